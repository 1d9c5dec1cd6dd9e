#!/usr/bin/env python3
"""Generate pdmesh's llama.cpp reference fixtures.

What it makes (both under tests/fixtures/, paths relative to the repository root):

* ``tokenizer_ids.json``: a list of strings, each with the token ids llama.cpp gives it
  (``Llama(model, vocab_only=True).tokenize(text.encode(), add_bos=False, special=True)``).
  pdmesh-tokenize's tests check that its GGUF-built tokenizer produces the same ids.
* ``reference.json``: for a handful of prompts (chat-template-rendered and raw text), the
  prompt token ids, llama.cpp's greedy continuation of 32 tokens (argmax of the raw logits,
  taken here with numpy: no sampler, no penalties, EOS is not a stop), and the top-5
  (token id, logit) pairs at the last prompt position and after each of the first 31
  generated tokens. Also the llama.cpp version and the model file's sha256.

How to run (a developer tool, never a runtime dependency of pdmesh):

    pip install numpy llama-cpp-python==0.3.36
    python3 scripts/reference/gen_reference.py --model PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf

``--model`` defaults to ``$PDMESH_MODEL`` or ``~/.cache/pdmesh/models/<default file>``.
Re-run it whenever the model, the string list or the prompt list changes, and commit the
two JSON files. Runs on CPU with n_threads=2 and n_ctx=2048 so results are comparable
with pdmesh's CPU engine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

N_CTX = 2048
N_THREADS = 2
N_GEN = 32
N_TOP = 5
N_TOP_POSITIONS = 31  # generated positions with a top-5 record (after the prompt's own)

# Strings the tokenizer must get exactly right. Keep each case's intent in its name.
TOKENIZER_CASES: list[tuple[str, str]] = [
    ("ascii", "Hello world"),
    ("sentence", "The quick brown fox jumps over the lazy dog."),
    ("leading_space", " leading space"),
    ("trailing_space", "trailing space "),
    ("spaces_both_ends", "  two leading and three trailing   "),
    ("single_space", " "),
    ("single_newline", "\n"),
    ("empty", ""),
    ("accents", "café naïve façade résumé Ångström ÀÉÎÕÜ"),
    ("cjk", "日本語のテキストと中文字符"),
    ("emoji", "Emoji: 😀🎉👍🏽"),
    ("emoji_zwj", "Family 👨‍👩‍👧‍👦, flag 🇺🇸, heart ❤️ and 🏳️‍🌈"),
    ("code_tabs", "def f(x):\n\tif x:\n\t\treturn x * 2\n    return None\n"),
    ("indented", "    indented with four spaces"),
    ("tsv", "tab\tseparated\tvalues\t\t"),
    ("space_runs", "a     b      c"),
    ("newline_runs", "line1\n\n\nline2\r\nline3\n \n"),
    ("trailing_ws_mix", "end  \n  "),
    ("digits", "1234567890 3.14159 -42 1,000,000 2024-01-01 x2y 007"),
    ("contractions", "I'm can't won't they're we've he'll she'd IT'S You'RE"),
    ("chatml_turn", "<|im_start|>user\nhi<|im_end|>"),
    (
        "chatml_prompt",
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    ),
    ("special_inline", "before<|endoftext|>after <|im_end|> x"),
    ("not_special", "<|im_start <im_end|> <|unknown|>"),
    ("mixed_scripts", "Mixed: English, русский, ελληνικά, العربية, हिन्दी, 한국어"),
    ("url", "https://example.com/path?query=1&x=y#frag"),
    ("json", '{"key": [1, 2, 3], "nested": {"a": null}}'),
    ("identifiers", "snake_case camelCase PascalCase SCREAMING_CASE"),
    ("punctuation", "Punctuation!!! ??? ... --- *** (a) [b] {c}"),
    ("math", "Math: ∑ x² ≤ ∞, α+β=γ"),
    ("nbsp_zwsp", "non\u00a0breaking and zero\u200bwidth"),
    ("fullwidth", "ＡＢＣ１２３　全角"),
]


def chat_prompts() -> list[dict]:
    return [
        {"name": "chat_capital", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {
            "name": "chat_system_haiku",
            "messages": [
                {"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "Write a haiku about the sea."},
            ],
        },
        {
            "name": "chat_multi_turn",
            "messages": [
                {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello! How can I help you today?"},
                {"role": "user", "content": "Tell me a fun fact about octopuses."},
            ],
        },
        {"name": "chat_recipe", "messages": [{"role": "user", "content": "How do I boil an egg?"}]},
    ]


RAW_PROMPTS: list[tuple[str, str]] = [
    ("raw_fox", "The quick brown fox"),
    ("raw_code", "def fibonacci(n):\n"),
    ("raw_story", "Once upon a time, in a land far away,"),
    ("raw_list", "Three primary colors are"),
]


def default_model() -> Path:
    env = os.environ.get("PDMESH_MODEL")
    if env:
        return Path(env)
    cache = os.environ.get("PDMESH_CACHE_DIR")
    if cache:
        base = Path(cache)
    elif os.environ.get("XDG_CACHE_HOME"):
        base = Path(os.environ["XDG_CACHE_HOME"]) / "pdmesh"
    else:
        base = Path.home() / ".cache" / "pdmesh"
    return base / "models" / DEFAULT_FILE


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def versions() -> dict:
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp": llama_cpp.llama_version().decode(),
    }


def write_json(path: Path, value: dict) -> None:
    text = json.dumps(value, ensure_ascii=False, indent=1)
    path.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(REPO)} ({len(text)} chars)")


def gen_tokenizer_ids(model: Path, meta: dict) -> None:
    llm = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    cases = []
    for name, text in TOKENIZER_CASES:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        cases.append({"name": name, "text": text, "ids": ids})
    write_json(FIXTURES / "tokenizer_ids.json", {**meta, "cases": cases})


def top_k(logits: np.ndarray, k: int) -> list[list]:
    # Stable sort on -logit: equal logits keep ascending id order, like a first-max argmax.
    order = np.argsort(-logits, kind="stable")[:k]
    return [[int(i), float(logits[i])] for i in order]


def last_logits(llm: llama_cpp.Llama) -> np.ndarray:
    """The raw logits of the last evaluated position, straight from llama.cpp's context
    (llama-cpp-python only mirrors them into ``llm.scores`` with logits_all=True)."""
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float32, copy=True)


def gen_reference(model: Path, meta: dict) -> None:
    llm = llama_cpp.Llama(
        str(model), n_ctx=N_CTX, n_threads=N_THREADS, n_threads_batch=N_THREADS, verbose=False
    )
    md = llm.metadata
    vocab = llama_cpp.llama_model_get_vocab(llm.model)

    def piece(i: int) -> str:
        return llama_cpp.llama_vocab_get_text(vocab, i).decode("utf-8", "replace")

    bos = piece(int(md["tokenizer.ggml.bos_token_id"]))
    eos = piece(int(md["tokenizer.ggml.eos_token_id"]))
    fmt = Jinja2ChatFormatter(md["tokenizer.chat_template"], eos_token=eos, bos_token=bos)

    prompts = []
    for p in chat_prompts():
        text = fmt(messages=p["messages"]).prompt
        prompts.append({"name": p["name"], "kind": "chat", "messages": p["messages"], "text": text})
    for name, text in RAW_PROMPTS:
        prompts.append({"name": name, "kind": "raw", "text": text})

    eog = [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    out = []
    for p in prompts:
        ids = llm.tokenize(p["text"].encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        generated: list[int] = []
        tops = []
        for step in range(N_GEN):
            logits = last_logits(llm)
            if step <= N_TOP_POSITIONS:
                tops.append(top_k(logits, N_TOP))
            tok = int(np.argmax(logits))
            generated.append(tok)
            if step + 1 < N_GEN:
                llm.eval([tok])
        text = llm.detokenize(generated, special=True).decode("utf-8", "replace")
        out.append(
            {
                **p,
                "prompt_ids": ids,
                "greedy_ids": generated,
                "greedy_text": text,
                "top5": tops,
            }
        )
        print(f"{p['name']}: {len(ids)} prompt tokens -> {text!r}")
    write_json(
        FIXTURES / "reference.json",
        {
            **meta,
            "n_ctx": N_CTX,
            "n_threads": N_THREADS,
            "n_gen": N_GEN,
            "eog_token_ids": eog,
            "top5_note": "top5[0] = logits at the last prompt position (predicting greedy_ids[0]); "
            "top5[i] = logits after feeding greedy_ids[i-1] (predicting greedy_ids[i]); "
            "pairs are [token_id, logit], highest first",
            "prompts": out,
        },
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF model file")
    args = ap.parse_args()
    model = args.model or default_model()
    if not model.is_file():
        print(f"model file {model} is missing (pass --model or set PDMESH_MODEL)", file=sys.stderr)
        return 2
    FIXTURES.mkdir(parents=True, exist_ok=True)
    meta = {
        "generated_by": "scripts/reference/gen_reference.py",
        "model_file": model.name,
        "model_sha256": sha256(model),
        **versions(),
    }
    gen_tokenizer_ids(model, meta)
    gen_reference(model, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())

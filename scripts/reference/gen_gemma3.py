#!/usr/bin/env python3
"""Generate pdmesh's llama.cpp reference fixtures for Gemma 3 (270M, Q4_K_M).

What it makes (under tests/fixtures/, paths relative to the repository root):

* ``gemma3_tokenizer_ids.json``: strings with the token ids llama.cpp gives them
  (``tokenize(text, add_bos=False, special=True)``) and the text it decodes them to
  (``detokenize(ids, special=True)``): byte fallback, whitespace runs (the vocabulary's
  user-defined space and newline runs), scripts, digits, control tokens.
* ``gemma3_reference.json``: eight raw-text prompts (Gemma 3 270M is a base model: no chat
  template), three of them longer than the 512-token sliding window (about 1,500 tokens),
  each with its prompt ids (BOS first, as the GGUF asks), llama.cpp's greedy continuation
  of 32 tokens (argmax of the raw logits), the top-5 (token id, logit) pairs at every
  step and the smallest top-2 margin met. The prompts are chosen so that margin stays
  clear of the two implementations' rounding differences (this small model meets
  near-ties often: "The capital of France is" has one of 0.03 at its twelfth token).

How to run (a developer tool, never a runtime dependency of pdmesh):

    pip install numpy llama-cpp-python==0.3.36
    pdmesh model fetch gemma3-270m
    python3 scripts/reference/gen_gemma3.py --model PATH/TO/gemma-3-270m-q4_k_m.gguf

Re-run it whenever the model or the lists change, and commit the two JSON files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_reference import FIXTURES, last_logits, sha256, top_k, versions, write_json  # noqa: E402

N_CTX = 4096
N_THREADS = 2
N_GEN = 32
N_TOP = 5

TOKENIZER_CASES: list[tuple[str, str]] = [
    ("ascii", "Hello world"),
    ("sentence", "The quick brown fox jumps over the lazy dog."),
    ("leading_space", " leading space"),
    ("trailing_space", "trailing space "),
    ("single_space", " "),
    ("empty", ""),
    ("space_runs", "a  b   c    d     e" + " " * 40 + "f"),
    ("newline_runs", "line1\n\n\nline2\r\nline3\n \n" + "\n" * 35 + "end"),
    ("tab_runs", "tab\tseparated\t\tvalues\t\t\t\tx"),
    ("code", "def f(x):\n    if x:\n        return x * 2\n    return None\n"),
    ("accents", "café naïve façade résumé Ångström ÀÉÎÕÜ"),
    ("cjk", "日本語のテキストと中文字符"),
    ("emoji", "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇺🇸"),
    # Characters the vocabulary lacks: each becomes its UTF-8 bytes' <0xNN> tokens.
    ("byte_fallback", "private \U000f0001\U00100000 use, control \x01\x02\x7f, ancient 𓀀𐎀"),
    ("digits", "1234567890 3.14159 -42 1,000,000 2024-01-01 x2y 007"),
    ("contractions", "I'm can't won't they're we've he'll she'd"),
    ("control_tokens", "<start_of_turn>user\nhi<end_of_turn>\n<bos>x<eos>"),
    ("not_control", "<start_of_turn <end_of_turn> <unused99x>"),
    ("mixed_scripts", "English, русский, ελληνικά, العربية, हिन्दी, 한국어"),
    ("url_json", 'https://example.com/p?q=1&x=y#f {"key": [1, 2], "n": {"a": null}}'),
    ("html", "<table><tr><td>cell</td></tr></table> <h1>Title</h1>"),
    ("nbsp_zwsp", "non\u00a0breaking and zero\u200bwidth"),
    ("fullwidth", "ＡＢＣ１２３　全角"),
    ("underscore_marker", "▁already▁marked and __dunder__"),
    # Text that spells a byte token is plain text, not that byte.
    ("byte_token_text", "<0x41> <0xE2><0x82><0xAC> <0x0A>"),
    # Adjacent user-defined runs of different whitespace, and single spaces between them.
    ("mixed_whitespace", "a \n b  \n  c\t \t\n\t\n  \t d \r\n\r\n e"),
    # User-defined tokens that are not whitespace (HTML tags, multimodal markers) and
    # control tokens that are not chat markers.
    ("user_defined_tags", "[multimodal]<start_of_image><end_of_image><b>bold</b> <td><unused0><mask>"),
    # Runs of one character: many equal-score merges, resolved leftmost first.
    ("repeated_chars", "aaaaaaaaaaaaaaaaaaaaaaa ---------------- ======== ........ !!!!!!! ____ 0000000"),
    ("long_word", "Pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism"),
]

FACTS = [
    "The lighthouse keeper on Marrow Island logs the weather every morning at six.",
    "Copper wire conducts electricity well because its electrons move freely.",
    "In the old library, the rare maps are kept in a climate-controlled vault.",
    "Honeybees communicate the location of flowers with a waggle dance.",
    "The river that runs through the valley freezes only in the coldest winters.",
    "A well-tuned bicycle chain should be cleaned and oiled every few hundred miles.",
    "The orchestra rehearses on Tuesdays and performs on the first Saturday of the month.",
    "Granite forms when magma cools slowly deep beneath the surface of the earth.",
    "The bakery on Elm Street sells out of rye bread before noon most days.",
    "Migrating geese fly in a V formation to save energy on long journeys.",
    "The museum's newest exhibit features pottery from an ancient trading port.",
    "Tidal pools host anemones, small crabs and the occasional starfish.",
]


def long_text(seed: int, sentences: int) -> str:
    """A deterministic passage of `sentences` sentences drawn from FACTS."""
    out, s = [], seed
    for i in range(sentences):
        s = (s * 1103515245 + 12345) % (1 << 31)
        out.append(f"{i + 1}. {FACTS[s % len(FACTS)]}")
    return "\n".join(out)


def prompts() -> list[tuple[str, str]]:
    return [
        ("fox", "The quick brown fox"),
        ("story", "Once upon a time, in a land far away,"),
        ("code", "def fibonacci(n):\n"),
        ("weekdays", "Monday, Tuesday, Wednesday,"),
        ("list", "Three primary colors are"),
        # Longer than the sliding window: the local layers see only the last 512 tokens.
        ("long_notes", long_text(7, 90) + "\n\nIn summary, the notes above describe"),
        ("long_counting", " ".join(str(i) for i in range(1, 700)) + " "),
        (
            "long_recall",
            "Remember this code word: PELICAN.\n\n"
            + long_text(11, 85)
            + "\n\nThe code word mentioned at the very beginning was",
        ),
    ]


def gen_tokenizer_ids(model: Path, meta: dict) -> None:
    llm = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    cases = []
    for name, text in TOKENIZER_CASES:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        # What llama.cpp prints for those ids: the text, except that a literal "▁" in it
        # comes back as a space.
        decoded = llm.detokenize(ids, special=True).decode("utf-8")
        cases.append({"name": name, "text": text, "ids": ids, "decoded": decoded})
    write_json(FIXTURES / "gemma3_tokenizer_ids.json", {**meta, "cases": cases})


def gen_reference(model: Path, meta: dict) -> None:
    llm = llama_cpp.Llama(
        str(model), n_ctx=N_CTX, n_threads=N_THREADS, n_threads_batch=N_THREADS, verbose=False
    )
    out = []
    for name, text in prompts():
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        generated: list[int] = []
        tops = []
        margin = float("inf")
        for step in range(N_GEN):
            logits = last_logits(llm)
            tops.append(top_k(logits, N_TOP))
            margin = min(margin, tops[-1][0][1] - tops[-1][1][1])
            tok = int(np.argmax(logits))
            generated.append(tok)
            if step + 1 < N_GEN:
                llm.eval([tok])
        cont = llm.detokenize(generated, special=True).decode("utf-8", "replace")
        out.append(
            {
                "name": name,
                "text": text,
                "prompt_ids": ids,
                "greedy_ids": generated,
                "greedy_text": cont,
                "min_margin": margin,
                "top5": tops,
            }
        )
        print(f"{name}: {len(ids)} prompt tokens, min top-2 margin {margin:.3f} -> {cont!r}")
    write_json(
        FIXTURES / "gemma3_reference.json",
        {
            **meta,
            "n_ctx": N_CTX,
            "n_threads": N_THREADS,
            "n_gen": N_GEN,
            "top5_note": "top5[i] = the logits predicting greedy_ids[i]; pairs are [token_id, logit], highest first",
            "prompts": out,
        },
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="gemma-3-270m-q4_k_m.gguf")
    args = ap.parse_args()
    if not args.model.is_file():
        print(f"model file {args.model} is missing", file=sys.stderr)
        return 2
    FIXTURES.mkdir(parents=True, exist_ok=True)
    meta = {
        "generated_by": "scripts/reference/gen_gemma3.py",
        "model_file": args.model.name,
        "model_sha256": sha256(args.model),
        **versions(),
    }
    gen_tokenizer_ids(args.model, meta)
    gen_reference(args.model, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())

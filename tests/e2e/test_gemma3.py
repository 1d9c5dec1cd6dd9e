"""Gemma 3 270M, a base model whose GGUF has no chat template, through `pdmesh up
--model`: greedy completions continue as llama.cpp's do, and chat requests are served
once `--chat-template` gives the template the GGUF lacks, its BOS included. (Without one,
chat is a 400 naming the fix: cli/tests/mesh/gateway_api/errors.rs tests that, with no
second mesh.)

The model is $PDMESH_GEMMA3_MODEL, else the copy `pdmesh model fetch gemma3-270m` puts in
the cache.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import API_KEY, http, start_up, stop_up

# What the template below makes of one user turn: `bos_token` is the model's BOS text.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
QUESTION = "What day comes after Monday?"


def rendered(bos: str) -> str:
    return f"{bos}user: {QUESTION}\nassistant:"


def gemma3_model() -> Path:
    """$PDMESH_GEMMA3_MODEL, else the cached copy (the cache as `pdmesh` finds it)."""
    if os.environ.get("PDMESH_GEMMA3_MODEL"):
        return Path(os.environ["PDMESH_GEMMA3_MODEL"])
    cache = os.environ.get("PDMESH_CACHE_DIR")
    if not cache and os.environ.get("XDG_CACHE_HOME"):
        cache = Path(os.environ["XDG_CACHE_HOME"]) / "pdmesh"
    cache = Path(cache or Path.home() / ".cache" / "pdmesh")
    return cache / "models" / "gemma-3-270m-q4_k_m.gguf"


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    model = gemma3_model()
    if not model.is_file():
        pytest.fail(f"{model} is missing: run `pdmesh model fetch gemma3-270m` (or set PDMESH_GEMMA3_MODEL)",
                    pytrace=False)
    tmp = tmp_path_factory.mktemp("gemma3")
    template = tmp / "chat.jinja"
    template.write_text(TEMPLATE)
    mesh = start_up(tmp, ["--model", str(model), "--chat-template", str(template), "--no-smoke-test"])
    yield mesh
    code = stop_up(mesh)
    assert code == 0, f"pdmesh up exited with {code} on SIGTERM:\n{mesh.log()}"


def tokenize(mesh, body: dict) -> list[int]:
    status, out = http("POST", mesh.base + "/tokenize", json.dumps(body).encode(),
                       {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    assert status == 200, out
    return json.loads(out)["tokens"]


def test_greedy_completion_continues_the_week_as_llama_cpp_does(gemma):
    out = gemma.client().completions.create(model=gemma.model, prompt="Monday, Tuesday, Wednesday,",
                                            max_tokens=16, temperature=0)
    text = out.choices[0].text
    assert text.startswith(" Thursday, Friday, Saturday, Sunday"), repr(text)
    assert out.usage.completion_tokens == 16, out.usage


def test_chat_renders_through_the_given_template_with_bos(gemma):
    messages = [{"role": "user", "content": QUESTION}]
    ids = tokenize(gemma, {"model": gemma.model, "messages": messages})
    # The template's text, BOS first, is exactly what chat requests run.
    bos = tokenize(gemma, {"model": gemma.model, "prompt": "", "add_special_tokens": True})
    assert len(bos) == 1, bos
    assert ids == tokenize(gemma, {"model": gemma.model, "prompt": rendered("<bos>"), "add_special_tokens": False})
    assert ids[0] == bos[0] and ids.count(bos[0]) == 1, ids

    out = gemma.client().chat.completions.create(model=gemma.model, messages=messages, max_tokens=8,
                                                 temperature=0)
    assert out.usage.prompt_tokens == len(ids), out.usage
    content = out.choices[0].message.content
    assert content and content.strip(), out

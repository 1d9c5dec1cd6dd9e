"""Tensor parallelism through the whole mesh, and GPU flags refused clearly by a build
without CUDA.

`--tp 3` splits SmolLM2's three KV heads (and every matrix's rows) over three ranks that
all-gather their results; the answers must be the single-rank mesh's, character for
character, through the real gateway and tokenizer."""

from __future__ import annotations

import os
import secrets
import subprocess

from conftest import WORKER_ARGS, pdmesh_bin, start_up, stop_up

PROMPTS = [
    "Name three rivers in Europe.",
    "Write a haiku about tensor parallelism.",
    "What is 17 times 23? Explain step by step.",
]


def answers(mesh) -> list[str]:
    client = mesh.client()
    out = []
    for p in PROMPTS:
        r = client.chat.completions.create(
            model=mesh.model,
            messages=[{"role": "user", "content": p}],
            max_tokens=48,
            temperature=0,
        )
        assert r.choices[0].finish_reason in ("stop", "length"), r
        out.append(r.choices[0].message.content)
    return out


def test_tp3_answers_equal_the_single_rank_mesh(mesh, tmp_path):
    want = answers(mesh)
    assert all(want), want
    tp = start_up(tmp_path, ["--unified", *(f"--worker-arg={a}" for a in [*WORKER_ARGS, "--tp=3"])])
    try:
        assert answers(tp) == want
        assert "tensor parallelism" in tp.log(), tp.log()
    finally:
        assert stop_up(tp) == 0, tp.log()


def test_gpu_flags_are_refused_by_name():
    cases = [
        (["--device", "cuda"], "built without the CUDA backend"),
        (["--gpus", "0"], "need --device cuda"),
        (["--tp", "4"], "at most 3"),
    ]
    for args, want in cases:
        r = subprocess.run(
            [str(pdmesh_bin()), "worker", "--listen", "127.0.0.1:0", *args],
            env=dict(os.environ, PDMESH_MESH_TOKEN=secrets.token_hex(32)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode != 0, (args, r.stdout, r.stderr)
        assert want in r.stdout + r.stderr, (args, r.stdout, r.stderr)

#!/usr/bin/env python3
"""PD vs unified on the default model: starts `pdmesh up` in both modes, streams chat
completions at each concurrency and reports TTFT p50/p99, inter-token latency p50 and
output throughput per mode, and the PD/unified ratios.

    python3 scripts/bench/pd_vs_unified.py [--conc 1,16,64] [--requests 32] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
# Ports for the programs that cannot bind port 0 (smg, llama.cpp's server).
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
import ports as fixed_ports  # noqa: E402,F401
PROMPT = "Summarize: " + " ".join(f"Fact {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i} coins." for i in range(40))


def up(extra: list[str], env: dict | None = None):
    tmp = Path(tempfile.mkdtemp())
    ports = tmp / "ports.json"
    proc = subprocess.Popen(
        [os.environ.get("PDMESH_BIN", str(ROOT / "target/release/pdmesh")), "up", "--port", "0",
         "--ports-json", str(ports), "--no-smoke-test", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, **(env or {})),
    )
    while not ports.exists():
        if proc.poll() is not None:
            sys.exit(f"pdmesh up {extra} exited with {proc.returncode}")
        time.sleep(0.2)
    return proc, json.loads(ports.read_text())


def one(client, i: int, max_tokens: int):
    t0 = time.perf_counter()
    stamps = []
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", stream=True, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "user", "content": f"{PROMPT} ({i})"}],
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return ttft, itl, len(stamps), stamps[-1] - t0


def measure(one, conc: int, n: int, max_tokens: int, offset: int = 0) -> dict:
    """`n` requests of `one(i, max_tokens)` (prompt `i`: its TTFT, its ITLs, its tokens
    and its total time) at `conc`, after one to warm up; prompts are numbered from
    `offset`, so runs that must not find each other's prompts in the prefix cache use
    different offsets."""
    one(-1, 4)  # warm
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(conc) as pool:
        res = list(pool.map(lambda i: one(offset + i, max_tokens), range(n)))
    wall = time.perf_counter() - t0
    ttft = sorted(r[0] for r in res)
    itl = sorted(x for r in res for x in r[1])
    q = lambda v, p: v[min(len(v) - 1, int(p * len(v)))]
    return {"ttft_p50": q(ttft, 0.5), "ttft_p99": q(ttft, 0.99), "itl_p50": q(itl, 0.5) if itl else 0.0,
            "tok_s": sum(r[2] for r in res) / wall}


def run(url: str, conc: int, n: int, max_tokens: int, offset: int = 0):
    """[`measure`] through the OpenAI API at `url`."""
    client = openai.OpenAI(base_url=url, api_key="bench", max_retries=0, timeout=600)
    return measure(lambda i, max_t: one(client, i, max_t), conc, n, max_tokens, offset)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conc", default="1,16,64")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    out = {}
    for mode, extra in (("unified", ["--unified"]), ("pd", [])):
        proc, ports = up(extra)
        try:
            for c in map(int, a.conc.split(",")):
                out[(mode, c)] = run(ports["url"], c, max(a.requests, c), a.max_tokens)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    print(f"{'conc':>4} {'mode':>8} {'ttft_p50':>9} {'ttft_p99':>9} {'itl_p50':>8} {'tok/s':>7}")
    for c in map(int, a.conc.split(",")):
        for mode in ("unified", "pd"):
            r = out[(mode, c)]
            print(f"{c:>4} {mode:>8} {r['ttft_p50']*1000:>8.1f}ms {r['ttft_p99']*1000:>8.1f}ms {r['itl_p50']*1000:>7.1f}ms {r['tok_s']:>7.1f}")
        u, p = out[("unified", c)], out[("pd", c)]
        print(f"{c:>4} {'pd/unif':>8} {p['ttft_p50']/u['ttft_p50']:>9.2f}x {p['ttft_p99']/u['ttft_p99']:>8.2f}x "
              f"{(p['itl_p50']/u['itl_p50'] if u['itl_p50'] else 0):>7.2f}x {p['tok_s']/u['tok_s']:>7.2f}x")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""TTFT of a 2k-token prompt: prefill and decode on two hosts (network namespaces, the KV
crossing between the hosts' cache services over the tcp page transport) beside
prefill and decode on one host (`pdmesh up`, the KV through shared memory), same binary,
same model, same run. Every prompt starts differently, so no prefix cache helps. Prints
TTFT p50 per concurrency for both and their ratio. Needs root and iproute2.

    cargo build --release -p pdmesh-cli
    sudo python3 scripts/bench/hosts_ttft.py [--tokens 2048] [--conc 1,16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from conftest import start_up, stop_up  # noqa: E402
from hosts import Hosts  # noqa: E402

FILLER = " ".join(f"Note {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} crate weighs {i * 3 % 97} kilograms." for i in range(400))


def prompt(n: int, tokens: int) -> str:
    # ~14 tokens per note: cut to about `tokens` tokens, a unique head for every request.
    notes = FILLER.split(". ")[: max(1, tokens // 14)]
    return f"Request {n} of the benchmark, read carefully. " + ". ".join(notes) + ". Which crate is heaviest?"


def ttft(client, model: str, text: str) -> float:
    t0 = time.monotonic()
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], max_tokens=4, temperature=0, stream=True)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - t0
    return first if first is not None else time.monotonic() - t0


def measure(submit, client, model: str, conc: int, rounds: int, tokens: int, base: int) -> list[float]:
    out = []
    for r in range(rounds):
        futs = [submit(ttft, client, model, prompt(base + r * conc + i, tokens)) for i in range(conc)]
        out += [f.result() for f in futs]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--conc", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    # On a small CPU a wave of long prompts outlasts the default hand-over deadline.
    ap.add_argument("--transfer-timeout-ms", type=int, default=600_000)
    # A wave of sixteen 2k-token prompts on two cores takes minutes to answer.
    ap.add_argument("--client-timeout-s", type=float, default=1800)
    args = ap.parse_args()
    concs = [int(c) for c in args.conc.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="pdmesh-bench-ttft-"))
    (tmp / "one").mkdir()
    # A wave may also hold more prompt tokens than decode's KV pool: later ones wait for
    # pages (that wait is part of their TTFT on both meshes) instead of being refused.
    wargs = [f"--transfer-timeout-ms={args.transfer_timeout_ms}", f"--admission-timeout-ms={args.transfer_timeout_ms}"]
    # ... and the cache service's deadline for a room waiting on its prompt's prefill.
    cargs = [f"--room-wait-ms={args.transfer_timeout_ms}"]
    one = start_up(tmp / "one", ["--no-smoke-test", *(f"--worker-arg={a}" for a in wargs), *(f"--cache-arg={a}" for a in cargs)])
    hosts = Hosts(tmp / "hosts", short_deadlines=False, worker_args=wargs, cache_args=cargs)
    try:
        local = cf.ThreadPoolExecutor(64)
        c1, c2 = (c.with_options(timeout=args.client_timeout_s) for c in (one.client(), hosts.openai()))
        # Warm both (model pages in memory, connections up).
        measure(local.submit, c1, one.model, 1, 1, args.tokens, 10**6)
        measure(hosts.client.submit, c2, one.model, 1, 1, args.tokens, 2 * 10**6)
        print(f"TTFT p50 of a {args.tokens}-token prompt (no prefix cache hits), seconds:")
        for conc in concs:
            a = measure(local.submit, c1, one.model, conc, args.rounds, args.tokens, 100 * conc)
            b = measure(hosts.client.submit, c2, one.model, conc, args.rounds, args.tokens, 100 * conc + 50_000)
            pa, pb = statistics.median(a), statistics.median(b)
            print(f"  concurrency {conc:>3}: one host {pa:.3f}  across hosts {pb:.3f}  ratio {pb / pa:.2f}", flush=True)
        m = hosts.metrics()
        moved = m['mesh_kv_peer_bytes_total{direction="received"}']
        print(f"  KV moved between hosts: {moved / 1e6:.1f} MB")
    finally:
        hosts.stop()
        stop_up(one)


if __name__ == "__main__":
    main()

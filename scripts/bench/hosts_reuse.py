#!/usr/bin/env python3
"""KV bytes crossing between hosts per turn of the `sessions` workload (multi-turn agentic
sessions: a shared system prompt, tools, tool results), with decode's prefix reuse and
without it, on the three-host mesh of the multi-host tests (network namespaces, prefill
and decode on different hosts).

Decode tells the sender how many leading pages it holds; those do not travel. The bytes
that would have travelled without reuse are the ones that did plus the pages decode held
(`mesh_kv_held_pages_skipped_total`) times the page size: the end-to-end prefix-reuse test
checks exactly that equality against a decode worker with an empty cache. Prints both per
turn and their ratio. Needs root and iproute2.

    cargo build --release -p pdmesh-cli
    sudo python3 scripts/bench/hosts_reuse.py [--sessions 16] [--turns 4] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from conftest import API_KEY  # noqa: E402
from hosts import Hosts  # noqa: E402

# SmolLM2-135M's KV page: 30 layers, K and V, 3 heads x 64 f16, 16 tokens.
PAGE_BYTES = 30 * 2 * 192 * 2 * 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    pdmesh = ROOT / "target" / "release" / "pdmesh"
    if not pdmesh.is_file():
        sys.exit(f"{pdmesh} is missing: build it first (see this script's docstring)")
    tmp = Path(tempfile.mkdtemp(prefix="pdmesh-bench-reuse-"))
    h = Hosts(tmp / "hosts", short_deadlines=False)
    try:
        key = lambda m, name: m.get(name, 0.0)
        before = h.metrics()
        r = subprocess.run(h.net.exec_argv("gw", [
            str(pdmesh), "bench", "--url", f"{h.base}/v1", "--api-key", API_KEY, "--workload", "sessions",
            "--concurrency", str(args.concurrency), "--requests", str(args.sessions), "--turns", str(args.turns),
            "--output-len", str(args.output_len), "--out", str(tmp / "report")]), capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            sys.exit(f"pdmesh bench failed:\n{r.stdout}\n{r.stderr}")
        after = h.metrics()
        report = json.loads((tmp / "report" / "report.json").read_text())
        h.assert_baseline()
    finally:
        h.stop()
    moved = key(after, 'mesh_kv_peer_bytes_total{direction="received"}') - key(before, 'mesh_kv_peer_bytes_total{direction="received"}')
    held = key(after, 'mesh_kv_held_pages_skipped_total{tier="host"}') - key(before, 'mesh_kv_held_pages_skipped_total{tier="host"}')
    turns = args.sessions * args.turns
    without = moved + held * PAGE_BYTES
    print(json.dumps({"turns": turns, "bytes_moved": moved, "pages_held": held, "bytes_without_reuse": without,
                      "errors": [lvl["errors"] for series in report for lvl in series["levels"]]}))
    print(f"sessions workload, {args.sessions} sessions x {args.turns} turns at concurrency {args.concurrency}:")
    print(f"  with decode prefix reuse:    {moved / turns / 1e6:.2f} MB per turn")
    print(f"  without (all prompt pages):  {without / turns / 1e6:.2f} MB per turn")
    print(f"  ratio {moved / without:.2f}" if without else "  nothing moved")


if __name__ == "__main__":
    main()

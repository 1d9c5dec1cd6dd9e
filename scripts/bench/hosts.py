#!/usr/bin/env python3
"""KV moved between hosts, beside iperf3 over the same link in the same run.

Makes two hosts (network namespaces joined by veth pairs and a bridge, as the multi-host
tests do), starts a cache service on each, and times rooms of 64 pages moved from the
first host's cache service to the second's (`examples/bench_hosts.rs`: written to A's
mirror, committed, moved over the tcp page transport, committed at B, taken by B's
receiver) for SmolLM2's layout and deepseek-v32-tiny's, one room at a time and several
committed at once (`--rooms`), and one room of twice the pages (a 2k-token prompt at the
default 64: with small pages a room's fixed cost, the worker's commit call and the hops
between the processes, weighs less there). Then iperf3 over the same link.
Prints each transfer's GB/s, iperf3's, and their ratio. Needs root, iproute2 and iperf3.

    cargo build --release -p pdmesh-cli && cargo build --release -p pdmesh-cache --example bench_hosts
    sudo python3 scripts/bench/hosts.py [--pages 64] [--rounds 60] [--rooms 1,4]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from netns import Net  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=60)  # medians of 15 swing on a noisy machine
    ap.add_argument("--iperf-seconds", type=int, default=5)
    ap.add_argument("--rooms", default="1,4", help="rooms committed at once per round (comma-separated levels)")
    args = ap.parse_args()
    pdmesh = ROOT / "target" / "release" / "pdmesh"
    bench = ROOT / "target" / "release" / "examples" / "bench_hosts"
    for p in (pdmesh, bench):
        if not p.is_file():
            sys.exit(f"{p} is missing: build it first (see this script's docstring)")
    net = Net(["a", "b"])
    procs = []
    tmp = Path(tempfile.mkdtemp(prefix="pdmesh-bench-hosts-"))
    try:
        urls = {h: f"http://{net.addr[h]}:7100" for h in ("a", "b")}
        out = {}
        for layout in ("smol", "deepseek-tiny"):
            # A mirror takes the layout of its first worker: fresh services per layout.
            procs = []
            for h in ("a", "b"):
                log = open(tmp / f"cache-{h}-{layout}.log", "wb")
                argv = [str(pdmesh), "cache", "--listen", f"{net.addr[h]}:7100", "--host-mirror-size", "1GiB"]
                procs.append(subprocess.Popen(net.exec_argv(h, argv), stdout=log, stderr=subprocess.STDOUT))
            time.sleep(0.5)  # let both bind; bench_hosts fails loudly if one did not
            runs = [(args.pages, rooms) for rooms in args.rooms.split(",")] + [(2 * args.pages, "1")]
            for pages, rooms in runs:
                r = subprocess.run(net.exec_argv("a", [str(bench), layout, str(pages), str(args.rounds), urls["a"], urls["b"], rooms]), capture_output=True, text=True, timeout=600)
                if r.returncode != 0:
                    stop(procs)
                    sys.exit(f"bench_hosts {layout} failed:\n{r.stderr}\n" + "\n".join(p.read_text() for p in tmp.glob("*.log")))
                out[f"{layout} {pages}p x{rooms}"] = json.loads(r.stdout.strip().splitlines()[-1])
                print(layout, pages, rooms, r.stderr.strip().splitlines()[-1], file=sys.stderr)
            stop(procs)
        server = subprocess.Popen(net.exec_argv("b", ["iperf3", "-s", "-1", "-B", net.addr["b"]]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
        r = subprocess.run(net.exec_argv("a", ["iperf3", "-c", net.addr["b"], "-t", str(args.iperf_seconds), "-J"]), capture_output=True, text=True, timeout=120)
        server.wait(timeout=30)
        iperf = json.loads(r.stdout)["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
        print(json.dumps({"iperf3_gbytes_per_s": round(iperf, 3), **{k: v for k, v in out.items()}}))
        for v in out.values():
            print(f"{v['layout']}: {v['rooms']} room(s) at once of {v['pages']} pages x {v['page_bytes']} B: {v['gbytes_per_s']:.2f} GB/s; iperf3 {iperf:.2f} GB/s; ratio {v['gbytes_per_s'] / iperf:.2f}")
    finally:
        stop(procs)
        net.remove()


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


if __name__ == "__main__":
    main()

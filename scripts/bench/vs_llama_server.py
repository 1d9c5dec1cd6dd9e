#!/usr/bin/env python3
"""pdmesh against llama.cpp's server on the same GGUF, in one run: starts `pdmesh up`
(disaggregated, the default) and then `llama-server`, drives each with the same
`pdmesh bench` workload and concurrency sweep, one after the other so they never share
the CPU, and writes one combined report (plots and ratios) with `pdmesh bench compare`.

llama-server is llama.cpp's own HTTP server. A dev-only way to build it from the sources
llama-cpp-python vendors (pip and cmake from PyPI, no other download):

    pip install cmake scikit-build-core
    pip download llama-cpp-python==0.3.36 --no-deps --no-binary llama-cpp-python \\
        --no-build-isolation -d /tmp/llsrc && cd /tmp/llsrc && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DCMAKE_BUILD_TYPE=Release \\
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF && cmake --build build --target llama-server -j

    python3 scripts/bench/vs_llama_server.py --llama-server PATH/build/bin/llama-server \\
        [--concurrency 1,4,16,64] [--requests 64] [--input-len 256] [--output-len 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_vs_unified import ROOT, free_port, up  # noqa: E402

PDMESH = os.environ.get("PDMESH_BIN", str(ROOT / "target/release/pdmesh"))


def default_model() -> Path:
    return Path(os.environ.get("PDMESH_CACHE_DIR", Path.home() / ".cache/pdmesh")) / "models/SmolLM2-135M-Instruct.Q4_1.gguf"


def bench(url: str, label: str, out: Path, a) -> None:
    cmd = [PDMESH, "bench", "--url", url, "--label", label, "--workload", a.workload,
           "--concurrency", a.concurrency, "--requests", str(a.requests),
           "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--out", str(out)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"{url} not ready after {timeout}s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    ap.add_argument("--model", type=Path, default=default_model())
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--workload", default="random")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", type=Path, default=Path("bench-vs-llama-server"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    slots = max(int(c) for c in a.concurrency.split(","))

    proc, ports = up([])
    try:
        bench(ports["url"], "pdmesh", a.out / "pdmesh", a)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)

    port = free_port()
    # One slot per request in flight (continuous batching across them), each with room for
    # a prompt and its answer.
    ctx = slots * (a.input_len * 2 + a.output_len + 64)
    server = subprocess.Popen(
        [a.llama_server, "-m", str(a.model), "--host", "127.0.0.1", "--port", str(port),
         "-t", str(a.threads), "-np", str(slots), "-c", str(ctx), "--jinja"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", server)
        bench(f"http://127.0.0.1:{port}/v1", "llama.cpp", a.out / "llama-server", a)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)

    subprocess.run([PDMESH, "bench", "compare", str(a.out / "pdmesh/report.json"),
                    str(a.out / "llama-server/report.json"), "--out", str(a.out / "both")], check=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Gateway overhead: one unified pdmesh worker driven three ways with the same streamed
greedy chat workload: straight over gRPC (pdmesh.worker.v1 Generate with the prompt's
token ids, no gateway at all), through pdmesh's gateway, and through the smg gateway
speaking SGLang's scheduler protocol. Reports TTFT p50/p99, inter-token latency and
throughput per concurrency, and each gateway's added TTFT and throughput ratio against
the direct call.

    pip install smg==1.13.0 grpcio-tools
    python3 scripts/bench/gateway_overhead.py [--conc 1,8] [--requests 32] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import importlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_vs_unified import PROMPT, ROOT, fixed_ports, measure, run, up  # noqa: E402


def stubs():
    """pdmesh's own worker and tokenizer protos compiled for Python, in a temp dir."""
    from grpc_tools import protoc

    out = tempfile.mkdtemp()
    include = str(Path(protoc.__file__).parent / "_proto")
    for p in ("pdmesh/worker/v1/worker.proto", "pdmesh/tokenizer/v1/tokenizer.proto", "pdmesh/cache/v1/cache.proto"):
        rc = protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={out}",
                          f"--grpc_python_out={out}", p])
        if rc != 0:
            sys.exit(f"protoc failed on {p}")
    sys.path.insert(0, out)
    mods = {}
    for name in ("pdmesh.worker.v1.worker_pb2", "pdmesh.worker.v1.worker_pb2_grpc",
                 "pdmesh.tokenizer.v1.tokenizer_pb2", "pdmesh.tokenizer.v1.tokenizer_pb2_grpc"):
        mods[name.rsplit(".", 1)[1]] = importlib.import_module(name)
    return mods


def direct(ports: dict, conc: int, n: int, max_tokens: int, offset: int):
    import grpc

    m = stubs()
    tok = m["tokenizer_pb2_grpc"].TokenizerStub(grpc.insecure_channel(f"127.0.0.1:{ports['tokenizer']}"))
    worker = m["worker_pb2_grpc"].WorkerStub(grpc.insecure_channel(f"127.0.0.1:{ports['worker']}"))
    wpb, tpb = m["worker_pb2"], m["tokenizer_pb2"]

    def ids(i: int):
        msg = tpb.ChatMessage(role=b"user", content=f"{PROMPT} ({i})".encode())
        return list(tok.ApplyChatTemplate(tpb.ChatTemplateRequest(messages=[msg], add_generation_prompt=True)).ids)

    # Tokenized before timing, as a gateway's tokenizer cache would have them.
    prompts = {i: ids(i) for i in [-1, *range(offset, offset + n)]}

    def one(i: int, max_t: int):
        t0 = time.perf_counter()
        stamps = []
        sp = wpb.SamplingParams(temperature=0.0, max_tokens=max_t, ignore_eos=True)
        for r in worker.Generate(wpb.GenerateRequest(request_id=f"d{i}-{time.time_ns()}", input_ids=prompts[i], sampling=sp)):
            if r.HasField("chunk"):
                stamps.append(time.perf_counter())
        return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], len(stamps), stamps[-1] - t0

    return measure(one, conc, n, max_tokens, offset)


def smg(ports: dict):
    # smg refuses port 0 (a bench run by hand: no second draw when one is taken).
    port = fixed_ports.outside_ephemeral()
    proc = subprocess.Popen(
        [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(fixed_ports.outside_ephemeral()),
         "--worker-urls", f"grpc://127.0.0.1:{ports['worker']}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                if b"SmolLM2" in r.read():
                    return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit("smg did not start")
        time.sleep(0.5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conc", default="1,8")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    # smg presents no mesh credential to workers: the worker runs open.
    proc, ports = up(["--unified", "--worker-arg=--insecure-plaintext"])
    gw = None
    out = {}
    try:
        gw, smg_url = smg(ports)
        for c in map(int, a.conc.split(",")):
            n = max(a.requests, c)
            # Interleaved per concurrency, so slow phases of a noisy machine hit all three;
            # each path gets its own prompts (the shared prefix cached, the tails not).
            base = 10_000 * c
            out[("pdmesh", c)] = run(ports["url"], c, n, a.max_tokens, base)
            out[("smg", c)] = run(smg_url, c, n, a.max_tokens, base + 1000)
            out[("direct", c)] = direct(ports, c, n, a.max_tokens, base + 2000)
    finally:
        if gw:
            gw.terminate()
            gw.wait(timeout=30)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    print(f"{'conc':>4} {'path':>7} {'ttft_p50':>9} {'ttft_p99':>9} {'itl_p50':>8} {'tok/s':>7} {'+ttft':>8} {'tok/s÷direct':>12}")
    for c in map(int, a.conc.split(",")):
        d = out[("direct", c)]
        for path in ("direct", "pdmesh", "smg"):
            r = out[(path, c)]
            print(f"{c:>4} {path:>7} {r['ttft_p50']*1000:>8.1f}ms {r['ttft_p99']*1000:>8.1f}ms {r['itl_p50']*1000:>7.1f}ms "
                  f"{r['tok_s']:>7.1f} {(r['ttft_p50']-d['ttft_p50'])*1000:>+7.1f}ms {r['tok_s']/d['tok_s']:>12.2f}")


if __name__ == "__main__":
    main()

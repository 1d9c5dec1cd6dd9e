#!/usr/bin/env python3
"""Cost of trace export: two `pdmesh up` meshes (prefill/decode, the default), one with
OTLP export to a receiver in this process and one without, driven in alternating rounds
with the same streamed greedy chat workload. Reports each mode's median over the rounds
of TTFT p50/p99 and output throughput, the on/off ratios, and the spans received.

    pip install opentelemetry-proto==1.45.2 grpcio
    python3 scripts/bench/tracing_overhead.py [--conc 8] [--requests 32] [--max-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import signal
import statistics
import sys
import threading
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_vs_unified import run, up  # noqa: E402


class Receiver:
    """An OTLP trace receiver that keeps the raw requests and decodes them only after the
    run, so the receiver costs the measured machine as little as it can."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.raw: list[bytes] = []
        empty = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()

        def export(request: bytes, context) -> bytes:
            with self.lock:
                self.raw.append(request)
            return empty

        self.handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {"Export": grpc.unary_unary_rpc_method_handler(export)},
        )

    def spans(self) -> int:
        n = 0
        for raw in self.raw:
            req = trace_service_pb2.ExportTraceServiceRequest.FromString(raw)
            n += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conc", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()

    receiver = Receiver()
    server = grpc.server(cf.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((receiver.handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    meshes = {
        "off": up([]),
        "on": up([], env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}),
    }
    results = {"off": [], "on": []}
    try:
        for r in range(a.rounds):
            # Alternate which mode goes first, so drift over the run hits both alike.
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for k, mode in enumerate(order):
                offset = 10_000 * (r + 1) + 1_000 * k
                results[mode].append(run(meshes[mode][1]["url"], a.conc, a.requests, a.max_tokens, offset))
    finally:
        for proc, _ in meshes.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in meshes.values():
            proc.wait(timeout=60)
        server.stop(0)

    med = {m: {k: statistics.median(x[k] for x in rs) for k in ("ttft_p50", "ttft_p99", "tok_s")}
           for m, rs in results.items()}
    print(f"conc {a.conc}, {a.requests} requests x {a.max_tokens} tokens, median of {a.rounds} rounds")
    print(f"{'export':>7} {'ttft_p50':>9} {'ttft_p99':>9} {'tok/s':>7}")
    for m in ("off", "on"):
        r = med[m]
        print(f"{m:>7} {r['ttft_p50']*1000:>7.1f}ms {r['ttft_p99']*1000:>7.1f}ms {r['tok_s']:>7.1f}")
    on, off = med["on"], med["off"]
    print(f"{'on/off':>7} {on['ttft_p50']/off['ttft_p50']:>8.3f}x {on['ttft_p99']/off['ttft_p99']:>8.3f}x "
          f"{on['tok_s']/off['tok_s']:>6.3f}x")
    spans = receiver.spans()
    print(f"spans received: {spans} ({sum(map(len, receiver.raw)) / 1e6:.1f} MB of OTLP)")
    if spans == 0:
        sys.exit("the exporting mesh sent no spans: nothing was measured")


if __name__ == "__main__":
    main()

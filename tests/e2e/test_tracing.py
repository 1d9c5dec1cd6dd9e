"""One trace per request across the mesh's processes. An OTLP receiver in this test process
(OpenTelemetry's own protobuf definitions, served with grpcio) gets every span `pdmesh up`'s
services export, and a prefill/decode request's spans must share one trace id across the
gateway, tokenizer, prefill, decode and cache services, with the room and the transfer's
start and end on them."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import defaultdict

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from conftest import start_up, stop_up

SERVICES = {"pdmesh-gateway", "pdmesh-tokenizer", "pdmesh-prefill", "pdmesh-decode", "pdmesh-cache"}
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def attrs(kvs) -> dict:
    return {kv.key: value(kv.value) for kv in kvs}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every exported span as a dict (ids as hex)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[dict] = []

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = attrs(rs.resource.attributes).get("service.name")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({
                            "service": service,
                            "name": s.name,
                            "trace": s.trace_id.hex(),
                            "id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(),
                            "kind": s.kind,
                            "attrs": attrs(s.attributes),
                            "events": [(e.name, attrs(e.attributes)) for e in s.events],
                            "status": s.status.code,
                        })
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    receiver = Receiver()
    server = grpc.server(cf.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_BSP_SCHEDULE_DELAY": "200"}
    mesh = start_up(tmp_path_factory.mktemp("traced"), env=env)
    yield mesh, receiver
    code = stop_up(mesh)
    server.stop(0)
    assert code == 0, mesh.log()


def wait_for(receiver: Receiver, trace_id: str, done, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        spans = receiver.trace(trace_id)
        if done(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def complete(spans: list[dict]) -> bool:
    names = {(s["service"], s["name"]) for s in spans}
    return SERVICES <= {s["service"] for s in spans} and ("pdmesh-prefill", "prefill room") in names and (
        "pdmesh-decode", "decode room") in names


def summary(spans: list[dict]) -> str:
    return "\n".join(f'{s["service"]:18} {s["name"]:45} {s["attrs"]}' for s in spans)


def check_trace(spans: list[dict], usage, response_id: str) -> None:
    by_service = defaultdict(list)
    for s in spans:
        by_service[s["service"]].append(s)
    assert SERVICES <= set(by_service), f"services in the trace: {sorted(by_service)}\n{summary(spans)}"

    # The gateway's request span: GenAI attributes, the room, the usage the client saw.
    roots = [s for s in by_service["pdmesh-gateway"] if s["attrs"].get("gen_ai.operation.name") == "chat"]
    assert len(roots) == 1, summary(spans)
    root = roots[0]
    a = root["attrs"]
    assert root["name"] == f'chat {a["gen_ai.request.model"]}'
    assert a["gen_ai.response.id"] == response_id
    assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens
    room = a["pdmesh.room"]  # a decimal string: room ids are unsigned 64-bit
    assert int(room) > 0

    # Every span hangs off another span of the same trace, up to the root.
    ids = {s["id"] for s in spans}
    for s in spans:
        if s is not root:
            assert s["parent"] in ids, f'{s["service"]} {s["name"]} has a parent outside the trace'

    # Both sides' room spans name the room and mark the transfer's start and end, and
    # agree on what moved: the prompt's pages (16 tokens each), of one size.
    moved = {}
    for side in ("prefill", "decode"):
        rs = [s for s in by_service[f"pdmesh-{side}"] if s["name"] == f"{side} room"]
        assert len(rs) == 1, summary(spans)
        r = rs[0]
        assert r["attrs"]["pdmesh.room"] == room and r["attrs"]["pdmesh.role"] == side
        events = [name for name, _ in r["events"]]
        assert "kv_cache_transfer_start" in events and "kv_cache_transfer_end" in events, events
        assert events.index("kv_cache_transfer_start") < events.index("kv_cache_transfer_end")
        end = dict(r["events"])["kv_cache_transfer_end"]
        assert end["pdmesh.pages"] > 0 and end["pdmesh.bytes"] > 0 and end["pdmesh.seconds"] >= 0
        assert dict(r["events"])["kv_cache_transfer_start"]["pdmesh.bytes"] == end["pdmesh.bytes"]
        moved[side] = (end["pdmesh.pages"], end["pdmesh.pages_held"], end["pdmesh.bytes"])
        assert "room_state" in events
    assert moved["prefill"] == moved["decode"], moved
    # The prompt's pages: those decode's prefix cache held already stayed, the rest moved.
    pages, held, size = moved["decode"]
    assert pages + held == -(-usage.prompt_tokens // 16) and size % pages == 0, (moved, usage.prompt_tokens)

    # The cache service's room calls carry the room and the state they left it in.
    cache = by_service["pdmesh-cache"]
    assert {s["attrs"].get("rpc.method") for s in cache} >= {"RoomOpen", "RoomWait", "RoomStart", "RoomCommit", "RoomResult"}
    assert all(s["attrs"].get("pdmesh.room") == room for s in cache), summary(cache)
    assert "success" in {s["attrs"].get("pdmesh.room.state") for s in cache}

    # The tokenizer rendered the prompt in the same trace; the answer's text was made in the
    # gateway (`pdmesh up` gives it the model file), so no Detokenize stream was opened.
    methods = {s["attrs"].get("rpc.method") for s in by_service["pdmesh-tokenizer"]}
    assert "ApplyChatTemplate" in methods and "Detokenize" not in methods, methods


def ask(mesh, content: str, max_tokens: int, temperature: float = 0, **kw):
    """One user turn through the mesh's gateway, greedy unless told."""
    return mesh.client().chat.completions.create(model=mesh.model, messages=[{"role": "user", "content": content}],
                                                 max_tokens=max_tokens, temperature=temperature, **kw)


def root_of(receiver: Receiver, response_id: str, timeout: float = 30) -> dict | None:
    """The span the gateway exported for the response `response_id`, once it came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with receiver.lock:
            root = next((s for s in receiver.spans if s["attrs"].get("gen_ai.response.id") == response_id), None)
        if root is not None:
            return root
        time.sleep(0.2)
    return None


def test_a_pd_request_is_one_trace_across_five_services(traced):
    mesh, receiver = traced
    r = ask(mesh, "Name a colour.", 8)
    # The trace starts at the gateway: find it by the response id.
    root = root_of(receiver, r.id)
    assert root, "the gateway exported no span for the request"
    spans = wait_for(receiver, root["trace"], complete)
    check_trace(spans, r.usage, r.id)
    assert root["parent"] == "", "without a traceparent the gateway starts the trace"


def test_a_clients_traceparent_is_joined_and_streams_trace_too(traced):
    mesh, receiver = traced
    stream = ask(mesh, "Count to three.", 8, stream=True, stream_options={"include_usage": True},
                 extra_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    chunks = list(stream)
    usage = chunks[-1].usage
    spans = wait_for(receiver, CLIENT_TRACE, complete)
    root = next((s for s in spans if s["attrs"].get("gen_ai.operation.name") == "chat"), None)
    assert root is not None, summary(spans)
    assert root["parent"] == CLIENT_SPAN
    check_trace(spans, usage, chunks[0].id)


def test_failed_requests_mark_their_span(traced):
    mesh, receiver = traced
    import openai

    with pytest.raises(openai.BadRequestError):
        ask(mesh, "x", 8, temperature=-1,
            extra_headers={"traceparent": "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-01"})
    spans = wait_for(receiver, "1af7651916cd43dd8448eb211c80319c", lambda s: len(s) > 0)
    assert len(spans) == 1, summary(spans)
    s = spans[0]
    assert s["attrs"]["error.type"] == "invalid_request" and s["status"] == 2, s


def test_a_malformed_traceparent_is_ignored_and_the_gateway_starts_the_trace(traced):
    mesh, receiver = traced
    r = ask(mesh, "Name a fruit.", 4, extra_headers={"traceparent": "00-not-a-trace-context-" + "f" * 300})
    root = root_of(receiver, r.id)
    assert root is not None and root["parent"] == "", root

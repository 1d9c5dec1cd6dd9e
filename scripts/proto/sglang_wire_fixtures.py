#!/usr/bin/env python3
"""Check pdmesh's SGLang scheduler protos against smg's and write wire fixtures.

pdmesh keeps its own copy of the SGLang scheduler protocol (proto/sglang/grpc/scheduler/
scheduler.proto and proto/smg/grpc/common/common.proto) so a pdmesh worker can serve
behind the smg gateway. This script holds that copy to the reference, the .proto files
shipped in the PyPI package smg-grpc-proto (the version smg 1.13.0 speaks), in two ways:

1. Descriptors. It compiles both sets with grpc_tools.protoc and compares them: every
   message and enum pdmesh defines must have the reference's full name, fields (name,
   number, type, type name, label, proto3 `optional`, oneof), reserved numbers and enum
   values; every pdmesh RPC must have the reference's types and streaming shape; and every
   message the pdmesh RPCs reach in the reference must be in pdmesh's copy. Any
   difference is printed and the script exits 1.
2. Fixtures. It builds a set of fully populated messages with the REFERENCE's generated
   Python classes, serializes them deterministically and writes one `name hex` line per
   message. proto/tests/sglang_wire.rs decodes those bytes with pdmesh's prost types,
   checks every value and checks that prost re-encodes the same bytes. The values here
   and in that test must be kept in step.

The reference .proto files are downloaded at run time (pip download, no install) into a
temporary directory and never copied into the repository. grpcio-tools is used from the
current environment, or pip-installed into a temporary directory when it is missing.

How to run (a developer tool; needs PyPI access):

    python3 scripts/proto/sglang_wire_fixtures.py            # check, then write the fixture
    python3 scripts/proto/sglang_wire_fixtures.py --check    # check only

Re-run it after editing either pdmesh .proto file or when moving to a newer smg version
(change SMG_GRPC_PROTO), and commit the fixture.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMG_GRPC_PROTO = "0.4.28"
REPO = Path(__file__).resolve().parents[2]
OURS = REPO / "proto"
OUR_FILES = ["smg/grpc/common/common.proto", "sglang/grpc/scheduler/scheduler.proto"]
REF_FILES = ["common.proto", "sglang_scheduler.proto"]
FIXTURE = OURS / "tests" / "fixtures" / "sglang_wire.hex"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                   check=True)


def reference_protos(tmp: Path) -> Path:
    """Downloads the smg-grpc-proto wheel and unpacks its .proto files; returns their folder."""
    dl = tmp / "wheel"
    pip("download", "--no-deps", "--only-binary=:all:", "-d", str(dl),
        f"smg-grpc-proto=={SMG_GRPC_PROTO}")
    wheels = glob.glob(str(dl / "smg_grpc_proto-*.whl"))
    if len(wheels) != 1:
        sys.exit(f"expected one smg-grpc-proto wheel, found {wheels}")
    out = tmp / "ref"
    with zipfile.ZipFile(wheels[0]) as z:
        for name in z.namelist():
            if name.startswith("smg_grpc_proto/proto/") and name.endswith(".proto"):
                target = out / Path(name).name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
    for f in REF_FILES:
        if not (out / f).is_file():
            sys.exit(f"{f} missing from smg-grpc-proto {SMG_GRPC_PROTO}")
    return out


def load_grpc_tools(tmp: Path):
    try:
        from grpc_tools import protoc  # noqa: F401
    except ImportError:
        target = tmp / "site"
        pip("install", "--target", str(target), "grpcio-tools")
        sys.path.insert(0, str(target))
        importlib.invalidate_caches()
    from grpc_tools import protoc

    return protoc


def run_protoc(protoc, args: list[str]) -> None:
    include = str(Path(protoc.__file__).parent / "_proto")
    rc = protoc.main(["grpc_tools.protoc", f"-I{include}", *args])
    if rc != 0:
        sys.exit(f"protoc failed ({rc}): {args}")


def descriptor_set(protoc, root: Path, files: list[str], out: Path):
    from google.protobuf import descriptor_pb2

    run_protoc(protoc, [f"-I{root}", f"--descriptor_set_out={out}", *files])
    fds = descriptor_pb2.FileDescriptorSet()
    fds.ParseFromString(out.read_bytes())
    return fds


def index(fds):
    """Full name -> descriptor proto for messages (nested included), enums and methods."""
    messages, enums, methods = {}, {}, {}

    def walk(prefix: str, msgs, ens):
        for e in ens:
            enums[f"{prefix}.{e.name}"] = e
        for m in msgs:
            name = f"{prefix}.{m.name}"
            messages[name] = m
            walk(name, m.nested_type, m.enum_type)

    for f in fds.file:
        prefix = "." + f.package
        walk(prefix, f.message_type, f.enum_type)
        for s in f.service:
            for m in s.method:
                methods[f"{prefix}.{s.name}/{m.name}"] = m
    return messages, enums, methods


def field_sig(m, f):
    oneof = m.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None
    if f.proto3_optional:
        oneof = None  # the synthetic oneof's name is not part of the contract
    return (f.number, f.label, f.type, f.type_name, bool(f.proto3_optional), oneof)


def compare(ours, ref) -> list[str]:
    om, oe, osv = index(ours)
    rm, re_, rsv = index(ref)
    errors = []
    for name, m in om.items():
        r = rm.get(name)
        if r is None:
            errors.append(f"message {name}: not in the reference")
            continue
        of = {f.name: field_sig(m, f) for f in m.field}
        rf = {f.name: field_sig(r, f) for f in r.field}
        for fname in sorted(set(of) | set(rf)):
            if of.get(fname) != rf.get(fname):
                errors.append(f"{name}.{fname}: ours {of.get(fname)} reference {rf.get(fname)}")
        ores = sorted((x.start, x.end) for x in m.reserved_range)
        rres = sorted((x.start, x.end) for x in r.reserved_range)
        if ores != rres:
            errors.append(f"{name}: reserved ours {ores} reference {rres}")
        if m.options.map_entry != r.options.map_entry:
            errors.append(f"{name}: map_entry differs")
    for name, e in oe.items():
        r = re_.get(name)
        if r is None:
            errors.append(f"enum {name}: not in the reference")
        elif [(v.name, v.number) for v in e.value] != [(v.name, v.number) for v in r.value]:
            errors.append(f"enum {name}: values differ")
    for name, m in osv.items():
        r = rsv.get(name)
        sig = lambda x: (x.input_type, x.output_type, x.client_streaming, x.server_streaming)
        if r is None:
            errors.append(f"rpc {name}: not in the reference")
        elif sig(m) != sig(r):
            errors.append(f"rpc {name}: ours {sig(m)} reference {sig(r)}")
    # Every message and enum reachable from our RPCs in the reference must be ours too.
    todo = [t for m in osv.values() for t in (m.input_type, m.output_type)]
    seen = set()
    while todo:
        t = todo.pop()
        if t in seen or t.startswith(".google.protobuf."):
            continue
        seen.add(t)
        if t in rm:
            if t not in om:
                errors.append(f"{t}: reached from pdmesh's RPCs but missing from pdmesh")
            todo.extend(f.type_name for f in rm[t].field if f.type_name)
        elif t in re_ and t not in oe:
            errors.append(f"enum {t}: reached from pdmesh's RPCs but missing from pdmesh")
    omitted = sorted(n for n in rsv if n not in osv)
    print(f"descriptors: {len(om)} messages, {len(oe)} enums, {len(osv)} RPCs compared; "
          f"reference RPCs left out: {', '.join(n.split('/')[1] for n in omitted)}",
          file=sys.stderr)
    return errors


# The sections a load report carries, with the same values in SGLang's messages
# (GetLoads) and in smg's (the KV event stream's engine load).
LOAD_MEMORY = dict(weight_gb=1.5, kv_cache_gb=2.5, graph_gb=0.5, token_capacity=4096)
LOAD_SPECULATIVE = dict(accept_length=2.5, accept_rate=0.75)
LOAD_LORA = dict(slots_used=1, slots_total=4, utilization=0.25)
LOAD_QUEUES = dict(waiting=2, grammar=1, paused=0, retracted=3)
LOAD_DISAGGREGATION = dict(
    prefill_prealloc_queue_reqs=1, prefill_inflight_queue_reqs=2, decode_prealloc_queue_reqs=3,
    decode_transfer_queue_reqs=4, decode_retracted_queue_reqs=5, kv_transfer_speed_gb_s=10.5,
    kv_transfer_latency_ms=0.125)


def build_messages(sched, common):
    """The fixture messages, built with the reference's classes. Mirrored in sglang_wire.rs."""
    out = []

    req = sched.GenerateRequest(request_id="req-42")
    req.tokenized.original_text = "Hello"
    req.tokenized.input_ids.extend([1, 15043, 300000])
    mm = req.mm_inputs
    mm.image_urls.append("http://img/a.png")
    mm.video_urls.append("v.mp4")
    mm.audio_urls.append("a.wav")
    mm.pixel_values.data = b"\x00\x00\x80\x3f"
    mm.pixel_values.shape.extend([1, 1])
    mm.pixel_values.dtype = "float32"
    mm.image_data.append(b"\x89PNG")
    mm.video_data.append(b"vid")
    mm.audio_data.append(b"aud")
    mm.modalities.append("image")
    t = mm.model_specific_tensors["image_grid_thw"]
    t.data = b"\x01\x00\x00\x00\x00\x00\x00\x00"
    t.shape.append(1)
    t.dtype = "int64"
    mm.im_token_id = 0
    mm.mm_placeholders.add(offset=1, length=2)
    sp = req.sampling_params
    sp.temperature = 0.5
    sp.top_p = 0.75
    sp.top_k = -1
    sp.min_p = 0.125
    sp.frequency_penalty = 0.25
    sp.presence_penalty = -0.5
    sp.repetition_penalty = 1.5
    sp.max_new_tokens = 64
    sp.stop.extend(["</s>", "\n\n"])
    sp.stop_token_ids.extend([2, 128009])
    sp.skip_special_tokens = True
    sp.spaces_between_special_tokens = True
    sp.json_schema = '{"type":"object"}'
    sp.n = 2
    sp.min_new_tokens = 1
    sp.ignore_eos = True
    sp.no_stop_trim = True
    sp.stream_interval = 0
    sp.logit_bias["15043"] = -2.5
    sp.custom_params.update({"alpha": 1.5, "mode": "x", "flags": [True, None],
                             "nested": {"k": 3}})
    req.return_logprob = True
    req.logprob_start_len = -1
    req.top_logprobs_num = 5
    req.token_ids_logprob.extend([7, 8])
    req.return_hidden_states = True
    req.disaggregated_params.bootstrap_host = "10.0.0.7"
    req.disaggregated_params.bootstrap_port = 8998
    req.disaggregated_params.bootstrap_room = 123456789
    req.custom_logit_processor = "proc"
    req.timestamp.seconds = 1700000000
    req.timestamp.nanos = 500
    req.log_metrics = True
    req.input_embeds.extend([0.5, -1.0])
    req.lora_id = "lora-a"
    req.data_parallel_rank = 0
    req.stream = True
    req.require_reasoning = True
    out.append(("generate_request", req))

    req = sched.GenerateRequest(request_id="req-43", stream=False)
    req.tokenized.input_ids.extend([5, 6])
    req.sampling_params.temperature = 1.0
    req.sampling_params.regex = "[a-z]+"
    out.append(("generate_request_minimal", req))

    resp = sched.GenerateResponse(request_id="req-42")
    c = resp.chunk
    c.token_ids.extend([10, 11])
    c.prompt_tokens = 3
    c.completion_tokens = 2
    c.cached_tokens = 1
    c.reasoning_tokens = 1
    c.output_logprobs.token_logprobs.extend([-0.5, -0.25])
    c.output_logprobs.token_ids.extend([10, 11])
    c.output_logprobs.top_logprobs.add(values=[-0.5, -1.0], token_ids=[10, 12])
    c.output_logprobs.token_ids_logprobs.add(values=[-3.0], token_ids=[7])
    c.hidden_states.extend([0.25, 0.5])
    c.input_logprobs.token_logprobs.add()
    c.input_logprobs.token_logprobs.add(value=-1.5)
    c.input_logprobs.token_ids.extend([1, 15043])
    c.input_logprobs.top_logprobs.add(values=[-1.5], token_ids=[15043])
    c.index = 1
    out.append(("generate_response_chunk", resp))

    resp = sched.GenerateResponse(request_id="req-42")
    d = resp.complete
    d.output_ids.extend([10, 11, 2])
    d.finish_reason = "stop"
    d.prompt_tokens = 3
    d.completion_tokens = 3
    d.cached_tokens = 1
    d.reasoning_tokens = 2
    d.output_logprobs.token_logprobs.append(-0.5)
    d.output_logprobs.token_ids.append(10)
    d.all_hidden_states.add(values=[0.5], layer=-1, position=4)
    d.matched_stop_str = "</s>"
    d.input_logprobs.token_ids.append(1)
    d.index = 1
    d.spec_accepted_tokens = 5
    d.spec_draft_tokens = 8
    out.append(("generate_response_complete", resp))

    resp = sched.GenerateResponse(request_id="req-44")
    resp.complete.finish_reason = "length"
    resp.complete.matched_token_id = 0
    out.append(("generate_response_complete_token", resp))

    m = sched.EmbedRequest(request_id="emb-1", data_parallel_rank=3, is_cross_encoder=True)
    m.tokenized.input_ids.extend([5, 6])
    m.mm_inputs.image_urls.append("u")
    m.sampling_params.temperature = 1.0
    m.token_type_ids.extend([0, 1])
    m.texts.extend(["a", "b"])
    out.append(("embed_request", m))
    out.append(("embed_response",
                sched.EmbedResponse(embedding_dim=3, embedding=[0.5, 0.25, -1.0],
                                    prompt_tokens=2)))
    out.append(("health_check_response", sched.HealthCheckResponse(healthy=True, message="ok")))
    out.append(("abort_request", sched.AbortRequest(request_id="req-42", reason="client gone")))
    out.append(("abort_response", sched.AbortResponse(success=True, message="aborted")))

    out.append(("get_model_info_response", sched.GetModelInfoResponse(
        model_path="/models/llama", tokenizer_path="/models/llama/tok", is_generation=True,
        preferred_sampling_params='{"temperature":0.6}', weight_version="v1",
        served_model_name="llama", max_context_length=8192, vocab_size=128256,
        supports_vision=True, model_type="llama", eos_token_ids=[128001, 128009],
        pad_token_id=128004, bos_token_id=128000, max_req_input_len=8000,
        architectures=["LlamaForCausalLM"], id2label_json='{"0":"neg"}', num_labels=1,
        default_sampling_params_json='{"top_p":0.9}')))

    m = sched.GetServerInfoResponse(active_requests=3, is_paused=True,
                                    last_receive_timestamp=1700000000.25, uptime_seconds=12.5,
                                    sglang_version="0.5.0", server_type="grpc",
                                    max_total_num_tokens=4096)
    m.server_args.update({"model_path": "/m", "tp_size": 2, "enable_x": False})
    m.scheduler_info.update({"max_total_num_tokens": 4096})
    m.start_time.seconds = 1699999000
    out.append(("get_server_info_response", m))

    m = sched.GetLoadsRequest(dp_rank=0, include=["core", "memory"])
    out.append(("get_loads_request", m))

    m = sched.GetLoadsResponse(timestamp="2024-01-01T00:00:00Z", version="0.5.0",
                               dp_rank_count=2)
    l0 = m.loads.add(dp_rank=0, num_running_reqs=4, num_waiting_reqs=2, num_total_reqs=6,
                     num_used_tokens=1000, max_total_num_tokens=4096, token_usage=0.25,
                     gen_throughput=100.5, cache_hit_rate=0.5, utilization=0.75,
                     max_running_requests=32, num_waiting_uncached_tokens=77)
    l0.memory.CopyFrom(sched.MemoryMetrics(**LOAD_MEMORY))
    l0.speculative.CopyFrom(sched.SpeculativeMetrics(**LOAD_SPECULATIVE))
    l0.lora.CopyFrom(sched.LoRAMetrics(**LOAD_LORA))
    l0.disaggregation.CopyFrom(sched.DisaggregationMetrics(mode="prefill", **LOAD_DISAGGREGATION))
    l0.queues.CopyFrom(sched.QueueMetrics(**LOAD_QUEUES))
    l1 = m.loads.add(dp_rank=1, num_running_reqs=1)
    l1.memory.SetInParent()
    m.aggregate.CopyFrom(sched.AggregateMetrics(
        total_running_reqs=5, total_waiting_reqs=2, total_reqs=7, avg_token_usage=0.125,
        avg_throughput=200.25, avg_utilization=0.5))
    out.append(("get_loads_response", m))

    out.append(("flush_cache_request", common.FlushCacheRequest(timeout_s=2.5)))
    out.append(("flush_cache_response",
                common.FlushCacheResponse(success=True, message="flushed")))
    out.append(("get_tokenizer_chunk",
                common.GetTokenizerChunk(data=b"PK\x03\x04", sha256="ab" * 32)))
    out.append(("subscribe_kv_events_request", common.SubscribeKvEventsRequest(
        start_sequence_number=17, load_records_before_first_batch=True)))

    b = common.KvEventBatch(sequence_number=18, timestamp=1700000000.5, dp_rank=0)
    e = b.events.add(event_id=1)
    s = e.stored
    blk = s.blocks.add(block_hash=-5, token_ids=[1, 2, 3, 4], block_size=4, lora_id=0,
                       cache_level=0)
    blk.extra_keys.add(text="lora")
    blk.extra_keys.add(blob=b"\x01")
    blk.extra_keys.add(number=-3)
    blk.extra_keys.add().multimodal.CopyFrom(
        common.KvMultimodalKey(identifier="img", offset=2))
    s.parent_block_hash = -9
    s.tier = common.KV_CACHE_TIER_HOST
    s.medium = "CPU_PINNED"
    s.group_idx = 0
    s.kv_cache_spec_kind = "full"
    s.kv_cache_spec_sliding_window = 128
    s.locality = common.KV_CACHE_LOCALITY_LOCAL
    s.ownership = "engine"
    s.session_id = "s"
    s.lora_name = "l"
    s.cache_salt = "salt"
    e = b.events.add(event_id=2)
    e.removed.CopyFrom(common.KvBlocksRemoved(
        block_hashes=[-5, 7], cache_level=1, tier=common.KV_CACHE_TIER_DEVICE, medium="GPU",
        group_idx=1, locality=common.KV_CACHE_LOCALITY_REMOTE, ownership="agent"))
    b.events.add(event_id=3).cleared.ownership = "engine"
    b.events.add(event_id=4).cleared.SetInParent()
    b.snapshot.CopyFrom(common.KvSnapshotChunk(index=1, count=3, blocks=100, unknown_before=2))
    ld = b.load
    ld.running_requests = 3
    ld.waiting_requests = 1
    ld.waiting_uncached_tokens = 0
    ld.token_usage = 0.5
    ld.active_token_usage = 0.25
    ld.gen_throughput = 50.5
    ld.max_running_requests = 16
    ld.age_ms = 7
    ld.sample = 99
    ld.load_only = True
    ld.cache_hit_rate = 0.75
    ld.num_used_tokens = 512
    ld.max_total_num_tokens = 4096
    ld.memory.CopyFrom(common.EngineMemory(**LOAD_MEMORY))
    ld.queues.CopyFrom(common.EngineQueues(**LOAD_QUEUES))
    ld.speculative.CopyFrom(common.EngineSpeculative(**LOAD_SPECULATIVE))
    ld.lora.CopyFrom(common.EngineLora(**LOAD_LORA))
    ld.disaggregation.CopyFrom(common.EngineDisaggregation(mode="decode", **LOAD_DISAGGREGATION))
    ld.engine_silence_ms = 1500
    ld.engine_reports_steps = False
    ld.prefill_pending_tokens = 300
    out.append(("kv_event_batch", b))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare descriptors only")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        protoc = load_grpc_tools(tmp)
        ref = reference_protos(tmp)
        errors = compare(descriptor_set(protoc, OURS, OUR_FILES, tmp / "ours.pb"),
                         descriptor_set(protoc, ref, REF_FILES, tmp / "ref.pb"))
        if errors:
            print("pdmesh's protos differ from smg-grpc-proto " + SMG_GRPC_PROTO + ":",
                  file=sys.stderr)
            for e in errors:
                print("  " + e, file=sys.stderr)
            sys.exit(1)
        print(f"descriptors match smg-grpc-proto {SMG_GRPC_PROTO}", file=sys.stderr)
        if args.check:
            return

        gen = tmp / "gen"
        gen.mkdir()
        run_protoc(protoc, [f"-I{ref}", f"--python_out={gen}", *REF_FILES])
        sys.path.insert(0, str(gen))
        common = importlib.import_module("common_pb2")
        sched = importlib.import_module("sglang_scheduler_pb2")
        lines = [f"# smg-grpc-proto {SMG_GRPC_PROTO}, written by "
                 "scripts/proto/sglang_wire_fixtures.py; do not edit."]
        for name, msg in build_messages(sched, common):
            lines.append(f"{name} {msg.SerializeToString(deterministic=True).hex()}")
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_text("\n".join(lines) + "\n")
        print(f"wrote {FIXTURE.relative_to(REPO)} ({len(lines) - 1} messages)",
              file=sys.stderr)


if __name__ == "__main__":
    main()

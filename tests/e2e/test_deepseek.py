"""The DeepSeek V3.2 tiny model (MLA + DSA indexer + MoE, synthesized weights in real
safetensors files) through the whole mesh. In each of the four cache forms (MLA latent
bf16/fp8 x index-K fp8/bf16), prefill/decode disaggregation with a host mirror too small
for 80 concurrent sessions sharing a long prefix, over a disk tier that pages are spilled
to and promoted from (a page's latents and index-K in one file), answers bit-identically
to a unified worker with no cache at all answering one request at a time (bf16-fp8 and
bf16-bf16 also with prefill and decode on two hosts, network namespaces, the KV crossing
between their cache services). A disk tier written with fp8 index-K is refused, file by
file, by a bf16 mesh. And the seed's bug, forced on purpose (bf16 index-K sent
through a buffer sized for fp8): with the seed's own after-the-loss checksums it is caught
by the same comparison, on one host and across hosts; with the mesh's checksums (of the
engine's bytes) the hand-over refuses it and a report names both layouts, 256 vs 132
bytes per token of index-K."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import time

import openai
import pytest

from hosts import Hosts
from conftest import API_KEY, http, pdmesh_bin, start_up, stop_up

SESSIONS = 80
TURNS = 2
MAX_TOKENS = 6
# The tiny model's indexer keeps this many keys per query (`index_topk`).
INDEX_TOPK = 64
# Long enough that every prompt passes the indexer's top-k: attention is sparse.
SYSTEM = "You are the archivist. " + " ".join(
    f"Shelf {i} holds {['maps', 'letters', 'ledgers', 'seeds'][i % 4]} from year {1900 + 7 * i}." for i in range(6)
)

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek-v32-tiny")
    subprocess.run([str(pdmesh_bin()), "model", "synth", "deepseek-v32-tiny", "--out", str(d)], check=True, capture_output=True)
    return d


def converse(client, model: str, s: int) -> list[tuple[str, str]]:
    """One session: each turn's answer and finish reason (the next turn's history holds
    this session's own answers, so one differing answer changes every later request)."""
    history = [{"role": "system", "content": SYSTEM}]
    out = []
    for turn in range(TURNS):
        history.append({"role": "user", "content": f"Session {s}, turn {turn}: which shelf holds {['maps', 'seeds'][(s + turn) % 2]}?"})
        r = client.chat.completions.create(model=model, messages=list(history), max_tokens=MAX_TOKENS, temperature=0)
        assert r.usage.prompt_tokens > INDEX_TOPK, "the prompt must make attention sparse"
        text = r.choices[0].message.content
        out.append((text, r.choices[0].finish_reason))
        history.append({"role": "assistant", "content": text})
    return out


# Every variable the worker's fault hooks once read from the environment, set the way a
# user who exported the wrong ones would. The default binary must ignore all of them.
EVERY_FAULT_VARIABLE = {
    "PDMESH_FAULT_WRITE_DELAY_MS": "6000",
    "PDMESH_FAULT_COUNT": "1",
    "PDMESH_FAULT_STALL_STEP": "3:5000",
    "PDMESH_FAULT_MISSIZE_INDEX_K": "0",
}


def fault_injection(mesh) -> tuple[bool, list[str], float]:
    """What the gateway says of fault injection: /health's flag and list, and the gauge."""
    status, body = http("GET", mesh.base + "/health")
    assert status == 200, body
    health = json.loads(body)
    return health["fault_injection"], health["faults"], mesh.metrics()["mesh_fault_injection_enabled"]


# A host mirror and a prefill device pool too small for 80 sessions, over a disk tier:
# second turns find their first turns' pages on disk, the MLA latents and the index-K of a
# page in one file.
SMALL_TIERS = ["--cache-arg=--host-mirror-size=2048tokens", "--prefill-arg=--kv-pages=64"]


def disaggregated(tmp, tiny, mla: str, index_k: str, env=None, extra=(), faults=()):
    """Every session's transcript from a PD mesh with the host mirror over a disk tier,
    all at once. `faults`: the test-only faults the workers must report (none by
    default)."""
    forms = [f"--worker-arg=--kv-cache-dtype={mla}", f"--worker-arg=--index-k-dtype={index_k}"]
    tmp.mkdir()
    disk = tmp / "disk"
    disk.mkdir(mode=0o700)
    mesh = start_up(tmp, ["--model", str(tiny), "--no-smoke-test", *forms, "--disk-dir", str(disk), *SMALL_TIERS,
                          *extra], env=env)
    try:
        assert mesh.ports["mode"] == "pd"
        assert fault_injection(mesh) == (bool(faults), list(faults), float(bool(faults)))
        client = mesh.client()
        with cf.ThreadPoolExecutor(SESSIONS) as pool:
            transcripts = list(pool.map(lambda s: converse(client, mesh.model, s), range(SESSIONS)))
        m = mesh.metrics()
        assert m['mesh_kv_transfer_bytes_total{side="all"}'] > 0, "the KV went through rooms"
        assert m['mesh_kv_disk_pages_total{event="spilled"}'] > 0, {k: v for k, v in m.items() if "disk" in k}
        assert m['mesh_kv_disk_pages_total{event="promoted"}'] > 0, {k: v for k, v in m.items() if "disk" in k}
    finally:
        stop_up(mesh)
    return transcripts


# One reference per cache form for the whole module: it does not depend on the mesh it
# is compared with.
REFERENCES: dict[tuple[str, str], list[list[tuple[str, str]]]] = {}


def reference(tmp_path_factory, tiny, mla: str, index_k: str) -> list[list[tuple[str, str]]]:
    """Every session's answers from a unified worker with no cache at all, answering one
    request at a time."""
    if (mla, index_k) not in REFERENCES:
        args = ["--unified", "--no-host-cache", "--worker-arg=--disable-prefix-cache", "--worker-arg=--max-batch=1",
                f"--worker-arg=--kv-cache-dtype={mla}", f"--worker-arg=--index-k-dtype={index_k}"]
        mesh = start_up(tmp_path_factory.mktemp(f"reference-{mla}-{index_k}"), ["--model", str(tiny), "--no-smoke-test", *args])
        try:
            client = mesh.client()
            REFERENCES[mla, index_k] = [converse(client, mesh.model, s) for s in range(SESSIONS)]
        finally:
            stop_up(mesh)
    return REFERENCES[mla, index_k]


def differences(transcripts, ref) -> int:
    got = [answer for session in transcripts for answer in session]
    want = [answer for session in ref for answer in session]
    assert len(got) == len(want) == SESSIONS * TURNS
    return sum(a != b for a, b in zip(got, want))


@pytest.mark.parametrize(
    "mla,index_k,env",
    [
        # The form the seed's bug corrupts, with every old fault variable exported: the
        # default binary ignores them and answers as a clean mesh does.
        ("bf16", "bf16", EVERY_FAULT_VARIABLE),
        # DeepSeek's own serving form: fp8 latent cache and fp8 index-K.
        ("fp8", "fp8", None),
        # The other two (bf16-fp8 also runs across hosts below).
        ("bf16", "fp8", None),
        ("fp8", "bf16", None),
    ],
    ids=["bf16-bf16-fault-variables-set", "fp8-fp8", "bf16-fp8", "fp8-bf16"],
)
def test_pd_with_host_mirror_is_bit_identical_to_unified_no_cache(tmp_path, tmp_path_factory, tiny, mla, index_k, env):
    pd = disaggregated(tmp_path / "pd", tiny, mla, index_k, env=env)
    assert differences(pd, reference(tmp_path_factory, tiny, mla, index_k)) == 0
    if env:
        log = (tmp_path / "pd" / "up.log").read_text(errors="replace")
        assert "PDMESH_FAULT_* variables are ignored" in log, log[-4000:]
        assert "FAULT INJECTION IS ON" not in log


def test_a_disk_tier_written_with_fp8_index_k_is_refused_by_a_bf16_mesh(tmp_path, tmp_path_factory, tiny):
    """The seed's bug class at the disk tier: pages a mesh with fp8 index-K (132 B/token)
    left on disk, offered to a mesh with bf16 index-K (256 B/token) on the same folder,
    are refused by the layout's fingerprint at start (every file counted as
    foreign_layout), never loaded; the bf16 mesh answers as its no-cache reference."""
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    common = ["--model", str(tiny), "--no-smoke-test", "--unified", "--disk-dir", str(disk),
              "--worker-arg=--kv-cache-dtype=bf16"]
    fp8 = start_up(tmp_path / "fp8", [*common, "--worker-arg=--index-k-dtype=fp8"])
    try:
        converse(fp8.client(), fp8.model, 0)
    finally:
        stop_up(fp8)
    written = list(disk.glob("*.page"))
    assert written, "a graceful stop writes the mirror's pages to disk"
    bf16 = start_up(tmp_path / "bf16", [*common, "--worker-arg=--index-k-dtype=bf16"])
    try:
        def opened():
            m = bf16.metrics()
            return m if m['mesh_kv_disk_tier{state="serving"}'] == 1 else None
        deadline = time.monotonic() + 60
        while not (m := opened()):
            assert time.monotonic() < deadline, bf16.log()[-4000:]
            time.sleep(0.2)
        assert m['mesh_kv_disk_discards_total{reason="foreign_layout"}'] == len(written), m
        assert m["mesh_kv_disk_pages"] == 0 and not list(disk.glob("*.page")), m
        want = reference(tmp_path_factory, tiny, "bf16", "bf16")
        assert [converse(bf16.client(), bf16.model, s) for s in range(2)] == want[:2]
        assert bf16.metrics()['mesh_kv_disk_pages_total{event="promoted"}'] == 0
    finally:
        stop_up(bf16)


def test_the_seeds_bug_forced_on_purpose_is_caught_by_the_differential(tmp_path, tmp_path_factory, tiny):
    """bf16 index-K pages sent through a buffer sized for fp8 index-K: checksums pass (they
    are computed after the loss, as in the seed), the answers change. The fault is on only
    through the worker's explicit test flag, and the mesh says so loudly."""
    pd = disaggregated(tmp_path / "pd", tiny, "bf16", "bf16", extra=["--worker-arg=--fault-missize-index-k-unchecked"],
                       faults=["missize-index-k-unchecked"])
    log = (tmp_path / "pd" / "up.log").read_text(errors="replace")
    assert "FAULT INJECTION IS ON" in log and "missize-index-k-unchecked" in log, log[-4000:]
    assert differences(pd, reference(tmp_path_factory, tiny, "bf16", "bf16")) > 0


def test_the_seeds_bug_is_refused_by_the_hand_over_and_reported_with_both_layouts(tmp_path, tiny):
    """The same mis-sized copy behind the mesh's own checksums (taken from the engine's
    bytes before staging): the prefill's write into the mirror does not match them, the
    request fails with DATA_LOSS before decode sees a page, and the prefill worker files a
    checksum report whose layout section puts the engine's index-K (bf16, 256 B/token)
    beside the staging buffer's (fp8, 132 B/token). Its replay command, run as written
    once a healthy mesh serves on the same address, gives that mesh's answer."""
    forms = ["--model", str(tiny), "--no-smoke-test", "--worker-arg=--kv-cache-dtype=bf16", "--worker-arg=--index-k-dtype=bf16"]
    # The replay needs the prompt's token ids, which a report keeps only with the flag.
    mesh = start_up(tmp_path / "faulty", [*forms, "--worker-arg=--fault-missize-index-k",
                                          "--worker-arg=--incident-include-prompts"])
    ask = lambda client: client.chat.completions.create(model=mesh.model, messages=[{"role": "user", "content": SYSTEM}],
                                                        max_tokens=MAX_TOKENS, temperature=0)
    try:
        client = mesh.client()
        with pytest.raises(openai.APIStatusError) as e:
            ask(client)
        assert e.value.status_code >= 500 and e.value.body["code"] == "data_loss", e.value.body
        assert "changed between the engine and the host mirror" in e.value.body["message"], e.value.body
        reports = [json.loads(p.read_text()) for p in sorted(mesh.incident_dir.glob("*.json"))]
        assert [(r["kind"], r["place"]["service"], r["place"]["stage"]) for r in reports] == [
            ("checksum", "worker", "hand-over write")], reports
        r = reports[0]
        assert r["pages"] and all(p["expected"] != p["found"] for p in r["pages"]), r["pages"]
        index_k = {side: next(c for c in r["layouts"][side]["components"] if c["name"] == "index_k")
                   for side in ("ours", "theirs")}
        assert (index_k["ours"]["bytes_per_token"], index_k["theirs"]["bytes_per_token"]) == (256, 132), index_k
        assert (r["layouts"]["ours_label"], r["layouts"]["theirs_label"]) == ("prefill engine", "host staging buffer")
        md = (mesh.incident_dir / f"{r['id']}.md").read_text()
        assert "index_k: 256 B/token (bf16) vs 132 B/token (fp8_e4m3)" in md, md
        assert r["config"]["faults (TEST ONLY)"] == "missize-index-k"
        assert r["place"]["request_id"] and r["place"]["trace_id"] and r["replay"]["prompt_token_ids"], r["place"]
        # No corrupted page reached decode, so the gateway saw no first-token mismatch.
        assert not list(mesh.incident_dir.glob("*first_token_mismatch*")), list(mesh.incident_dir.iterdir())
        # The gateway's counter includes the worker's report.
        m = mesh.metrics()
        assert m['mesh_incidents_total{kind="checksum"}'] == 1, m
        assert m['mesh_incidents_total{kind="first_token_mismatch"}'] == 0, m
    finally:
        stop_up(mesh)
    # The fault gone, the same address serves a healthy mesh; the report's command,
    # run as written, replays the failed request there and gets that mesh's answer.
    port = mesh.ports["gateway"]
    assert f"--url http://127.0.0.1:{port}/v1" in r["replay"]["command"], r["replay"]
    healthy = start_up(tmp_path / "healthy", forms, port=port)
    try:
        want = ask(healthy.client())
        env = dict(os.environ, PDMESH_API_KEY=API_KEY, PATH=f"{pdmesh_bin().parent}{os.pathsep}{os.environ['PATH']}")
        run = lambda *extra: subprocess.run(r["replay"]["command"] + "".join(f" {x}" for x in extra), shell=True,
                                            env=env, capture_output=True, text=True, timeout=300)
        out = run()
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["report"] == r["id"] and got["request"]["prompt"] == r["replay"]["prompt_token_ids"], got
        assert (got["answer"]["text"], got["answer"]["finish_reason"]) == (want.choices[0].message.content, want.choices[0].finish_reason)
        assert got["answer"]["completion_tokens"] == want.usage.completion_tokens
        # With a reference, the command compares and says so.
        out = run("--reference", healthy.base + "/v1")
        assert out.returncode == 0 and json.loads(out.stdout)["same_as_reference"] is True, out.stdout + out.stderr
    finally:
        stop_up(healthy)


def across_hosts(tmp, tiny, index_k: str, prefill_args=()) -> list[list[tuple[str, str]]]:
    """Every session's transcript from the mesh over three hosts (network namespaces),
    all at once; the KV crossed between the hosts' cache services."""
    h = Hosts(tmp, model=tiny, short_deadlines=False, prefill_args=prefill_args,
              worker_args=["--kv-cache-dtype=bf16", f"--index-k-dtype={index_k}"])
    try:
        client = h.openai()
        model = h.client.submit(lambda: client.models.list().data[0].id).result()
        futs = [h.client.submit(converse, client, model, s) for s in range(SESSIONS)]
        transcripts = [f.result() for f in futs]
        m = h.assert_baseline()
        assert m['mesh_kv_peer_bytes_total{direction="received"}'] > 0, "the KV crossed between the hosts"
    finally:
        h.stop()
    return transcripts


@pytest.mark.parametrize("index_k", ["bf16", "fp8"])
def test_across_hosts_is_bit_identical_to_unified_no_cache(tmp_path, tmp_path_factory, tiny, index_k):
    assert differences(across_hosts(tmp_path / "hosts", tiny, index_k), reference(tmp_path_factory, tiny, "bf16", index_k)) == 0


def test_the_seeds_bug_on_the_prefill_host_is_caught_across_hosts(tmp_path, tmp_path_factory, tiny):
    """The seed's mis-sized index-K copy, switched on in the prefill host's worker only."""
    pd = across_hosts(tmp_path / "hosts", tiny, "bf16", prefill_args=["--fault-missize-index-k-unchecked"])
    assert "FAULT INJECTION IS ON" in (tmp_path / "hosts" / "prefill.log").read_text(errors="replace")
    assert differences(pd, reference(tmp_path_factory, tiny, "bf16", "bf16")) > 0


def test_thinking_is_chosen_per_request_and_checked(tmp_path, tiny):
    """`chat_template_kwargs.thinking` (or `enable_thinking`) reaches the DeepSeek V3.2
    encoding: a thinking prompt opens `<think>`, so what the model writes is reasoning; a
    plain one closes it, so the same model writes content. A non-boolean is a 400 naming
    the field."""
    mesh = start_up(tmp_path, ["--model", str(tiny), "--no-smoke-test", "--unified", "--no-host-cache"])
    try:
        client = mesh.client()
        ask = lambda kw: client.chat.completions.create(
            model=mesh.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0,
            extra_body={"chat_template_kwargs": kw},
        )
        think, plain = ask({"thinking": True}), ask({"thinking": False})
        # The output fields differ: reasoning only, or content only ...
        t, p = think.choices[0].message, plain.choices[0].message
        assert t.model_extra.get("reasoning_content") and not t.content, t
        assert p.content and not p.model_extra.get("reasoning_content"), p
        # ... and so do the prompts (`<think>` against `</think>` after the assistant tag):
        # greedy on one prompt would write the same text, whatever field it landed in.
        assert t.model_extra["reasoning_content"] != p.content, (t, p)
        # `enable_thinking` is the same switch; no switch is a plain prompt.
        for kw, same in (({"enable_thinking": True}, think), ({"enable_thinking": False}, plain), ({}, plain)):
            r = ask(kw)
            assert r.usage.prompt_tokens == same.usage.prompt_tokens, (kw, r.usage)
            assert r.choices[0].message == same.choices[0].message, (kw, r.choices[0].message)
        with pytest.raises(openai.BadRequestError) as e:
            ask({"thinking": "yes"})
        assert "chat_template_kwargs.thinking" in str(e.value.body), e.value.body
    finally:
        stop_up(mesh)


BOOK = {
    "type": "function",
    "function": {
        "name": "fetch_book",
        "description": "Fetch a book from a shelf",
        "parameters": {
            "type": "object",
            "properties": {
                "shelf": {"type": "integer", "minimum": 0, "maximum": 13},
                "kind": {"type": "string", "enum": ["maps", "letters", "ledgers", "seeds"]},
                "fragile": {"type": "boolean"},
            },
            "required": ["shelf", "kind", "fragile"],
        },
    },
}


def test_required_calls_are_dsml_under_pd_and_parse_into_tool_calls(tmp_path, tiny):
    """The tiny model's weights are random, so only the grammar makes it call: the DSML it
    is forced to write must come back as a valid call, across the PD hand-over, streamed
    and not; in thinking mode the output is reasoning, never content."""
    import json

    import jsonschema

    mesh = start_up(tmp_path, ["--model", str(tiny), "--no-smoke-test"])
    try:
        assert mesh.ports["mode"] == "pd"
        client = mesh.client()
        kw = dict(
            model=mesh.model, messages=[{"role": "user", "content": "Fetch the maps."}], tools=[BOOK],
            # Its tokenizer (SmolLM2's) spells each fullwidth DSML sentinel in three byte
            # tokens: a call takes about 150.
            tool_choice="required", parallel_tool_calls=False, max_tokens=400, temperature=0,
        )
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        (call,) = c.message.tool_calls
        assert call.function.name == "fetch_book"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, BOOK["function"]["parameters"])

        streamed, content = {}, ""
        for ch in client.chat.completions.create(stream=True, **kw):
            if ch.choices:
                content += ch.choices[0].delta.content or ""
                for tc in ch.choices[0].delta.tool_calls or []:
                    streamed.setdefault(tc.index, [None, ""])
                    streamed[tc.index][0] = streamed[tc.index][0] or tc.function.name
                    streamed[tc.index][1] += tc.function.arguments or ""
        assert content == "" and len(streamed) == 1
        assert (streamed[0][0], json.loads(streamed[0][1])) == ("fetch_book", args), "greedy: the same call"

        think = client.chat.completions.create(
            model=mesh.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0,
            extra_body={"chat_template_kwargs": {"thinking": True}},
        )
        msg = think.choices[0].message
        assert msg.model_extra.get("reasoning_content"), msg
        assert not msg.content, "the prompt opened <think>: no </think>, no content"
    finally:
        stop_up(mesh)

"""The mesh across hosts: a gateway host (gateway + tokenizer), a prefill host (cache
service + prefill worker) and a decode host (cache service + decode worker), each in its
own network namespace with its own address, real processes talking real TCP across veth
links (nothing between hosts goes over 127.0.0.1). The KV of every request crosses from
the prefill host's cache service to the decode host's over the tcp page transport.

Answers equal a unified worker's with no cache; another KV layout on the decode host is
refused naming both; killing the prefill host, taking its link down (for a moment, and
past its leases), 50 ms delay with 5% loss, and a stopped remote cache service each end
every request within its deadline with an answer or a clean error, leave nothing held on
any host, and leave a mesh that serves again with the same answers. With the mesh's
mutual TLS the answers are the same and nothing without the mesh's certificate gets in."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOM_ARGS, raw_exchange, start_up, stop_up
from hosts import MODEL, REQUEST_DEADLINE_S, Hosts, make_certs

# A worker's or a relay's lease at a cache service, as the fault tests run it.
LEASE_S = next(int(a.split("=", 1)[1]) for a in ROOM_ARGS if a.startswith("--lease-ttl-ms=")) / 1000


LONG = " ".join(f"item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(120))
TOOLS = [{
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}]


def session(chat, s: int) -> list[str]:
    """Two turns of an agentic session. Every fourth session is forced to call a tool on
    its first turn (whose arguments must parse) and answers the tool's result on its
    second; the others talk."""
    history = [{"role": "system", "content": "You are a terse assistant."}]
    out = []
    kw = {"temperature": 0} if s % 3 else {"temperature": 0.9, "seed": s, "top_p": 0.95}
    topic = ["fruit", "color", "city", "animal"][s % 4]
    if s % 4 == 0:
        history.append({"role": "user", "content": f"Session {s}: look up the word {topic}."})
        # Greedy: a sampled argument may run past max_tokens inside its JSON string.
        kind, r = chat(history, max_tokens=80, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0)
        assert kind == "ok", r
        msg = r["choices"][0]["message"]
        calls = msg.get("tool_calls") or []
        assert calls, f"tool_choice=required gave no call: {msg}"
        for c in calls:
            assert c["function"]["name"] == "lookup"
            assert isinstance(json.loads(c["function"]["arguments"]).get("word"), str), c
        out.append(json.dumps([c["function"] for c in calls], sort_keys=True))
        # Ids are random per answer: the history names them the same way on both meshes.
        calls = [{**c, "id": f"call_{s}_{i}"} for i, c in enumerate(calls)]
        history.append({"role": "assistant", "content": None, "tool_calls": calls})
        history.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "a common word"})
    else:
        history.append({"role": "user", "content": f"Session {s}, turn 0: name a {topic}."})
        kind, r = chat(history, max_tokens=6, **kw)
        assert kind == "ok", r
        text = r["choices"][0]["message"]["content"]
        out.append(f"{r['choices'][0]['finish_reason']}:{text}")
        history.append({"role": "assistant", "content": text})
        history.append({"role": "user", "content": "And another one?"})
    kind, r = chat(history, max_tokens=6, **kw)
    assert kind == "ok", r
    out.append(f"{r['choices'][0]['finish_reason']}:{r['choices'][0]['message']['content']}")
    return out


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    h = Hosts(tmp_path_factory.mktemp("hosts"))
    yield h
    h.stop()


# 80 sessions at once on two cores: a request waits behind up to 79 others' prompts
# (median 21 s, slowest 39 s on a 2-core AVX2-only machine). This bounds a wedge, not
# the speed, which the benchmarks measure.
LOADED_WAIT_S = 180


def test_80_sessions_across_hosts_are_bit_identical_to_unified_and_nothing_is_left_held(tmp_path):
    # The services' own deadlines, as the one-host session test runs with.
    hosts = Hosts(tmp_path / "hosts", short_deadlines=False)

    def loaded_chat(messages, **kw):
        return hosts.chat(messages, wait_s=LOADED_WAIT_S, **kw)

    unified = start_up(tmp_path, ["--unified", "--no-host-cache", "--no-smoke-test"])
    try:
        client = unified.client()

        def unified_chat(messages, **kw):
            r = client.chat.completions.create(model=unified.model, messages=messages, **kw)
            return "ok", r.model_dump(exclude_none=True)

        with cf.ThreadPoolExecutor(80) as pool:
            across = list(pool.map(lambda s: session(loaded_chat, s), range(80)))
        with cf.ThreadPoolExecutor(80) as pool:
            ref = list(pool.map(lambda s: session(unified_chat, s), range(80)))
        diff = [(s, a, b) for s, (a, b) in enumerate(zip(across, ref)) if a != b]
        assert not diff, f"{len(diff)} sessions differ, e.g. {diff[:3]}"
        m = hosts.assert_baseline()
        sent, received = m['mesh_kv_peer_bytes_total{direction="sent"}'], m['mesh_kv_peer_bytes_total{direction="received"}']
        assert sent > 0 and sent == received, (sent, received)
        assert m['mesh_kv_peer_transfer_failures_total{tier="host"}'] == 0
    finally:
        assert stop_up(unified) == 0
        hosts.stop()


def ask_all(hosts: Hosts, n: int, fault=None, max_tokens=16):
    """n concurrent long-prompt requests; `fault` runs once they are handing their KV over
    between the hosts. Returns their outcomes; each must end within the deadline with an
    answer or a clean error."""
    def one(i):
        t0 = time.monotonic()
        kind, r = hosts.chat([{"role": "user", "content": f"{LONG} Question {i}: which box is blue?"}], max_tokens=max_tokens, temperature=0)
        secs = time.monotonic() - t0
        assert secs < REQUEST_DEADLINE_S + 5, f"a request took {secs:.1f}s"
        return (kind, r["choices"][0]["message"]["content"] if kind == "ok" else r)

    with cf.ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(one, i) for i in range(n)]
        if fault is not None:
            deadline = time.monotonic() + 60
            while not any(k.startswith("mesh_handovers") and v > 0 for k, v in hosts.metrics().items()):
                assert time.monotonic() < deadline, "the requests never reached a hand-over"
                time.sleep(0.05)
            fault()
        results = [f.result(timeout=REQUEST_DEADLINE_S + 60) for f in futs]
    for kind, what in results:
        assert kind == "ok" or what in (429, 500, 502, 503, 504), (kind, what)
    return results


N = 8


@pytest.fixture(scope="module")
def reference(hosts):
    # One request first puts the long shared prefix in the prefill worker's cache (as in
    # any agentic workload), so N at once compute only their own questions.
    warm = ask_all(hosts, 1)
    assert warm[0][0] == "ok", warm
    ref = ask_all(hosts, N)
    assert all(k == "ok" for k, _ in ref), ref
    hosts.assert_baseline()
    return ref


def check_after(hosts: Hosts, reference, results) -> None:
    for i, (kind, text) in enumerate(results):
        if kind == "ok":
            assert text == reference[i][1], f"request {i}: a successful answer differs from the reference"
    # Workers whose cache lease ran out meanwhile register again before they say healthy.
    hosts.wait_healthy()
    hosts.assert_baseline()
    # A restarted prefill worker has an empty prefix cache: warm it as the reference was.
    assert ask_all(hosts, 1)[0] == reference[0], "the mesh serves the same answer again"
    again = ask_all(hosts, N)
    assert again == reference, "the mesh serves the same answers again"


def test_killing_the_prefill_host_mid_transfer(hosts, reference):
    def fault():
        hosts.kill("prefill")
        hosts.kill("prefill-cache")
    results = ask_all(hosts, N, fault)
    assert any(k == "error" for k, _ in results), "the kill hit requests in flight"
    hosts.start("prefill-cache")
    hosts.start("prefill")
    hosts.wait_healthy()
    check_after(hosts, reference, results)


def test_the_prefill_hosts_link_down_mid_transfer_then_up(hosts, reference):
    def fault():
        hosts.net.link("prefill", up=False)
        time.sleep(3)  # the outage itself: how long the link stays down
        hosts.net.link("prefill", up=True)
    results = ask_all(hosts, N, fault)
    check_after(hosts, reference, results)


def test_the_prefill_hosts_link_down_past_its_leases_then_every_request_is_answered(hosts, reference):
    """The prefill host's link stays down for several leases' time while requests hand
    their KV over: the decode host's cache service lets the prefill host's relay lease
    expire, and the rooms under way with it. Once the link is back, every request is
    answered with the reference answer, the first one included: the relay registers
    again rather than naming the lease that expired, and nothing the outage left behind
    turns into a refusal."""
    expired = 'mesh_host_mirror_expired_leases_total{tier="host"}'
    before = hosts.metrics()[expired]

    def fault():
        hosts.net.link("prefill", up=False)
        time.sleep(3 * LEASE_S)  # the outage itself: how long the link stays down
        hosts.net.link("prefill", up=True)
    results = ask_all(hosts, N, fault)
    # The link is back once the gateway reaches the prefill host's worker again: the
    # first requests then, all at once, are answered, and so is every one after them.
    hosts.wait_healthy()
    first = ask_all(hosts, N)
    assert hosts.metrics()[expired] > before, "a lease expired during the outage"
    assert first == reference, f"the first requests after the link came back: {first}"
    check_after(hosts, reference, results)


def test_50ms_delay_and_5_percent_loss_between_hosts(hosts, reference):
    applied = [hosts.net.impair(h, 50, 5) for h in ("prefill", "decode")]
    print("impaired:", applied)
    try:
        # The delay is on: a connect's round trip crosses both impaired hosts' sends.
        rtt = hosts.net.connect_seconds("prefill", hosts.net.addr["decode"], 7100)
        assert rtt >= 0.09, f"a round trip of {rtt:.3f} s: the links are not delayed"
        results = ask_all(hosts, N, None)
        print("outcomes:", [k for k, _ in results])
        assert any(k == "ok" for k, _ in results), "requests are answered over the impaired links"
        m = hosts.metrics()
        assert m['mesh_kv_peer_bytes_total{direction="received"}'] > 0, "KV crossed the impaired links"
    finally:
        for h in ("prefill", "decode"):
            hosts.net.clear(h)
    check_after(hosts, reference, results)


def test_the_remote_cache_service_stopped_past_the_deadline(hosts, reference):
    def fault():
        hosts.kill("decode-cache", signal.SIGSTOP)
        time.sleep(6)  # past the room and peer deadlines (ROOM_ARGS, PEER_ARGS)
        hosts.kill("decode-cache", signal.SIGCONT)
    results = ask_all(hosts, N, fault)
    check_after(hosts, reference, results)


def test_a_decode_host_with_another_kv_layout_is_refused_naming_both(tmp_path):
    incidents = tmp_path / "incidents"
    h = Hosts(tmp_path, decode_args=["--page-size=32"], cache_args=[f"--incident-dir={incidents}"])
    try:
        kind, status = h.chat([{"role": "user", "content": "Hello there, how are you today?"}], max_tokens=4)
        assert kind == "error" and status == 500, (kind, status)
        _, body = h.http("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        msg = json.loads(body)["error"]["message"]
        print("refusal:", msg)
        # Both hosts' layouts, each with its components' bytes per token.
        assert "KV layout mismatch between hosts" in msg and msg.count("B/token") >= 4, msg
        m = h.assert_baseline()
        assert m['mesh_kv_peer_layout_refusals_total{tier="host"}'] >= 1
        assert m['mesh_kv_peer_pages_total{direction="received"}'] == 0, "nothing moved"
        # The refusing cache service wrote a report naming both layouts: side by side
        # when the peer registered with it, quoted when its page transport refused the
        # other's handshake (which carries a layout's description only).
        # (Filed by the service's housekeeping tick, a moment after the refusal.)
        deadline = time.monotonic() + 10
        while True:
            reports = [json.loads(f.read_text()) for f in sorted(incidents.glob("*.json"))]
            refused = [r for r in reports if r["kind"] == "layout_refused"]
            if refused or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert refused, reports
        r = refused[0]
        assert r["place"]["service"] == "cache" and r["place"]["worker"].startswith("peer "), r
        if "layouts" in r:
            pair = r["layouts"]
            assert {pair["ours"]["page_size"], pair["theirs"]["page_size"]} == {16, 32}, pair
            md = (incidents / f"{r['id']}.md").read_text()
            assert "## KV layouts" in md and "**differs**" in md, md
        else:
            said = json.dumps(r["details"])
            assert "page 16 tokens" in said and "page 32 tokens" in said, r
    finally:
        h.stop()


def test_a_second_turn_moves_only_the_pages_decode_does_not_hold(hosts, reference):
    """Decode's prefix cache holds the first turn's pages: the second turn's KV crossing
    between the hosts is only the rest, counted in /metrics, and its answer is the one a
    decode worker with an empty cache gives (all pages moved)."""
    page_bytes = 30 * 2 * 192 * 2 * 16  # SmolLM2's KV page: 30 layers, K and V, 192 f16, 16 tokens
    first = [{"role": "user", "content": f"{LONG} Which box is red?"}]
    kind, r = hosts.chat(first, max_tokens=8, temperature=0)
    assert kind == "ok", r
    second = [*first, {"role": "assistant", "content": r["choices"][0]["message"]["content"]},
              {"role": "user", "content": "And which one is green?"}]

    def turn() -> tuple[str, float, float]:
        before = hosts.metrics()
        kind, r = hosts.chat(second, max_tokens=8, temperature=0)
        assert kind == "ok", r
        after = hosts.metrics()
        moved = after['mesh_kv_peer_bytes_total{direction="received"}'] - before['mesh_kv_peer_bytes_total{direction="received"}']
        held = after['mesh_kv_held_pages_skipped_total{tier="host"}'] - before['mesh_kv_held_pages_skipped_total{tier="host"}']
        return r["choices"][0]["message"]["content"], moved, held

    reused, moved, held = turn()
    status, body = hosts.http("POST", "/flush_cache")
    assert status == 200, body
    cold, moved_cold, held_cold = turn()
    print(f"second turn: {moved:.0f} B moved with {held:.0f} pages held; {moved_cold:.0f} B with an empty decode cache")
    assert reused == cold, "reusing decode's pages changes nothing in the answer"
    assert held >= 60 and held_cold == 0, (held, held_cold)
    assert moved_cold - moved == held * page_bytes, (moved, moved_cold, held)
    hosts.assert_baseline()


def test_with_a_prefill_worker_on_the_decode_host_the_kv_stays_on_that_host(tmp_path):
    """Of two idle prefill workers, the one on decode's host takes a prompt nobody has
    cached: its KV goes through that host's shared memory, none crosses between hosts."""
    h = Hosts(tmp_path, prefill_on_decode_host=True)
    try:
        for i in range(4):
            kind, r = h.chat([{"role": "user", "content": f"Fresh prompt {i}: {'abc ' * (40 + i)}"}], max_tokens=4, temperature=0)
            assert kind == "ok", r
        m = h.assert_baseline()
        assert m['mesh_kv_transfer_bytes_total{side="all"}'] > 0, "the KV went through rooms"
        assert m['mesh_kv_peer_bytes_total{direction="received"}'] == 0, "no KV crossed between hosts"
    finally:
        h.stop()


def test_mutual_tls_between_every_service_and_nothing_without_the_meshs_certificate_gets_in(tmp_path, reference):
    """Each host brought up by one `pdmesh up --role` with the mesh's mutual TLS (a CA
    made for the test, a certificate per host): the answers and the pages crossing
    between the hosts are as without it; a
    plaintext client, a TLS client without a certificate and one whose certificate
    another CA signed are refused by the cache services and workers, and the page
    transport closes on a sender that does not speak TLS."""
    h = Hosts(tmp_path / "tls", tls=True, via_up=True)
    try:
        warm = ask_all(h, 1)
        assert warm[0] == reference[0], "the same answer as the plaintext mesh"
        assert ask_all(h, N) == reference, "the same answers as the plaintext mesh, all of them"
        m = h.assert_baseline()
        assert m['mesh_kv_peer_bytes_total{direction="received"}'] > 0, "KV crossed between the hosts"

        a = h.net.addr
        intruder = make_certs(tmp_path / "intruder", {"gw": [a["gw"]]}, ca_name="another CA")
        probe = str(Path(__file__).with_name("grpc_probe.py"))
        mine = ["--ca", h.certs["ca"], "--cert", h.certs["gw"][0], "--key", h.certs["gw"][1]]
        clients = {
            "mesh certificate": mine,
            "plaintext": [],
            "TLS, no certificate": ["--ca", h.certs["ca"]],
            "another CA's certificate": ["--ca", h.certs["ca"], "--cert", intruder["gw"][0], "--key", intruder["gw"][1]],
        }
        for target, method in [(f"{a['decode']}:7100", "/pdmesh.cache.v1.Cache/Stats"),
                               (f"{a['prefill']}:7200", "/pdmesh.worker.v1.Worker/Health")]:
            got = {}
            for who, args in clients.items():
                r = subprocess.run(h.net.exec_argv("gw", [sys.executable, probe, target, method, *args]),
                                   capture_output=True, text=True, timeout=30)
                got[who] = r.stdout.strip()
            print(target, got)
            assert got.pop("mesh certificate") == "ok", got
            assert all(v == "UNAVAILABLE" for v in got.values()), got

        # The mesh's own certificates, each used for a call its role is not for: the
        # gateway's registering with a cache service (as a worker or anything else), a
        # worker host's driving another host's worker or reading its KV events.
        worker_host = ["--ca", h.certs["ca"], "--cert", h.certs["prefill"][0], "--key", h.certs["prefill"][1]]
        refused = lambda: sum(v for k, v in h.metrics().items() if k.startswith("mesh_auth_refused_total"))
        before = refused()
        for target, method, args in [
            (f"{a['decode']}:7100", "/pdmesh.cache.v1.Cache/Register", mine),
            (f"{a['decode']}:7100", "/pdmesh.cache.v1.Cache/RoomOpen", mine),
            # A forged page for a prompt's prefix: neither reserved nor committed.
            (f"{a['decode']}:7100", "/pdmesh.cache.v1.Cache/Reserve", mine),
            (f"{a['decode']}:7100", "/pdmesh.cache.v1.Cache/Commit", mine),
            (f"{a['decode']}:7200", "/pdmesh.worker.v1.Worker/Generate", worker_host),
            (f"{a['decode']}:7200", "/pdmesh.worker.v1.Worker/FlushCache", worker_host),
        ]:
            r = subprocess.run(h.net.exec_argv("gw", [sys.executable, probe, target, method, *args, "--no-token"]),
                               capture_output=True, text=True, timeout=30)
            assert r.stdout.strip() == "PERMISSION_DENIED", (method, r.stdout, r.stderr)
            assert "certificate" in r.stderr, r.stderr
        assert refused() >= before + 6, "each refusal is counted"
        assert ask_all(h, 1) == reference[:1], "the answers are unchanged"

        # The page transport: a plaintext hello gets no hello reply (a status byte 0 or 1),
        # at most a TLS alert record (0x15), and a closed socket.
        log = (h.tmp / "decode.log").read_text(errors="replace")
        port = int(re.findall(r"peer_port=(\d+)", log)[-1])

        reply = h.client.submit(raw_exchange, a["decode"], port, b"PDKV" + bytes(200)).result(timeout=30)
        assert reply == b"" or reply.startswith(b"\x15\x03"), reply
        h.assert_baseline()
    finally:
        h.stop()

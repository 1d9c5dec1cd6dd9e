"""Prefill/decode disaggregation between real processes: the answers equal a unified
worker's, and faults injected into the processes (kill -9, SIGSTOP, clients leaving, a full
decode pool, a late write) end every request within its deadline, return every page and
slot, and leave a mesh that serves again."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import openai
import pytest

from conftest import (ROOM_ARGS, WORKER_ARGS, API_KEY, http, metrics, pdmesh_bin, start_up, stop_procs, stop_up,
                      wait_baseline, wait_healthy)

# Every request must end (answer or error) within this.
REQUEST_DEADLINE_S = 40


def replaced(defaults, args) -> list[str]:
    """`defaults` (`--flag=value` each) without the flags `args` name, then `args`."""
    named = {a.split("=")[0] for a in args}
    return [*(a for a in defaults if a.split("=")[0] not in named), *args]


class Services:
    """cache, tokenizer, prefill, decode and gateway as separate `pdmesh` processes, each
    one killable and restartable on its own port."""

    def __init__(self, tmp: Path, decode_args=(), prefill_env=None, cache_args=(), prefill_args=(), prefills=1, decode_env=None):
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.prefills = ["prefill"] + [f"prefill{i}" for i in range(2, prefills + 1)]
        # Each service binds port 0 and names its port in its ports file; a restart
        # binds the port it had.
        self.ports: dict[str, int] = {}
        url = lambda name: f"http://127.0.0.1:{self.ports[name]}"
        # Each service's flags, made when it starts (from the ports of those before it).
        self.argv = {
            # `cache_args` replace conftest's room deadlines they name.
            "cache": lambda: ["cache", *replaced(ROOM_ARGS, cache_args)],
            "tokenizer": lambda: ["tokenizer"],
            # `prefill_args` and `decode_args` replace conftest's worker flags they name.
            **{p: lambda: ["prefill", "--cache-url", url("cache"), *replaced(WORKER_ARGS, prefill_args)]
               for p in self.prefills},
            "decode": lambda: ["decode", "--cache-url", url("cache"), *replaced(WORKER_ARGS, decode_args)],
            "gateway": lambda: [
                "gateway",
                "--tokenizer-url", url("tokenizer"),
                "--prefill-url", ",".join(url(p) for p in self.prefills),
                "--decode-url", url("decode"),
                "--cache-url", url("cache"),
            ],
        }
        self.env = {p: prefill_env or {} for p in self.prefills} | {"decode": decode_env or {}}
        # The mesh's credential, in every service's environment (as `pdmesh up` gives it).
        self.token = secrets.token_hex(32)
        for name in self.argv:
            self.start(name)
        self.base = url("gateway")
        self.wait_healthy()

    def start(self, name: str) -> None:
        env = dict(os.environ, PDMESH_API_KEY=API_KEY, PDMESH_MESH_TOKEN=self.token, **self.env.get(name, {}))
        log = open(self.tmp / f"{name}.log", "ab")
        ports_file = self.tmp / f"{name}.ports.json"
        ports_file.unlink(missing_ok=True)
        # Every service but the tokenizer writes its incident reports here.
        reports = [f"--incident-dir={self.tmp / 'incidents'}"] if name != "tokenizer" else []
        argv = [str(pdmesh_bin()), *self.argv[name](), *reports,
                "--listen", f"127.0.0.1:{self.ports.get(name, 0)}", "--ports-file", str(ports_file)]
        self.procs[name] = p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        # Bound before the model loads: the file comes within moments.
        deadline = time.monotonic() + 60
        while not ports_file.exists():
            assert p.poll() is None, f"{name} exited with {p.returncode}:\n{self.logs()}"
            assert time.monotonic() < deadline, f"{name} wrote no ports file:\n{self.logs()}"
            time.sleep(0.02)
        self.ports[name] = json.loads(ports_file.read_text())["listen"]

    def wait_healthy(self, timeout: float = 120) -> None:
        wait_healthy(self.procs, lambda: http("GET", self.base + "/health", timeout=5)[0], self.logs, timeout)

    def kill(self, name: str, sig=signal.SIGKILL) -> None:
        self.procs[name].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[name].wait(timeout=30)

    def restart(self, name: str) -> None:
        self.start(name)
        self.wait_healthy()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(self.tmp.glob("*.log")))

    def stop(self) -> None:
        stop_procs(self.procs.values())

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, timeout=REQUEST_DEADLINE_S)

    def metrics(self) -> dict[str, float]:
        return metrics(self.base)

    def assert_baseline(self, timeout: float = 30) -> dict[str, float]:
        """Waits until nothing is held: no request in a worker, no reserved or exported
        page, every pool page free or cached, no room open, no mirror slot held by a room."""
        return wait_baseline(self.metrics, self.logs, timeout)


@pytest.fixture
def services(tmp_path, request):
    kw = getattr(request, "param", {})
    s = Services(tmp_path, **kw)
    yield s
    s.stop()


def ask(client: openai.OpenAI, prompt: str, max_tokens: int = 8, **kw) -> str:
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=kw.pop("temperature", 0),
        **kw,
    )
    return r.choices[0].message.content


LONG = " ".join(f"item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(120))


def outcome(fn):
    """Runs fn; returns ('ok', value) or ('error', HTTP status) and the seconds it took."""
    t0 = time.monotonic()
    try:
        return ("ok", fn()), time.monotonic() - t0
    except openai.APIStatusError as e:
        assert e.message, "an error says what happened"
        return ("error", e.status_code), time.monotonic() - t0
    except (openai.APIConnectionError, openai.APITimeoutError) as e:
        return ("error", type(e).__name__), time.monotonic() - t0


def wait_metrics(svc: Services, cond, what: str, timeout: float = 30) -> dict[str, float]:
    """Polls the gateway's /metrics until `cond` holds of a scrape that read every worker;
    fails the test if it does not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m = svc.metrics()
        if m["mesh_workers_read"] == 1 and cond(m):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout}s\n{svc.logs()}", pytrace=False)
        time.sleep(0.05)


def handing_over(m: dict[str, float]) -> bool:
    """Requests are in the middle of a KV hand-over: both workers have hand-overs under way
    and decode holds pages reserved for KV still in flight."""
    return (m['mesh_handovers{side="prefill"}'] > 0 and m['mesh_handovers{side="decode"}'] > 0
            and m['mesh_worker_requests{state="reserved"}'] > 0)


def under_load(svc: Services, n: int, fault, prompt=LONG, max_tokens=24):
    """n concurrent requests; `fault` runs once they are handing their KV over. Returns
    their outcomes."""
    client = svc.client()
    with cf.ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(outcome, lambda i=i: ask(client, f"{prompt} Question {i}: which box is blue?", max_tokens)) for i in range(n)]
        wait_metrics(svc, handing_over, "the requests never reached a KV hand-over")
        fault()
        results = [f.result(timeout=REQUEST_DEADLINE_S + 30) for f in futs]
    for (kind, what), secs in results:
        assert secs < REQUEST_DEADLINE_S, f"a request took {secs:.1f}s ({kind} {what})"
        assert kind == "ok" or what in (429, 503, 504, 500), (kind, what)
    return [r for r, _ in results]


def test_pd_output_is_bit_identical_to_unified_for_32_sessions(mesh, tmp_path):
    """The session mesh is disaggregated (`pdmesh up` default); a unified one answers the
    same 32 concurrent multi-turn sessions, greedy and seeded. (80 sessions at once, with
    tool calls, go across hosts in test_hosts.py.)"""
    assert mesh.ports["mode"] == "pd"
    unified = start_up(tmp_path, ["--unified", "--no-smoke-test"])
    try:
        assert unified.ports["mode"] == "unified"

        def session(client, s: int) -> list[str]:
            history = [{"role": "system", "content": "You are a terse assistant."}]
            out = []
            for turn in range(2):
                history.append({"role": "user", "content": f"Session {s}, turn {turn}: name a {['fruit', 'color', 'city', 'animal'][(s + turn) % 4]}."})
                kw = {"temperature": 0} if s % 3 else {"temperature": 0.9, "seed": s, "top_p": 0.95}
                if s % 4 == 1:
                    # Raw logprobs with alternatives, a bias and min_tokens: the same bits
                    # whichever side computed the token (the first comes from prefill)
                    # and whichever cache held the prompt (turn 2 finds turn 1's pages).
                    kw |= {"logprobs": True, "top_logprobs": 3, "logit_bias": {"28": 2.5},
                           "extra_body": {"min_tokens": 3}}
                r = client.chat.completions.create(model=mesh.model, messages=history, max_tokens=6, **kw)
                text = r.choices[0].message.content
                out.append(f"{r.choices[0].finish_reason}:{text}")
                if s % 4 == 1:
                    lp = r.choices[0].logprobs.content
                    assert len(lp) >= 3 and all(len(t.top_logprobs) == 3 for t in lp), lp
                    out.append(repr([(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs]) for t in lp]))
                history.append({"role": "assistant", "content": text})
            return out

        def run(m) -> list[list[str]]:
            client = m.client()
            with cf.ThreadPoolExecutor(32) as pool:
                return list(pool.map(lambda s: session(client, s), range(32)))

        pd, un = run(mesh), run(unified)
        diff = [(s, a, b) for s, (a, b) in enumerate(zip(pd, un)) if a != b]
        assert not diff, f"{len(diff)} sessions differ, e.g. {diff[:3]}"
        assert mesh.metrics()['mesh_kv_transfer_bytes_total{side="all"}'] > 0, "the KV really travelled"
    finally:
        assert stop_up(unified) == 0


def test_kill_prefill_mid_transfer(services):
    ref = ask(services.client(), "Which box is blue? Answer briefly.")
    services.assert_baseline()
    results = under_load(services, 12, lambda: services.kill("prefill"))
    assert any(k == "error" for k, _ in results), "the kill hit requests in flight"
    services.restart("prefill")
    services.assert_baseline()
    assert ask(services.client(), "Which box is blue? Answer briefly.") == ref


def test_kill_decode_mid_transfer(services):
    ref = ask(services.client(), "Which box is blue? Answer briefly.")
    results = under_load(services, 12, lambda: services.kill("decode"))
    assert any(k == "error" for k, _ in results)
    services.restart("decode")
    m = services.assert_baseline()
    # Prefill's rooms whose receiver died failed and gave their slots back.
    assert sum(v for k, v in m.items() if k.startswith("mesh_room_aborts_total") or k.startswith("mesh_room_timeouts_total")) > 0
    assert ask(services.client(), "Which box is blue? Answer briefly.") == ref


def test_sigstop_cache_past_the_deadline_then_sigcont(services):
    ref = ask(services.client(), "Which box is blue? Answer briefly.")

    def freeze():
        services.kill("cache", signal.SIGSTOP)
        # Stopped until the workers' transfer deadline has ended every hand-over.
        wait_metrics(services, lambda m: m['mesh_handovers{side="prefill"}'] == 0 and m['mesh_handovers{side="decode"}'] == 0,
                     "the hand-overs stuck at the stopped cache never ended", timeout=REQUEST_DEADLINE_S)
        services.kill("cache", signal.SIGCONT)

    results = under_load(services, 8, freeze)
    assert any(k == "error" for k, _ in results), "requests in transfer hit the frozen cache"
    services.wait_healthy()
    services.assert_baseline(timeout=60)
    assert ask(services.client(), "Which box is blue? Answer briefly.") == ref


def test_a_stopped_cache_service_shows_as_a_rising_handover_age_that_falls_after_recovery(services):
    """The Wedge dashboard's view of the seed's failure: the component that moves the KV
    stops answering. The cache service cannot report its rooms then, so the workers' own
    view (the oldest hand-over each side has under way) is what rises; it falls once the
    transfer deadline fails the requests, and after the service resumes every room age
    and bucket is back to zero."""
    ref = ask(services.client(), "Which box is blue? Answer briefly.")
    before = services.assert_baseline()

    def oldest(m=None) -> float:
        m = m or services.metrics()
        return max(v for k, v in m.items() if k.startswith("mesh_handover_oldest_seconds{"))

    def expired(m) -> float:
        return sum(v for k, v in m.items() if k.startswith("mesh_host_mirror_expired_leases_total"))

    assert oldest(before) == 0
    services.kill("cache", signal.SIGSTOP)
    try:
        client = services.client()
        with cf.ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(outcome, lambda i=i: ask(client, f"Question {i}: which box is blue?")) for i in range(2)]
            # Well within the transfer deadline: the requests are still waiting on the cache.
            first = oldest(wait_metrics(services, lambda m: oldest(m) > 0, "no hand-over began", timeout=8))
            wait_metrics(services, lambda m: oldest(m) > first,
                         f"the oldest hand-over's age did not rise from {first} while the cache is stopped", timeout=4)
            results = [f.result(timeout=REQUEST_DEADLINE_S + 30) for f in futs]
        for (kind, what), secs in results:
            assert kind == "error" and what in (500, 503, 504), (kind, what)
            assert secs < REQUEST_DEADLINE_S, f"a request took {secs:.1f}s"
        # The requests ended at their transfer deadline: nothing is under way any more,
        # although the cache service is still stopped.
        assert oldest() == 0
    finally:
        services.kill("cache", signal.SIGCONT)
    # Once it runs again the cache service expires the leases that missed their
    # heartbeats, and each worker finds out and registers again at its next heartbeat:
    # until then /health can still say ok while a room call would be refused. One pass of
    # its reaper ends every lease past its time at once (a lease it spares was renewed),
    # so: some expired, and as many leases are live as before the stop.
    wait_metrics(services, lambda m: expired(m) > expired(before) and m["mesh_host_mirror_leases"] >= before["mesh_host_mirror_leases"],
                 "the workers did not register again after the cache service resumed")
    services.wait_healthy()
    m = services.assert_baseline(timeout=60)
    deadline = time.monotonic() + 30
    while any(v for k, v in m.items() if k.startswith(("mesh_room_oldest_seconds{", "mesh_rooms_older_than{"))):
        assert time.monotonic() < deadline, {k: v for k, v in m.items() if k.startswith("mesh_room")}
        time.sleep(0.5)
        m = services.metrics()
    assert m["mesh_handovers{side=\"decode\"}"] == 0 and m["mesh_handovers{side=\"prefill\"}"] == 0
    # Decode ended both hand-overs as failed; the first request's went through.
    assert m['mesh_kv_transfers_total{outcome="failed"}'] == 2
    assert m['mesh_kv_transfers_total{outcome="ok"}'] == 1
    assert ask(services.client(), "Which box is blue? Answer briefly.") == ref


def _stream_and_leave(base: str, prompt: str, chunks: int) -> None:
    """Streams a completion over a raw socket and closes it after `chunks` SSE events
    (0: right after sending the request)."""
    import json as _json

    body = _json.dumps({
        "model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 200, "temperature": 0,
        "messages": [{"role": "user", "content": prompt}],
    }).encode()
    host, port = base.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    )
    seen = b""
    while seen.count(b"data:") < chunks:
        got = s.recv(4096)
        if not got:
            break
        seen += got
    s.close()


def test_client_disconnects_during_prefill_and_during_decode(services):
    ref = ask(services.client(), "Which box is blue? Answer briefly.")
    with cf.ThreadPoolExecutor(16) as pool:
        # During prefill: gone right after asking (a long prompt takes a while to compute).
        during_prefill = [pool.submit(_stream_and_leave, services.base, f"{LONG} {i}", 0) for i in range(8)]
        # During decode: gone after a few tokens.
        during_decode = [pool.submit(_stream_and_leave, services.base, f"Count to fifty, {i}.", 4) for i in range(8)]
        for f in during_prefill + during_decode:
            f.result(timeout=REQUEST_DEADLINE_S)
    services.assert_baseline()
    assert ask(services.client(), "Which box is blue? Answer briefly.") == ref


DECODE_PAGES = 64


@pytest.mark.parametrize(
    "services",
    [{
        "decode_args": [f"--kv-pages={DECODE_PAGES}", "--admission-timeout-ms=3000"],
        # The request decode serves gets 10 s for its hand-over: on two busy cores prefill's
        # engine loop, still working through the others, can be slow to copy its pages,
        # and a request failed by that is not what this test is about.
        "cache_args": ["--room-transfer-ms=10000", "--room-success-ms=10000"],
    }],
    indirect=True,
)
def test_decode_pool_exhausted_by_80_long_requests(services):
    """Decode's pool holds one of these prompts at a time (each needs more than half of its
    pages), so of 80 sent at once all but the few served one after the other within the
    admission timeout are refused: with 429, counted in /metrics, and the requests it
    served answer as they do alone."""
    client = services.client()
    ref = ask(client, "Which box is blue? Answer briefly.")
    question = lambda i: f"{LONG[:1500]} Question {i}: which box is blue?"

    def one(i: int):
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question(i)}], max_tokens=32, temperature=0,
        )
        return r.choices[0].message.content, r.usage.prompt_tokens

    # One of them first: the premise holds (a prompt takes more than half the pool, in
    # 16-token pages), and prefill's cache now holds the prefix they share, so the burst
    # costs prefill little and decode's pool is what they wait for.
    _, tokens = one(80)
    assert 2 * -(-tokens // 16) > DECODE_PAGES, f"{tokens} prompt tokens fit the pool twice"
    before = services.assert_baseline()
    with cf.ThreadPoolExecutor(80) as pool:
        results = list(pool.map(lambda i: outcome(lambda: one(i)), range(80)))
    for (kind, what), secs in results:
        assert secs < REQUEST_DEADLINE_S, f"a request took {secs:.1f}s ({kind} {what})"
    served = {i: what for i, ((kind, what), _) in enumerate(results) if kind == "ok"}
    refused = [what for (kind, what), _ in results if kind == "error"]
    assert served, "the pool serves some requests"
    assert refused, "a pool that holds one prompt at a time refused none of 80"
    assert all(w == 429 for w in refused), refused
    m = services.assert_baseline()
    grew = lambda k: m.get(k, 0) - before.get(k, 0)
    assert grew('mesh_admission_timeouts_total{side="all"}') == len(refused)
    assert grew('mesh_requests_total{endpoint="chat_completions",status="429"}') == len(refused)
    # Served under the load, each answer is the one its question gets alone.
    for i, (text, _) in served.items():
        assert ask(client, question(i), 32) == text, f"question {i}"
    assert ask(client, "Which box is blue? Answer briefly.") == ref


@pytest.mark.parametrize("services", [{"prefill_args": ["--fault-write-delay-ms=6000", "--fault-count=1"]}], indirect=True)
def test_a_late_write_is_rejected_and_reused_pages_are_untouched(services):
    client = services.client()
    # A fresh prompt, so the first (delayed) request really transfers.
    late = [None]

    def first():
        late[0] = outcome(lambda: ask(client, "Which box is red? Answer briefly.", 16))

    with cf.ThreadPoolExecutor(1) as pool:
        f = pool.submit(first)
        # Its room fails 3 s into the transfer; its pages are free again at decode.
        deadline = time.monotonic() + 20
        while not any(k.startswith("mesh_room_timeouts_total") and v > 0 for k, v in services.metrics().items()):
            assert time.monotonic() < deadline, services.logs()
            time.sleep(0.1)
        # These reuse decode's pages (and would reuse the mirror slots, were they not held)
        # while the late write is still to come.
        answers = [ask(client, f"Which box is blue? Answer briefly. ({i})", 16) for i in range(3)]
        f.result(timeout=REQUEST_DEADLINE_S)
    (kind, what), _ = late[0]
    assert kind == "error" and what == 503, late[0]
    # The late writer is detached from its request (it no longer holds the engine's
    # pages, which it staged before its room started): its commit comes 6 s into the
    # transfer, and is refused.
    wait_metrics(services, lambda m: m['mesh_room_late_writes_rejected_total{tier="host"}'] >= 1,
                 "the late write was never rejected", timeout=REQUEST_DEADLINE_S)
    m = services.assert_baseline()
    assert m['mesh_room_late_writes_rejected_total{tier="host"}'] == 1, services.logs()
    # The same questions again, with no late writer around: identical answers.
    assert answers == [ask(client, f"Which box is blue? Answer briefly. ({i})", 16) for i in range(3)]


@pytest.mark.parametrize(
    "services",
    # Prefill loads nothing back from the host mirror: every cached token a prefill
    # reports comes from its own device cache.
    [{"prefills": 2, "prefill_args": ["--host-load-min-pages=1000000"]}],
    indirect=True,
)
def test_prefill_routing_follows_the_workers_kv_events(services):
    """With two prefill workers, the gateway learns what each one's device cache holds from
    its KV events and sends a prompt to the worker holding its longest prefix."""
    client = services.client()
    texts = {
        "boxes": LONG,
        "birds": " ".join(f"bird {i} sings {['low', 'high', 'twice'][i % 3]} at dawn." for i in range(120)),
    }

    def usage(text: str, q: str):
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": f"{text} {q}"}],
            max_tokens=2,
            temperature=0,
        )
        return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    def views():
        m = services.metrics()
        return {k: v for k, v in m.items() if k.startswith("mesh_router_cached_pages{")}

    # One prompt after the other: the second shares only the chat template's first page
    # with the first, too little to follow, so it goes to the worker whose cache is emptier.
    for text in texts.values():
        assert usage(text, "First question?")[1] <= 16
    deadline = time.monotonic() + 10
    while not (len(views()) == 2 and all(v > 0 for v in views().values())):
        assert time.monotonic() < deadline, f"the gateway never learned both caches: {views()}\n{services.logs()}"
        time.sleep(0.1)
    before = services.metrics()
    # Every later prompt reuses its text's pages, so it must land where they are cached
    # (several in a row: balancing by load or cache size alone would move some away).
    for name, text in texts.items():
        for i in range(3):
            prompt, cached = usage(text, f"Question {i} about the {name}?")
            assert cached >= prompt - 64, f"{name} #{i}: {cached} of {prompt} prompt tokens cached"
    after = services.metrics()
    routed = 'mesh_route_prefill_total{reason="prefix"}'
    assert after[routed] - before.get(routed, 0) == 6


@pytest.mark.parametrize(
    "services",
    [{
        # The prefill's engine loop sleeps before its first step, so computing the first
        # prompt takes longer than decode's transfer deadline (the room waits 60 s).
        "prefill_args": ["--fault-stall-step=0:5000"],
        "decode_args": ["--transfer-timeout-ms=2000"],
    }],
    indirect=True,
)
def test_a_prefill_slower_than_the_transfer_deadline_still_hands_over(services):
    """Decode's transfer deadline bounds the transfer, not the prefill's computing: a
    prompt that takes longer to compute than that deadline (a long prompt, a slow machine)
    is answered, with the same answer as when it is cached, and nothing fails."""
    client = services.client()
    t = time.monotonic()
    first = ask(client, "Which box is blue? Answer briefly.")
    assert time.monotonic() - t >= 5, "the prefill's stall did not hold this request"
    assert ask(client, "Which box is blue? Answer briefly.") == first
    m = services.assert_baseline()
    failures = {k: v for k, v in m.items() if k.startswith("mesh_kv_transfer_failures_total")}
    assert failures and not any(failures.values()), failures
    assert services.logs().count("KV transfer failed") == 0, services.logs()


STALL_S = 10


@pytest.mark.parametrize(
    "services",
    [{
        # The decode engine loop sleeps before its 30th step, mid-generation.
        "decode_args": ["--watchdog=hard", "--watchdog-stall-ms=1000", f"--fault-stall-step=30:{STALL_S * 1000}"],
    }],
    indirect=True,
)
def test_hard_watchdog_ends_the_requests_of_a_stalled_engine_loop(services):
    """A decode engine loop that stops stepping: the hard watchdog ends its requests with
    503 well before the loop comes back, refuses new ones meanwhile, and once the loop
    moves again every page is back and the mesh answers."""
    client = services.client()

    def attempt(prompt: str, max_tokens: int):
        """('ok', text) or ('error', HTTP status, message)."""
        try:
            return ("ok", ask(client, prompt, max_tokens))
        except openai.APIStatusError as e:
            return ("error", e.status_code, e.message)

    with cf.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: attempt(f"Question {i}: name {i + 2} colors.", 64), range(6)))
    errors = [r for r in results if r[0] == "error"]
    assert errors, f"the stall ended no request: {results}"
    for r in errors:
        assert r[1] == 503 and "the watchdog ended this request" in r[2], errors
    # They all ended while the loop is still stalled (so the watchdog ended them, not the
    # loop coming back): a new request is refused now.
    refused = attempt("Still there?", 4)
    assert refused[0] == "error" and refused[1] == 503 and "refusing requests until it does" in refused[2], refused
    status, body = http("GET", services.base + "/health", timeout=10)
    assert status == 503 and json.loads(body)["worker"] == "unavailable", (status, body)
    # The loop moves again: the worker is healthy, every page is back.
    services.wait_healthy(timeout=STALL_S + 30)
    m = services.assert_baseline(timeout=STALL_S + 30)
    assert m['mesh_watchdog_aborts_total{component="engine"}'] >= len(errors)
    assert m['mesh_engine_stalls_total{side="all"}'] >= 1
    assert ask(client, "Name a fruit.", 4)
    # The stall left a report: what the watchdog saw and did.
    reports = [json.loads(f.read_text()) for f in (services.tmp / "incidents").glob("*.json")]
    stalls = [r for r in reports if r["kind"] == "engine_stall"]
    assert len(stalls) == 1 and stalls[0]["details"]["watchdog"] == "hard", reports
    assert float(stalls[0]["details"]["idle seconds"]) >= 1.0, stalls

"""A decode worker told to stop (SIGTERM, as Kubernetes does before it removes a pod)
drains: it refuses new requests, so the gateway sends them to the other decode worker;
every stream it runs finishes; then it exits, well inside its drain bound, and nothing is
left held anywhere; the gateway's `/ready` stays 200 all along.  A gateway told to stop drains too: its open streams run to their
end, `/health` says `draining` meanwhile, and it exits once they are done. A decode worker
that stops answering without exiting holds no request past the gateway's start timeout,
and is taken back once it answers again."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time

from conftest import ROOM_ARGS, WORKER_ARGS, alive, http, start_up, stop_up, wait_baseline

DRAIN_S = 20
STREAMS = 6
MAX_TOKENS = 48


def stream(client, model: str, n: int, started: cf.Future | None = None) -> tuple[str, int, str]:
    """One streamed chat answer: its text, its chunks with content, its finish reason.
    `started` is set at the first content chunk."""
    text, chunks, finish = "", 0, ""
    s = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Count from {n} upwards, one number a line."}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True})
    for c in s:
        if not c.choices:
            continue
        if c.choices[0].delta.content:
            text += c.choices[0].delta.content
            chunks += 1
            if started is not None and not started.done():
                started.set_result(time.monotonic())
        finish = c.choices[0].finish_reason or finish
    return text, chunks, finish


def sample_ready_and_health(base: str, victim: int) -> tuple[list[int], list[int]]:
    """`/ready`'s and `/health`'s statuses every 0.1 s until `victim` has exited and a
    second more."""
    ready, health, gone = [], [], None
    while gone is None or time.monotonic() - gone < 1:
        ready.append(http("GET", base + "/ready", timeout=5)[0])
        health.append(http("GET", base + "/health", timeout=5)[0])
        if gone is None and not alive(victim):
            gone = time.monotonic()
        time.sleep(0.1)
    return ready, health


def test_sigterm_drains_a_decode_worker_under_load(tmp_path):
    m = start_up(tmp_path, [
        "--restart", "--no-smoke-test", "--decode", "2",
        *(f"--cache-arg={a}" for a in ROOM_ARGS),
        *(f"--worker-arg={a}" for a in WORKER_ARGS),
        f"--decode-arg=--drain-timeout-ms={DRAIN_S * 1000}",
    ])
    try:
        client, model = m.client(), m.model
        victim = m.ports["pids"]["decode"][0]
        with cf.ThreadPoolExecutor(STREAMS + 4) as pool:
            started = [cf.Future() for _ in range(STREAMS)]
            running = [pool.submit(stream, client, model, i, started[i]) for i in range(STREAMS)]
            # Every stream is generating (least-loaded routing put half on each decode
            # worker) when the victim is told to stop.
            for f in started:
                f.result(timeout=120)
            t0 = time.monotonic()
            os.kill(victim, signal.SIGTERM)
            # New requests while it drains: all answered, by the other decode worker.
            during = [pool.submit(stream, client, model, 100 + i) for i in range(4)]
            # The gateway's readiness (what a load balancer asks) holds all along, while
            # `/health` (every worker) says one is missing: a rolling update of workers
            # never takes the gateways out of their Service.
            probes = pool.submit(sample_ready_and_health, m.base, victim)
            answers = [f.result(timeout=120) for f in running + during]
            ready, health = probes.result(timeout=DRAIN_S + 30)
        assert ready and set(ready) == {200}, ready
        assert 503 in health, health
        # Every stream, those running on the victim included, ran to its length.
        for text, chunks, finish in answers:
            assert finish == "length" and chunks > 0, (text, chunks, finish)
        # It exited once nothing ran, well before the bound.
        while alive(victim):
            assert time.monotonic() - t0 < DRAIN_S + 5, "the draining worker did not exit"
            time.sleep(0.1)
        took = time.monotonic() - t0
        log = m.log()
        assert "draining: new requests are refused" in log and "drained: nothing runs" in log, log[-4000:]
        assert "drain timed out" not in log, log[-4000:]
        assert took < DRAIN_S, took
        print(f"the decode worker drained and exited {took:.1f} s after SIGTERM")
        # Nothing held: every worker (the victim restarted by `up --restart`) idle, no
        # room open, every page back.
        wait_baseline(m.metrics, m.log, timeout=60)
    finally:
        # Restarted services have new pids: stop_up checks those are gone too.
        m.ports = json.loads((tmp_path / "ports.json").read_text())
        assert stop_up(m) == 0, m.log()[-4000:]


def test_sigterm_drains_the_gateway_its_open_streams_run_to_their_end(tmp_path):
    m = start_up(tmp_path, ["--restart", "--no-smoke-test", *(f"--worker-arg={a}" for a in WORKER_ARGS)])
    try:
        client, model = m.client(), m.model
        gateway = m.ports["pids"]["gateway"]
        with cf.ThreadPoolExecutor(3) as pool:
            started = [cf.Future() for _ in range(3)]
            running = [pool.submit(stream, client, model, i, started[i]) for i in range(3)]
            for f in started:
                f.result(timeout=120)
            t0 = time.monotonic()
            os.kill(gateway, signal.SIGTERM)
            answers = [f.result(timeout=120) for f in running]
        # The streams open at SIGTERM ran to their length through the draining gateway.
        for text, chunks, finish in answers:
            assert finish == "length" and chunks > 0, (text, chunks, finish)
        while alive(gateway):
            assert time.monotonic() - t0 < DRAIN_S + 5, "the draining gateway did not exit"
            time.sleep(0.1)
        log = m.log()
        assert "draining: open streams run on" in log and "drained: no stream is open" in log, log[-4000:]
        assert "drain timed out" not in log, log[-4000:]
        # `up --restart` brings a gateway back on the same port, which answers again.
        def healthy() -> bool:
            try:
                return http("GET", m.base + "/health", timeout=5)[0] == 200
            except OSError:  # refused while `up` restarts it
                return False

        deadline = time.monotonic() + 60
        while not healthy():
            assert time.monotonic() < deadline, m.log()[-4000:]
            time.sleep(0.2)
        assert stream(client, model, 7)[2] == "length"
    finally:
        m.ports = json.loads((tmp_path / "ports.json").read_text())
        assert stop_up(m) == 0, m.log()[-4000:]


def test_a_stopped_decode_worker_is_passed_over_after_the_start_timeout(tmp_path):
    """A decode worker that stops answering (SIGSTOP: its connections stay open, nothing
    comes back, as on a host whose link black-holes packets) holds no request: the one
    routed to it is tried again on the other decode worker once the gateway's start
    timeout passes, and the gateway says which worker it passed over, until the worker
    answers its health probe again. Every request gets the answer it gets with both
    workers up."""
    m = start_up(tmp_path, ["--no-smoke-test", "--decode", "2", "--gateway-arg=--worker-start-timeout-ms=1000"])
    victim = m.ports["pids"]["decode"][0]
    try:
        client, model = m.client(), m.model
        # A client that waits no longer than a test should: a request left with the
        # stopped worker fails here instead of hanging.
        client = client.with_options(timeout=60)
        want = stream(client, model, 1)
        os.kill(victim, signal.SIGSTOP)
        try:
            # At once, so least-loaded routing gives each decode worker some of them.
            with cf.ThreadPoolExecutor(4) as pool:
                got = list(pool.map(lambda _: stream(client, model, 1), range(4)))
        finally:
            os.kill(victim, signal.SIGCONT)
        assert got == [want] * 4, (got, want)
        log = m.log()
        assert "did not start the request within 1000 ms: passed over" in log, log[-4000:]
        # Running again, it answers the gateway's health probe and is taken back.
        deadline = time.monotonic() + 30
        while "answers again: no longer passed over" not in m.log():
            assert time.monotonic() < deadline, m.log()[-4000:]
            time.sleep(0.2)
        with cf.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda _: stream(client, model, 1), range(4))) == [want] * 4
    finally:
        assert stop_up(m) == 0, m.log()[-4000:]

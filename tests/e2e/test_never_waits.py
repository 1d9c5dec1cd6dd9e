"""Architecture Invariant, on a real mesh: the engine thread never waits on the network.
With the cache service stopped by SIGSTOP (its sockets open, nothing answering), a new
request's host-tier fetch waits out its deadline on the side, not on the engine: a stream
already running on the same (unified) worker keeps getting tokens all that time, and its
answer is the same bits as with the cache service well. Counted in tokens, not timed."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest

from conftest import http, start_up, stop_up

# Long enough to outlast the fetch's deadline (2 s) many times over on a slow machine.
A_TOKENS = 400
# What the stream must get while the new request waits for its fetch. A loop that waited
# for the cache service would give it at most the one or two tokens of the steps that
# compute the new prompt.
DURING = 10


def stream_a(client, model: str, chunks: list[str], first: threading.Event) -> None:
    s = client.completions.create(model=model, prompt="Count from one upwards, one number a line:",
                                  max_tokens=A_TOKENS, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    for c in s:
        if c.choices and c.choices[0].text:
            chunks.append(c.choices[0].text)
            first.set()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """One unified worker with the host tier: the stream and the fetch share its engine."""
    m = start_up(tmp_path_factory.mktemp("unified"), ["--unified", "--no-smoke-test"])
    yield m
    assert stop_up(m) == 0, m.log()


def test_a_stopped_cache_service_costs_a_running_stream_no_token(mesh):
    client = mesh.client()
    m = mesh.metrics()
    assert m["mesh_host_mirror_leases"] > 0, "the worker must hold a lease with the cache service"
    want = client.completions.create(model=mesh.model, prompt="Count from one upwards, one number a line:",
                                     max_tokens=A_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    cache = mesh.ports["pids"]["cache"]
    chunks: list[str] = []
    first = threading.Event()
    a = threading.Thread(target=stream_a, args=(client, mesh.model, chunks, first))
    a.start()
    try:
        assert first.wait(120), "the stream never started"
        # A prompt no cache holds: its admission fetches its pages from the host tier.
        prompt = f"{uuid.uuid4()} " + "Tell me about the colours of the sea and the sky. " * 12
        os.kill(cache, signal.SIGSTOP)
        try:
            before = len(chunks)
            b = client.completions.create(model=mesh.model, prompt=prompt, max_tokens=2, temperature=0)
            during = len(chunks) - before
        finally:
            os.kill(cache, signal.SIGCONT)
        assert b.choices[0].text, b
        assert b.usage.prompt_tokens > 32, b.usage
        assert during >= DURING, (
            f"the stream got {during} tokens while the new request waited for the stopped cache service")
    finally:
        os.kill(cache, signal.SIGCONT)
        a.join(timeout=300)
    assert not a.is_alive()
    assert "".join(chunks) == want, "the stream's answer changed"
    # The mesh is whole again: the worker still answers and the cache service runs.
    status, _ = http("GET", mesh.base + "/ready")
    assert status == 200
    # Nothing fetches any more, and the store queue (whose drops are counted) empties.
    deadline = time.monotonic() + 60
    while True:
        m = mesh.metrics()
        idle = m["mesh_kv_cache_host_fetching_requests"] == 0 and m["mesh_kv_cache_write_back_queued_pages"] == 0
        if idle:
            break
        assert time.monotonic() < deadline, {k: v for k, v in m.items() if "write_back" in k or "fetching" in k}
        time.sleep(0.2)
    assert m['mesh_kv_cache_write_back_dropped_pages_total{tier="host"}'] == 0

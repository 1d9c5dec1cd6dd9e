"""Bounded work for any request, against a running `pdmesh up` whose gateway serves at
most four generating requests at once: schemas built to cost exponential time are
prepared in linear time or refused with a 400 naming the limit while `/live` keeps
answering; past the concurrency limit clients get 503 with `Retry-After`, the accepted
requests finish, and nothing is left held."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import API_KEY, http, http_headers, start_up, stop_up, wait_baseline

LIMIT = 4
# A Kubernetes liveness probe's default timeout is 1 s; a common setting is 5 s.
LIVE_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    m = start_up(tmp_path_factory.mktemp("limits"),
                 ["--unified", "--no-host-cache", "--no-smoke-test", f"--gateway-arg=--max-concurrent-requests={LIMIT}"])
    yield m
    assert stop_up(m) == 0, m.log()


def doubling(levels: int) -> dict:
    """`levels` nested allOfs of two $refs to the next level: 2^levels paths to the leaf
    for code that follows each $ref anew."""
    defs = {f"l{i}": {"allOf": [{"$ref": f"#/$defs/l{i + 1}"}] * 2} for i in range(levels)}
    defs[f"l{levels}"] = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    return {"$ref": "#/$defs/l0", "$defs": defs}


def wide(nodes: int, names: int) -> dict:
    """`nodes` objects that each combine their own property with a definition of `names`
    properties: every node's combination unions all of them."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(names)}}
    props = {f"n{j}": {"$ref": "#/$defs/big", "properties": {"own": {}}} for j in range(nodes)}
    return {"type": "object", "properties": props, "$defs": {"big": big}}


def chat_with_schema(client: openai.OpenAI, model: str, schema: dict, max_tokens: int = 12):
    return client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "user", "content": "Give x."}],
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )


def test_exponential_schemas_are_linear_or_refused_and_live_keeps_answering(small):
    client = small.client()
    # Past the step budget: a 400 that names the field and the limit, at once.
    with pytest.raises(openai.BadRequestError) as e:
        chat_with_schema(client, small.model, wide(200, 2000))
    err = e.value.body
    assert err["param"] == "response_format.json_schema.schema", err
    assert err["message"].startswith("schema too complex") and "200000" in err["message"], err

    # Four doubling schemas in flight (23 and 40 levels, 1.9 and 3.3 KB): each prepared in
    # steps proportional to its size and answered, while /live answers throughout.
    stop = threading.Event()
    live: list[int] = []

    def probe():
        while not stop.is_set():
            status, _ = http("GET", small.base + "/live", timeout=LIVE_TIMEOUT_S)
            live.append(status)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda n: chat_with_schema(client, small.model, doubling(n), 24),
                                    [23, 40, 23, 40]))
    finally:
        stop.set()
        prober.join()
    assert live and set(live) == {200}, live
    for a in answers:
        text = a.choices[0].message.content
        if a.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text)["x"], int), text
        else:
            assert text.startswith('{"x":'), text
    wait_baseline(small.metrics, small.log)


def test_past_the_concurrency_limit_clients_get_503_with_retry_after_and_nothing_leaks(small):
    client = small.client()
    before = small.metrics()
    streams = []
    try:
        for i in range(LIMIT):
            s = client.chat.completions.create(
                model=small.model, max_tokens=24, temperature=0, stream=True,
                messages=[{"role": "user", "content": f"Count to twenty, run {i}."}])
            first = next(iter(s))  # admitted and generating: it holds a permit
            assert first.choices or first.usage is not None
            streams.append(s)
        body = json.dumps({"model": small.model, "max_tokens": 4,
                           "messages": [{"role": "user", "content": "hi"}]}).encode()
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        status, raw, got = http_headers("POST", small.base + "/v1/chat/completions", body, headers)
        assert status == 503, raw
        assert got.get("retry-after") == "1", got
        err = json.loads(raw)["error"]
        assert err["code"] == "overloaded" and str(LIMIT) in err["message"], err
        # The accepted ones run to their end.
        for s in streams:
            chunks = list(s)
            assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason in ("length", "stop")
    finally:
        for s in streams:
            s.close()
    # Every permit came back: a request goes through again, and the workers are idle.
    ok = client.chat.completions.create(model=small.model, max_tokens=4, temperature=0,
                                        messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].finish_reason in ("length", "stop")
    after = wait_baseline(small.metrics, small.log)
    shed = 'mesh_errors_total{error_type="overloaded"}'
    assert after.get(shed, 0) - before.get(shed, 0) == 1, {k: v for k, v in after.items() if "errors" in k}


def test_stop_strings_and_metadata_past_their_bounds_are_400s_naming_the_field(small):
    status, body = http("POST", small.base + "/v1/chat/completions", json.dumps(
        {"model": small.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
         "stop": ["x" * 257]}).encode(),
        {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert status == 400 and json.loads(body)["error"]["param"] == "stop", body
    status, body = http("POST", small.base + "/v1/responses", json.dumps(
        {"model": small.model, "input": "hi", "max_output_tokens": 4,
         "metadata": {f"k{i}": "v" for i in range(17)}}).encode(),
        {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert status == 400 and json.loads(body)["error"]["param"] == "metadata", body


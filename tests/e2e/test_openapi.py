"""The gateway's own OpenAPI document (`GET /openapi.json`), and Schemathesis run against
a real `pdmesh up` with it: for every operation, requests generated from the document
(valid ones, and ones that break it) must never get a 5xx, every answer must have a
documented status and content type, routes that declare the API key must refuse a
request without it, and every refusal must be the gateway's error shape naming the
field it refuses (`refusals_name_the_field`).

The run is bounded (EXAMPLES per operation and mode, deterministic) and keeps
generations short: the served model's name replaces a generated one, and a token limit
the document allows up to the context's end is cut to MAX_NEW_TOKENS (the only changes
made to generated requests). The document carries the limits the gateway checks on
single fields, so those examples are valid; what depends on other fields or on the
model (the vocabulary's size, which roles may carry tool calls, `min_tokens` against
`max_tokens`) is refused with a 400 naming the field, as the checks require."""

from __future__ import annotations

import json
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    ignored_auth,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from conftest import ADMIN_KEY, API_KEY, http

# Every route the gateway serves, as the document must list it.
OPERATIONS = [
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/messages",
    "POST /v1/responses",
    "GET /v1/responses/{id}",
    "DELETE /v1/responses/{id}",
    "GET /v1/models",
    "GET /v1/models/{model}",
    "POST /tokenize",
    "POST /detokenize",
    "POST /flush_cache",
    "GET /health",
    "GET /ready",
    "GET /live",
    "GET /metrics",
    "GET /openapi.json",
    "GET /debug/incidents",
    "GET /debug/incidents/{id}",
]
# Operations whose valid examples must include at least one the gateway serves (2xx):
# the run reached the model, not only the request checks.
MUST_SERVE = {
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/messages",
    "POST /v1/responses",
    "GET /v1/responses/{id}",
    "GET /v1/models/{model}",
    "POST /tokenize",
    "POST /detokenize",
}
# Examples per operation and generation mode (positive, then negative).
EXAMPLES = 25
MAX_NEW_TOKENS = 8
# The body field that bounds a generation, per generating route (the first one given
# wins, as the gateway reads them).
TOKEN_FIELDS = {
    "/v1/chat/completions": ("max_completion_tokens", "max_tokens"),
    "/v1/completions": ("max_completion_tokens", "max_tokens"),
    "/v1/responses": ("max_output_tokens",),
    "/v1/messages": ("max_tokens",),
}
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}
# A refusal for a field the request left out says so (serde's "missing field `x`", the
# tokenizer's "give exactly one of `prompt` and `messages`").
LEFT_OUT = re.compile(r"missing|required|exactly one of", re.IGNORECASE)


def _word(name: str, text: str) -> bool:
    return re.search(r"(?<![A-Za-z0-9_])" + re.escape(name) + r"(?![A-Za-z0-9_])", text) is not None


def _documented_fields(case) -> set[str]:
    """The top-level properties the operation's JSON body schema documents (in it, and in
    the schemas it is composed of)."""
    doc = case.operation.schema.raw_schema
    body = doc["paths"][case.operation.path][case.operation.method.lower()].get("requestBody")
    if not body:
        return set()

    def fields(schema: dict) -> set[str]:
        if "$ref" in schema:
            schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        out = set(schema.get("properties", {}))
        for key in ("allOf", "oneOf", "anyOf"):
            for part in schema.get(key, []):
                out |= fields(part)
        return out

    return fields(body["content"]["application/json"]["schema"])


@schemathesis.check
def refusals_name_the_field(ctx, response, case):
    """Every 4xx is JSON in the gateway's error shape: `{"error": {"message", "type",
    "param", "code"}}` with exactly those keys, a non-empty message, `param` and `code`
    strings or null (on `/v1/messages`, past the key check, Anthropic's `{"type":
    "error", "error": {"type", "message"}}`). A 400 or 404 about a request whose body is
    a JSON object, or that has path or query parameters, names the field it refuses:

    - a `param` names one: its root (before `.` or `[`) is a field the request sent (a
      body key, a path or query parameter), or one it left out when the message says so
      (`missing field`, `exactly one of`) and the document has that field;
    - with no `param` (Anthropic's shape has none), the message names, as a word, a
      documented field the request sent, or a path or query parameter; a 404 may
      instead quote the value of a path parameter (`no incident "x"`): what the path
      names does not exist.

    Only a body that is not a JSON object (not JSON, or another JSON type) may be refused
    without naming a field. It fails on a non-JSON 4xx, a missing, extra or mistyped
    error key, an empty message, a `param` naming a field the request does not have (or
    left out without saying so), and a field refusal that names none of the request's
    fields."""
    status = response.status_code
    if not 400 <= status < 500:
        return None
    try:
        body = json.loads(response.content)
    except ValueError as e:
        raise AssertionError(f"a {status} that is not JSON ({e}): {response.content[:300]!r}") from None
    anthropic = case.operation.path == "/v1/messages" and status != 401
    if anthropic:
        assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
        err = body["error"]
        assert isinstance(err, dict) and set(err) == {"type", "message"}, body
        assert isinstance(err["type"], str), body
        param = None
    else:
        assert isinstance(body, dict) and set(body) == {"error"}, body
        err = body["error"]
        assert isinstance(err, dict) and set(err) == OPENAI_ERROR_KEYS, body
        assert isinstance(err["type"], str), body
        assert err["param"] is None or isinstance(err["param"], str), body
        assert err["code"] is None or isinstance(err["code"], str), body
        param = err["param"]
    message = err["message"]
    assert isinstance(message, str) and message, body
    if status not in (400, 404):
        # The key check, a body past the size limit, a full queue: not about one field.
        return None
    sent_body = case.body if isinstance(case.body, dict) else None
    named = set(case.path_parameters or {}) | set(case.query or {})
    if sent_body is None and not named:
        return None
    sent = set(sent_body or {}) | named
    documented = _documented_fields(case)
    if param is not None:
        root = re.match(r"[^.\[]*", param).group(0)
        left_out = root in documented and root not in sent and LEFT_OUT.search(message) and _word(root, message)
        assert root in sent or left_out, (
            f"{status} names `{param}`, which the request does not have "
            f"(it sent {sorted(sent)}): {body}"
        )
    else:
        candidates = (sent & documented) | named
        if LEFT_OUT.search(message):
            candidates |= documented
        quoted = status == 404 and any(
            f"{q}{v}{q}" in message for v in (case.path_parameters or {}).values() for q in "\"'`"
        )
        assert quoted or any(_word(f, message) for f in candidates), (
            f"{status} names none of the request's fields ({sorted(sent)}): {body}"
        )
    return None


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, ignored_auth, refusals_name_the_field]


@pytest.fixture(scope="module")
def api(mesh):
    # Read as a dict: loaded from its URL, Schemathesis would leave the document's own
    # route out. Requests go to `mesh.base`.
    status, body = http("GET", mesh.base + "/openapi.json")
    assert status == 200, body
    return schemathesis.openapi.from_dict(json.loads(body))


@pytest.fixture(scope="module")
def context_length(mesh) -> int:
    status, body = http("POST", mesh.base + "/tokenize", json.dumps({"prompt": "x"}).encode(),
                        {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert status == 200, body
    return json.loads(body)["max_model_len"]


@pytest.fixture(scope="module")
def stored_response(mesh) -> str:
    """A stored response's id, for the valid examples of `/v1/responses/{id}`."""
    status, body = http("POST", mesh.base + "/v1/responses",
                        json.dumps({"model": mesh.model, "input": "Hi", "max_output_tokens": 2}).encode(),
                        {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert status == 200, body
    return json.loads(body)["id"]


def test_the_document_lists_every_route_and_parses_as_openapi_3_1(mesh, api):
    status, body = http("GET", mesh.base + "/openapi.json")
    assert status == 200, body
    doc = json.loads(body)
    assert doc["openapi"].startswith("3.1"), doc["openapi"]
    labels = sorted(f"{m.upper()} {p}" for p, item in doc["paths"].items() for m in item)
    assert labels == sorted(OPERATIONS)
    # Schemathesis reads every operation of it.
    loaded = sorted(r.ok().label for r in api.get_all_operations())
    assert loaded == sorted(OPERATIONS)
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["required"]
    for field in ("cache_salt", "max_tokens", "response_format"):
        assert field in chat["properties"], field


def test_the_refusal_check_fails_where_it_should(api):
    """`refusals_name_the_field` on answers made up here: it lets the gateway's kinds of
    refusals through and fails the kinds it exists to catch."""
    chat = api["/v1/chat/completions"]["POST"]
    messages = api["/v1/messages"]["POST"]
    incident = api["/debug/incidents/{id}"]["GET"]
    body = {"model": "m", "messages": [], "max_completion_tokens": 5}

    def openai_error(message, param=None, **extra):
        return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None,
                          **extra}}

    def anthropic_error(message):
        return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}

    def passes(operation, status, answer, **case) -> bool:
        content = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        try:
            refusals_name_the_field(None, SimpleNamespace(status_code=status, content=content),
                                    operation.Case(**case))
        except AssertionError:
            return False
        return True

    # The gateway's refusals.
    assert passes(chat, 400, openai_error("messages must not be empty", "messages"), body=body)
    assert passes(chat, 400, openai_error("unknown role", "messages[0].role"), body=body)
    assert passes(chat, 400, openai_error("invalid request: missing field `model`", "model"), body={"messages": []})
    assert passes(chat, 400, openai_error("invalid logit_bias: token 9 is listed twice"),
                  body={**body, "logit_bias": {"9": 1}})
    assert passes(chat, 400, openai_error("could not parse the JSON body of the request"), body=[1])
    assert passes(chat, 401, openai_error("Incorrect API key provided."), body=body)
    assert passes(messages, 400, anthropic_error("stop_sequences: at most 4 stop strings are allowed"),
                  body={"model": "m", "stop_sequences": []})
    assert passes(messages, 401, openai_error("Incorrect API key provided."), body={"model": "m"})
    assert passes(incident, 404, openai_error('no incident "x1"'), path_parameters={"id": "x1"})
    # What it exists to catch.
    assert not passes(chat, 400, b"Bad Request", body=body)
    assert not passes(chat, 400, {"error": {"message": "bad", "type": "t", "param": None}}, body=body)
    assert not passes(chat, 400, openai_error("bad", "messages", extra=1), body=body)
    assert not passes(chat, 400, openai_error("", "messages"), body=body)
    assert not passes(chat, 400, openai_error("too long: reduce max_tokens", "max_tokens"), body=body)
    assert not passes(chat, 400, openai_error("schema too complex"), body=body)
    assert not passes(messages, 400, anthropic_error("at most 4 stop strings are allowed"),
                      body={"model": "m", "stop_sequences": []})
    assert not passes(messages, 400, openai_error("unknown role", "model"), body={"model": "m"})
    assert not passes(incident, 404, openai_error("not found"), path_parameters={"id": "x1"})


def _bound(case, mesh, context_length: int) -> None:
    """The served model in place of a generated name, and generations cut short (see the
    module's docstring)."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = mesh.model
    fields = TOKEN_FIELDS.get(case.operation.path)
    if fields is None:
        return
    given_fields = [f for f in fields if body.get(f) is not None]
    if not given_fields and case.operation.path != "/v1/messages":
        body[fields[-1]] = MAX_NEW_TOKENS
    for f in given_fields:
        v = body[f]
        # Past the context it is refused before generating: left as generated.
        if isinstance(v, int) and not isinstance(v, bool) and MAX_NEW_TOKENS < v < context_length:
            body[f] = MAX_NEW_TOKENS


@pytest.mark.parametrize("label", OPERATIONS)
def test_schemathesis(api, mesh, context_length, stored_response, label):
    method, path = label.split(" ", 1)
    operation = api[path][method]
    key = ADMIN_KEY if path.startswith("/debug/") else API_KEY
    headers = {"Authorization": f"Bearer {key}"}
    statuses: dict[GenerationMode, Counter] = {}
    has_inputs = bool(len(operation.body) or len(operation.query) or len(operation.path_parameters))
    # Without a body or parameters there is nothing to break, and one request to make.
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if has_inputs else [GenerationMode.POSITIVE]
    for mode in modes:
        seen = statuses[mode] = Counter()
        # Valid examples of the lookups name what exists (the served model, a stored
        # response); the negative ones name whatever was generated (404s).
        fixed = {}
        if mode == GenerationMode.POSITIVE and path == "/v1/models/{model}":
            fixed = {"path_parameters": {"model": mesh.model}}
        if mode == GenerationMode.POSITIVE and path == "/v1/responses/{id}":
            fixed = {"path_parameters": {"id": stored_response}}

        @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate, Phase.shrink],
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode, **fixed))
        def run(case):
            _bound(case, mesh, context_length)
            response = case.call(base_url=mesh.base, headers=headers, timeout=120)
            seen[response.status_code] += 1
            case.validate_response(response, checks=CHECKS, headers=headers)

        run()
        # The statuses seen, shown when the test fails.
        print(label, mode.value, dict(seen))
        least = 3 if has_inputs and not fixed else 1
        assert sum(seen.values()) >= least, f"{label}, {mode.value}: only {dict(seen)}"
    served = sum(n for s, n in statuses[GenerationMode.POSITIVE].items() if 200 <= s < 300)
    if label in MUST_SERVE:
        assert served, f"{label}: no valid example was served: {dict(statuses[GenerationMode.POSITIVE])}"

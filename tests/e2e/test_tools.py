"""Tool calls, tool_choice and structured outputs through the whole mesh with the openai
client, on the default model (SmolLM2-135M, whose calls are Hermes `<tool_call>` JSON).

A model this small rarely calls a tool on its own; `tool_choice: required` or a named
function constrains decoding to the model's own call format, so it must return a valid
call every time. Markup must never reach content, and a block that fails to parse must
fail the request and be counted, not be shown.
"""

from __future__ import annotations

import json
import os
import subprocess

import jsonschema
import openai
import pytest

from conftest import ADMIN_KEY, API_KEY, WEATHER_FUNCTION, fixture, http, pdmesh_bin

WEATHER = {"type": "function", "function": WEATHER_FUNCTION}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}, "24h": {"type": "boolean"}},
            "required": ["timezone", "24h"],
        },
    },
}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def chat(client, mesh, **kw):
    kw.setdefault("max_tokens", 80)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=mesh.model, **kw)


def stream_chat(client, mesh, **kw):
    """(content, tool calls as {index: [id, name, args]}, finish_reason, chunks)."""
    chunks = list(chat(client, mesh, stream=True, **kw))
    content, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            call = calls.setdefault(tc.index, [None, None, ""])
            if tc.id:
                assert call[0] is None, "the id comes once, in the first delta"
                call[0] = tc.id
            if tc.function and tc.function.name:
                assert call[1] is None and call[2] == "", "the name comes first, once"
                call[1] = tc.function.name
            if tc.function and tc.function.arguments:
                assert call[1] is not None, "arguments after the name"
                call[2] += tc.function.arguments
        finish = c.finish_reason or finish
    return content, calls, finish, chunks


def check_call(name, args_json, tool):
    assert name == tool["function"]["name"]
    args = json.loads(args_json)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_or_named_tool_choice_returns_a_valid_call(client, mesh, choice):
    r = chat(client, mesh, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content is None, c.message
    assert len(c.message.tool_calls) == 1, c.message.tool_calls
    tc = c.message.tool_calls[0]
    assert tc.type == "function" and tc.id.startswith("call_")
    tool = WEATHER if tc.function.name == "get_weather" else TIME
    if isinstance(choice, dict):
        assert tc.function.name == "get_weather"
    check_call(tc.function.name, tc.function.arguments, tool)

    # Streaming gives the same call, id and name first, then argument fragments.
    content, calls, finish, chunks = stream_chat(
        client, mesh, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False
    )
    assert finish == "tool_calls"
    assert content == "", f"markup leaked into content: {content!r}"
    assert list(calls) == [0]
    cid, name, args = calls[0]
    assert cid.startswith("call_")
    assert (name, json.loads(args)) == (tc.function.name, json.loads(tc.function.arguments)), "greedy: same call"


def test_naming_the_other_tool_calls_it(client, mesh):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = chat(client, mesh, messages=ASK, tools=[WEATHER, TIME], tool_choice=named)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"], "a named choice allows one call of that tool"
    args = check_call("get_time", calls[0].function.arguments, TIME)
    assert isinstance(args["24h"], bool)
    _, scalls, finish, _ = stream_chat(client, mesh, messages=ASK, tools=[WEATHER, TIME], tool_choice=named)
    assert finish == "tool_calls" and [c[1] for c in scalls.values()] == ["get_time"]


def test_tool_choice_none_renders_no_tools_and_returns_text(client, mesh):
    plain = chat(client, mesh, messages=ASK, max_tokens=8)
    none = chat(client, mesh, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8)
    auto = chat(client, mesh, messages=ASK, tools=[WEATHER], max_tokens=8)
    # The prompt is the prompt without tools: nothing about them was rendered.
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 30, "auto renders the tools"
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_json_schema_output_validates(client, mesh):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "population": {"type": "integer", "minimum": 0, "maximum": 50000000},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "population", "capital"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    msgs = [{"role": "user", "content": "Describe Paris as JSON."}]
    r = chat(client, mesh, messages=msgs, response_format=rf, max_tokens=120)
    assert r.choices[0].finish_reason == "stop", r
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    content, calls, finish, _ = stream_chat(client, mesh, messages=msgs, response_format=rf, max_tokens=120)
    assert (content, calls, finish) == (r.choices[0].message.content, {}, "stop")

    r = chat(client, mesh, messages=msgs, response_format={"type": "json_object"}, max_tokens=120)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def closed(schema):
    """`schema` with `additionalProperties: false` on every object that names properties."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def no_whitespace_between_tokens(text):
    """True when the JSON `text` has no whitespace outside its strings."""
    import re

    return not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text))


def test_a_json_schema_without_additional_properties_gets_only_its_properties(client, mesh):
    # The schema does not say `additionalProperties`: as with OpenAI's, vLLM's and
    # SGLang's strict default, the answer holds the named properties and nothing else, so
    # the model cannot wander off into keys it invents until the length limit.
    schema = fixture("city_schema.json")
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    msgs = [{"role": "user", "content": "JSON for the city of Cairo with its population."}]
    r = chat(client, mesh, messages=msgs, response_format=rf, max_tokens=120)
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    out = json.loads(c.message.content)
    jsonschema.validate(out, closed(schema))
    assert set(out) == {"name", "country", "population_millions"}, out
    assert no_whitespace_between_tokens(c.message.content), c.message.content


BOOK = {
    "type": "function",
    "function": {
        "name": "book_flight",
        "description": "Book a flight for one passenger",
        "parameters": {
            "type": "object",
            "properties": {
                "passenger": {"$ref": "#/$defs/person"},
                "legs": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
                        "required": ["from", "to"],
                    },
                    "minItems": 1,
                    "maxItems": 2,
                },
            },
            "required": ["passenger", "legs"],
            "$defs": {
                "person": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                    "required": ["name", "age"],
                }
            },
        },
    },
}


def inlined(tool):
    """`tool` with its parameters' `$defs` written in place."""
    t = json.loads(json.dumps(tool))
    params = t["function"]["parameters"]
    params["properties"]["passenger"] = params.pop("$defs")["person"]
    return t


@pytest.mark.parametrize("defs", [True, False], ids=["defs", "inline"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book_flight"}}])
def test_a_forced_calls_arguments_hold_only_the_declared_parameters(client, mesh, choice, defs):
    tool = BOOK if defs else inlined(BOOK)
    msgs = [{"role": "user", "content": "Book a flight from Paris to Rome for Ann, who is 34."}]
    r = chat(client, mesh, messages=msgs, tools=[tool], tool_choice=choice, parallel_tool_calls=False, max_tokens=160)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    [tc] = c.message.tool_calls
    assert tc.function.name == "book_flight"
    args = json.loads(tc.function.arguments)
    jsonschema.validate(args, closed(tool["function"]["parameters"]))
    assert set(args) == {"passenger", "legs"}, args
    assert set(args["passenger"]) == {"name", "age"}, args
    assert all(set(leg) == {"from", "to"} for leg in args["legs"]), args


def test_a_conversation_with_tool_results_continues(client, mesh):
    first = chat(client, mesh, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "clear"})},
    ]
    r = chat(client, mesh, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=24)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length") and c.message.tool_calls is None
    assert c.message.content
    # The call and its result were rendered into the prompt.
    without_call = chat(client, mesh, messages=ASK, max_tokens=1)
    without_result = chat(client, mesh, messages=history[:-1], tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert r.usage.prompt_tokens > without_result.usage.prompt_tokens + 10
    assert without_result.usage.prompt_tokens > without_call.usage.prompt_tokens + 10

    # A second required call after the result is again valid.
    again = chat(client, mesh, messages=history, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    tc = again.choices[0].message.tool_calls[0]
    check_call(tc.function.name, tc.function.arguments, WEATHER)
    assert tc.id != call.id, "ids are unique per response"


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name"),
        (dict(response_format={"type": "yaml"}), "response_format"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    ],
)
def test_bad_tool_requests_are_400_naming_the_param(client, mesh, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, mesh, messages=ASK, **kw)
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize(
    "message, needle",
    [
        ({"role": "user", "content": "x", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "tool_calls"),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1"}}]}, "arguments"),
    ],
)
def test_malformed_tool_history_is_400(client, mesh, message, needle):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, mesh, messages=ASK + [message, {"role": "user", "content": "and?"}])
    assert needle in e.value.message


def test_markup_that_fails_to_parse_fails_the_request_and_is_counted(client, mesh):
    # The grammar makes the model write a tool-call block that never closes, inside a
    # JSON string; with tools offered, the parser sees the markup and must fail closed.
    schema = {"type": "string", "const": '<tool_call>\n{"name": "get_weather", oops'}
    rf = {"type": "json_schema", "json_schema": {"name": "leak", "schema": schema}}
    key = 'mesh_tool_call_parse_failures_total{parser="hermes",reason="unterminated"}'
    before = mesh.metrics().get(key, 0)
    with pytest.raises(openai.InternalServerError) as e:
        chat(client, mesh, messages=ASK, tools=[WEATHER], response_format=rf)
    assert "failed to parse" in e.value.message
    with pytest.raises(openai.APIError) as e:
        stream_chat(client, mesh, messages=ASK, tools=[WEATHER], response_format=rf)
    assert "failed to parse" in str(e.value)
    assert mesh.metrics().get(key, 0) == before + 2
    assert mesh.metrics()['mesh_incidents_total{kind="tool_parse"}'] >= 2


def test_a_parse_failure_files_an_incident_report_without_secrets_or_prompt_text(client, mesh):
    schema = {"type": "string", "const": '<tool_call>\n{"name": "get_weather", oops'}
    rf = {"type": "json_schema", "json_schema": {"name": "leak", "schema": schema}}
    with pytest.raises(openai.InternalServerError):
        chat(client, mesh, messages=ASK, tools=[WEATHER], response_format=rf)
    # The gateway lists it (behind the admin key, never the API key); one report per
    # cause, its repeats counted.
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    status, raw = http("GET", mesh.base + "/debug/incidents", None, admin)
    assert status == 200, raw
    found = [i for i in json.loads(raw)["data"] if i["kind"] == "tool_parse"]
    assert len(found) == 1 and found[0]["repeats"] >= 1 and found[0]["service"] == "gateway", found
    assert http("GET", mesh.base + "/debug/incidents", None, {})[0] == 401
    assert http("GET", mesh.base + "/debug/incidents", None, {"Authorization": f"Bearer {API_KEY}"})[0] == 401
    report_id = found[0]["id"]
    status, md = http("GET", f"{mesh.base}/debug/incidents/{report_id}?format=markdown", None, admin)
    assert status == 200 and md.decode().startswith("# Output failed to parse"), md
    # On disk, owner-only, Markdown and JSON: the evidence, never the key, the prompt's
    # text or ids, the tools or the output that failed (no --incident-include-prompts).
    assert (mesh.incident_dir.stat().st_mode & 0o777) == 0o700
    text = (mesh.incident_dir / f"{report_id}.md").read_text()
    report = json.loads((mesh.incident_dir / f"{report_id}.json").read_text())
    for leaked in (API_KEY, ADMIN_KEY, ASK[0]["content"], "get_weather", "oops"):
        assert leaked not in text and leaked not in json.dumps(report), leaked
    assert report["details"]["parser"] == "hermes" and report["details"]["reason"] == "unterminated"
    assert "detail" not in report["details"], report["details"]
    assert int(report["details"]["prompt tokens"]) > 0, report["details"]
    assert report["place"]["request_id"].startswith("chatcmpl-")
    assert not report["replay"].get("prompt_token_ids") and "messages" not in report["replay"]["body"], report["replay"]
    assert report["config"]["api_key"] == "[redacted]"
    # The gateway's figures a second before and at the failure.
    parse = next(m for m in report["metrics"] if m["name"] == "tool-call outputs that failed to parse")
    assert parse["after"] >= 1 and parse["before"] is not None and parse["before"] <= parse["after"], report["metrics"]
    assert report["replay"]["command"].startswith("pdmesh bench replay "), report["replay"]
    # `pdmesh incident` reads the directory, or asks the gateway with the admin key.
    listed = subprocess.run([str(pdmesh_bin()), "incident", "list", "--dir", str(mesh.incident_dir)],
                            capture_output=True, text=True, check=True).stdout
    assert report_id in listed and "tool_parse" in listed
    shown = subprocess.run([str(pdmesh_bin()), "incident", "show", report_id, "--gateway", mesh.base],
                           capture_output=True, text=True, check=True,
                           env=dict(os.environ, PDMESH_ADMIN_KEY=ADMIN_KEY)).stdout
    assert shown == md.decode()


def test_a_schema_the_grammar_cannot_compile_is_400(client, mesh):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, mesh, messages=ASK, response_format=rf)
    assert "grammar" in e.value.message
    # The worker is fine afterwards.
    assert chat(client, mesh, messages=ASK, max_tokens=2).choices[0].finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [29, 32, 45])
def test_calls_cut_off_by_max_tokens_keep_the_complete_ones_and_end_with_length(client, mesh, max_tokens):
    # With parallel calls allowed SmolLM2 writes a call and goes on to another; these
    # limits stop it inside the second call's opening marker (`\n<` at 29 tokens,
    # `\n<tool_call` at 32) and inside its JSON (45). The answer is the complete call with
    # "length", nothing of the unfinished one: no 500, no markup as content, no arguments
    # that do not parse, whole or streamed, and no parse failure counted.
    def failures():
        return sum(v for k, v in mesh.metrics().items() if k.startswith("mesh_tool_call_parse_failures_total"))

    before = failures()
    kw = dict(messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=True, max_tokens=max_tokens)
    r = chat(client, mesh, **kw)
    c = r.choices[0]
    assert c.finish_reason == "length", (max_tokens, c)
    assert r.usage.completion_tokens == max_tokens
    assert not c.message.content, f"max_tokens {max_tokens}: content {c.message.content!r}"
    calls = [(tc.function.name, tc.function.arguments) for tc in c.message.tool_calls or []]
    assert len(calls) == 1, f"max_tokens {max_tokens}: the complete call is kept, only it: {calls}"
    for name, args in calls:
        check_call(name, args, WEATHER if name == "get_weather" else TIME)

    content, scalls, finish, _ = stream_chat(client, mesh, **kw)
    assert finish == "length", max_tokens
    assert content == "", f"max_tokens {max_tokens}: markup leaked into content: {content!r}"
    assert [(n, json.loads(a)) for _, n, a in (scalls[i] for i in sorted(scalls))] == [
        (n, json.loads(a)) for n, a in calls
    ], f"max_tokens {max_tokens}: streamed, the same complete calls and only those"
    assert failures() == before, "a cut is not a parse failure"

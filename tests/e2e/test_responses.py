"""OpenAI's Responses API (`/v1/responses`) on the running mesh, through the official
`openai` client: answers equal the chat endpoint's for the same conversation (greedy), a
forced function call continued with its output through `previous_response_id`, streams
that end in the plain response, the store (`GET`, `DELETE`, `store: false`), and 400s
naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from conftest import WEATHER_FUNCTION

INSTRUCTIONS = "Be brief."
QUESTION = "Name three primary colors."
# The Responses API's function tool is flat: the function's fields beside "type".
WEATHER = {"type": "function", **WEATHER_FUNCTION, "strict": True}
ASK = "What's the weather in Paris?"
FORCED = {"type": "function", "name": "get_weather"}


def respond(client, mesh, **kw):
    kw.setdefault("max_output_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.responses.create(model=mesh.model, **kw)


def shape(r):
    """A response's output without its random ids."""
    out = []
    for o in r.output:
        if o.type == "message":
            out.append((o.type, o.status, [(c.type, c.text) for c in o.content]))
        elif o.type == "function_call":
            out.append((o.type, o.status, o.name, o.arguments))
        else:
            out.append((o.type, [c.text for c in o.content or []]))
    return out


def streamed(client, mesh, **kw):
    """(event types, the deltas' text and arguments, the final response) of one stream."""
    kw.setdefault("max_output_tokens", 24)
    kw.setdefault("temperature", 0)
    with client.responses.stream(model=mesh.model, **kw) as s:
        events = list(s)
        final = s.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    return [e.type for e in events], text, args, final


@pytest.fixture(scope="module")
def plain(client, mesh):
    """A greedy answer that ends on its own (`completed`, so a stream has a final response)."""
    r = respond(client, mesh, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=96)
    assert r.status == "completed", r
    return r


def test_an_answer_equals_the_chat_endpoints_and_is_stored(client, mesh, plain):
    chat = client.chat.completions.create(
        model=mesh.model, max_tokens=96, temperature=0,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
    r = plain
    assert r.id.startswith("resp_") and r.object == "response" and r.model == mesh.model
    assert [o.type for o in r.output] == ["message"] and r.output[0].id.startswith("msg_")
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert (r.instructions, r.temperature, r.max_output_tokens, r.store) == (INSTRUCTIONS, 0, 96, True)
    # A length cut is `incomplete`, with the reason.
    short = respond(client, mesh, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=3)
    assert (short.status, short.incomplete_details.reason, short.usage.output_tokens) == (
        "incomplete", "max_output_tokens", 3)
    assert r.output_text.startswith(short.output_text)
    # Stored: GET returns it as it was; DELETE forgets it.
    assert client.responses.retrieve(short.id).model_dump() == short.model_dump()
    client.responses.delete(short.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(short.id)
    assert mesh.metrics()['mesh_requests_total{endpoint="responses",status="200"}'] >= 3


def test_a_forced_call_then_its_output_through_previous_response_id(client, mesh):
    r = respond(client, mesh, input=ASK, tools=[WEATHER], tool_choice=FORCED, max_output_tokens=64)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r
    call = calls[0]
    assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The result goes back as a function_call_output item; the stored turn comes first.
    r2 = respond(client, mesh, previous_response_id=r.id, tools=[WEATHER],
                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}])
    assert r2.previous_response_id == r.id and r2.usage.input_tokens > r.usage.input_tokens
    # The same conversation through the chat endpoint gives the same answer.
    chat = client.chat.completions.create(model=mesh.model, max_tokens=24, temperature=0, tools=[{
        "type": "function", "function": WEATHER_FUNCTION}], messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C."},
    ]).choices[0].message
    assert r2.output_text == (chat.content or "")
    assert [(o.name, o.arguments) for o in r2.output if o.type == "function_call"] == [
        (c.function.name, c.function.arguments) for c in chat.tool_calls or []]


def test_streams_end_in_the_plain_response(client, mesh, plain):
    types, text, _, final = streamed(client, mesh, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=96)
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert text == final.output_text == plain.output_text
    assert shape(final) == shape(plain)
    # (The cached part of the prompt differs: the plain request filled the prefix cache.)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (plain.usage.input_tokens, plain.usage.output_tokens)
    # A function call streams its arguments.
    forced = dict(input=ASK, tools=[WEATHER], tool_choice=FORCED, max_output_tokens=64)
    types, _, args, final = streamed(client, mesh, **forced)
    assert types[2] == "response.output_item.added" and types[-1] == "response.completed"
    assert types[-3:-1] == ["response.function_call_arguments.done", "response.output_item.done"]
    assert "response.function_call_arguments.delta" in types
    assert shape(final) == shape(respond(client, mesh, **forced))
    assert [o.arguments for o in final.output if o.type == "function_call"] == [args]


def test_store_false_is_not_continued(client, mesh):
    r = respond(client, mesh, input="Hi!", store=False, max_output_tokens=4)
    assert r.store is False
    with pytest.raises(openai.NotFoundError) as info:
        respond(client, mesh, input="And then?", previous_response_id=r.id)
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_bad_requests_name_the_field(client, mesh):
    for kw, param in [
        (dict(tools=[{"type": "web_search_preview"}]), "tools[0].type"),
        (dict(tools=[WEATHER], tool_choice="always"), "tool_choice"),
        (dict(max_output_tokens=0), "max_output_tokens"),
        (dict(extra_body={"background": True}), "background"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]),
         "input[0].content[0]"),
    ]:
        kw.setdefault("input", "hi")
        with pytest.raises(openai.BadRequestError) as info:
            respond(client, mesh, **kw)
        assert info.value.body["param"] == param, (kw, info.value.body)
        assert info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        mesh.client(api_key="wrong").responses.create(model=mesh.model, input="hi")

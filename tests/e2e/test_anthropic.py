"""Anthropic's Messages API (`/v1/messages`) on the running mesh, through the official
`anthropic` client: plain and streamed answers equal the OpenAI endpoint's, stop
sequences, a forced tool call and its result, and errors with Anthropic's statuses."""

from __future__ import annotations

import anthropic
import pytest

from conftest import API_KEY

QUESTION = "Name three primary colors."
# The client has no sampling arguments; the API takes them in the body (default 1.0).
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def claude(mesh) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=mesh.base, api_key=API_KEY, max_retries=0, timeout=120)


def test_an_answer_equals_the_chat_endpoints_streamed_or_not(claude, client, mesh):
    msgs = [{"role": "user", "content": QUESTION}]
    r = claude.messages.create(model=mesh.model, max_tokens=24, extra_body=GREEDY, system="Be brief.", messages=msgs)
    chat = client.chat.completions.create(
        model=mesh.model, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, *msgs])
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == chat.choices[0].message.content
    assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    with claude.messages.stream(model=mesh.model, max_tokens=24, extra_body=GREEDY, system="Be brief.",
                                messages=msgs) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == r.content[0].text
    assert [(b.type, b.text) for b in final.content] == [("text", r.content[0].text)]
    assert final.stop_reason == r.stop_reason
    assert final.usage.output_tokens == r.usage.output_tokens


def test_a_stop_sequence_is_named(claude, mesh):
    first = claude.messages.create(model=mesh.model, max_tokens=16, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": QUESTION}]).content[0].text
    stop = first.split()[1]
    r = claude.messages.create(model=mesh.model, max_tokens=16, extra_body=GREEDY, stop_sequences=[stop],
                               messages=[{"role": "user", "content": QUESTION}])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert stop not in r.content[0].text and first.startswith(r.content[0].text)


def test_a_forced_tool_call_and_its_result(claude, mesh):
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    r = claude.messages.create(model=mesh.model, max_tokens=64, extra_body=GREEDY, tools=[WEATHER],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True}, messages=[ask])
    assert r.stop_reason == "tool_use", r
    calls = [b for b in r.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and isinstance(calls[0].input.get("city"), str)
    with claude.messages.stream(model=mesh.model, max_tokens=64, extra_body=GREEDY, tools=[WEATHER],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}, messages=[ask]) as s:
        final = s.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(calls[0].name, calls[0].input)]
    # The result goes back as a tool_result block; the model answers in text.
    r2 = claude.messages.create(model=mesh.model, max_tokens=24, extra_body=GREEDY, tools=[WEATHER], messages=[
        ask,
        {"role": "assistant", "content": [{"type": "tool_use", "id": calls[0].id, "name": "get_weather",
                                           "input": calls[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C."}]},
    ])
    assert r2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert r2.content and r2.usage.input_tokens > r.usage.input_tokens


def test_errors_have_anthropics_statuses(claude, mesh):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=4, messages=msgs)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=mesh.base, api_key="wrong", max_retries=0).messages.create(
            model=mesh.model, max_tokens=4, messages=msgs)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=mesh.model, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in info.value.body["error"]["message"]

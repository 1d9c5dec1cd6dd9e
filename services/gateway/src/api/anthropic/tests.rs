//! Tests of the Messages API's translation to the chat request and of its answers.

use super::*;

fn req(body: Value) -> MessagesRequest {
    serde_json::from_value(body).unwrap()
}

#[test]
fn a_tool_conversation_becomes_the_chat_requests_messages() {
    let r = req(json!({
        "model": "m", "max_tokens": 20, "system": [{"type": "text", "text": "Be brief."}],
        "stop_sequences": ["\n\n"], "temperature": 0.5, "top_k": 5,
        "tools": [{"name": "weather", "description": "Weather now",
                   "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "tool_choice": {"type": "tool", "name": "weather", "disable_parallel_tool_use": true},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "Thanks!"}]},
        ],
    }));
    let o = r.to_openai().unwrap();
    let roles: Vec<&str> = o["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
    assert_eq!(o["messages"][0]["content"], "Be brief.");
    assert_eq!(
        o["messages"][2]["tool_calls"][0]["function"]["arguments"],
        r#"{"city":"Paris"}"#
    );
    assert_eq!(
        (
            &o["messages"][3]["tool_call_id"],
            &o["messages"][3]["content"]
        ),
        (&json!("t1"), &json!("sunny"))
    );
    assert_eq!(
        o["tools"][0]["function"]["parameters"]["properties"]["city"]["type"],
        "string"
    );
    assert_eq!(o["tool_choice"]["function"]["name"], "weather");
    assert_eq!(o["parallel_tool_calls"], false);
    assert_eq!(
        (&o["stop"], &o["max_tokens"], &o["top_k"]),
        (&json!(["\n\n"]), &json!(20), &json!(5))
    );
    // Parsed by the chat endpoint's own types.
    let chat: ChatRequest = serde_json::from_value(o.clone()).unwrap();
    assert_eq!(chat.messages().unwrap().len(), 5);
    let fields: SamplingFields = serde_json::from_value(o).unwrap();
    assert_eq!(fields.to_params().unwrap().stop, ["\n\n"]);
}

#[test]
fn what_cannot_be_honoured_is_refused_by_name() {
    let image = req(
        json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}),
    );
    assert_eq!(
        image.to_openai().unwrap_err().param.as_deref(),
        Some("messages[0].content[0]")
    );
    let role = req(
        json!({"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}),
    );
    assert_eq!(
        role.to_openai().unwrap_err().param.as_deref(),
        Some("messages[0].role")
    );
    let hot = req(json!({"model": "m", "max_tokens": 5, "temperature": 1.5, "messages": []}));
    assert_eq!(
        hot.to_openai().unwrap_err().param.as_deref(),
        Some("temperature")
    );
    let e = json::parse::<MessagesRequest>(br#"{"model": "m", "messages": []}"#).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("max_tokens"));
}

/// Errors of the translated chat request named chat fields (`stop` for
/// `stop_sequences`), which the Messages request does not have.
#[test]
fn translated_errors_name_the_messages_fields() {
    let named = |param: &str| {
        anthropic_param(ApiError::invalid_param(
            param,
            "at most 4 stop strings are allowed",
        ))
        .param
        .unwrap()
    };
    assert_eq!(named("stop"), "stop_sequences");
    assert_eq!(named("chat_template_kwargs.thinking"), "thinking");
    assert_eq!(named("tools[2].function.name"), "tools[2].name");
    assert_eq!(
        named("tools[0].function.parameters"),
        "tools[0].input_schema"
    );
    assert_eq!(named("max_tokens"), "max_tokens");
    let resp = anthropic_error(anthropic_param(ApiError::invalid_param(
        "stop",
        "at most 4 stop strings are allowed, got 5",
    )));
    assert_eq!(resp.status(), 400);
    let tool_use = |input: Value, name: &str| {
        req(json!({"model": "m", "max_tokens": 5, "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": name, "input": input}]}]}))
            .to_openai()
            .unwrap_err()
            .param
            .unwrap()
    };
    assert_eq!(tool_use(json!("x"), "f"), "messages[1].content[0].input");
    assert_eq!(tool_use(json!({}), ""), "messages[1].content[0].name");
    // Integers written as whole floats are integers.
    let r: MessagesRequest =
        json::parse(br#"{"model": "m", "max_tokens": 4.0, "top_k": 2.0, "messages": []}"#).unwrap();
    assert_eq!((r.max_tokens, r.top_k), (4, Some(2)));
}

#[test]
fn stop_reasons_and_errors_in_anthropics_terms() {
    let done = |finish_reason, stop: Option<&str>| Done {
        finish_reason,
        usage: Default::default(),
        stop_sequence: stop.map(str::to_owned),
    };
    assert_eq!(stop_reason(&done("stop", None)), "end_turn");
    assert_eq!(stop_reason(&done("stop", Some("\n"))), "stop_sequence");
    assert_eq!(stop_reason(&done("length", None)), "max_tokens");
    assert_eq!(stop_reason(&done("tool_calls", None)), "tool_use");
    let resp = anthropic_error(ApiError::model_not_found("x"));
    assert_eq!(resp.status(), 404);
}

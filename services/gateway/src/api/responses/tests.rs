//! Tests of the Responses API: its field checks, input items, translation to the chat
//! request, and the answers and events built from a generation.

use std::collections::BTreeMap;

use super::request::parse_items;
use super::*;
use crate::clients::output::ToolCallDelta;
use crate::generate::{Done, Usage};

fn req(body: Value) -> ResponsesRequest {
    serde_json::from_value(body).unwrap()
}

fn chat_of(body: Value) -> Result<Value, ApiError> {
    let r = req(body);
    r.to_chat(&r.input_items()?)
}

/// A function call item whose arguments are not a JSON object was refused by the
/// tokenizer as `messages[0].tool_calls[0].function.arguments`, a chat field.
#[test]
fn function_call_items_are_checked_by_name() {
    let call = |name: &str, arguments: &str| {
        parse_items(&[
            json!({"role": "user", "content": "x"}),
            json!({"type": "function_call", "call_id": "c", "name": name, "arguments": arguments}),
        ])
        .map(|_| ())
    };
    call("f", r#"{"a": 1}"#).unwrap();
    for (name, arguments, param) in [
        ("f", "", "input[1].arguments"),
        ("f", "[1]", "input[1].arguments"),
        ("", "{}", "input[1].name"),
    ] {
        let e = call(name, arguments).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{name:?} {arguments:?}");
    }
    let r = req(json!({"model": "m", "input": "x", "max_output_tokens": 3.0}));
    assert_eq!(r.max_output_tokens, Some(3));
}

/// A worker's refusal of a grammar had no `param`.
#[test]
fn grammar_refusals_name_the_field_the_grammar_came_from() {
    let refusal = || {
        ApiError::from(tonic::Status::invalid_argument(
            "invalid grammar: at 1(8): failed to compile JSON schema: regex parse error",
        ))
    };
    let e = responses_param(blame_grammar(refusal(), Some("response_format")));
    assert_eq!(e.param.as_deref(), Some("text.format"));
    let e = blame_grammar(refusal(), Some("tools"));
    assert_eq!(e.param.as_deref(), Some("tools"));
    let other = ApiError::from(tonic::Status::invalid_argument("invalid top_p: got 0"));
    assert_eq!(blame_grammar(other, Some("tools")).param, None);
}

fn param(e: ApiError) -> String {
    e.param.unwrap_or_default()
}

#[test]
fn items_become_the_chat_requests_messages() {
    let o = chat_of(json!({
            "model": "m", "instructions": "Be brief.",
            "tools": [{"type": "function", "name": "weather", "description": "Weather now", "strict": true,
                       "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "function", "name": "weather"}, "parallel_tool_calls": false,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": true}},
            "reasoning": {"effort": "low"},
            "input": [
                {"role": "developer", "content": "Answer in French."},
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{\"city\":\"Lyon\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
                {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
                {"role": "assistant", "content": "Sunny in Paris."},
                {"role": "user", "content": "Thanks!"},
            ],
        }))
        .unwrap();
    let msgs = o["messages"].as_array().unwrap();
    let roles: Vec<&str> = msgs.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(
        roles,
        [
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
            "tool",
            "assistant",
            "user"
        ]
    );
    assert_eq!(msgs[0]["content"], "Be brief.");
    assert_eq!(msgs[2]["content"], "Weather in Paris?");
    // Reasoning, text and both calls are one assistant turn.
    assert_eq!(
        (&msgs[3]["content"], &msgs[3]["reasoning_content"]),
        (&json!("Checking."), &json!("Look it up."))
    );
    assert_eq!(msgs[3]["tool_calls"][1]["id"], "c2");
    assert_eq!(
        msgs[3]["tool_calls"][0]["function"]["arguments"],
        r#"{"city":"Paris"}"#
    );
    assert_eq!(
        (&msgs[5]["tool_call_id"], &msgs[5]["content"]),
        (&json!("c2"), &json!("rain"))
    );
    assert!(
        msgs[6].get("reasoning_content").is_none(),
        "encrypted reasoning is dropped"
    );
    assert_eq!(
        o["tools"][0]["function"]["parameters"]["properties"]["city"]["type"],
        "string"
    );
    assert_eq!(
        o["tool_choice"],
        json!({"type": "function", "function": {"name": "weather"}})
    );
    assert_eq!(o["parallel_tool_calls"], false);
    assert_eq!(o["response_format"]["json_schema"]["name"], "w");
    assert_eq!(o["chat_template_kwargs"]["thinking"], true);
    // Parsed and checked by the chat endpoint's own types.
    let chat: ChatRequest = serde_json::from_value(o).unwrap();
    assert_eq!(chat.messages().unwrap().len(), 8);
    let tools = crate::generate::tools::parse_tools(chat.tools.as_ref()).unwrap();
    assert_eq!(
        crate::generate::tools::parse_tool_choice(chat.tool_choice.as_ref(), &tools).unwrap(),
        crate::generate::tools::ToolChoice::Named("weather".into())
    );
    assert!(
        crate::generate::tools::response_schema(chat.response_format.as_ref())
            .unwrap()
            .is_some()
    );
}

#[test]
fn a_string_input_is_one_user_message_and_choices_pass_through() {
    let o = chat_of(json!({"model": "m", "input": "hi", "tool_choice": "required"})).unwrap();
    assert_eq!(o["messages"], json!([{"role": "user", "content": "hi"}]));
    assert_eq!(o["tool_choice"], "required");
    assert!(o.get("chat_template_kwargs").is_none());
    let o = chat_of(json!({"model": "m", "input": "hi", "reasoning": {"effort": "none"}})).unwrap();
    assert!(
        o.get("chat_template_kwargs").is_none(),
        "effort none is no thinking"
    );
}

#[test]
fn what_cannot_be_honoured_is_refused_by_name() {
    let check = |body: Value| check_fields(body.as_object().unwrap()).map_err(param);
    assert_eq!(
        check(json!({"model": "m", "input": "x", "background": true})),
        Err("background".into())
    );
    assert_eq!(
        check(json!({"truncation": "auto"})),
        Err("truncation".into())
    );
    assert_eq!(
        check(json!({"include": ["reasoning.encrypted_content"]})),
        Err("include".into())
    );
    assert_eq!(check(json!({"max_tokens": 5})), Err("max_tokens".into()));
    assert_eq!(
        check(json!({"conversation": "conv_1"})),
        Err("conversation".into())
    );
    assert_eq!(
        check(
            json!({"background": false, "truncation": "disabled", "include": [], "prompt": null,
                         "user": "u", "seed": 3, "top_k": 5, "service_tier": "auto"})
        ),
        Ok(())
    );
    let bad = |body: Value| param(chat_of(body).unwrap_err());
    let base = |extra: Value| {
        let mut b = json!({"model": "m", "input": "x"});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    assert_eq!(
        bad(base(json!({"tools": [{"type": "web_search_preview"}]}))),
        "tools[0].type"
    );
    let e = chat_of(base(
        json!({"tools": [{"type": "function", "name": "f"}, {"type": "file_search"}]}),
    ))
    .unwrap_err();
    assert!(e.message.contains("\"file_search\""), "{}", e.message);
    assert_eq!(
        bad(base(json!({"tool_choice": {"type": "web_search_preview"}}))),
        "tool_choice"
    );
    assert_eq!(
        bad(base(json!({"tool_choice": {"type": "function"}}))),
        "tool_choice.name"
    );
    assert_eq!(
        bad(base(json!({"text": {"format": {"type": "xml"}}}))),
        "text.format.type"
    );
    assert_eq!(
        bad(base(json!({"reasoning": {"effort": "max"}}))),
        "reasoning.effort"
    );
    assert_eq!(bad(json!({"model": "m", "input": []})), "input");
    assert_eq!(
        bad(json!({"model": "m", "input": [{"role": "tool", "content": "x"}]})),
        "input[0].role"
    );
    assert_eq!(
        bad(json!({"model": "m", "input": [{"type": "web_search_call", "id": "w"}]})),
        "input[0].type"
    );
    assert_eq!(
        bad(
            json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})
        ),
        "input[0].content[0]"
    );
    assert_eq!(
        bad(json!({"model": "m", "input": [{"type": "function_call_output", "output": "x"}]})),
        "input[0]"
    );
    assert_eq!(
        bad(
            json!({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]})
        ),
        "input[0].arguments"
    );
    let e = json::parse::<ResponsesRequest>(br#"{"input": "x"}"#).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("model"));
}

#[test]
fn chat_errors_are_renamed_to_the_responses_fields() {
    let named = |p: &str| param(responses_param(ApiError::invalid_param(p, "x")));
    assert_eq!(named("max_tokens"), "max_output_tokens");
    assert_eq!(named("messages[3].content"), "input");
    assert_eq!(named("tools[1].function.name"), "tools[1].name");
    assert_eq!(
        named("response_format.json_schema.name"),
        "text.format.name"
    );
    assert_eq!(named("response_format"), "text.format");
    assert_eq!(named("chat_template_kwargs.thinking"), "reasoning");
    assert_eq!(named("temperature"), "temperature");
    // The chat checks themselves, on a translated request.
    let o = chat_of(
        json!({"model": "m", "input": "x", "tools": [{"type": "function", "name": "bad name"}]}),
    )
    .unwrap();
    let chat: ChatRequest = serde_json::from_value(o).unwrap();
    let e = crate::generate::tools::parse_tools(chat.tools.as_ref()).unwrap_err();
    assert_eq!(param(responses_param(e)), "tools[0].name");
}

fn done(finish_reason: &'static str) -> Done {
    Done {
        finish_reason,
        usage: Usage {
            prompt_tokens: 10,
            completion_tokens: 4,
            cached_tokens: 2,
        },
        stop_sequence: None,
    }
}

fn call(index: u32, id: &str, name: &str, arguments: &str) -> GenEvent {
    GenEvent::ToolCall(ToolCallDelta {
        index,
        id: id.into(),
        name: name.into(),
        arguments: arguments.into(),
    })
}

#[test]
fn the_builder_streams_items_in_order_and_ends_with_the_same_output() {
    let mut b = Builder::default();
    let mut events = Vec::new();
    for ev in [
        GenEvent::Reasoning("Hmm".into()),
        GenEvent::Reasoning(".".into()),
        GenEvent::Text("Let me ".into()),
        GenEvent::Text("check.".into()),
        call(0, "call_a", "weather", "{\"city\":"),
        call(0, "", "", "\"Paris\"}"),
        call(1, "call_b", "time", "{}"),
    ] {
        events.extend(b.push(ev));
    }
    let (status, end) = b.finish(&done("tool_calls"));
    events.extend(end);
    assert_eq!(status, "completed");
    let kinds: Vec<&str> = events.iter().map(|(k, _)| *k).collect();
    assert_eq!(
        kinds,
        [
            "response.output_item.added",
            "response.content_part.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
    );
    let seqs: Vec<u64> = events
        .iter()
        .map(|(_, v)| v["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, (0..events.len() as u64).collect::<Vec<_>>());
    // Each item's done event carries the item the final output holds.
    let done_items: Vec<&Value> = events
        .iter()
        .filter(|(k, _)| *k == "response.output_item.done")
        .map(|(_, v)| &v["item"])
        .collect();
    assert_eq!(done_items, b.items.iter().collect::<Vec<_>>());
    assert_eq!(
        b.items[0]["content"][0],
        json!({"type": "reasoning_text", "text": "Hmm."})
    );
    assert_eq!(b.items[1]["content"][0]["text"], "Let me check.");
    assert!(b.items[1]["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        (
            &b.items[2]["call_id"],
            &b.items[2]["name"],
            &b.items[2]["arguments"]
        ),
        (
            &json!("call_a"),
            &json!("weather"),
            &json!("{\"city\":\"Paris\"}")
        )
    );
    assert!(b.items[2]["id"].as_str().unwrap().starts_with("fc_"));
    assert_eq!(b.items[3]["name"], "time");
    assert_eq!(
        b.history,
        [
            Item::Reasoning("Hmm.".into()),
            Item::Message {
                role: "assistant".into(),
                text: "Let me check.".into()
            },
            Item::Call {
                call_id: "call_a".into(),
                name: "weather".into(),
                arguments: "{\"city\":\"Paris\"}".into()
            },
            Item::Call {
                call_id: "call_b".into(),
                name: "time".into(),
                arguments: "{}".into()
            },
        ]
    );
}

#[test]
fn metadata_past_openais_bounds_is_a_400_naming_it() {
    let meta = |pairs: Vec<(String, String)>| pairs.into_iter().collect::<BTreeMap<_, _>>();
    let ok = meta(
        (0..16)
            .map(|i| (format!("k{i}"), "v".repeat(512)))
            .collect(),
    );
    assert!(check_metadata(Some(&ok)).is_ok());
    for (bad, param) in [
        (
            meta((0..17).map(|i| (format!("k{i}"), "v".into())).collect()),
            "metadata",
        ),
        (meta(vec![("k".repeat(65), "v".into())]), "metadata"),
        (meta(vec![("k".into(), "v".repeat(513))]), "metadata.k"),
    ] {
        let e = check_metadata(Some(&bad)).unwrap_err();
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)));
    }
}

#[test]
fn the_response_object_echoes_the_request_and_says_why_it_is_incomplete() {
    let r = req(json!({
        "model": "m", "input": "x", "instructions": "Be brief.", "max_output_tokens": 4, "store": false,
        "metadata": {"k": "v"}, "temperature": 0, "previous_response_id": "resp_1",
    }));
    let echo = Echo::new(&r, "resp_2".into(), "served".into());
    assert!(!echo.store, "store: false is not remembered");
    let mut b = Builder::default();
    drop(b.push(GenEvent::Text("Hi".into())));
    let (status, _) = b.finish(&done("length"));
    let o = echo.object(status, &b.items, Some(&done("length")), None);
    assert_eq!(
        (o["status"].as_str(), &o["incomplete_details"]),
        (Some("incomplete"), &json!({"reason": "max_output_tokens"}))
    );
    assert_eq!(o["output"][0]["status"], "incomplete");
    // A call is only ever sent whole: a cut after it leaves it completed.
    let mut b = Builder::default();
    drop(b.push(call(0, "call_a", "f", "{}")));
    let (status, _) = b.finish(&done("length"));
    assert_eq!(
        (status, &b.items[0]["status"]),
        ("incomplete", &json!("completed"))
    );
    assert_eq!(
        (
            &o["instructions"],
            &o["max_output_tokens"],
            &o["metadata"],
            &o["store"],
            &o["temperature"]
        ),
        (
            &json!("Be brief."),
            &json!(4),
            &json!({"k": "v"}),
            &json!(false),
            &json!(0.0)
        )
    );
    assert_eq!(
        (&o["previous_response_id"], &o["tool_choice"], &o["model"]),
        (&json!("resp_1"), &json!("auto"), &json!("served"))
    );
    assert_eq!(o["usage"]["input_tokens_details"]["cached_tokens"], 2);
    assert_eq!(o["usage"]["total_tokens"], 14);
    let failed = echo.object("failed", &[], None, Some(&ApiError::backend("boom")));
    assert_eq!(
        failed["error"],
        json!({"code": "server_error", "message": "boom"})
    );
    assert!(failed["usage"].is_null());
}

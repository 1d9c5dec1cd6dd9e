//! Anthropic's Messages API (`POST /v1/messages`), translated to the chat endpoint's own
//! request and back: system prompt, text, `tool_use` and `tool_result` blocks, tools and
//! `tool_choice`, `stop_sequences`, thinking on models that reason, usage, and streaming
//! with Anthropic's event types. Errors keep their status and take Anthropic's body
//! shape. Fields this server cannot honour (images, documents, `n`-like options) are a
//! 400 naming them, never dropped.

use std::convert::Infallible;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use utoipa::ToSchema;
use utoipa::openapi::schema::{ArrayBuilder, Object, Schema, SchemaType, Type};

use super::handler::body_bytes;
use crate::error::ApiError;
use crate::generate::chat::{ChatRequest, blame_grammar, prepare_chat};
use crate::generate::sampling::{MAX_STOP, SamplingFields, stop_string};
use crate::generate::schema::strings;
use crate::generate::{self, Done, GenEvent};
use crate::json::{self, whole};
use crate::state::AppState;

/// `POST /v1/messages`. The limits in the `schema` attributes are the chat endpoint's,
/// which checks the translated request (Anthropic's own for `temperature`).
#[derive(Debug, Deserialize, ToSchema)]
#[schema(
    as = AnthropicMessagesRequest,
    description = "The body of `POST /v1/messages`, as Anthropic's Messages API takes it."
)]
pub(crate) struct MessagesRequest {
    /// The served model's name (`GET /v1/models`).
    model: String,
    /// Most tokens to generate; the prompt and these must fit in the model's context.
    #[schema(minimum = 1)]
    #[serde(deserialize_with = "whole::int")]
    max_tokens: i64,
    #[schema(min_items = 1)]
    messages: Vec<InMessage>,
    /// The system prompt: a string or text blocks.
    system: Option<Content>,
    /// Strings that end the answer (where the model writes one).
    #[schema(schema_with = crate::api::anthropic::stop_sequences)]
    stop_sequences: Option<Vec<String>>,
    #[schema(minimum = 0, maximum = 1)]
    temperature: Option<f64>,
    #[schema(exclusive_minimum = 0, maximum = 1)]
    top_p: Option<f64>,
    #[schema(minimum = -1, maximum = 2147483647)]
    #[serde(default, deserialize_with = "whole::opt")]
    top_k: Option<i64>,
    /// Answer with Anthropic's server-sent events.
    stream: Option<bool>,
    tools: Option<Vec<Tool>>,
    tool_choice: Option<ToolChoice>,
    thinking: Option<Thinking>,
    /// Accepted and unused (a user id for abuse tracking).
    #[allow(dead_code)]
    metadata: Option<Value>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = AnthropicMessage)]
struct InMessage {
    #[schema(schema_with = crate::api::anthropic::anthropic_role)]
    role: String,
    content: Content,
}

/// A string, or a list of typed blocks.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
#[schema(as = AnthropicContent)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

/// A content block. Blocks of other types (`image`, `document`, ...) are read as `Other`
/// and refused with a 400 that names them (the OpenAPI document leaves `Other` out).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
#[schema(
    as = AnthropicContentBlock,
    description = "A content block: the types served here (others are refused with a 400 naming the block)."
)]
enum Block {
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        #[schema(min_length = 1)]
        name: String,
        #[schema(value_type = Object)]
        input: Value,
    },
    ToolResult {
        tool_use_id: String,
        /// A string or text blocks (blocks hold blocks: the schema refers to itself).
        #[schema(no_recursion)]
        content: Option<Content>,
        #[serde(default)]
        is_error: bool,
    },
    Thinking {
        thinking: String,
    },
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = AnthropicTool)]
struct Tool {
    name: String,
    description: Option<String>,
    /// The JSON schema of the tool's input.
    #[schema(value_type = Object)]
    input_schema: Value,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
#[schema(as = AnthropicToolChoice)]
enum ToolChoice {
    Auto {
        #[serde(default)]
        disable_parallel_tool_use: bool,
    },
    Any {
        #[serde(default)]
        disable_parallel_tool_use: bool,
    },
    None,
    Tool {
        name: String,
        #[serde(default)]
        disable_parallel_tool_use: bool,
    },
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
#[schema(as = AnthropicThinking)]
enum Thinking {
    Enabled {
        #[allow(dead_code)]
        #[serde(default, deserialize_with = "whole::opt")]
        budget_tokens: Option<i64>,
    },
    Disabled,
}

/// The text of a string or of text blocks; `what` names the field for errors.
fn text_of(c: &Content, what: &str) -> Result<String, ApiError> {
    match c {
        Content::Text(t) => Ok(t.clone()),
        Content::Blocks(blocks) => {
            let mut out = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match b {
                    Block::Text { text } => out.push_str(text),
                    _ => {
                        return Err(ApiError::invalid_param(
                            &format!("{what}[{j}]"),
                            "only text blocks are accepted here",
                        ));
                    }
                }
            }
            Ok(out)
        }
    }
}

impl MessagesRequest {
    /// The equivalent OpenAI chat request body (the chat endpoint's checks then apply).
    fn to_openai(&self) -> Result<Value, ApiError> {
        let mut msgs: Vec<Value> = Vec::new();
        if let Some(system) = &self.system {
            msgs.push(json!({"role": "system", "content": text_of(system, "system")?}));
        }
        for (i, m) in self.messages.iter().enumerate() {
            if m.role != "user" && m.role != "assistant" {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].role"),
                    format!("role must be user or assistant, got {:?}", m.role),
                ));
            }
            let at = |j: usize| format!("messages[{i}].content[{j}]");
            let blocks = match &m.content {
                Content::Text(t) => {
                    msgs.push(json!({"role": m.role, "content": t}));
                    continue;
                }
                Content::Blocks(b) => b,
            };
            match m.role.as_str() {
                "user" => {
                    // Tool results become tool messages, before the turn's own text.
                    let mut text = String::new();
                    for (j, b) in blocks.iter().enumerate() {
                        match b {
                            Block::Text { text: t } => text.push_str(t),
                            Block::ToolResult {
                                tool_use_id,
                                content,
                                is_error,
                            } => {
                                let mut body = match content {
                                    None => String::new(),
                                    Some(c) => text_of(c, &format!("{}.content", at(j)))?,
                                };
                                if *is_error {
                                    body = format!("Error: {body}");
                                }
                                msgs.push(json!({"role": "tool", "tool_call_id": tool_use_id, "content": body}));
                            }
                            _ => {
                                return Err(ApiError::unsupported(
                                    &at(j),
                                    "user turns take text and tool_result blocks only",
                                ));
                            }
                        }
                    }
                    if !text.is_empty() {
                        msgs.push(json!({"role": "user", "content": text}));
                    }
                }
                _ => {
                    let (mut text, mut reasoning, mut calls) =
                        (String::new(), String::new(), Vec::new());
                    for (j, b) in blocks.iter().enumerate() {
                        match b {
                            Block::Text { text: t } => text.push_str(t),
                            Block::Thinking { thinking } => reasoning.push_str(thinking),
                            Block::ToolUse { id, name, input } => {
                                if name.is_empty() {
                                    return Err(ApiError::invalid_param(
                                        &format!("{}.name", at(j)),
                                        "a tool_use block's name must not be empty",
                                    ));
                                }
                                if !input.is_object() {
                                    return Err(ApiError::invalid_param(
                                        &format!("{}.input", at(j)),
                                        "a tool_use block's input must be a JSON object",
                                    ));
                                }
                                calls.push(json!({
                                    "id": id, "type": "function",
                                    "function": {"name": name, "arguments": input.to_string()},
                                }));
                            }
                            _ => {
                                return Err(ApiError::unsupported(
                                    &at(j),
                                    "assistant turns take text, thinking and tool_use blocks only",
                                ));
                            }
                        }
                    }
                    let mut msg = json!({"role": "assistant", "content": text});
                    if !calls.is_empty() {
                        msg["tool_calls"] = Value::Array(calls);
                    }
                    if !reasoning.is_empty() {
                        msg["reasoning_content"] = json!(reasoning);
                    }
                    msgs.push(msg);
                }
            }
        }
        let mut body = Map::new();
        body.insert("model".into(), json!(self.model));
        body.insert("messages".into(), Value::Array(msgs));
        body.insert("max_tokens".into(), json!(self.max_tokens));
        if let Some(t) = self.temperature {
            // Anthropic's range is [0, 1]; OpenAI's wider one holds it.
            if !(0.0..=1.0).contains(&t) {
                return Err(ApiError::invalid_param(
                    "temperature",
                    format!("temperature must be between 0 and 1, got {t}"),
                ));
            }
            body.insert("temperature".into(), json!(t));
        }
        if let Some(p) = self.top_p {
            body.insert("top_p".into(), json!(p));
        }
        if let Some(k) = self.top_k {
            body.insert("top_k".into(), json!(k));
        }
        if let Some(stops) = &self.stop_sequences {
            body.insert("stop".into(), json!(stops));
        }
        if let Some(tools) = &self.tools {
            let list: Vec<Value> = tools
                .iter()
                .map(|t| {
                    json!({"type": "function", "function": {
                        "name": t.name, "description": t.description, "parameters": t.input_schema,
                    }})
                })
                .collect();
            body.insert("tools".into(), Value::Array(list));
        }
        if let Some(choice) = &self.tool_choice {
            let (c, one) = match choice {
                ToolChoice::Auto {
                    disable_parallel_tool_use: one,
                } => (json!("auto"), *one),
                ToolChoice::Any {
                    disable_parallel_tool_use: one,
                } => (json!("required"), *one),
                ToolChoice::None => (json!("none"), false),
                ToolChoice::Tool {
                    name,
                    disable_parallel_tool_use: one,
                } => (
                    json!({"type": "function", "function": {"name": name}}),
                    *one,
                ),
            };
            body.insert("tool_choice".into(), c);
            if one {
                body.insert("parallel_tool_calls".into(), json!(false));
            }
        }
        if let Some(Thinking::Enabled { .. }) = self.thinking {
            body.insert("chat_template_kwargs".into(), json!({"thinking": true}));
        }
        Ok(Value::Object(body))
    }
}

/// A chat-endpoint error's `param` in the Messages request's terms (the message names it:
/// Anthropic's errors have no `param`).
fn anthropic_param(mut e: ApiError) -> ApiError {
    let Some(p) = e.param.take() else { return e };
    let renamed = if p == "stop" {
        "stop_sequences".to_owned()
    } else if p.starts_with("chat_template_kwargs") {
        "thinking".to_owned()
    } else if let Some(rest) = p.strip_prefix("tools[")
        && let Some((i, rest)) = rest.split_once(']')
    {
        match rest {
            ".function.name" => format!("tools[{i}].name"),
            ".function.parameters" => format!("tools[{i}].input_schema"),
            _ => format!("tools[{i}]"),
        }
    } else {
        p
    };
    e.param = Some(renamed);
    e
}

/// An error in Anthropic's body shape, with the status and metric class it had.
fn anthropic_error(e: ApiError) -> Response {
    let kind = match e.status.as_u16() {
        400 | 413 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        _ => "api_error",
    };
    // Anthropic's errors have no `param`: the message names it.
    let message = match &e.param {
        Some(p) if !e.message.contains(p.as_str()) => format!("{p}: {}", e.message),
        _ => e.message.clone(),
    };
    let body = error_body(kind, &message);
    let mut resp = e.into_response();
    *resp.body_mut() = Body::from(body.to_string());
    resp
}

fn error_body(kind: &str, message: &str) -> Value {
    json!(AnthropicErrorBody {
        kind: "error",
        error: AnthropicError { kind, message },
    })
}

/// The body of an error answer in Anthropic's shape.
#[derive(serde::Serialize, ToSchema)]
pub(crate) struct AnthropicErrorBody<'a> {
    /// `error`.
    #[serde(rename = "type")]
    kind: &'a str,
    error: AnthropicError<'a>,
}

#[derive(serde::Serialize, ToSchema)]
pub(crate) struct AnthropicError<'a> {
    /// `invalid_request_error`, `authentication_error`, `permission_error`,
    /// `not_found_error`, `rate_limit_error`, `overloaded_error` or `api_error`.
    #[serde(rename = "type")]
    kind: &'a str,
    /// What went wrong; it names the field at fault.
    message: &'a str,
}

/// Anthropic's `stop_reason` for how a generation ended.
fn stop_reason(d: &Done) -> &'static str {
    match d.finish_reason {
        "tool_calls" => "tool_use",
        "length" => "max_tokens",
        _ if d.stop_sequence.is_some() => "stop_sequence",
        _ => "end_turn",
    }
}

fn usage(d: &Done) -> Value {
    json!({
        "input_tokens": d.usage.prompt_tokens,
        "output_tokens": d.usage.completion_tokens,
        "cache_read_input_tokens": d.usage.cached_tokens,
    })
}

/// A tool call's arguments as the `input` object (a call that parsed is valid JSON).
fn input_of(arguments: &str) -> Value {
    serde_json::from_str(arguments).unwrap_or_else(|_| json!({}))
}

/// Creates a message (Anthropic's Messages API).
///
/// Translated to a chat completion and back. Fields this server cannot honour (images,
/// documents) are a 400 naming them.
#[utoipa::path(
    post,
    path = "/v1/messages",
    tag = "Anthropic",
    request_body = MessagesRequest,
    responses(
        (status = 200, description = "The message; with `stream`, Anthropic's server-sent events (`message_start` ... `message_stop`).", content(
            (Object = "application/json"),
            (crate::api::schema::SseEvent = "text/event-stream"),
        )),
        crate::api::schema::AnthropicErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn messages(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match run(st, body).await {
        Ok(r) => r,
        Err(e) => anthropic_error(e),
    }
}

async fn run(st: AppState, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let start = Instant::now();
    let body = body_bytes(&st, body)?;
    let req: MessagesRequest = json::parse(&body)?;
    let chat_body = req.to_openai()?;
    let chat: ChatRequest = serde_json::from_value(chat_body.clone())
        .map_err(|e| ApiError::invalid_request(format!("invalid request: {e}"), None))?;
    let fields: SamplingFields = serde_json::from_value(chat_body)
        .map_err(|e| ApiError::invalid_request(format!("invalid request: {e}"), None))?;
    let prep = prepare_chat(&st, &chat, &fields)
        .await
        .map_err(anthropic_param)?;
    let grammar_from = prep.grammar_from;
    let blame = |e| anthropic_param(blame_grammar(e, grammar_from));
    let id = format!("msg_{}", uuid::Uuid::new_v4().simple());
    let input_tokens = prep.ids.len();
    let gen_stream = generate::start(&st, id.clone(), prep.ids, prep.params, prep.parsing, start)
        .await
        .map_err(blame)?;
    let model = prep.model;
    if !req.stream.unwrap_or(false) {
        let (out, done) = generate::collect(gen_stream).await.map_err(blame)?;
        let mut content = Vec::new();
        if !out.reasoning.is_empty() {
            content.push(json!({"type": "thinking", "thinking": out.reasoning, "signature": ""}));
        }
        if !out.text.is_empty() {
            content.push(json!({"type": "text", "text": out.text}));
        }
        for (call_id, name, arguments) in &out.tool_calls {
            content.push(json!({"type": "tool_use", "id": call_id, "name": name, "input": input_of(arguments)}));
        }
        let body = json!({
            "id": id, "type": "message", "role": "assistant", "model": model,
            "content": content,
            "stop_reason": stop_reason(&done),
            "stop_sequence": done.stop_sequence,
            "usage": usage(&done),
        });
        return Ok(axum::Json(body).into_response());
    }
    let start_event = json!({
        "type": "message_start",
        "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        },
    });
    let events = async_stream::stream! {
        let mut gen_stream = gen_stream;
        let ev = |name: &str, v: &Value| Ok::<Event, Infallible>(Event::default().event(name).data(v.to_string()));
        yield ev("message_start", &start_event);
        // The open content block: its index and kind ("text", "thinking", or a tool
        // call's index in the generation).
        let mut open: Option<(usize, String)> = None;
        let mut next = 0usize;
        while let Some(item) = gen_stream.next().await {
            let (kind, delta, start_block) = match item {
                Ok(GenEvent::Logprob(_) | GenEvent::Prompt(_)) => continue,
                Ok(GenEvent::Text(t)) => ("text".to_owned(), json!({"type": "text_delta", "text": t}), json!({"type": "text", "text": ""})),
                Ok(GenEvent::Reasoning(t)) => ("thinking".to_owned(), json!({"type": "thinking_delta", "thinking": t}), json!({"type": "thinking", "thinking": "", "signature": ""})),
                Ok(GenEvent::ToolCall(d)) => (
                    format!("tool {}", d.index),
                    json!({"type": "input_json_delta", "partial_json": d.arguments}),
                    json!({"type": "tool_use", "id": d.id, "name": d.name, "input": {}}),
                ),
                Ok(GenEvent::Done(d)) => {
                    if let Some((index, _)) = open.take() {
                        yield ev("content_block_stop", &json!({"type": "content_block_stop", "index": index}));
                    }
                    yield ev("message_delta", &json!({
                        "type": "message_delta",
                        "delta": {"stop_reason": stop_reason(&d), "stop_sequence": d.stop_sequence},
                        "usage": {"output_tokens": d.usage.completion_tokens},
                    }));
                    yield ev("message_stop", &json!({"type": "message_stop"}));
                    return;
                }
                Err(e) => {
                    st.metrics.error(e.error_type);
                    yield ev("error", &error_body("api_error", &e.message));
                    return;
                }
            };
            if open.as_ref().is_none_or(|(_, k)| *k != kind) {
                if let Some((index, _)) = open.take() {
                    yield ev("content_block_stop", &json!({"type": "content_block_stop", "index": index}));
                }
                yield ev("content_block_start", &json!({"type": "content_block_start", "index": next, "content_block": start_block}));
                open = Some((next, kind));
                next += 1;
            }
            let index = open.as_ref().map_or(0, |(i, _)| *i);
            yield ev("content_block_delta", &json!({"type": "content_block_delta", "index": index, "delta": delta}));
        }
    };
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// `InMessage.role` (Anthropic).
pub(crate) fn anthropic_role() -> Object {
    strings(&["user", "assistant"])
}

/// `stop_sequences` (Anthropic): what the chat endpoint's `stop` takes, as a list.
pub(crate) fn stop_sequences() -> Schema {
    ArrayBuilder::new()
        .schema_type(SchemaType::from_iter([Type::Array, Type::Null]))
        .items(stop_string())
        .max_items(Some(MAX_STOP))
        .description(Some(format!(
            "Strings that end the answer where the model writes one (at most {}).",
            MAX_STOP
        )))
        .into()
}

#[cfg(test)]
mod tests;

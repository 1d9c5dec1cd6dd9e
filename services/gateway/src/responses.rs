//! OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`),
//! translated to the chat endpoint's own request and back, as `anthropic` does for
//! Messages: input items (messages, function calls and their outputs, reasoning),
//! `instructions`, function tools and `tool_choice`, `text.format`, `reasoning`, and
//! streaming with the Responses event types. Responses are remembered (in memory,
//! bounded, see [`store`]) so that `previous_response_id` continues a conversation.
//! Fields that would change the answer and that this server cannot honour (built-in
//! tools, `background`, `truncation: "auto"`, `include`) are a 400 naming them, never
//! dropped.
//!
//! Reasoning given back as `reasoning` items becomes the assistant turn's
//! `reasoning_content`, as the chat endpoint takes it (the chat template decides whether
//! to render it; encrypted-only items carry no text and are dropped). `reasoning.effort`
//! other than `none` turns thinking on, like `chat_template_kwargs.thinking`; reasoning
//! comes back as a `reasoning` item with its text in `content` and no summary, and is not
//! counted apart (`reasoning_tokens` is 0). `text.verbosity` is accepted and not acted on.

mod store;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::generate::{self, Done, GenEvent, Usage};
use crate::handlers::{StreamTimer, blame_grammar, body_bytes, prepare_chat, traced};
use crate::openai::{self, ChatRequest, SamplingFields};
use crate::state::{AppState, unix_now};

/// What a stored response keeps: its JSON (for `GET`), and the conversation so far —
/// every earlier turn's input and output items, then its own — for a later
/// `previous_response_id` (its `instructions` are not carried over, as OpenAI does).
pub(crate) struct Stored {
    body: Value,
    history: Vec<Item>,
}

pub(crate) type Store = store::Store<Stored>;

/// The gateway's store, sized by its configuration.
pub(crate) fn new_store(max: usize, max_bytes: usize, ttl_secs: u64) -> Store {
    Store::new(max, max_bytes, Duration::from_secs(ttl_secs))
}

/// Top-level fields acted on (the request struct's, and the chat endpoint's extra sampling
/// fields, which clients send in the body: `extra_body={"seed": 1}`).
pub(crate) const FIELDS: [&str; 26] = [
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "temperature",
    "top_p",
    "max_output_tokens",
    "stream",
    "store",
    "previous_response_id",
    "metadata",
    "text",
    "reasoning",
    "seed",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
];

/// Fields accepted and not acted on: they describe the caller, caching or billing, never
/// the answer.
pub(crate) const IGNORED: [&str; 7] = [
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
    "stream_options",
    "include_obfuscation",
];

/// Refuses every field not in [`FIELDS`] or [`IGNORED`] unless it is null or asks for what
/// this server does anyway (`background: false`, `truncation: "disabled"`, `include: []`).
fn check_fields(body: &Map<String, Value>) -> Result<(), ApiError> {
    for (k, v) in body {
        let k = k.as_str();
        if v.is_null() || FIELDS.contains(&k) || IGNORED.contains(&k) {
            continue;
        }
        let why = match k {
            "background" if v == false => continue,
            "truncation" if v == "disabled" => continue,
            "include" if v.as_array().is_some_and(Vec::is_empty) => continue,
            "background" => "background responses are not supported; omit `background`",
            "truncation" => {
                "only truncation \"disabled\" is supported (a prompt past the context is a 400)"
            }
            "include" => "no `include` values are supported by this server",
            "max_tokens" | "max_completion_tokens" => {
                "the Responses API takes `max_output_tokens`, not max_tokens"
            }
            _ => "this field is not supported by this server's Responses API",
        };
        return Err(ApiError::unsupported(k, format!("`{k}`: {why}")));
    }
    Ok(())
}

/// OpenAI's bounds on `metadata`, which is stored with the response: at most this many
/// pairs, keys of at most [`MAX_METADATA_KEY`] characters, values of at most
/// [`MAX_METADATA_VALUE`].
pub(crate) const MAX_METADATA_PAIRS: usize = 16;
pub(crate) const MAX_METADATA_KEY: usize = 64;
pub(crate) const MAX_METADATA_VALUE: usize = 512;

fn check_metadata(m: Option<&BTreeMap<String, String>>) -> Result<(), ApiError> {
    let Some(m) = m else { return Ok(()) };
    if m.len() > MAX_METADATA_PAIRS {
        return Err(ApiError::invalid_param(
            "metadata",
            format!(
                "metadata holds at most {MAX_METADATA_PAIRS} pairs, got {}",
                m.len()
            ),
        ));
    }
    for (k, v) in m {
        if k.chars().count() > MAX_METADATA_KEY {
            return Err(ApiError::invalid_param(
                "metadata",
                format!("a metadata key is at most {MAX_METADATA_KEY} characters"),
            ));
        }
        if v.chars().count() > MAX_METADATA_VALUE {
            return Err(ApiError::invalid_param(
                &format!("metadata.{k}"),
                format!("a metadata value is at most {MAX_METADATA_VALUE} characters"),
            ));
        }
    }
    Ok(())
}

/// `POST /v1/responses` (the fields acted on; [`check_fields`] refuses the others). The
/// OpenAPI document shows it with the sampling fields of [`FIELDS`] and what
/// [`check_fields`] lets through (`openapi::ResponseCreateRequest`, which writes its
/// description).
#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct ResponsesRequest {
    /// The served model's name (`GET /v1/models`).
    model: String,
    input: Input,
    /// A system message put before the conversation (not carried over by
    /// `previous_response_id`).
    instructions: Option<String>,
    /// Function tools: `{"type": "function", "name", "description", "parameters"}`.
    #[schema(value_type = Option<Vec<Object>>)]
    tools: Option<Vec<Value>>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "name"}`.
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    #[schema(minimum = 0, maximum = 2)]
    temperature: Option<f64>,
    #[schema(exclusive_minimum = 0, maximum = 1)]
    top_p: Option<f64>,
    /// Most tokens to generate; the conversation and these must fit in the context.
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "openai::whole::opt")]
    max_output_tokens: Option<i64>,
    /// Answer with the Responses API's server-sent events.
    stream: Option<bool>,
    /// Keep the response for `GET /v1/responses/{id}` and `previous_response_id`
    /// (default true).
    store: Option<bool>,
    /// Continue the conversation of this stored response.
    previous_response_id: Option<String>,
    #[schema(schema_with = crate::openapi::metadata)]
    metadata: Option<BTreeMap<String, String>>,
    user: Option<String>,
    text: Option<TextConfig>,
    reasoning: Option<ReasoningConfig>,
}

/// A string (one user message), or a list of input items.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
#[schema(as = ResponseInput)]
enum Input {
    Text(String),
    // Parsed one by one ([`parse_items`]), so an error names the item; the document shows
    // the items' own types.
    #[schema(value_type = Vec<crate::openapi::ResponseInputItem>)]
    Items(Vec<Value>),
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = ResponseTextConfig)]
struct TextConfig {
    #[schema(schema_with = crate::openapi::text_format)]
    format: Option<Value>,
    /// A hint for how long the answer should be; accepted and not acted on.
    verbosity: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = ResponseReasoningConfig)]
struct ReasoningConfig {
    /// Anything but `none` turns thinking on (on models that think).
    #[schema(schema_with = crate::openapi::reasoning_effort)]
    effort: Option<String>,
    /// No summaries are written: a reasoning item's `summary` is empty and its text is in
    /// `content`.
    #[allow(dead_code)]
    summary: Option<String>,
}

pub(crate) const EFFORTS: [&str; 6] = ["none", "minimal", "low", "medium", "high", "xhigh"];

/// One conversation item, normalized: what input items become, what a response's output
/// adds, and what the store replays.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Item {
    Message {
        role: String,
        text: String,
    },
    Call {
        call_id: String,
        name: String,
        arguments: String,
    },
    Output {
        call_id: String,
        text: String,
    },
    Reasoning(String),
}

impl Item {
    /// The bytes of its text, what it costs the store.
    fn bytes(&self) -> usize {
        match self {
            Self::Message { role, text } => role.len() + text.len(),
            Self::Call {
                call_id,
                name,
                arguments,
            } => call_id.len() + name.len() + arguments.len(),
            Self::Output { call_id, text } => call_id.len() + text.len(),
            Self::Reasoning(text) => text.len(),
        }
    }
}

/// Input items on the wire, one struct per `type` (deserialized apart, so an error names
/// the field: serde's tagged enums lose the path). The OpenAPI document shows them as
/// `ResponseInputItem`, each with its `type`.
#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = ResponseInputMessage)]
pub(crate) struct MessageIn {
    #[schema(schema_with = crate::openapi::responses_role)]
    role: String,
    content: ContentIn,
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = ResponseFunctionCall)]
pub(crate) struct CallIn {
    call_id: String,
    #[schema(min_length = 1)]
    name: String,
    /// The call's arguments: a JSON object, written as a string.
    arguments: String,
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = ResponseFunctionCallOutput)]
pub(crate) struct OutputIn {
    call_id: String,
    output: ContentIn,
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = ResponseReasoningItem)]
pub(crate) struct ReasoningIn {
    #[serde(default)]
    content: Vec<Part>,
    #[serde(default)]
    summary: Vec<Part>,
}

/// A string, or text parts (`input_text`; an assistant's may be `output_text`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
#[schema(as = ResponseContent)]
enum ContentIn {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = ResponseContentPart)]
struct Part {
    /// `input_text`, `output_text` or `text` (a 400 names the others).
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

pub(crate) const ROLES: [&str; 4] = ["user", "assistant", "system", "developer"];

/// The text of a string or of text parts of the `kinds` given; `at` names the field.
fn text_of(c: &ContentIn, kinds: &[&str], at: &str) -> Result<String, ApiError> {
    match c {
        ContentIn::Text(t) => Ok(t.clone()),
        ContentIn::Parts(parts) => {
            parts
                .iter()
                .enumerate()
                .try_fold(String::new(), |mut out, (j, p)| {
                    match (&p.text, kinds.contains(&p.kind.as_str())) {
                        (Some(t), true) => {
                            out.push_str(t);
                            Ok(out)
                        }
                        _ => Err(ApiError::unsupported(
                            &format!("{at}[{j}]"),
                            format!(
                                "content parts of type {:?} are not supported here; only text",
                                p.kind
                            ),
                        )),
                    }
                })
        }
    }
}

/// One input item as `T`; an error names the field (`input[2].call_id`).
fn de<T: serde::de::DeserializeOwned>(v: Value, at: &str) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let param = if path == "." {
            at.to_owned()
        } else {
            format!("{at}.{path}")
        };
        ApiError::invalid_request(
            format!("invalid value for `{param}`: {}", e.into_inner()),
            Some(&param),
        )
    })
}

/// Input items, normalized; an error names the item.
fn parse_items(list: &[Value]) -> Result<Vec<Item>, ApiError> {
    const TYPES: [&str; 4] = [
        "message",
        "function_call",
        "function_call_output",
        "reasoning",
    ];
    let mut out = Vec::with_capacity(list.len());
    for (i, v) in list.iter().enumerate() {
        let at = format!("input[{i}]");
        let mut v = v.clone();
        let Some(obj) = v.as_object_mut() else {
            return Err(ApiError::invalid_param(
                &at,
                "an input item must be an object",
            ));
        };
        let kind = obj.entry("type").or_insert_with(|| json!("message"));
        match kind.as_str() {
            Some(k) if TYPES.contains(&k) => {}
            k => {
                return Err(ApiError::unsupported(
                    &format!("{at}.type"),
                    format!(
                        "input items of type {} are not supported; only {}",
                        k.map_or_else(|| kind.to_string(), |k| format!("{k:?}")),
                        TYPES.join(", ")
                    ),
                ));
            }
        }
        let kind = v["type"].as_str().unwrap_or_default().to_owned();
        out.push(match kind.as_str() {
            "message" => {
                let MessageIn { role, content } = de(v, &at)?;
                if !ROLES.contains(&role.as_str()) {
                    return Err(ApiError::invalid_param(
                        &format!("{at}.role"),
                        format!(
                            "unknown role {role:?}; expected one of {}",
                            ROLES.join(", ")
                        ),
                    ));
                }
                let kinds: &[&str] = if role == "assistant" {
                    &["output_text", "input_text", "text"]
                } else {
                    &["input_text", "text"]
                };
                let text = text_of(&content, kinds, &format!("{at}.content"))?;
                Item::Message { role, text }
            }
            "function_call" => {
                let CallIn {
                    call_id,
                    name,
                    arguments,
                } = de(v, &at)?;
                if name.is_empty() {
                    return Err(ApiError::invalid_param(
                        &format!("{at}.name"),
                        format!("{at}.name must not be empty"),
                    ));
                }
                if !matches!(serde_json::from_str(&arguments), Ok(Value::Object(_))) {
                    return Err(ApiError::invalid_param(
                        &format!("{at}.arguments"),
                        format!("{at}.arguments must be a JSON object, written as a string"),
                    ));
                }
                Item::Call {
                    call_id,
                    name,
                    arguments,
                }
            }
            "function_call_output" => {
                let OutputIn { call_id, output } = de(v, &at)?;
                let text = text_of(&output, &["input_text", "text"], &format!("{at}.output"))?;
                Item::Output { call_id, text }
            }
            _ => {
                let ReasoningIn { content, summary } = de(v, &at)?;
                // The reasoning's text, else its summary (all an OpenAI model gives back).
                let texts = |parts: &[Part]| {
                    parts
                        .iter()
                        .filter_map(|p| p.text.as_deref())
                        .collect::<String>()
                };
                let text = Some(texts(&content))
                    .filter(|t| !t.is_empty())
                    .unwrap_or_else(|| texts(&summary));
                Item::Reasoning(text)
            }
        });
    }
    Ok(out)
}

/// The chat endpoint's messages for a conversation. An assistant turn is the run of
/// assistant items a response produces (reasoning, a message, function calls), so it
/// becomes one chat message with `reasoning_content` and `tool_calls`, as the chat
/// template expects; reasoning or a message after a turn's text or calls starts another.
/// Empty reasoning (an encrypted item given back) is dropped.
fn chat_messages(instructions: Option<&str>, items: &[Item]) -> Vec<Value> {
    #[derive(Default)]
    struct Turn {
        text: Option<String>,
        reasoning: String,
        calls: Vec<Value>,
    }
    fn flush(turn: &mut Option<Turn>, msgs: &mut Vec<Value>) {
        let Some(t) = turn.take() else { return };
        let mut m = json!({"role": "assistant", "content": t.text.unwrap_or_default()});
        if !t.calls.is_empty() {
            m["tool_calls"] = Value::Array(t.calls);
        }
        if !t.reasoning.is_empty() {
            m["reasoning_content"] = json!(t.reasoning);
        }
        msgs.push(m);
    }
    let mut msgs = Vec::new();
    if let Some(s) = instructions {
        msgs.push(json!({"role": "system", "content": s}));
    }
    let mut turn: Option<Turn> = None;
    for item in items {
        let started = turn
            .as_ref()
            .is_some_and(|t| t.text.is_some() || !t.calls.is_empty());
        match item {
            Item::Reasoning(r) if r.is_empty() => {}
            Item::Reasoning(r) => {
                if started {
                    flush(&mut turn, &mut msgs);
                }
                turn.get_or_insert_default().reasoning.push_str(r);
            }
            Item::Message { role, text } if role == "assistant" => {
                if started {
                    flush(&mut turn, &mut msgs);
                }
                turn.get_or_insert_default().text = Some(text.clone());
            }
            Item::Call {
                call_id,
                name,
                arguments,
            } => {
                turn.get_or_insert_default().calls.push(json!({
                    "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments},
                }));
            }
            Item::Message { role, text } => {
                flush(&mut turn, &mut msgs);
                msgs.push(json!({"role": role, "content": text}));
            }
            Item::Output { call_id, text } => {
                flush(&mut turn, &mut msgs);
                msgs.push(json!({"role": "tool", "tool_call_id": call_id, "content": text}));
            }
        }
    }
    flush(&mut turn, &mut msgs);
    msgs
}

impl ResponsesRequest {
    fn input_items(&self) -> Result<Vec<Item>, ApiError> {
        match &self.input {
            Input::Text(t) => Ok(vec![Item::Message {
                role: "user".into(),
                text: t.clone(),
            }]),
            Input::Items(list) => parse_items(list),
        }
    }

    fn thinking(&self) -> Result<bool, ApiError> {
        match self.reasoning.as_ref().and_then(|r| r.effort.as_deref()) {
            None => Ok(false),
            Some(e) if EFFORTS.contains(&e) => Ok(e != "none"),
            Some(e) => Err(ApiError::invalid_param(
                "reasoning.effort",
                format!(
                    "reasoning.effort must be one of {}, not {e:?}",
                    EFFORTS.join(", ")
                ),
            )),
        }
    }

    /// The equivalent chat request body for the conversation `items` (the chat
    /// endpoint's checks then apply; [`responses_param`] renames what they name).
    fn to_chat(&self, items: &[Item]) -> Result<Value, ApiError> {
        let mut body = Map::new();
        body.insert("model".into(), json!(self.model));
        let messages = chat_messages(self.instructions.as_deref(), items);
        if messages.iter().all(|m| m["role"] == "system") {
            return Err(ApiError::invalid_param(
                "input",
                "input must contain at least one message or item",
            ));
        }
        body.insert("messages".into(), Value::Array(messages));
        if let Some(tools) = &self.tools {
            let mut list = Vec::with_capacity(tools.len());
            for (i, t) in tools.iter().enumerate() {
                match t.get("type").and_then(Value::as_str) {
                    Some("function") => {}
                    kind => {
                        let kind = kind.map_or_else(|| "(none)".to_owned(), |k| format!("{k:?}"));
                        return Err(ApiError::unsupported(
                            &format!("tools[{i}].type"),
                            format!(
                                "tools of type {kind} are not supported; only \"function\" tools"
                            ),
                        ));
                    }
                }
                let mut f = t.as_object().cloned().unwrap_or_default();
                f.remove("type");
                list.push(json!({"type": "function", "function": f}));
            }
            body.insert("tools".into(), Value::Array(list));
        }
        if let Some(choice) = &self.tool_choice {
            body.insert("tool_choice".into(), tool_choice(choice)?);
        }
        if let Some(p) = self.parallel_tool_calls {
            body.insert("parallel_tool_calls".into(), json!(p));
        }
        if let Some(format) = self.text.as_ref().and_then(|t| t.format.as_ref()) {
            body.insert("response_format".into(), response_format(format)?);
        }
        if self.thinking()? {
            body.insert("chat_template_kwargs".into(), json!({"thinking": true}));
        }
        Ok(Value::Object(body))
    }
}

/// Responses' `tool_choice` in the chat endpoint's shape.
fn tool_choice(v: &Value) -> Result<Value, ApiError> {
    let Some(obj) = v.as_object() else {
        // Strings ("auto", "none", "required") mean the same; the chat checks say the rest.
        return Ok(v.clone());
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("function") => match obj.get("name").and_then(Value::as_str) {
            Some(name) => Ok(json!({"type": "function", "function": {"name": name}})),
            None => Err(ApiError::invalid_param(
                "tool_choice.name",
                "a function tool_choice needs a `name`",
            )),
        },
        kind => Err(ApiError::unsupported(
            "tool_choice",
            format!(
                "tool_choice of type {} is not supported; use \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"name\": …}}",
                kind.map_or_else(|| "(none)".to_owned(), |k| format!("{k:?}"))
            ),
        )),
    }
}

/// `text.format` as the chat endpoint's `response_format`.
fn response_format(f: &Value) -> Result<Value, ApiError> {
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(json!({"type": "text"})),
        Some("json_object") => Ok(json!({"type": "json_object"})),
        Some("json_schema") => {
            let mut js = f.as_object().cloned().unwrap_or_default();
            js.remove("type");
            Ok(json!({"type": "json_schema", "json_schema": js}))
        }
        _ => Err(ApiError::invalid_param(
            "text.format.type",
            "text.format.type must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// A chat-endpoint error's `param` in the Responses request's terms.
fn responses_param(mut e: ApiError) -> ApiError {
    let Some(p) = e.param.take() else { return e };
    let renamed = if p == "max_tokens" {
        "max_output_tokens".to_owned()
    } else if p.starts_with("messages") {
        "input".to_owned()
    } else if p.starts_with("chat_template_kwargs") {
        "reasoning".to_owned()
    } else if let Some(rest) = p.strip_prefix("response_format") {
        format!(
            "text.format{}",
            rest.strip_prefix(".json_schema").unwrap_or(rest)
        )
    } else if p.starts_with("tools[") {
        p.replacen(".function", "", 1)
    } else {
        p
    };
    e.param = Some(renamed);
    e
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// Responses' `usage`. Reasoning is not counted apart from the answer (the gateway sees
/// text, not which tokens made it), so `reasoning_tokens` is 0.
fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// What the response object repeats from its request.
struct Echo {
    id: String,
    created_at: u64,
    model: String,
    fields: Map<String, Value>,
    store: bool,
}

impl Echo {
    fn new(req: &ResponsesRequest, id: String, model: String) -> Self {
        let text = match &req.text {
            None => json!({"format": {"type": "text"}, "verbosity": "medium"}),
            Some(t) => json!({
                "format": t.format.clone().unwrap_or_else(|| json!({"type": "text"})),
                "verbosity": t.verbosity.as_deref().unwrap_or("medium"),
            }),
        };
        let effort = req.reasoning.as_ref().and_then(|r| r.effort.clone());
        let fields = json!({
            "instructions": req.instructions,
            "tools": req.tools.clone().unwrap_or_default(),
            "tool_choice": req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
            "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
            // The chat endpoint's defaults, which OpenAI's are too.
            "temperature": req.temperature.unwrap_or(1.0),
            "top_p": req.top_p.unwrap_or(1.0),
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "metadata": req.metadata.clone().unwrap_or_default(),
            "store": req.store.unwrap_or(true),
            "text": text,
            "reasoning": {"effort": effort, "summary": null},
            "truncation": "disabled",
            "user": req.user,
        });
        Self {
            id,
            created_at: unix_now(),
            model,
            fields: fields.as_object().cloned().unwrap_or_default(),
            store: req.store.unwrap_or(true),
        }
    }

    /// The response object in `status`; `done` gives the usage and whether length cut it.
    fn object(
        &self,
        status: &str,
        output: &[Value],
        done: Option<&Done>,
        error: Option<&ApiError>,
    ) -> Value {
        let mut o = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error.map(|e| json!({"code": "server_error", "message": e.message})),
            "incomplete_details": (status == "incomplete").then(|| json!({"reason": "max_output_tokens"})),
            "model": self.model,
            "output": output,
            "usage": done.map(|d| usage_json(&d.usage)),
        });
        if done.is_some() {
            o["completed_at"] = json!(unix_now());
        }
        if let Value::Object(m) = &mut o {
            m.extend(self.fields.clone());
        }
        o
    }
}

/// One SSE event of a response stream: its `type` and its body.
type StreamEvent = (&'static str, Value);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Reasoning,
    Message,
    /// A tool call, by its index in the generation.
    Call(u32),
}

/// The output item being written.
struct Open {
    kind: Kind,
    id: String,
    index: usize,
    /// The reasoning, the message's text or the call's arguments so far.
    text: String,
    call_id: String,
    name: String,
}

impl Open {
    fn item(&self, status: &str) -> Value {
        match self.kind {
            Kind::Reasoning => json!({
                "type": "reasoning", "id": self.id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": self.text}],
            }),
            Kind::Message => json!({
                "type": "message", "id": self.id, "role": "assistant", "status": status,
                "content": [self.part()],
            }),
            Kind::Call(_) => json!({
                "type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                "arguments": self.text, "status": status,
            }),
        }
    }

    fn part(&self) -> Value {
        match self.kind {
            Kind::Reasoning => json!({"type": "reasoning_text", "text": self.text}),
            _ => {
                json!({"type": "output_text", "text": self.text, "annotations": [], "logprobs": []})
            }
        }
    }
}

/// The output items as they form from the generation's events. The same builder makes the
/// streamed events and the final object, so a stream ends in exactly the response a plain
/// request gets (items in the order the model wrote them).
#[derive(Default)]
struct Builder {
    items: Vec<Value>,
    /// The output as conversation items, for the store.
    history: Vec<Item>,
    open: Option<Open>,
    seq: u64,
}

impl Builder {
    fn event(&mut self, kind: &'static str, mut body: Value) -> StreamEvent {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.seq);
        self.seq += 1;
        (kind, body)
    }

    /// The events one generation event makes (none for logprobs, not asked for).
    fn push(&mut self, ev: GenEvent) -> Vec<StreamEvent> {
        let (kind, delta, call) = match ev {
            GenEvent::Text(t) => (Kind::Message, t, None),
            GenEvent::Reasoning(t) => (Kind::Reasoning, t, None),
            GenEvent::ToolCall(d) => (Kind::Call(d.index), d.arguments, Some((d.id, d.name))),
            GenEvent::Logprob(_) | GenEvent::Prompt(_) | GenEvent::Done(_) => return Vec::new(),
        };
        let mut out = Vec::new();
        if self.open.as_ref().is_none_or(|o| o.kind != kind) {
            out.extend(self.close("completed"));
            let (call_id, name) = call.clone().unwrap_or_default();
            let prefix = match kind {
                Kind::Reasoning => "rs",
                Kind::Message => "msg",
                Kind::Call(_) => "fc",
            };
            let open = Open {
                kind,
                id: new_id(prefix),
                index: self.items.len(),
                text: String::new(),
                call_id,
                name,
            };
            let (mut item, part) = (open.item("in_progress"), open.part());
            let (id, index) = (open.id.clone(), open.index);
            self.open = Some(open);
            let has_parts = item.get("content").is_some();
            if has_parts {
                // The content arrives as a part, announced after its item.
                item["content"] = json!([]);
            }
            out.push(self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            ));
            if has_parts {
                out.push(self.event(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                ));
            }
        }
        let Some(open) = self.open.as_mut() else {
            return out;
        };
        if let Some((call_id, name)) = call {
            // A later piece of the same call may repeat what the first gave.
            if !call_id.is_empty() {
                open.call_id = call_id;
            }
            if !name.is_empty() {
                open.name = name;
            }
        }
        if delta.is_empty() {
            return out;
        }
        open.text.push_str(&delta);
        let (id, index) = (open.id.clone(), open.index);
        let ev = match kind {
            Kind::Message => self.event(
                "response.output_text.delta",
                json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta, "logprobs": []}),
            ),
            Kind::Reasoning => self.event(
                "response.reasoning_text.delta",
                json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta}),
            ),
            Kind::Call(_) => self.event(
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": index, "delta": delta}),
            ),
        };
        out.push(ev);
        out
    }

    /// Ends the open item (`incomplete` when the generation was cut by length, except a
    /// call: one is only sent whole, and a call cut short is dropped).
    fn close(&mut self, status: &str) -> Vec<StreamEvent> {
        let Some(open) = self.open.take() else {
            return Vec::new();
        };
        let status = if matches!(open.kind, Kind::Call(_)) {
            "completed"
        } else {
            status
        };
        let (id, index, item) = (open.id.clone(), open.index, open.item(status));
        let mut out = Vec::new();
        let at = json!({"item_id": id, "output_index": index, "content_index": 0});
        let with = |mut v: Value, extra: Value| {
            if let (Value::Object(a), Value::Object(b)) = (&mut v, extra) {
                a.extend(b);
            }
            v
        };
        match open.kind {
            Kind::Message => {
                out.push(self.event(
                    "response.output_text.done",
                    with(at.clone(), json!({"text": open.text, "logprobs": []})),
                ));
                out.push(self.event(
                    "response.content_part.done",
                    with(at, json!({"part": open.part()})),
                ));
                self.history.push(Item::Message {
                    role: "assistant".into(),
                    text: open.text.clone(),
                });
            }
            Kind::Reasoning => {
                out.push(self.event(
                    "response.reasoning_text.done",
                    with(at.clone(), json!({"text": open.text})),
                ));
                out.push(self.event(
                    "response.content_part.done",
                    with(at, json!({"part": open.part()})),
                ));
                self.history.push(Item::Reasoning(open.text.clone()));
            }
            Kind::Call(_) => {
                out.push(self.event(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "arguments": open.text}),
                ));
                self.history.push(Item::Call {
                    call_id: open.call_id.clone(),
                    name: open.name.clone(),
                    arguments: open.text.clone(),
                });
            }
        }
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        ));
        self.items.push(item);
        out
    }

    /// Closes the output for the generation's end; the response's status.
    fn finish(&mut self, done: &Done) -> (&'static str, Vec<StreamEvent>) {
        let status = if done.finish_reason == "length" {
            "incomplete"
        } else {
            "completed"
        };
        (status, self.close(status))
    }
}

fn not_found(what: &str, id: &str, param: Option<&str>) -> ApiError {
    ApiError {
        param: param.map(str::to_owned),
        ..ApiError::not_found(format!("{what} with id '{id}' not found."))
    }
}

/// Creates a response (OpenAI's Responses API).
///
/// Translated to a chat completion and back; stored (unless `store` is false) for
/// `GET /v1/responses/{id}` and `previous_response_id`. Fields that would change the
/// answer and that this server cannot honour are a 400 naming them.
#[utoipa::path(
    post,
    path = "/v1/responses",
    tag = "OpenAI",
    request_body = crate::openapi::ResponseCreateRequest,
    responses(
        (status = 200, description = "The response; with `stream`, the Responses API's server-sent events (`response.created` ... `response.completed`).", content(
            (Object = "application/json"),
            (crate::openapi::SseEvent = "text/event-stream"),
        )),
        crate::openapi::GenerationErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn create(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    traced("chat", &headers, run(st, body)).await
}

/// A stored response, as it was returned.
#[utoipa::path(
    get,
    path = "/v1/responses/{id}",
    tag = "OpenAI",
    params(("id" = String, Path, description = "The response's id (`resp_...`).")),
    responses(
        (status = 200, description = "The response object.", body = Object),
        crate::openapi::StoredErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn get(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    match st.responses.get(&id) {
        Some(s) => Ok(Json(s.body.clone())),
        None => Err(not_found("Response", &id, None)),
    }
}

/// Forgets a stored response.
#[utoipa::path(
    delete,
    path = "/v1/responses/{id}",
    tag = "OpenAI",
    params(("id" = String, Path, description = "The response's id (`resp_...`).")),
    responses(
        (status = 200, description = "`{\"id\", \"object\": \"response\", \"deleted\": true}`.", body = Object),
        crate::openapi::StoredErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn delete(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if st.responses.remove(&id) {
        Ok(Json(
            json!({"id": id, "object": "response", "deleted": true}),
        ))
    } else {
        Err(not_found("Response", &id, None))
    }
}

async fn run(st: AppState, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let start = Instant::now();
    let body = body_bytes(&st, body)?;
    check_fields(&openai::parse::<Map<String, Value>>(&body)?)?;
    let req: ResponsesRequest = openai::parse(&body)?;
    check_metadata(req.metadata.as_ref())?;
    if let Some(m) = req.max_output_tokens.filter(|&m| m < 1) {
        return Err(ApiError::invalid_param(
            "max_output_tokens",
            format!("max_output_tokens must be at least 1, got {m}"),
        ));
    }
    let mut history = match &req.previous_response_id {
        None => Vec::new(),
        Some(prev) => match st.responses.get(prev) {
            Some(s) => s.history.clone(),
            None => {
                return Err(ApiError {
                    code: Some("previous_response_not_found"),
                    ..not_found("Previous response", prev, Some("previous_response_id"))
                });
            }
        },
    };
    history.extend(req.input_items()?);
    let chat_body = req.to_chat(&history)?;
    let chat: ChatRequest = serde_json::from_value(chat_body)
        .map_err(|e| ApiError::invalid_request(format!("invalid request: {e}"), None))?;
    // The extra sampling fields, read where the client put them; the length limit is
    // Responses' own.
    let mut sampling: SamplingFields = openai::parse(&body)?;
    sampling.max_tokens = req.max_output_tokens;
    let prep = prepare_chat(&st, &chat, &sampling)
        .await
        .map_err(responses_param)?;
    let grammar_from = prep.grammar_from;
    let id = new_id("resp");
    let span = tracing::Span::current();
    span.record("request_id", id.as_str());
    span.record("gen_ai.response.id", id.as_str());
    let echo = Echo::new(&req, id.clone(), prep.model);
    let gen_stream = generate::start(&st, id.clone(), prep.ids, prep.params, prep.parsing, start)
        .await
        .map_err(|e| responses_param(blame_grammar(e, grammar_from)))?;
    let mut resp = if req.stream.unwrap_or(false) {
        stream(st, start, echo, history, gen_stream)
    } else {
        let mut b = Builder::default();
        let mut gen_stream = gen_stream;
        let done = loop {
            match gen_stream.next().await {
                Some(Ok(GenEvent::Done(d))) => break d,
                Some(Ok(ev)) => drop(b.push(ev)),
                Some(Err(e)) => return Err(responses_param(blame_grammar(e, grammar_from))),
                None => {
                    return Err(ApiError::backend(
                        "the generation ended without a finish reason",
                    ));
                }
            }
        };
        let (status, _) = b.finish(&done);
        let obj = echo.object(status, &b.items, Some(&done), None);
        remember(&st, &echo, &obj, history, b.history);
        Json(obj).into_response()
    };
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    Ok(resp)
}

/// Stores a finished response unless the request said `store: false`.
fn remember(st: &AppState, echo: &Echo, obj: &Value, mut history: Vec<Item>, output: Vec<Item>) {
    if echo.store {
        history.extend(output);
        let bytes = obj.to_string().len() + history.iter().map(Item::bytes).sum::<usize>();
        let stored = Stored {
            body: obj.clone(),
            history,
        };
        if !st.responses.insert(echo.id.clone(), stored, bytes) {
            tracing::warn!(
                id = %echo.id,
                bytes,
                limit = st.cfg.responses_max_stored_bytes,
                "a response larger than --responses-max-stored-bytes is not stored"
            );
        }
    }
}

/// The SSE response: `response.created` and `response.in_progress`, each output item's
/// events as the model writes it, then `response.completed` (or `response.incomplete`)
/// with the whole response. An error after the stream began ends it with
/// `response.failed`, whose response carries the error and the output so far.
fn stream(
    st: AppState,
    start: Instant,
    echo: Echo,
    history: Vec<Item>,
    mut gen_stream: generate::GenStream,
) -> Response {
    let timer = StreamTimer {
        st: st.clone(),
        start,
    };
    let events = async_stream::stream! {
        let _timer = timer;
        let mut b = Builder::default();
        let sse = |(kind, body): StreamEvent| Ok::<Event, Infallible>(Event::default().event(kind).data(body.to_string()));
        let created = echo.object("in_progress", &[], None, None);
        yield sse(b.event("response.created", json!({"response": created})));
        yield sse(b.event("response.in_progress", json!({"response": created})));
        while let Some(item) = gen_stream.next().await {
            match item {
                Ok(GenEvent::Done(d)) => {
                    let (status, events) = b.finish(&d);
                    for e in events {
                        yield sse(e);
                    }
                    let obj = echo.object(status, &b.items, Some(&d), None);
                    remember(&st, &echo, &obj, history, std::mem::take(&mut b.history));
                    let kind = if status == "completed" { "response.completed" } else { "response.incomplete" };
                    yield sse(b.event(kind, json!({"response": obj})));
                    return;
                }
                Ok(ev) => {
                    for e in b.push(ev) {
                        yield sse(e);
                    }
                }
                Err(e) => {
                    st.metrics.error(e.error_type);
                    let closed = b.close("incomplete");
                    for e in closed {
                        yield sse(e);
                    }
                    let obj = echo.object("failed", &b.items, None, Some(&e));
                    yield sse(b.event("response.failed", json!({"response": obj})));
                    return;
                }
            }
        }
    };
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ToolCallDelta;

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
        let tools = crate::tools::parse_tools(chat.tools.as_ref()).unwrap();
        assert_eq!(
            crate::tools::parse_tool_choice(chat.tool_choice.as_ref(), &tools).unwrap(),
            crate::tools::ToolChoice::Named("weather".into())
        );
        assert!(
            crate::tools::response_schema(chat.response_format.as_ref())
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
        let o =
            chat_of(json!({"model": "m", "input": "hi", "reasoning": {"effort": "none"}})).unwrap();
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
        let e = openai::parse::<ResponsesRequest>(br#"{"input": "x"}"#).unwrap_err();
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
        let o = chat_of(json!({"model": "m", "input": "x", "tools": [{"type": "function", "name": "bad name"}]})).unwrap();
        let chat: ChatRequest = serde_json::from_value(o).unwrap();
        let e = crate::tools::parse_tools(chat.tools.as_ref()).unwrap_err();
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
}

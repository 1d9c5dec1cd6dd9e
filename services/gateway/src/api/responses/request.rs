//! The Responses API's request: the fields acted on and refused, its input items, and its
//! translation to the chat request's body.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Map, Value, json};
use utoipa::ToSchema;
use utoipa::openapi::RefOr;
use utoipa::openapi::schema::{
    AdditionalProperties, ArrayBuilder, Object, ObjectBuilder, OneOfBuilder, Schema, SchemaType,
    Type,
};

use crate::api::schema::{composed, merged};
use crate::error::ApiError;
use crate::generate::sampling::SamplingFields;
use crate::generate::schema::{json_schema_fields, nullable, strings, typed};
use crate::json::whole;

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
pub(super) fn check_fields(body: &Map<String, Value>) -> Result<(), ApiError> {
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

pub(super) fn check_metadata(m: Option<&BTreeMap<String, String>>) -> Result<(), ApiError> {
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
    pub(super) model: String,
    input: Input,
    /// A system message put before the conversation (not carried over by
    /// `previous_response_id`).
    pub(super) instructions: Option<String>,
    /// Function tools: `{"type": "function", "name", "description", "parameters"}`.
    #[schema(value_type = Option<Vec<Object>>)]
    pub(super) tools: Option<Vec<Value>>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "name"}`.
    pub(super) tool_choice: Option<Value>,
    pub(super) parallel_tool_calls: Option<bool>,
    #[schema(minimum = 0, maximum = 2)]
    pub(super) temperature: Option<f64>,
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub(super) top_p: Option<f64>,
    /// Most tokens to generate; the conversation and these must fit in the context.
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "whole::opt")]
    pub(super) max_output_tokens: Option<i64>,
    /// Answer with the Responses API's server-sent events.
    pub(super) stream: Option<bool>,
    /// Keep the response for `GET /v1/responses/{id}` and `previous_response_id`
    /// (default true).
    pub(super) store: Option<bool>,
    /// Continue the conversation of this stored response.
    pub(super) previous_response_id: Option<String>,
    #[schema(schema_with = crate::api::responses::request::metadata)]
    pub(super) metadata: Option<BTreeMap<String, String>>,
    pub(super) user: Option<String>,
    pub(super) text: Option<TextConfig>,
    pub(super) reasoning: Option<ReasoningConfig>,
}

/// A string (one user message), or a list of input items.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
#[schema(as = ResponseInput)]
enum Input {
    Text(String),
    // Parsed one by one ([`parse_items`]), so an error names the item; the document shows
    // the items' own types.
    #[schema(value_type = Vec<crate::api::responses::request::ResponseInputItem>)]
    Items(Vec<Value>),
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = ResponseTextConfig)]
pub(super) struct TextConfig {
    #[schema(schema_with = crate::api::responses::request::text_format)]
    pub(super) format: Option<Value>,
    /// A hint for how long the answer should be; accepted and not acted on.
    pub(super) verbosity: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = ResponseReasoningConfig)]
pub(super) struct ReasoningConfig {
    /// Anything but `none` turns thinking on (on models that think).
    #[schema(schema_with = crate::api::responses::request::reasoning_effort)]
    pub(super) effort: Option<String>,
    /// No summaries are written: a reasoning item's `summary` is empty and its text is in
    /// `content`.
    #[allow(dead_code)]
    pub(super) summary: Option<String>,
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
    pub(super) fn bytes(&self) -> usize {
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
    #[schema(schema_with = crate::api::responses::request::responses_role)]
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
pub(super) fn parse_items(list: &[Value]) -> Result<Vec<Item>, ApiError> {
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
    pub(super) fn input_items(&self) -> Result<Vec<Item>, ApiError> {
        match &self.input {
            Input::Text(t) => Ok(vec![Item::Message {
                role: "user".into(),
                text: t.clone(),
            }]),
            Input::Items(list) => parse_items(list),
        }
    }

    pub(super) fn thinking(&self) -> Result<bool, ApiError> {
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
    pub(super) fn to_chat(&self, items: &[Item]) -> Result<Value, ApiError> {
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
pub(super) fn responses_param(mut e: ApiError) -> ApiError {
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

/// `MessageIn.role` (Responses).
pub(crate) fn responses_role() -> Object {
    strings(&ROLES)
}

/// `TextConfig.format` (Responses): as `response_format`, the schema's fields inline.
pub(crate) fn text_format() -> Schema {
    nullable(
        OneOfBuilder::new()
            .item(typed("text"))
            .item(typed("json_object"))
            .item(json_schema_fields(typed("json_schema")))
            .description(Some(
                "The answer is made to match: any text, a JSON object, or a JSON schema.",
            )),
    )
}

/// `ReasoningConfig.effort` (Responses).
pub(crate) fn reasoning_effort() -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::String, Type::Null]))
        .enum_values(Some(
            EFFORTS
                .iter()
                .map(|e| json!(e))
                .chain([serde_json::Value::Null]),
        ))
        .build()
}

/// `ResponsesRequest.metadata`.
pub(crate) fn metadata() -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::Object, Type::Null]))
        .max_properties(Some(MAX_METADATA_PAIRS))
        .property_names(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .max_length(Some(MAX_METADATA_KEY)),
        ))
        .additional_properties(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .max_length(Some(MAX_METADATA_VALUE)),
        ))
        .description(Some("Stored with the response and returned with it."))
        .build()
}

composed! {
    /// `POST /v1/responses`'s body: [`ResponsesRequest`], the sampling fields it acts on
    /// and what it accepts without acting on; any other field only as null.
    ResponseCreateRequest from [ResponsesRequest, SamplingFields],
        "The body of `POST /v1/responses`. Fields not listed here are refused (a 400 naming \
         them) unless null." => {
        let mut o = merged(ResponsesRequest::schema(), SamplingFields::schema(), |name| {
            FIELDS.contains(&name)
        });
        for name in IGNORED {
            o.properties.entry(name.to_owned()).or_insert_with(|| {
                ObjectBuilder::new()
                    .schema_type(SchemaType::AnyValue)
                    .description(Some("Accepted and not acted on."))
                    .into()
            });
        }
        let only = |kind: Type, value: serde_json::Value, what: &str| {
            ObjectBuilder::new()
                .schema_type(SchemaType::from_iter([kind, Type::Null]))
                .enum_values(Some([value, serde_json::Value::Null]))
                .description(Some(what))
                .build()
        };
        o.properties.insert(
            "background".into(),
            only(Type::Boolean, json!(false), "Only false: responses are not run in the background.").into(),
        );
        o.properties.insert(
            "truncation".into(),
            only(Type::String, json!("disabled"), "Only `disabled`: a conversation past the context is a 400.").into(),
        );
        o.properties.insert(
            "include".into(),
            ArrayBuilder::new()
                .schema_type(SchemaType::from_iter([Type::Array, Type::Null]))
                .max_items(Some(0))
                .description(Some("Only empty: no `include` values are supported."))
                .build()
                .into(),
        );
        o.additional_properties = Some(Box::new(AdditionalProperties::RefOr(
            Object::with_type(Type::Null).into(),
        )));
        o
    }
}

composed! {
    /// An input item of `POST /v1/responses`, by its `type` (`message` when it has none).
    ResponseInputItem from [MessageIn, CallIn, OutputIn, ReasoningIn],
        "An input item, by its `type` (`message` when it has none)." => {
        let with_type = |schema: RefOr<Schema>, kind: &str, required: bool, what: &str| {
            let RefOr::T(Schema::Object(mut o)) = schema else {
                unreachable!("input item structs derive object schemas");
            };
            o.properties.insert("type".into(), strings(&[kind]).into());
            if required {
                o.required.push("type".into());
            }
            o.description = Some(what.into());
            o
        };
        OneOfBuilder::new()
            .item(with_type(MessageIn::schema(), "message", false, "A message."))
            .item(with_type(CallIn::schema(), "function_call", true, "A function call the model made."))
            .item(with_type(OutputIn::schema(), "function_call_output", true, "A function call's result."))
            .item(with_type(ReasoningIn::schema(), "reasoning", true, "The model's reasoning, given back."))
    }
}

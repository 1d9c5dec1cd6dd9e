//! The chat request every protocol is turned into (OpenAI's shape: Anthropic's and the
//! Responses API's bodies are translated to it), and what it is checked and made into
//! before generating: the prompt's ids through the chat template, the grammar, the parsing.

use std::time::Instant;

use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::Value;
use utoipa::ToSchema;
use utoipa::openapi::schema::{Object, ObjectBuilder, OneOfBuilder, Schema};

use super::sampling::{MAX_TOP_LOGPROBS, SamplingFields};
use super::schema::{json_schema_fields, nullable, strings, typed};
use super::tools::{self, ToolChoice};
use crate::clients::output::Parsing;
use crate::clients::{GenParams, Message, WorkerInfo};
use crate::error::ApiError;
use crate::json::whole;
use crate::metrics::Stage;
use crate::state::AppState;

/// Options of a streamed answer.
#[derive(Debug, Default, Deserialize, ToSchema)]
pub(crate) struct StreamOptions {
    /// End the stream with a chunk that carries the usage of the whole request.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// A chat message's content: a string or a list of typed parts.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
#[schema(as = ChatContent)]
pub(crate) enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// A part of a message's content; only text parts are accepted (a 400 names the others).
#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = ChatContentPart)]
pub(crate) struct ContentPart {
    #[serde(rename = "type")]
    #[schema(schema_with = crate::generate::chat::chat_part_type)]
    pub kind: String,
    /// The text of a `text` part (which needs one).
    pub text: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct ChatMessage {
    #[schema(schema_with = crate::generate::chat::chat_role)]
    pub role: String,
    pub content: Option<Content>,
    /// Assistant turns: the calls it made (checked in detail by the tokenizer), as
    /// OpenAI writes them: `{"id", "type": "function", "function": {"name", "arguments"}}`.
    #[schema(value_type = Option<Vec<Object>>)]
    pub tool_calls: Option<Value>,
    /// Tool turns: the call this result answers.
    pub tool_call_id: Option<String>,
    /// Assistant turns: the reasoning shown before the answer.
    pub reasoning_content: Option<String>,
}

/// `POST /v1/chat/completions` (with [`SamplingFields`], read from the same body: the
/// OpenAPI document shows the two as one object, `openapi::ChatCompletionRequest`).
#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct ChatRequest {
    /// The served model's name (`GET /v1/models`).
    pub model: String,
    #[schema(min_items = 1)]
    pub messages: Vec<ChatMessage>,
    /// Answer with server-sent events, one chunk per piece of text.
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Return each generated token's log-probability.
    pub logprobs: Option<bool>,
    /// With `logprobs`, this many most likely alternatives per token.
    #[schema(minimum = 0, maximum = 20)]
    #[serde(default, deserialize_with = "whole::opt")]
    pub top_logprobs: Option<i64>,
    /// Function tools the model may call: `{"type": "function", "function": {"name",
    /// "description", "parameters"}}`.
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Value>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    #[schema(schema_with = crate::generate::chat::response_format)]
    pub response_format: Option<Value>,
    /// Extra variables for the chat format, as vLLM and SGLang take them; pdmesh reads
    /// `thinking` (or `enable_thinking`).
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<Value>,
}

pub(crate) const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

impl ChatRequest {
    /// The messages flattened to text, or a 400 naming the bad one.
    pub fn messages(&self) -> Result<Vec<Message>, ApiError> {
        messages(&self.messages)
    }
}

/// Chat messages flattened to text, or a 400 naming the bad one.
pub(crate) fn messages(list: &[ChatMessage]) -> Result<Vec<Message>, ApiError> {
    if list.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages must contain at least one message",
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].role"),
                    format!(
                        "unknown role {:?}; expected one of {}",
                        m.role,
                        ROLES.join(", ")
                    ),
                ));
            }
            let content = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => text.push_str(t),
                            _ => {
                                return Err(ApiError::unsupported(
                                    &format!("messages[{i}].content[{j}]"),
                                    format!(
                                        "content parts of type {:?} are not supported; only text",
                                        p.kind
                                    ),
                                ));
                            }
                        }
                    }
                    text
                }
            };
            let role = if m.role == "developer" {
                "system".to_owned()
            } else {
                m.role.clone()
            };
            let tool_calls_json = match &m.tool_calls {
                None | Some(Value::Null) => None,
                Some(Value::Array(a)) if a.is_empty() => None,
                Some(v @ Value::Array(calls)) if role == "assistant" => {
                    // As the tokenizer reads them, so a bad call is refused by name here.
                    for (j, call) in calls.iter().enumerate() {
                        if let Err(e) = pdmesh_chat::ToolCall::from_openai(call.clone()) {
                            let at = format!("messages[{i}].tool_calls[{j}]");
                            let param = match e.part {
                                "" => at,
                                part => format!("{at}.{part}"),
                            };
                            return Err(ApiError::invalid_param(
                                &param,
                                format!("{param} {}", e.problem),
                            ));
                        }
                    }
                    Some(v.to_string())
                }
                Some(Value::Array(_)) => {
                    return Err(ApiError::invalid_param(
                        &format!("messages[{i}].tool_calls"),
                        format!("only assistant messages carry tool_calls, not {:?}", m.role),
                    ));
                }
                Some(_) => {
                    return Err(ApiError::invalid_param(
                        &format!("messages[{i}].tool_calls"),
                        "tool_calls must be a list",
                    ));
                }
            };
            Ok(Message {
                role,
                content,
                tool_calls_json,
                tool_call_id: m.tool_call_id.clone(),
                reasoning: m.reasoning_content.clone().filter(|r| !r.is_empty()),
            })
        })
        .collect()
}

impl ChatRequest {
    /// `logprobs` and `top_logprobs`: `Some(alternatives)` when logprobs are asked for.
    pub fn logprobs(&self) -> Result<Option<u32>, ApiError> {
        let top = match self.top_logprobs {
            None => 0,
            Some(n) if (0..=MAX_TOP_LOGPROBS).contains(&n) => n as u32,
            Some(n) => {
                return Err(ApiError::invalid_param(
                    "top_logprobs",
                    format!("top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
                ));
            }
        };
        match self.logprobs {
            Some(true) => Ok(Some(top)),
            _ if top > 0 => Err(ApiError::invalid_param(
                "top_logprobs",
                "top_logprobs needs logprobs set to true",
            )),
            _ => Ok(None),
        }
    }

    /// `chat_template_kwargs.thinking` (or `.enable_thinking`); a 400 unless a boolean.
    pub fn thinking(&self) -> Result<bool, ApiError> {
        let Some(kw) = &self.chat_template_kwargs else {
            return Ok(false);
        };
        if !kw.is_object() {
            return Err(ApiError::invalid_param(
                "chat_template_kwargs",
                "chat_template_kwargs must be an object",
            ));
        }
        match kw.get("thinking").or_else(|| kw.get("enable_thinking")) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(ApiError::invalid_param(
                "chat_template_kwargs.thinking",
                format!("thinking must be true or false, not {other}"),
            )),
        }
    }

    pub fn tools_json(&self) -> Option<String> {
        match &self.tools {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) if a.is_empty() => None,
            Some(t) => Some(t.to_string()),
        }
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

/// The prompt must leave room for at least one token, and for `max_tokens` if given
/// (`max_param`: the field the request gave it in).
pub(crate) fn check_context(
    info: &WorkerInfo,
    prompt_len: usize,
    (max_tokens, max_param): (Option<u32>, &str),
    prompt_param: &str,
) -> Result<(), ApiError> {
    let ctx = info.context_length as usize;
    if ctx == 0 {
        return Ok(());
    }
    if prompt_len >= ctx {
        return Err(ApiError::context_length(
            format!(
                "This model's maximum context length is {ctx} tokens, but the prompt has {prompt_len} tokens \
                 (no room to generate). Please shorten the prompt."
            ),
            Some(prompt_param),
        ));
    }
    if let Some(m) = max_tokens
        && prompt_len + m as usize > ctx
    {
        return Err(ApiError::context_length(
            format!(
                "This model's maximum context length is {ctx} tokens. However, you requested {} tokens \
                 ({prompt_len} in the prompt, {m} for the completion). Please reduce the prompt or {max_param}.",
                prompt_len + m as usize
            ),
            Some(max_param),
        ));
    }
    Ok(())
}

/// `max_tokens` alone already beyond the context: rejected before tokenizing.
/// Logprobs name tokens by their text, which the gateway reads from its own copy of the
/// tokenizer (the one it detokenizes with).
pub(crate) async fn check_logprobs(st: &AppState, params: &GenParams) -> Result<(), ApiError> {
    if params.logprobs.is_some() && st.local_tokenizer().await.is_none() {
        return Err(ApiError::unsupported(
            "logprobs",
            "logprobs need the gateway to hold the model's tokenizer (start it with --model, as `pdmesh up` does)",
        ));
    }
    Ok(())
}

pub(crate) fn check_max_tokens(
    info: &WorkerInfo,
    max: (Option<u32>, &str),
) -> Result<(), ApiError> {
    check_context(info, 0, max, "max_tokens")
}

/// Names the request's span after the model, as the GenAI conventions do.
pub(crate) fn record_model(operation: &str, model: &str) {
    let span = tracing::Span::current();
    span.record("gen_ai.request.model", model);
    pdmesh_telemetry::rename(&span, format!("{operation} {model}"));
}

/// A chat request made ready to generate: the served model's name, the prompt's ids
/// (through the chat template), the worker's parameters and the output's parsing.
pub(crate) struct PreparedChat {
    pub model: String,
    pub ids: Vec<u32>,
    pub params: GenParams,
    pub parsing: Option<Parsing>,
    /// The field the grammar was made from (`response_format`, or `tools` for a forced
    /// call), if there is one: see [`blame_grammar`].
    pub grammar_from: Option<&'static str>,
}

/// A worker's refusal of the request's grammar (its schema does not compile: a bad
/// `pattern`, an unsatisfiable `required`) names the field the grammar came from. The
/// worker's engine says `invalid grammar: …` and knows no field of the request.
pub(crate) fn blame_grammar(mut e: ApiError, from: Option<&'static str>) -> ApiError {
    if e.param.is_none()
        && e.status == StatusCode::BAD_REQUEST
        && e.message.starts_with("invalid grammar")
    {
        e.param = from.map(str::to_owned);
    }
    e
}

/// Everything a chat request is checked and turned into before generating (the OpenAI
/// endpoint's, and the Anthropic one's once translated).
pub(crate) async fn prepare_chat(
    st: &AppState,
    req: &ChatRequest,
    fields: &SamplingFields,
) -> Result<PreparedChat, ApiError> {
    let mut params = fields.to_params()?;
    params.logprobs = req.logprobs()?;
    check_logprobs(st, &params).await?;
    let messages = req.messages()?;
    let tools = tools::parse_tools(req.tools.as_ref())?;
    let choice = tools::parse_tool_choice(req.tool_choice.as_ref(), &tools)?;
    let schema = tools::response_schema(req.response_format.as_ref())?;
    let thinking = req.thinking()?;
    let model = st.check_model(&req.model).await?;
    record_model("chat", &model);
    let info = st.worker_info().await?.clone();
    let max = (params.max_tokens, fields.max_param());
    check_max_tokens(&info, max)?;
    let format = st.output_format().await?;
    let (tools_json, parallel) = (req.tools_json(), req.parallel_tool_calls.unwrap_or(true));
    let grammar_from = if schema.is_some() {
        Some("response_format")
    } else if matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        Some("tools")
    } else {
        None
    };
    let grammar = grammar_from.is_some();
    let plan = if !grammar {
        tools::plan(
            &tools, tools_json, &choice, parallel, schema, format, thinking,
        )?
    } else {
        let choice = choice.clone();
        // Schemas become grammars off the async runtime, within a step budget and a
        // deadline: no request holds the gateway's threads (its `/live` must answer).
        let work = tokio::task::spawn_blocking(move || {
            tools::plan(
                &tools, tools_json, &choice, parallel, schema, format, thinking,
            )
        });
        match tokio::time::timeout(tools::SCHEMA_DEADLINE, work).await {
            Ok(Ok(plan)) => plan?,
            Ok(Err(e)) => {
                return Err(ApiError::backend(format!(
                    "preparing the grammar failed: {e}"
                )));
            }
            Err(_) => return Err(tools::past_deadline()),
        }
    };
    params.grammar = plan.grammar;
    let parsing = (plan.parse_tools.is_some() || format.reasoning).then(|| Parsing {
        tool_format: format.tools.filter(|_| plan.parse_tools.is_some()),
        tool_names: plan.parse_tools.unwrap_or_default(),
        reasoning: format.reasoning,
        thinking,
        call_id_prefix: format!("call_{}_", &uuid::Uuid::new_v4().simple().to_string()[..12]),
    });

    let t0 = Instant::now();
    let ids = st
        .backends
        .apply_chat_template(messages, plan.render, thinking)
        .await?;
    st.metrics
        .stage(Stage::Tokenize, t0.elapsed().as_secs_f64());
    check_context(&info, ids.len(), max, "messages")?;
    Ok(PreparedChat {
        model,
        ids,
        params,
        parsing,
        grammar_from,
    })
}

/// `ChatMessage.role`.
pub(crate) fn chat_role() -> Object {
    strings(&ROLES)
}

/// `ContentPart.kind`: the parts served.
pub(crate) fn chat_part_type() -> Object {
    strings(&["text"])
}

/// `ChatRequest.response_format`.
pub(crate) fn response_format() -> Schema {
    nullable(
        OneOfBuilder::new()
            .item(typed("text"))
            .item(typed("json_object"))
            .item(
                typed("json_schema")
                    .property("json_schema", json_schema_fields(ObjectBuilder::new()))
                    .required("json_schema"),
            )
            .description(Some(
                "The answer is made to match: any text, a JSON object, or a JSON schema.",
            )),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(ctx: u32) -> WorkerInfo {
        WorkerInfo {
            model_id: "m".into(),
            context_length: ctx,
            vocab_size: 100,
            total_pages: 1,
            free_pages: 1,
            cached_pages: 0,
            evicted_pages: 0,
            device_hit_tokens: 0,
            host: Default::default(),
            pd: Default::default(),
            faults: Vec::new(),
            auth_refused: 0,
            insecure_plaintext: false,
            incidents: Default::default(),
        }
    }

    #[test]
    fn context_checks_name_the_limit_and_the_param() {
        let m = |n| (n, "max_tokens");
        let e = check_context(&info(100), 100, m(None), "prompt").unwrap_err();
        assert_eq!(e.code, Some("context_length_exceeded"));
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert!(e.message.contains("100 tokens"), "{}", e.message);
        let e = check_context(&info(100), 60, m(Some(41)), "prompt").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(check_context(&info(100), 60, m(Some(40)), "prompt").is_ok());
        assert!(check_context(&info(100), 99, m(None), "prompt").is_ok());
        assert!(check_max_tokens(&info(100), m(Some(101))).is_err());
        // The limit is blamed on the field the request gave it in.
        let e = check_max_tokens(&info(100), (Some(101), "max_completion_tokens")).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
        assert!(
            e.message.ends_with("or max_completion_tokens."),
            "{}",
            e.message
        );
    }
}

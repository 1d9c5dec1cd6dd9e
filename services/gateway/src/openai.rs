//! The OpenAI wire format: request bodies, their validation into domain types, and the
//! JSON of responses and stream chunks. Every rejection is an [`ApiError`] naming the
//! parameter, checked here before any backend is called.

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use utoipa::ToSchema;

use crate::backend::{GenParams, Message, ToolCallDelta};
use crate::error::ApiError;
use crate::generate::{Collected, LogprobEntry, TokenText, Usage};

/// Most stop strings per request (OpenAI's limit).
pub(crate) const MAX_STOP: usize = 4;

/// Longest stop string, in bytes (the worker's engine refuses longer ones too: each is
/// matched after every generated token).
pub(crate) const MAX_STOP_BYTES: usize = 256;

/// Longest `cache_salt`, in bytes (the worker's engine refuses longer ones too).
pub(crate) const MAX_CACHE_SALT_BYTES: usize = 256;

/// Most alternatives per token: chat's `top_logprobs` and completions' `logprobs`
/// (OpenAI's limits).
pub(crate) const MAX_TOP_LOGPROBS: i64 = 20;
/// Most choices (`n`) one request may ask for: each holds a batch slot and its own pages
/// after the shared prompt.
pub(crate) const MAX_CHOICES: u32 = 16;
pub(crate) const MAX_COMPLETION_LOGPROBS: i64 = 5;

/// Parses a JSON body into `T`; syntax errors, invalid UTF-8, missing fields and wrong
/// types all become a 400 `invalid_request_error` (never axum's plain-text rejection).
pub(crate) fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if let Err(e) = std::str::from_utf8(body) {
        return Err(ApiError::invalid_request(
            format!(
                "the request body is not valid UTF-8 (invalid byte at offset {})",
                e.valid_up_to()
            ),
            None,
        ));
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid_request(
            "the request body is empty; expected a JSON object",
            None,
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let value: T = match serde_path_to_error::deserialize(&mut de) {
        Ok(v) => v,
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            return Err(match inner.classify() {
                serde_json::error::Category::Data if path != "." => ApiError::invalid_request(
                    format!("invalid value for `{path}`: {inner}"),
                    Some(&path),
                ),
                serde_json::error::Category::Data => {
                    // "missing field `x`": name the field as the param.
                    let msg = inner.to_string();
                    let missing = msg
                        .strip_prefix("missing field `")
                        .and_then(|r| r.split('`').next());
                    ApiError::invalid_request(format!("invalid request: {msg}"), missing)
                }
                _ => ApiError::invalid_request(
                    format!("could not parse the JSON body of the request: {inner}"),
                    None,
                ),
            });
        }
    };
    de.end().map_err(|e| {
        ApiError::invalid_request(
            format!("could not parse the JSON body of the request: {e}"),
            None,
        )
    })?;
    Ok(value)
}

/// Integer fields as JSON may write them: `5`, or `5.0`, which JSON Schema (and so the
/// OpenAPI document, whose `integer` admits it) counts as the same integer, as the
/// pydantic-based servers (vLLM, SGLang) do. Any other number (`5.5`, one out of the
/// field's range) is refused as serde refuses it. For `#[serde(deserialize_with)]`.
pub(crate) mod whole {
    use std::fmt;
    use std::marker::PhantomData;

    use serde::de::{Deserialize, Deserializer, Error, Unexpected, Visitor};

    /// An integer type a field holds.
    pub(crate) trait Int: Sized + TryFrom<i64> + TryFrom<u64> {
        const NAME: &'static str;
    }

    impl Int for i64 {
        const NAME: &'static str = "i64";
    }

    impl Int for u32 {
        const NAME: &'static str = "u32";
    }

    /// One integer, read as [`whole`](self) reads them.
    struct Whole<T>(T);

    impl<'de, T: Int> Deserialize<'de> for Whole<T> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(IntVisitor(PhantomData)).map(Whole)
        }
    }

    struct IntVisitor<T>(PhantomData<T>);

    impl<T: Int> Visitor<'_> for IntVisitor<T> {
        type Value = T;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(T::NAME)
        }

        fn visit_i64<E: Error>(self, v: i64) -> Result<T, E> {
            T::try_from(v).map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
        }

        fn visit_u64<E: Error>(self, v: u64) -> Result<T, E> {
            T::try_from(v).map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
        }

        fn visit_f64<E: Error>(self, v: f64) -> Result<T, E> {
            // Whole, and an i64 (2^63 is not): exactly that integer.
            const LIMIT: f64 = 9_223_372_036_854_775_808.0;
            if v.fract() == 0.0 && (-LIMIT..LIMIT).contains(&v) {
                self.visit_i64(v as i64)
            } else {
                Err(E::invalid_type(Unexpected::Float(v), &self))
            }
        }
    }

    pub(crate) fn int<'de, D: Deserializer<'de>, T: Int>(d: D) -> Result<T, D::Error> {
        Whole::deserialize(d).map(|w| w.0)
    }

    pub(crate) fn opt<'de, D: Deserializer<'de>, T: Int>(d: D) -> Result<Option<T>, D::Error> {
        Option::<Whole<T>>::deserialize(d).map(|o| o.map(|w| w.0))
    }

    pub(crate) fn list<'de, D: Deserializer<'de>, T: Int>(d: D) -> Result<Vec<T>, D::Error> {
        Vec::<Whole<T>>::deserialize(d).map(|v| v.into_iter().map(|w| w.0).collect())
    }

    pub(crate) fn opt_list<'de, D: Deserializer<'de>, T: Int>(
        d: D,
    ) -> Result<Option<Vec<T>>, D::Error> {
        Option::<Vec<Whole<T>>>::deserialize(d)
            .map(|o| o.map(|v| v.into_iter().map(|w| w.0).collect()))
    }

    pub(crate) fn lists<'de, D: Deserializer<'de>, T: Int>(d: D) -> Result<Vec<Vec<T>>, D::Error> {
        Vec::<Vec<Whole<T>>>::deserialize(d).map(|v| {
            v.into_iter()
                .map(|l| l.into_iter().map(|w| w.0).collect())
                .collect()
        })
    }
}

/// `stop`: a string or a list of strings (its schema, with the limits on both, is
/// written out in `openapi`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The sampling fields both endpoints share (parsed from the same body as the request).
/// The limits in the `schema` attributes are the ones [`SamplingFields::to_params`]
/// checks (a test in `openapi` holds them together).
#[derive(Debug, Default, Deserialize, ToSchema)]
pub(crate) struct SamplingFields {
    /// Sampling temperature; 0 picks the most likely token.
    #[schema(minimum = 0, maximum = 2)]
    pub temperature: Option<f64>,
    /// Nucleus sampling: the smallest set of tokens whose probabilities reach this.
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub top_p: Option<f64>,
    /// Sample from this many most likely tokens; -1 or 0 turns it off.
    #[schema(minimum = -1, maximum = 2147483647)]
    #[serde(default, deserialize_with = "whole::opt")]
    pub top_k: Option<i64>,
    /// Drop tokens less likely than this fraction of the most likely one's probability.
    #[schema(minimum = 0, maximum = 1)]
    pub min_p: Option<f64>,
    #[schema(minimum = -2, maximum = 2)]
    pub frequency_penalty: Option<f64>,
    #[schema(minimum = -2, maximum = 2)]
    pub presence_penalty: Option<f64>,
    #[schema(exclusive_minimum = 0, maximum = 10)]
    pub repetition_penalty: Option<f64>,
    /// Seed for sampling: the same request with the same seed gives the same answer.
    #[serde(default, deserialize_with = "whole::opt")]
    pub seed: Option<i64>,
    /// Most tokens to generate. The prompt and these must fit in the model's context
    /// (a 400 naming the field otherwise). Unset: up to the context's end.
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "whole::opt")]
    pub max_tokens: Option<i64>,
    /// OpenAI's newer name for `max_tokens`; wins over it when both are given.
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "whole::opt")]
    pub max_completion_tokens: Option<i64>,
    #[schema(schema_with = crate::openapi::stop)]
    pub stop: Option<Stop>,
    /// How many choices to generate for the one prompt.
    #[schema(minimum = 1, maximum = 16)]
    #[serde(default, deserialize_with = "whole::opt")]
    pub n: Option<i64>,
    /// Token ids that end the generation, as the end-of-sequence token does.
    #[serde(default, deserialize_with = "whole::opt_list")]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Generate past the end-of-sequence token (up to `max_tokens`).
    pub ignore_eos: Option<bool>,
    /// Token id (as a string, JSON's object keys) → bias in [-100, 100].
    #[schema(schema_with = crate::openapi::logit_bias)]
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// Generate at least this many tokens before the end-of-sequence token may end the
    /// answer; at most `max_tokens`.
    #[schema(minimum = 0)]
    #[serde(default, deserialize_with = "whole::opt")]
    pub min_tokens: Option<i64>,
    /// vLLM's prefix-cache salt: requests with different salts never share cached KV.
    #[schema(schema_with = crate::openapi::cache_salt)]
    pub cache_salt: Option<String>,
}

fn in_range(
    param: &str,
    v: Option<f64>,
    ok: impl Fn(f64) -> bool,
    range: &str,
) -> Result<Option<f32>, ApiError> {
    match v {
        None => Ok(None),
        // A positive value too small for an f32 (`top_p: 1e-50`) stays positive: as 0 it
        // would leave an open range such as top_p's (0, 1], and the worker refuse it.
        Some(x) if x.is_finite() && ok(x) && x > 0.0 => Ok(Some((x as f32).max(f32::MIN_POSITIVE))),
        Some(x) if x.is_finite() && ok(x) => Ok(Some(x as f32)),
        Some(x) => Err(ApiError::invalid_param(
            param,
            format!("{param} must be {range}, got {x}"),
        )),
    }
}

impl SamplingFields {
    /// The field the length limit was given in: `max_completion_tokens` wins over
    /// `max_tokens`.
    pub fn max_param(&self) -> &'static str {
        if self.max_completion_tokens.is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        }
    }

    /// Range-checks every field (OpenAI's ranges) and builds the worker's parameters.
    pub fn to_params(&self) -> Result<GenParams, ApiError> {
        let n = match self.n {
            None => 1,
            Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as u32,
            Some(n) => {
                return Err(ApiError::invalid_param(
                    "n",
                    format!("n must be between 1 and {MAX_CHOICES}, got {n}"),
                ));
            }
        };
        let temperature = in_range(
            "temperature",
            self.temperature,
            |x| (0.0..=2.0).contains(&x),
            "between 0 and 2",
        )?;
        let top_p = in_range("top_p", self.top_p, |x| x > 0.0 && x <= 1.0, "in (0, 1]")?;
        let min_p = in_range(
            "min_p",
            self.min_p,
            |x| (0.0..=1.0).contains(&x),
            "between 0 and 1",
        )?;
        let frequency_penalty = in_range(
            "frequency_penalty",
            self.frequency_penalty,
            |x| (-2.0..=2.0).contains(&x),
            "between -2 and 2",
        )?;
        let presence_penalty = in_range(
            "presence_penalty",
            self.presence_penalty,
            |x| (-2.0..=2.0).contains(&x),
            "between -2 and 2",
        )?;
        let repetition_penalty = in_range(
            "repetition_penalty",
            self.repetition_penalty,
            |x| x > 0.0 && x <= 10.0,
            "in (0, 10]",
        )?;
        let top_k = match self.top_k {
            None => None,
            Some(k) if (-1..=i64::from(i32::MAX)).contains(&k) => Some(k as i32),
            Some(k) => {
                return Err(ApiError::invalid_param(
                    "top_k",
                    format!("top_k must be -1 (disabled) or >= 0, got {k}"),
                ));
            }
        };
        let max_param = self.max_param();
        let max = self.max_completion_tokens.or(self.max_tokens);
        let max_tokens = match max {
            None => None,
            Some(m) if m >= 1 => Some(u32::try_from(m).unwrap_or(u32::MAX)),
            Some(m) => {
                return Err(ApiError::invalid_param(
                    max_param,
                    format!("{max_param} must be at least 1, got {m}"),
                ));
            }
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "at most {MAX_STOP} stop strings are allowed, got {}",
                    stop.len()
                ),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid_param(
                "stop",
                "stop strings must not be empty",
            ));
        }
        if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "a stop string is at most {MAX_STOP_BYTES} bytes, got one of {}",
                    long.len()
                ),
            ));
        }
        let mut logit_bias = Vec::new();
        for (k, &v) in self.logit_bias.iter().flatten() {
            let Ok(t) = k.parse::<u32>() else {
                return Err(ApiError::invalid_param(
                    "logit_bias",
                    format!("logit_bias keys must be token ids, got {k:?}"),
                ));
            };
            if !(-100.0..=100.0).contains(&v) {
                return Err(ApiError::invalid_param(
                    "logit_bias",
                    format!(
                        "logit_bias values must be between -100 and 100, got {v} for token {t}"
                    ),
                ));
            }
            logit_bias.push((t, v as f32));
        }
        let min_tokens = match self.min_tokens {
            None => 0,
            Some(m) if m < 0 => {
                return Err(ApiError::invalid_param(
                    "min_tokens",
                    format!("min_tokens must be at least 0, got {m}"),
                ));
            }
            Some(m) => match max_tokens {
                Some(max) if m > i64::from(max) => {
                    return Err(ApiError::invalid_param(
                        "min_tokens",
                        format!("min_tokens ({m}) must not exceed {max_param} ({max})"),
                    ));
                }
                _ => u32::try_from(m).unwrap_or(u32::MAX),
            },
        };
        match self.cache_salt.as_deref() {
            Some("") => {
                return Err(ApiError::invalid_param(
                    "cache_salt",
                    "cache_salt must be a non-empty string when given",
                ));
            }
            Some(salt) if salt.len() > MAX_CACHE_SALT_BYTES => {
                return Err(ApiError::invalid_param(
                    "cache_salt",
                    format!(
                        "cache_salt is at most {MAX_CACHE_SALT_BYTES} bytes, got {}",
                        salt.len()
                    ),
                ));
            }
            _ => {}
        }
        Ok(GenParams {
            temperature: temperature.unwrap_or(1.0),
            top_p,
            top_k,
            min_p,
            frequency_penalty: frequency_penalty.unwrap_or(0.0),
            presence_penalty: presence_penalty.unwrap_or(0.0),
            repetition_penalty,
            seed: self.seed.map(|s| s as u64),
            max_tokens,
            stop,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            grammar: None,
            logprobs: None,
            logit_bias,
            min_tokens,
            n,
            request: None,
            prompt_group: None,
            prompt_logprobs: None,
            cache_salt: self.cache_salt.clone(),
        })
    }
}

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
    #[schema(schema_with = crate::openapi::chat_part_type)]
    pub kind: String,
    /// The text of a `text` part (which needs one).
    pub text: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct ChatMessage {
    #[schema(schema_with = crate::openapi::chat_role)]
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
    #[schema(schema_with = crate::openapi::response_format)]
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
fn messages(list: &[ChatMessage]) -> Result<Vec<Message>, ApiError> {
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
                        if let Err(e) = pdmesh_text::ToolCall::from_openai(call.clone()) {
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

/// `POST /tokenize` (vLLM's): a prompt, or chat messages through the chat template.
#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct TokenizeRequest {
    /// The served model's name, if given.
    pub model: Option<String>,
    /// Text to tokenize (give this or `messages`).
    pub prompt: Option<String>,
    /// Chat messages to tokenize through the chat template (give this or `prompt`).
    pub messages: Option<Vec<ChatMessage>>,
    /// Prompts: BOS/EOS where the model adds them (default true). Messages: the template
    /// writes its own special tokens, so only false is accepted there.
    pub add_special_tokens: Option<bool>,
    /// Messages only, and only true: the template opens the assistant's turn.
    pub add_generation_prompt: Option<bool>,
    /// Messages only: function tools, as the chat endpoint takes them.
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Value>,
}

/// What [`TokenizeRequest`] asks to tokenize.
#[derive(Debug)]
pub(crate) enum ToTokenize {
    Prompt {
        text: String,
        add_special: bool,
    },
    Chat {
        messages: Vec<Message>,
        tools_json: Option<String>,
    },
}

impl TokenizeRequest {
    pub fn input(self) -> Result<ToTokenize, ApiError> {
        match (self.prompt, self.messages) {
            (Some(text), None) => {
                if self.add_generation_prompt.is_some() || self.tools.is_some() {
                    return Err(ApiError::invalid_param(
                        "add_generation_prompt",
                        "add_generation_prompt and tools go with messages, not a prompt",
                    ));
                }
                Ok(ToTokenize::Prompt {
                    text,
                    add_special: self.add_special_tokens.unwrap_or(true),
                })
            }
            (None, Some(list)) => {
                if self.add_generation_prompt == Some(false) {
                    return Err(ApiError::unsupported(
                        "add_generation_prompt",
                        "the chat template always ends with the assistant's turn opened here",
                    ));
                }
                if self.add_special_tokens == Some(true) {
                    return Err(ApiError::unsupported(
                        "add_special_tokens",
                        "messages are rendered by the chat template, which writes its own special tokens",
                    ));
                }
                let tools_json = match self.tools {
                    None | Some(Value::Null) => None,
                    Some(Value::Array(a)) if a.is_empty() => None,
                    Some(t @ Value::Array(_)) => Some(t.to_string()),
                    Some(_) => {
                        return Err(ApiError::invalid_param("tools", "tools must be a list"));
                    }
                };
                Ok(ToTokenize::Chat {
                    messages: messages(&list)?,
                    tools_json,
                })
            }
            _ => Err(ApiError::invalid_request(
                "give exactly one of `prompt` and `messages`",
                Some("prompt"),
            )),
        }
    }
}

/// `POST /detokenize` (vLLM's).
#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct DetokenizeRequest {
    /// The served model's name, if given.
    pub model: Option<String>,
    /// Token ids, each below the model's vocabulary size.
    #[serde(deserialize_with = "whole::list")]
    pub tokens: Vec<u32>,
}

/// A completions prompt: text, token ids, or a batch of one of either (its schema, with
/// the limits, is written out in `openapi`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Prompt {
    Text(String),
    Ids(#[serde(deserialize_with = "whole::list")] Vec<u32>),
    Texts(Vec<String>),
    IdBatch(#[serde(deserialize_with = "whole::lists")] Vec<Vec<u32>>),
}

/// The prompt once a batch of one has been unwrapped.
#[derive(Debug, PartialEq)]
pub(crate) enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
}

/// `POST /v1/completions` (with [`SamplingFields`], read from the same body: the OpenAPI
/// document shows the two as one object, `openapi::CompletionsRequest`).
#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct CompletionRequest {
    /// The served model's name (`GET /v1/models`).
    pub model: String,
    #[schema(schema_with = crate::openapi::prompt)]
    pub prompt: Prompt,
    /// Answer with server-sent events, one chunk per piece of text.
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Return each generated token's log-probability, with this many most likely
    /// alternatives.
    #[schema(minimum = 0, maximum = 5)]
    #[serde(default, deserialize_with = "whole::opt")]
    pub logprobs: Option<i64>,
    /// Start the answer with the prompt (with `logprobs`, the prompt's too).
    pub echo: Option<bool>,
    /// Only 1 is served.
    #[schema(minimum = 1, maximum = 1)]
    #[serde(default, deserialize_with = "whole::opt")]
    pub best_of: Option<i64>,
    /// Not supported: only empty.
    #[schema(max_length = 0)]
    pub suffix: Option<String>,
}

impl CompletionRequest {
    pub fn prompt(&self) -> Result<PromptInput, ApiError> {
        let batch = |n: usize| {
            ApiError::unsupported(
                "prompt",
                format!("a list of {n} prompts is not supported; send one prompt per request"),
            )
        };
        let input = match &self.prompt {
            Prompt::Text(t) => PromptInput::Text(t.clone()),
            Prompt::Ids(ids) => PromptInput::Ids(ids.clone()),
            Prompt::Texts(v) if v.len() == 1 => PromptInput::Text(v[0].clone()),
            Prompt::Texts(v) => return Err(batch(v.len())),
            Prompt::IdBatch(v) if v.len() == 1 => PromptInput::Ids(v[0].clone()),
            Prompt::IdBatch(v) => return Err(batch(v.len())),
        };
        let empty = match &input {
            PromptInput::Text(t) => t.is_empty(),
            PromptInput::Ids(ids) => ids.is_empty(),
        };
        if empty {
            return Err(ApiError::invalid_param(
                "prompt",
                "prompt must not be empty",
            ));
        }
        Ok(input)
    }

    /// `logprobs`: `Some(alternatives)` when asked for (0 gives the sampled tokens'
    /// alone).
    pub fn logprobs(&self) -> Result<Option<u32>, ApiError> {
        match self.logprobs {
            None => Ok(None),
            Some(n) if (0..=MAX_COMPLETION_LOGPROBS).contains(&n) => Ok(Some(n as u32)),
            Some(n) => Err(ApiError::invalid_param(
                "logprobs",
                format!("logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {n}"),
            )),
        }
    }

    pub fn check_supported(&self) -> Result<(), ApiError> {
        if self.best_of.is_some_and(|b| b != 1) {
            return Err(ApiError::unsupported("best_of", "best_of must be 1"));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::unsupported(
                "suffix",
                "suffix is not supported by this server",
            ));
        }
        Ok(())
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

/// The `usage` object.
pub(crate) fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
    })
}

/// Identity shared by every chunk of one response.
#[derive(Clone, Debug)]
pub(crate) struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    /// The request asked for logprobs: choices carry them (else `null`).
    pub logprobs: bool,
    /// A completion with `echo`: each choice starts with the prompt.
    pub echo: Option<Echo>,
}

/// The prompt a completion echoes: its text, and its first token (which has no
/// log-probability: nothing comes before it).
#[derive(Clone, Debug)]
pub(crate) struct Echo {
    pub text: String,
    pub first: TokenText,
}

/// The legacy `logprobs` of an echoed prompt: its first token with `null`s, then the rest
/// (`prompt`); offsets from 0, and `offset` left after the prompt.
pub(crate) fn echo_logprobs(e: &Echo, prompt: &[LogprobEntry], offset: &mut usize) -> Value {
    *offset = e.first.text.chars().count();
    let mut v = completion_logprobs(prompt, offset);
    for (key, first) in [
        ("tokens", json!(e.first.text)),
        ("token_logprobs", Value::Null),
        ("top_logprobs", Value::Null),
        ("text_offset", json!(0)),
    ] {
        if let Some(a) = v[key].as_array_mut() {
            a.insert(0, first);
        }
    }
    v
}

/// Two legacy `logprobs` objects one after the other (an echoed prompt's and the
/// completion's).
pub(crate) fn join_logprobs(mut a: Value, b: Value) -> Value {
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(x), Some(y)) = (a[key].as_array_mut(), b[key].as_array()) {
            x.extend(y.iter().cloned());
        }
    }
    a
}

/// A chat choice's `logprobs`: per token its text, log-probability, bytes and
/// alternatives (OpenAI's `ChatCompletionTokenLogprob`).
pub(crate) fn chat_logprobs(entries: &[LogprobEntry]) -> Value {
    let one = |t: &TokenText, lp: f32| json!({"token": t.text, "logprob": lp, "bytes": t.bytes});
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = one(&e.token, e.logprob);
            v["top_logprobs"] = e.top.iter().map(|(t, lp)| one(t, *lp)).collect();
            v
        })
        .collect();
    json!({ "content": content, "refusal": null })
}

/// A completion choice's `logprobs` (the legacy shape): token texts, their
/// log-probabilities, the alternatives as `{text: logprob}` and each token's character
/// offset in the completion, counted on from `offset` (advanced past these tokens).
pub(crate) fn completion_logprobs(entries: &[LogprobEntry], offset: &mut usize) -> Value {
    let mut offsets = Vec::with_capacity(entries.len());
    for e in entries {
        offsets.push(*offset);
        *offset += e.token.text.chars().count();
    }
    let top: Vec<Value> = entries
        .iter()
        .map(|e| {
            let map: serde_json::Map<String, Value> = e
                .top
                .iter()
                .map(|(t, lp)| (t.text.clone(), json!(lp)))
                .collect();
            Value::Object(map)
        })
        .collect();
    json!({
        "tokens": entries.iter().map(|e| e.token.text.as_str()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

/// Choice `index` of a chat completion.
pub(crate) fn chat_choice(
    m: &ResponseMeta,
    index: usize,
    out: &Collected,
    finish_reason: &str,
) -> Value {
    let mut message = json!({ "role": "assistant", "content": out.text });
    if !out.reasoning.is_empty() {
        message["reasoning_content"] = json!(out.reasoning);
    }
    if !out.tool_calls.is_empty() {
        if out.text.is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = out
            .tool_calls
            .iter()
            .map(|(id, name, arguments)| {
                json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
            })
            .collect();
    }
    json!({
        "index": index,
        "message": message,
        "logprobs": if m.logprobs { chat_logprobs(&out.logprobs) } else { Value::Null },
        "finish_reason": finish_reason,
    })
}

pub(crate) fn chat_completion(m: &ResponseMeta, choices: Vec<Value>, usage: &Usage) -> Value {
    json!({
        "id": m.id,
        "object": "chat.completion",
        "created": m.created,
        "model": m.model,
        "choices": choices,
        "usage": usage_json(usage),
    })
}

/// The delta of one tool-call piece: the first carries id, type and name.
pub(crate) fn tool_call_delta(d: &ToolCallDelta) -> Value {
    let mut call = json!({"index": d.index, "function": {"arguments": d.arguments}});
    if !d.id.is_empty() {
        call["id"] = json!(d.id);
        call["type"] = json!("function");
    }
    if !d.name.is_empty() {
        call["function"]["name"] = json!(d.name);
    }
    json!({ "tool_calls": [call] })
}

/// A stream chunk; `logprobs` is the choice's (`null` unless asked for).
pub(crate) fn chat_chunk(
    m: &ResponseMeta,
    index: usize,
    delta: Value,
    finish_reason: Option<&str>,
    logprobs: Value,
) -> Value {
    json!({
        "id": m.id,
        "object": "chat.completion.chunk",
        "created": m.created,
        "model": m.model,
        "choices": [{ "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason }],
    })
}

/// Choice `index` of a text completion.
pub(crate) fn completion_choice(
    m: &ResponseMeta,
    index: usize,
    out: &Collected,
    finish_reason: &str,
) -> Value {
    let mut offset = 0;
    let (text, logprobs) = match (&m.echo, m.logprobs) {
        (None, false) => (out.text.clone(), Value::Null),
        (None, true) => (
            out.text.clone(),
            completion_logprobs(&out.logprobs, &mut offset),
        ),
        (Some(e), false) => (format!("{}{}", e.text, out.text), Value::Null),
        (Some(e), true) => {
            let prompt = echo_logprobs(e, &out.prompt_logprobs, &mut offset);
            let rest = completion_logprobs(&out.logprobs, &mut offset);
            (
                format!("{}{}", e.text, out.text),
                join_logprobs(prompt, rest),
            )
        }
    };
    json!({ "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason })
}

pub(crate) fn completion(m: &ResponseMeta, choices: Vec<Value>, usage: &Usage) -> Value {
    json!({
        "id": m.id,
        "object": "text_completion",
        "created": m.created,
        "model": m.model,
        "choices": choices,
        "usage": usage_json(usage),
    })
}

pub(crate) fn completion_chunk(
    m: &ResponseMeta,
    index: usize,
    text: &str,
    finish_reason: Option<&str>,
    logprobs: Value,
) -> Value {
    json!({
        "id": m.id,
        "object": "text_completion",
        "created": m.created,
        "model": m.model,
        "choices": [{ "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason }],
    })
}

/// The final usage-only chunk of a stream (`stream_options.include_usage`).
pub(crate) fn usage_chunk(m: &ResponseMeta, object: &str, usage: &Usage) -> Value {
    json!({
        "id": m.id,
        "object": object,
        "created": m.created,
        "model": m.model,
        "choices": [],
        "usage": usage_json(usage),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err<T: DeserializeOwned + std::fmt::Debug>(body: &str) -> ApiError {
        parse::<T>(body.as_bytes()).unwrap_err()
    }

    fn params(body: &str) -> Result<GenParams, ApiError> {
        parse::<SamplingFields>(body.as_bytes())
            .unwrap()
            .to_params()
    }

    #[test]
    fn malformed_json_is_a_400_with_the_parser_message() {
        let e = err::<ChatRequest>(r#"{"model": "m", "messages": [}"#);
        assert_eq!(e.status, 400);
        assert!(
            e.message.starts_with("could not parse the JSON body"),
            "{}",
            e.message
        );
        let e = err::<ChatRequest>(r#"{"model": "m", "messages": []} trailing"#);
        assert_eq!(e.status, 400);
    }

    #[test]
    fn invalid_utf8_is_a_400_not_a_crash() {
        let e = parse::<ChatRequest>(b"{\"model\": \"m\xff\", \"messages\": []}").unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("UTF-8"), "{}", e.message);
    }

    #[test]
    fn missing_field_and_wrong_type_name_the_problem() {
        let e = err::<ChatRequest>(r#"{"model": "m"}"#);
        assert!(
            e.message.contains("missing field `messages`"),
            "{}",
            e.message
        );
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = err::<SamplingFields>(r#"{"temperature": "hot"}"#);
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = err::<ChatRequest>(r#"{"model": "m", "messages": [{"role": 7, "content": "x"}]}"#);
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
    }

    #[test]
    fn out_of_range_sampling_params_are_rejected_by_name() {
        let long_stop = format!(r#"{{"stop": ["{}"]}}"#, "x".repeat(MAX_STOP_BYTES + 1));
        let long_salt = format!(
            r#"{{"cache_salt": "{}"}}"#,
            "s".repeat(MAX_CACHE_SALT_BYTES + 1)
        );
        for (body, param) in [
            (r#"{"cache_salt": ""}"#, "cache_salt"),
            (long_salt.as_str(), "cache_salt"),
            (r#"{"max_tokens": 0}"#, "max_tokens"),
            (r#"{"max_tokens": -5}"#, "max_tokens"),
            (r#"{"max_completion_tokens": 0}"#, "max_completion_tokens"),
            (r#"{"temperature": -0.1}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_p": 1.5}"#, "top_p"),
            (r#"{"min_p": 2}"#, "min_p"),
            (r#"{"frequency_penalty": 3}"#, "frequency_penalty"),
            (r#"{"top_k": -2}"#, "top_k"),
            (r#"{"stop": ["a","b","c","d","e"]}"#, "stop"),
            (r#"{"stop": ""}"#, "stop"),
            (long_stop.as_str(), "stop"),
            (r#"{"n": 0}"#, "n"),
            (r#"{"n": 17}"#, "n"),
        ] {
            let e = params(body).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
    }

    /// Schemathesis sends `5.0` where the document says integer (JSON Schema's integer
    /// admits it): such requests were refused as "expected i64".
    #[test]
    fn integers_written_as_whole_floats_are_integers() {
        let f: SamplingFields = parse(
            br#"{"max_tokens": 5.0, "max_completion_tokens": 6.0, "n": 2.0, "seed": -3.0,
                "top_k": 40.0, "min_tokens": 1.0, "stop_token_ids": [2.0, 3]}"#,
        )
        .unwrap();
        assert_eq!(
            (
                f.max_tokens,
                f.max_completion_tokens,
                f.n,
                f.seed,
                f.top_k,
                f.min_tokens
            ),
            (Some(5), Some(6), Some(2), Some(-3), Some(40), Some(1))
        );
        assert_eq!(f.stop_token_ids, Some(vec![2, 3]));
        let f: SamplingFields =
            parse(br#"{"max_tokens": null, "seed": 9007199254740992.0}"#).unwrap();
        assert_eq!((f.max_tokens, f.seed), (None, Some(1 << 53)));
        for (body, param) in [
            (r#"{"max_tokens": 5.5}"#, "max_tokens"),
            (r#"{"max_tokens": "5"}"#, "max_tokens"),
            (r#"{"seed": 1e300}"#, "seed"),
            (r#"{"seed": 9223372036854775808.0}"#, "seed"),
            (r#"{"stop_token_ids": [-1.0]}"#, "stop_token_ids[0]"),
            (r#"{"stop_token_ids": [4294967296.0]}"#, "stop_token_ids[0]"),
            (r#"{"n": 1e-9}"#, "n"),
        ] {
            let e = err::<SamplingFields>(body);
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        assert!(
            err::<SamplingFields>(r#"{"max_tokens": 5.5}"#)
                .message
                .contains("floating point `5.5`, expected i64")
        );
        let prompt = |body: &str| {
            parse::<CompletionRequest>(body.as_bytes())
                .unwrap()
                .prompt()
        };
        assert_eq!(
            prompt(r#"{"model":"m","prompt":[1.0,2]}"#).unwrap(),
            PromptInput::Ids(vec![1, 2])
        );
        assert_eq!(
            prompt(r#"{"model":"m","prompt":[[4.0]]}"#).unwrap(),
            PromptInput::Ids(vec![4])
        );
        assert_eq!(
            err::<CompletionRequest>(r#"{"model":"m","prompt":[1.5]}"#)
                .param
                .as_deref(),
            Some("prompt")
        );
        let c: CompletionRequest =
            parse(br#"{"model":"m","prompt":"x","logprobs":2.0,"best_of":1.0}"#).unwrap();
        assert_eq!((c.logprobs, c.best_of), (Some(2), Some(1)));
        let d: DetokenizeRequest = parse(br#"{"tokens":[1.0,2]}"#).unwrap();
        assert_eq!(d.tokens, [1, 2]);
        let r: ChatRequest = parse(br#"{"model":"m","messages":[],"top_logprobs":3.0}"#).unwrap();
        assert_eq!(r.top_logprobs, Some(3));
    }

    /// `top_p: 1e-50` passed the gateway's (0, 1] check, became 0 as an f32 and was
    /// refused by the worker ("got 0", no `param`).
    #[test]
    fn open_ranges_stay_open_once_narrowed() {
        let p = params(r#"{"top_p": 1e-50, "repetition_penalty": 1e-300}"#).unwrap();
        assert!(p.top_p.unwrap() > 0.0);
        assert!(p.repetition_penalty.unwrap() > 0.0);
        assert_eq!(params(r#"{"top_p": 0.5}"#).unwrap().top_p, Some(0.5));
        assert_eq!(params(r#"{"temperature": 0}"#).unwrap().temperature, 0.0);
    }

    #[test]
    fn defaults_and_mapping() {
        let p = params("{}").unwrap();
        assert_eq!(p.cache_salt, None);
        let salt = "s".repeat(MAX_CACHE_SALT_BYTES);
        let p = params(&format!(r#"{{"cache_salt": "{salt}"}}"#)).unwrap();
        assert_eq!(p.cache_salt, Some(salt));
        let p = params("{}").unwrap();
        assert_eq!(p.temperature, 1.0);
        assert_eq!(p.max_tokens, None);
        let p = params(r#"{"temperature": 0, "max_tokens": 7, "max_completion_tokens": 9, "stop": "\n", "seed": 3, "top_k": 40}"#)
            .unwrap();
        assert_eq!(p.temperature, 0.0);
        assert_eq!(
            p.max_tokens,
            Some(9),
            "max_completion_tokens wins over max_tokens"
        );
        assert_eq!(p.stop, ["\n"]);
        assert_eq!(p.seed, Some(3));
        assert_eq!(p.top_k, Some(40));
    }

    #[test]
    fn completion_prompt_forms() {
        let prompt = |body: &str| {
            parse::<CompletionRequest>(body.as_bytes())
                .unwrap()
                .prompt()
        };
        assert_eq!(
            prompt(r#"{"model":"m","prompt":"hi"}"#).unwrap(),
            PromptInput::Text("hi".into())
        );
        assert_eq!(
            prompt(r#"{"model":"m","prompt":["hi"]}"#).unwrap(),
            PromptInput::Text("hi".into())
        );
        assert_eq!(
            prompt(r#"{"model":"m","prompt":[1,2,3]}"#).unwrap(),
            PromptInput::Ids(vec![1, 2, 3])
        );
        assert_eq!(
            prompt(r#"{"model":"m","prompt":[[4,5]]}"#).unwrap(),
            PromptInput::Ids(vec![4, 5])
        );
        assert_eq!(
            prompt(r#"{"model":"m","prompt":["a","b"]}"#)
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(
            prompt(r#"{"model":"m","prompt":""}"#).unwrap_err().status,
            400
        );
        assert_eq!(
            prompt(r#"{"model":"m","prompt":[]}"#).unwrap_err().status,
            400
        );
        assert_eq!(
            err::<CompletionRequest>(r#"{"model":"m","prompt":[-1]}"#).status,
            400
        );
    }

    #[test]
    fn chat_content_parts_are_joined_and_images_rejected() {
        let req: ChatRequest = parse(
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
        )
        .unwrap();
        assert_eq!(req.messages().unwrap()[0].content, "ab");
        let req: ChatRequest =
            parse(br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#).unwrap();
        assert_eq!(req.messages().unwrap_err().status, 400);
        let req: ChatRequest =
            parse(br#"{"model":"m","messages":[{"role":"wizard","content":"x"}]}"#).unwrap();
        assert_eq!(
            req.messages().unwrap_err().param.as_deref(),
            Some("messages[0].role")
        );
        let req: ChatRequest = parse(br#"{"model":"m","messages":[]}"#).unwrap();
        assert_eq!(req.messages().unwrap_err().status, 400);
    }

    /// An assistant's tool call the tokenizer cannot read was refused by the tokenizer,
    /// with no `param` (and, through `/v1/responses`, naming a chat field).
    #[test]
    fn assistant_tool_calls_are_checked_by_name() {
        let bad = |calls: Value| {
            let body = json!({"model": "m", "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": calls}]});
            parse::<ChatRequest>(body.to_string().as_bytes())
                .unwrap()
                .messages()
                .map(|_| ())
        };
        for (calls, param) in [
            (
                json!([{"function": {"name": "f", "arguments": "x"}}]),
                "messages[1].tool_calls[0].function.arguments",
            ),
            (
                json!([{"function": {"name": "", "arguments": "{}"}}]),
                "messages[1].tool_calls[0].function.name",
            ),
            (
                json!([{"id": "c", "function": {"name": "f", "arguments": "{}"}}, 7]),
                "messages[1].tool_calls[1]",
            ),
        ] {
            let e = bad(calls).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param));
            assert!(e.message.starts_with(param), "{}", e.message);
        }
        bad(json!([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]))
            .unwrap();
    }

    #[test]
    fn logprobs_ranges_and_their_pairing() {
        let chat = |extra: &str| {
            parse::<ChatRequest>(format!(r#"{{"model":"m","messages":[]{extra}}}"#).as_bytes())
                .unwrap()
                .logprobs()
        };
        assert_eq!(chat("").unwrap(), None);
        assert_eq!(chat(r#","logprobs":false"#).unwrap(), None);
        assert_eq!(chat(r#","logprobs":true"#).unwrap(), Some(0));
        assert_eq!(
            chat(r#","logprobs":true,"top_logprobs":20"#).unwrap(),
            Some(20)
        );
        for bad in [
            r#","logprobs":true,"top_logprobs":21"#,
            r#","logprobs":true,"top_logprobs":-1"#,
            r#","top_logprobs":3"#,
        ] {
            assert_eq!(
                chat(bad).unwrap_err().param.as_deref(),
                Some("top_logprobs"),
                "{bad}"
            );
        }
        let completion = |lp: i64| {
            parse::<CompletionRequest>(
                format!(r#"{{"model":"m","prompt":"x","logprobs":{lp}}}"#).as_bytes(),
            )
            .unwrap()
            .logprobs()
        };
        assert_eq!(completion(0).unwrap(), Some(0));
        assert_eq!(completion(5).unwrap(), Some(5));
        assert_eq!(
            completion(6).unwrap_err().param.as_deref(),
            Some("logprobs")
        );
        assert_eq!(
            completion(-1).unwrap_err().param.as_deref(),
            Some("logprobs")
        );
    }

    #[test]
    fn logit_bias_and_min_tokens_are_checked_and_passed_on() {
        let p =
            params(r#"{"logit_bias": {"28": 5, "13": -100}, "min_tokens": 3, "max_tokens": 8}"#)
                .unwrap();
        assert_eq!(
            (p.logit_bias, p.min_tokens),
            (vec![(13, -100.0), (28, 5.0)], 3)
        );
        for (body, param) in [
            (r#"{"logit_bias": {"the": 1}}"#, "logit_bias"),
            (r#"{"logit_bias": {"5": 100.5}}"#, "logit_bias"),
            (r#"{"min_tokens": -1}"#, "min_tokens"),
            (r#"{"min_tokens": 9, "max_tokens": 8}"#, "min_tokens"),
            (
                r#"{"min_tokens": 9, "max_completion_tokens": 8}"#,
                "min_tokens",
            ),
        ] {
            assert_eq!(
                params(body).unwrap_err().param.as_deref(),
                Some(param),
                "{body}"
            );
        }
        assert_eq!(
            err::<SamplingFields>(r#"{"logit_bias": [1]}"#)
                .param
                .as_deref(),
            Some("logit_bias")
        );
    }

    #[test]
    fn logprobs_render_in_the_chat_and_the_legacy_shapes() {
        let t = |s: &str| TokenText {
            text: s.into(),
            bytes: s.as_bytes().to_vec(),
        };
        let entries = vec![
            LogprobEntry {
                token: t("Hé"),
                logprob: -0.25,
                top: vec![(t("Hé"), -0.25), (t("Ho"), -2.0)],
            },
            LogprobEntry {
                token: t("!"),
                logprob: -1.5,
                top: vec![(t("."), -0.5), (t("!"), -1.5)],
            },
        ];
        let c = chat_logprobs(&entries);
        assert_eq!(c["content"][0]["token"], "Hé");
        assert_eq!(c["content"][0]["bytes"], json!([72, 195, 169]));
        assert_eq!(
            c["content"][1]["top_logprobs"][0],
            json!({"token": ".", "logprob": -0.5, "bytes": [46]})
        );
        let mut offset = 10;
        let l = completion_logprobs(&entries, &mut offset);
        assert_eq!(l["tokens"], json!(["Hé", "!"]));
        assert_eq!(l["token_logprobs"], json!([-0.25, -1.5]));
        assert_eq!(l["top_logprobs"][1], json!({".": -0.5, "!": -1.5}));
        assert_eq!(
            l["text_offset"],
            json!([10, 12]),
            "offsets count characters"
        );
        assert_eq!(offset, 13);
    }
}

//! The legacy completions' request (its prompt as text or token ids) and the OpenAPI schemas
//! of both OpenAI bodies, which read the sampling fields from the same JSON.

use serde::Deserialize;
use serde_json::{Value, json};
use utoipa::ToSchema;
use utoipa::openapi::schema::{
    AllOfBuilder, ArrayBuilder, Object, ObjectBuilder, OneOfBuilder, Schema, SchemaType, Type,
};

use crate::api::schema::{composed, merged};
use crate::clients::Message;
use crate::error::ApiError;
use crate::generate::chat::{ChatMessage, ChatRequest, StreamOptions, messages};
use crate::generate::sampling::{MAX_COMPLETION_LOGPROBS, SamplingFields};
use crate::json::whole;

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
    #[schema(schema_with = crate::api::openai::request::prompt)]
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

/// `CompletionRequest.prompt`: text, token ids, or a batch of one of either.
pub(crate) fn prompt() -> Schema {
    let id = || {
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .minimum(Some(0))
            .maximum(Some(u32::MAX))
    };
    let ids = || ArrayBuilder::new().items(id()).min_items(Some(1));
    let text = || {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(1))
    };
    OneOfBuilder::new()
        .item(text())
        .item(ids())
        .item(
            ArrayBuilder::new()
                .items(text())
                .min_items(Some(1))
                .max_items(Some(1)),
        )
        .item(
            ArrayBuilder::new()
                .items(ids())
                .min_items(Some(1))
                .max_items(Some(1)),
        )
        .description(Some(
            "Text, token ids (each below the vocabulary size), or a list of one of either \
             (one prompt per request).",
        ))
        .into()
}

composed! {
    /// `POST /v1/chat/completions`'s body: [`ChatRequest`] and [`SamplingFields`].
    ChatCompletionRequest from [ChatRequest, SamplingFields],
        "The body of `POST /v1/chat/completions`: OpenAI's fields and vLLM's extra sampling fields." =>
        merged(ChatRequest::schema(), SamplingFields::schema(), |_| true)
}

composed! {
    /// `POST /v1/completions`'s body: [`CompletionRequest`] and [`SamplingFields`].
    CompletionsRequest from [CompletionRequest, SamplingFields],
        "The body of `POST /v1/completions`: OpenAI's fields and vLLM's extra sampling fields." =>
        merged(CompletionRequest::schema(), SamplingFields::schema(), |_| true)
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

composed! {
    /// `POST /tokenize`'s body: [`TokenizeRequest`], with what `TokenizeRequest::input`
    /// checks: exactly one of `prompt` and `messages` (null is absent, as serde reads it),
    /// and the fields that go with each.
    TokenizeBody from [TokenizeRequest],
        "The body of `POST /tokenize`: a `prompt`, or `messages` (with `tools`) rendered by \
         the chat template." => {
        let null = || Object::with_type(Type::Null);
        let prompt = ObjectBuilder::new()
            .property("prompt", Object::with_type(Type::String))
            .required("prompt")
            .property("messages", null())
            .property("add_generation_prompt", null())
            .property("tools", null());
        let messages = ObjectBuilder::new()
            .property(
                "messages",
                ArrayBuilder::new().min_items(Some(1)).items(Object::new()),
            )
            .required("messages")
            .property("prompt", null())
            .property(
                "add_special_tokens",
                ObjectBuilder::new()
                    .schema_type(SchemaType::from_iter([Type::Boolean, Type::Null]))
                    .enum_values(Some([json!(false), serde_json::Value::Null])),
            )
            .property(
                "add_generation_prompt",
                ObjectBuilder::new()
                    .schema_type(SchemaType::from_iter([Type::Boolean, Type::Null]))
                    .enum_values(Some([json!(true), serde_json::Value::Null])),
            );
        AllOfBuilder::new()
            .item(TokenizeRequest::schema())
            .item(OneOfBuilder::new().item(prompt).item(messages))
    }
}

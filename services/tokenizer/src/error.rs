//! The tokenizer service's error type and its single mapping to gRPC status codes.

use std::path::PathBuf;

use pdmesh_chat::ChatError;
use pdmesh_tokenize::TokenizerError;

/// Everything the tokenizer service can fail with, from start-up to a single request.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("loading the tokenizer from {path}: {source}")]
    Load { path: PathBuf, source: ChatError },
    #[error("starting the tokenizer service: {0}")]
    Startup(String),
    /// The `--chat-template` file cannot serve; `problem` says why and what to do.
    #[error("--chat-template {}: {problem}", path.display())]
    ChatTemplate { path: PathBuf, problem: String },
    #[error(transparent)]
    Tls(#[from] pdmesh_tls::TlsError),
    #[error("serving gRPC: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// A `bytes` field that must hold UTF-8 does not; `field` is its path in the request.
    #[error("{field} is not valid UTF-8")]
    InvalidUtf8 { field: String },
    #[error("{field}: token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        field: String,
        token: u32,
        vocab: usize,
    },
    #[error("tools_json is not valid JSON: {0}")]
    ToolsJson(serde_json::Error),
    /// A field holds UTF-8 but not what it must (`field` is its path in the request,
    /// `problem` finishes the sentence: "is not a JSON object").
    #[error("{field} {problem}")]
    InvalidField { field: String, problem: String },
    /// A chat request to a model with no chat format; `model` is the name it is served
    /// under. The message says both ways out, as vLLM's does.
    #[error(
        "this model ({model}) has no chat template: serve it with --chat-template FILE (a Jinja template), or use /v1/completions"
    )]
    NoChatTemplate { model: String },
    /// The template refused the conversation (e.g. a role order it does not support).
    #[error("chat template: {0}")]
    Template(ChatError),
    #[error("tokenizer: {0}")]
    Text(TokenizerError),
}

impl Error {
    /// Closed set of labels for metrics.
    pub fn error_type(&self) -> &'static str {
        match self {
            Self::Load { .. }
            | Self::Startup(_)
            | Self::ChatTemplate { .. }
            | Self::Transport(_)
            | Self::Tls(_) => "startup",
            Self::InvalidUtf8 { .. } => "invalid_utf8",
            Self::TokenOutOfRange { .. } => "token_out_of_range",
            Self::ToolsJson(_) => "tools_json",
            Self::InvalidField { .. } => "invalid_field",
            Self::NoChatTemplate { .. } => "no_chat_template",
            Self::Template(_) => "template",
            Self::Text(_) => "tokenizer",
        }
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        let msg = e.to_string();
        match e {
            Error::InvalidUtf8 { .. }
            | Error::TokenOutOfRange { .. }
            | Error::ToolsJson(_)
            | Error::InvalidField { .. }
            | Error::Template(_) => tonic::Status::invalid_argument(msg),
            Error::NoChatTemplate { .. } => tonic::Status::failed_precondition(msg),
            Error::Load { .. }
            | Error::Startup(_)
            | Error::ChatTemplate { .. }
            | Error::Transport(_)
            | Error::Tls(_)
            | Error::Text(_) => tonic::Status::internal(msg),
        }
    }
}

//! pdmesh-engine: the inference engine. A model forward pass that reads and writes KV
//! only through a [`pdmesh_kv::PagePool`], sampling, and a continuous-batching scheduler
//! with chunked prefill and admission by free pages.
//!
//! [`Engine`] is a plain struct driven by `submit` / `abort` / `step`; the worker service
//! wraps it in an actix actor, tests drive it directly.

mod api;
mod budget;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod deepseek;
pub mod deepseek_synth;
mod engine;
pub mod gemma;
mod gpu;
mod grammar;
pub use grammar::{Grammar, GrammarCompiler, GrammarError};
mod llama_config;
mod model;
mod sampler;
pub mod tp;
mod vocab;

pub use api::{
    FinishReason, GenRequest, Logprob, MAX_STOP_BYTES, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS,
    ModelInfo, Part, SamplingParams, StepEvent,
};
pub use engine::{DEFAULT_MAX_QUEUED, Engine, EngineConfig, HostStats, WritePolicy};
pub use gpu::{CUDA_BUILT, CudaError, CudaErrorKind, GpuConfig};
pub use model::{BatchToken, rms_norm};

/// Everything that can go wrong between a request and the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid {field}: {msg}")]
    InvalidParam { field: &'static str, msg: String },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens; this model's context length is {context}")]
    PromptTooLong { prompt: usize, context: usize },
    #[error(
        "prompt ({prompt} tokens) plus max_tokens ({max_tokens}) exceeds the context length {context}"
    )]
    MaxTokensTooLarge {
        prompt: usize,
        max_tokens: usize,
        context: usize,
    },
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("request id {0:?} is already running")]
    DuplicateId(String),
    /// `pages`: what ran short, "KV pages", or a hybrid model's window pages (whose
    /// number `--kv-window-pages` sets).
    #[error("the request needs {need} {pages} but the pool only has {total}")]
    TooLargeForPool {
        need: usize,
        total: usize,
        pages: &'static str,
    },
    #[error("model: {0}")]
    Model(#[from] pdmesh_gguf::GgufError),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("the engine is offline")]
    Offline,
    /// A prefill/decode hand-over failed (unknown request, wrong page count, bytes that
    /// did not match their checksum).
    #[error("KV transfer: {0}")]
    Transfer(String),
    /// The caller's `fill` of a hand-over's pages failed; its own error, kept whole so
    /// the caller can read it back by type.
    #[error("KV transfer: {0}")]
    Fill(#[source] FillError),
    /// The engine's queue holds its limit of waiting requests; try again later.
    #[error("the engine's queue is full ({limit} requests waiting); retry later")]
    QueueFull { limit: usize },
    /// The GPU failed (loading, or a forward pass: then every request of that batch ends
    /// with it).
    #[error(transparent)]
    Cuda(#[from] CudaError),
}

/// Why the bytes handed to [`Engine::import`] could not be written: the caller's error.
pub type FillError = Box<dyn std::error::Error + Send + Sync>;

impl EngineError {
    /// Closed set of labels for metrics.
    pub fn error_type(&self) -> &'static str {
        match self {
            Self::InvalidParam { .. } => "invalid_param",
            Self::EmptyPrompt => "empty_prompt",
            Self::PromptTooLong { .. } | Self::MaxTokensTooLarge { .. } => "context_length",
            Self::TokenOutOfRange { .. } => "token_out_of_range",
            Self::DuplicateId(_) => "duplicate_id",
            Self::TooLargeForPool { .. } => "too_large_for_pool",
            Self::Model(_) | Self::Unsupported(_) => "model",
            Self::Offline => "offline",
            Self::Transfer(_) | Self::Fill(_) => "transfer",
            Self::QueueFull { .. } => "queue_full",
            Self::Cuda(e) => match e.kind {
                CudaErrorKind::OutOfMemory => "device_out_of_memory",
                CudaErrorKind::Device => "device",
                CudaErrorKind::Setup | CudaErrorKind::Unsupported => "model",
            },
        }
    }

    /// Whether the caller sent something wrong (as opposed to a server-side failure).
    pub fn is_client_error(&self) -> bool {
        !matches!(
            self,
            Self::Model(_)
                | Self::Unsupported(_)
                | Self::Offline
                | Self::Transfer(_)
                | Self::Fill(_)
                | Self::QueueFull { .. }
                | Self::Cuda(_)
        )
    }
}

pub use llama_config::LlamaConfig;

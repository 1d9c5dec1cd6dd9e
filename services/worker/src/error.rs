//! The worker service's error type and its single mapping to gRPC status codes.

use pdmesh_engine::{CudaErrorKind, EngineError};

/// Everything the worker service can fail with, from start-up to a single request.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid worker configuration: {0}")]
    Config(String),
    #[error("starting the engine thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("serving gRPC: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// A `bytes` field that must hold UTF-8 does not; `field` is its path in the request.
    #[error("{field} is not valid UTF-8")]
    InvalidUtf8 { field: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(
        "this worker is draining (shutting down): it finishes what it runs and takes nothing new"
    )]
    Draining,
    /// The hard-mode watchdog: the engine loop has not stepped for `limit`.
    #[error("the engine loop has made no step for over {limit:?}; refusing requests until it does")]
    Stalled { limit: std::time::Duration },
    #[error("grammar too complex: it did not compile within {} s", .limit.as_secs())]
    GrammarTooSlow { limit: std::time::Duration },
    /// A blocking task of this worker's own failed (a panic).
    #[error("{what}: {error}")]
    Task {
        what: &'static str,
        error: tokio::task::JoinError,
    },
}

impl Error {
    /// Closed set of labels for metrics.
    pub fn error_type(&self) -> &'static str {
        match self {
            Self::Config(_) | Self::Thread(_) | Self::Transport(_) => "startup",
            Self::Draining => "draining",
            Self::Stalled { .. } => "stalled",
            Self::GrammarTooSlow { .. } => "grammar_too_slow",
            Self::Task { .. } => "internal",
            Self::InvalidUtf8 { .. } => "invalid_utf8",
            Self::Engine(e) => e.error_type(),
        }
    }
}

impl From<Error> for tonic::Status {
    /// The code says who is to blame; the error's kind ([`Error::error_type`]) travels
    /// beside it, typed, for the caller to classify by.
    fn from(e: Error) -> Self {
        use tonic::Code;
        let code = match &e {
            Error::InvalidUtf8 { .. } | Error::GrammarTooSlow { .. } => Code::InvalidArgument,
            Error::Draining | Error::Stalled { .. } => Code::Unavailable,
            Error::Engine(EngineError::Offline) => Code::Unavailable,
            Error::Engine(EngineError::QueueFull { .. }) => Code::ResourceExhausted,
            // Out of device memory is load, not a fault: another worker may take it.
            Error::Engine(EngineError::Cuda(c)) if c.kind == CudaErrorKind::OutOfMemory => {
                Code::Unavailable
            }
            Error::Engine(err) if err.is_client_error() => Code::InvalidArgument,
            Error::Engine(_)
            | Error::Config(_)
            | Error::Thread(_)
            | Error::Transport(_)
            | Error::Task { .. } => Code::Internal,
        };
        pdmesh_proto::error_kind::status(code, e.to_string(), e.error_type())
    }
}

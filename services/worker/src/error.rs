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
}

impl Error {
    /// Closed set of labels for metrics.
    pub fn error_type(&self) -> &'static str {
        match self {
            Self::Config(_) | Self::Thread(_) | Self::Transport(_) => "startup",
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
            Error::InvalidUtf8 { .. } => Code::InvalidArgument,
            Error::Engine(EngineError::Offline) => Code::Unavailable,
            Error::Engine(EngineError::QueueFull { .. }) => Code::ResourceExhausted,
            // Out of device memory is load, not a fault: another worker may take it.
            Error::Engine(EngineError::Cuda(c)) if c.kind == CudaErrorKind::OutOfMemory => {
                Code::Unavailable
            }
            Error::Engine(err) if err.is_client_error() => Code::InvalidArgument,
            Error::Engine(_) | Error::Config(_) | Error::Thread(_) | Error::Transport(_) => {
                Code::Internal
            }
        };
        pdmesh_proto::error_kind::status(code, e.to_string(), e.error_type())
    }
}

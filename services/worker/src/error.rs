//! The worker service's error type and its single mapping to gRPC status codes.

use pdmesh_engine::EngineError;

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
    fn from(e: Error) -> Self {
        let msg = e.to_string();
        match e {
            Error::InvalidUtf8 { .. } => tonic::Status::invalid_argument(msg),
            Error::Engine(EngineError::Offline) => tonic::Status::unavailable(msg),
            Error::Engine(EngineError::QueueFull { .. }) => tonic::Status::resource_exhausted(msg),
            Error::Engine(ref err) if err.is_client_error() => tonic::Status::invalid_argument(msg),
            Error::Engine(_) | Error::Config(_) | Error::Thread(_) | Error::Transport(_) => {
                tonic::Status::internal(msg)
            }
        }
    }
}

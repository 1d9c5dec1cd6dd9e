//! Why routing could not start a request: no worker to pick, a worker that did not start
//! it in time or say which host it is on, or a worker's own refusal. Classified once, as
//! the gateway's HTTP errors are (`From<RouteError> for ApiError`).

use std::time::Duration;

use tonic::Status;

use crate::error::ApiError;

#[derive(Debug, thiserror::Error)]
pub(crate) enum RouteError {
    #[error("no {side} worker is known yet (none given, or DNS names none)")]
    NoWorker { side: &'static str },
    #[error("worker {url} did not start the request within {} ms", .limit.as_millis())]
    NotStarted { url: String, limit: Duration },
    #[error("worker {url}: {why}")]
    NoHome { url: String, why: String },
    #[error("worker {url} did not say which host it is on in time")]
    HomeTimeout { url: String },
    /// The worker refused the call: its status, as the wire carried it.
    #[error("{}", .0.message())]
    Worker(Status),
}

impl RouteError {
    /// Whether the mesh could not take the request now (nothing of it ran): a start
    /// refused so is tried once more.
    pub fn unavailable(&self) -> bool {
        match self {
            Self::Worker(s) => s.code() == tonic::Code::Unavailable,
            Self::NoWorker { .. }
            | Self::NotStarted { .. }
            | Self::NoHome { .. }
            | Self::HomeTimeout { .. } => true,
        }
    }
}

impl From<RouteError> for ApiError {
    fn from(e: RouteError) -> Self {
        match e {
            RouteError::Worker(s) => s.into(),
            e => ApiError::unavailable(format!("backend unavailable: {e}")),
        }
    }
}

//! Why one request's side of a hand-over failed, classified once: the failure the worker
//! counts and the status its caller sees.

use std::time::Duration;

use pdmesh_cache_client::rooms::HandoverError;
use pdmesh_engine::EngineError;
use pdmesh_telemetry::labels::TransferFailure;
use tonic::Status;

use crate::error::Error;

#[derive(Debug, thiserror::Error)]
pub(crate) enum PdError {
    /// A room call, as the cache service answered it (or did not).
    #[error(transparent)]
    Room(#[from] HandoverError),
    /// The engine refused or failed the request.
    #[error(transparent)]
    Worker(#[from] Error),
    #[error("the engine went away")]
    EngineGone,
    #[error("the caller left")]
    CallerLeft,
    /// Pages or their data changed on the way (checksums, counts, the aux data).
    #[error("{0}")]
    Corrupt(String),
    /// No decode pages became free before the admission deadline.
    #[error("no KV pages for a {prompt}-token prompt became free within {within:?}")]
    NoPages { prompt: usize, within: Duration },
    /// The mesh's own fault (sizes or counts that disagree, a task that failed).
    #[error("{0}")]
    Internal(String),
}

impl From<EngineError> for PdError {
    fn from(e: EngineError) -> Self {
        Self::Worker(e.into())
    }
}

impl PdError {
    /// The failure `pdmesh_kv_transfer_failures_total` counts it as.
    pub(crate) fn failure(&self) -> TransferFailure {
        match self {
            Self::Room(r) => r.failure(),
            Self::Worker(Error::Engine(EngineError::QueueFull { .. })) | Self::NoPages { .. } => {
                TransferFailure::Admission
            }
            Self::CallerLeft => TransferFailure::CallerLeft,
            Self::Corrupt(_) => TransferFailure::Checksum,
            Self::Worker(_) | Self::EngineGone | Self::Internal(_) => TransferFailure::Other,
        }
    }
}

impl From<PdError> for Status {
    fn from(e: PdError) -> Self {
        match e {
            PdError::Room(r) => r.into(),
            PdError::Worker(w) => w.into(),
            PdError::EngineGone => Status::unavailable(e.to_string()),
            PdError::CallerLeft => Status::cancelled(e.to_string()),
            PdError::Corrupt(m) => Status::data_loss(m),
            PdError::NoPages { .. } => Status::resource_exhausted(e.to_string()),
            PdError::Internal(m) => Status::internal(m),
        }
    }
}

//! Why a call over a link to another host's cache service failed. Its gRPC code is chosen
//! once ([`PeerError::code`]); a refusal the home answered keeps the home's code.

use std::time::Duration;

use tonic::{Code, Status};

use super::MAX_LINKS;
use crate::transfer::TransferError;

#[derive(Debug, thiserror::Error)]
pub(crate) enum PeerError {
    #[error("room home {home:?} is not one of this cache service's --peer list")]
    NotListed { home: String },
    #[error(
        "room home {home:?}: without mutual TLS this cache service relays rooms only to the \
         cache services its --peer list names, and it names none"
    )]
    NoPeerList { home: String },
    #[error("this host already links to {MAX_LINKS} other cache services")]
    TooManyLinks,
    #[error("room home {url:?}: {why}")]
    BadHome { url: String, why: String },
    #[error("{what} at {url}: {why}")]
    Unreachable {
        what: &'static str,
        url: String,
        why: String,
    },
    #[error("{host} does not resolve")]
    Unresolved { host: String },
    #[error("{what} at {url} passed its {limit:?} deadline")]
    Deadline {
        what: &'static str,
        url: String,
        limit: Duration,
    },
    /// The home refused the call: its code and words, and where they came from.
    #[error("{what} at {url}: {}", .status.message())]
    Answered {
        what: &'static str,
        url: String,
        status: Status,
    },
    #[error("{url} answered a peer registration with {page_bytes} B pages and page port {port}")]
    BadRegistration {
        url: String,
        page_bytes: u64,
        port: u32,
    },
    /// The home answered with something that makes no sense.
    #[error("{url} answered {what} with {why}")]
    Garbled {
        url: String,
        what: &'static str,
        why: String,
    },
    #[error(transparent)]
    Transfer(#[from] TransferError),
}

impl PeerError {
    /// The code a caller of this service sees for it.
    pub fn code(&self) -> Code {
        match self {
            Self::NotListed { .. } | Self::NoPeerList { .. } => Code::PermissionDenied,
            Self::TooManyLinks => Code::ResourceExhausted,
            Self::BadHome { .. } => Code::InvalidArgument,
            Self::Unreachable { .. } | Self::Unresolved { .. } => Code::Unavailable,
            Self::Deadline { .. } => Code::DeadlineExceeded,
            Self::Answered { status, .. } => status.code(),
            Self::BadRegistration { .. } => Code::FailedPrecondition,
            Self::Garbled { .. } => Code::Internal,
            Self::Transfer(e) => e.code(),
        }
    }
}

impl From<PeerError> for Status {
    fn from(e: PeerError) -> Self {
        Status::new(e.code(), e.to_string())
    }
}

impl TransferError {
    /// The code a sender sees for a failed transfer.
    pub fn code(&self) -> Code {
        match self {
            Self::LayoutRefused { .. } => Code::FailedPrecondition,
            Self::Unauthenticated { .. } => Code::Unauthenticated,
            Self::Checksum { .. } => Code::DataLoss,
            Self::Refused { .. } => Code::Aborted,
            Self::Deadline { .. } => Code::DeadlineExceeded,
            Self::Connect { .. } | Self::Io { .. } | Self::Broken { .. } => Code::Unavailable,
            Self::PageSize { .. } | Self::TrailerSize(_) | Self::Protocol { .. } => Code::Internal,
        }
    }
}

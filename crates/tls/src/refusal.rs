//! Why a call or connection was refused for its credential, and the count of refusals
//! (each service's `pdmesh_auth_refused_total`). Both the guard ([`crate::auth`]) and the
//! role check ([`crate::role`]) refuse through here; the gRPC status is chosen once, in
//! `From<Refusal> for Status`.

use std::sync::atomic::{AtomicU64, Ordering};

use tonic::Status;

/// How many calls and transport connections this process refused for a missing or wrong
/// credential, or a certificate without the role the call needs.
static REFUSED: AtomicU64 = AtomicU64::new(0);

/// Counts one refusal.
pub(crate) fn count() {
    REFUSED.fetch_add(1, Ordering::Relaxed);
}

/// Calls and page-transport connections refused so far for their credential.
pub fn total() -> u64 {
    REFUSED.load(Ordering::Relaxed)
}

/// A call the mesh credential did not admit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("this mesh service needs a client certificate the mesh CA signed")]
    NoCertificate,
    #[error("this mesh service needs the mesh token (authorization: Bearer)")]
    NoToken,
    #[error("the mesh token does not match")]
    WrongToken,
    #[error(
        "{what} is for a {allowed} certificate; the caller's names {have} (its subject's OU entries)"
    )]
    WrongRole {
        what: String,
        /// The roles the call is open to, and those the caller's certificate names, as
        /// `Roles` writes them.
        allowed: String,
        have: String,
    },
}

impl Refusal {
    /// Counts this refusal and hands it back, for `Err(...)`.
    pub(crate) fn counted(self) -> Self {
        count();
        self
    }
}

impl From<Refusal> for Status {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::WrongRole { .. } => Status::permission_denied(r.to_string()),
            _ => Status::unauthenticated(r.to_string()),
        }
    }
}

//! A failure's kind, typed, beside its gRPC code: a service attaches one label of its
//! closed set of error types (for example `context_length`) to the status it answers as a
//! `google.rpc.ErrorInfo` in the `pdmesh` domain, and the caller classifies the failure by
//! that label, never by the message's words.

use tonic_types::{ErrorDetails, StatusExt};

/// The `ErrorInfo` domain of pdmesh's own error kinds.
pub const DOMAIN: &str = "pdmesh";

/// The kind of a prompt (plus `max_tokens`) longer than the model's context.
pub const CONTEXT_LENGTH: &str = "context_length";

/// A status of `code` with `message`, naming its `kind`.
pub fn status(code: tonic::Code, message: impl Into<String>, kind: &str) -> tonic::Status {
    tonic::Status::with_error_details(
        code,
        message,
        ErrorDetails::with_error_info(kind, DOMAIN, std::collections::HashMap::new()),
    )
}

/// The kind `status` names, if a pdmesh service attached one.
pub fn of(status: &tonic::Status) -> Option<String> {
    status
        .get_details_error_info()
        .filter(|i| i.domain == DOMAIN)
        .map(|i| i.reason)
}

/// Whether `status` is one the transport made up because the connection broke (a peer
/// that died or a link that went down mid-call), not one a peer answered: it carries its
/// cause, which a status read off the wire never does. UNKNOWN and INTERNAL only; the
/// transport's UNAVAILABLE and timeouts already say what they are.
pub fn connection_lost(status: &tonic::Status) -> bool {
    matches!(status.code(), tonic::Code::Unknown | tonic::Code::Internal)
        && std::error::Error::source(status).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_made_from_a_broken_connection_is_told_from_one_a_peer_sent() {
        let broken = tonic::Status::from_error(Box::new(std::io::Error::other("reset")));
        assert!(connection_lost(&broken));
        assert!(!connection_lost(&tonic::Status::unknown(
            "the peer said so"
        )));
        assert!(!connection_lost(&tonic::Status::internal(
            "the peer said so"
        )));
        assert!(!connection_lost(&tonic::Status::unavailable("down")));
    }

    #[test]
    fn a_kind_travels_with_its_status_and_only_in_its_domain() {
        let s = status(tonic::Code::InvalidArgument, "too long", CONTEXT_LENGTH);
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert_eq!(s.message(), "too long");
        assert_eq!(of(&s).as_deref(), Some(CONTEXT_LENGTH));
        // Through the wire form (the trailers' status details) and back.
        let wire = s.clone().into_http::<()>();
        let back = tonic::Status::from_header_map(wire.headers()).unwrap();
        assert_eq!(of(&back).as_deref(), Some(CONTEXT_LENGTH));
        assert_eq!(of(&tonic::Status::invalid_argument("context length")), None);
        let other = tonic::Status::with_error_details(
            tonic::Code::InvalidArgument,
            "x",
            ErrorDetails::with_error_info(
                CONTEXT_LENGTH,
                "elsewhere",
                std::collections::HashMap::new(),
            ),
        );
        assert_eq!(of(&other), None, "another domain's reasons are not ours");
    }
}

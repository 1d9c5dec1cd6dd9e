//! What a worker passes on when the cache service refuses a room call: never a code
//! that blames the client's request.

use super::*;

/// The codes a gateway answers with a 4xx, blaming the client's request.
pub(super) const CLIENT_ERRORS: [tonic::Code; 4] = [
    tonic::Code::InvalidArgument,
    tonic::Code::FailedPrecondition,
    tonic::Code::OutOfRange,
    tonic::Code::NotFound,
];

#[test]
fn every_code_a_cache_service_refuses_a_room_call_with_is_passed_on_as_the_meshs_fault() {
    use tonic::Code::*;
    let table = [
        (Ok, Internal),
        (Cancelled, Cancelled),
        (Unknown, Internal),
        (InvalidArgument, Internal),
        (DeadlineExceeded, DeadlineExceeded),
        (NotFound, Aborted),
        (AlreadyExists, Internal),
        (PermissionDenied, Internal),
        // A full mirror: the mesh's overload, retried until the transfer deadline.
        (ResourceExhausted, ResourceExhausted),
        (FailedPrecondition, Internal),
        (Aborted, Aborted),
        (OutOfRange, Internal),
        (Unimplemented, Internal),
        (Internal, Internal),
        (Unavailable, Unavailable),
        (DataLoss, DataLoss),
        (Unauthenticated, Internal),
    ];
    assert_eq!(table.len(), 17, "every gRPC code");
    for (code, want) in table {
        let err = HandoverError::from_cache(ClientError::Rpc(Status::new(
            code,
            "the cache service's words",
        )));
        let passed = Status::from(err);
        assert_eq!(passed.code(), want, "{code:?}");
        assert!(!CLIENT_ERRORS.contains(&passed.code()), "{code:?}");
        assert!(
            passed.message().contains("the cache service's words"),
            "{code:?}: {passed:?}"
        );
    }
}

#[test]
fn a_connection_that_broke_under_a_room_call_is_unreachable_not_a_refusal() {
    let broken = Status::from_error(Box::new(std::io::Error::other("transport error")));
    assert_eq!(broken.code(), tonic::Code::Unknown);
    let err = HandoverError::from_cache(ClientError::Rpc(broken));
    assert!(matches!(err, HandoverError::Unreachable(_)), "{err:?}");
    assert_eq!(err.failure(), TransferFailure::CacheUnavailable);
    assert_eq!(Status::from(err).code(), tonic::Code::Unavailable);
    // The same code sent by the service is still its refusal.
    let sent = HandoverError::from_cache(ClientError::Rpc(Status::unknown("no")));
    assert!(matches!(sent, HandoverError::Refused { .. }), "{sent:?}");
}

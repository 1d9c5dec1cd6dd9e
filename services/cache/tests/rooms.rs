//! A worker's room link and room calls (pdmesh-cache-client's `rooms`) against the real
//! cache service on loopback: a link that registers again, a room open retried with the
//! new lease, and refusals passed on as the mesh's fault.

use std::sync::Arc;
use std::time::Duration;

use pdmesh_cache::client::{DataPlane, HostClient, RoomOpen};
use pdmesh_cache_client::rooms::{RELINK_GRACE, RoomLink, by};
use pdmesh_kv::KvLayout;
use pdmesh_proto::cache::v1 as cpb;
use pdmesh_testkit::service::Service;

mod common;

use common::{host_client, past_reconnect, serve_in};

/// The codes a gateway answers with a 4xx, blaming the client's request.
const CLIENT_ERRORS: [tonic::Code; 4] = [
    tonic::Code::InvalidArgument,
    tonic::Code::FailedPrecondition,
    tonic::Code::OutOfRange,
    tonic::Code::NotFound,
];

/// A cache service on loopback (at `addr`; port 0 picks one) with its mirror under `shm`.
async fn cache_service(
    addr: std::net::SocketAddr,
    shm: &std::path::Path,
    layout: &KvLayout,
) -> Service<pdmesh_cache::Error> {
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    serve_in(listener, shm, 16 * layout.bytes_per_page() as u64, |cfg| {
        // Long: no heartbeat comes between the restart and the request.
        cfg.lease_ttl_ms = 60_000;
        // A restart here is a crash: no drain holds the room the test leaves open.
        cfg.drain_timeout_ms = 0;
    })
}

/// A running service with a link registered at it, its client, and the service then
/// restarted on the same address: it no longer knows the link's lease, and no heartbeat
/// came to say so. Returns the link, the client it had, and the new service.
async fn linked_then_restarted(
    layout: &KvLayout,
    shm: &std::path::Path,
    worker: &str,
) -> (RoomLink, Arc<HostClient>, Service<pdmesh_cache::Error>) {
    let any = "127.0.0.1:0".parse().unwrap();
    let first_service = cache_service(any, shm, layout).await;
    let link = RoomLink::start(
        first_service.url(),
        (worker.into(), String::new()),
        layout.clone(),
        pdmesh_tls::test_ca::auth(),
    );
    let first = link.wait(Duration::from_secs(10)).await.unwrap();
    let addr = first_service.addr;
    first_service.stop().await.unwrap();
    let restarted = cache_service(addr, shm, layout).await;
    (link, first, restarted)
}

#[tokio::test]
async fn a_request_in_the_moment_the_room_link_registers_again_waits_for_it() {
    let layout = KvLayout::llama(2, 1, 8, pdmesh_kv::DType::F16, 4);
    let dir = tempfile::tempdir().unwrap();
    // The service restarts: the link's lease is gone, and the first room call says so.
    let (link, first, svc) = linked_then_restarted(&layout, dir.path(), "w").await;
    let refused = past_reconnect(async || first.room_open(1, cpb::RoomSide::Sender, "r", "").await)
        .await
        .expect_err("the new service knows no such lease");
    assert_eq!(refused.code(), tonic::Code::NotFound);
    assert!(
        link.get().is_none(),
        "the link is down until it registers again"
    );
    // A request now is served once the link registered again, not refused.
    let again = link.wait(RELINK_GRACE).await.unwrap();
    assert!(again.is_alive());
    again
        .room_open(1, cpb::RoomSide::Sender, "r", "")
        .await
        .unwrap();
    drop(link);
    svc.stop().await.unwrap();
}

#[tokio::test]
async fn a_room_open_refused_for_a_lease_the_service_forgot_opens_again_with_the_new_one() {
    let layout = KvLayout::llama(2, 1, 8, pdmesh_kv::DType::F16, 4);
    let dir = tempfile::tempdir().unwrap();
    // The service restarts, forgetting the lease, and no heartbeat comes to say so.
    let (link, first, svc) = linked_then_restarted(&layout, dir.path(), "prefill-1").await;
    // The broken connection fails a call before it connects again: a call that
    // changes nothing takes that.
    let _ = past_reconnect(async || first.room_abort(9, "reconnecting").await).await;
    // A request holding the old client opens its room.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let (again, st) = link
        .open_room(
            first.clone(),
            deadline,
            (1, cpb::RoomSide::Sender),
            ("r", ""),
            RoomOpen::default(),
        )
        .await
        .expect("opened with the lease registered again, not refused");
    assert_eq!(st.state, cpb::RoomState::Bootstrapping as i32);
    assert!(!first.is_alive());
    assert!(!Arc::ptr_eq(&again, &first), "registered again");
    drop((link, first, again));
    svc.stop().await.unwrap();
}

#[tokio::test]
async fn a_cache_services_refusals_of_room_calls_never_reach_the_caller_as_client_errors() {
    use tonic::Code::*;
    let layout = KvLayout::llama(2, 1, 8, pdmesh_kv::DType::F16, 4);
    let dir = tempfile::tempdir().unwrap();
    let svc = cache_service("127.0.0.1:0".parse().unwrap(), dir.path(), &layout).await;
    let c = host_client(&svc.url(), "w", &layout, DataPlane::Shm)
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    // A room this worker sends in, with no receiver yet.
    c.room_open(7, cpb::RoomSide::Sender, "r", "")
        .await
        .unwrap();
    let refused = [
        // A malformed call, a room in the wrong state, a side this lease is not, an
        // unknown room: the service's own words, and what this worker passes on.
        (
            "room 0",
            by(
                deadline,
                "open",
                c.room_open(0, cpb::RoomSide::Sender, "r", ""),
            )
            .await
            .map(|_| ()),
            InvalidArgument,
            Internal,
        ),
        (
            "a start before the receiver joined",
            by(deadline, "start", c.room_start(7, 1)).await.map(|_| ()),
            FailedPrecondition,
            Internal,
        ),
        (
            "the sender asking for the receiver's pages",
            by(deadline, "result", c.room_result(7)).await.map(|_| ()),
            PermissionDenied,
            Internal,
        ),
        (
            "a room never opened",
            by(
                deadline,
                "wait",
                c.room_wait(8, cpb::RoomState::Success, Duration::from_millis(1)),
            )
            .await
            .map(|_| ()),
            NotFound,
            Aborted,
        ),
    ];
    for (what, got, said, want) in refused {
        let e = tonic::Status::from(got.expect_err(what));
        assert_eq!(e.code(), want, "{what}: {e:?}");
        assert!(!CLIENT_ERRORS.contains(&e.code()), "{what}: {e:?}");
        // The service's words travel along, and its code with them where it changed.
        if said != want {
            assert!(
                e.message().contains(&format!("{said:?}")) || said == NotFound,
                "{what}: {e:?}"
            );
        }
    }
    drop(c);
    svc.stop().await.unwrap();
}

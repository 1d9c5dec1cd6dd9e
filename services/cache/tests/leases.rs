//! Who gets a lease at the cache service and what happens when it ends: another KV
//! layout, a missing credential or a malformed registration is refused creating nothing,
//! and a silent worker's lease expires and frees what it pinned.

use std::time::Duration;

use pb::cache_client::CacheClient;
use pdmesh_cache::client::DataPlane;
use pdmesh_kv::{DType, KvLayout};
use pdmesh_proto::cache::v1 as pb;

mod common;

use pdmesh_testkit::service::answer;

use common::{
    chain, client, dsv32, host_client, layout, past_reconnect, start, start_at, start_with, store,
};

#[tokio::test]
async fn a_worker_with_another_layout_is_refused_and_the_message_names_both() {
    let s = start(8, 10_000).await;
    let _first = client(&s, "fp16", DataPlane::Shm).await;
    let other = KvLayout::llama(30, 3, 64, DType::Bf16, 4);
    let err = host_client(&s.url(), "bf16", &other, DataPlane::Grpc)
        .await
        .unwrap_err();
    let pdmesh_cache::client::ClientError::Rpc(status) = err else {
        panic!("{err}")
    };
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert!(
        status.message().contains(&layout().to_string()),
        "{}",
        status.message()
    );
    assert!(
        status.message().contains(&other.to_string()),
        "{}",
        status.message()
    );
    s.stop().await;
}

/// The hybrid seed: a decode worker that dropped Gemma 3's window group (every layer
/// global) registers where the mirror holds the hybrid layout. Same bytes per page, same
/// components: only the grouping differs, and it is refused naming both groupings.
#[tokio::test]
async fn a_worker_that_believes_every_layer_global_is_refused_by_a_hybrid_mirror() {
    use common::gemma3;
    let (hybrid, global) = (gemma3(false), gemma3(true));
    assert_eq!(hybrid.bytes_per_page(), global.bytes_per_page());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let s = common::serve(listener, 8 * hybrid.bytes_per_page() as u64, |_| {});
    let _prefill = host_client(&s.url(), "prefill", &hybrid, DataPlane::Shm)
        .await
        .unwrap();
    for plane in [DataPlane::Shm, DataPlane::Grpc] {
        let err = host_client(&s.url(), "decode", &global, plane)
            .await
            .unwrap_err();
        let pdmesh_cache::client::ClientError::Rpc(status) = err else {
            panic!("{err}")
        };
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        let msg = status.message();
        for want in [hybrid.to_string(), global.to_string()] {
            assert!(msg.contains(&want), "{msg} should name {want}");
        }
        assert!(msg.contains("0-4,6-10,12-16 window 512"), "{msg}");
    }
    s.stop().await;
}

#[tokio::test]
async fn the_seeds_bug_a_bf16_index_k_worker_is_refused_by_a_mirror_sized_for_fp8_index_k() {
    use pdmesh_kv::IndexKDtype;
    let (fp8, bf16) = (dsv32(IndexKDtype::Fp8), dsv32(IndexKDtype::Bf16));
    let s = start(8, 10_000).await;
    // The first worker fixes the mirror's layout: fp8 index-K, 132 B per token per layer.
    let _fp8_worker = host_client(&s.url(), "fp8", &fp8, DataPlane::Shm)
        .await
        .unwrap();
    for plane in [DataPlane::Shm, DataPlane::Grpc] {
        let err = host_client(&s.url(), "bf16", &bf16, plane)
            .await
            .unwrap_err();
        let pdmesh_cache::client::ClientError::Rpc(status) = err else {
            panic!("{err}")
        };
        assert_eq!(status.code(), tonic::Code::FailedPrecondition);
        let m = status.message();
        for want in [
            "deepseek-v32-mla-bf16-index-k-fp8",
            "deepseek-v32-mla-bf16-index-k-bf16",
            "452 B/token/layer", // 320 latent + 132 index-K
            "576 B/token/layer", // 320 latent + 256 index-K
        ] {
            assert!(m.contains(want), "{want:?} missing from: {m}");
        }
    }
    assert_eq!(
        s.stats().await.leases,
        1,
        "the refused worker holds nothing"
    );
    s.stop().await;
}

/// A client without the mesh token, or with another, registers nothing and reads
/// nothing: every call is UNAUTHENTICATED, and the service's count of refusals grows.
#[tokio::test]
async fn a_caller_without_the_mesh_token_is_refused_everywhere_and_creates_nothing() {
    let s = start(8, 10_000).await;
    let strangers = [
        pdmesh_tls::MeshAuth::open(),
        pdmesh_tls::MeshAuth::token(pdmesh_tls::MeshToken::generate()),
    ];
    for auth in &strangers {
        let mut rpc = CacheClient::new(auth.connect(&s.url()).await.unwrap());
        let err = rpc
            .register(pb::RegisterRequest {
                worker_id: "intruder".into(),
                layout: Some(pdmesh_cache::wire::layout_to_pb(&layout())),
                data_plane: pb::DataPlane::Shm.into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err}");
        let err = rpc.stats(pb::StatsRequest {}).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err}");
        let err = rpc
            .subscribe_events(pb::SubscribeEventsRequest {})
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err}");
    }
    let st = s.stats().await;
    assert_eq!((st.layout.as_str(), st.total_pages, st.leases), ("", 0, 0));
    assert!(st.auth_refused >= 6, "{}", st.auth_refused);
    assert!(!st.insecure_plaintext);
    assert_eq!(std::fs::read_dir(s.mirror_dir()).unwrap().count(), 0);
    s.stop().await;
}

/// Over mutual TLS each call needs a certificate naming a role it is for: a gateway's
/// certificate registers nothing and opens no room, a worker's cannot register as a peer
/// cache service or read the KV events, and the refusals are counted.
#[tokio::test]
async fn over_mutual_tls_a_certificate_of_the_wrong_role_is_refused_and_creates_nothing() {
    let ca = pdmesh_tls::test_ca::Ca::new("mesh");
    let pems = tempfile::tempdir().unwrap();
    let (cert, key) = ca.leaf_with_roles(&["127.0.0.1"], &["cache"]);
    for (name, text) in [("ca.pem", &ca.pem), ("cert.pem", &cert), ("key.pem", &key)] {
        std::fs::write(pems.path().join(name), text).unwrap();
    }
    let s = start_with("127.0.0.1:0".parse().unwrap(), 8, |c| {
        c.tls = pdmesh_tls::TlsArgs {
            tls_ca: Some(pems.path().join("ca.pem")),
            tls_cert: Some(pems.path().join("cert.pem")),
            tls_key: Some(pems.path().join("key.pem")),
            ..Default::default()
        };
    })
    .await;
    let rpc = |roles: &'static [&'static str]| {
        let auth = pdmesh_tls::MeshAuth::new(Some(ca.member(&["127.0.0.1"], roles)), None, false);
        let url = s.url();
        async move { CacheClient::new(auth.connect(&url).await.unwrap()) }
    };
    let register = |plane: pb::DataPlane| pb::RegisterRequest {
        worker_id: format!("{plane:?}"),
        layout: Some(pdmesh_cache::wire::layout_to_pb(&layout())),
        data_plane: plane.into(),
        ..Default::default()
    };
    fn denied<T>(r: Result<T, tonic::Status>) {
        match r {
            Err(e) => assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}"),
            Ok(_) => panic!("admitted"),
        }
    }

    let mut gw = rpc(&["gateway"]).await;
    denied(gw.register(register(pb::DataPlane::Shm)).await);
    denied(gw.register(register(pb::DataPlane::Peer)).await);
    denied(
        gw.room_open(pb::RoomOpenRequest {
            lease: vec![1; 16],
            room: 1,
            side: pb::RoomSide::Receiver.into(),
            ..Default::default()
        })
        .await,
    );
    let stats = answer(gw.stats(pb::StatsRequest {})).await;
    assert_eq!((stats.leases, stats.total_pages), (0, 0));
    assert!(stats.auth_refused >= 3, "{}", stats.auth_refused);
    gw.subscribe_events(pb::SubscribeEventsRequest {})
        .await
        .expect("the gateway routes by the KV events");

    let mut worker = rpc(&["worker"]).await;
    let err = worker
        .register(register(pb::DataPlane::Peer))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err}");
    assert!(err.message().contains("cache"), "{err}");
    denied(worker.subscribe_events(pb::SubscribeEventsRequest {}).await);
    assert_eq!(answer(gw.stats(pb::StatsRequest {})).await.leases, 0);
    worker
        .register(register(pb::DataPlane::Grpc))
        .await
        .expect("a worker registers as one");
    rpc(&["cache"])
        .await
        .register(register(pb::DataPlane::Peer))
        .await
        .expect("a cache service registers as a peer");
    assert_eq!(answer(gw.stats(pb::StatsRequest {})).await.leases, 2);
    s.stop().await;
}

#[tokio::test]
async fn malformed_registrations_are_refused_and_create_nothing() {
    let s = start(8, 10_000).await;
    let mut rpc = s.rpc().await;
    let good = pdmesh_cache::wire::layout_to_pb(&layout());
    let mut huge = good.clone();
    huge.layers = u32::MAX; // a page far beyond any size the mirror could hold
    let mut forged = good.clone();
    forged.fingerprint = "0123456789abcdef".into();
    let mut no_components = good.clone();
    no_components.components.clear();
    for (worker, l, what) in [
        ("w", Some(huge), "exceed"),
        ("w", Some(forged), "fingerprint"),
        ("w", Some(no_components), "at least one"),
        ("w", None, "layout is required"),
        ("", Some(good.clone()), "worker_id"),
    ] {
        let err = rpc
            .register(pb::RegisterRequest {
                worker_id: worker.into(),
                layout: l,
                data_plane: pb::DataPlane::Shm.into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{what}: {err}");
        assert!(err.message().contains(what), "{what}: {}", err.message());
    }
    // Nothing was created: no layout fixed, no mirror file, no lease.
    let st = s.stats().await;
    assert_eq!((st.layout.as_str(), st.total_pages, st.leases), ("", 0, 0));
    assert_eq!(std::fs::read_dir(s.mirror_dir()).unwrap().count(), 0);
    // A lease that does not exist is NOT_FOUND, and the answer does not echo it.
    let unknown = pdmesh_cache_client::Lease::random();
    let err = rpc
        .r#match(pb::MatchRequest {
            lease: unknown.to_wire(),
            hashes: vec![1],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    let hex: String = unknown
        .to_wire()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert!(!err.message().contains(&hex[..8]), "{}", err.message());
    // A lease is 16 bytes: the old 8-byte numbers (or none) are malformed, not unknown.
    for bad in [vec![], 4242u64.to_le_bytes().to_vec(), vec![7; 17]] {
        let n = bad.len();
        let err = rpc
            .heartbeat(pb::HeartbeatRequest { lease: bad })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{n} bytes: {err}");
        assert!(err.message().contains("16 bytes"), "{}", err.message());
    }
    s.stop().await;
}

#[tokio::test]
async fn a_silent_workers_lease_expires_and_its_pinned_pages_become_evictable() {
    let s = start(4, 300).await;
    let mut w = client(&s, "writer", DataPlane::Shm).await;
    let c = chain(1, 4);
    store(&mut w, &c).await;
    let hashes: Vec<u64> = c.iter().map(|p| p.0).collect();
    let mut doomed = client(&s, "doomed", DataPlane::Shm).await;
    assert_eq!(doomed.match_pages(&hashes).await.unwrap().len(), 4);
    // The mirror is full and every page is pinned: nothing can be stored.
    assert_eq!(store(&mut w, &chain(50, 1)).await.skipped, 1);
    drop(doomed); // stops heartbeating, as a killed worker would
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let st = s.stats().await;
        if st.expired_leases == 1 {
            assert_eq!(st.pinned_pages, 0);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "lease never expired: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(w.is_alive(), "a heartbeating worker keeps its lease");
    assert_eq!(store(&mut w, &chain(50, 1)).await.written, 1);
    assert_eq!(s.stats().await.evicted_pages, 1);
    s.stop().await;
}

#[tokio::test]
async fn a_room_opened_on_a_lease_the_service_forgot_makes_the_client_register_again() {
    // A long lease: no heartbeat comes between the restart and the room call.
    let s = start(16, 60_000).await;
    let addr = s.svc.addr;
    let w = client(&s, "w", DataPlane::Grpc).await;
    w.room_open(1, pb::RoomSide::Sender, "r1", "")
        .await
        .unwrap();
    assert!(w.is_alive());
    s.stop().await;
    // The service restarted (as one paused past the lease comes back): it knows no lease.
    let s = start_at(addr, 16, 60_000).await;
    assert!(w.is_alive(), "no heartbeat has told the client yet");
    let err = past_reconnect(async || w.room_open(2, pb::RoomSide::Sender, "r2", "").await)
        .await
        .expect_err("a room opened on a lease the service never gave");
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
    assert!(err.to_string().contains("register again"), "{err}");
    assert!(
        !w.is_alive(),
        "the refused open tells the client to register again"
    );
    let again = client(&s, "w", DataPlane::Grpc).await;
    again
        .room_open(2, pb::RoomSide::Sender, "r2", "")
        .await
        .unwrap();
    s.stop().await;
}

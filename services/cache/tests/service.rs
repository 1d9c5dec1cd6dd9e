//! The cache service over real gRPC on loopback, with workers on both data planes: pages
//! stored by one worker load bit for bit in another, a byte flipped in the mirror is
//! caught on load, a different KV layout is refused naming both, a silent worker's lease
//! expires and frees what it pinned, and a full mirror evicts least recently used pages.

use std::net::SocketAddr;
use std::time::Duration;

use futures::StreamExt;
use pb::cache_client::CacheClient;
use pdmesh_cache::client::{Corrupt, DataPlane, HostClient, Loaded};
use pdmesh_cache::{Config, MirrorSize};
use pdmesh_kv::{DType, KvLayout, page_hashes};
use pdmesh_proto::cache::v1 as pb;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

struct Server {
    addr: SocketAddr,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), pdmesh_cache::Error>>,
    _dir: tempfile::TempDir,
}

impl Server {
    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn stats(&self) -> pb::StatsResponse {
        let mut c = pdmesh_tls::test_ca::client(self.url(), CacheClient::new)
            .await
            .unwrap();
        c.stats(pb::StatsRequest {}).await.unwrap().into_inner()
    }

    async fn events(&self) -> tonic::Streaming<pb::KvEvent> {
        let mut c = pdmesh_tls::test_ca::client(self.url(), CacheClient::new)
            .await
            .unwrap();
        c.subscribe_events(pb::SubscribeEventsRequest {})
            .await
            .unwrap()
            .into_inner()
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.unwrap().unwrap();
    }

    /// The service user's private directory under --shm-dir, where the mirror goes.
    fn mirror_dir(&self) -> std::path::PathBuf {
        pdmesh_cache::mirror::dirs(Some(self._dir.path())).remove(0)
    }
}

async fn start(pages: u64, lease_ttl_ms: u64) -> Server {
    start_at("127.0.0.1:0".parse().unwrap(), pages, lease_ttl_ms).await
}

async fn start_at(addr: SocketAddr, pages: u64, lease_ttl_ms: u64) -> Server {
    start_with(addr, pages, |c| {
        c.lease_ttl_ms = lease_ttl_ms;
        // Tests that stop the service with a room open do not wait for it long.
        c.drain_timeout_ms = 300;
    })
    .await
}

async fn start_with(addr: SocketAddr, pages: u64, f: impl FnOnce(&mut Config)) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config::new(MirrorSize::Bytes(pages * layout().bytes_per_page() as u64));
    cfg.tls = pdmesh_tls::test_ca::args();
    cfg.shm_dir = Some(dir.path().to_owned());
    f(&mut cfg);
    let listener = TcpListener::bind(addr).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(pdmesh_cache::run(cfg, listener, shutdown.clone()));
    Server {
        addr,
        shutdown,
        task,
        _dir: dir,
    }
}

/// SmolLM2's KV layout with 4-token pages: 30 layers × (K + V) × 192 f16 × 4 tokens.
fn layout() -> KvLayout {
    KvLayout::llama(30, 3, 64, DType::F16, 4)
}

async fn client(s: &Server, name: &str, plane: DataPlane) -> HostClient {
    HostClient::connect(
        &s.url(),
        name,
        &layout(),
        plane,
        &pdmesh_tls::test_ca::auth(),
    )
    .await
    .unwrap()
}

/// Distinct page contents per hash.
fn page_for(hash: u64) -> Vec<u8> {
    let mut x = hash | 1;
    (0..layout().bytes_per_page())
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A prompt's page hashes and their parents.
fn chain(first_token: u32, pages: usize) -> Vec<(u64, u64)> {
    let tokens: Vec<u32> = (first_token..first_token + 4 * pages as u32).collect();
    let h = page_hashes(layout().fingerprint(), &tokens, 4);
    h.iter()
        .enumerate()
        .map(|(i, &x)| (x, if i == 0 { 0 } else { h[i - 1] }))
        .collect()
}

async fn store(c: &mut HostClient, chain: &[(u64, u64)]) -> pdmesh_cache::client::Stored {
    let pages: Vec<Vec<u8>> = chain.iter().map(|&(h, _)| page_for(h)).collect();
    let refs: Vec<(u64, u64, &[u8])> = chain
        .iter()
        .zip(&pages)
        .map(|(&(h, p), d)| (h, p, &d[..]))
        .collect();
    c.store(&refs).await.unwrap()
}

async fn load(c: &mut HostClient, hashes: &[u64]) -> (Loaded, Vec<Vec<u8>>) {
    let refs = c.match_pages(hashes).await.unwrap();
    let mut bufs = vec![vec![0u8; c.page_bytes()]; refs.len()];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let loaded = c.load_into(&refs, &mut dsts).await.unwrap();
    (loaded, bufs)
}

#[tokio::test]
async fn pages_stored_on_one_plane_load_bit_for_bit_on_both_and_are_announced() {
    let s = start(64, 10_000).await;
    let mut events = s.events().await;
    for (writer_plane, tag) in [(DataPlane::Shm, 100), (DataPlane::Grpc, 200)] {
        let mut w = client(&s, "writer", writer_plane).await;
        let c = chain(tag, 5);
        let st = store(&mut w, &c).await;
        assert_eq!((st.written, st.skipped, st.rejected), (5, 0, 0));
        assert_eq!(
            store(&mut w, &c).await.skipped,
            5,
            "held pages are not stored twice"
        );
        let hashes: Vec<u64> = c.iter().map(|p| p.0).collect();
        for reader_plane in [DataPlane::Shm, DataPlane::Grpc] {
            let mut r = client(&s, "reader", reader_plane).await;
            // A prompt that shares the first three pages, then differs.
            let mut asked = hashes[..3].to_vec();
            asked.push(0xdead);
            let (loaded, bufs) = load(&mut r, &asked).await;
            assert_eq!(
                loaded,
                Loaded {
                    pages: 3,
                    corrupt: None
                }
            );
            for (i, b) in bufs.iter().enumerate() {
                assert!(
                    *b == page_for(hashes[i]),
                    "{writer_plane:?} → {reader_plane:?} page {i}"
                );
            }
        }
        let ev = events.next().await.unwrap().unwrap();
        let Some(pb::kv_event::Kind::Stored(st)) = ev.kind else {
            panic!("{ev:?}")
        };
        assert_eq!((st.parent_hash, st.hashes), (0, hashes));
    }
    let st = s.stats().await;
    assert_eq!(
        (st.used_pages, st.pinned_pages),
        (10, 0),
        "loads release their pins"
    );
    assert!(st.layout.contains("page 4 tokens"), "{}", st.layout);
    s.stop().await;
}

#[tokio::test]
async fn a_byte_flipped_in_the_mirror_is_caught_on_load_on_both_planes_and_discarded() {
    let s = start(16, 10_000).await;
    let mut w = client(&s, "writer", DataPlane::Shm).await;
    let path = {
        let mut rpc = pdmesh_tls::test_ca::client(s.url(), CacheClient::new)
            .await
            .unwrap();
        rpc.register(pb::RegisterRequest {
            worker_id: "inspector".into(),
            layout: Some(pdmesh_cache::wire::layout_to_pb(&layout())),
            data_plane: pb::DataPlane::Shm.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .shm_path
    };
    // Nine pages: a load copies them on several threads; the corrupt one is in the second
    // half.
    let c = chain(7, 9);
    let hashes: Vec<u64> = c.iter().map(|p| p.0).collect();
    for plane in [DataPlane::Shm, DataPlane::Grpc] {
        // (Re)store the chain: a discarded page is written afresh.
        store(&mut w, &c).await;
        let refs = w.match_pages(&hashes).await.unwrap();
        assert_eq!(refs.len(), 9);
        w.release(&refs.iter().map(|r| r.slot).collect::<Vec<_>>())
            .await
            .unwrap();
        // Corrupt the seventh page behind the service's back.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[layout().page_offset(refs[6].slot as usize) + 1234] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();

        let mut r = client(&s, "reader", plane).await;
        let (loaded, bufs) = load(&mut r, &hashes).await;
        let found = {
            let mut page = page_for(hashes[6]);
            page[1234] ^= 0x10;
            pdmesh_kv::page_checksum(&page)
        };
        assert_eq!(
            loaded,
            Loaded {
                pages: 6,
                // Which page, the checksum it was stored with, and the one of what is there.
                corrupt: Some(Corrupt {
                    hash: hashes[6],
                    slot: refs[6].slot,
                    expected: refs[6].checksum,
                    found,
                })
            },
            "{plane:?}"
        );
        for (i, b) in bufs.iter().take(6).enumerate() {
            assert!(*b == page_for(hashes[i]), "{plane:?} page {i}");
        }
        // The corrupt page is gone: nobody is served it again.
        let again = r.match_pages(&hashes).await.unwrap();
        assert_eq!(again.len(), 6, "{plane:?}");
        r.release(&again.iter().map(|p| p.slot).collect::<Vec<_>>())
            .await
            .unwrap();
    }
    assert_eq!(s.stats().await.pinned_pages, 0);
    s.stop().await;
}

#[tokio::test]
async fn a_worker_with_another_layout_is_refused_and_the_message_names_both() {
    let s = start(8, 10_000).await;
    let _first = client(&s, "fp16", DataPlane::Shm).await;
    let other = KvLayout::llama(30, 3, 64, DType::Bf16, 4);
    let err = HostClient::connect(
        &s.url(),
        "bf16",
        &other,
        DataPlane::Grpc,
        &pdmesh_tls::test_ca::auth(),
    )
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

#[tokio::test]
async fn the_seeds_bug_a_bf16_index_k_worker_is_refused_by_a_mirror_sized_for_fp8_index_k() {
    use pdmesh_kv::{IndexKDtype, MlaCacheDtype, MlaDims};
    let dims = MlaDims {
        kv_lora_rank: 128,
        rope_dim: 32,
        index_head_dim: 128,
    };
    let form = |ik| KvLayout::deepseek_v32(4, dims, MlaCacheDtype::Bf16, ik, 16).unwrap();
    let (fp8, bf16) = (form(IndexKDtype::Fp8), form(IndexKDtype::Bf16));
    let s = start(8, 10_000).await;
    // The first worker fixes the mirror's layout: fp8 index-K, 132 B per token per layer.
    let _fp8_worker = HostClient::connect(
        &s.url(),
        "fp8",
        &fp8,
        DataPlane::Shm,
        &pdmesh_tls::test_ca::auth(),
    )
    .await
    .unwrap();
    for plane in [DataPlane::Shm, DataPlane::Grpc] {
        let err = HostClient::connect(&s.url(), "bf16", &bf16, plane, &pdmesh_tls::test_ca::auth())
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
    let stats = gw.stats(pb::StatsRequest {}).await.unwrap().into_inner();
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
    assert_eq!(
        gw.stats(pb::StatsRequest {})
            .await
            .unwrap()
            .into_inner()
            .leases,
        0
    );
    worker
        .register(register(pb::DataPlane::Grpc))
        .await
        .expect("a worker registers as one");
    rpc(&["cache"])
        .await
        .register(register(pb::DataPlane::Peer))
        .await
        .expect("a cache service registers as a peer");
    assert_eq!(
        gw.stats(pb::StatsRequest {})
            .await
            .unwrap()
            .into_inner()
            .leases,
        2
    );
    s.stop().await;
}

#[tokio::test]
async fn malformed_registrations_are_refused_and_create_nothing() {
    let s = start(8, 10_000).await;
    let mut rpc = pdmesh_tls::test_ca::client(s.url(), CacheClient::new)
        .await
        .unwrap();
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
    let addr = s.addr;
    let w = client(&s, "w", DataPlane::Grpc).await;
    w.room_open(1, pb::RoomSide::Sender, "r1", "")
        .await
        .unwrap();
    assert!(w.is_alive());
    s.stop().await;
    // The service restarted (as one paused past the lease comes back): it knows no lease.
    let s = start_at(addr, 16, 60_000).await;
    assert!(w.is_alive(), "no heartbeat has told the client yet");
    let mut err = None;
    // The channel's first call after the old connection closed may find it closing.
    for _ in 0..3 {
        match w.room_open(2, pb::RoomSide::Sender, "r2", "").await {
            Err(e) if e.code() == tonic::Code::Unavailable => continue,
            r => {
                err = Some(r.expect_err("a room opened on a lease the service never gave"));
                break;
            }
        }
    }
    let err = err.expect("the restarted service answered");
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
    assert!(err.message().contains("register again"), "{err}");
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

#[tokio::test]
async fn a_full_mirror_evicts_the_least_recently_used_pages_and_says_so() {
    let s = start(4, 10_000).await;
    let mut events = s.events().await;
    let mut w = client(&s, "w", DataPlane::Grpc).await;
    let (a, b) = (chain(1000, 2), chain(2000, 2));
    store(&mut w, &a).await;
    store(&mut w, &b).await;
    // Touch a: b is least recently used.
    let (l, _) = load(&mut w, &[a[0].0, a[1].0]).await;
    assert_eq!(l.pages, 2);
    let c = chain(3000, 2);
    assert_eq!(store(&mut w, &c).await.written, 2);
    let mut removed = Vec::new();
    while removed.len() < 2 {
        if let Some(pb::kv_event::Kind::Removed(r)) = events.next().await.unwrap().unwrap().kind {
            removed.extend(r.hashes);
        }
    }
    removed.sort();
    let mut want = vec![b[0].0, b[1].0];
    want.sort();
    assert_eq!(removed, want);
    let (l, _) = load(&mut w, &[a[0].0]).await;
    assert_eq!(l.pages, 1, "the recently used prefix survived");
    s.stop().await;
}

/// At shutdown (SIGTERM) the service drains: a new room is refused as UNAVAILABLE (the
/// gateway then tries another host), while a room already open still gets its other side
/// and the service keeps answering; it stops once that room has ended.
#[tokio::test]
async fn at_shutdown_no_new_room_opens_and_the_service_stops_once_the_rooms_under_way_end() {
    let s = start_with("127.0.0.1:0".parse().unwrap(), 16, |c| {
        c.drain_timeout_ms = 60_000;
    })
    .await;
    let receiver = client(&s, "decode", DataPlane::Grpc).await;
    let sender = client(&s, "prefill", DataPlane::Grpc).await;
    receiver
        .room_open(1, pb::RoomSide::Receiver, "r1", "")
        .await
        .unwrap();
    s.shutdown.cancel();
    let mut refused = None;
    for _ in 0..200 {
        match sender.room_open(2, pb::RoomSide::Sender, "r2", "").await {
            Err(e) if e.code() == tonic::Code::Unavailable && e.message().contains("draining") => {
                refused = Some(e);
                break;
            }
            Err(e) => panic!("{e}"),
            // Not draining yet: this room is under way too; end it.
            Ok(_) => sender.room_abort(2, "not yet draining").await.unwrap(),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let refused = refused.expect("a new room is refused while draining");
    assert!(refused.message().contains("try another host"), "{refused}");
    // The room under way still takes its sender, and the service still answers.
    sender
        .room_open(1, pb::RoomSide::Sender, "r1", "")
        .await
        .unwrap();
    let census: u32 = s.stats().await.rooms.values().sum();
    assert!(census >= 1, "the open room is counted");
    assert!(!s.task.is_finished(), "the drain waits for the room");
    sender.room_abort(1, "done").await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), s.task)
        .await
        .expect("the service stops once no room is under way")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn a_room_that_never_ends_holds_the_drain_only_to_its_bound() {
    let s = start_with("127.0.0.1:0".parse().unwrap(), 16, |c| {
        c.drain_timeout_ms = 300;
    })
    .await;
    let receiver = client(&s, "decode", DataPlane::Grpc).await;
    receiver
        .room_open(1, pb::RoomSide::Receiver, "r1", "")
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    s.shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), s.task)
        .await
        .expect("the drain ends at its bound")
        .unwrap()
        .unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t0.elapsed()
    );
}

/// The mirror's directory and file are the service user's alone: the directory is made
/// 0700 as the service starts, the file 0600, and another local user (nobody, by a child
/// that drops root before trying) can open neither, though the --shm-dir above is open to
/// all (as /dev/shm is).
#[tokio::test]
async fn the_mirror_is_private_to_the_service_user_and_another_user_cannot_open_it() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let s = start(4, 10_000).await;
    std::fs::set_permissions(s._dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    // Serving (a Stats answer) means the start-up checks are behind it.
    s.stats().await;
    let dir = s.mirror_dir();
    let meta = std::fs::symlink_metadata(&dir).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.mode() & 0o7777, 0o700, "{}", dir.display());
    let _w = client(&s, "writer", DataPlane::Shm).await;
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let file = &files[0];
    let meta = std::fs::symlink_metadata(file).unwrap();
    assert!(meta.is_file());
    assert_eq!(meta.mode() & 0o7777, 0o600, "{}", file.display());
    assert_eq!(meta.uid(), effective_uid());

    if effective_uid() == 0 {
        // A control: a file others may read, beside the private directory, is read by
        // nobody; the mirror and its directory are not.
        let open_to_all = s._dir.path().join("open-to-all");
        std::fs::write(&open_to_all, b"x").unwrap();
        std::fs::set_permissions(&open_to_all, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(open_as_nobody(&open_to_all).map_err(|e| e.kind()), Ok(()));
        for path in [file, &dir] {
            let e = open_as_nobody(path).unwrap_err();
            assert_eq!(
                e.raw_os_error(),
                Some(libc::EACCES),
                "{}: {e}",
                path.display()
            );
        }
    } else {
        // Not root, so no other user to become: the mode bits (no group or other bit on
        // the directory or the file) are what keeps other users out.
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o077, 0);
        assert_eq!(std::fs::metadata(file).unwrap().mode() & 0o077, 0);
    }
    s.stop().await;
}

/// A stopped service leaves nothing in the shared-memory directory: its mirror file goes,
/// and so does this user's directory for mirrors once it is empty. A file another cache
/// service keeps there keeps the directory.
#[tokio::test]
async fn a_stopped_service_leaves_no_mirror_file_or_empty_directory_behind() {
    for other in [false, true] {
        let s = start(4, 10_000).await;
        let w = client(&s, "writer", DataPlane::Shm).await;
        let dir = s.mirror_dir();
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "the mirror file"
        );
        if other {
            std::fs::write(dir.join("pdmesh-mirror-of-another-service"), b"x").unwrap();
        }
        drop(w);
        // Stopped by hand: `Server::stop` would remove the --shm-dir with it.
        let Server {
            shutdown,
            task,
            _dir: base,
            ..
        } = s;
        shutdown.cancel();
        task.await.unwrap().unwrap();
        if other {
            let left: Vec<_> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert_eq!(
                left,
                ["pdmesh-mirror-of-another-service"],
                "only the other file"
            );
        } else {
            assert!(!dir.exists(), "{} is left behind", dir.display());
            assert!(base.path().is_dir(), "the --shm-dir itself stays");
        }
    }
}

/// Opens `path` read-only in a child that first becomes nobody (uid and gid 65534, no
/// supplementary groups): `Ok` if it could, else the error it got. The open runs between
/// fork and exec, so its error comes back as the spawn's.
fn open_as_nobody(path: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::process::CommandExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut cmd = std::process::Command::new("/bin/true");
    // SAFETY: the closure only makes async-signal-safe calls (setgroups, setgid, setuid,
    // open, close) on memory allocated before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(65534) != 0
                || libc::setuid(65534) != 0
            {
                return Err(std::io::Error::other("could not become nobody"));
            }
            let fd = libc::open(c_path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::close(fd);
            Ok(())
        });
    }
    let status = cmd.status()?;
    assert!(status.success());
    Ok(())
}

fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// A private directory someone made loose (0777), or one owned by another user, stops
/// the service at start with an error naming the directory and why.
#[tokio::test]
async fn a_loose_or_foreign_mirror_directory_makes_the_service_refuse_to_start() {
    use std::os::unix::fs::PermissionsExt;
    let base = tempfile::tempdir().unwrap();
    let dir = pdmesh_cache::mirror::dirs(Some(base.path())).remove(0);
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let refused = |base: &std::path::Path| {
        let mut cfg = Config::new(MirrorSize::Bytes(4 * layout().bytes_per_page() as u64));
        cfg.tls = pdmesh_tls::test_ca::args();
        cfg.shm_dir = Some(base.to_owned());
        async move {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            // Refused before serving: it returns without being shut down.
            tokio::time::timeout(
                Duration::from_secs(30),
                pdmesh_cache::run(cfg, listener, CancellationToken::new()),
            )
            .await
            .expect("the service started instead of refusing")
            .unwrap_err()
            .to_string()
        }
    };
    let e = refused(base.path()).await;
    assert!(
        e.contains(&dir.display().to_string()) && e.contains("mode is 0777"),
        "{e}"
    );
    if effective_uid() == 0 {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
        let e = refused(base.path()).await;
        assert!(e.contains("owned by uid 65534"), "{e}");
    }
    // Not root, no directory of another user can be made here: the owner check is then
    // covered by pdmesh-cache-client's mirror tests, which check against another uid.
}

/// Registers `name` on the grpc data plane through a raw client; returns its lease.
async fn register_grpc(rpc: &mut CacheClient<pdmesh_tls::AuthChannel>, name: &str) -> Vec<u8> {
    rpc.register(pb::RegisterRequest {
        worker_id: name.into(),
        layout: Some(pdmesh_cache::wire::layout_to_pb(&layout())),
        data_plane: pb::DataPlane::Grpc.into(),
    })
    .await
    .unwrap()
    .into_inner()
    .lease
}

/// The host-tier poisoning attack: a popular prefix's page hashes are public (token ids
/// and a layout fingerprint), so a member of the mesh reserves them and commits bytes of
/// its choosing with a valid checksum. Resident pages are never granted again, a commit
/// lands only in a slot its own lease reserved for that very hash, and a guessed lease is
/// unknown: the victim's pages load bit for bit as it stored them.
#[tokio::test]
async fn a_forged_commit_for_a_popular_prefix_is_refused_and_the_victims_pages_are_unchanged() {
    let s = start(64, 10_000).await;
    let mut victim = client(&s, "victim", DataPlane::Grpc).await;
    let popular = chain(500, 3);
    let hashes: Vec<u64> = popular.iter().map(|p| p.0).collect();
    assert_eq!(store(&mut victim, &popular).await.written, 3);

    // The attacker holds the mesh token and registers as a worker of the same layout.
    let mut rpc = pdmesh_tls::test_ca::client(s.url(), CacheClient::new)
        .await
        .unwrap();
    let lease = register_grpc(&mut rpc, "attacker").await;
    let forged = vec![0x5au8; layout().bytes_per_page()];
    let commit = |lease: Vec<u8>, hash: u64, slot: u32| pb::CommitRequest {
        lease,
        pages: vec![pb::CommitPage {
            hash,
            slot,
            checksum: pdmesh_kv::page_checksum(&forged),
            data: forged.clone(),
            parent_hash: 0,
        }],
    };
    // 1. The resident pages are not granted to anyone again.
    let grants = rpc
        .reserve(pb::ReserveRequest {
            lease: lease.clone(),
            hashes: hashes.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .grants;
    assert!(
        grants.is_empty(),
        "resident pages granted again: {grants:?}"
    );
    // 2. A slot reserved for another hash takes no commit of the popular one.
    let other = rpc
        .reserve(pb::ReserveRequest {
            lease: lease.clone(),
            hashes: vec![0xa77ac4],
        })
        .await
        .unwrap()
        .into_inner()
        .grants[0]
        .slot;
    let err = rpc
        .commit(commit(lease.clone(), hashes[0], other))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    // 3. A reservation of the victim's (a page it is writing) takes no commit of another
    // lease, even for the hash it was reserved for.
    let mut writer = pdmesh_tls::test_ca::client(s.url(), CacheClient::new)
        .await
        .unwrap();
    let writer_lease = register_grpc(&mut writer, "victim-writer").await;
    let (next, parent) = chain(500, 4)[3];
    let slot = writer
        .reserve(pb::ReserveRequest {
            lease: writer_lease.clone(),
            hashes: vec![next],
        })
        .await
        .unwrap()
        .into_inner()
        .grants[0]
        .slot;
    let err = rpc
        .commit(commit(lease.clone(), next, slot))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    // 4. A guessed lease is unknown.
    let guessed = pdmesh_cache::Lease::random().to_wire();
    let err = rpc.commit(commit(guessed, next, slot)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");

    // The victim finishes its own page, and every page loads as the victim wrote it.
    let data = page_for(next);
    let done = writer
        .commit(pb::CommitRequest {
            lease: writer_lease,
            pages: vec![pb::CommitPage {
                hash: next,
                slot,
                checksum: pdmesh_kv::page_checksum(&data),
                data,
                parent_hash: parent,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(done.rejected_slots.is_empty());
    let all: Vec<u64> = chain(500, 4).iter().map(|p| p.0).collect();
    let (loaded, bufs) = load(&mut victim, &all).await;
    assert_eq!(
        loaded,
        Loaded {
            pages: 4,
            corrupt: None
        }
    );
    for (i, b) in bufs.iter().enumerate() {
        assert!(*b == page_for(all[i]), "page {i} is not the victim's");
    }
    s.stop().await;
}

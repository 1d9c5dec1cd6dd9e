//! Tests of the links to rooms' homes, against real cache services on loopback.

use pdmesh_cache_client::client::{DataPlane, HostClient};
use pdmesh_kv::DType;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::*;

/// A cache service of `layout`'s pages at `addr` (port 0: any) with leases of
/// `ttl_ms`, with a worker registered (which fixes its layout); it stops, at once, when
/// `stop` is cancelled.
async fn home(
    addr: SocketAddr,
    layout: &KvLayout,
    ttl_ms: u64,
    dir: &std::path::Path,
    stop: CancellationToken,
) -> (
    String,
    HostClient,
    tokio::task::JoinHandle<Result<(), crate::Error>>,
) {
    let mut cfg = crate::Config::new(crate::MirrorSize::Bytes(
        (8 * layout.bytes_per_page()) as u64,
    ));
    cfg.tls = pdmesh_tls::test_ca::args();
    cfg.shm_dir = Some(dir.to_owned());
    cfg.lease_ttl_ms = ttl_ms;
    cfg.drain_timeout_ms = 0;
    let listener = TcpListener::bind(addr).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let served = tokio::spawn(crate::run(cfg, listener, stop));
    let worker = HostClient::connect(
        &url,
        ("w", ""),
        layout,
        DataPlane::Shm,
        &pdmesh_tls::test_ca::auth(),
    )
    .await
    .unwrap();
    (url, worker, served)
}

#[tokio::test]
async fn a_link_whose_heartbeats_stop_landing_for_a_lease_is_given_up_for_a_new_one() {
    let layout = Arc::new(KvLayout::llama(2, 1, 8, DType::F16, 16));
    let dir = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let any = "127.0.0.1:0".parse().unwrap();
    let (url, worker, served) = home(any, &layout, 300, dir.path(), stop.clone()).await;
    let opts = TcpOptions {
        io_timeout: Duration::from_secs(1),
        ..TcpOptions::default()
    };
    let peers = Peers::new(
        "here".into(),
        opts,
        pdmesh_tls::test_ca::auth(),
        std::slice::from_ref(&url),
    )
    .unwrap();
    let link = peers.link(&url, &layout).await.unwrap();
    assert!(Arc::ptr_eq(
        &link,
        &peers.link(&url, &layout).await.unwrap()
    ));
    // The home goes away: no heartbeat lands, and none says the lease is unknown.
    drop(worker);
    stop.cancel();
    served.await.unwrap().unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while link.alive.load(Ordering::Relaxed) {
        assert!(Instant::now() < until, "the link still counts on its lease");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Back on the same address: the next room links again rather than name the lease
    // the home let go.
    let stop = CancellationToken::new();
    let addr = url.trim_start_matches("http://").parse().unwrap();
    let (_, worker, served) = home(addr, &layout, 300, dir.path(), stop.clone()).await;
    let again = peers.link(&url, &layout).await.unwrap();
    assert!(!Arc::ptr_eq(&link, &again), "a new link");
    assert!(again.alive.load(Ordering::Relaxed));
    drop((link, again, worker));
    stop.cancel();
    served.await.unwrap().unwrap();
}

#[tokio::test]
async fn homes_that_cannot_be_reached_are_forgotten() {
    let layout = Arc::new(KvLayout::llama(2, 1, 8, DType::F16, 16));
    // Ports that refuse every connection.
    let closed: Vec<_> = (0..5).map(|_| pdmesh_testkit::Refusing::new()).collect();
    let urls: Vec<String> = closed.iter().map(|c| c.url()).collect();
    let peers = Peers::new(
        "here".into(),
        TcpOptions::default(),
        pdmesh_tls::test_ca::auth(),
        &urls,
    )
    .unwrap();
    for url in &urls {
        let Err(err) = peers.link(url, &layout).await else {
            panic!("linked to a closed port")
        };
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    }
    assert_eq!(peers.len(), 0, "no failed home is kept");
}

#[tokio::test]
async fn a_home_that_never_answers_does_not_hold_up_links_to_other_homes() {
    let layout = Arc::new(KvLayout::llama(2, 1, 8, DType::F16, 16));
    // A live home: a cache service with a worker of this layout.
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = crate::Config::new(crate::MirrorSize::Bytes(
        (8 * layout.bytes_per_page()) as u64,
    ));
    cfg.tls = pdmesh_tls::test_ca::args();
    cfg.shm_dir = Some(dir.path().to_owned());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let live = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    let served = tokio::spawn(crate::run(cfg, listener, stop.clone()));
    let _worker = HostClient::connect(
        &live,
        ("w", ""),
        &layout,
        DataPlane::Shm,
        &pdmesh_tls::test_ca::auth(),
    )
    .await
    .unwrap();
    // A home that accepts connections and then says nothing.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gone = format!("http://{}", silent.local_addr().unwrap());

    let opts = TcpOptions {
        io_timeout: Duration::from_secs(30),
        ..TcpOptions::default()
    };
    let peers = Arc::new(
        Peers::new(
            "here".into(),
            opts,
            pdmesh_tls::test_ca::auth(),
            &[live.clone(), gone.clone()],
        )
        .unwrap(),
    );
    let stuck = {
        let (peers, layout, gone) = (peers.clone(), layout.clone(), gone.clone());
        tokio::spawn(async move { peers.link(&gone, &layout).await.map(|_| ()) })
    };
    // Once the silent home has the connection, that link is mid-connect.
    let (_held, _) = silent.accept().await.unwrap();
    let link = peers.link(&live, &layout).await.unwrap();
    assert_eq!(link.url, live);
    assert!(
        !stuck.is_finished(),
        "the silent home's link is still connecting"
    );
    assert!(peers.existing(&live).await.is_some());
    stuck.abort();
    drop(link);
    stop.cancel();
    served.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_room_home_the_mesh_does_not_know_is_refused_before_anything_is_dialled() {
    let layout = Arc::new(KvLayout::llama(2, 1, 8, DType::F16, 16));
    // A listener that would see any connection made to it.
    let stranger = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", stranger.local_addr().unwrap());
    let token = pdmesh_tls::test_ca::auth();
    let listed = Peers::new(
        "here".into(),
        TcpOptions::default(),
        token.clone(),
        &[
            "http://10.0.0.9:7100".to_owned(),
            "HTTP://Cache-B:7100/".to_owned(),
        ],
    )
    .unwrap();
    let unlisted = Peers::new("here".into(), TcpOptions::default(), token.clone(), &[]).unwrap();
    for (peers, says) in [(&listed, "--peer list"), (&unlisted, "names none")] {
        let Err(err) = peers.link(&url, &layout).await else {
            panic!("linked to a home off the list")
        };
        assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err}");
        assert!(err.to_string().contains(says), "{err}");
        assert_eq!(peers.len(), 0);
    }
    // Listed homes match by host and port, whatever the case or path.
    assert!(listed.admits("http://cache-b:7100").is_ok());
    assert!(listed.admits("http://10.0.0.9:7100/x").is_ok());
    assert!(listed.admits("http://10.0.0.9:7101").is_err());
    // With mutual TLS and no list, the home's certificate decides (at the page
    // transport, which checks it names the cache role).
    let ca = pdmesh_tls::test_ca::Ca::new("mesh");
    let tls = pdmesh_tls::MeshAuth::new(Some(ca.member(&["here"], &["cache"])), None, false);
    let by_cert = Peers::new("here".into(), TcpOptions::default(), tls, &[]).unwrap();
    assert!(by_cert.admits(&url).is_ok());
    // Nothing reached the stranger.
    let accepted = tokio::time::timeout(Duration::ZERO, stranger.accept()).await;
    assert!(accepted.is_err(), "a refused home was dialled");
    // A --peer that is not a URL stops the service at start.
    let bad = Peers::new(
        "here".into(),
        TcpOptions::default(),
        token,
        &["cache-b".into()],
    );
    assert!(matches!(bad, Err(crate::Error::Config(m)) if m.contains("--peer")));
}

//! Helpers shared by the cache service's integration tests: start the real service on
//! loopback, connect workers, and make pages and prompts' hash chains.

#![allow(dead_code)]

use std::net::SocketAddr;

use pb::cache_client::CacheClient;
use pdmesh_cache::client::{DataPlane, HostClient, Loaded};
use pdmesh_cache::{Config, MirrorSize};
use pdmesh_kv::{DType, KvLayout, page_hashes};
use pdmesh_proto::cache::v1 as pb;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub struct Server {
    pub addr: SocketAddr,
    pub shutdown: CancellationToken,
    pub task: tokio::task::JoinHandle<Result<(), pdmesh_cache::Error>>,
    pub _dir: tempfile::TempDir,
}

impl Server {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn stats(&self) -> pb::StatsResponse {
        let mut c = pdmesh_tls::test_ca::client(self.url(), CacheClient::new)
            .await
            .unwrap();
        c.stats(pb::StatsRequest {}).await.unwrap().into_inner()
    }

    pub async fn events(&self) -> tonic::Streaming<pb::KvEvent> {
        let mut c = pdmesh_tls::test_ca::client(self.url(), CacheClient::new)
            .await
            .unwrap();
        c.subscribe_events(pb::SubscribeEventsRequest {})
            .await
            .unwrap()
            .into_inner()
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.unwrap().unwrap();
    }

    /// The service user's private directory under --shm-dir, where the mirror goes.
    pub fn mirror_dir(&self) -> std::path::PathBuf {
        pdmesh_cache::mirror::dirs(Some(self._dir.path())).remove(0)
    }
}

pub async fn start(pages: u64, lease_ttl_ms: u64) -> Server {
    start_at("127.0.0.1:0".parse().unwrap(), pages, lease_ttl_ms).await
}

pub async fn start_at(addr: SocketAddr, pages: u64, lease_ttl_ms: u64) -> Server {
    start_with(addr, pages, |c| {
        c.lease_ttl_ms = lease_ttl_ms;
        // Tests that stop the service with a room open do not wait for it long.
        c.drain_timeout_ms = 300;
    })
    .await
}

pub async fn start_with(addr: SocketAddr, pages: u64, f: impl FnOnce(&mut Config)) -> Server {
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
pub fn layout() -> KvLayout {
    KvLayout::llama(30, 3, 64, DType::F16, 4)
}

pub async fn client(s: &Server, name: &str, plane: DataPlane) -> HostClient {
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
pub fn page_for(hash: u64) -> Vec<u8> {
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
pub fn chain(first_token: u32, pages: usize) -> Vec<(u64, u64)> {
    let tokens: Vec<u32> = (first_token..first_token + 4 * pages as u32).collect();
    let h = page_hashes(layout().fingerprint(), &tokens, 4);
    h.iter()
        .enumerate()
        .map(|(i, &x)| (x, if i == 0 { 0 } else { h[i - 1] }))
        .collect()
}

pub async fn store(c: &mut HostClient, chain: &[(u64, u64)]) -> pdmesh_cache::client::Stored {
    let pages: Vec<Vec<u8>> = chain.iter().map(|&(h, _)| page_for(h)).collect();
    let refs: Vec<(u64, u64, &[u8])> = chain
        .iter()
        .zip(&pages)
        .map(|(&(h, p), d)| (h, p, &d[..]))
        .collect();
    c.store(&refs).await.unwrap()
}

pub async fn load(c: &mut HostClient, hashes: &[u64]) -> (Loaded, Vec<Vec<u8>>) {
    let refs = c.match_pages(hashes).await.unwrap();
    let mut bufs = vec![vec![0u8; c.page_bytes()]; refs.len()];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let loaded = c.load_into(&refs, &mut dsts).await.unwrap();
    (loaded, bufs)
}

//! Helpers shared by the cache service's integration tests: start the real service on
//! loopback, connect workers, and make pages and prompts' hash chains.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;

use pb::cache_client::CacheClient;
use pdmesh_cache::client::{ClientError, DataPlane, HostClient, Loaded};
use pdmesh_cache::{Config, MirrorSize};
use pdmesh_kv::{DType, KvLayout, page_hashes};
use pdmesh_proto::cache::v1 as pb;
use pdmesh_testkit::service::{Service, answer, credentials};
use tokio::net::TcpListener;

/// A cache service with a mirror directory of its own.
pub struct Server {
    pub svc: Service<pdmesh_cache::Error>,
    /// Its --shm-dir.
    pub dir: tempfile::TempDir,
}

impl Server {
    pub fn url(&self) -> String {
        self.svc.url()
    }

    /// A raw client of the service's own RPCs.
    pub async fn rpc(&self) -> CacheClient<pdmesh_tls::AuthChannel> {
        self.svc.client(CacheClient::new).await
    }

    pub async fn stats(&self) -> pb::StatsResponse {
        answer(self.rpc().await.stats(pb::StatsRequest {})).await
    }

    pub async fn events(&self) -> tonic::Streaming<pb::KvEvent> {
        answer(
            self.rpc()
                .await
                .subscribe_events(pb::SubscribeEventsRequest {}),
        )
        .await
    }

    pub async fn stop(self) {
        self.svc.stop().await.unwrap();
    }

    /// The service user's private directory under --shm-dir, where the mirror goes.
    pub fn mirror_dir(&self) -> std::path::PathBuf {
        pdmesh_cache::mirror::dirs(Some(self.dir.path())).remove(0)
    }
}

/// A configuration with the test's credentials and a mirror of `bytes` under `shm`.
pub fn config(shm: &Path, bytes: u64) -> Config {
    let mut cfg = Config::new(MirrorSize::Bytes(bytes));
    cfg.tls = credentials();
    cfg.shm_dir = Some(shm.to_owned());
    cfg
}

/// The service with [`config`] as `f` leaves it, on `listener`.
pub fn serve_in(
    listener: TcpListener,
    shm: &Path,
    bytes: u64,
    f: impl FnOnce(&mut Config),
) -> Service<pdmesh_cache::Error> {
    let mut cfg = config(shm, bytes);
    f(&mut cfg);
    Service::serve(listener, |listener, shutdown| {
        pdmesh_cache::run(cfg, listener, shutdown)
    })
}

/// [`serve_in`] a mirror directory of the service's own.
pub fn serve(listener: TcpListener, bytes: u64, f: impl FnOnce(&mut Config)) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let svc = serve_in(listener, dir.path(), bytes, f);
    Server { svc, dir }
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

/// A service at `addr` with a mirror of `pages` pages of [`layout`].
pub async fn start_with(addr: SocketAddr, pages: u64, f: impl FnOnce(&mut Config)) -> Server {
    let listener = TcpListener::bind(addr).await.unwrap();
    serve(listener, pages * layout().bytes_per_page() as u64, f)
}

/// SmolLM2's KV layout with 4-token pages: 30 layers × (K + V) × 192 f16 × 4 tokens.
pub fn layout() -> KvLayout {
    KvLayout::llama(30, 3, 64, DType::F16, 4)
}

/// What `call` answers once its channel connected again: the first calls after the old
/// connection closed may find it closing (UNAVAILABLE), and are made again, three tries
/// in all.
pub async fn past_reconnect<T>(
    mut call: impl AsyncFnMut() -> Result<T, ClientError>,
) -> Result<T, ClientError> {
    let mut answer = call().await;
    for _ in 1..3 {
        match &answer {
            Err(e) if e.code() == tonic::Code::Unavailable => answer = call().await,
            _ => break,
        }
    }
    answer
}

/// A worker `name` of `layout` registered at `url`, or why not.
pub async fn host_client(
    url: &str,
    name: &str,
    layout: &KvLayout,
    plane: DataPlane,
) -> Result<HostClient, ClientError> {
    HostClient::connect(url, (name, ""), layout, plane, &pdmesh_tls::test_ca::auth()).await
}

/// A worker `name` of [`layout`] registered at `s`.
pub async fn client(s: &Server, name: &str, plane: DataPlane) -> HostClient {
    host_client(&s.url(), name, &layout(), plane).await.unwrap()
}

/// `len` bytes of a xorshift sequence from `seed` (not 0): page contents that differ
/// from seed to seed.
pub fn bytes_from(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Distinct page contents per hash.
pub fn page_for(hash: u64) -> Vec<u8> {
    bytes_from(hash | 1, layout().bytes_per_page())
}

/// DeepSeek V3.2's layout (4 layers, 16-token pages) with its index-K in `index_k`: the
/// seed's two forms, which a mirror must tell apart.
pub fn dsv32(index_k: pdmesh_kv::IndexKDtype) -> KvLayout {
    let dims = pdmesh_kv::MlaDims {
        kv_lora_rank: 128,
        rope_dim: 32,
        index_head_dim: 128,
    };
    KvLayout::deepseek_v32(4, dims, pdmesh_kv::MlaCacheDtype::Bf16, index_k, 16).unwrap()
}

/// Gemma 3 270M's layout (16-token pages): layers 5, 11 and 17 global, the others a
/// window of 512; with `all_global`, the layout of a worker that dropped the window and
/// believes every layer global.
pub fn gemma3(all_global: bool) -> KvLayout {
    let dense = KvLayout::llama(18, 1, 256, DType::F16, 16);
    if all_global {
        return dense;
    }
    dense.with_window(512, &[5, 11, 17]).unwrap()
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

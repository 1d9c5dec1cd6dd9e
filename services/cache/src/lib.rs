//! Cache service: the host tier of the KV cache.
//!
//! It owns the host mirror — a shared-memory file of page slots sized from the first
//! registered worker's `KvLayout` — and the index of the prefix pages it holds, named by
//! chained token hashes. Workers register (a different layout is refused, naming both),
//! hold a lease kept alive by heartbeats, pin pages they load and reserve slots they
//! write; a worker that dies stops heartbeating and its lease expires, releasing all of
//! it. Page bytes move over one of two data planes with one page format: `shm` (workers
//! map the file) or `grpc` (bytes in messages). Every page carries a checksum
//! (`pdmesh_kv::page_checksum`, XXH3-64),
//! checked at commit and by every consumer.
//!
//! [`client`] is the worker side of the protocol.

pub mod client;
mod grpc;
pub mod mirror;
pub mod rooms;
mod state;
mod tier;
pub mod wire;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use state::{CacheError, MirrorSize};
pub use tier::{RemoteTier, TierConfig};

/// Configuration of the cache service.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct Config {
    /// Size of the host mirror: bytes (`4GiB`, `512MiB`, `1000000`) or tokens of the
    /// registered layout (`200000tokens`).
    #[arg(long, env = "PDMESH_HOST_MIRROR_SIZE", default_value = "1GiB")]
    pub host_mirror_size: MirrorSize,
    /// Directory of the mirror file (default: /dev/shm if it has room, else the temporary
    /// directory).
    #[arg(long, env = "PDMESH_SHM_DIR")]
    pub shm_dir: Option<PathBuf>,
    /// A worker that does not heartbeat for this long loses its pins and reservations.
    #[arg(long, env = "PDMESH_LEASE_TTL_MS", default_value_t = 10_000)]
    pub lease_ttl_ms: u64,
}

impl Config {
    pub fn new(host_mirror_size: MirrorSize) -> Self {
        Self {
            host_mirror_size,
            shm_dir: None,
            lease_ttl_ms: 10_000,
        }
    }
}

/// Everything the service can fail with at start-up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid cache configuration: {0}")]
    Config(String),
    #[error("serving gRPC: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves `pdmesh.cache.v1.Cache` on `listener` until `shutdown` is cancelled; the mirror
/// file is removed on the way out.
pub async fn run(
    cfg: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    if cfg.lease_ttl_ms == 0 {
        return Err(Error::Config("--lease-ttl-ms must be at least 1".into()));
    }
    if let Some(dir) = &cfg.shm_dir
        && !dir.is_dir()
    {
        return Err(Error::Config(format!(
            "--shm-dir {} is not a directory",
            dir.display()
        )));
    }
    let ttl = Duration::from_millis(cfg.lease_ttl_ms);
    let shared = grpc::Shared::new(state::State::new(
        cfg.host_mirror_size,
        cfg.shm_dir.clone(),
        ttl,
    ));
    let reaper = {
        let shared = shared.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval((ttl / 4).max(Duration::from_millis(5)));
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tick.tick() => { shared.with(|s| s.expire(Instant::now())); }
                }
            }
        })
    };
    let addr = listener.local_addr().ok();
    tracing::info!(?addr, size = ?cfg.host_mirror_size, "cache service listening");
    let served = tonic::transport::Server::builder()
        .add_service(pdmesh_proto::cache::v1::cache_server::CacheServer::new(
            grpc::CacheService::new(shared.clone(), shutdown.clone()),
        ))
        .serve_with_incoming_shutdown(
            // Small messages (tokens, control calls) must not wait for Nagle's algorithm.
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown.cancelled_owned(),
        )
        .await;
    reaper.abort();
    let _ = reaper.await;
    tracing::info!(?addr, "cache service stopped");
    served.map_err(Error::from)
}

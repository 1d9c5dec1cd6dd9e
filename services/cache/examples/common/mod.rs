//! What the cache service's benchmarks share: SmolLM2's page layout, their arguments, a
//! cache service in process and its clients.

#![allow(dead_code)]

use pdmesh_cache::client::{ClientError, DataPlane, HostClient};
use pdmesh_cache::{Config, MirrorSize};
use pdmesh_kv::{DType, KvLayout};
use pdmesh_testkit::service::{Service, credentials};

pub use pdmesh_testkit::bench::median;

/// SmolLM2-135M's KV layout with 16-token pages: 368,640 bytes a page.
pub fn smol() -> KvLayout {
    KvLayout::llama(30, 3, 64, DType::F16, 16)
}

/// `[PAGES] [ROUNDS]` (64 and 15 unless given), and the arguments after them.
pub fn pages_and_rounds() -> (usize, usize, Vec<String>) {
    let mut args = pdmesh_testkit::bench::args();
    let rest = args.split_off(args.len().min(2));
    let n = pdmesh_testkit::bench::numbers(&args);
    (*n.first().unwrap_or(&64), *n.get(1).unwrap_or(&15), rest)
}

/// A cache service in process on loopback with a mirror of `bytes` (in /dev/shm), the
/// bench's mesh credential, and every other setting its default.
pub async fn serve(bytes: u64) -> Service<pdmesh_cache::Error> {
    let mut cfg = Config::new(MirrorSize::Bytes(bytes));
    cfg.tls = credentials();
    Service::start(|listener, shutdown| pdmesh_cache::run(cfg, listener, shutdown)).await
}

/// A worker `name` of `layout` registered at `url` on the shm data plane.
pub async fn shm_client(
    url: &str,
    name: &str,
    layout: &KvLayout,
) -> Result<HostClient, ClientError> {
    let auth = pdmesh_tls::test_ca::auth();
    HostClient::connect(url, (name, ""), layout, DataPlane::Shm, &auth).await
}

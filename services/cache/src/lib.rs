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
//! The worker side of the protocol (client, wire forms, mirror file, host-tier adapter)
//! is the `pdmesh-cache-client` crate; it is re-exported here for the server's tests.

#![forbid(unsafe_code)]

pub mod disk;
mod grpc;
mod peers;
pub mod rooms;
mod state;
pub mod transfer;

pub use pdmesh_cache_client::{Watchdog, client, mirror, wire};

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use state::stats::RoomStats;

pub use pdmesh_cache_client::{Lease, RemoteTier, TierConfig};
pub use state::CacheError;
pub use state::slots::{BadMirrorSize, MirrorSize};

/// Configuration of the cache service.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct Config {
    /// Size of the host mirror: bytes (`4GiB`, `512MiB`, `1000000`) or tokens of the
    /// registered layout (`200000tokens`).
    #[arg(long, env = "PDMESH_HOST_MIRROR_SIZE", default_value = "1GiB")]
    pub host_mirror_size: MirrorSize,
    /// Directory of the mirror file (default: /dev/shm if it has room, else the temporary
    /// directory). The file goes into this user's own subdirectory there,
    /// `pdmesh-mirrors-<uid>`, made mode 0700 (the file is 0600): the service refuses to
    /// start when that subdirectory is someone else's or its group or others may reach
    /// it. Workers mapping the mirror run as the same user. At start the service removes
    /// the mirror files there (in both defaults when unset) whose cache service died
    /// without removing them.
    #[arg(long, env = "PDMESH_SHM_DIR")]
    pub shm_dir: Option<PathBuf>,
    /// A worker that does not heartbeat for this long loses its pins and reservations.
    #[arg(long, env = "PDMESH_LEASE_TTL_MS", default_value_t = 10_000)]
    pub lease_ttl_ms: u64,
    /// A room fails when it stays longer than this until both sides joined (decode joins
    /// once its pages are reserved).
    #[arg(long, env = "PDMESH_ROOM_BOOTSTRAP_MS", default_value_t = 60_000)]
    pub room_bootstrap_ms: u64,
    /// ... until the sender starts writing (prefill computes meanwhile).
    #[arg(long, env = "PDMESH_ROOM_WAIT_MS", default_value_t = 120_000)]
    pub room_wait_ms: u64,
    /// ... while the sender writes.
    #[arg(long, env = "PDMESH_ROOM_TRANSFER_MS", default_value_t = 30_000)]
    pub room_transfer_ms: u64,
    /// A room that succeeded is dropped (its slots freed) when the receiver has not taken
    /// its pages within this.
    #[arg(long, env = "PDMESH_ROOM_SUCCESS_MS", default_value_t = 30_000)]
    pub room_success_ms: u64,
    /// What the watchdog does with a room past half its state's deadline: `soft` logs a
    /// table of them and counts stalls; `hard` also fails them, releasing their slots.
    #[arg(long, env = "PDMESH_WATCHDOG", value_enum, default_value_t = Watchdog::Soft)]
    pub watchdog: Watchdog,
    /// Where the tcp page transport listens for pages from other hosts' cache services
    /// (default: the gRPC address's IP, any free port; peers learn the port when they
    /// register).
    #[arg(long, env = "PDMESH_PEER_LISTEN")]
    pub peer_listen: Option<std::net::SocketAddr>,
    /// Deadline of every call to another host's cache service and of every read and
    /// write of the page transport.
    #[arg(long, env = "PDMESH_PEER_IO_TIMEOUT_MS", default_value_t = 5_000)]
    pub peer_io_timeout_ms: u64,
    /// The other hosts' cache services this one may relay rooms to, by gRPC URL
    /// (comma-separated, or the flag repeated). A room's home must be one of them. With
    /// the mesh's mutual TLS and no list, a home is accepted when its certificate names
    /// the cache role (the mesh's CA decides who belongs); with the mesh token and no
    /// list, no room is relayed to another host.
    #[arg(long = "peer", env = "PDMESH_PEERS", value_delimiter = ',')]
    pub peers: Vec<String>,
    /// Where incident reports (a wedge the watchdog found) are written.
    #[command(flatten)]
    pub incidents: pdmesh_incident::IncidentArgs,
    /// At SIGTERM the cache service drains: it opens no new room (UNAVAILABLE, so the
    /// gateway tries the request on another host) and keeps serving until every room
    /// and relay under way has ended, or for this long; then it stops (0: at once). Keep
    /// it under the pod's terminationGracePeriodSeconds.
    #[arg(long, env = "PDMESH_DRAIN_TIMEOUT_MS", default_value_t = 20_000)]
    pub drain_timeout_ms: u64,
    /// The mesh credential for gRPC and the page transport (both ways): mutual TLS or
    /// the mesh token.
    #[command(flatten)]
    pub tls: pdmesh_tls::TlsArgs,
    /// The disk tier below the host mirror.
    #[command(flatten)]
    pub disk: DiskArgs,
}

/// The disk tier's flags.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct DiskArgs {
    /// A folder for the disk tier (made mode 0700; refused when other users may enter
    /// it or another cache service holds it): pages evicted from the host mirror are
    /// written there, promoted back on a hit, and outlive restarts. Without it, no disk
    /// tier.
    #[arg(long, env = "PDMESH_DISK_DIR")]
    pub disk_dir: Option<PathBuf>,
    /// Bytes of page files the disk tier keeps at most (`64GiB`, `500MB`); the least
    /// recently used go first.
    #[arg(long, env = "PDMESH_DISK_SIZE", default_value = "16GiB")]
    pub disk_size: DiskSize,
    /// How long a match waits for its pages to be promoted from disk; pages not in by
    /// then are a miss (recomputed), never a longer wait.
    #[arg(long, env = "PDMESH_DISK_PROMOTE_TIMEOUT_MS", default_value_t = 500)]
    pub disk_promote_timeout_ms: u64,
    /// Bytes of evicted pages waiting to be written at most; more are not spilled
    /// (counted).
    #[arg(long, env = "PDMESH_DISK_SPILL_QUEUE", default_value = "256MiB")]
    pub disk_spill_queue: DiskSize,
}

impl Default for DiskArgs {
    /// No disk tier; the flags' defaults.
    fn default() -> Self {
        Self {
            disk_dir: None,
            disk_size: DiskSize(16 << 30),
            disk_promote_timeout_ms: 500,
            disk_spill_queue: DiskSize(256 << 20),
        }
    }
}

/// A size in bytes (`16GiB`, `500MB`, `1000000`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskSize(pub u64);

impl std::str::FromStr for DiskSize {
    type Err = state::slots::BadMirrorSize;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.parse::<MirrorSize>()? {
            MirrorSize::Bytes(b) => Ok(DiskSize(b)),
            MirrorSize::Tokens(_) => Err(state::slots::BadMirrorSize::UnknownUnit(
                s.to_owned(),
                "tokens".into(),
            )),
        }
    }
}

impl Config {
    pub fn new(host_mirror_size: MirrorSize) -> Self {
        Self {
            host_mirror_size,
            shm_dir: None,
            lease_ttl_ms: 10_000,
            room_bootstrap_ms: 60_000,
            room_wait_ms: 120_000,
            room_transfer_ms: 30_000,
            room_success_ms: 30_000,
            watchdog: Watchdog::Soft,
            peer_listen: None,
            peer_io_timeout_ms: 5_000,
            peers: Vec::new(),
            incidents: pdmesh_incident::IncidentArgs::default(),
            drain_timeout_ms: 20_000,
            tls: pdmesh_tls::TlsArgs::default(),
            disk: DiskArgs::default(),
        }
    }

    pub fn room_deadlines(&self) -> rooms::RoomDeadlines {
        rooms::RoomDeadlines {
            bootstrapping: Duration::from_millis(self.room_bootstrap_ms),
            waiting_for_input: Duration::from_millis(self.room_wait_ms),
            transferring: Duration::from_millis(self.room_transfer_ms),
            success: Duration::from_millis(self.room_success_ms),
        }
    }
}

/// Everything the service can fail with at start-up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid cache configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Tls(#[from] pdmesh_tls::TlsError),
    #[error("serving gRPC: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// The cache service's listeners: its gRPC port and its tcp page transport's (without
/// one, `run` binds it with [`bind_peer`]).
#[derive(Debug)]
pub struct Listeners {
    pub grpc: TcpListener,
    pub peer: Option<TcpListener>,
}

impl From<TcpListener> for Listeners {
    fn from(grpc: TcpListener) -> Self {
        Self { grpc, peer: None }
    }
}

/// The page transport's listener as `cfg` says: [`Config::peer_listen`], or any free
/// port on the IP of `grpc`, the service's own address.
pub async fn bind_peer(
    cfg: &Config,
    grpc: Option<std::net::SocketAddr>,
) -> Result<TcpListener, Error> {
    let peer_at = cfg.peer_listen.unwrap_or_else(|| {
        let ip = grpc.map_or(std::net::Ipv4Addr::LOCALHOST.into(), |a| a.ip());
        std::net::SocketAddr::new(ip, 0)
    });
    TcpListener::bind(peer_at).await.map_err(|e| {
        Error::Config(format!(
            "the page transport cannot listen on {peer_at}: {e}"
        ))
    })
}

/// Serves `pdmesh.cache.v1.Cache` on the gRPC listener until `shutdown` is cancelled and
/// the drain that starts then is over (see [`Config::drain_timeout_ms`]); the mirror file
/// is removed on the way out.
pub async fn run(
    cfg: Config,
    listeners: impl Into<Listeners>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let Listeners {
        grpc: listener,
        peer,
    } = listeners.into();
    let addr = listener.local_addr().ok();
    let peer_listener = match peer {
        Some(l) => l,
        None => bind_peer(&cfg, addr).await?,
    };
    for (flag, v) in [
        ("lease-ttl-ms", cfg.lease_ttl_ms),
        ("room-bootstrap-ms", cfg.room_bootstrap_ms),
        ("room-wait-ms", cfg.room_wait_ms),
        ("room-transfer-ms", cfg.room_transfer_ms),
        ("room-success-ms", cfg.room_success_ms),
        ("peer-io-timeout-ms", cfg.peer_io_timeout_ms),
        ("disk-promote-timeout-ms", cfg.disk.disk_promote_timeout_ms),
        ("disk-size", cfg.disk.disk_size.0),
        ("disk-spill-queue", cfg.disk.disk_spill_queue.0),
    ] {
        if v == 0 {
            return Err(Error::Config(format!("--{flag} must be at least 1")));
        }
    }
    if let Some(dir) = &cfg.shm_dir
        && !dir.is_dir()
    {
        return Err(Error::Config(format!(
            "--shm-dir {} is not a directory",
            dir.display()
        )));
    }
    // The mirror's own directory, this user's alone, made or checked now: a loose or
    // foreign one stops the service here rather than at the first registration.
    let mirror_dir = match &cfg.shm_dir {
        Some(base) => Some(mirror::private_dir(base).map_err(|e| Error::Config(e.to_string()))?),
        None => {
            for base in mirror::bases(None) {
                mirror::private_dir(&base).map_err(|e| Error::Config(e.to_string()))?;
            }
            None
        }
    };
    let auth = cfg.tls.auth()?;
    if let Some(a) = addr {
        auth.check_listen("the cache service", a)?;
    }
    if let Ok(a) = peer_listener.local_addr() {
        auth.check_listen("the cache service's page transport", a)?;
    }
    mirror::sweep_dirs(cfg.shm_dir.as_deref());
    let disk = match &cfg.disk.disk_dir {
        Some(dir) => Some(
            disk::tier::DiskTier::new(disk::tier::DiskConfig {
                dir: dir.clone(),
                capacity: cfg.disk.disk_size.0,
                spill_queue_bytes: cfg.disk.disk_spill_queue.0 as usize,
                readers: 4,
            })
            .map_err(|e| Error::Config(format!("--disk-dir: {e}")))?,
        ),
        None => None,
    };
    let shm_dir = cfg.shm_dir.clone();
    let ttl = Duration::from_millis(cfg.lease_ttl_ms);
    // `shutdown` starts the drain; `serving` stops everything once it is over.
    let serving = CancellationToken::new();
    let shared = grpc::Shared::new(
        state::State::with_rooms(cfg.host_mirror_size, mirror_dir, ttl, cfg.room_deadlines())
            .with_disk(disk.clone()),
    );
    let opts = transfer::TcpOptions {
        io_timeout: Duration::from_millis(cfg.peer_io_timeout_ms),
        ..transfer::TcpOptions::default()
    };
    let peer_port = peer_listener.local_addr().map_or(0, |a| a.port());
    let receiver = tokio::spawn(receive_pages(
        peer_listener,
        shared.clone(),
        opts,
        auth.clone(),
        serving.clone(),
    ));
    let drainer = tokio::spawn(drain(
        shared.clone(),
        Duration::from_millis(cfg.drain_timeout_ms),
        shutdown.clone(),
        serving.clone(),
    ));
    let peers = std::sync::Arc::new(peers::Peers::new(
        format!(
            "cache service at {}",
            addr.map_or("?".into(), |a| a.to_string())
        ),
        opts,
        auth.clone(),
        &cfg.peers,
    )?);
    let watchdog = cfg.watchdog;
    let reporter = pdmesh_incident::Reporter::from_flags(
        cfg.incidents.dir.as_deref(),
        cfg.incidents.trace_link.clone(),
        None,
        false,
    )
    .map_err(|e| Error::Config(e.to_string()))?
    .map(std::sync::Arc::new);
    let wedges = Wedges {
        reporter: reporter.clone(),
        config: config_table(&cfg, addr),
        host: pdmesh_incident::hostname(),
    };
    let reaper = {
        let shared = shared.clone();
        let shutdown = serving.clone();
        let peers = peers.clone();
        tokio::spawn(async move {
            // Fine enough for room deadlines of a fraction of a second.
            let every = (ttl / 4).clamp(Duration::from_millis(5), Duration::from_millis(50));
            let mut tick = tokio::time::interval(every);
            // The rooms' figures at the last tick: a wedge report's "before".
            let mut before = shared.with(|s| s.room_stats(Instant::now()));
            // A gap this long between ticks is this service's own stall (stopped,
            // starved of CPU, swapped out): long enough to put the workers' leases,
            // which they could not renew meanwhile, at risk.
            let stalled_after = (ttl / 2).max(Duration::from_secs(1));
            let mut last = Instant::now();
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tick.tick() => {
                        let gap = last.elapsed();
                        last = Instant::now();
                        if gap >= stalled_after {
                            // What was under way when it stopped, before the leases it
                            // could not renew expire and fail those rooms.
                            let (rooms, now_stats) = shared.with(|s| {
                                let now = Instant::now();
                                (s.rooms_under_way(now), s.room_stats(now))
                            });
                            tracing::error!(seconds = gap.as_secs_f64(), rooms = rooms.len(), "this cache service made no progress: its reaper did not run");
                            wedges.stalled(gap, every, &rooms, (&before, &now_stats));
                        }
                        let (stuck, after, seen) = shared.with(|s| {
                            let now = Instant::now();
                            s.expire(now);
                            let stuck = match watchdog {
                                Watchdog::Off => Vec::new(),
                                Watchdog::Soft => s.watchdog(now, 0.5, false),
                                Watchdog::Hard => s.watchdog(now, 0.5, true),
                            };
                            (stuck, s.room_stats(now), s.take_incidents())
                        });
                        for i in seen {
                            wedges.file(i);
                        }
                        if !stuck.is_empty() {
                            log_stuck(&stuck, watchdog);
                            wedges.report(&stuck, watchdog, (&before, &after));
                        }
                        before = after;
                        if let Some(r) = &wedges.reporter
                            && let Err(e) = r.tick()
                        {
                            tracing::warn!(error = %e, "incident reports: repeats not written");
                        }
                        for d in shared.with(|s| s.take_dropped_relays()) {
                            let peers = peers.clone();
                            tokio::spawn(async move {
                                if let Some(link) = peers.existing(&d.home).await
                                    && let Err(e) = link.room_abort(d.room, &d.reason).await
                                {
                                    tracing::debug!(room = d.room, error = %e, "telling the room's home it failed");
                                }
                            });
                        }
                    }
                }
            }
        })
    };
    tracing::info!(?addr, peer_port, size = ?cfg.host_mirror_size, "cache service listening");
    let router = auth.traced_server()?.add_service(
        auth.guard(
            &grpc::POLICY,
            pdmesh_proto::cache::v1::cache_server::CacheServer::new(
                grpc::CacheService::new(shared.clone(), serving.clone(), peers, peer_port)
                    .with_incidents(reporter)
                    .with_promote_timeout(Duration::from_millis(cfg.disk.disk_promote_timeout_ms)),
            ),
        ),
    );
    let served = pdmesh_tls::serve(router, listener, serving.cancelled_owned()).await;
    drainer.abort();
    let _ = drainer.await;
    reaper.abort();
    let _ = reaper.await;
    receiver.abort();
    let _ = receiver.await;
    if let Some(d) = disk {
        flush_to_disk(&shared, d, Duration::from_millis(cfg.drain_timeout_ms)).await;
    }
    // The mirror file goes with the state's last holder, then this user's directory for
    // mirrors unless another cache service's mirror is in it: nothing is left in /dev/shm.
    drop(shared);
    mirror::remove_empty_dirs(shm_dir.as_deref());
    tracing::info!(?addr, "cache service stopped");
    served.map_err(Error::from)
}

/// At a graceful stop, writes the host mirror's pages not yet on disk (the most recently
/// used first) within `timeout`, so a restarted service finds them.
async fn flush_to_disk(shared: &grpc::Shared, disk: Arc<disk::tier::DiskTier>, timeout: Duration) {
    if !disk.serving() {
        return;
    }
    let shared = shared.clone();
    let t0 = Instant::now();
    let deadline = t0 + timeout;
    let done = tokio::task::spawn_blocking(move || {
        let pages = shared.with(|s| s.resident_pages());
        let mirror = shared.with(|s| s.mirror());
        let Some(mirror) = mirror else { return 0 };
        let n = pages.len();
        disk.flush(
            pages.into_iter().filter_map(|(hash, slot, checksum)| {
                let mut data = vec![0u8; mirror.page_bytes()];
                // Still that page (nothing is served now, but a page is read only as it is).
                shared
                    .with(|s| s.read_resident(hash, slot, &mut data))
                    .then_some((hash, checksum, data))
            }),
            deadline,
        );
        n
    })
    .await
    .unwrap_or(0);
    tracing::info!(
        pages = done,
        seconds = t0.elapsed().as_secs_f64(),
        "host mirror written to the disk tier"
    );
}

/// Once `shutdown` is cancelled: opens no new room or relay, waits until none is under
/// way (the reaper still fails those past their deadlines) or `timeout` passes, then
/// cancels `serving`.
async fn drain(
    shared: grpc::Shared,
    timeout: Duration,
    shutdown: CancellationToken,
    serving: CancellationToken,
) {
    shutdown.cancelled().await;
    shared.with(|s| s.drain());
    tracing::info!(
        ?timeout,
        "draining: no new room opens, those under way finish"
    );
    pdmesh_tls::wait_drained(
        timeout,
        || std::future::ready(shared.with(|s| s.busy(Instant::now()))),
        pdmesh_tls::DrainEnd {
            drained: "drained: no room is under way",
            timed_out: "drain timed out: stopping with rooms under way",
        },
    )
    .await;
    serving.cancel();
}

/// Accepts page transport connections from other hosts' cache services until `stop`;
/// each page lands in its room's slot only if the room is transferring from a peer.
async fn receive_pages(
    listener: TcpListener,
    shared: grpc::Shared,
    opts: transfer::TcpOptions,
    auth: pdmesh_tls::MeshAuth,
    stop: CancellationToken,
) {
    let admitted = Admitted::default();
    loop {
        let (stream, from) = tokio::select! {
            () = stop.cancelled() => return,
            a = listener.accept() => match a {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a page transport connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(layout) = shared.with(|s| s.layout().cloned()) else {
            tracing::warn!("a peer connected before any worker registered here: closed");
            continue;
        };
        let Some(slot) = admitted.take(from.ip(), &opts) else {
            tracing::warn!(peer = %from, "page transport connection limit reached: closed");
            continue;
        };
        let (shared, stop, auth) = (shared.clone(), stop.clone(), auth.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let sink = HomeSink(&shared);
            let served = tokio::select! {
                () = stop.cancelled() => return,
                r = transfer::serve_connection(stream, &auth, &layout, opts, sink) => r,
            };
            match served {
                Ok(_) => {}
                Err(transfer::TransferError::LayoutRefused { peer, reason }) => {
                    shared.with(|s| s.peer_layout_refused(&peer, &reason));
                    tracing::warn!(%peer, %reason, "page transport refused a peer's layout");
                }
                Err(e) => tracing::warn!(error = %e, "page transport connection failed"),
            }
        });
    }
}

/// The page transport connections being served, in all and by peer address, so that no
/// peer (nor all of them) holds more than `TcpOptions::max_connections` / `max_per_peer`.
#[derive(Clone, Default)]
struct Admitted(Arc<Mutex<(usize, HashMap<IpAddr, usize>)>>);

impl Admitted {
    /// A slot for one more connection from `ip`, released when dropped; `None` at a limit.
    fn take(&self, ip: IpAddr, opts: &transfer::TcpOptions) -> Option<AdmittedSlot> {
        let mut g = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let (total, by_peer) = &mut *g;
        let mine = by_peer.entry(ip).or_default();
        if *total >= opts.max_connections || *mine >= opts.max_per_peer {
            if *mine == 0 {
                by_peer.remove(&ip);
            }
            return None;
        }
        *mine += 1;
        *total += 1;
        Some(AdmittedSlot(self.clone(), ip))
    }
}

struct AdmittedSlot(Admitted, IpAddr);

impl Drop for AdmittedSlot {
    fn drop(&mut self) {
        let mut g = self.0.0.lock().unwrap_or_else(PoisonError::into_inner);
        let (total, by_peer) = &mut *g;
        *total -= 1;
        if let Some(n) = by_peer.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                by_peer.remove(&self.1);
            }
        }
    }
}

/// Where pages from peers land: their rooms' slots here; a trailer is the room's commit.
struct HomeSink<'a>(&'a grpc::Shared);

impl transfer::Sink for HomeSink<'_> {
    type Refusal = state::PageRefused;
    fn page(&mut self, p: transfer::InPage<'_>) -> Result<(), state::PageRefused> {
        self.0
            .with(|s| s.peer_write(p.sender, p.room, p.index, p.bytes))
    }

    fn trailer(&mut self, room: u64, sender: Lease, trailer: &[u8]) -> Vec<u8> {
        grpc::rooms::peer_commit(self.0, room, sender, trailer)
    }
    fn checksum_failed(&mut self, bad: transfer::BadArrival<'_>) {
        self.0.with(|s| s.arrival_checksum_failed(bad));
    }
}

/// What the cache service's wedge reports need beside the stuck rooms.
struct Wedges {
    reporter: Option<std::sync::Arc<pdmesh_incident::Reporter>>,
    config: std::collections::BTreeMap<String, String>,
    host: String,
}

impl Wedges {
    /// Files a failure seen under the state's lock (checksum, layout), as this service.
    fn file(&self, mut i: pdmesh_incident::Incident) {
        let Some(r) = &self.reporter else {
            return;
        };
        i.place.service = "cache".into();
        i.place.host = self.host.clone();
        i.config = self.config.clone();
        if let Err(e) = r.report(i) {
            tracing::warn!(error = %e, "an incident report could not be written");
        }
    }

    /// Files a `wedge` report of this service's own stall: it made no progress for
    /// `gap` (its reaper runs every `every`), with the rooms under way when it resumed.
    fn stalled(
        &self,
        gap: Duration,
        every: Duration,
        rooms: &[rooms::Stuck],
        figures: (&RoomStats, &RoomStats),
    ) {
        let summary = format!(
            "This cache service made no progress for {:.1} s: its reaper, due every {} ms, \
             did not run (the process was stopped, starved of CPU or swapped out). {} \
             room(s) were under way when it resumed; the workers could not renew their \
             leases meanwhile, so leases past their time expire now and fail their rooms.",
            gap.as_secs_f64(),
            every.as_millis(),
            rooms.len()
        );
        self.wedge(summary, "service stall", rooms, figures, |i| {
            i.details.insert(
                "stalled seconds".into(),
                format!("{:.3}", gap.as_secs_f64()),
            );
        });
    }

    /// Files a `wedge` report for the rooms the watchdog found stuck now: the oldest
    /// room's request, trace and timeline, every stuck room, and the rooms' figures
    /// before and after.
    fn report(&self, stuck: &[rooms::Stuck], mode: Watchdog, figures: (&RoomStats, &RoomStats)) {
        let Some(oldest) = stuck.first() else {
            return;
        };
        let done = if mode == Watchdog::Hard {
            "the hard watchdog failed them, giving their mirror slots back"
        } else {
            "the soft watchdog left them to their deadlines"
        };
        let summary = format!(
            "{} room(s) stayed in one state past half that state's deadline; {done}. \
             The oldest, room {} of request {}, had been {} for {:.1} s.",
            stuck.len(),
            oldest.room,
            if oldest.request_id.is_empty() {
                "(unnamed)"
            } else {
                &oldest.request_id
            },
            oldest.state.name(),
            oldest.age.as_secs_f64()
        );
        self.wedge(summary, "", stuck, figures, |i| {
            i.details
                .insert("watchdog".into(), format!("{mode:?}").to_lowercase());
        });
    }

    /// A `wedge` report: `summary`, the first (oldest) room's request, trace and
    /// timeline, every room listed, and the rooms' figures before and after.
    fn wedge(
        &self,
        summary: String,
        stage: &str,
        rooms: &[rooms::Stuck],
        (before, after): (&RoomStats, &RoomStats),
        details: impl FnOnce(&mut pdmesh_incident::Incident),
    ) {
        let Some(r) = &self.reporter else {
            return;
        };
        let mut i = pdmesh_incident::Incident::new(
            pdmesh_incident::Kind::Wedge,
            summary,
            pdmesh_incident::Place {
                service: "cache".into(),
                host: self.host.clone(),
                stage: stage.into(),
                ..Default::default()
            },
        );
        if let Some(oldest) = rooms.first() {
            i.place.room = Some(oldest.room);
            i.place.request_id = oldest.request_id.clone();
            i.place.trace_id = oldest.trace_id.clone();
            i.timeline = oldest
                .timeline
                .iter()
                .map(|(at, what)| pdmesh_incident::Step::new(*at, what.to_string()))
                .collect();
        }
        i.stuck_rooms = rooms
            .iter()
            .map(|s| pdmesh_incident::StuckRoom {
                room: s.room,
                state: s.state.name().into(),
                age_seconds: s.age.as_secs_f64(),
                request_id: s.request_id.clone(),
                trace_id: s.trace_id.clone(),
            })
            .collect();
        let (b, a) = (room_figures(before), room_figures(after));
        i.metrics = a
            .iter()
            .map(|(name, v)| pdmesh_incident::MetricDelta {
                name: name.clone(),
                before: b.iter().find(|(n, _)| n == name).map(|x| x.1),
                after: Some(*v),
            })
            .collect();
        i.config = self.config.clone();
        details(&mut i);
        if let Err(e) = r.report(i) {
            tracing::warn!(error = %e, "a wedge report could not be written");
        }
    }
}

/// The rooms' figures a wedge report shows (the cache service's own counts; `/metrics`
/// shows them as `mesh_rooms`, `mesh_room_oldest_seconds`, `mesh_stalls_total`,
/// `mesh_room_slots` and `mesh_kv_transfer_bytes_total`).
fn room_figures(s: &RoomStats) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = Vec::new();
    for (state, n, oldest) in &s.census {
        out.push((format!("rooms {}", state.name()), *n as f64));
        out.push((
            format!("oldest {} room, seconds", state.name()),
            oldest.as_secs_f64(),
        ));
    }
    out.extend([
        ("room stalls seen".to_owned(), s.stalls as f64),
        ("mirror slots held by rooms".to_owned(), s.room_slots as f64),
        (
            "mirror slots quarantined".to_owned(),
            s.quarantined_slots as f64,
        ),
        ("transfer bytes".to_owned(), s.transfer_bytes as f64),
        ("rooms finished".to_owned(), s.finished as f64),
    ]);
    out
}

/// The service's settings as a report shows them.
fn config_table(
    cfg: &Config,
    addr: Option<std::net::SocketAddr>,
) -> std::collections::BTreeMap<String, String> {
    [
        ("listen", addr.map_or_else(String::new, |a| a.to_string())),
        ("host_mirror_size", format!("{:?}", cfg.host_mirror_size)),
        ("lease_ttl_ms", cfg.lease_ttl_ms.to_string()),
        ("room_bootstrap_ms", cfg.room_bootstrap_ms.to_string()),
        ("room_wait_ms", cfg.room_wait_ms.to_string()),
        ("room_transfer_ms", cfg.room_transfer_ms.to_string()),
        ("room_success_ms", cfg.room_success_ms.to_string()),
        ("watchdog", format!("{:?}", cfg.watchdog).to_lowercase()),
        ("peer_io_timeout_ms", cfg.peer_io_timeout_ms.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// One warning with a table of the rooms the watchdog found stuck.
fn log_stuck(stuck: &[rooms::Stuck], mode: Watchdog) {
    use std::fmt::Write as _;
    let mut table = format!(
        "{:<36} {:>20} {:<18} {:>9} {}",
        "request", "room", "state", "age", "trace"
    );
    for s in stuck {
        let _ = write!(
            table,
            "\n{:<36} {:>20} {:<18} {:>8.1}s {}",
            s.request_id,
            s.room,
            s.state.name(),
            s.age.as_secs_f64(),
            s.trace_id
        );
    }
    let action = if mode == Watchdog::Hard {
        "failed"
    } else {
        "left to their deadlines"
    };
    tracing::warn!(rooms = stuck.len(), "stuck rooms ({action}):\n{table}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_transport_connections_are_capped_per_peer_and_in_all() {
        let opts = transfer::TcpOptions {
            max_connections: 3,
            max_per_peer: 2,
            ..transfer::TcpOptions::default()
        };
        let (a, b, c): (IpAddr, IpAddr, IpAddr) = (
            "10.0.0.1".parse().unwrap(),
            "10.0.0.2".parse().unwrap(),
            "10.0.0.3".parse().unwrap(),
        );
        let admitted = Admitted::default();
        let a1 = admitted.take(a, &opts).unwrap();
        let a2 = admitted.take(a, &opts).unwrap();
        assert!(admitted.take(a, &opts).is_none(), "a third from one peer");
        let b1 = admitted.take(b, &opts).unwrap();
        assert!(admitted.take(c, &opts).is_none(), "a fourth in all");
        drop(a1);
        let c1 = admitted.take(c, &opts).unwrap();
        drop((a2, b1, c1));
        let g = admitted.0.lock().unwrap();
        assert_eq!(
            (g.0, g.1.len()),
            (0, 0),
            "every slot given back, no peer remembered"
        );
    }
}

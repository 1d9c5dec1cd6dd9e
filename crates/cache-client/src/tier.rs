//! [`RemoteTier`]: the `HostTier` an engine uses, over [`HostClient`]. The engine's thread
//! never waits on it: each fetch runs as a task on a tokio runtime, under a deadline, and
//! its answer waits in a queue until the engine takes it (the engine's waker is woken);
//! stores go to a bounded queue drained by one task. When the cache service is down,
//! slow, or forgot the lease, fetches answer "nothing held" and stores write nothing, the
//! connection is dropped, and a background task registers again — requests keep being
//! served from the device tier alone meanwhile.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::Waker;
use std::time::{Duration, Instant};

use pdmesh_kv::{Fetch, Fetched, HostTier, KvLayout, StorePage, StoreStats};
use tokio::sync::{Mutex, mpsc};

use crate::client::{ClientError, Corrupt, DataPlane, HostClient};

/// Told of each host page that fails its checksum on load (an incident report).
pub type OnCorrupt = Arc<dyn Fn(Corrupt) + Send + Sync>;

/// Fetches running at once; one more is answered as a miss at once.
const MAX_FETCHES: usize = 64;

/// Where and how to reach the cache service.
#[derive(Clone, Debug)]
pub struct TierConfig {
    /// e.g. `http://127.0.0.1:50063`
    pub url: String,
    pub worker_id: String,
    /// What the worker serves: its model's name and weights digest (the cache service
    /// names disk pages by it, and refuses a worker of another model).
    pub model: String,
    pub plane: DataPlane,
    /// Deadline of each call: a fetch still waiting for an answer (or for the connection)
    /// after it is a miss.
    pub call_timeout: Duration,
    /// Pause between registration attempts while disconnected.
    pub retry_every: Duration,
    /// The mesh credential.
    pub auth: pdmesh_tls::MeshAuth,
    /// Bytes of pages waiting to be stored at most; pages offered beyond it are dropped
    /// and counted.
    pub store_queue_bytes: usize,
}

impl TierConfig {
    /// A worker's defaults: calls bounded at 2 s, registration retried every second, a
    /// store queue of 256 MiB.
    pub fn new(
        url: impl Into<String>,
        worker_id: impl Into<String>,
        plane: DataPlane,
        auth: pdmesh_tls::MeshAuth,
    ) -> Self {
        Self {
            url: url.into(),
            worker_id: worker_id.into(),
            model: String::new(),
            plane,
            call_timeout: Duration::from_secs(2),
            retry_every: Duration::from_secs(1),
            auth,
            store_queue_bytes: 256 << 20,
        }
    }
}

/// What the tasks and the engine's side share.
struct Shared {
    client: Mutex<Option<HostClient>>,
    timeout: Duration,
    answers: std::sync::Mutex<Vec<Fetched>>,
    waker: std::sync::Mutex<Option<Waker>>,
    on_corrupt: OnceLock<OnCorrupt>,
    failures: AtomicU64,
    /// Registrations so far: each one may face a mirror that lost everything.
    registrations: AtomicU64,
    fetching: AtomicUsize,
    queued_bytes: AtomicUsize,
    queued_pages: AtomicU64,
    /// Whether a registered connection was up when last seen (read without waiting).
    connected: std::sync::atomic::AtomicBool,
    written_pages: AtomicU64,
    written_bytes: AtomicU64,
    written_nanos: AtomicU64,
    dropped_pages: AtomicU64,
}

impl Shared {
    /// A call's outcome; on failure or timeout the connection is dropped (its lease then
    /// expires at the service, releasing whatever it held).
    fn settle<T>(
        &self,
        r: Result<Result<T, ClientError>, tokio::time::error::Elapsed>,
        client: &mut Option<HostClient>,
    ) -> Option<T> {
        match r {
            Ok(Ok(v)) => return Some(v),
            Ok(Err(e)) => tracing::warn!(error = %e, "host tier call failed; reconnecting"),
            Err(_) => tracing::warn!("host tier call timed out; reconnecting"),
        }
        self.failures.fetch_add(1, Ordering::Relaxed);
        self.connected.store(false, Ordering::Relaxed);
        *client = None;
        None
    }

    fn answer(&self, f: Fetched) {
        self.answers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(f);
        if let Some(w) = &*self.waker.lock().unwrap_or_else(|e| e.into_inner()) {
            w.wake_by_ref();
        }
    }

    /// Finds and copies the leading pages of `f.hashes`; a miss on any failure.
    async fn fetch(&self, f: &Fetch) -> (Vec<Vec<u8>>, bool) {
        let miss = (Vec::new(), false);
        let Ok(mut guard) = tokio::time::timeout(self.timeout, self.client.lock()).await else {
            return miss;
        };
        let Some(c) = guard.as_mut().filter(|c| c.is_alive()) else {
            return miss;
        };
        let r = tokio::time::timeout(self.timeout, c.match_pages(&f.hashes)).await;
        let Some(found) = self.settle(r, &mut guard) else {
            return miss;
        };
        let Some(c) = guard.as_mut() else {
            return miss;
        };
        if found.is_empty() {
            return miss;
        }
        if found.len() < f.min_pages {
            // Too short to be worth a load: recomputed (all or nothing).
            let slots: Vec<u32> = found.iter().map(|p| p.slot).collect();
            let r = tokio::time::timeout(self.timeout, c.release(&slots)).await;
            self.settle(r, &mut guard);
            return miss;
        }
        let mut pages = vec![vec![0u8; c.page_bytes()]; found.len()];
        let mut dsts: Vec<&mut [u8]> = pages.iter_mut().map(Vec::as_mut_slice).collect();
        let r = tokio::time::timeout(self.timeout, c.load_into(&found, &mut dsts)).await;
        let Some(loaded) = self.settle(r, &mut guard) else {
            return miss;
        };
        if let (Some(bad), Some(f)) = (loaded.corrupt, self.on_corrupt.get()) {
            f(bad);
        }
        pages.truncate(loaded.pages);
        (pages, loaded.corrupt.is_some())
    }

    /// Writes one queued batch (nothing when disconnected).
    async fn store(&self, batch: &[StorePage]) {
        let t0 = Instant::now();
        let refs: Vec<(u64, u64, &[u8])> = batch
            .iter()
            .map(|p| (p.hash, p.parent, p.bytes.as_slice()))
            .collect();
        let mut guard = self.client.lock().await;
        if let Some(c) = guard.as_mut().filter(|c| c.is_alive()) {
            let bytes = c.page_bytes() as u64;
            let r = tokio::time::timeout(self.timeout, c.store(&refs)).await;
            if let Some(s) = self.settle(r, &mut guard) {
                self.written_pages
                    .fetch_add(s.written as u64, Ordering::Relaxed);
                self.written_bytes
                    .fetch_add(s.written as u64 * bytes, Ordering::Relaxed);
            }
        }
        self.written_nanos
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

/// See the module docs.
pub struct RemoteTier {
    rt: tokio::runtime::Handle,
    shared: Arc<Shared>,
    stores: mpsc::UnboundedSender<Vec<StorePage>>,
    store_queue_bytes: usize,
    tasks: [tokio::task::JoinHandle<()>; 2],
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier")
            .field("timeout", &self.shared.timeout)
            .finish()
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl RemoteTier {
    /// Starts connecting in the background (on `rt`); the tier is usable at once and
    /// serves nothing until the first registration succeeds.
    pub fn start(rt: tokio::runtime::Handle, cfg: TierConfig, layout: KvLayout) -> Self {
        let shared = Arc::new(Shared {
            client: Mutex::default(),
            timeout: cfg.call_timeout,
            answers: Default::default(),
            waker: Default::default(),
            on_corrupt: OnceLock::new(),
            failures: AtomicU64::default(),
            registrations: AtomicU64::default(),
            fetching: AtomicUsize::default(),
            queued_bytes: AtomicUsize::default(),
            queued_pages: AtomicU64::default(),
            connected: Default::default(),
            written_pages: AtomicU64::default(),
            written_bytes: AtomicU64::default(),
            written_nanos: AtomicU64::default(),
            dropped_pages: AtomicU64::default(),
        });
        let store_queue_bytes = cfg.store_queue_bytes;
        let reconnect = rt.spawn(reconnect(shared.clone(), cfg, layout));
        let (stores, mut queue) = mpsc::unbounded_channel::<Vec<StorePage>>();
        let writer = {
            let shared = shared.clone();
            rt.spawn(async move {
                while let Some(batch) = queue.recv().await {
                    shared.store(&batch).await;
                    let bytes = batch.iter().map(|p| p.bytes.len()).sum();
                    shared.queued_bytes.fetch_sub(bytes, Ordering::Relaxed);
                    shared
                        .queued_pages
                        .fetch_sub(batch.len() as u64, Ordering::Relaxed);
                }
            })
        };
        Self {
            rt,
            shared,
            stores,
            store_queue_bytes,
            tasks: [reconnect, writer],
        }
    }

    /// Calls `f` with each page that fails its checksum on load.
    pub fn on_corrupt(self, f: OnCorrupt) -> Self {
        // Set once, before the tier is handed to an engine.
        let _ = self.shared.on_corrupt.set(f);
        self
    }

    /// Calls that failed or timed out (each dropped the connection).
    pub fn failures(&self) -> u64 {
        self.shared.failures.load(Ordering::Relaxed)
    }

    /// Whether a registered connection is up now. Waits for the connection's lock: for
    /// tests and tools that wait for the tier before they start, never for an engine.
    pub fn connected(&self) -> bool {
        self.rt.block_on(async {
            self.shared
                .client
                .lock()
                .await
                .as_ref()
                .is_some_and(HostClient::is_alive)
        })
    }
}

/// Registers whenever the connection is down, every `cfg.retry_every`.
async fn reconnect(shared: Arc<Shared>, cfg: TierConfig, layout: KvLayout) {
    let mut warned = false;
    loop {
        let connected = shared
            .client
            .lock()
            .await
            .as_ref()
            .is_some_and(HostClient::is_alive);
        shared.connected.store(connected, Ordering::Relaxed);
        if !connected {
            let attempt = tokio::time::timeout(
                cfg.call_timeout.max(Duration::from_secs(1)),
                HostClient::connect(
                    &cfg.url,
                    (&cfg.worker_id, &cfg.model),
                    &layout,
                    cfg.plane,
                    &cfg.auth,
                ),
            )
            .await;
            match attempt {
                Ok(Ok(c)) => {
                    tracing::info!(url = %cfg.url, lease = %c.lease(), plane = ?cfg.plane, "host tier connected");
                    *shared.client.lock().await = Some(c);
                    shared.connected.store(true, Ordering::Relaxed);
                    shared.registrations.fetch_add(1, Ordering::Relaxed);
                    warned = false;
                }
                Ok(Err(ClientError::Rpc(s))) if s.code() == tonic::Code::FailedPrecondition => {
                    // Another layout: retrying cannot help. Say so once, loudly.
                    tracing::error!(url = %cfg.url, error = %s.message(), "the cache service refused this worker; serving without the host tier");
                    return;
                }
                Ok(Err(e)) if !warned => {
                    tracing::warn!(url = %cfg.url, error = %e, "host tier unavailable; serving from the device tier, retrying");
                    warned = true;
                }
                Err(_) if !warned => {
                    tracing::warn!(url = %cfg.url, "host tier registration timed out; retrying");
                    warned = true;
                }
                _ => {}
            }
        }
        tokio::time::sleep(cfg.retry_every).await;
    }
}

impl HostTier for RemoteTier {
    fn fetch(&mut self, f: Fetch) {
        let shared = self.shared.clone();
        if shared.fetching.fetch_add(1, Ordering::Relaxed) >= MAX_FETCHES {
            shared.fetching.fetch_sub(1, Ordering::Relaxed);
            shared.answer(Fetched {
                ticket: f.ticket,
                ..Fetched::default()
            });
            return;
        }
        self.rt.spawn(async move {
            let t0 = Instant::now();
            let (pages, corrupt) = shared.fetch(&f).await;
            shared.fetching.fetch_sub(1, Ordering::Relaxed);
            shared.answer(Fetched {
                ticket: f.ticket,
                pages,
                corrupt,
                seconds: t0.elapsed().as_secs_f64(),
            });
        });
    }

    fn take_fetched(&mut self) -> Vec<Fetched> {
        std::mem::take(
            &mut *self
                .shared
                .answers
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }

    fn has_fetched(&self) -> bool {
        !self
            .shared
            .answers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    fn set_waker(&mut self, waker: Waker) {
        *self.shared.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(waker);
    }

    fn store(&mut self, pages: Vec<StorePage>) -> bool {
        if pages.is_empty() {
            return true;
        }
        let bytes: usize = pages.iter().map(|p| p.bytes.len()).sum();
        let queued = &self.shared.queued_bytes;
        if queued.fetch_add(bytes, Ordering::Relaxed) + bytes > self.store_queue_bytes {
            queued.fetch_sub(bytes, Ordering::Relaxed);
            self.shared
                .dropped_pages
                .fetch_add(pages.len() as u64, Ordering::Relaxed);
            return false;
        }
        let n = pages.len() as u64;
        self.shared.queued_pages.fetch_add(n, Ordering::Relaxed);
        if self.stores.send(pages).is_err() {
            // The writer is gone (the runtime is shutting down).
            queued.fetch_sub(bytes, Ordering::Relaxed);
            self.shared.queued_pages.fetch_sub(n, Ordering::Relaxed);
            self.shared.dropped_pages.fetch_add(n, Ordering::Relaxed);
            return false;
        }
        true
    }

    fn accepts_stores(&self) -> bool {
        self.shared.connected.load(Ordering::Relaxed)
    }

    fn store_stats(&self) -> StoreStats {
        let s = &self.shared;
        StoreStats {
            written_pages: s.written_pages.load(Ordering::Relaxed),
            written_bytes: s.written_bytes.load(Ordering::Relaxed),
            written_seconds: s.written_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            dropped_pages: s.dropped_pages.load(Ordering::Relaxed),
            queued_pages: s.queued_pages.load(Ordering::Relaxed),
        }
    }

    fn generation(&self) -> u64 {
        self.shared.registrations.load(Ordering::Relaxed)
    }
}

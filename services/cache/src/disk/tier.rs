//! The disk tier at run time, around the [`DiskStore`]: the folder is locked at start, the
//! store opens (its index rebuilt) on a blocking thread once the first worker fixed the
//! layout and model, evicted host pages are spilled through a bounded queue by one
//! blocking writer, and promotions read pages on blocking threads, a few at once. No page
//! is read or written under the store's lock or the cache state's: the store's lock
//! guards the index (and removing the files it evicts or discards).
//!
//! A write that fails (a full or unwritable disk) degrades the tier: spills stop, with a
//! WARN, the `degraded` figure and an incident report, and one is tried again after
//! [`RETRY_AFTER`]; pages already on disk still load (every load is checked).

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Discard, DiskError, DiskLock, DiskStore, Load};

/// Pages the disk tier stored or removed (the cache state turns them into KV events).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiskEvent {
    Stored(Vec<u64>),
    Removed(Vec<u64>),
}

/// Pages named in one event at most (9 bytes each on the wire).
const EVENT_BATCH: usize = 4096;

/// A degraded tier tries one spill again after this long.
pub const RETRY_AFTER: Duration = Duration::from_secs(30);

/// How the disk tier runs.
#[derive(Clone, Debug)]
pub struct DiskConfig {
    pub dir: PathBuf,
    pub capacity: u64,
    /// Bytes of evicted pages waiting to be written at most; more are dropped (counted).
    pub spill_queue_bytes: usize,
    /// Page files read at once.
    pub readers: usize,
}

/// A page to write: its hash, the checksum it was committed with, its bytes.
struct Spill {
    hash: u64,
    checksum: u64,
    data: Vec<u8>,
}

#[derive(Default)]
struct Spills {
    queue: VecDeque<Spill>,
    bytes: usize,
    writing: bool,
}

/// The tier's counters since start.
#[derive(Default)]
struct Counters {
    spilled: AtomicU64,
    spill_dropped: AtomicU64,
    promoted: AtomicU64,
    hits: AtomicU64,
    late: AtomicU64,
    evicted: AtomicU64,
    written_bytes: AtomicU64,
    read_bytes: AtomicU64,
    promote_nanos: AtomicU64,
}

/// The tier's figures now (the Stats call's `disk`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DiskFigures {
    pub serving: bool,
    pub degraded: bool,
    pub pages: u64,
    pub bytes: u64,
    pub capacity: u64,
    pub spilled: u64,
    pub spill_dropped: u64,
    pub promoted: u64,
    pub hits: u64,
    pub late: u64,
    pub evicted: u64,
    pub written_bytes: u64,
    pub read_bytes: u64,
    pub promote_seconds: f64,
    pub discards: BTreeMap<Discard, u64>,
}

pub struct DiskTier {
    cfg: DiskConfig,
    /// The folder's lock until the store opens on it.
    lock: Mutex<Option<DiskLock>>,
    store: Mutex<Option<DiskStore>>,
    /// Set once the store opened (or failed to).
    opened: AtomicBool,
    spills: Mutex<Spills>,
    /// When the last write failed; `None` while healthy.
    degraded: Mutex<Option<Instant>>,
    events: Mutex<Vec<DiskEvent>>,
    incidents: Mutex<Vec<pdmesh_incident::Incident>>,
    discards: Mutex<BTreeMap<Discard, u64>>,
    counters: Counters,
    readers: tokio::sync::Semaphore,
    rt: tokio::runtime::Handle,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier").field("cfg", &self.cfg).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl DiskTier {
    /// Takes the folder: refused when another cache service holds it or other users may
    /// enter it (a setup to fix, not a disk fault); a folder that cannot be made or
    /// locked (a read-only or failed disk) gives a degraded tier, which never opens.
    /// Must be called inside a tokio runtime, which runs the tier's I/O.
    pub fn new(cfg: DiskConfig) -> Result<Arc<DiskTier>, DiskError> {
        let taken = match DiskLock::take(&cfg.dir) {
            Ok(l) => Some(l),
            Err(e @ DiskError::Io { .. }) => {
                let tier = DiskTier::with(cfg, None);
                tier.degrade(&e, "disk open");
                tier.opened.store(true, Ordering::Release);
                return Ok(tier);
            }
            Err(e) => return Err(e),
        };
        Ok(DiskTier::with(cfg, taken))
    }

    fn with(cfg: DiskConfig, taken: Option<DiskLock>) -> Arc<DiskTier> {
        Arc::new(DiskTier {
            readers: tokio::sync::Semaphore::new(cfg.readers.max(1)),
            cfg,
            lock: Mutex::new(taken),
            store: Mutex::new(None),
            opened: AtomicBool::new(false),
            spills: Mutex::default(),
            degraded: Mutex::new(None),
            events: Mutex::default(),
            incidents: Mutex::default(),
            discards: Mutex::default(),
            counters: Counters::default(),
            rt: tokio::runtime::Handle::current(),
        })
    }

    pub fn dir(&self) -> &std::path::Path {
        &self.cfg.dir
    }

    /// Opens the store for pages named by `identity` (the layout's fingerprint and the
    /// model's) on a blocking thread, rebuilding its index; files of another identity or
    /// unsound are discarded, counted by reason. Once only; later calls do nothing.
    pub fn open(self: &Arc<Self>, identity: u64) {
        let Some(taken) = lock(&self.lock).take() else {
            return;
        };
        let me = self.clone();
        self.rt.spawn_blocking(move || {
            let t0 = Instant::now();
            match DiskStore::open_locked(taken, identity, me.cfg.capacity) {
                Ok((store, discarded)) => {
                    let hashes = store.hashes();
                    tracing::info!(dir = %me.cfg.dir.display(), pages = hashes.len(), bytes = store.used(),
                        ?discarded, seconds = t0.elapsed().as_secs_f64(), "disk tier open");
                    me.discarded_at_open(&discarded);
                    // In batches: one event per page of a large tier would be too many,
                    // one for all of them too large a message for a router.
                    for batch in hashes.chunks(EVENT_BATCH) {
                        me.event(DiskEvent::Stored(batch.to_vec()));
                    }
                    *lock(&me.store) = Some(store);
                }
                Err(e) => me.degrade(&e, "disk open"),
            }
            me.opened.store(true, Ordering::Release);
        });
    }

    /// Counts what the rebuild discarded; files damaged (not another layout's, not a write
    /// a crash cut short) are a WARN and one `checksum` report at stage `disk open`.
    fn discarded_at_open(&self, discarded: &BTreeMap<Discard, u64>) {
        for (reason, n) in discarded {
            *lock(&self.discards).entry(*reason).or_default() += n;
        }
        let damaged: Vec<(Discard, u64)> = discarded
            .iter()
            .filter(|(r, _)| !matches!(r, Discard::ForeignLayout | Discard::Unfinished))
            .map(|(r, n)| (*r, *n))
            .collect();
        if damaged.is_empty() {
            return;
        }
        let total: u64 = damaged.iter().map(|(_, n)| n).sum();
        tracing::warn!(dir = %self.cfg.dir.display(), ?damaged, "disk tier: damaged page files discarded at start, never served");
        let mut i = pdmesh_incident::Incident::new(
            pdmesh_incident::Kind::Checksum,
            format!(
                "The disk tier in {} held {total} damaged page file(s) at start (cut short, \
                 garbled, failing their checksum or under another page's name): each was \
                 removed and is a miss, never served. A disk or file system fault, or \
                 someone writing into the folder.",
                self.cfg.dir.display()
            ),
            pdmesh_incident::Place {
                stage: "disk open".into(),
                ..Default::default()
            },
        );
        for (r, n) in damaged {
            i.details
                .insert(format!("discarded {}", r.name()), n.to_string());
        }
        lock(&self.incidents).push(i);
    }

    /// Whether the store is open (a promotion can find pages).
    pub fn serving(&self) -> bool {
        lock(&self.store).is_some()
    }

    /// Whether the store has opened or failed to (its index is rebuilt, or never will be).
    pub fn opened(&self) -> bool {
        self.opened.load(Ordering::Acquire)
    }

    /// Whether page `hash` is on disk (or being written there).
    pub fn contains(&self, hash: u64) -> bool {
        lock(&self.store).as_ref().is_some_and(|s| s.contains(hash))
    }

    /// Queues an evicted page's bytes for the writer; dropped (counted) when the queue is
    /// full, the store is not open, or the tier is degraded and no retry is due.
    pub fn spill(self: &Arc<Self>, hash: u64, checksum: u64, data: Vec<u8>) {
        if !self.serving() || self.contains(hash) {
            return;
        }
        {
            let mut d = lock(&self.degraded);
            if let Some(at) = *d {
                if at.elapsed() < RETRY_AFTER {
                    self.counters.spill_dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                // One try; a failure stamps it again.
                *d = Some(Instant::now());
            }
        }
        let mut q = lock(&self.spills);
        if q.bytes + data.len() > self.cfg.spill_queue_bytes {
            self.counters.spill_dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        q.bytes += data.len();
        q.queue.push_back(Spill {
            hash,
            checksum,
            data,
        });
        if !q.writing {
            q.writing = true;
            let me = self.clone();
            self.rt.spawn_blocking(move || me.write_queued());
        }
    }

    /// The writer: writes queued pages until the queue is empty.
    fn write_queued(&self) {
        loop {
            let next = {
                let mut q = lock(&self.spills);
                match q.queue.pop_front() {
                    Some(s) => {
                        q.bytes -= s.data.len();
                        s
                    }
                    None => {
                        q.writing = false;
                        return;
                    }
                }
            };
            self.write(next);
        }
    }

    /// Writes one page now (blocking); false when the tier refused it or the write failed.
    fn write(&self, s: Spill) -> bool {
        // Checked before the store's lock: the mirror's copy must still match its checksum.
        let begun = if pdmesh_kv::page_checksum(&s.data) != s.checksum {
            Err(DiskError::Corrupt { hash: s.hash })
        } else {
            let mut g = lock(&self.store);
            let Some(store) = g.as_mut() else {
                return false;
            };
            store.to_write(s.hash, s.checksum, s.data.len())
        };
        let w = match begun {
            Ok((Some(w), gone)) => {
                self.evicted(gone);
                w
            }
            Ok((None, gone)) => {
                self.evicted(gone);
                return true;
            }
            Err(e @ DiskError::Corrupt { .. }) => {
                // The mirror's copy no longer matches its checksum: never persisted.
                tracing::warn!(error = %e, "a page evicted from the host mirror was not spilled");
                self.counters.spill_dropped.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            Err(e) => {
                self.counters.spill_dropped.fetch_add(1, Ordering::Relaxed);
                self.degrade(&e, "disk spill");
                return false;
            }
        };
        let written = w.write(&s.data);
        if let Some(store) = lock(&self.store).as_mut() {
            store.finish_write(w, written.is_ok());
        }
        match written {
            Ok(()) => {
                self.counters.spilled.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .written_bytes
                    .fetch_add(s.data.len() as u64, Ordering::Relaxed);
                if lock(&self.degraded).take().is_some() {
                    tracing::info!(dir = %self.cfg.dir.display(), "disk tier writes again");
                }
                self.event(DiskEvent::Stored(vec![s.hash]));
                true
            }
            Err(e) => {
                self.counters.spill_dropped.fetch_add(1, Ordering::Relaxed);
                self.degrade(&e, "disk spill");
                false
            }
        }
    }

    fn evicted(&self, gone: Vec<u64>) {
        if !gone.is_empty() {
            self.counters
                .evicted
                .fetch_add(gone.len() as u64, Ordering::Relaxed);
            self.event(DiskEvent::Removed(gone));
        }
    }

    /// Stops spilling until a retry succeeds: WARN, the `degraded` figure and an incident.
    fn degrade(&self, e: &DiskError, stage: &str) {
        let first = lock(&self.degraded).replace(Instant::now()).is_none();
        let dropped = {
            let mut q = lock(&self.spills);
            let n = q.queue.len() as u64;
            q.queue.clear();
            q.bytes = 0;
            n
        };
        self.counters
            .spill_dropped
            .fetch_add(dropped, Ordering::Relaxed);
        if !first {
            return;
        }
        tracing::warn!(error = %e, dir = %self.cfg.dir.display(), "disk tier degraded: no page is spilled until a write succeeds again; requests go on without it");
        let mut i = pdmesh_incident::Incident::new(
            pdmesh_incident::Kind::DiskDegraded,
            format!(
                "The disk tier in {} stopped taking pages: {e}. Requests go on without it \
                 (pages evicted from the host mirror are recomputed when needed); pages \
                 already on disk still load, each checked. A write is tried again every {} s.",
                self.cfg.dir.display(),
                RETRY_AFTER.as_secs()
            ),
            pdmesh_incident::Place {
                stage: stage.into(),
                ..Default::default()
            },
        );
        i.details.insert("error".into(), e.to_string());
        lock(&self.incidents).push(i);
    }

    /// Reads page `hash` on a blocking thread (a few at once), checked whole: its bytes
    /// and checksum, or `None` (not on disk, or unsound: discarded, counted, reported).
    pub async fn load(self: &Arc<Self>, hash: u64) -> Option<(Vec<u8>, u64)> {
        let _permit = self.readers.acquire().await.ok()?;
        let me = self.clone();
        self.rt
            .spawn_blocking(move || me.load_now(hash))
            .await
            .ok()
            .flatten()
    }

    fn load_now(&self, hash: u64) -> Option<(Vec<u8>, u64)> {
        let f = lock(&self.store).as_ref()?.to_load(hash)?;
        let read = f.read();
        let found = lock(&self.store).as_mut()?.finish_load(hash, read);
        match found {
            Ok(Load::Hit(data)) => {
                self.counters
                    .read_bytes
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                let sum = pdmesh_kv::page_checksum(&data);
                Some((data, sum))
            }
            Ok(Load::Miss) => None,
            Ok(Load::Discarded(reason)) => {
                self.discarded(hash, reason);
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "disk tier: forgetting a page");
                None
            }
        }
    }

    /// A page file found unsound at load: counted, reported as a `checksum` incident at
    /// stage `disk load`, gone from the routers' view.
    fn discarded(&self, hash: u64, reason: Discard) {
        *lock(&self.discards).entry(reason).or_default() += 1;
        tracing::warn!(
            page = format!("{hash:016x}"),
            reason = reason.name(),
            "disk tier page discarded at load: a miss, never served"
        );
        let mut i = pdmesh_incident::Incident::new(
            pdmesh_incident::Kind::Checksum,
            format!(
                "A page file of the disk tier failed its check at load ({}): it was removed \
                 and treated as a miss, so the prefix is computed again; nothing of it \
                 reached the host mirror.",
                reason.name()
            ),
            pdmesh_incident::Place {
                stage: "disk load".into(),
                ..Default::default()
            },
        );
        i.pages.push(pdmesh_incident::PageCheck {
            page: format!("{hash:016x}"),
            expected: "a sound page of this layout and model".into(),
            found: reason.name().into(),
        });
        lock(&self.incidents).push(i);
        self.event(DiskEvent::Removed(vec![hash]));
    }

    /// Writes each page of `pages` (hash, checksum, bytes) not yet on disk now, until
    /// `deadline` (at a graceful stop: the host mirror's pages outlive the restart).
    pub fn flush(&self, pages: impl Iterator<Item = (u64, u64, Vec<u8>)>, deadline: Instant) {
        // The queue first: it holds what was evicted earlier.
        while let Some(s) = {
            let mut q = lock(&self.spills);
            q.queue.pop_front().inspect(|s| q.bytes -= s.data.len())
        } {
            if Instant::now() >= deadline || lock(&self.degraded).is_some() {
                return;
            }
            self.write(s);
        }
        for (hash, checksum, data) in pages {
            if Instant::now() >= deadline || lock(&self.degraded).is_some() {
                return;
            }
            if !self.contains(hash) {
                self.write(Spill {
                    hash,
                    checksum,
                    data,
                });
            }
        }
    }

    /// A promotion's outcome: the page reached the host mirror after `took`, or it did not.
    pub fn promoted(&self, took: Duration) {
        self.counters.promoted.fetch_add(1, Ordering::Relaxed);
        self.counters
            .promote_nanos
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Pages promoted from disk that a match handed out.
    pub fn hits(&self, pages: usize) {
        self.counters
            .hits
            .fetch_add(pages as u64, Ordering::Relaxed);
    }

    /// A match stopped waiting for its promotions at their deadline: `pages` were not in
    /// (each a miss for it).
    pub fn late(&self, pages: usize) {
        self.counters
            .late
            .fetch_add(pages as u64, Ordering::Relaxed);
    }

    pub fn take_events(&self) -> Vec<DiskEvent> {
        std::mem::take(&mut *lock(&self.events))
    }

    pub fn take_incidents(&self) -> Vec<pdmesh_incident::Incident> {
        std::mem::take(&mut *lock(&self.incidents))
    }

    fn event(&self, e: DiskEvent) {
        lock(&self.events).push(e);
    }

    pub fn figures(&self) -> DiskFigures {
        let c = &self.counters;
        let (pages, bytes) = lock(&self.store)
            .as_ref()
            .map_or((0, 0), |s| (s.pages() as u64, s.used()));
        DiskFigures {
            serving: self.serving(),
            degraded: lock(&self.degraded).is_some(),
            pages,
            bytes,
            capacity: self.cfg.capacity,
            spilled: c.spilled.load(Ordering::Relaxed),
            spill_dropped: c.spill_dropped.load(Ordering::Relaxed),
            promoted: c.promoted.load(Ordering::Relaxed),
            hits: c.hits.load(Ordering::Relaxed),
            late: c.late.load(Ordering::Relaxed),
            evicted: c.evicted.load(Ordering::Relaxed),
            written_bytes: c.written_bytes.load(Ordering::Relaxed),
            read_bytes: c.read_bytes.load(Ordering::Relaxed),
            promote_seconds: c.promote_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            discards: lock(&self.discards).clone(),
        }
    }
}

//! The cache service's bookkeeping, free of gRPC: the `State` every call goes through and
//! the glue between its parts, each in its own file. Every method takes `now` so tests
//! drive time.

pub(crate) mod disk;
mod expiry;
pub(crate) mod index;
pub(crate) mod leases;
mod peer_traffic;
pub(crate) use peer_traffic::PageRefused;
pub(crate) mod relays;
mod rooms;
pub(crate) mod slots;
pub(crate) mod stats;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdmesh_cache_client::Lease;
use pdmesh_kv::KvLayout;

use crate::rooms::{RoomDeadlines, RoomError, Rooms};
use leases::Holder;
use pdmesh_cache_client::mirror::Mirror;
use relays::{DroppedRelay, Relay};
use slots::{MirrorSize, Slot};
use stats::{RoomStats, Stats};

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error(
        "this cache service is draining (shutting down): it opens no new room; try another host"
    )]
    Draining,
    #[error("KV layout mismatch: the host mirror holds {ours}; this worker has {theirs}")]
    LayoutMismatch { ours: String, theirs: String },
    #[error("invalid KV layout: {0}")]
    BadLayout(#[from] pdmesh_cache_client::wire::WireLayoutError),
    // Leases are capabilities: no message names one.
    #[error("this lease is unknown or expired: register again")]
    UnknownLease(Lease),
    #[error("slot {slot} is not {what} by this lease")]
    NotHeld { slot: u32, what: &'static str },
    #[error("a page is {want} bytes, got {got}")]
    WrongSize { want: usize, got: usize },
    #[error("slot {0} appears twice in one request")]
    DuplicateSlot(u32),
    #[error("the host mirror size {size:?} holds no page of {page_bytes} bytes")]
    TooSmall { size: MirrorSize, page_bytes: usize },
    #[error("host mirror file: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Room(#[from] RoomError),
    #[error("the host mirror has {free} pages to spare now; the transfer needs {want}")]
    MirrorFull { want: usize, free: usize },
    #[error("invalid room call: {0}")]
    BadRoomCall(String),
    #[error(
        "KV layout mismatch between hosts: this host's mirror holds {ours}; the sender's host has {theirs}"
    )]
    PeerLayoutMismatch { ours: String, theirs: String },
    #[error(
        "no worker has registered on this host yet, so it has no KV layout to receive pages in"
    )]
    NoLayoutYet,
    #[error(
        "model mismatch: this host's cache holds pages of {ours:?}; this worker serves {theirs:?}"
    )]
    ModelMismatch { ours: String, theirs: String },
}

/// Which tier an event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// The host mirror.
    Host,
    /// The disk tier below it.
    Disk,
}

/// Pages stored in or removed from the mirror or the disk tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Stored {
        parent: u64,
        hashes: Vec<u64>,
        tier: Tier,
    },
    Removed {
        hashes: Vec<u64>,
        tier: Tier,
    },
}

/// The cache service's bookkeeping: the mirror's slots, the index of resident pages by
/// chained hash, pins and reservations owned by leases, LRU eviction of unpinned pages,
/// rooms and relays, and the KV events.
#[derive(Debug)]
pub struct State {
    size: MirrorSize,
    /// Where the mirror file goes; `None`: [`pdmesh_cache_client::mirror::default_dir`].
    dir: Option<PathBuf>,
    ttl: Duration,
    layout: Option<Arc<KvLayout>>,
    mirror: Option<Arc<Mirror>>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Resident pages by hash, and hashes being written (reserved) so two writers do not
    /// store one page twice.
    index: HashMap<u64, u32>,
    /// Resident, unpinned pages by last use: the eviction order.
    lru: BTreeSet<(u64, u32)>,
    leases: HashMap<Lease, Holder>,
    tick: u64,
    stats: Stats,
    events: Vec<Event>,
    rooms: Rooms,
    room_stats: RoomStats,
    /// Bumped whenever a room changes, so waiters look again.
    rooms_version: u64,
    relays: HashMap<u64, Relay>,
    dropped_relays: Vec<DroppedRelay>,
    /// Set at shutdown: no new room or relay opens; those under way finish.
    draining: bool,
    /// Pages a peer wrote into each room transferring from it: its commit must cover all.
    peer_pages: HashMap<u64, usize>,
    /// Failures seen under the lock, for the service to file as incident reports
    /// (outside it: files are written there).
    incidents: Vec<pdmesh_incident::Incident>,
    /// What the first worker serves (with the layout, it names disk pages).
    model: Option<String>,
    /// The disk tier below the mirror, when the service has one.
    disk: Option<Arc<crate::disk::tier::DiskTier>>,
    /// Slots being promoted from the disk tier now (`Slot::Promoting`).
    promoting: usize,
}

impl State {
    #[cfg(test)]
    pub fn new(size: MirrorSize, dir: Option<PathBuf>, ttl: Duration) -> Self {
        Self::with_rooms(size, dir, ttl, RoomDeadlines::default())
    }

    pub fn with_rooms(
        size: MirrorSize,
        dir: Option<PathBuf>,
        ttl: Duration,
        deadlines: RoomDeadlines,
    ) -> Self {
        Self {
            size,
            dir,
            ttl,
            layout: None,
            mirror: None,
            slots: Vec::new(),
            free: Vec::new(),
            index: HashMap::new(),
            lru: BTreeSet::new(),
            leases: HashMap::new(),
            tick: 0,
            stats: Stats::default(),
            events: Vec::new(),
            rooms: Rooms::new(deadlines),
            room_stats: RoomStats::default(),
            rooms_version: 0,
            relays: HashMap::new(),
            dropped_relays: Vec::new(),
            draining: false,
            peer_pages: HashMap::new(),
            incidents: Vec::new(),
            model: None,
            disk: None,
            promoting: 0,
        }
    }

    /// With a disk tier below the mirror.
    pub fn with_disk(mut self, disk: Option<Arc<crate::disk::tier::DiskTier>>) -> Self {
        self.disk = disk;
        self
    }

    /// Changes whenever any room changed.
    pub fn rooms_version(&self) -> u64 {
        self.rooms_version
    }

    /// The mirror, once the first worker registered.
    pub fn mirror(&self) -> Option<Arc<Mirror>> {
        self.mirror.clone()
    }

    /// Events since the last call, in order (the disk tier's after the mirror's).
    pub fn take_events(&mut self) -> Vec<Event> {
        let mut out = std::mem::take(&mut self.events);
        if let Some(d) = &self.disk {
            use crate::disk::tier::DiskEvent;
            out.extend(d.take_events().into_iter().map(|e| match e {
                DiskEvent::Stored(hashes) => Event::Stored {
                    parent: 0,
                    hashes,
                    tier: Tier::Disk,
                },
                DiskEvent::Removed(hashes) => Event::Removed {
                    hashes,
                    tier: Tier::Disk,
                },
            }));
        }
        out
    }

    pub fn layout(&self) -> Option<&Arc<KvLayout>> {
        self.layout.as_ref()
    }

    /// The failures seen since the last call, to file as incident reports.
    pub fn take_incidents(&mut self) -> Vec<pdmesh_incident::Incident> {
        let mut out = std::mem::take(&mut self.incidents);
        if let Some(d) = &self.disk {
            out.extend(d.take_incidents());
        }
        out
    }

    /// From now on no new room or relay opens (the other side of a room already open
    /// still joins it): the service is shutting down.
    pub fn drain(&mut self) {
        self.draining = true;
    }

    /// Rooms whose hand-over has not ended, and relays carrying one to another host.
    pub fn busy(&self, now: Instant) -> usize {
        self.rooms.under_way(now).len() + self.relays.len()
    }
}

#[cfg(test)]
mod tests;

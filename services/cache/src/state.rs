//! The cache service's bookkeeping, free of gRPC: the mirror's slots, the index of
//! resident pages by chained hash, pins and reservations owned by leases, LRU eviction of
//! unpinned pages, and the KV events. Every method takes `now` so tests drive time.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdmesh_cache_client::Lease;
use pdmesh_kv::KvLayout;
use pdmesh_telemetry::labels::RoomAbort;

use crate::mirror::Mirror;
use crate::rooms::{
    Aux, Released, RoomDeadlines, RoomError, RoomPage, RoomState, Rooms, Side, Stuck,
};

/// How big the host mirror is: bytes, or tokens of the registered layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MirrorSize {
    Bytes(u64),
    Tokens(u64),
}

impl std::str::FromStr for MirrorSize {
    type Err = String;

    /// `4GiB`, `512MiB`, `1000000` (bytes), `2GB`, `100000tokens`.
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let n: u64 = num
            .parse()
            .map_err(|_| format!("{s:?}: expected a number with an optional unit"))?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "tokens" | "token" => return Ok(Self::Tokens(n)),
            "" | "b" => 1,
            "kb" => 1000,
            "mb" => 1000 * 1000,
            "gb" => 1000 * 1000 * 1000,
            "kib" => 1 << 10,
            "mib" => 1 << 20,
            "gib" => 1 << 30,
            u => {
                return Err(format!(
                    "{s:?}: unknown unit {u:?} (B, KB, MB, GB, KiB, MiB, GiB, tokens)"
                ));
            }
        };
        n.checked_mul(mult)
            .map(Self::Bytes)
            .ok_or_else(|| format!("{s:?} is too large"))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error(
        "this cache service is draining (shutting down): it opens no new room; try another host"
    )]
    Draining,
    #[error("KV layout mismatch: the host mirror holds {ours}; this worker has {theirs}")]
    LayoutMismatch { ours: String, theirs: String },
    #[error("invalid KV layout: {0}")]
    BadLayout(String),
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
}

/// What a worker needs to use the mirror.
#[derive(Clone, Debug)]
pub struct Registration {
    pub lease: Lease,
    pub lease_ttl: Duration,
    pub shm_path: PathBuf,
    pub page_bytes: usize,
    pub total_pages: usize,
    pub layout: Arc<KvLayout>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRef {
    pub hash: u64,
    pub slot: u32,
    pub checksum: u64,
}

#[derive(Clone, Debug)]
pub struct CommitPage {
    pub hash: u64,
    pub slot: u32,
    pub checksum: u64,
    /// The bytes, on the grpc data plane; `None` when written through shared memory.
    pub data: Option<Vec<u8>>,
    pub parent: u64,
}

/// Pages stored in or removed from the mirror.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Stored { parent: u64, hashes: Vec<u64> },
    Removed { hashes: Vec<u64> },
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub total_pages: usize,
    pub used_pages: usize,
    pub pinned_pages: usize,
    pub leases: usize,
    pub evicted_pages: u64,
    pub checksum_failures: u64,
    pub expired_leases: u64,
}

/// Room counters since the service started.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoomStats {
    /// Rooms now by state, with the oldest one's age.
    pub census: Vec<(RoomState, usize, Duration)>,
    /// Rooms under way longer than each of `rooms::AGE_THRESHOLDS` in their state.
    pub older_than: Vec<(f64, usize)>,
    /// Rooms failed by a deadline, by the state they were stuck in.
    pub timeouts: HashMap<RoomState, u64>,
    /// Rooms aborted, by who or what.
    pub aborts: HashMap<RoomAbort, u64>,
    pub finished: u64,
    pub transfer_pages: u64,
    pub transfer_bytes: u64,
    pub room_slots: usize,
    pub quarantined_slots: usize,
    pub stalls: u64,
    pub late_writes_rejected: u64,
    pub peer: PeerStats,
}

/// Traffic with other hosts' cache services, since the service started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerStats {
    /// Peers refused for another KV layout (registration or transport handshake).
    pub layout_refusals: u64,
    pub pages_received: u64,
    pub bytes_received: u64,
    pub pages_sent: u64,
    pub bytes_sent: u64,
    pub transfer_failures: u64,
    /// Pages receivers held already, so they did not travel.
    pub held_pages_skipped: u64,
}

/// A room whose home is another host: this service relays its calls there and lends its
/// sender slots of this mirror to write into until the pages have crossed.
#[derive(Debug)]
struct Relay {
    lease: Lease,
    home: String,
    /// This service's lease at the home, the one the room was opened there with (none
    /// until the home answered): the room lives there only as long as that lease.
    link: Option<Lease>,
    /// This mirror's slots the sender writes (empty until it starts).
    slots: Vec<u32>,
    /// The home host's slots for the same pages, in order.
    remote_slots: Vec<u32>,
    /// When the relay was opened, or started transferring.
    since: Instant,
}

/// A relayed room this service gave up on (its deadline, or its sender's lease ended):
/// the home host must hear of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DroppedRelay {
    pub room: u64,
    pub home: String,
    pub reason: String,
}

/// What a relayed room's commit needs: the pages' bytes are read from `mirror`.
#[derive(Debug)]
pub struct RelayCommit {
    pub mirror: Arc<Mirror>,
    pub slots: Vec<u32>,
    pub remote_slots: Vec<u32>,
}

#[derive(Debug)]
enum Slot {
    Free,
    Reserved {
        lease: Lease,
        hash: u64,
    },
    Resident {
        hash: u64,
        checksum: u64,
        pins: u32,
        last_use: u64,
    },
    /// Held by a room for its transfer.
    Room {
        room: u64,
    },
    /// A failed room's slot its sender might still write: not reused until that sender
    /// calls again or its lease ends.
    Quarantined {
        room: u64,
        lease: Lease,
    },
}

#[derive(Debug)]
struct Holder {
    worker: String,
    expires: Instant,
    /// Pins per slot (a lease may pin a page more than once).
    pins: HashMap<u32, u32>,
    reserved: HashSet<u32>,
    /// Another host's cache service: this service writes its pages itself, checking
    /// the room under the lock, so a late write from it can never land.
    peer: bool,
}

/// See the module docs.
#[derive(Debug)]
pub struct State {
    size: MirrorSize,
    /// Where the mirror file goes; `None`: [`crate::mirror::default_dir`].
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
}

/// A `layout_refused` report: this mirror's layout against `theirs`, side by side.
fn layout_incident(
    ours: &KvLayout,
    theirs: &KvLayout,
    who: &str,
    summary: String,
) -> pdmesh_incident::Incident {
    let mut i = pdmesh_incident::Incident::new(
        pdmesh_incident::Kind::LayoutRefused,
        summary,
        pdmesh_incident::Place {
            worker: who.to_owned(),
            ..Default::default()
        },
    );
    i.layouts = Some(pdmesh_incident::LayoutPair {
        ours_label: "this host's mirror".into(),
        ours: pdmesh_incident::LayoutView::of(ours),
        theirs_label: who.to_owned(),
        theirs: pdmesh_incident::LayoutView::of(theirs),
    });
    i
}

/// A lease number nobody holds: random, so that no caller can guess another's (a lease is
/// the capability to pin, reserve and commit) and a restarted cache service never hands
/// out a lease its killed predecessor did. A worker still heartbeating the old lease then
/// hears NOT_FOUND and registers again (mapping the new mirror file), instead of keeping
/// another worker's lease alive and reading the new mirror's slots through the old file's
/// mapping.
fn fresh_lease(taken: &HashMap<Lease, Holder>) -> Lease {
    loop {
        let l = Lease::random();
        if !taken.contains_key(&l) {
            return l;
        }
    }
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
        }
    }

    /// Changes whenever any room changed.
    pub fn rooms_version(&self) -> u64 {
        self.rooms_version
    }

    /// The mirror, once the first worker registered.
    pub fn mirror(&self) -> Option<Arc<Mirror>> {
        self.mirror.clone()
    }

    /// Events since the last call, in order.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    /// Admits a worker. The first registration fixes the layout and creates the mirror
    /// file sized from it; later ones must bring the same fingerprint.
    pub fn register(
        &mut self,
        worker: &str,
        layout: KvLayout,
        now: Instant,
    ) -> Result<Registration, CacheError> {
        match &self.layout {
            Some(ours) if ours.fingerprint() != layout.fingerprint() => {
                self.incidents.push(layout_incident(
                    ours,
                    &layout,
                    &format!("worker {worker}"),
                    format!(
                        "Worker {worker} registered with another KV layout than this host's \
                         mirror holds, and was refused: pages written with one layout and read \
                         with the other would be read as the wrong bytes."
                    ),
                ));
                return Err(CacheError::LayoutMismatch {
                    ours: ours.to_string(),
                    theirs: layout.to_string(),
                });
            }
            Some(_) => {}
            None => {
                let page_bytes = layout.bytes_per_page();
                let pages = match self.size {
                    MirrorSize::Bytes(b) => b as usize / page_bytes,
                    MirrorSize::Tokens(t) => t as usize / layout.page_size(),
                };
                if pages == 0 {
                    return Err(CacheError::TooSmall {
                        size: self.size,
                        page_bytes,
                    });
                }
                let dir = match &self.dir {
                    Some(d) => {
                        crate::mirror::ensure_private(d)?;
                        d.clone()
                    }
                    None => crate::mirror::default_dir((page_bytes * pages) as u64)?,
                };
                let mirror = Mirror::create(&dir, page_bytes, pages)?;
                tracing::info!(path = %mirror.path().display(), pages, page_bytes, layout = %layout, "host mirror created");
                self.mirror = Some(Arc::new(mirror));
                self.slots = (0..pages).map(|_| Slot::Free).collect();
                self.free = (0..pages as u32).rev().collect();
                self.stats.total_pages = pages;
                self.layout = Some(Arc::new(layout));
            }
        }
        tracing::info!(worker, "worker registered");
        Ok(self.admit(worker, false, now))
    }

    /// A new lease for `name` (a worker, or a peer host's cache service) on the mirror.
    fn admit(&mut self, name: &str, peer: bool, now: Instant) -> Registration {
        let lease = fresh_lease(&self.leases);
        self.leases.insert(
            lease,
            Holder {
                worker: name.to_owned(),
                expires: now + self.ttl,
                pins: HashMap::new(),
                reserved: HashSet::new(),
                peer,
            },
        );
        let mirror = self.mirror.as_ref().expect("a layout implies a mirror");
        Registration {
            lease,
            lease_ttl: self.ttl,
            shm_path: mirror.path().to_owned(),
            page_bytes: mirror.page_bytes(),
            total_pages: mirror.pages(),
            layout: self.layout.clone().expect("a mirror implies a layout"),
        }
    }

    /// Whether `lease` is another host's cache service's (not a worker's of this host).
    pub fn is_peer_lease(&self, lease: Lease) -> bool {
        self.leases.get(&lease).is_some_and(|l| l.peer)
    }

    fn lease_mut(&mut self, lease: Lease) -> Result<&mut Holder, CacheError> {
        self.leases
            .get_mut(&lease)
            .ok_or(CacheError::UnknownLease(lease))
    }

    /// Admits another host's cache service, which sends rooms' pages here. It must bring
    /// this mirror's layout (a mismatch is refused naming both, with each component's
    /// bytes per token, and counted) and never fixes it: a host with no worker yet
    /// refuses it.
    pub fn register_peer(
        &mut self,
        peer: &str,
        layout: &KvLayout,
        now: Instant,
    ) -> Result<Registration, CacheError> {
        let Some(ours) = self.layout.clone() else {
            return Err(CacheError::NoLayoutYet);
        };
        if ours.fingerprint() != layout.fingerprint() {
            self.room_stats.peer.layout_refusals += 1;
            self.incidents.push(layout_incident(
                &ours,
                layout,
                &format!("peer {peer}"),
                format!(
                    "The cache service of another host ({peer}) registered with another KV \
                     layout and was refused: no room's pages cross between the two hosts."
                ),
            ));
            tracing::warn!(peer, ours = %ours, theirs = %layout, "peer refused: another KV layout");
            return Err(CacheError::PeerLayoutMismatch {
                ours: crate::transfer::describe(&ours),
                theirs: crate::transfer::describe(layout),
            });
        }
        tracing::info!(peer, "peer cache service registered");
        Ok(self.admit(peer, true, now))
    }

    /// The failures seen since the last call, to file as incident reports.
    pub fn take_incidents(&mut self) -> Vec<pdmesh_incident::Incident> {
        std::mem::take(&mut self.incidents)
    }

    /// Counts a peer refused for its layout in the page transport's handshake (by
    /// either side), and queues its report: the handshake carries the other side's
    /// layout as a description only, so the report quotes it beside this side's layout.
    pub fn peer_layout_refused(&mut self, peer: &str, reason: &str) {
        self.room_stats.peer.layout_refusals += 1;
        let mut i = pdmesh_incident::Incident::new(
            pdmesh_incident::Kind::LayoutRefused,
            format!(
                "The page transport between this host and {peer} refused the other side's KV \
                 layout: no room's pages cross between the two hosts. {reason}"
            ),
            pdmesh_incident::Place {
                worker: format!("peer {peer}"),
                ..Default::default()
            },
        );
        if let Some(ours) = &self.layout {
            i.details
                .insert("this host's layout".into(), crate::transfer::describe(ours));
        }
        i.details.insert("refusal".into(), reason.to_owned());
        self.incidents.push(i);
    }

    /// A page of a room that arrived from a peer's cache service with bytes not matching
    /// the checksum the peer sent it with: the batch was refused, so the sender's
    /// hand-over fails with DATA_LOSS.
    pub fn arrival_checksum_failed(&mut self, bad: crate::transfer::BadArrival<'_>) {
        let story = self.rooms.story(bad.room).unwrap_or_default();
        let mut i = pdmesh_incident::Incident::new(
            pdmesh_incident::Kind::Checksum,
            format!(
                "Page {} of room {} arrived from the cache service at {} with bytes that do not \
                 match the checksum it was sent with: they changed on the way (the network \
                 path, or the sender's memory after it checksummed them). Its batch was \
                 refused, so the page never landed here and the hand-over failed with \
                 DATA_LOSS.",
                bad.index, bad.room, bad.peer
            ),
            pdmesh_incident::Place {
                worker: format!("peer {}", bad.peer),
                stage: "page transport arrival".into(),
                room: Some(bad.room),
                request_id: story.request_id,
                trace_id: story.trace_id,
                ..Default::default()
            },
        );
        i.timeline = story
            .history
            .iter()
            .map(|(at, what)| pdmesh_incident::Step::new(*at, what.to_string()))
            .collect();
        i.pages.push(pdmesh_incident::PageCheck {
            page: format!("page {} of room {}", bad.index, bad.room),
            expected: format!("{:016x}", bad.expected),
            found: format!("{:016x}", bad.found),
        });
        self.incidents.push(i);
    }

    /// One page of a room from a peer, its checksum already verified by the transport:
    /// written into the room's `index`th slot if the room is transferring with a peer as
    /// its sender. Checked and written under the state lock, so a page that arrives after
    /// its room failed is refused and never lands in a slot someone else now uses.
    /// A page a peer host sent over the page transport for `room`, from the connection of
    /// `sender`'s lease: it lands only in a room that lease sends in.
    pub fn peer_write(
        &mut self,
        sender: Lease,
        room: u64,
        index: u32,
        bytes: &[u8],
    ) -> Result<(), String> {
        let refuse = |why: String| {
            tracing::warn!(room, index, "page from a peer refused: {why}");
            why
        };
        match self.rooms.state(room) {
            Some((RoomState::Transferring, _)) => {}
            Some((st, why)) => {
                self.room_stats.late_writes_rejected += 1;
                let why = why.map(|w| format!(": {w}")).unwrap_or_default();
                return Err(refuse(format!("room {room} is {}{why}", st.name())));
            }
            None => {
                self.room_stats.late_writes_rejected += 1;
                return Err(refuse(format!("room {room} does not exist")));
            }
        }
        let from_peer = self
            .rooms
            .sender(room)
            .and_then(|l| self.leases.get(&l))
            .is_some_and(|l| l.peer);
        if !from_peer {
            return Err(refuse(format!("room {room}'s sender is not a peer host")));
        }
        if self.rooms.sender(room) != Some(sender) {
            return Err(refuse(format!(
                "room {room} is sent by another peer than this connection's"
            )));
        }
        let Some(&slot) = self.rooms.slots(room).get(index as usize) else {
            return Err(refuse(format!(
                "room {room} has {} pages; page {index} is not one",
                self.rooms.slots(room).len()
            )));
        };
        let mirror = self.mirror.as_ref().expect("a room implies a mirror");
        if bytes.len() != mirror.page_bytes() {
            return Err(refuse(format!(
                "a page is {} bytes, got {}",
                mirror.page_bytes(),
                bytes.len()
            )));
        }
        mirror.write(slot, bytes);
        *self.peer_pages.entry(room).or_default() += 1;
        self.room_stats.peer.pages_received += 1;
        self.room_stats.peer.bytes_received += bytes.len() as u64;
        Ok(())
    }

    pub fn heartbeat(&mut self, lease: Lease, now: Instant) -> Result<(), CacheError> {
        let ttl = self.ttl;
        self.lease_mut(lease)?.expires = now + ttl;
        Ok(())
    }

    /// The longest run of leading `hashes` resident in the mirror, each pinned for `lease`.
    pub fn match_pages(
        &mut self,
        lease: Lease,
        hashes: &[u64],
    ) -> Result<Vec<PageRef>, CacheError> {
        self.lease_mut(lease)?;
        self.tick += 1;
        let mut out = Vec::new();
        for &h in hashes {
            let Some(&slot) = self.index.get(&h) else {
                break;
            };
            let tick = self.tick;
            let Slot::Resident {
                checksum,
                pins,
                last_use,
                ..
            } = &mut self.slots[slot as usize]
            else {
                break; // still being written
            };
            if *pins == 0 {
                self.lru.remove(&(*last_use, slot));
            }
            *pins += 1;
            *last_use = tick;
            out.push(PageRef {
                hash: h,
                slot,
                checksum: *checksum,
            });
            *self
                .leases
                .get_mut(&lease)
                .expect("checked above")
                .pins
                .entry(slot)
                .or_default() += 1;
        }
        Ok(out)
    }

    /// Slots for the pages of `hashes` the mirror does not hold, evicting least recently
    /// used unpinned pages for room; stops granting when nothing more can be evicted.
    pub fn reserve(&mut self, lease: Lease, hashes: &[u64]) -> Result<Vec<(u64, u32)>, CacheError> {
        self.lease_mut(lease)?;
        let mut grants = Vec::new();
        let mut removed = Vec::new();
        for &h in hashes {
            if self.index.contains_key(&h) {
                continue;
            }
            let slot = match self.free.pop() {
                Some(s) => s,
                None => match self.lru.pop_first() {
                    Some((_, s)) => {
                        let Slot::Resident { hash, .. } = self.slots[s as usize] else {
                            unreachable!("the LRU set holds resident slots only");
                        };
                        self.index.remove(&hash);
                        removed.push(hash);
                        self.stats.evicted_pages += 1;
                        s
                    }
                    None => break,
                },
            };
            self.slots[slot as usize] = Slot::Reserved { lease, hash: h };
            self.index.insert(h, slot);
            self.lease_mut(lease)?.reserved.insert(slot);
            grants.push((h, slot));
        }
        if !removed.is_empty() {
            self.events.push(Event::Removed { hashes: removed });
        }
        Ok(grants)
    }

    fn free_slot(&mut self, slot: u32) {
        if let Slot::Reserved { hash, .. } | Slot::Resident { hash, .. } = self.slots[slot as usize]
        {
            self.index.remove(&hash);
        }
        self.slots[slot as usize] = Slot::Free;
        self.free.push(slot);
    }

    /// Publishes written pages: each must be reserved by `lease` for its hash, and its
    /// bytes (written to the slot, or carried in `data`) must match its checksum. Returns
    /// the slots refused for a checksum mismatch (freed and counted).
    pub fn commit(&mut self, lease: Lease, pages: Vec<CommitPage>) -> Result<Vec<u32>, CacheError> {
        self.lease_mut(lease)?;
        let mirror = self.mirror.clone().expect("a lease implies a mirror");
        let mut seen = HashSet::new();
        for p in &pages {
            if !seen.insert(p.slot) {
                return Err(CacheError::DuplicateSlot(p.slot));
            }
            match self.slots.get(p.slot as usize) {
                Some(Slot::Reserved { lease: l, hash }) if *l == lease && *hash == p.hash => {}
                _ => {
                    return Err(CacheError::NotHeld {
                        slot: p.slot,
                        what: "reserved for this page",
                    });
                }
            }
            if let Some(d) = &p.data
                && d.len() != mirror.page_bytes()
            {
                return Err(CacheError::WrongSize {
                    want: mirror.page_bytes(),
                    got: d.len(),
                });
            }
        }
        self.tick += 1;
        let mut scratch = Vec::new();
        let mut rejected = Vec::new();
        let mut stored: Vec<Event> = Vec::new();
        for p in pages {
            self.lease_mut(lease)?.reserved.remove(&p.slot);
            if let Some(d) = &p.data {
                mirror.write(p.slot, d);
            }
            let found = mirror.checksum(p.slot, &mut scratch);
            if found != p.checksum {
                tracing::warn!(
                    slot = p.slot,
                    hash = p.hash,
                    "committed page does not match its checksum"
                );
                self.stats.checksum_failures += 1;
                let worker = self.leases.get(&lease).map(|l| l.worker.clone());
                let mut i = pdmesh_incident::Incident::new(
                    pdmesh_incident::Kind::Checksum,
                    format!(
                        "A page written into the host mirror by {} did not match the checksum \
                         its writer computed; the page was refused (never published) and \
                         will be computed again by whoever needs it.",
                        worker.as_deref().unwrap_or("a worker")
                    ),
                    pdmesh_incident::Place {
                        worker: worker.unwrap_or_default(),
                        ..Default::default()
                    },
                );
                i.pages.push(pdmesh_incident::PageCheck {
                    page: format!("{:016x} (slot {})", p.hash, p.slot),
                    expected: format!("{:016x}", p.checksum),
                    found: format!("{found:016x}"),
                });
                self.incidents.push(i);
                self.free_slot(p.slot);
                rejected.push(p.slot);
                continue;
            }
            self.slots[p.slot as usize] = Slot::Resident {
                hash: p.hash,
                checksum: p.checksum,
                pins: 0,
                last_use: self.tick,
            };
            self.lru.insert((self.tick, p.slot));
            match stored.last_mut() {
                Some(Event::Stored { hashes, .. }) if hashes.last() == Some(&p.parent) => {
                    hashes.push(p.hash)
                }
                _ => stored.push(Event::Stored {
                    parent: p.parent,
                    hashes: vec![p.hash],
                }),
            }
        }
        self.events.extend(stored);
        Ok(rejected)
    }

    /// Checks that `lease` pins every slot of `slots` (before their bytes are sent).
    pub fn check_pinned(&mut self, lease: Lease, slots: &[u32]) -> Result<Vec<u64>, CacheError> {
        let l = self.lease_mut(lease)?;
        if let Some(&slot) = slots.iter().find(|s| !l.pins.contains_key(s)) {
            return Err(CacheError::NotHeld {
                slot,
                what: "pinned",
            });
        }
        Ok(slots
            .iter()
            .map(|&s| match self.slots[s as usize] {
                Slot::Resident { checksum, .. } => checksum,
                _ => unreachable!("a pinned slot is resident"),
            })
            .collect())
    }

    fn unpin(&mut self, slot: u32) {
        if let Slot::Resident { pins, last_use, .. } = &mut self.slots[slot as usize] {
            *pins -= 1;
            if *pins == 0 {
                self.lru.insert((*last_use, slot));
            }
        }
    }

    /// Drops one pin per listed slot (or the reservation, if the slot was reserved and
    /// never committed).
    pub fn release(&mut self, lease: Lease, slots: &[u32]) -> Result<(), CacheError> {
        for &slot in slots {
            let l = self.lease_mut(lease)?;
            if let Some(n) = l.pins.get_mut(&slot) {
                *n -= 1;
                if *n == 0 {
                    l.pins.remove(&slot);
                }
                self.unpin(slot);
            } else if l.reserved.remove(&slot) {
                self.free_slot(slot);
            } else {
                return Err(CacheError::NotHeld {
                    slot,
                    what: "pinned or reserved",
                });
            }
        }
        Ok(())
    }

    /// Removes resident, unpinned pages a consumer found corrupt; returns how many.
    pub fn discard(&mut self, lease: Lease, hashes: &[u64]) -> Result<usize, CacheError> {
        self.lease_mut(lease)?;
        let mut gone = Vec::new();
        for &h in hashes {
            if let Some(&slot) = self.index.get(&h)
                && let Slot::Resident {
                    pins: 0, last_use, ..
                } = self.slots[slot as usize]
            {
                self.lru.remove(&(last_use, slot));
                self.free_slot(slot);
                gone.push(h);
            }
        }
        let n = gone.len();
        if n > 0 {
            tracing::warn!(pages = n, "corrupt pages discarded from the host mirror");
            self.events.push(Event::Removed { hashes: gone });
        }
        Ok(n)
    }

    /// Ends every lease whose worker stopped heartbeating: its pins and reservations are
    /// dropped, so its pages become evictable. Returns the expired workers.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
        let dead: Vec<Lease> = self
            .leases
            .iter()
            .filter(|(_, l)| l.expires <= now)
            .map(|(&id, _)| id)
            .collect();
        let mut workers = Vec::new();
        for id in dead {
            let l = self.leases.remove(&id).expect("listed above");
            for (slot, n) in l.pins {
                for _ in 0..n {
                    self.unpin(slot);
                }
            }
            for slot in l.reserved {
                self.free_slot(slot);
            }
            let lost = self.rooms.lease_lost(id, now);
            *self
                .room_stats
                .aborts
                .entry(RoomAbort::LeaseLost)
                .or_default() += lost.len() as u64;
            for (_, rel) in lost {
                self.give_back(rel);
            }
            // Slots quarantined for this sender: it writes no more.
            self.free_quarantined(|_, lease| lease == id);
            let gone: Vec<u64> = self
                .relays
                .iter()
                .filter(|(_, r)| r.lease == id)
                .map(|(&room, _)| room)
                .collect();
            for room in gone {
                self.drop_relay(room, true, "the sender's lease was lost".to_owned());
            }
            self.rooms_version += 1;
            self.stats.expired_leases += 1;
            tracing::warn!(worker = %l.worker, lease = %id, "lease expired: its pins and reservations are released");
            workers.push(l.worker);
        }
        let late: Vec<(u64, bool)> = self
            .relays
            .iter()
            .filter_map(|(&room, r)| {
                let limit = if r.slots.is_empty() {
                    self.rooms.deadlines().bootstrapping + self.rooms.deadlines().waiting_for_input
                } else {
                    self.rooms.deadlines().transferring
                };
                (now.duration_since(r.since) >= limit).then_some((room, !r.slots.is_empty()))
            })
            .collect();
        for (room, writing) in late {
            *self
                .room_stats
                .timeouts
                .entry(if writing {
                    RoomState::Transferring
                } else {
                    RoomState::WaitingForInput
                })
                .or_default() += 1;
            self.drop_relay(room, false, "deadline passed on the sender's host".into());
        }
        let rooms = &self.rooms;
        self.peer_pages
            .retain(|&room, _| matches!(rooms.state(room), Some((RoomState::Transferring, _))));
        let expired = self.rooms.expire(now);
        if !expired.is_empty() {
            self.rooms_version += 1;
        }
        for (room, stuck_in, rel) in expired {
            if stuck_in != RoomState::Success {
                *self.room_stats.timeouts.entry(stuck_in).or_default() += 1;
                tracing::warn!(
                    room,
                    state = stuck_in.name(),
                    "room deadline passed: failed"
                );
                let crate::rooms::Story {
                    request_id,
                    trace_id,
                    history,
                } = self.rooms.story(room).unwrap_or_default();
                let mut i = pdmesh_incident::Incident::new(
                    pdmesh_incident::Kind::RoomDeadline,
                    format!(
                        "Room {room} of request {} stayed {} past that state's deadline and \
                         was failed: both sides were told, and its mirror slots came back.",
                        if request_id.is_empty() {
                            "(unnamed)"
                        } else {
                            &request_id
                        },
                        stuck_in.name()
                    ),
                    pdmesh_incident::Place {
                        room: Some(room),
                        request_id,
                        trace_id,
                        ..Default::default()
                    },
                );
                i.timeline = history
                    .into_iter()
                    .map(|(at, what)| pdmesh_incident::Step::new(at, what.to_string()))
                    .collect();
                self.incidents.push(i);
            }
            self.give_back(rel);
        }
        // Failed rooms stay long enough for both sides to learn why, then go.
        self.rooms
            .forget_failed(now, self.ttl.max(Duration::from_secs(30)));
        workers
    }

    pub fn stats(&self) -> Stats {
        Stats {
            used_pages: self.slots.len() - self.free.len(),
            pinned_pages: self
                .slots
                .iter()
                .filter(|s| matches!(s, Slot::Resident { pins, .. } if *pins > 0))
                .count(),
            leases: self.leases.len(),
            ..self.stats
        }
    }

    pub fn layout(&self) -> Option<&Arc<KvLayout>> {
        self.layout.as_ref()
    }

    /// Frees a room's slots, or quarantines those its sender might still write.
    fn give_back(&mut self, rel: Released) {
        for slot in rel.free_now {
            self.free_slot(slot);
        }
        for (slot, lease) in rel.quarantined {
            if let Slot::Room { room } = self.slots[slot as usize] {
                // A peer writes through this process only (see `peer_write`).
                if self.leases.get(&lease).is_some_and(|l| !l.peer) {
                    self.slots[slot as usize] = Slot::Quarantined { room, lease };
                } else {
                    self.free_slot(slot);
                }
            }
        }
    }

    fn free_quarantined(&mut self, pick: impl Fn(u64, Lease) -> bool) {
        let slots: Vec<u32> = (0..self.slots.len() as u32)
            .filter(|&i| {
                matches!(self.slots[i as usize], Slot::Quarantined { room, lease } if pick(room, lease))
            })
            .collect();
        for slot in slots {
            self.free_slot(slot);
        }
    }

    fn room_call<T>(&mut self, r: Result<T, RoomError>) -> Result<T, CacheError> {
        self.rooms_version += 1;
        Ok(r?)
    }

    /// `lease` joins `room` as `side`.
    pub fn room_open(
        &mut self,
        lease: Lease,
        room: u64,
        side: Side,
        (request_id, trace_id): (&str, &str),
        held: u32,
        now: Instant,
    ) -> Result<RoomState, CacheError> {
        self.lease_mut(lease)?;
        if room == 0 {
            return Err(CacheError::BadRoomCall("room 0 is not a room".into()));
        }
        if self.draining && self.rooms.state(room).is_none() {
            return Err(CacheError::Draining);
        }
        if held > 0 && side != Side::Receiver {
            return Err(CacheError::BadRoomCall(
                "only a receiver says which pages it holds".into(),
            ));
        }
        let r = self.rooms.open(room, side, lease, now);
        if r.is_ok() && side == Side::Receiver {
            self.rooms.set_held(room, held);
        }
        self.rooms.describe(room, request_id, trace_id);
        self.room_call(r)
    }

    /// Leading pages `room`'s receiver holds already.
    pub fn room_held(&self, room: u64) -> u32 {
        self.rooms.held(room)
    }

    /// Where `room` is, and why it failed.
    pub fn room_state(&self, room: u64) -> Option<(RoomState, Option<String>)> {
        self.rooms
            .state(room)
            .map(|(s, why)| (s, why.map(str::to_owned)))
    }

    /// Slots for the sender to write `pages` pages into, all or none; the room starts
    /// transferring.
    pub fn room_start(
        &mut self,
        lease: Lease,
        room: u64,
        pages: usize,
        now: Instant,
    ) -> Result<Vec<u32>, CacheError> {
        self.lease_mut(lease)?;
        if pages == 0 || pages > self.slots.len() {
            return Err(CacheError::BadRoomCall(format!(
                "a transfer of {pages} pages (the mirror has {})",
                self.slots.len()
            )));
        }
        // Check the room before taking anything.
        if let Some((state, _)) = self.rooms.state(room)
            && state != RoomState::WaitingForInput
        {
            let r = self.rooms.start_transfer(room, lease, Vec::new(), now);
            return self.room_call(r.map(|()| Vec::new()));
        }
        let slots = self.take_slots(room, pages)?;
        let r = self.rooms.start_transfer(room, lease, slots.clone(), now);
        if r.is_ok() {
            self.room_stats.peer.held_pages_skipped += u64::from(self.rooms.held(room));
        }
        if r.is_err() {
            for &s in &slots {
                self.free_slot(s);
            }
        }
        self.room_call(r.map(|()| slots))
    }

    /// `pages` slots for `room`'s transfer, all or none, evicting least recently used
    /// unpinned pages for them.
    fn take_slots(&mut self, room: u64, pages: usize) -> Result<Vec<u32>, CacheError> {
        let spare = self.free.len() + self.lru.len();
        if spare < pages {
            return Err(CacheError::MirrorFull {
                want: pages,
                free: spare,
            });
        }
        let mut slots = Vec::with_capacity(pages);
        let mut removed = Vec::new();
        for _ in 0..pages {
            let slot = match self.free.pop() {
                Some(s) => s,
                None => {
                    let (_, s) = self.lru.pop_first().expect("counted above");
                    let Slot::Resident { hash, .. } = self.slots[s as usize] else {
                        unreachable!("the LRU set holds resident slots only");
                    };
                    self.index.remove(&hash);
                    removed.push(hash);
                    self.stats.evicted_pages += 1;
                    s
                }
            };
            self.slots[slot as usize] = Slot::Room { room };
            slots.push(slot);
        }
        if !removed.is_empty() {
            self.events.push(Event::Removed { hashes: removed });
        }
        Ok(slots)
    }

    /// The sender hands over its pages: exactly the room's slots, in order.
    pub fn room_commit(
        &mut self,
        lease: Lease,
        room: u64,
        pages: Vec<RoomPage>,
        aux: Aux,
        now: Instant,
    ) -> Result<(), CacheError> {
        self.lease_mut(lease)?;
        if aux.room != room {
            return Err(CacheError::BadRoomCall(format!(
                "aux data names room {}, not {room}",
                aux.room
            )));
        }
        if matches!(self.rooms.state(room), Some((RoomState::Transferring, _)))
            && self.rooms.sender(room) == Some(lease)
            && !pages
                .iter()
                .map(|p| p.slot)
                .eq(self.rooms.slots(room).iter().copied())
        {
            return Err(CacheError::BadRoomCall(
                "a commit must list exactly the room's slots, in order".into(),
            ));
        }
        let from_peer = self.leases.get(&lease).is_some_and(|l| l.peer);
        if from_peer
            && matches!(self.rooms.state(room), Some((RoomState::Transferring, _)))
            && self.peer_pages.get(&room).copied().unwrap_or(0) < pages.len()
        {
            return Err(CacheError::BadRoomCall(format!(
                "a peer committed {} pages of room {room} but sent {}",
                pages.len(),
                self.peer_pages.get(&room).copied().unwrap_or(0)
            )));
        }
        let r = self.rooms.commit(room, lease, pages, aux, now);
        self.peer_pages.remove(&room);
        if let Err(RoomError::Failed { .. } | RoomError::Unknown(_)) = &r {
            // A late write: refused. Its sender is done, so its held slots are free now.
            self.room_stats.late_writes_rejected += 1;
            self.free_quarantined(|q, l| q == room && l == lease);
            tracing::warn!(room, %lease, "late commit to a failed room refused");
        }
        self.room_call(r)
    }

    /// The receiver's pages and aux data.
    pub fn room_result(
        &mut self,
        lease: Lease,
        room: u64,
    ) -> Result<(Vec<RoomPage>, Aux), CacheError> {
        self.lease_mut(lease)?;
        Ok(self.rooms.result(room, lease)?)
    }

    /// The receiver took its pages: the slots are free.
    pub fn room_finish(&mut self, lease: Lease, room: u64) -> Result<(), CacheError> {
        self.lease_mut(lease)?;
        let pages = self.rooms.result(room, lease).map(|(p, _)| p.len());
        let rel = self.rooms.finish(room, lease);
        let rel = self.room_call(rel)?;
        let n = pages.unwrap_or(0) as u64;
        self.room_stats.finished += 1;
        self.room_stats.transfer_pages += n;
        let page_bytes = self.mirror.as_ref().map_or(0, |m| m.page_bytes()) as u64;
        self.room_stats.transfer_bytes += n * page_bytes;
        self.give_back(rel);
        Ok(())
    }

    /// Either side gives up. Not an error if the room is already over.
    pub fn room_abort(
        &mut self,
        lease: Lease,
        room: u64,
        reason: &str,
        now: Instant,
    ) -> Result<(), CacheError> {
        self.lease_mut(lease)?;
        let who = if self.rooms.sender(room) == Some(lease) {
            RoomAbort::Sender
        } else {
            RoomAbort::Receiver
        };
        if let Some(rel) = self.rooms.abort(room, lease, reason, now) {
            *self.room_stats.aborts.entry(who).or_default() += 1;
            tracing::info!(room, by = who.name(), reason, "room aborted");
            self.give_back(rel);
        }
        if who == RoomAbort::Sender {
            self.free_quarantined(|q, l| q == room && l == lease);
        }
        self.rooms_version += 1;
        Ok(())
    }

    /// `lease` (a local sender) opens `room`, whose home is the cache service at `home`.
    pub fn relay_open(
        &mut self,
        lease: Lease,
        room: u64,
        home: &str,
        now: Instant,
    ) -> Result<(), CacheError> {
        self.lease_mut(lease)?;
        if room == 0 {
            return Err(CacheError::BadRoomCall("room 0 is not a room".into()));
        }
        if self.draining {
            return Err(CacheError::Draining);
        }
        if self.rooms.state(room).is_some() {
            return Err(CacheError::BadRoomCall(format!(
                "room {room} lives on this host; it has no other home"
            )));
        }
        match self.relays.get(&room) {
            Some(r) if r.lease != lease => Err(CacheError::Room(RoomError::SideTaken {
                room,
                side: Side::Sender,
            })),
            Some(_) => Ok(()),
            None => {
                self.relays.insert(
                    room,
                    Relay {
                        lease,
                        home: home.to_owned(),
                        link: None,
                        slots: Vec::new(),
                        remote_slots: Vec::new(),
                        since: now,
                    },
                );
                self.rooms_version += 1;
                Ok(())
            }
        }
    }

    /// The local sender of relayed `room`.
    pub fn relay_owner(&self, room: u64) -> Option<Lease> {
        self.relays.get(&room).map(|r| r.lease)
    }

    /// The home of `room` if it is relayed from here.
    pub fn relay_home(&self, room: u64) -> Option<&str> {
        self.relays.get(&room).map(|r| r.home.as_str())
    }

    /// The home opened relayed `room` for this service's lease `link` there.
    pub fn relay_linked(&mut self, room: u64, link: Lease) {
        if let Some(r) = self.relays.get_mut(&room) {
            r.link = Some(link);
        }
    }

    /// The home of `room` if it is relayed from here, and the lease there it was opened
    /// with (none while its opening is under way).
    pub fn relay_link(&self, room: u64) -> Option<(&str, Option<Lease>)> {
        self.relays.get(&room).map(|r| (r.home.as_str(), r.link))
    }

    fn relay_mut(&mut self, lease: Lease, room: u64) -> Result<&mut Relay, CacheError> {
        self.lease_mut(lease)?;
        match self.relays.get_mut(&room) {
            Some(r) if r.lease == lease => Ok(r),
            Some(_) => Err(CacheError::Room(RoomError::NotYours {
                room,
                side: Side::Sender,
            })),
            None => Err(CacheError::Room(RoomError::Unknown(room))),
        }
    }

    /// This mirror's slots for the sender of relayed `room` to write `pages` pages into.
    pub fn relay_take_slots(
        &mut self,
        lease: Lease,
        room: u64,
        pages: usize,
    ) -> Result<Vec<u32>, CacheError> {
        let r = self.relay_mut(lease, room)?;
        if !r.slots.is_empty() {
            return Err(CacheError::Room(RoomError::WrongState {
                room,
                state: RoomState::Transferring,
                need: RoomState::WaitingForInput,
            }));
        }
        if pages == 0 || pages > self.slots.len() {
            return Err(CacheError::BadRoomCall(format!(
                "a transfer of {pages} pages (the mirror has {})",
                self.slots.len()
            )));
        }
        self.take_slots(room, pages)
    }

    /// The home host granted its slots: the relayed room transfers with `slots` here.
    /// False (and the slots are freed) if the relay ended meanwhile.
    pub fn relay_started(
        &mut self,
        room: u64,
        slots: Vec<u32>,
        remote_slots: Vec<u32>,
        now: Instant,
    ) -> bool {
        match self.relays.get_mut(&room) {
            Some(r) if r.slots.is_empty() => {
                r.slots = slots;
                r.remote_slots = remote_slots;
                r.since = now;
                true
            }
            _ => {
                for s in slots {
                    self.free_slot(s);
                }
                false
            }
        }
    }

    /// Frees slots taken for a relayed room whose start the home host refused.
    pub fn relay_unstart(&mut self, slots: &[u32]) {
        for &s in slots {
            if matches!(self.slots[s as usize], Slot::Room { .. }) {
                self.free_slot(s);
            }
        }
    }

    /// What the commit of relayed `room` sends: `pages` must be exactly its slots here,
    /// in order.
    pub fn relay_commit(
        &mut self,
        lease: Lease,
        room: u64,
        pages: &[RoomPage],
    ) -> Result<RelayCommit, CacheError> {
        let r = self.relay_mut(lease, room)?;
        if r.slots.is_empty() {
            return Err(CacheError::Room(RoomError::WrongState {
                room,
                state: RoomState::WaitingForInput,
                need: RoomState::Transferring,
            }));
        }
        if !pages.iter().map(|p| p.slot).eq(r.slots.iter().copied()) {
            return Err(CacheError::BadRoomCall(
                "a commit must list exactly the room's slots, in order".into(),
            ));
        }
        let (slots, remote_slots) = (r.slots.clone(), r.remote_slots.clone());
        Ok(RelayCommit {
            mirror: self.mirror.clone().expect("a lease implies a mirror"),
            slots,
            remote_slots,
        })
    }

    /// Ends relayed `room` here: its slots are freed, or held back from reuse while its
    /// sender might still write them (`sender_done` false while it is transferring).
    /// Returns whether it was relayed.
    pub fn relay_end(&mut self, room: u64, sender_done: bool) -> bool {
        let Some(r) = self.relays.remove(&room) else {
            return false;
        };
        self.rooms_version += 1;
        let writing = !sender_done && !r.slots.is_empty() && self.leases.contains_key(&r.lease);
        for s in r.slots {
            if writing {
                self.slots[s as usize] = Slot::Quarantined {
                    room,
                    lease: r.lease,
                };
            } else {
                self.free_slot(s);
            }
        }
        true
    }

    fn drop_relay(&mut self, room: u64, sender_done: bool, reason: String) {
        let home = self.relays.get(&room).map(|r| r.home.clone());
        if let Some(home) = home {
            tracing::warn!(room, %home, %reason, "relayed room failed on the sender's host");
            self.relay_end(room, sender_done);
            self.dropped_relays
                .push(DroppedRelay { room, home, reason });
        }
    }

    /// The sender of a relayed room that failed here came back (a late commit or its
    /// abort): it writes no more, so the slots held back for it are free.
    pub fn relay_sender_done(&mut self, lease: Lease, room: u64, late: bool) {
        if late {
            self.room_stats.late_writes_rejected += 1;
        }
        self.free_quarantined(|q, l| q == room && l == lease);
    }

    /// Relayed rooms given up on since the last call: their homes must be told.
    pub fn take_dropped_relays(&mut self) -> Vec<DroppedRelay> {
        std::mem::take(&mut self.dropped_relays)
    }

    /// Counts pages sent to a peer, or a failed transfer.
    pub fn count_peer_sent(&mut self, pages: u64, bytes: u64) {
        self.room_stats.peer.pages_sent += pages;
        self.room_stats.peer.bytes_sent += bytes;
    }

    pub fn count_peer_failure(&mut self) {
        self.room_stats.peer.transfer_failures += 1;
    }

    /// Rooms stuck past `fraction` of their state's deadline, each reported once per
    /// state; with `abort`, they are failed and their slots released.
    pub fn watchdog(&mut self, now: Instant, fraction: f64, abort: bool) -> Vec<Stuck> {
        let stuck = self.rooms.stuck(now, fraction);
        self.room_stats.stalls += stuck.len() as u64;
        if abort {
            for s in &stuck {
                if let Some(rel) = self.rooms.abort_any(s.room, "watchdog: stuck", now) {
                    *self
                        .room_stats
                        .aborts
                        .entry(RoomAbort::Watchdog)
                        .or_default() += 1;
                    self.give_back(rel);
                    self.rooms_version += 1;
                }
            }
        }
        stuck
    }

    /// Every room under way now (see [`crate::rooms::Rooms::under_way`]).
    pub fn rooms_under_way(&self, now: Instant) -> Vec<Stuck> {
        self.rooms.under_way(now)
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

    pub fn room_stats(&self, now: Instant) -> RoomStats {
        let mut st = self.room_stats.clone();
        st.census = self.rooms.census(now);
        st.older_than = crate::rooms::AGE_THRESHOLDS
            .into_iter()
            .zip(self.rooms.older_than(now))
            .collect();
        st.room_slots = self
            .slots
            .iter()
            .filter(|s| matches!(s, Slot::Room { .. }))
            .count();
        st.quarantined_slots = self
            .slots
            .iter()
            .filter(|s| matches!(s, Slot::Quarantined { .. }))
            .count();
        st
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_kv::DType;

    const TTL: Duration = Duration::from_secs(10);

    fn layout() -> KvLayout {
        KvLayout::llama(2, 1, 4, DType::F16, 4) // 2 layers × (k+v) × 4 f16 × 4 tokens = 128 B
    }

    fn state(pages: u64) -> (State, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let s = State::new(
            MirrorSize::Bytes(128 * pages),
            Some(crate::mirror::private_dir(dir.path()).unwrap()),
            TTL,
        );
        (s, dir)
    }

    fn page(seed: u8) -> Vec<u8> {
        (0..128u32).map(|i| (i as u8).wrapping_mul(seed)).collect()
    }

    fn put(s: &mut State, lease: Lease, hashes: &[u64]) -> Vec<u32> {
        let grants = s.reserve(lease, hashes).unwrap();
        let pages = grants
            .iter()
            .map(|&(hash, slot)| {
                let d = page(hash as u8);
                CommitPage {
                    hash,
                    slot,
                    checksum: pdmesh_kv::page_checksum(&d),
                    data: Some(d),
                    parent: 0,
                }
            })
            .collect();
        assert!(s.commit(lease, pages).unwrap().is_empty());
        grants.iter().map(|g| g.1).collect()
    }

    #[test]
    fn sizes_parse_in_bytes_and_tokens() {
        assert_eq!("4GiB".parse(), Ok(MirrorSize::Bytes(4 << 30)));
        assert_eq!("2 MB".parse(), Ok(MirrorSize::Bytes(2_000_000)));
        assert_eq!("1000".parse(), Ok(MirrorSize::Bytes(1000)));
        assert_eq!("5000tokens".parse(), Ok(MirrorSize::Tokens(5000)));
        assert!("lots".parse::<MirrorSize>().is_err());
        assert!("3 parsecs".parse::<MirrorSize>().is_err());
    }

    #[test]
    fn a_page_changed_on_the_way_from_a_peer_is_reported_with_both_checksums() {
        let (mut s, _d) = state(10);
        s.arrival_checksum_failed(crate::transfer::BadArrival {
            peer: "10.7.0.2:40000",
            room: 42,
            index: 3,
            expected: 0xaa,
            found: 0xbb,
        });
        let seen = s.take_incidents();
        assert_eq!(seen.len(), 1);
        let i = &seen[0];
        assert_eq!(i.kind, pdmesh_incident::Kind::Checksum);
        assert_eq!(
            (
                i.place.worker.as_str(),
                i.place.stage.as_str(),
                i.place.room
            ),
            ("peer 10.7.0.2:40000", "page transport arrival", Some(42))
        );
        assert_eq!(
            i.pages,
            [pdmesh_incident::PageCheck {
                page: "page 3 of room 42".into(),
                expected: format!("{:016x}", 0xaa),
                found: format!("{:016x}", 0xbb),
            }]
        );
    }

    #[test]
    fn a_restarted_service_knows_none_of_the_leases_its_predecessor_handed_out() {
        let now = Instant::now();
        let (mut old, _d) = state(4);
        let olds: Vec<Lease> = ["decode", "prefill", "tier"]
            .map(|w| old.register(w, layout(), now).unwrap().lease)
            .into();
        drop(old);
        // The new one registers the workers in another order: a worker still heartbeating
        // its old lease must hear that it is unknown, whoever registered first.
        let (mut new, _d) = state(4);
        for w in ["tier", "prefill"] {
            let lease = new.register(w, layout(), now).unwrap().lease;
            assert!(
                !olds.contains(&lease),
                "{lease} was handed out before the restart"
            );
        }
        for lease in olds {
            assert!(matches!(
                new.heartbeat(lease, now),
                Err(CacheError::UnknownLease(l)) if l == lease
            ));
        }
    }

    #[test]
    fn the_first_layout_sizes_the_mirror_and_another_is_refused_naming_both() {
        let (mut s, _d) = state(10);
        let now = Instant::now();
        let r = s.register("w1", layout(), now).unwrap();
        assert_eq!((r.page_bytes, r.total_pages), (128, 10));
        let other = KvLayout::llama(2, 1, 4, DType::Bf16, 4);
        let err = s
            .register("w2", other.clone(), now)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&layout().to_string()), "{err}");
        assert!(err.contains(&other.to_string()), "{err}");
        // A report with both layouts side by side, naming the refused worker.
        let seen = s.take_incidents();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].kind, pdmesh_incident::Kind::LayoutRefused);
        let pair = seen[0].layouts.as_ref().unwrap();
        assert_eq!(pair.theirs_label, "worker w2");
        assert_eq!(
            pair.differences(),
            [
                "k: 8 B/token (f16) vs 8 B/token (bf16)",
                "v: 8 B/token (f16) vs 8 B/token (bf16)"
            ]
        );
        assert!(s.take_incidents().is_empty(), "taken once");

        let (mut t, _d2) = state(0);
        assert!(matches!(
            t.register("w", layout(), now),
            Err(CacheError::TooSmall { .. })
        ));
        let dir = tempfile::tempdir().unwrap();
        let mut u = State::new(
            MirrorSize::Tokens(40),
            Some(crate::mirror::private_dir(dir.path()).unwrap()),
            TTL,
        );
        assert_eq!(u.register("w", layout(), now).unwrap().total_pages, 10);
        // A mirror bigger than its filesystem's free space is refused when it is made.
        let mut huge = State::new(
            MirrorSize::Bytes(1 << 60),
            Some(crate::mirror::private_dir(dir.path()).unwrap()),
            TTL,
        );
        let err = huge.register("w", layout(), now).unwrap_err().to_string();
        assert!(err.contains("--host-mirror-size"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let mut u = State::new(
            MirrorSize::Tokens(40),
            Some(crate::mirror::private_dir(dir.path()).unwrap()),
            TTL,
        );
        assert_eq!(u.register("w", layout(), now).unwrap().total_pages, 10);
    }

    #[test]
    fn pages_are_stored_matched_as_a_leading_run_and_pinned_against_eviction() {
        let (mut s, _d) = state(3);
        let now = Instant::now();
        let a = s.register("a", layout(), now).unwrap().lease;
        let b = s.register("b", layout(), now).unwrap().lease;
        put(&mut s, a, &[1, 2]);
        // A page already held is not reserved again.
        assert_eq!(s.reserve(b, &[1, 2]).unwrap(), vec![]);
        let m = s.match_pages(b, &[1, 2, 3]).unwrap();
        assert_eq!(m.iter().map(|p| p.hash).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(m[0].checksum, pdmesh_kv::page_checksum(&page(1)));
        assert_eq!(
            s.match_pages(b, &[9, 1]).unwrap(),
            vec![],
            "a leading run only"
        );
        // Full but for one slot, and both resident pages pinned: one grant only.
        let g = s.reserve(a, &[3, 4]).unwrap();
        assert_eq!(g.len(), 1);
        assert_eq!(s.stats().evicted_pages, 0);
        // An abandoned reservation frees its slot.
        s.release(a, &[g[0].1]).unwrap();
        let slots: Vec<u32> = m.iter().map(|p| p.slot).collect();
        s.release(b, &slots).unwrap();
        assert!(s.release(b, &slots).is_err(), "pins are counted");
        // Unpinned now: the free slot goes first, then 1, least recently used.
        let g = s.reserve(a, &[5, 6]).unwrap();
        assert_eq!(g[1].1, slots[0]);
        assert_eq!(s.stats().evicted_pages, 1);
        let ev = s.take_events();
        assert_eq!(
            ev[0],
            Event::Stored {
                parent: 0,
                hashes: vec![1]
            }
        );
        assert!(ev.contains(&Event::Removed { hashes: vec![1] }), "{ev:?}");
    }

    #[test]
    fn a_page_that_does_not_match_its_checksum_is_refused_and_counted() {
        let (mut s, _d) = state(4);
        let now = Instant::now();
        let a = s.register("a", layout(), now).unwrap().lease;
        let g = s.reserve(a, &[7]).unwrap();
        let d = page(7);
        let bad = CommitPage {
            hash: 7,
            slot: g[0].1,
            checksum: pdmesh_kv::page_checksum(&d) ^ 1,
            data: Some(d),
            parent: 0,
        };
        assert_eq!(s.commit(a, vec![bad]).unwrap(), vec![g[0].1]);
        assert_eq!(s.stats().checksum_failures, 1);
        let seen = s.take_incidents();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].kind, pdmesh_incident::Kind::Checksum);
        assert_eq!(seen[0].place.worker, "a");
        let want = pdmesh_kv::page_checksum(&page(7));
        assert_eq!(
            seen[0].pages,
            [pdmesh_incident::PageCheck {
                page: format!("{:016x} (slot {})", 7, g[0].1),
                expected: format!("{:016x}", want ^ 1),
                found: format!("{want:016x}"),
            }]
        );
        assert_eq!(s.match_pages(a, &[7]).unwrap(), vec![]);
        assert_eq!(s.stats().used_pages, 0);
        // Committing a slot that is not reserved for that page is an error.
        // The same slot twice in one commit is refused whole, before anything changes.
        let g = s.reserve(a, &[10]).unwrap();
        let d = page(10);
        let twice = CommitPage {
            hash: 10,
            slot: g[0].1,
            checksum: pdmesh_kv::page_checksum(&d),
            data: Some(d),
            parent: 0,
        };
        let err = s.commit(a, vec![twice.clone(), twice.clone()]).unwrap_err();
        assert!(matches!(err, CacheError::DuplicateSlot(_)), "{err}");
        assert_eq!(
            s.commit(a, vec![twice]).unwrap(),
            Vec::<u32>::new(),
            "the reservation is intact"
        );
        assert_eq!(s.match_pages(a, &[10]).unwrap().len(), 1);
        let g = s.reserve(a, &[8]).unwrap();
        let wrong = CommitPage {
            hash: 9,
            slot: g[0].1,
            checksum: 0,
            data: None,
            parent: 0,
        };
        assert!(matches!(
            s.commit(a, vec![wrong]),
            Err(CacheError::NotHeld { .. })
        ));
    }

    #[test]
    fn an_expired_lease_gives_up_its_pins_and_reservations() {
        let (mut s, _d) = state(2);
        let t0 = Instant::now();
        let a = s.register("a", layout(), t0).unwrap().lease;
        let b = s.register("b", layout(), t0).unwrap().lease;
        put(&mut s, a, &[1]);
        s.match_pages(b, &[1]).unwrap();
        s.reserve(b, &[2]).unwrap();
        assert_eq!(s.stats().pinned_pages, 1);
        // a keeps its lease alive, b goes silent.
        s.heartbeat(a, t0 + TTL / 2).unwrap();
        assert_eq!(s.expire(t0 + TTL), vec!["b".to_string()]);
        assert!(matches!(
            s.heartbeat(b, t0 + TTL),
            Err(CacheError::UnknownLease(_))
        ));
        let st = s.stats();
        assert_eq!(
            (st.pinned_pages, st.used_pages, st.expired_leases),
            (0, 1, 1)
        );
        // b's page is evictable now, its reservation free: a can take both slots.
        assert_eq!(s.reserve(a, &[3, 4]).unwrap().len(), 2);
    }

    fn aux(room: u64) -> Aux {
        Aux {
            room,
            first_token: 1,
            first_logprob: f32::NAN,
            prompt_tokens: 4,
            ..Aux::default()
        }
    }

    /// Opens `room` on both sides and starts a transfer of `pages` pages.
    fn transferring(s: &mut State, room: u64, p: Lease, d: Lease, pages: usize) -> Vec<u32> {
        let t = Instant::now();
        s.room_open(d, room, Side::Receiver, ("r", ""), 0, t)
            .unwrap();
        s.room_open(p, room, Side::Sender, ("r", ""), 0, t).unwrap();
        s.room_start(p, room, pages, t).unwrap()
    }

    #[test]
    fn a_failed_rooms_slots_stay_out_of_reach_until_its_late_writer_is_refused() {
        let (mut s, _dir) = state(4);
        let t = Instant::now();
        let p = s.register("prefill", layout(), t).unwrap().lease;
        let d = s.register("decode", layout(), t).unwrap().lease;
        let first = transferring(&mut s, 1, p, d, 2);
        // Decode gives up while prefill is writing: those slots are quarantined.
        s.room_abort(d, 1, "client left", t).unwrap();
        assert_eq!(s.room_stats(t).quarantined_slots, 2);
        // Another room cannot get them: only the 2 other slots exist for it.
        let second = transferring(&mut s, 2, p, d, 2);
        assert!(
            second.iter().all(|x| !first.contains(x)),
            "{first:?} {second:?}"
        );
        assert!(matches!(
            s.room_start(p, 3, 1, t),
            Err(CacheError::MirrorFull { .. }) | Err(CacheError::Room(_))
        ));
        // The late commit is refused and, its writer being done, frees the slots.
        let pages = first
            .iter()
            .map(|&slot| RoomPage { slot, checksum: 0 })
            .collect();
        let err = s.room_commit(p, 1, pages, aux(1), t).unwrap_err();
        assert!(
            matches!(err, CacheError::Room(RoomError::Failed { .. })),
            "{err}"
        );
        let st = s.room_stats(t);
        assert_eq!((st.quarantined_slots, st.late_writes_rejected), (0, 1));
        // A commit naming slots that are not the room's is refused before anything moves.
        let wrong = vec![
            RoomPage {
                slot: first[0],
                checksum: 0
            };
            2
        ];
        assert!(matches!(
            s.room_commit(p, 2, wrong, aux(2), t),
            Err(CacheError::BadRoomCall(_))
        ));
        let pages = second
            .iter()
            .map(|&slot| RoomPage { slot, checksum: 0 })
            .collect();
        s.room_commit(p, 2, pages, aux(2), t).unwrap();
        s.room_finish(d, 2).unwrap();
        let st = s.room_stats(t);
        assert_eq!((st.room_slots, st.finished, st.transfer_pages), (0, 1, 2));
        assert_eq!(s.stats().used_pages, 0, "every slot is free again");
    }

    #[test]
    fn hostile_room_calls_are_refused_and_change_nothing() {
        let (mut s, _dir) = state(4);
        let t = Instant::now();
        let p = s.register("prefill", layout(), t).unwrap().lease;
        let d = s.register("decode", layout(), t).unwrap().lease;
        assert!(matches!(
            s.room_open(p, 0, Side::Sender, ("", ""), 0, t),
            Err(CacheError::BadRoomCall(_))
        ));
        assert!(matches!(
            s.room_open(
                Lease::from_test_number(999),
                5,
                Side::Sender,
                ("", ""),
                0,
                t
            ),
            Err(CacheError::UnknownLease(_))
        ));
        s.room_open(d, 5, Side::Receiver, ("", ""), 0, t).unwrap();
        s.room_open(p, 5, Side::Sender, ("", ""), 0, t).unwrap();
        for pages in [0, 5, usize::MAX] {
            assert!(matches!(
                s.room_start(p, 5, pages, t),
                Err(CacheError::BadRoomCall(_))
            ));
        }
        // The receiver cannot start the sender's transfer.
        assert!(s.room_start(d, 5, 1, t).is_err());
        let slots = s.room_start(p, 5, 1, t).unwrap();
        let pages = vec![RoomPage {
            slot: slots[0],
            checksum: 0,
        }];
        assert!(matches!(
            s.room_commit(p, 5, pages, aux(6), t),
            Err(CacheError::BadRoomCall(_))
        ));
        assert_eq!(s.room_stats(t).room_slots, 1, "the transfer is still on");
        // A lease that dies fails its rooms and frees what they held.
        s.expire(t + TTL * 2);
        assert_eq!(s.stats().used_pages, 0);
    }

    #[test]
    fn a_peers_page_lands_only_in_a_room_transferring_from_that_peer_and_never_late() {
        let (mut s, _dir) = state(4);
        let t = Instant::now();
        assert!(matches!(
            s.register_peer("peer", &layout(), t),
            Err(CacheError::NoLayoutYet)
        ));
        let d = s.register("decode", layout(), t).unwrap().lease;
        let local = s.register("prefill", layout(), t).unwrap().lease;
        let other = KvLayout::llama(2, 1, 4, DType::F16, 8);
        assert!(matches!(
            s.register_peer("peer", &other, t),
            Err(CacheError::PeerLayoutMismatch { .. })
        ));
        let peer = s.register_peer("peer", &layout(), t).unwrap().lease;
        // A room whose sender is a local worker takes no page from the transport.
        s.room_open(d, 1, Side::Receiver, ("", ""), 0, t).unwrap();
        s.room_open(local, 1, Side::Sender, ("", ""), 0, t).unwrap();
        s.room_start(local, 1, 1, t).unwrap();
        assert!(s.peer_write(local, 1, 0, &page(3)).is_err());
        assert!(s.peer_write(peer, 1, 0, &page(3)).is_err());
        // From the peer: a wrong index or size is refused; the right page lands.
        s.room_open(d, 2, Side::Receiver, ("", ""), 0, t).unwrap();
        s.room_open(peer, 2, Side::Sender, ("", ""), 0, t).unwrap();
        let slots = s.room_start(peer, 2, 2, t).unwrap();
        assert!(s.peer_write(peer, 2, 2, &page(5)).is_err());
        assert!(s.peer_write(peer, 2, 0, &page(5)[..64]).is_err());
        // Another peer's connection may not write this peer's room.
        let intruder = s.register_peer("intruder", &layout(), t).unwrap().lease;
        assert!(s.peer_write(intruder, 2, 0, &page(6)).is_err());
        s.peer_write(peer, 2, 0, &page(5)).unwrap();
        let mirror = s.mirror().unwrap();
        let mut got = vec![0u8; 128];
        mirror.read(slots[0], &mut got);
        assert_eq!(got, page(5));
        // It must send every page before it commits.
        let pages: Vec<RoomPage> = slots
            .iter()
            .map(|&slot| RoomPage { slot, checksum: 0 })
            .collect();
        assert!(matches!(
            s.room_commit(peer, 2, pages, aux(2), t),
            Err(CacheError::BadRoomCall(_))
        ));
        // The receiver gives up: its slots are free at once (the peer writes through this
        // process only), and a page that arrives now is refused and written nowhere.
        s.room_abort(d, 2, "client left", t).unwrap();
        assert_eq!(s.room_stats(t).quarantined_slots, 0);
        let before = s.stats().used_pages;
        assert!(s.peer_write(peer, 2, 1, &page(7)).is_err());
        mirror.read(slots[1], &mut got);
        assert_ne!(got, page(7), "a late page never lands");
        assert_eq!(s.stats().used_pages, before);
        assert_eq!(s.room_stats(t).late_writes_rejected, 1);
    }
}

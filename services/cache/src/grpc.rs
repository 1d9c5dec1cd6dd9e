//! `pdmesh.cache.v1.Cache` over [`State`]: request validation, status codes, the grpc
//! data plane's page streams, and the KV event fan-out.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::Stream;
use pdmesh_proto::cache::v1 as pb;
use tokio::sync::broadcast;
use tokio_stream::StreamExt as _;
use tonic::{Request, Response, Status};

use crate::peers::{Link, Peers};
use crate::rooms::{Aux, RoomError, RoomPage, RoomState, Side};
use crate::state::{CacheError, CommitPage, Event, State};
use crate::transfer::Pages;
use crate::wire::layout_from_pb;
use pdmesh_cache_client::Lease;
use pdmesh_cache_client::mirror::Mirror;
use prost::Message as _;

/// The lease a request names: 16 bytes, or INVALID_ARGUMENT (never echoing it).
fn lease_of(b: &[u8]) -> Result<Lease, Status> {
    Lease::from_wire(b).map_err(|e| Status::invalid_argument(e.to_string()))
}

impl From<CacheError> for Status {
    fn from(e: CacheError) -> Self {
        let msg = e.to_string();
        match e {
            CacheError::LayoutMismatch { .. }
            | CacheError::PeerLayoutMismatch { .. }
            | CacheError::TooSmall { .. } => Status::failed_precondition(msg),
            CacheError::NoLayoutYet | CacheError::Draining => Status::unavailable(msg),
            CacheError::BadLayout(_)
            | CacheError::WrongSize { .. }
            | CacheError::DuplicateSlot(_) => Status::invalid_argument(msg),
            CacheError::UnknownLease(_) => Status::not_found(msg),
            CacheError::NotHeld { .. } => Status::failed_precondition(msg),
            CacheError::Io(_) => Status::internal(msg),
            CacheError::MirrorFull { .. } => Status::resource_exhausted(msg),
            CacheError::BadRoomCall(_) => Status::invalid_argument(msg),
            CacheError::Room(r) => match r {
                RoomError::Failed { .. } => Status::aborted(msg),
                RoomError::Unknown(_) => Status::not_found(msg),
                RoomError::SideTaken { .. } => Status::already_exists(msg),
                RoomError::NotYours { .. } => Status::permission_denied(msg),
                RoomError::WrongState { .. } => Status::failed_precondition(msg),
            },
        }
    }
}

/// Shared between the gRPC handlers and the lease reaper.
#[derive(Clone)]
pub(crate) struct Shared {
    pub state: Arc<Mutex<State>>,
    pub events: broadcast::Sender<pb::KvEvent>,
    seq: Arc<std::sync::atomic::AtomicU64>,
    /// The rooms' version: room waiters look again whenever it changes.
    pub rooms: tokio::sync::watch::Sender<u64>,
}

impl Shared {
    pub fn new(state: State) -> Self {
        Self {
            state: Arc::new(Mutex::new(state)),
            events: broadcast::channel(1024).0,
            seq: Default::default(),
            rooms: tokio::sync::watch::channel(0).0,
        }
    }

    /// Runs `f` on the state, then publishes the events it produced.
    pub fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let mut st = self.state.lock().expect("cache state lock");
        let out = f(&mut st);
        let version = st.rooms_version();
        self.rooms.send_if_modified(|v| {
            let changed = *v != version;
            *v = version;
            changed
        });
        for e in st.take_events() {
            let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            let kind = match e {
                Event::Stored { parent, hashes } => pb::kv_event::Kind::Stored(pb::PagesStored {
                    parent_hash: parent,
                    hashes,
                    // The mirror keeps pages by hash, not their tokens.
                    token_ids: Vec::new(),
                }),
                Event::Removed { hashes } => {
                    pb::kv_event::Kind::Removed(pb::PagesRemoved { hashes })
                }
            };
            // No subscriber is fine: events are for whoever listens now.
            let _ = self.events.send(pb::KvEvent {
                seq,
                kind: Some(kind),
            });
        }
        out
    }
}

pub(crate) struct CacheService {
    shared: Shared,
    /// Ends the event streams, which would otherwise hold a graceful shutdown forever.
    shutdown: tokio_util::sync::CancellationToken,
    /// Links to the homes of rooms relayed from here.
    peers: Arc<Peers>,
    /// The tcp page transport's port, told to peers that register.
    peer_port: u16,
    /// Where this service's incident reports go, for their counts in Stats.
    incidents: Option<Arc<pdmesh_incident::Reporter>>,
}

impl CacheService {
    pub fn new(
        shared: Shared,
        shutdown: tokio_util::sync::CancellationToken,
        peers: Arc<Peers>,
        peer_port: u16,
    ) -> Self {
        Self {
            shared,
            shutdown,
            peers,
            peer_port,
            incidents: None,
        }
    }

    /// Counts the reports `r` files in Stats.
    pub fn with_incidents(mut self, r: Option<Arc<pdmesh_incident::Reporter>>) -> Self {
        self.incidents = r;
        self
    }

    /// The link to the home of relayed `room`, if it is relayed from here: the one the
    /// home opened the room for. The room lives there only as long as that link's lease;
    /// once the link registered again (the lease ran out, over a partition say), the room
    /// is gone at its home, and it fails here too.
    async fn relay(&self, room: u64) -> Result<Option<Arc<Link>>, Status> {
        let Some((home, lease)) = self.shared.with(|s| {
            s.relay_link(room)
                .map(|(home, lease)| (home.to_owned(), lease))
        }) else {
            return Ok(None);
        };
        match self.peers.existing(&home).await {
            Some(link) if Some(link.lease) == lease => Ok(Some(link)),
            _ => {
                self.shared.with(|s| s.relay_end(room, true));
                let reason = format!(
                    "this host's link to the room's home {home} lost the lease the room was opened with"
                );
                Err(CacheError::Room(RoomError::Failed { room, reason }).into())
            }
        }
    }

    /// Ends relayed `room` here and tells its home (bounded, in the background).
    fn end_relay(&self, link: Option<Arc<Link>>, room: u64, sender_done: bool, reason: String) {
        self.shared.with(|s| s.relay_end(room, sender_done));
        if let Some(link) = link {
            tokio::spawn(async move {
                if let Err(e) = link.room_abort(room, &reason).await {
                    tracing::debug!(room, error = %e.message(), "telling the room's home it failed");
                }
            });
        }
    }

    async fn relayed_commit(
        &self,
        link: Arc<Link>,
        lease: Lease,
        r: pb::RoomCommitRequest,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let room = r.room;
        let pages = pages_from_pb(&r.pages);
        let plan = match self.shared.with(|s| s.relay_commit(lease, room, &pages)) {
            Ok(p) => p,
            Err(e @ CacheError::Room(RoomError::Unknown(_))) => {
                // The relay failed here already: a late commit, refused.
                self.shared.with(|s| s.relay_sender_done(lease, room, true));
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        };
        let t0 = Instant::now();
        // The sender finished writing these slots; they stay ours until the relay ends,
        // and the transport copies each straight from the mirror into its frame.
        let out = MirrorPages {
            mirror: &plan.mirror,
            slots: &plan.slots,
            pages: &pages,
        };
        // The commit rides on the last batch: the home runs it once every page landed.
        let commit = pb::RoomCommitRequest {
            lease: link.lease.to_wire(),
            room,
            pages: plan
                .remote_slots
                .iter()
                .zip(&pages)
                .map(|(&slot, p)| pb::RoomPage {
                    slot,
                    checksum: p.checksum,
                })
                .collect(),
            aux: r.aux,
        }
        .encode_to_vec();
        let done = match link.send(room, &out, Some(&commit)).await {
            Err(e) => {
                if let crate::transfer::TransferError::LayoutRefused { peer, reason } = &e {
                    self.shared.with(|s| s.peer_layout_refused(peer, reason));
                }
                Err(e.status())
            }
            Ok(sent) => peer_commit_result(&link.url, sent.reply.as_deref()).map(|st| (st, sent)),
        };
        match done {
            Ok((st, sent)) => {
                self.shared.with(|s| {
                    s.relay_end(room, true);
                    s.count_peer_sent(sent.pages, sent.bytes);
                });
                tracing::debug!(room, pages = sent.pages, bytes = sent.bytes, secs = t0.elapsed().as_secs_f64(), home = %link.url, "pages moved to the room's home");
                Ok(Response::new(st))
            }
            Err(e) => {
                self.shared.with(|s| s.count_peer_failure());
                tracing::warn!(room, home = %link.url, error = %e.message(), "moving a room's pages to its home failed");
                let reason = format!(
                    "the sender's host could not move the pages: {}",
                    e.message()
                );
                self.end_relay(Some(link), room, true, reason);
                Err(e)
            }
        }
    }
}

type PageStream = Pin<Box<dyn Stream<Item = Result<pb::PageData, Status>> + Send>>;
type EventStream = Pin<Box<dyn Stream<Item = Result<pb::KvEvent, Status>> + Send>>;

/// Who may call each RPC (over mutual TLS, by the roles in the caller's certificate):
/// workers and peer cache services the page and room calls (registering as a peer needs
/// the cache role, checked in `register`), the gateway the KV events it routes by, any
/// member Stats.
pub static POLICY: pdmesh_tls::Policy = {
    use pdmesh_tls::Roles;
    const W: Roles = Roles::WORKER_OR_CACHE;
    pdmesh_tls::Policy {
        service: "pdmesh.cache.v1.Cache",
        methods: &[
            ("Register", W),
            ("Heartbeat", W),
            ("Match", W),
            ("Reserve", W),
            ("Commit", W),
            ("Load", W),
            ("Release", W),
            ("Discard", W),
            ("SubscribeEvents", Roles::GATEWAY),
            ("Stats", Roles::ANY),
            ("RoomOpen", W),
            ("RoomWait", W),
            ("RoomStart", W),
            ("RoomCommit", W),
            ("RoomResult", W),
            ("RoomFinish", W),
            ("RoomAbort", W),
        ],
    }
};

#[tonic::async_trait]
impl pb::cache_server::Cache for CacheService {
    async fn register(
        &self,
        request: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        let caller = pdmesh_tls::Caller::of(&request);
        let r = request.into_inner();
        if r.data_plane == pb::DataPlane::Peer as i32 {
            caller.require(pdmesh_tls::Roles::CACHE, "Register as a peer cache service")?;
        }
        let layout = r
            .layout
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("layout is required"))
            .and_then(|l| layout_from_pb(l).map_err(|e| CacheError::BadLayout(e).into()))?;
        if r.worker_id.is_empty() {
            return Err(Status::invalid_argument("worker_id is required"));
        }
        let reg = if r.data_plane == pb::DataPlane::Peer as i32 {
            self.shared
                .with(|s| s.register_peer(&r.worker_id, &layout, Instant::now()))?
        } else {
            self.shared
                .with(|s| s.register(&r.worker_id, layout, Instant::now()))?
        };
        Ok(Response::new(pb::RegisterResponse {
            lease: reg.lease.to_wire(),
            lease_ttl_ms: reg.lease_ttl.as_millis() as u32,
            shm_path: reg.shm_path.to_string_lossy().into_owned(),
            page_bytes: reg.page_bytes as u64,
            total_pages: reg.total_pages as u32,
            layout_fingerprint: reg.layout.fingerprint_hex(),
            peer_port: u32::from(self.peer_port),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let lease = lease_of(&request.into_inner().lease)?;
        self.shared.with(|s| s.heartbeat(lease, Instant::now()))?;
        Ok(Response::new(pb::HeartbeatResponse {}))
    }

    async fn r#match(
        &self,
        request: Request<pb::MatchRequest>,
    ) -> Result<Response<pb::MatchResponse>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        let pages = self.shared.with(|s| s.match_pages(lease, &r.hashes))?;
        Ok(Response::new(pb::MatchResponse {
            pages: pages
                .into_iter()
                .map(|p| pb::PageRef {
                    hash: p.hash,
                    slot: p.slot,
                    checksum: p.checksum,
                })
                .collect(),
        }))
    }

    async fn reserve(
        &self,
        request: Request<pb::ReserveRequest>,
    ) -> Result<Response<pb::ReserveResponse>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        let grants = self.shared.with(|s| s.reserve(lease, &r.hashes))?;
        Ok(Response::new(pb::ReserveResponse {
            grants: grants
                .into_iter()
                .map(|(hash, slot)| pb::Grant { hash, slot })
                .collect(),
        }))
    }

    async fn commit(
        &self,
        request: Request<pb::CommitRequest>,
    ) -> Result<Response<pb::CommitResponse>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        let pages = r
            .pages
            .into_iter()
            .map(|p| CommitPage {
                hash: p.hash,
                slot: p.slot,
                checksum: p.checksum,
                data: (!p.data.is_empty()).then_some(p.data),
                parent: p.parent_hash,
            })
            .collect();
        let rejected = self.shared.with(|s| s.commit(lease, pages))?;
        Ok(Response::new(pb::CommitResponse {
            rejected_slots: rejected,
        }))
    }

    type LoadStream = PageStream;

    async fn load(
        &self,
        request: Request<pb::LoadRequest>,
    ) -> Result<Response<Self::LoadStream>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        let (checksums, mirror) = self.shared.with(|s| {
            let sums = s.check_pinned(lease, &r.slots)?;
            Ok::<_, CacheError>((sums, s.mirror().expect("a lease implies a mirror")))
        })?;
        // Pinned pages cannot be evicted or rewritten while the lease holds them, so their
        // bytes are read outside the lock, one page per message.
        let pages = r
            .slots
            .into_iter()
            .zip(checksums)
            .map(move |(slot, checksum)| {
                let mut data = vec![0u8; mirror.page_bytes()];
                mirror.read(slot, &mut data);
                Ok(pb::PageData {
                    slot,
                    checksum,
                    data,
                })
            });
        Ok(Response::new(Box::pin(tokio_stream::iter(pages))))
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        self.shared.with(|s| s.release(lease, &r.slots))?;
        Ok(Response::new(pb::ReleaseResponse {}))
    }

    async fn discard(
        &self,
        request: Request<pb::DiscardRequest>,
    ) -> Result<Response<pb::DiscardResponse>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        let n = self.shared.with(|s| s.discard(lease, &r.hashes))?;
        Ok(Response::new(pb::DiscardResponse {
            discarded: n as u32,
        }))
    }

    type SubscribeEventsStream = EventStream;

    async fn subscribe_events(
        &self,
        _request: Request<pb::SubscribeEventsRequest>,
    ) -> Result<Response<Self::SubscribeEventsStream>, Status> {
        let rx = self.shared.events.subscribe();
        let stream = tokio_stream::wrappers::BroadcastStream::new(rx).map(|e| {
            e.map_err(|lag| Status::data_loss(format!("event stream fell behind: {lag}")))
        });
        let stream =
            futures::StreamExt::take_until(stream, self.shutdown.clone().cancelled_owned());
        Ok(Response::new(Box::pin(stream)))
    }

    async fn stats(
        &self,
        _request: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        let (st, layout, rooms) = self.shared.with(|s| {
            (
                s.stats(),
                s.layout().map(|l| l.to_string()),
                s.room_stats(Instant::now()),
            )
        });
        Ok(Response::new(pb::StatsResponse {
            total_pages: st.total_pages as u32,
            used_pages: st.used_pages as u32,
            pinned_pages: st.pinned_pages as u32,
            leases: st.leases as u32,
            evicted_pages: st.evicted_pages,
            checksum_failures: st.checksum_failures,
            expired_leases: st.expired_leases,
            layout: layout.unwrap_or_default(),
            rooms: rooms
                .census
                .iter()
                .map(|(st, n, _)| (st.name().to_owned(), *n as u32))
                .collect(),
            rooms_older_than: rooms
                .older_than
                .iter()
                .map(|(t, n)| (format!("{t}"), *n as u32))
                .collect(),
            oldest_room_seconds: rooms
                .census
                .iter()
                .map(|(st, _, age)| (st.name().to_owned(), age.as_secs_f64()))
                .collect(),
            room_timeouts: rooms
                .timeouts
                .iter()
                .map(|(k, v)| (k.name().to_owned(), *v))
                .collect(),
            room_aborts: rooms
                .aborts
                .iter()
                .map(|(k, v)| (k.name().to_owned(), *v))
                .collect(),
            rooms_finished: rooms.finished,
            transfer_pages: rooms.transfer_pages,
            transfer_bytes: rooms.transfer_bytes,
            room_slots: rooms.room_slots as u32,
            quarantined_slots: rooms.quarantined_slots as u32,
            room_stalls: rooms.stalls,
            late_writes_rejected: rooms.late_writes_rejected,
            peer_layout_refusals: rooms.peer.layout_refusals,
            peer_pages_received: rooms.peer.pages_received,
            peer_bytes_received: rooms.peer.bytes_received,
            peer_pages_sent: rooms.peer.pages_sent,
            peer_bytes_sent: rooms.peer.bytes_sent,
            peer_transfer_failures: rooms.peer.transfer_failures,
            held_pages_skipped: rooms.peer.held_pages_skipped,
            incidents: self
                .incidents
                .as_ref()
                .map(|r| r.counts())
                .unwrap_or_default(),
            auth_refused: pdmesh_tls::auth::refused_total(),
            insecure_plaintext: pdmesh_tls::auth::insecure(),
        }))
    }

    async fn room_open(
        &self,
        request: Request<pb::RoomOpenRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        let side = match pb::RoomSide::try_from(r.side) {
            Ok(pb::RoomSide::Sender) => Side::Sender,
            Ok(pb::RoomSide::Receiver) => Side::Receiver,
            _ => return Err(Status::invalid_argument("side must be SENDER or RECEIVER")),
        };
        let span = traced(r.room, None);
        span.record("pdmesh.request_id", r.request_id.as_str());
        if !r.home.is_empty() {
            if side != Side::Sender {
                return Err(Status::invalid_argument(
                    "only a sender names a room's home: a receiver opens it on its own host",
                ));
            }
            self.peers.admits(&r.home)?;
            let layout = self.shared.with(|s| {
                s.relay_open(lease, r.room, &r.home, Instant::now())?;
                Ok::<_, CacheError>(s.layout().cloned().expect("a lease implies a layout"))
            })?;
            let opened = async {
                let link = self.peers.link(&r.home, &layout).await?;
                match link.room_open(r.room, &r.request_id, &r.trace_id).await {
                    // A room open names no room the home must know (it makes it): NOT_FOUND
                    // is this host's lease there, which ran out while the hosts could not
                    // reach each other, before a heartbeat could tell. Nothing was opened:
                    // register again and open once more.
                    Err(e) if e.code() == tonic::Code::NotFound => {
                        link.lost();
                        let link = self.peers.link(&r.home, &layout).await?;
                        let st = link.room_open(r.room, &r.request_id, &r.trace_id).await?;
                        Ok((link, st))
                    }
                    opened => opened.map(|st| (link, st)),
                }
            }
            .await;
            return match opened {
                Ok((link, st)) => {
                    self.shared.with(|s| {
                        if st.state == pb::RoomState::Failed as i32 {
                            s.relay_end(r.room, true);
                        } else {
                            s.relay_linked(r.room, link.lease);
                        }
                    });
                    Ok(Response::new(st))
                }
                Err(e) => {
                    if e.code() == tonic::Code::FailedPrecondition {
                        tracing::warn!(room = r.room, home = %r.home, error = %e.message(), "the room's home refused this host");
                    }
                    self.shared.with(|s| s.relay_end(r.room, true));
                    // The home's NOT_FOUND names this host's lease there, never the
                    // sender's here, which would take it for its own and register again.
                    Err(match e.code() {
                        tonic::Code::NotFound => Status::unavailable(format!(
                            "the room's home does not know this host's link: {}",
                            e.message()
                        )),
                        _ => e,
                    })
                }
            };
        }
        let (st, held) = self.shared.with(|s| {
            let st = s.room_open(
                lease,
                r.room,
                side,
                (&r.request_id, &r.trace_id),
                r.held_pages,
                Instant::now(),
            )?;
            Ok::<_, CacheError>((st, s.room_held(r.room)))
        })?;
        traced(r.room, Some(st));
        Ok(Response::new(status(st, None).held(held)))
    }

    async fn room_wait(
        &self,
        request: Request<pb::RoomWaitRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        let until = room_state_from_pb(r.until)
            .ok_or_else(|| Status::invalid_argument("until must be a room state"))?;
        if let Some(link) = self.relay(r.room).await? {
            self.shared.with(|s| s.heartbeat(lease, Instant::now()))?;
            let st = link.room_wait(r.room, r.until, r.timeout_ms).await;
            if let Ok(st) = &st
                && st.state == pb::RoomState::Failed as i32
            {
                self.shared.with(|s| s.relay_end(r.room, true));
            }
            return st.map(Response::new);
        }
        // Long polls are bounded so a vanished caller never holds a task for long.
        let deadline = tokio::time::Instant::now()
            + std::time::Duration::from_millis(u64::from(r.timeout_ms.min(60_000)));
        let mut changed = self.shared.rooms.subscribe();
        loop {
            let (now, held) = self.shared.with(|s| {
                s.heartbeat(lease, Instant::now())?;
                Ok::<_, CacheError>((s.room_state(r.room), s.room_held(r.room)))
            })?;
            let Some((st, why)) = now else {
                return Err(CacheError::Room(RoomError::Unknown(r.room)).into());
            };
            // The state the wait ends in: a room stuck in a state shows up as waits
            // ending in it.
            traced(r.room, Some(st));
            if st == RoomState::Failed || st as i32 >= until as i32 {
                return Ok(Response::new(status(st, why).held(held)));
            }
            tokio::select! {
                c = changed.changed() => if c.is_err() {
                    return Err(Status::unavailable("the cache service is stopping"));
                },
                _ = tokio::time::sleep_until(deadline) => {
                    return Ok(Response::new(status(st, why).held(held)));
                }
                _ = self.shutdown.cancelled() => {
                    return Err(Status::unavailable("the cache service is stopping"));
                }
            }
        }
    }

    async fn room_start(
        &self,
        request: Request<pb::RoomStartRequest>,
    ) -> Result<Response<pb::RoomStartResponse>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        traced(r.room, None);
        if let Some(link) = self.relay(r.room).await? {
            // Slots here first: a full mirror here leaves the home's room waiting.
            let slots = self
                .shared
                .with(|s| s.relay_take_slots(lease, r.room, r.pages as usize))?;
            let remote = link.room_start(r.room, r.pages).await;
            return match remote {
                Ok(remote) if remote.len() == slots.len() => {
                    if self
                        .shared
                        .with(|s| s.relay_started(r.room, slots.clone(), remote, Instant::now()))
                    {
                        traced(r.room, Some(RoomState::Transferring));
                        Ok(Response::new(pb::RoomStartResponse { slots }))
                    } else {
                        Err(CacheError::Room(RoomError::Unknown(r.room)).into())
                    }
                }
                Ok(remote) => {
                    self.shared.with(|s| s.relay_unstart(&slots));
                    let msg = format!(
                        "the room's home granted {} slots for {} pages",
                        remote.len(),
                        slots.len()
                    );
                    self.end_relay(Some(link), r.room, true, msg.clone());
                    Err(Status::internal(msg))
                }
                Err(e) => {
                    self.shared.with(|s| s.relay_unstart(&slots));
                    Err(e)
                }
            };
        }
        let slots = self
            .shared
            .with(|s| s.room_start(lease, r.room, r.pages as usize, Instant::now()))?;
        traced(r.room, Some(RoomState::Transferring));
        Ok(Response::new(pb::RoomStartResponse { slots }))
    }

    async fn room_commit(
        &self,
        request: Request<pb::RoomCommitRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        if r.aux.as_ref().is_none_or(|a| a.room != r.room) {
            return Err(Status::invalid_argument(
                "aux is required and must name the room",
            ));
        }
        if let Some(link) = self.relay(r.room).await? {
            return self.relayed_commit(link, lease, r).await;
        }
        Ok(Response::new(commit_here(&self.shared, r)?))
    }

    async fn room_result(
        &self,
        request: Request<pb::RoomRef>,
    ) -> Result<Response<pb::RoomResultResponse>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        traced(r.room, None);
        self.not_relayed(r.room)?;
        let (pages, aux) = self.shared.with(|s| s.room_result(lease, r.room))?;
        Ok(Response::new(pb::RoomResultResponse {
            pages: pages
                .into_iter()
                .map(|p| pb::RoomPage {
                    slot: p.slot,
                    checksum: p.checksum,
                })
                .collect(),
            aux: Some(aux_to_pb(aux)),
        }))
    }

    async fn room_finish(
        &self,
        request: Request<pb::RoomRef>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        traced(r.room, None);
        self.not_relayed(r.room)?;
        self.shared.with(|s| s.room_finish(lease, r.room))?;
        Ok(Response::new(status(RoomState::Success, None)))
    }

    async fn room_abort(
        &self,
        request: Request<pb::RoomAbortRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        traced(r.room, Some(RoomState::Failed));
        let reason = if r.reason.is_empty() {
            "no reason given"
        } else {
            &r.reason
        };
        let relayed = self.shared.with(|s| {
            s.relay_home(r.room).map(str::to_owned).or_else(|| {
                // A relayed room that failed here already: its sender is done now.
                s.relay_sender_done(lease, r.room, false);
                None
            })
        });
        if let Some(home) = relayed {
            let mine = self.shared.with(|s| s.relay_owner(r.room) == Some(lease));
            if !mine {
                return Err(Status::permission_denied(format!(
                    "this lease is not the sender of room {}",
                    r.room
                )));
            }
            let link = self.peers.existing(&home).await;
            self.end_relay(link, r.room, true, format!("aborted: {reason}"));
            return Ok(Response::new(status(
                RoomState::Failed,
                Some(reason.to_owned()),
            )));
        }
        let st = self.shared.with(|s| {
            s.room_abort(lease, r.room, reason, Instant::now())?;
            Ok::<_, CacheError>(s.room_state(r.room))
        })?;
        let (st, why) = st.unwrap_or((RoomState::Failed, None));
        Ok(Response::new(status(st, why)))
    }
}

impl CacheService {
    fn not_relayed(&self, room: u64) -> Result<(), Status> {
        match self.shared.with(|s| s.relay_home(room).is_some()) {
            true => Err(Status::invalid_argument(format!(
                "room {room} lives on another host: its receiver takes its pages there"
            ))),
            false => Ok(()),
        }
    }
}

fn room_state_pb(s: RoomState) -> pb::RoomState {
    match s {
        RoomState::Failed => pb::RoomState::Failed,
        RoomState::Bootstrapping => pb::RoomState::Bootstrapping,
        RoomState::WaitingForInput => pb::RoomState::WaitingForInput,
        RoomState::Transferring => pb::RoomState::Transferring,
        RoomState::Success => pb::RoomState::Success,
    }
}

fn room_state_from_pb(v: i32) -> Option<RoomState> {
    Some(match pb::RoomState::try_from(v).ok()? {
        pb::RoomState::Failed => RoomState::Failed,
        pb::RoomState::Bootstrapping => RoomState::Bootstrapping,
        pb::RoomState::WaitingForInput => RoomState::WaitingForInput,
        pb::RoomState::Transferring => RoomState::Transferring,
        pb::RoomState::Success => RoomState::Success,
    })
}

trait Held {
    fn held(self, pages: u32) -> Self;
}

impl Held for pb::RoomStatus {
    /// With the receiver's held pages.
    fn held(mut self, pages: u32) -> Self {
        self.held_pages = pages;
        self
    }
}

/// Commits a room whose home is this host (from a worker here, or from a peer host).
fn commit_here(shared: &Shared, r: pb::RoomCommitRequest) -> Result<pb::RoomStatus, Status> {
    let aux = r
        .aux
        .ok_or_else(|| Status::invalid_argument("aux is required"))?;
    if aux.room != r.room {
        return Err(Status::invalid_argument("aux must name the room"));
    }
    let pages = pages_from_pb(&r.pages);
    let aux = aux_from_pb(aux);
    traced(r.room, None);
    let lease = lease_of(&r.lease)?;
    shared.with(|s| s.room_commit(lease, r.room, pages, aux, Instant::now()))?;
    traced(r.room, Some(RoomState::Success));
    Ok(status(RoomState::Success, None))
}

fn pages_from_pb(pages: &[pb::RoomPage]) -> Vec<RoomPage> {
    pages
        .iter()
        .map(|p| RoomPage {
            slot: p.slot,
            checksum: p.checksum,
        })
        .collect()
}

fn aux_from_pb(a: pb::RoomAux) -> Aux {
    Aux {
        room: a.room,
        first_token: a.first_token,
        first_logprob: a.first_logprob,
        first_top: a
            .first_top_logprobs
            .iter()
            .map(|t| (t.token_id, t.logprob))
            .collect(),
        prompt_tokens: a.prompt_tokens,
        cached_tokens: a.cached_tokens,
        host_cached_tokens: a.host_cached_tokens,
        queue_seconds: a.queue_seconds,
        prefill_seconds: a.prefill_seconds,
        send_seconds: a.send_seconds,
    }
}

fn aux_to_pb(a: Aux) -> pb::RoomAux {
    pb::RoomAux {
        room: a.room,
        first_token: a.first_token,
        first_logprob: a.first_logprob,
        first_top_logprobs: a
            .first_top
            .iter()
            .map(|&(token_id, logprob)| pb::TopToken { token_id, logprob })
            .collect(),
        prompt_tokens: a.prompt_tokens,
        cached_tokens: a.cached_tokens,
        host_cached_tokens: a.host_cached_tokens,
        queue_seconds: a.queue_seconds,
        prefill_seconds: a.prefill_seconds,
        send_seconds: a.send_seconds,
    }
}

/// The page transport's trailer at a room's home: a peer's commit of `room` (an encoded
/// RoomCommitRequest), run once its last pages landed. The reply is an encoded
/// PeerCommitReply.
/// The commit riding on a peer's last batch for `room`, over the connection of `sender`'s
/// lease: only that lease may commit with it.
pub(crate) fn peer_commit(shared: &Shared, room: u64, sender: Lease, trailer: &[u8]) -> Vec<u8> {
    let done = match pb::RoomCommitRequest::decode(trailer) {
        Err(e) => Err(Status::invalid_argument(format!(
            "a room commit that does not decode: {e}"
        ))),
        Ok(r) if r.room != room => Err(Status::invalid_argument(format!(
            "a commit of room {} after the pages of room {room}",
            r.room
        ))),
        // The page transport carries peers' rooms only: a local worker's lease is not
        // one a peer may commit with.
        Ok(r) if Lease::from_wire(&r.lease).is_ok_and(|l| !shared.with(|s| s.is_peer_lease(l))) => {
            Err(Status::permission_denied(
                "this lease is not a peer host's".to_owned(),
            ))
        }
        Ok(r) if Lease::from_wire(&r.lease).is_ok_and(|l| l != sender) => {
            Err(Status::permission_denied(
                "a commit with another lease than this connection's".to_owned(),
            ))
        }
        Ok(r) => commit_here(shared, r),
    };
    let reply = match done {
        Ok(st) => pb::PeerCommitReply {
            code: 0,
            message: String::new(),
            status: Some(st),
        },
        Err(e) => {
            tracing::warn!(room, code = ?e.code(), error = %e.message(), "a peer's room commit refused");
            pb::PeerCommitReply {
                code: e.code() as i32,
                message: e.message().to_owned(),
                status: None,
            }
        }
    };
    reply.encode_to_vec()
}

/// What a home's reply to a commit trailer says.
fn peer_commit_result(home: &str, reply: Option<&[u8]>) -> Result<pb::RoomStatus, Status> {
    let reply = reply
        .map(pb::PeerCommitReply::decode)
        .transpose()
        .map_err(|e| Status::internal(format!("{home} answered a room commit with {e}")))?
        .unwrap_or_default();
    match (reply.code, reply.status) {
        (0, Some(st)) => Ok(st),
        (0, None) => Err(Status::internal(format!(
            "{home} answered a room commit with no status"
        ))),
        (code, _) => Err(Status::new(
            tonic::Code::from(code),
            format!("room commit at {home}: {}", reply.message),
        )),
    }
}

/// A relayed room's pages, read from the slots its sender wrote in this host's mirror.
struct MirrorPages<'a> {
    mirror: &'a Mirror,
    slots: &'a [u32],
    pages: &'a [RoomPage],
}

impl Pages for MirrorPages<'_> {
    fn count(&self) -> usize {
        self.slots.len()
    }
    fn meta(&self, i: usize) -> (u32, u64) {
        (i as u32, self.pages[i].checksum)
    }
    fn len_of(&self, _: usize) -> usize {
        self.mirror.page_bytes()
    }
    fn copy_to(&self, i: usize, dst: &mut [u8]) {
        self.mirror.read(self.slots[i], dst);
    }
}

fn status(st: RoomState, why: Option<String>) -> pb::RoomStatus {
    pb::RoomStatus {
        state: room_state_pb(st).into(),
        reason: why.unwrap_or_default(),
        held_pages: 0,
    }
}

/// Records a room call's room (and the state it leaves the room in) on the call's span,
/// which exists when the call carries trace context.
fn traced(room: u64, state: Option<RoomState>) -> tracing::Span {
    let span = tracing::Span::current();
    span.record("pdmesh.room", room);
    if let Some(st) = state {
        span.record("pdmesh.room.state", st.name());
    }
    span
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::MirrorSize;

    #[test]
    fn a_commit_trailer_that_does_not_decode_or_names_another_room_is_refused_with_a_code() {
        let dir = tempfile::tempdir().unwrap();
        let shared = Shared::new(State::new(
            MirrorSize::Tokens(64),
            Some(crate::mirror::private_dir(dir.path()).unwrap()),
            Duration::from_secs(10),
        ));
        // Over the page-transport connection of lease `sender`.
        let reply = |room, sender, trailer: &[u8]| {
            pb::PeerCommitReply::decode(&peer_commit(&shared, room, sender, trailer)[..]).unwrap()
        };
        let garbage = reply(7, Lease::from_test_number(1), &[0xff; 9]);
        assert_eq!(garbage.code, tonic::Code::InvalidArgument as i32);
        assert!(garbage.message.contains("does not decode"), "{garbage:?}");
        let other = pb::RoomCommitRequest {
            room: 8,
            ..Default::default()
        }
        .encode_to_vec();
        let other = reply(7, Lease::from_test_number(1), &other);
        assert_eq!(other.code, tonic::Code::InvalidArgument as i32);
        assert!(other.message.contains("room 8"), "{other:?}");
        // A lease that is not a peer's (unknown here, or a local worker's) is refused.
        let commit_over = |lease: Lease, sender: Lease| {
            let req = pb::RoomCommitRequest {
                lease: lease.to_wire(),
                room: 7,
                pages: Vec::new(),
                aux: Some(pb::RoomAux {
                    room: 7,
                    ..Default::default()
                }),
            };
            reply(7, sender, &req.encode_to_vec())
        };
        let commit_with = |lease: Lease| commit_over(lease, lease);
        let unknown = commit_with(Lease::from_test_number(99));
        assert_eq!(
            unknown.code,
            tonic::Code::PermissionDenied as i32,
            "{unknown:?}"
        );
        assert!(unknown.status.is_none());
        let layout = pdmesh_kv::KvLayout::llama(2, 1, 8, pdmesh_kv::DType::F16, 16);
        let worker = shared
            .with(|s| s.register("w", layout.clone(), std::time::Instant::now()))
            .unwrap()
            .lease;
        let local = commit_with(worker);
        assert_eq!(
            local.code,
            tonic::Code::PermissionDenied as i32,
            "{local:?}"
        );
        assert!(local.message.contains("not a peer"), "{local:?}");
        // A peer's lease commits only over its own connection.
        let peer = shared
            .with(|s| s.register_peer("p", &layout, std::time::Instant::now()))
            .unwrap()
            .lease;
        let other_peer = shared
            .with(|s| s.register_peer("q", &layout, std::time::Instant::now()))
            .unwrap()
            .lease;
        let stolen = commit_over(peer, other_peer);
        assert_eq!(
            stolen.code,
            tonic::Code::PermissionDenied as i32,
            "{stolen:?}"
        );
        assert!(stolen.message.contains("another lease"), "{stolen:?}");
    }

    #[test]
    fn a_homes_reply_to_a_commit_becomes_the_status_or_the_error_it_names() {
        let ok = pb::PeerCommitReply {
            code: 0,
            message: String::new(),
            status: Some(status(RoomState::Success, None)),
        }
        .encode_to_vec();
        let st = peer_commit_result("home", Some(&ok)).unwrap();
        assert_eq!(st.state, pb::RoomState::Success as i32);
        let refused = pb::PeerCommitReply {
            code: tonic::Code::Aborted as i32,
            message: "room 3 failed: deadline".into(),
            status: None,
        }
        .encode_to_vec();
        let e = peer_commit_result("home", Some(&refused)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Aborted);
        assert!(e.message().contains("room 3 failed: deadline") && e.message().contains("home"));
        for bad in [None, Some(&[0xffu8; 3][..])] {
            let e = peer_commit_result("home", bad).unwrap_err();
            assert_eq!(e.code(), tonic::Code::Internal, "{e:?}");
        }
    }
}

#[cfg(test)]
#[test]
fn every_rpc_has_the_roles_that_may_call_it() {
    let proto = include_str!("../../../proto/pdmesh/cache/v1/cache.proto");
    assert_eq!(POLICY.unlisted(proto), Vec::<&str>::new());
}

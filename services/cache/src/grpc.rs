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

use crate::rooms::{Aux, RoomError, RoomPage, RoomState, Side};
use crate::state::{CacheError, CommitPage, Event, State};
use crate::wire::layout_from_pb;

impl From<CacheError> for Status {
    fn from(e: CacheError) -> Self {
        let msg = e.to_string();
        match e {
            CacheError::LayoutMismatch { .. } | CacheError::TooSmall { .. } => {
                Status::failed_precondition(msg)
            }
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
}

impl CacheService {
    pub fn new(shared: Shared, shutdown: tokio_util::sync::CancellationToken) -> Self {
        Self { shared, shutdown }
    }
}

type PageStream = Pin<Box<dyn Stream<Item = Result<pb::PageData, Status>> + Send>>;
type EventStream = Pin<Box<dyn Stream<Item = Result<pb::KvEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::cache_server::Cache for CacheService {
    async fn register(
        &self,
        request: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        let r = request.into_inner();
        let layout = r
            .layout
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("layout is required"))
            .and_then(|l| layout_from_pb(l).map_err(|e| CacheError::BadLayout(e).into()))?;
        if r.worker_id.is_empty() {
            return Err(Status::invalid_argument("worker_id is required"));
        }
        let reg = self
            .shared
            .with(|s| s.register(&r.worker_id, layout, Instant::now()))?;
        Ok(Response::new(pb::RegisterResponse {
            lease: reg.lease,
            lease_ttl_ms: reg.lease_ttl.as_millis() as u32,
            shm_path: reg.shm_path.to_string_lossy().into_owned(),
            page_bytes: reg.page_bytes as u64,
            total_pages: reg.total_pages as u32,
            layout_fingerprint: reg.layout.fingerprint_hex(),
        }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let lease = request.into_inner().lease;
        self.shared.with(|s| s.heartbeat(lease, Instant::now()))?;
        Ok(Response::new(pb::HeartbeatResponse {}))
    }

    async fn r#match(
        &self,
        request: Request<pb::MatchRequest>,
    ) -> Result<Response<pb::MatchResponse>, Status> {
        let r = request.into_inner();
        let pages = self.shared.with(|s| s.match_pages(r.lease, &r.hashes))?;
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
        let grants = self.shared.with(|s| s.reserve(r.lease, &r.hashes))?;
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
        let rejected = self.shared.with(|s| s.commit(r.lease, pages))?;
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
        let (checksums, mirror) = self.shared.with(|s| {
            let sums = s.check_pinned(r.lease, &r.slots)?;
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
        self.shared.with(|s| s.release(r.lease, &r.slots))?;
        Ok(Response::new(pb::ReleaseResponse {}))
    }

    async fn discard(
        &self,
        request: Request<pb::DiscardRequest>,
    ) -> Result<Response<pb::DiscardResponse>, Status> {
        let r = request.into_inner();
        let n = self.shared.with(|s| s.discard(r.lease, &r.hashes))?;
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
        }))
    }

    async fn room_open(
        &self,
        request: Request<pb::RoomOpenRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        let side = match pb::RoomSide::try_from(r.side) {
            Ok(pb::RoomSide::Sender) => Side::Sender,
            Ok(pb::RoomSide::Receiver) => Side::Receiver,
            _ => return Err(Status::invalid_argument("side must be SENDER or RECEIVER")),
        };
        let span = traced(r.room, None);
        span.record("pdmesh.request_id", r.request_id.as_str());
        let st = self.shared.with(|s| {
            s.room_open(
                r.lease,
                r.room,
                side,
                &r.request_id,
                &r.trace_id,
                Instant::now(),
            )
        })?;
        traced(r.room, Some(st));
        Ok(Response::new(status(st, None)))
    }

    async fn room_wait(
        &self,
        request: Request<pb::RoomWaitRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        let until = room_state_from_pb(r.until)
            .ok_or_else(|| Status::invalid_argument("until must be a room state"))?;
        // Long polls are bounded so a vanished caller never holds a task for long.
        let deadline = tokio::time::Instant::now()
            + std::time::Duration::from_millis(u64::from(r.timeout_ms.min(60_000)));
        let mut changed = self.shared.rooms.subscribe();
        loop {
            let now = self.shared.with(|s| {
                s.heartbeat(r.lease, Instant::now())?;
                Ok::<_, CacheError>(s.room_state(r.room))
            })?;
            let Some((st, why)) = now else {
                return Err(CacheError::Room(RoomError::Unknown(r.room)).into());
            };
            // The state the wait ends in: a room stuck in a state shows up as waits
            // ending in it.
            traced(r.room, Some(st));
            if st == RoomState::Failed || st as i32 >= until as i32 {
                return Ok(Response::new(status(st, why)));
            }
            tokio::select! {
                c = changed.changed() => if c.is_err() {
                    return Err(Status::unavailable("the cache service is stopping"));
                },
                _ = tokio::time::sleep_until(deadline) => {
                    return Ok(Response::new(status(st, why)));
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
        traced(r.room, None);
        let slots = self
            .shared
            .with(|s| s.room_start(r.lease, r.room, r.pages as usize, Instant::now()))?;
        traced(r.room, Some(RoomState::Transferring));
        Ok(Response::new(pb::RoomStartResponse { slots }))
    }

    async fn room_commit(
        &self,
        request: Request<pb::RoomCommitRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        let aux = r
            .aux
            .ok_or_else(|| Status::invalid_argument("aux is required"))?;
        let pages = r
            .pages
            .iter()
            .map(|p| RoomPage {
                slot: p.slot,
                checksum: p.checksum,
            })
            .collect();
        let aux = Aux {
            room: aux.room,
            first_token: aux.first_token,
            first_logprob: aux.first_logprob,
            prompt_tokens: aux.prompt_tokens,
            cached_tokens: aux.cached_tokens,
            host_cached_tokens: aux.host_cached_tokens,
            queue_seconds: aux.queue_seconds,
            prefill_seconds: aux.prefill_seconds,
            send_seconds: aux.send_seconds,
        };
        traced(r.room, None);
        self.shared
            .with(|s| s.room_commit(r.lease, r.room, pages, aux, Instant::now()))?;
        traced(r.room, Some(RoomState::Success));
        Ok(Response::new(status(RoomState::Success, None)))
    }

    async fn room_result(
        &self,
        request: Request<pb::RoomRef>,
    ) -> Result<Response<pb::RoomResultResponse>, Status> {
        let r = request.into_inner();
        traced(r.room, None);
        let (pages, aux) = self.shared.with(|s| s.room_result(r.lease, r.room))?;
        Ok(Response::new(pb::RoomResultResponse {
            pages: pages
                .into_iter()
                .map(|p| pb::RoomPage {
                    slot: p.slot,
                    checksum: p.checksum,
                })
                .collect(),
            aux: Some(pb::RoomAux {
                room: aux.room,
                first_token: aux.first_token,
                first_logprob: aux.first_logprob,
                prompt_tokens: aux.prompt_tokens,
                cached_tokens: aux.cached_tokens,
                host_cached_tokens: aux.host_cached_tokens,
                queue_seconds: aux.queue_seconds,
                prefill_seconds: aux.prefill_seconds,
                send_seconds: aux.send_seconds,
            }),
        }))
    }

    async fn room_finish(
        &self,
        request: Request<pb::RoomRef>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        traced(r.room, None);
        self.shared.with(|s| s.room_finish(r.lease, r.room))?;
        Ok(Response::new(status(RoomState::Success, None)))
    }

    async fn room_abort(
        &self,
        request: Request<pb::RoomAbortRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        traced(r.room, Some(RoomState::Failed));
        let reason = if r.reason.is_empty() {
            "no reason given"
        } else {
            &r.reason
        };
        let st = self.shared.with(|s| {
            s.room_abort(r.lease, r.room, reason, Instant::now())?;
            Ok::<_, CacheError>(s.room_state(r.room))
        })?;
        let (st, why) = st.unwrap_or((RoomState::Failed, None));
        Ok(Response::new(status(st, why)))
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

fn status(st: RoomState, why: Option<String>) -> pb::RoomStatus {
    pb::RoomStatus {
        state: room_state_pb(st).into(),
        reason: why.unwrap_or_default(),
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

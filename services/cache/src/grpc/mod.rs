//! `pdmesh.cache.v1.Cache` over [`State`]: the service, its shared state and who may call
//! what; each family of RPCs is served from its own file.

mod convert;
mod pages;
mod relay;
pub(crate) mod rooms;
mod stats;

use std::pin::Pin;
use std::sync::{Arc, Mutex};

use futures::Stream;
use pdmesh_proto::cache::v1 as pb;
use tokio::sync::broadcast;
use tonic::{Request, Response, Status};

use crate::peers::Peers;
use crate::rooms::RoomError;
use crate::state::{CacheError, Event, State, Tier};
use pdmesh_cache_client::Lease;

/// The lease a request names: 16 bytes, or INVALID_ARGUMENT (never echoing it).
fn lease_of(b: &[u8]) -> Result<Lease, Status> {
    Lease::from_wire(b).map_err(|e| Status::invalid_argument(e.to_string()))
}

impl From<CacheError> for Status {
    fn from(e: CacheError) -> Self {
        let msg = e.to_string();
        match e {
            CacheError::LayoutMismatch { .. }
            | CacheError::ModelMismatch { .. }
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

fn tier_pb(t: Tier) -> pb::KvTier {
    match t {
        Tier::Host => pb::KvTier::Memory,
        Tier::Disk => pb::KvTier::Disk,
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
    /// Bumped whenever a promotion from the disk tier ends: its waiters look again.
    pub promotions: tokio::sync::watch::Sender<u64>,
}

impl Shared {
    pub fn new(state: State) -> Self {
        Self {
            state: Arc::new(Mutex::new(state)),
            events: broadcast::channel(1024).0,
            seq: Default::default(),
            rooms: tokio::sync::watch::channel(0).0,
            promotions: tokio::sync::watch::channel(0).0,
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
                Event::Stored {
                    parent,
                    hashes,
                    tier,
                } => pb::kv_event::Kind::Stored(pb::PagesStored {
                    parent_hash: parent,
                    hashes,
                    // The mirror keeps pages by hash, not their tokens.
                    token_ids: Vec::new(),
                    tier: tier_pb(tier).into(),
                    // The tiers keep whole pages only.
                    unservable: Vec::new(),
                }),
                Event::Removed { hashes, tier } => pb::kv_event::Kind::Removed(pb::PagesRemoved {
                    hashes,
                    tier: tier_pb(tier).into(),
                }),
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
    /// How long a match waits for its pages' promotions from the disk tier.
    promote_timeout: std::time::Duration,
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
            promote_timeout: std::time::Duration::from_millis(500),
        }
    }

    /// A match waits this long for pages promoted from the disk tier; those not in by
    /// then are a miss.
    pub fn with_promote_timeout(mut self, t: std::time::Duration) -> Self {
        self.promote_timeout = t;
        self
    }

    /// Counts the reports `r` files in Stats.
    pub fn with_incidents(mut self, r: Option<Arc<pdmesh_incident::Reporter>>) -> Self {
        self.incidents = r;
        self
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

/// Each RPC is served by the `on_…` method of its family's file.
#[tonic::async_trait]
impl pb::cache_server::Cache for CacheService {
    async fn register(
        &self,
        request: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        self.on_register(request).await
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        self.on_heartbeat(request).await
    }

    async fn r#match(
        &self,
        request: Request<pb::MatchRequest>,
    ) -> Result<Response<pb::MatchResponse>, Status> {
        self.on_match(request).await
    }

    async fn reserve(
        &self,
        request: Request<pb::ReserveRequest>,
    ) -> Result<Response<pb::ReserveResponse>, Status> {
        self.on_reserve(request).await
    }

    async fn commit(
        &self,
        request: Request<pb::CommitRequest>,
    ) -> Result<Response<pb::CommitResponse>, Status> {
        self.on_commit(request).await
    }

    type LoadStream = PageStream;

    async fn load(
        &self,
        request: Request<pb::LoadRequest>,
    ) -> Result<Response<Self::LoadStream>, Status> {
        self.on_load(request).await
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.on_release(request).await
    }

    async fn discard(
        &self,
        request: Request<pb::DiscardRequest>,
    ) -> Result<Response<pb::DiscardResponse>, Status> {
        self.on_discard(request).await
    }

    type SubscribeEventsStream = EventStream;

    async fn subscribe_events(
        &self,
        request: Request<pb::SubscribeEventsRequest>,
    ) -> Result<Response<Self::SubscribeEventsStream>, Status> {
        self.on_subscribe_events(request).await
    }

    async fn stats(
        &self,
        request: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        self.on_stats(request).await
    }

    async fn room_open(
        &self,
        request: Request<pb::RoomOpenRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        self.on_room_open(request).await
    }

    async fn room_wait(
        &self,
        request: Request<pb::RoomWaitRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        self.on_room_wait(request).await
    }

    async fn room_start(
        &self,
        request: Request<pb::RoomStartRequest>,
    ) -> Result<Response<pb::RoomStartResponse>, Status> {
        self.on_room_start(request).await
    }

    async fn room_commit(
        &self,
        request: Request<pb::RoomCommitRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        self.on_room_commit(request).await
    }

    async fn room_result(
        &self,
        request: Request<pb::RoomRef>,
    ) -> Result<Response<pb::RoomResultResponse>, Status> {
        self.on_room_result(request).await
    }

    async fn room_finish(
        &self,
        request: Request<pb::RoomRef>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        self.on_room_finish(request).await
    }

    async fn room_abort(
        &self,
        request: Request<pb::RoomAbortRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        self.on_room_abort(request).await
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
#[test]
fn every_rpc_has_the_roles_that_may_call_it() {
    let proto = include_str!("../../../../proto/pdmesh/cache/v1/cache.proto");
    assert_eq!(POLICY.unlisted(proto), Vec::<&str>::new());
}

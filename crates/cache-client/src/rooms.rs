//! The cache service as a worker's hand-over meets it: the registered link rooms use
//! ([`RoomLink`], registering again when the service forgets its lease), each room call
//! bounded by a deadline, and the service's refusals turned into what the worker tells
//! its caller. A room a request leaves early is aborted here ([`RoomGuard`]).

use std::sync::Arc;
use std::time::Duration;

use pdmesh_kv::KvLayout;
use pdmesh_proto::cache::v1 as cpb;
use pdmesh_telemetry::KeyValue;
use pdmesh_telemetry::labels::TransferFailure;
use tonic::{Code, Status};

use crate::client::{ClientError, DataPlane, HostClient, RoomOpen};

#[cfg(test)]
mod tests;

/// The connection rooms use: registered with the cache service (its own lease), renewed
/// in the background when the service restarts or lets the lease lapse.
pub struct RoomLink {
    cur: tokio::sync::watch::Sender<Option<Arc<HostClient>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RoomLink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// How long a request waits for the room link to come back before it is refused: a cache
/// service that was paused past its lease comes back with this worker's lease gone, and
/// the link registers again within about one retry (250 ms); a request arriving in that
/// moment is served, not refused.
pub const RELINK_GRACE: Duration = Duration::from_secs(3);

impl RoomLink {
    /// Registers as `worker_id` serving `model` (see [`HostClient::connect`]).
    pub fn start(
        url: String,
        (worker_id, model): (String, String),
        layout: KvLayout,
        auth: pdmesh_tls::MeshAuth,
    ) -> Self {
        let (cur, _) = tokio::sync::watch::channel(None::<Arc<HostClient>>);
        let task = {
            let cur = cur.clone();
            tokio::spawn(async move {
                let mut warned = false;
                loop {
                    let alive = cur.borrow().as_ref().is_some_and(|c| c.is_alive());
                    if !alive {
                        let attempt = tokio::time::timeout(
                            Duration::from_secs(2),
                            HostClient::connect(
                                &url,
                                (&worker_id, &model),
                                &layout,
                                DataPlane::Shm,
                                &auth,
                            ),
                        )
                        .await;
                        match attempt {
                            Ok(Ok(c)) => {
                                tracing::info!(%url, lease = %c.lease(), "rooms: connected to the cache service");
                                cur.send_replace(Some(Arc::new(c)));
                                warned = false;
                            }
                            Ok(Err(e)) if !warned => {
                                tracing::warn!(%url, error = %e, "rooms: cache service unavailable; retrying");
                                warned = true;
                            }
                            Err(_) if !warned => {
                                tracing::warn!(%url, "rooms: cache service did not answer; retrying");
                                warned = true;
                            }
                            _ => {}
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            })
        };
        Self { cur, task }
    }

    /// The link as it is now.
    pub fn get(&self) -> Option<Arc<HostClient>> {
        self.cur.borrow().clone().filter(|c| c.is_alive())
    }

    /// The link, waiting up to `grace` for it to come back when it is down.
    pub async fn wait(&self, grace: Duration) -> Result<Arc<HostClient>, HandoverError> {
        let mut rx = self.cur.subscribe();
        let until = tokio::time::Instant::now() + grace;
        loop {
            if let Some(c) = rx.borrow_and_update().clone().filter(|c| c.is_alive()) {
                return Ok(c);
            }
            match tokio::time::timeout_at(until, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return Err(HandoverError::NoLink),
            }
        }
    }
}

/// Aborts a room when dropped armed: the request ended before its hand-over did.
pub struct RoomGuard {
    pub client: Arc<HostClient>,
    pub room: u64,
    pub reason: &'static str,
    pub armed: bool,
}

impl Drop for RoomGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (client, room, reason) = (self.client.clone(), self.room, self.reason);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let r =
                    tokio::time::timeout(Duration::from_secs(2), client.room_abort(room, reason));
                if !matches!(r.await, Ok(Ok(()))) {
                    tracing::debug!(
                        room,
                        "room abort did not reach the cache service; its deadline will"
                    );
                }
            });
        }
    }
}

/// Why a worker's side of a hand-over could not go on with the cache service, classified
/// once: what the worker tells its caller (`From<HandoverError> for Status`) and the
/// failure it counts ([`HandoverError::failure`]). Rooms, leases and the calls between
/// the mesh's services are the mesh's business, never the client's: no variant answers
/// with a code that blames the caller's request (INVALID_ARGUMENT, FAILED_PRECONDITION,
/// OUT_OF_RANGE, NOT_FOUND).
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    /// No registered link to the cache service: it is down, or registering again.
    #[error("not connected to the cache service (rooms)")]
    NoLink,
    /// The service could not be reached for a room call.
    #[error("the cache service could not be reached: {0}")]
    Unreachable(String),
    /// A room open the service refused because it no longer knows this worker's lease
    /// (paused or restarted past the lease's time): nothing of the request ran, and the
    /// client registers again at once (see `HostClient::room_open_with`).
    #[error("the cache service no longer knows this worker's lease; registering again ({0})")]
    LeaseLost(String),
    /// A room call did not finish before the transfer deadline.
    #[error("KV transfer: {0} did not finish before the transfer deadline")]
    Deadline(&'static str),
    /// The room failed, or the service no longer knows it: the hand-over is over.
    #[error("KV transfer failed: {0}")]
    Failed(String),
    /// The service said "not now" (UNAVAILABLE, a deadline, a full mirror, a cancelled
    /// call) or named a real fault (ABORTED, DATA_LOSS, INTERNAL): passed on as it is.
    #[error("{}", .0.message())]
    Cache(Status),
    /// The service refused the call as malformed or in the wrong state (a room in
    /// another state, another host's KV layout): the mesh's fault, INTERNAL.
    #[error("the cache service refused a room call ({code:?}): {message}")]
    Refused { code: Code, message: String },
}

impl HandoverError {
    /// What the cache service's refusal of a room call means for the hand-over.
    pub fn from_cache(e: ClientError) -> Self {
        let s = match e {
            // The connection broke: the service was not reached.
            ClientError::Rpc(s) if pdmesh_proto::error_kind::connection_lost(&s) => {
                return Self::Unreachable(s.message().to_owned());
            }
            ClientError::Rpc(s) => s,
            e @ (ClientError::Connect(_) | ClientError::Map(_)) => {
                return Self::Unreachable(e.to_string());
            }
            e @ (ClientError::WrongSize { .. } | ClientError::BadLease(_)) => {
                return Self::Refused {
                    code: Code::Internal,
                    message: e.to_string(),
                };
            }
        };
        match s.code() {
            Code::Unavailable
            | Code::DeadlineExceeded
            | Code::ResourceExhausted
            | Code::Cancelled
            | Code::Aborted
            | Code::DataLoss
            | Code::Internal => Self::Cache(s),
            Code::NotFound => Self::Failed(s.message().to_owned()),
            code => Self::Refused {
                code,
                message: s.message().to_owned(),
            },
        }
    }

    /// The failure a worker counts for it.
    pub fn failure(&self) -> TransferFailure {
        match self {
            Self::NoLink | Self::Unreachable(_) | Self::LeaseLost(_) => {
                TransferFailure::CacheUnavailable
            }
            Self::Deadline(_) => TransferFailure::Deadline,
            Self::Failed(_) => TransferFailure::RoomFailed,
            Self::Refused { .. } => TransferFailure::Other,
            Self::Cache(s) => match s.code() {
                Code::Aborted => TransferFailure::RoomFailed,
                Code::DeadlineExceeded => TransferFailure::Deadline,
                Code::Unavailable => TransferFailure::CacheUnavailable,
                Code::DataLoss => TransferFailure::Checksum,
                Code::Cancelled => TransferFailure::CallerLeft,
                Code::ResourceExhausted => TransferFailure::Admission,
                _ => TransferFailure::Other,
            },
        }
    }

    /// Whether the mirror is full of other rooms' pages for now (worth trying again
    /// before the deadline).
    pub fn mirror_full(&self) -> bool {
        matches!(self, Self::Cache(s) if s.code() == Code::ResourceExhausted)
    }
}

impl From<HandoverError> for Status {
    fn from(e: HandoverError) -> Self {
        let msg = e.to_string();
        match e {
            HandoverError::NoLink | HandoverError::Unreachable(_) | HandoverError::LeaseLost(_) => {
                Status::unavailable(msg)
            }
            HandoverError::Deadline(_) => Status::deadline_exceeded(msg),
            HandoverError::Failed(_) => Status::aborted(msg),
            HandoverError::Cache(s) => Status::new(s.code(), msg),
            HandoverError::Refused { .. } => Status::internal(msg),
        }
    }
}

/// A room open refused because the service no longer knows this worker's lease is
/// [`HandoverError::LeaseLost`], not a failed transfer; [`RoomLink::open_room`] opens
/// once more with the new lease.
async fn lease_checked<T>(
    fut: impl Future<Output = Result<T, ClientError>>,
) -> Result<T, HandoverError> {
    fut.await.map_err(|e| match e {
        ClientError::Rpc(s) if s.code() == Code::NotFound => {
            HandoverError::LeaseLost(s.message().to_owned())
        }
        e => HandoverError::from_cache(e),
    })
}

/// Runs room call `fut` until `deadline`; past it, [`HandoverError::Deadline`] naming
/// `what`.
pub async fn by<T>(
    deadline: tokio::time::Instant,
    what: &'static str,
    fut: impl Future<Output = Result<T, ClientError>>,
) -> Result<T, HandoverError> {
    within(deadline, what, async {
        fut.await.map_err(HandoverError::from_cache)
    })
    .await
}

/// `fut`, already classified, until `deadline`.
async fn within<T>(
    deadline: tokio::time::Instant,
    what: &'static str,
    fut: impl Future<Output = Result<T, HandoverError>>,
) -> Result<T, HandoverError> {
    tokio::time::timeout_at(deadline, fut)
        .await
        .unwrap_or(Err(HandoverError::Deadline(what)))
}

/// Waits until `room` reaches `until`; a failed room is ABORTED with its reason. Each
/// call to the service must answer by `deadline()`, asked before the call: a fixed
/// instant bounds the whole wait, `now + d` only each answer.
pub async fn wait_room(
    client: &HostClient,
    room: u64,
    until: cpb::RoomState,
    deadline: impl Fn() -> tokio::time::Instant,
) -> Result<cpb::RoomStatus, HandoverError> {
    loop {
        let st = by(
            deadline(),
            "waiting for the other side",
            client.room_wait(room, until, Duration::from_secs(1)),
        )
        .await?;
        match cpb::RoomState::try_from(st.state).unwrap_or(cpb::RoomState::Failed) {
            cpb::RoomState::Failed => return Err(HandoverError::Failed(st.reason)),
            s if s as i32 >= until as i32 => return Ok(st),
            _ => {}
        }
    }
}

/// A room reached `state` as this side sees it (an event on the request's room span).
pub fn room_event(state: &'static str) {
    pdmesh_telemetry::event(
        &tracing::Span::current(),
        "room_state",
        vec![KeyValue::new("pdmesh.room.state", state)],
    );
}

impl RoomLink {
    /// Opens `room` as `side` by `deadline`. A refusal because the cache service no
    /// longer knows this worker's lease (it was paused or restarted past the lease's
    /// time, before a heartbeat could tell) waits for the link to register again and
    /// opens once more with the new lease: nothing of the request ran yet. Returns the
    /// client the room was opened with, for the rest of the hand-over.
    pub async fn open_room(
        &self,
        client: Arc<HostClient>,
        deadline: tokio::time::Instant,
        (room, side): (u64, cpb::RoomSide),
        (request_id, trace_id): (&str, &str),
        how: RoomOpen<'_>,
    ) -> Result<(Arc<HostClient>, cpb::RoomStatus), HandoverError> {
        let open = async |c: &HostClient| {
            within(
                deadline,
                "room open",
                lease_checked(c.room_open_with(room, side, request_id, trace_id, how)),
            )
            .await
        };
        match open(&client).await {
            Err(s) if !client.is_alive() => {
                tracing::info!(room, lease = %client.lease(), error = %s, "room open refused for this worker's lease: opening again once registered again");
                let client = self.wait(RELINK_GRACE).await?;
                let st = open(&client).await?;
                Ok((client, st))
            }
            opened => opened.map(|st| (client, st)),
        }
    }
}

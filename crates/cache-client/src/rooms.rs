//! The cache service as a worker's hand-over meets it: the registered link rooms use
//! ([`RoomLink`], registering again when the service forgets its lease), each room call
//! bounded by a deadline, and the service's refusals turned into what the worker tells
//! its caller. A room a request leaves early is aborted here ([`RoomGuard`]).

use std::sync::Arc;
use std::time::Duration;

use pdmesh_kv::KvLayout;
use pdmesh_proto::cache::v1 as cpb;
use pdmesh_telemetry::KeyValue;
use tonic::Status;

use crate::client::{DataPlane, HostClient, RoomOpen};

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
    pub fn start(
        url: String,
        worker_id: String,
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
                            HostClient::connect(&url, &worker_id, &layout, DataPlane::Shm, &auth),
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
    pub async fn wait(&self, grace: Duration) -> Result<Arc<HostClient>, Status> {
        let mut rx = self.cur.subscribe();
        let until = tokio::time::Instant::now() + grace;
        loop {
            if let Some(c) = rx.borrow_and_update().clone().filter(|c| c.is_alive()) {
                return Ok(c);
            }
            match tokio::time::timeout_at(until, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => {
                    return Err(Status::unavailable(
                        "not connected to the cache service (rooms)",
                    ));
                }
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

/// A room open the cache service refused because it no longer knows this worker's lease
/// (paused or restarted past the lease's time) is UNAVAILABLE, not a failed transfer:
/// nothing of the request ran, and the client registers again at once (see
/// `HostClient::room_open_with`); [`RoomLink::open_room`] opens once more with the new
/// lease.
async fn lease_checked<T>(fut: impl Future<Output = Result<T, Status>>) -> Result<T, Status> {
    fut.await.map_err(|s| {
        if s.code() == tonic::Code::NotFound {
            Status::unavailable(format!(
                "the cache service no longer knows this worker's lease; registering again ({})",
                s.message()
            ))
        } else {
            s
        }
    })
}

/// What this worker tells its caller when the cache service refused a room call. Rooms,
/// leases and the calls between the mesh's services are the mesh's business, never the
/// client's: a code that would blame the caller's request (INVALID_ARGUMENT,
/// FAILED_PRECONDITION, OUT_OF_RANGE: a room in the wrong state, a malformed call,
/// another host's KV layout) is INTERNAL here; NOT_FOUND (the room or this worker's lease
/// is gone) fails the hand-over, ABORTED; what says "not now" (UNAVAILABLE, a deadline, a
/// full mirror) or names a real fault (ABORTED, DATA_LOSS, INTERNAL) stays as it is.
pub fn from_cache(s: Status) -> Status {
    use tonic::Code;
    match s.code() {
        Code::Unavailable
        | Code::DeadlineExceeded
        | Code::ResourceExhausted
        | Code::Cancelled
        | Code::Aborted
        | Code::DataLoss
        | Code::Internal => s,
        Code::NotFound => failed(s.message()),
        code => Status::internal(format!(
            "the cache service refused a room call ({code:?}): {}",
            s.message()
        )),
    }
}

pub fn failed(reason: &str) -> Status {
    Status::aborted(format!("KV transfer failed: {reason}"))
}

/// Runs room call `fut` until `deadline`; past it, DEADLINE_EXCEEDED naming `what`. Its
/// failure is what this worker passes on ([`from_cache`]).
pub async fn by<T>(
    deadline: tokio::time::Instant,
    what: &str,
    fut: impl Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    match tokio::time::timeout_at(deadline, fut).await {
        Ok(r) => r.map_err(from_cache),
        Err(_) => Err(Status::deadline_exceeded(format!(
            "KV transfer: {what} did not finish before the transfer deadline"
        ))),
    }
}

/// Waits until `room` reaches `until`; a failed room is ABORTED with its reason. Each
/// call to the service must answer by `deadline()`, asked before the call: a fixed
/// instant bounds the whole wait, `now + d` only each answer.
pub async fn wait_room(
    client: &HostClient,
    room: u64,
    until: cpb::RoomState,
    deadline: impl Fn() -> tokio::time::Instant,
) -> Result<cpb::RoomStatus, Status> {
    loop {
        let st = by(
            deadline(),
            "waiting for the other side",
            client.room_wait(room, until, Duration::from_secs(1)),
        )
        .await?;
        match cpb::RoomState::try_from(st.state).unwrap_or(cpb::RoomState::Failed) {
            cpb::RoomState::Failed => return Err(failed(&st.reason)),
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
    ) -> Result<(Arc<HostClient>, cpb::RoomStatus), Status> {
        let open = async |c: &HostClient| {
            by(
                deadline,
                "room open",
                lease_checked(c.room_open_with(room, side, request_id, trace_id, how)),
            )
            .await
        };
        match open(&client).await {
            Err(s) if !client.is_alive() => {
                tracing::info!(room, lease = %client.lease(), error = %s.message(), "room open refused for this worker's lease: opening again once registered again");
                let client = self.wait(RELINK_GRACE).await?;
                let st = open(&client).await?;
                Ok((client, st))
            }
            opened => opened.map(|st| (client, st)),
        }
    }
}

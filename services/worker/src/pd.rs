//! Prefill/decode disaggregation on the worker side: a prefill worker computes a prompt and
//! sends its KV pages through a room at the cache service; a decode worker reserves pages
//! first, receives them and generates. Every wait is bounded (the room's deadlines at the
//! service, this worker's transfer deadline here), and whatever ends a request early —
//! an error, a deadline, the caller leaving, a panic in the task — aborts its room, so the
//! other side learns it at its next call, and lets go of the pages it held.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use pdmesh_cache_client::client::{DataPlane, HostClient, RoomOpen};
use pdmesh_engine::{GenRequest, Logprob, Part};
use pdmesh_kv::KvLayout;
use pdmesh_proto::cache::v1 as cpb;
use pdmesh_telemetry::KeyValue;
use pdmesh_telemetry::labels::TransferFailure;
use tokio::sync::mpsc;
use tonic::Status;
use tracing::Instrument as _;

use crate::actor::{EngineHandle, Generation};
use crate::engine_core::{Event, Finish, Stages};
use crate::faults::Missize;
use crate::incidents::{BadPage, Figures, Handed, Incidents};

/// What this worker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Prompt and generation (no rooms).
    Unified,
    /// Prompts and first tokens; KV goes to a decode worker through a room.
    Prefill,
    /// Reserves pages, receives a prompt's KV through a room, generates the rest.
    Decode,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Self::Unified => "unified",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

/// Transfer counters since the worker started.
#[derive(Clone, Debug, Default)]
pub(crate) struct PdStats {
    pub pages: u64,
    pub bytes: u64,
    pub seconds: f64,
    /// Requests that failed in transfer, by reason.
    pub failures: HashMap<TransferFailure, u64>,
    pub admission_timeouts: u64,
    /// Hand-overs completed.
    pub transfers: u64,
    /// Hand-overs under way now, and the oldest one's age in seconds.
    pub handovers: usize,
    pub handover_oldest_seconds: f64,
}

/// The connection rooms use: registered with the cache service (its own lease), renewed
/// in the background when the service restarts or lets the lease lapse.
struct RoomLink {
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
const RELINK_GRACE: Duration = Duration::from_secs(3);

impl RoomLink {
    fn start(url: String, worker_id: String, layout: KvLayout, auth: pdmesh_tls::MeshAuth) -> Self {
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
    fn get(&self) -> Option<Arc<HostClient>> {
        self.cur.borrow().clone().filter(|c| c.is_alive())
    }

    /// The link, waiting up to `grace` for it to come back when it is down.
    async fn wait(&self, grace: Duration) -> Result<Arc<HostClient>, Status> {
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

/// Timing knobs of the disaggregated path.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PdTimes {
    /// How long a decode request may wait for its pages.
    pub admission: Duration,
    /// How long either side may spend on one request's hand-over (`--transfer-timeout-ms`).
    pub transfer: Duration,
    /// Test-only fault: a prefill sleeps this long after its room started transferring
    /// and before it writes (for the first `fault_count` transfers), so its write lands
    /// after the room's deadline.
    pub write_delay: Option<Duration>,
    pub fault_count: u64,
    /// Test-only fault, the seed's bug: a prefill stages its bf16 index-K through a
    /// buffer sized for fp8 index-K, so most of it is lost in transfer. `Checked`: the
    /// hand-over's checksums catch it; `Unchecked`: checksummed after the loss, so
    /// nothing downstream can tell.
    pub missize: Option<crate::faults::Missize>,
}

/// One worker's disaggregation state.
pub(crate) struct Pd {
    role: Role,
    link: Option<RoomLink>,
    /// This host's cache service as other hosts reach it (ModelInfo's cache_url).
    home: String,
    times: PdTimes,
    stats: Mutex<PdStats>,
    faults: std::sync::atomic::AtomicU64,
    /// The model's end-of-generation tokens (a first token that is one is never shown).
    eos: Vec<u32>,
    layout: KvLayout,
    /// When each hand-over under way began, by a key of its own.
    handovers: Mutex<HashMap<u64, Instant>>,
    next_handover: std::sync::atomic::AtomicU64,
    incidents: Option<Arc<Incidents>>,
}

/// A hand-over under way, counted until dropped (however the request ends).
struct Handover {
    pd: Arc<Pd>,
    key: u64,
}

impl Drop for Handover {
    fn drop(&mut self) {
        self.pd
            .handovers
            .lock()
            .expect("handovers lock")
            .remove(&self.key);
    }
}

/// Aborts a room when dropped armed: the request ended before its hand-over did.
struct RoomGuard {
    client: Arc<HostClient>,
    room: u64,
    reason: &'static str,
    armed: bool,
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

/// Lets go of a prefill's held pages when dropped armed: those of its own submission
/// (`ticket`) only, as the request may have been tried again under the same id by then.
struct ExportGuard {
    engine: EngineHandle,
    id: Option<String>,
    ticket: u64,
}

impl ExportGuard {
    /// The pages were exported: nothing left to let go of.
    fn disarm(&mut self) {
        self.id = None;
    }
}

impl Drop for ExportGuard {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.engine.drop_export(id, self.ticket);
        }
    }
}

type Item = Result<Event, Status>;

/// A room open the cache service refused because it no longer knows this worker's lease
/// (paused or restarted past the lease's time) is UNAVAILABLE, not a failed transfer:
/// nothing of the request ran, and the client registers again at once (see
/// `HostClient::room_open_with`); [`Pd::open_room`] opens once more with the new lease.
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
fn from_cache(s: Status) -> Status {
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

fn failed(reason: &str) -> Status {
    Status::aborted(format!("KV transfer failed: {reason}"))
}

/// Copies prefilled request `id`'s pages (submission `ticket`'s) from the `held`-th on out
/// of the engine (on its thread, between steps) into one buffer, `page_bytes` each, with
/// each page's checksum taken from the engine's own bytes.
async fn stage(
    engine: &EngineHandle,
    (id, ticket): (&str, u64),
    held: usize,
    page_bytes: usize,
) -> Result<(Vec<u8>, Vec<u64>), Status> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    engine
        .export(
            id.to_owned(),
            ticket,
            Box::new(move |src: &[&[u8]]| {
                let staged = stage_pages(src, held, page_bytes);
                let sums = staged.as_ref().map(|(_, s)| s.clone()).unwrap_or_default();
                let _ = tx.send(staged);
                sums
            }),
        )
        .await
        .map_err(|e| Status::from(crate::Error::from(e)))?;
    rx.await
        .map_err(|_| Status::internal("the engine exported no pages"))?
        .map_err(Status::internal)
}

/// The pages of `src` from the `held`-th on, copied into one buffer with each one's
/// checksum. A page of another size than the cache service's is refused, naming both
/// sizes, not copied into a buffer sized for the other.
fn stage_pages(
    src: &[&[u8]],
    held: usize,
    page_bytes: usize,
) -> Result<(Vec<u8>, Vec<u64>), String> {
    let src = src.get(held..).unwrap_or_default();
    if let Some(p) = src.iter().find(|p| p.len() != page_bytes) {
        return Err(format!(
            "the engine's KV pages are {} bytes, the cache service's {page_bytes}",
            p.len()
        ));
    }
    let mut buf = vec![0u8; src.len() * page_bytes];
    let sums = src
        .iter()
        .zip(buf.chunks_exact_mut(page_bytes))
        .map(|(page, dst)| {
            dst.copy_from_slice(page);
            pdmesh_kv::page_checksum(dst)
        })
        .collect();
    Ok((buf, sums))
}

/// Writes the staged pages into their mirror slots. Each write checksums what it wrote,
/// which must equal the checksum taken from the engine's bytes: a page that changed on
/// the way is an error here (the pages that did, named), not a corrupted answer later.
/// `missize` is the seed's fault: a copy through a buffer sized for fp8 index-K, either
/// caught by these checksums or, `Unchecked`, checksummed after the loss as the seed's
/// code did, so that nothing downstream can tell.
fn write_pages(
    mirror: &pdmesh_cache_client::mirror::Mirror,
    staged: &[u8],
    slots: &[u32],
    sums: &[u64],
    missize: Option<(Missize, &KvLayout)>,
) -> Result<Result<Vec<u64>, Vec<BadPage>>, Status> {
    let page_bytes = mirror.page_bytes();
    if staged.len() != slots.len() * page_bytes || sums.len() != slots.len() {
        return Err(Status::internal(format!(
            "{} staged bytes and {} checksums for {} slots of {page_bytes} bytes",
            staged.len(),
            sums.len(),
            slots.len()
        )));
    }
    let mut bad = Vec::new();
    let written = staged
        .chunks_exact(page_bytes)
        .zip(slots)
        .zip(sums)
        .enumerate()
        .map(|(index, ((page, &slot), &expected))| {
            let found = match missize {
                None => mirror.write_checked(slot, page),
                Some((_, layout)) => {
                    let mut copy = page.to_vec();
                    pdmesh_kv::faults::truncate_bf16_index_k_like_fp8(layout, &mut copy);
                    mirror.write_checked(slot, &copy)
                }
            };
            if found != expected && missize.is_none_or(|(m, _)| m == Missize::Checked) {
                bad.push(BadPage {
                    index,
                    slot,
                    expected,
                    found,
                });
            }
            found
        })
        .collect();
    Ok(if bad.is_empty() {
        Ok(written)
    } else {
        Err(bad)
    })
}

/// Files the report of a hand-over whose pages changed between the prefill engine and
/// the mirror: the pages, and the engine's layout beside the staging buffer's (another
/// one only under the seed's fault, whose differences the report then marks).
fn report_write(
    inc: &Incidents,
    (req, trace_id, room): (&GenRequest, &str, u64),
    bad: &[BadPage],
    pages: usize,
    engine: &KvLayout,
    missize: Option<Missize>,
) {
    let staging = missize
        .and_then(|_| pdmesh_kv::faults::fp8_sized_index_k(engine))
        .unwrap_or_else(|| engine.clone());
    let layouts = pdmesh_incident::LayoutPair {
        ours_label: "prefill engine".into(),
        ours: pdmesh_incident::LayoutView::of(engine),
        theirs_label: "host staging buffer".into(),
        theirs: pdmesh_incident::LayoutView::of(&staging),
    };
    let diffs = layouts.differences();
    let cause = if diffs.is_empty() {
        "The staging buffer has the engine's layout, so the bytes changed in the copy \
         itself (host memory, or a write into the wrong slot)."
            .to_owned()
    } else {
        format!(
            "The staging buffer was sized with another layout than the engine's ({}): \
             a copy through it loses what does not fit.",
            diffs.join("; ")
        )
    };
    let summary = format!(
        "Room {room}: {} of the {pages} pages this prefill wrote to the host mirror for \
         decode do not match the checksums taken from the engine's own bytes. {cause} The \
         request failed with DATA_LOSS before its room committed, so decode never used \
         these pages and no corrupted answer was sent.",
        bad.len()
    );
    let h = Handed {
        req,
        trace_id,
        room,
    };
    inc.handover_checksum("hand-over write", &h, (bad, pages), Some(layouts), summary);
}

/// The DATA_LOSS a hand-over's changed pages end the request with.
fn changed(bad: &[BadPage], of: usize, between: &str) -> Status {
    let b = bad[0];
    Status::data_loss(format!(
        "{} of {of} pages changed between {between}: page {} (mirror slot {}) has checksum {:#018x}, the engine's {:#018x}",
        bad.len(),
        b.index,
        b.slot,
        b.found,
        b.expected
    ))
}

/// Runs room call `fut` until `deadline`; past it, DEADLINE_EXCEEDED naming `what`. Its
/// failure is what this worker passes on ([`from_cache`]).
async fn by<T>(
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
async fn wait_room(
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
fn room_event(state: &'static str) {
    pdmesh_telemetry::event(
        &tracing::Span::current(),
        "room_state",
        vec![KeyValue::new("pdmesh.room.state", state)],
    );
}

/// A transfer started or ended: its pages and bytes, and at the end the copy's seconds.
/// `held`: the prompt's leading pages decode held already, which did not move.
fn transfer_event(
    name: &'static str,
    (pages, held): (usize, usize),
    page_bytes: usize,
    seconds: Option<f64>,
) {
    let mut attrs = vec![
        KeyValue::new("pdmesh.pages", pages as i64),
        KeyValue::new("pdmesh.pages_held", held as i64),
        KeyValue::new("pdmesh.bytes", (pages * page_bytes) as i64),
    ];
    if let Some(s) = seconds {
        attrs.push(KeyValue::new("pdmesh.seconds", s));
    }
    pdmesh_telemetry::event(&tracing::Span::current(), name, attrs);
}

fn reason_of(s: &Status) -> TransferFailure {
    match s.code() {
        tonic::Code::Aborted => TransferFailure::RoomFailed,
        tonic::Code::DeadlineExceeded => TransferFailure::Deadline,
        tonic::Code::Unavailable => TransferFailure::CacheUnavailable,
        tonic::Code::DataLoss => TransferFailure::Checksum,
        tonic::Code::Cancelled => TransferFailure::CallerLeft,
        tonic::Code::ResourceExhausted => TransferFailure::Admission,
        _ => TransferFailure::Other,
    }
}

impl Pd {
    pub(crate) fn new(
        role: Role,
        cache_url: Option<&str>,
        advertised: Option<&str>,
        layout: &KvLayout,
        times: PdTimes,
        eos: Vec<u32>,
        auth: pdmesh_tls::MeshAuth,
    ) -> Self {
        let link = match (role, cache_url) {
            (Role::Unified, _) | (_, None) => None,
            (_, Some(url)) => Some(RoomLink::start(
                url.to_owned(),
                format!("{}-{}", role.name(), std::process::id()),
                layout.clone(),
                auth,
            )),
        };
        Self {
            role,
            link,
            home: advertised.unwrap_or_default().to_owned(),
            times,
            stats: Mutex::default(),
            faults: Default::default(),
            eos,
            layout: layout.clone(),
            handovers: Mutex::default(),
            next_handover: Default::default(),
            incidents: None,
        }
    }

    /// Files incident reports through `incidents` (checksum failures in hand-overs).
    pub(crate) fn with_incidents(mut self, incidents: Option<Arc<Incidents>>) -> Self {
        self.incidents = incidents;
        self
    }

    /// The failures this worker filed reports for, by kind.
    pub(crate) fn incident_counts(&self) -> HashMap<String, u64> {
        self.incidents
            .as_ref()
            .map(|i| i.counts())
            .unwrap_or_default()
    }

    /// This worker's hand-over figures, for incident reports.
    pub(crate) fn figures(&self) -> Figures {
        let st = self.stats();
        Figures {
            handovers: st.handovers,
            oldest_handover_seconds: st.handover_oldest_seconds,
            transfers: st.transfers,
            transfer_bytes: st.bytes,
            failed_transfers: st.failures.values().sum(),
        }
    }

    fn handover(self: &Arc<Self>) -> Handover {
        let key = self
            .next_handover
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.handovers
            .lock()
            .expect("handovers lock")
            .insert(key, Instant::now());
        Handover {
            pd: self.clone(),
            key,
        }
    }

    /// This host's cache service as other hosts reach it (empty: none).
    pub(crate) fn home(&self) -> &str {
        &self.home
    }

    pub(crate) fn role(&self) -> Role {
        self.role
    }

    /// Whether this worker can serve: a prefill or decode worker needs its room link.
    pub(crate) fn ready(&self) -> bool {
        self.role == Role::Unified || self.link.as_ref().is_some_and(|l| l.get().is_some())
    }

    pub(crate) fn stats(&self) -> PdStats {
        let mut st = self.stats.lock().expect("pd stats").clone();
        let handovers = self.handovers.lock().expect("handovers lock");
        st.handovers = handovers.len();
        st.handover_oldest_seconds = handovers
            .values()
            .map(|t| t.elapsed().as_secs_f64())
            .fold(0.0, f64::max);
        st
    }

    fn count(&self, pages: usize, bytes: usize, secs: f64) {
        let mut st = self.stats.lock().expect("pd stats");
        st.pages += pages as u64;
        st.bytes += bytes as u64;
        st.seconds += secs;
        st.transfers += 1;
    }

    fn fail(&self, s: &Status) {
        let mut st = self.stats.lock().expect("pd stats");
        *st.failures.entry(reason_of(s)).or_default() += 1;
        if s.code() == tonic::Code::ResourceExhausted {
            st.admission_timeouts += 1;
        }
    }

    async fn client(&self) -> Result<Arc<HostClient>, Status> {
        self.link
            .as_ref()
            .ok_or_else(|| Status::internal("this worker has no cache service"))?
            .wait(RELINK_GRACE)
            .await
    }

    /// Opens `room` as `side` by `deadline`. A refusal because the cache service no
    /// longer knows this worker's lease (it was paused or restarted past the lease's
    /// time, before a heartbeat could tell) waits for the link to register again and
    /// opens once more with the new lease: nothing of the request ran yet. Returns the
    /// client the room was opened with, for the rest of the hand-over.
    async fn open_room(
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
                let client = self.client().await?;
                let st = open(&client).await?;
                Ok((client, st))
            }
            opened => opened.map(|st| (client, st)),
        }
    }

    /// Runs one request's side of a room; the returned channel carries its events.
    pub(crate) async fn generate(
        self: &Arc<Self>,
        engine: &EngineHandle,
        (req, group): (GenRequest, Option<(String, usize)>),
        room: u64,
        trace_id: String,
        kv_home: String,
    ) -> Result<mpsc::Receiver<Item>, Status> {
        let handover = self.handover();
        let client = self.client().await?;
        let (tx, rx) = mpsc::channel(64);
        let pd = self.clone();
        let engine = engine.clone();
        // This side's part of the hand-over, in the request's trace; its events mark the
        // room's progress and the transfer's start and end.
        let span = tracing::info_span!(
            "room",
            otel.name = format!("{} room", self.role.name()),
            otel.status_code = tracing::field::Empty,
            pdmesh.room = room,
            pdmesh.role = self.role.name(),
            pdmesh.request_id = %req.id,
        );
        match self.role {
            Role::Prefill => {
                // Join first, so a decode side that gave up already is known before any
                // compute is spent.
                // Bounded like every other room call: a cache service that stopped
                // answering fails the request instead of holding it.
                let (client, st) = self
                    .open_room(
                        client,
                        tokio::time::Instant::now() + self.times.transfer,
                        (room, cpb::RoomSide::Sender),
                        (&req.id, &trace_id),
                        RoomOpen {
                            // This host's own service is no other home.
                            home: if kv_home == self.home { "" } else { &kv_home },
                            held_pages: 0,
                        },
                    )
                    .await?;
                if st.state == cpb::RoomState::Failed as i32 {
                    return Err(failed(&st.reason));
                }
                let guard = RoomGuard {
                    client: client.clone(),
                    room,
                    reason: "prefill ended before its pages were sent",
                    armed: true,
                };
                let generation = engine
                    .generate_shared(req.clone(), Part::Prefill, group)
                    .await
                    .map_err(|e| Status::from(crate::Error::from(e)))?;
                tokio::spawn(
                    async move {
                        let _handover = handover;
                        let work =
                            pd.prefill(&engine, client, (req, trace_id), generation, guard, &tx);
                        pd.drive(work, &tx).await;
                    }
                    .instrument(span),
                );
            }
            Role::Decode => {
                let generation = engine
                    .generate_part(req.clone(), Part::Decode)
                    .await
                    .map_err(|e| Status::from(crate::Error::from(e)))?;
                tokio::spawn(
                    async move {
                        let work = pd.decode(
                            &engine,
                            client,
                            req,
                            (room, trace_id, handover),
                            generation,
                            &tx,
                        );
                        pd.drive(work, &tx).await;
                    }
                    .instrument(span),
                );
            }
            Role::Unified => unreachable!("checked by the caller"),
        }
        Ok(rx)
    }

    /// Runs `work` (which sends events on the channel it is given) until it ends or the
    /// caller leaves; an error becomes the stream's last item. Dropping `work` drops its
    /// guards: the room is aborted and held pages let go.
    async fn drive(&self, work: impl Future<Output = Result<(), Status>>, tx: &mpsc::Sender<Item>) {
        let out = tokio::select! {
            r = work => r,
            () = tx.closed() => Err(Status::cancelled("the caller left")),
        };
        if let Err(s) = out {
            self.fail(&s);
            let span = tracing::Span::current();
            span.record("otel.status_code", "ERROR");
            pdmesh_telemetry::event(
                &span,
                "kv_cache_transfer_failed",
                vec![
                    KeyValue::new("error.type", reason_of(&s).name()),
                    KeyValue::new("pdmesh.error", s.message().to_owned()),
                ],
            );
            if s.code() != tonic::Code::Cancelled {
                tracing::warn!(code = ?s.code(), error = %s.message(), "KV transfer failed");
            }
            let _ = tx.send(Err(s)).await;
        }
    }

    async fn prefill(
        &self,
        engine: &EngineHandle,
        client: Arc<HostClient>,
        (req, trace_id): (GenRequest, String),
        mut generation: Generation,
        mut guard: RoomGuard,
        tx: &mpsc::Sender<Item>,
    ) -> Result<(), Status> {
        let room = guard.room;
        let prompt_tokens = req.prompt.len() as u32;
        let (token, logprob, pages, cached, host_cached, stages) = loop {
            match generation.next().await {
                Some(Ok(Event::Exported {
                    token,
                    logprob,
                    pages,
                    cached,
                    host_cached,
                    stages,
                })) => break (token, logprob, pages, cached, host_cached, stages),
                Some(Ok(Event::Finished(f))) => {
                    return Err(failed(&format!("prefill ended: {:?}", f.reason)));
                }
                // Computed here only: they go to the client before the first token.
                Some(Ok(ev @ Event::PromptLogprobs { .. })) => {
                    let _ = tx.send(Ok(ev)).await;
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(Status::from(crate::Error::from(e))),
                None => return Err(Status::unavailable("the engine went away")),
            }
        };
        let mut export = ExportGuard {
            engine: engine.clone(),
            id: Some(req.id.clone()),
            ticket: generation.ticket(),
        };
        // The first token goes out now, before the hand-over: the gateway can show it
        // while the KV travels (decode streams it again, and the gateway checks they are
        // the same). A token that ends the generation is never shown, so it is not sent.
        let p = &req.params;
        let ends =
            (!p.ignore_eos && self.eos.contains(&token)) || p.stop_token_ids.contains(&token);
        if !ends {
            let _ = tx
                .send(Ok(Event::Token {
                    token,
                    logprob: logprob.clone(),
                }))
                .await;
        }
        let exported = Instant::now();
        let deadline = tokio::time::Instant::now() + self.times.transfer;
        // Decode joins once it has reserved pages for this prompt, saying how many of
        // its leading pages it holds already: only the rest travel.
        let st = wait_room(&client, room, cpb::RoomState::WaitingForInput, || deadline).await?;
        room_event("waiting_for_input");
        let held = st.held_pages as usize;
        if held >= pages {
            return Err(Status::internal(format!(
                "decode says it holds {held} of the prompt's {pages} pages; the last one always travels"
            )));
        }
        let pages = pages - held;
        // The pages leave the engine first, into this task's own buffer with each page's
        // checksum: the engine hands them over between two of its steps, however long
        // one takes on this machine. Only then does the room take mirror slots and start
        // transferring, so its deadline bounds the write and the commit, not a step.
        let page_bytes = client.page_bytes();
        let t0 = Instant::now();
        let (staged, sums) =
            stage(engine, (&req.id, generation.ticket()), held, page_bytes).await?;
        export.disarm();
        if sums.len() != pages {
            return Err(Status::internal(format!(
                "the engine exported {} pages of the {pages} that travel",
                sums.len()
            )));
        }
        let slots = loop {
            match by(
                deadline,
                "room start",
                client.room_start(room, pages as u32),
            )
            .await
            {
                Ok(slots) => break slots,
                // The mirror is full of other rooms' pages for now.
                Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(s) => return Err(s),
            }
        };
        if slots.len() != pages {
            return Err(Status::internal(format!(
                "the cache service granted {} slots for {pages} pages",
                slots.len()
            )));
        }
        transfer_event("kv_cache_transfer_start", (pages, held), page_bytes, None);
        let mirror = client
            .shared_mirror()
            .ok_or_else(|| Status::internal("rooms need the shm data plane"))?;
        let delay = self.times.write_delay.filter(|_| {
            self.faults
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                < self.times.fault_count
        });
        let client2 = client.clone();
        let (missize, layout) = (self.times.missize, self.layout.clone());
        // What a report needs, only when reports are written: the request itself moves
        // in (nothing after this needs it), so a hand-over copies nothing for it.
        let report = self.incidents.clone().map(|inc| (inc, req, trace_id));
        let write_and_commit = async move {
            if let Some(d) = delay {
                tracing::warn!(room, delay = ?d, "fault injection: a write that does not hear aborts, delayed");
                tokio::time::sleep(d).await;
            }
            let write_slots = slots.clone();
            let engine_layout = layout.clone();
            let written = tokio::task::spawn_blocking(move || {
                write_pages(
                    &mirror,
                    &staged,
                    &write_slots,
                    &sums,
                    missize.map(|m| (m, &layout)),
                )
            })
            .await
            .map_err(|e| Status::internal(format!("the page write failed: {e}")))??;
            let sums = match written {
                Ok(sums) => sums,
                Err(bad) => {
                    if let Some((inc, req, trace_id)) = &report {
                        report_write(
                            inc,
                            (req, trace_id, room),
                            &bad,
                            pages,
                            &engine_layout,
                            missize,
                        );
                    }
                    return Err(changed(&bad, pages, "the engine and the host mirror"));
                }
            };
            let secs = t0.elapsed().as_secs_f64();
            let aux = cpb::RoomAux {
                room,
                first_token: token,
                first_logprob: logprob.as_ref().map_or(f32::NAN, |l| l.logprob),
                first_top_logprobs: logprob.as_ref().map_or_else(Vec::new, |l| {
                    l.top
                        .iter()
                        .map(|&(token_id, logprob)| cpb::TopToken { token_id, logprob })
                        .collect()
                }),
                prompt_tokens,
                cached_tokens: cached as u32,
                host_cached_tokens: host_cached as u32,
                queue_seconds: stages.queue,
                prefill_seconds: stages.prefill,
                send_seconds: exported.elapsed().as_secs_f64(),
            };
            let pages_pb = slots
                .iter()
                .zip(&sums)
                .map(|(&slot, &checksum)| cpb::RoomPage { slot, checksum })
                .collect();
            let commit = client2.room_commit(room, pages_pb, aux);
            match delay {
                Some(_) => commit.await.map_err(from_cache)?,
                None => by(deadline, "room commit", commit).await?,
            }
            Ok::<f64, Status>(secs)
        };
        let secs = match delay {
            // The fault: a sender that does not hear its abort (as over a partition)
            // writes and commits late, detached from this request.
            Some(_) => tokio::spawn(write_and_commit)
                .await
                .map_err(|e| Status::internal(format!("the transfer task failed: {e}")))??,
            None => write_and_commit.await?,
        };
        guard.armed = false;
        self.count(pages, pages * client.page_bytes(), secs);
        transfer_event(
            "kv_cache_transfer_end",
            (pages, held),
            client.page_bytes(),
            Some(secs),
        );
        let _ = tx
            .send(Ok(Event::Finished(Finish {
                reason: pdmesh_engine::FinishReason::Length,
                matched_stop: None,
                matched_token: None,
                prompt_tokens,
                completion_tokens: 1,
                cached_tokens: 0,
                host_cached_tokens: 0,
                transferred_tokens: 0,
                stages: Stages {
                    transfer: exported.elapsed().as_secs_f64(),
                    ..stages
                },
            })))
            .await;
        Ok(())
    }

    async fn decode(
        &self,
        engine: &EngineHandle,
        client: Arc<HostClient>,
        req: GenRequest,
        (room, trace_id, handover): (u64, String, Handover),
        mut generation: Generation,
        tx: &mpsc::Sender<Item>,
    ) -> Result<(), Status> {
        // Decode reserves first; a pool that stays full is a clear error, not a wedge.
        let reserved = tokio::time::timeout(self.times.admission, async {
            loop {
                match generation.next().await {
                    Some(Ok(Event::Reserved { pages, held })) => return Ok((pages, held)),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(Status::from(crate::Error::from(e))),
                    None => return Err(Status::unavailable("the engine went away")),
                }
            }
        })
        .await;
        let mut guard = RoomGuard {
            client: client.clone(),
            room,
            reason: "decode ended before it took its pages",
            armed: true,
        };
        let (pages, held) = match reserved {
            Ok(r) => r?,
            Err(_) => {
                guard.reason = "decode pool exhausted";
                return Err(Status::resource_exhausted(format!(
                    "no KV pages for a {}-token prompt became free within {:?}",
                    req.prompt.len(),
                    self.times.admission
                )));
            }
        };
        let deadline = tokio::time::Instant::now() + self.times.transfer;
        let (client, _) = self
            .open_room(
                client,
                deadline,
                (room, cpb::RoomSide::Receiver),
                (&req.id, &trace_id),
                RoomOpen {
                    home: "",
                    held_pages: held as u32,
                },
            )
            .await?;
        guard.client = client.clone();
        room_event("receiver_joined");
        // The prefill computes the prompt meanwhile. However long that takes on this
        // machine is bounded by the room's own deadline at the cache service
        // (`--room-wait-ms`), which fails the room; here the service only has to answer
        // each wait in time. This side's transfer deadline starts once the sender writes.
        let transfer = self.times.transfer;
        wait_room(&client, room, cpb::RoomState::Transferring, || {
            tokio::time::Instant::now() + transfer
        })
        .await?;
        room_event("transferring");
        let deadline = tokio::time::Instant::now() + transfer;
        wait_room(&client, room, cpb::RoomState::Success, || deadline).await?;
        room_event("success");
        let arrived = Instant::now();
        let got = by(deadline, "room result", client.room_result(room)).await?;
        let aux = got
            .aux
            .ok_or_else(|| Status::internal("a room result without aux data"))?;
        if aux.room != room || aux.prompt_tokens as usize != req.prompt.len() {
            return Err(Status::data_loss(format!(
                "aux data for room {} ({} prompt tokens) arrived in room {room} ({} tokens)",
                aux.room,
                aux.prompt_tokens,
                req.prompt.len()
            )));
        }
        // The pages it held stayed here; the rest arrived.
        let pages = pages - held;
        if got.pages.len() != pages {
            return Err(Status::data_loss(format!(
                "{} pages arrived for {pages} reserved",
                got.pages.len()
            )));
        }
        let mirror = client
            .shared_mirror()
            .ok_or_else(|| Status::internal("rooms need the shm data plane"))?;
        transfer_event(
            "kv_cache_transfer_start",
            (pages, held),
            client.page_bytes(),
            None,
        );
        let t0 = Instant::now();
        let sent = got.pages;
        let of = sent.len();
        // The page that failed its checksum, if one does (for the report).
        let bad: Arc<Mutex<Option<BadPage>>> = Arc::default();
        let bad2 = bad.clone();
        let logprob = (!aux.first_logprob.is_nan()).then(|| Logprob {
            logprob: aux.first_logprob,
            top: aux
                .first_top_logprobs
                .iter()
                .map(|t| (t.token_id, t.logprob))
                .collect(),
        });
        engine
            .import(
                (req.id.clone(), generation.ticket()),
                aux.first_token,
                logprob,
                aux.cached_tokens as usize,
                Box::new(move |dst: &mut [&mut [u8]]| {
                    for (index, (d, p)) in dst.iter_mut().zip(&sent).enumerate() {
                        let found = mirror.read_checked(p.slot, d);
                        if found != p.checksum {
                            *bad2.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                                Some(BadPage {
                                    index,
                                    slot: p.slot,
                                    expected: p.checksum,
                                    found,
                                });
                            return Err(format!(
                                "page {index} (mirror slot {}) does not match its checksum: {found:#018x}, committed {:#018x}",
                                p.slot, p.checksum
                            ));
                        }
                    }
                    Ok(())
                }),
            )
            .await
            .map_err(|e| match e {
                pdmesh_engine::EngineError::Transfer(m) => {
                    let b = *bad.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    if let (Some(inc), Some(b)) = (&self.incidents, b) {
                        let summary = format!(
                            "Room {room}: page {} of the {of} pages prefill committed did not \
                             match its checksum when this decode worker read it from the \
                             host mirror (slot {}): the bytes changed in the mirror after the \
                             commit. The request failed with DATA_LOSS; nothing was \
                             generated from those pages.",
                            b.index, b.slot
                        );
                        let h = Handed {
                            req: &req,
                            trace_id: &trace_id,
                            room,
                        };
                        inc.handover_checksum("hand-over read", &h, (&[b], of), None, summary);
                    }
                    Status::data_loss(m)
                }
                e => Status::from(crate::Error::from(e)),
            })?;
        let secs = t0.elapsed().as_secs_f64();
        // The bytes are verified and ours: the room may end even if this call is lost.
        if let Err(s) = by(deadline, "room finish", client.room_finish(room)).await {
            tracing::debug!(room, error = %s.message(), "room finish failed; its deadline frees the slots");
        }
        guard.armed = false;
        self.count(pages, pages * client.page_bytes(), secs);
        transfer_event(
            "kv_cache_transfer_end",
            (pages, held),
            client.page_bytes(),
            Some(secs),
        );
        drop(handover);
        // The whole request's stages, as the prefill side measured its own: the report a
        // unified worker would give, plus the hand-over.
        let prefill_stages = Stages {
            queue: aux.queue_seconds,
            prefill: aux.prefill_seconds,
            transfer: aux.send_seconds + arrived.elapsed().as_secs_f64(),
            decode: 0.0,
        };
        let host_cached = aux.host_cached_tokens;
        let page_size = self.layout.page_size();
        while let Some(item) = generation.next().await {
            let item = item
                .map(|ev| match ev {
                    Event::Finished(f) => Event::Finished(Finish {
                        host_cached_tokens: host_cached.min(f.cached_tokens),
                        // Pages decode held already were not handed over.
                        transferred_tokens: f
                            .prompt_tokens
                            .saturating_sub((held * page_size) as u32),
                        stages: Stages {
                            decode: f.stages.decode,
                            ..prefill_stages
                        },
                        ..f
                    }),
                    ev => ev,
                })
                .map_err(|e| Status::from(crate::Error::from(e)));
            if tx.send(item).await.is_err() {
                break; // the caller left; dropping the generation aborts the request
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use pdmesh_cache_client::mirror::Mirror;
    use pdmesh_kv::page_checksum;

    use super::*;

    /// Three staged pages of distinct bytes and their checksums.
    fn staged(page_bytes: usize) -> (Vec<u8>, Vec<u64>) {
        let buf: Vec<u8> = (0..3 * page_bytes)
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        let sums = buf.chunks_exact(page_bytes).map(page_checksum).collect();
        (buf, sums)
    }

    /// A cache service on loopback (at `addr`; port 0 picks one) that stops when `stop` is
    /// cancelled.
    async fn cache_service(
        addr: std::net::SocketAddr,
        shm: &std::path::Path,
        layout: &KvLayout,
        stop: tokio_util::sync::CancellationToken,
    ) -> (
        std::net::SocketAddr,
        tokio::task::JoinHandle<Result<(), pdmesh_cache::Error>>,
    ) {
        let mut cfg = pdmesh_cache::Config::new(pdmesh_cache::MirrorSize::Bytes(
            16 * layout.bytes_per_page() as u64,
        ));
        cfg.tls = pdmesh_tls::test_ca::args();
        cfg.shm_dir = Some(shm.to_owned());
        // Long: no heartbeat comes between the restart and the request.
        cfg.lease_ttl_ms = 60_000;
        // A restart here is a crash: no drain holds the room the test leaves open.
        cfg.drain_timeout_ms = 0;
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        (addr, tokio::spawn(pdmesh_cache::run(cfg, listener, stop)))
    }

    #[tokio::test]
    async fn a_request_in_the_moment_the_room_link_registers_again_waits_for_it() {
        let layout = KvLayout::llama(2, 1, 8, pdmesh_kv::DType::F16, 4);
        let dir = tempfile::tempdir().unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let (addr, task) = cache_service(
            "127.0.0.1:0".parse().unwrap(),
            dir.path(),
            &layout,
            stop.clone(),
        )
        .await;
        let link = RoomLink::start(
            format!("http://{addr}"),
            "w".into(),
            layout.clone(),
            pdmesh_tls::test_ca::auth(),
        );
        let first = link.wait(Duration::from_secs(10)).await.unwrap();
        // The service restarts: the link's lease is gone, and the first room call says so.
        stop.cancel();
        task.await.unwrap().unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let (_, task) = cache_service(addr, dir.path(), &layout, stop.clone()).await;
        let mut refused = None;
        for _ in 0..3 {
            match first.room_open(1, cpb::RoomSide::Sender, "r", "").await {
                Err(e) if e.code() == tonic::Code::Unavailable => continue,
                r => {
                    refused = Some(r.expect_err("the new service knows no such lease"));
                    break;
                }
            }
        }
        assert_eq!(refused.unwrap().code(), tonic::Code::NotFound);
        assert!(
            link.get().is_none(),
            "the link is down until it registers again"
        );
        // A request now is served once the link registered again, not refused.
        let again = link.wait(RELINK_GRACE).await.unwrap();
        assert!(again.is_alive());
        again
            .room_open(1, cpb::RoomSide::Sender, "r", "")
            .await
            .unwrap();
        drop(link);
        stop.cancel();
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_room_open_refused_for_a_lease_the_service_forgot_opens_again_with_the_new_one() {
        let layout = KvLayout::llama(2, 1, 8, pdmesh_kv::DType::F16, 4);
        let dir = tempfile::tempdir().unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let any = "127.0.0.1:0".parse().unwrap();
        let (addr, task) = cache_service(any, dir.path(), &layout, stop.clone()).await;
        let times = PdTimes {
            admission: Duration::from_secs(5),
            transfer: Duration::from_secs(5),
            write_delay: None,
            fault_count: 0,
            missize: None,
        };
        let url = format!("http://{addr}");
        let pd = Pd::new(
            Role::Prefill,
            Some(&url),
            None,
            &layout,
            times,
            Vec::new(),
            pdmesh_tls::test_ca::auth(),
        );
        let first = pd.client().await.unwrap();
        // The service restarts, forgetting the lease, and no heartbeat comes to say so.
        stop.cancel();
        task.await.unwrap().unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let (_, task) = cache_service(addr, dir.path(), &layout, stop.clone()).await;
        // The broken connection fails a call before it connects again: a call that
        // changes nothing takes that.
        for _ in 0..3 {
            match first.room_abort(9, "reconnecting").await {
                Err(e) if e.code() == tonic::Code::Unavailable => continue,
                _ => break,
            }
        }
        // A request holding the old client opens its room.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let (again, st) = pd
            .open_room(
                first.clone(),
                deadline,
                (1, cpb::RoomSide::Sender),
                ("r", ""),
                RoomOpen::default(),
            )
            .await
            .expect("opened with the lease registered again, not refused");
        assert_eq!(st.state, cpb::RoomState::Bootstrapping as i32);
        assert!(!first.is_alive());
        assert!(!Arc::ptr_eq(&again, &first), "registered again");
        drop((pd, first, again));
        stop.cancel();
        task.await.unwrap().unwrap();
    }

    /// The codes a gateway answers with a 4xx, blaming the client's request.
    const CLIENT_ERRORS: [tonic::Code; 4] = [
        tonic::Code::InvalidArgument,
        tonic::Code::FailedPrecondition,
        tonic::Code::OutOfRange,
        tonic::Code::NotFound,
    ];

    #[test]
    fn every_code_a_cache_service_refuses_a_room_call_with_is_passed_on_as_the_meshs_fault() {
        use tonic::Code::*;
        let table = [
            (Ok, Internal),
            (Cancelled, Cancelled),
            (Unknown, Internal),
            (InvalidArgument, Internal),
            (DeadlineExceeded, DeadlineExceeded),
            (NotFound, Aborted),
            (AlreadyExists, Internal),
            (PermissionDenied, Internal),
            // A full mirror: the mesh's overload, retried until the transfer deadline.
            (ResourceExhausted, ResourceExhausted),
            (FailedPrecondition, Internal),
            (Aborted, Aborted),
            (OutOfRange, Internal),
            (Unimplemented, Internal),
            (Internal, Internal),
            (Unavailable, Unavailable),
            (DataLoss, DataLoss),
            (Unauthenticated, Internal),
        ];
        assert_eq!(table.len(), 17, "every gRPC code");
        for (code, want) in table {
            let passed = from_cache(Status::new(code, "the cache service's words"));
            assert_eq!(passed.code(), want, "{code:?}");
            assert!(!CLIENT_ERRORS.contains(&passed.code()), "{code:?}");
            assert!(
                passed.message().contains("the cache service's words"),
                "{code:?}: {passed:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_cache_services_refusals_of_room_calls_never_reach_the_caller_as_client_errors() {
        use tonic::Code::*;
        let layout = KvLayout::llama(2, 1, 8, pdmesh_kv::DType::F16, 4);
        let dir = tempfile::tempdir().unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let any = "127.0.0.1:0".parse().unwrap();
        let (addr, task) = cache_service(any, dir.path(), &layout, stop.clone()).await;
        let c = HostClient::connect(
            &format!("http://{addr}"),
            "w",
            &layout,
            DataPlane::Shm,
            &pdmesh_tls::test_ca::auth(),
        )
        .await
        .unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        // A room this worker sends in, with no receiver yet.
        c.room_open(7, cpb::RoomSide::Sender, "r", "")
            .await
            .unwrap();
        let refused = [
            // A malformed call, a room in the wrong state, a side this lease is not, an
            // unknown room: the service's own words, and what this worker passes on.
            (
                "room 0",
                by(
                    deadline,
                    "open",
                    c.room_open(0, cpb::RoomSide::Sender, "r", ""),
                )
                .await
                .map(|_| ()),
                InvalidArgument,
                Internal,
            ),
            (
                "a start before the receiver joined",
                by(deadline, "start", c.room_start(7, 1)).await.map(|_| ()),
                FailedPrecondition,
                Internal,
            ),
            (
                "the sender asking for the receiver's pages",
                by(deadline, "result", c.room_result(7)).await.map(|_| ()),
                PermissionDenied,
                Internal,
            ),
            (
                "a room never opened",
                by(
                    deadline,
                    "wait",
                    c.room_wait(8, cpb::RoomState::Success, Duration::from_millis(1)),
                )
                .await
                .map(|_| ()),
                NotFound,
                Aborted,
            ),
        ];
        for (what, got, said, want) in refused {
            let e = got.expect_err(what);
            assert_eq!(e.code(), want, "{what}: {e:?}");
            assert!(!CLIENT_ERRORS.contains(&e.code()), "{what}: {e:?}");
            // The service's words travel along, and its code with them where it changed.
            if said != want {
                assert!(
                    e.message().contains(&format!("{said:?}")) || said == NotFound,
                    "{what}: {e:?}"
                );
            }
        }
        drop(c);
        stop.cancel();
        task.await.unwrap().unwrap();
    }

    #[test]
    fn staged_pages_land_in_their_slots_with_the_engines_checksums() {
        let dir = tempfile::tempdir().unwrap();
        let mirror = Mirror::create(dir.path(), 256, 8).unwrap();
        let (buf, sums) = staged(256);
        let slots = [5, 0, 3];
        assert_eq!(
            write_pages(&mirror, &buf, &slots, &sums, None).unwrap(),
            Ok(sums.clone())
        );
        let mut scratch = Vec::new();
        for (i, &slot) in slots.iter().enumerate() {
            assert_eq!(mirror.checksum(slot, &mut scratch), sums[i]);
            assert_eq!(scratch, buf[i * 256..(i + 1) * 256]);
        }
    }

    #[test]
    fn a_page_that_changed_after_staging_is_data_loss_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let mirror = Mirror::create(dir.path(), 256, 8).unwrap();
        let (buf, mut sums) = staged(256);
        sums[1] ^= 1;
        let bad = write_pages(&mirror, &buf, &[0, 4, 2], &sums, None)
            .unwrap()
            .unwrap_err();
        assert_eq!(
            bad,
            [BadPage {
                index: 1,
                slot: 4,
                expected: sums[1],
                found: sums[1] ^ 1
            }]
        );
        let err = changed(&bad, 3, "the engine and the host mirror");
        assert_eq!(err.code(), tonic::Code::DataLoss);
        assert!(
            err.message().starts_with("1 of 3 pages changed")
                && err.message().contains("page 1 (mirror slot 4)"),
            "{}",
            err.message()
        );
    }

    #[test]
    fn pages_of_another_size_are_refused_naming_both_sizes() {
        let (a, b) = ([1u8; 256], [2u8; 132]);
        let err = stage_pages(&[&a, &b], 0, 256).unwrap_err();
        assert!(err.contains("132 bytes") && err.contains("256"), "{err}");
        // The pages decode holds are not staged, so their size is not asked.
        let (buf, sums) = stage_pages(&[&b, &a], 1, 256).unwrap();
        assert_eq!((buf, sums), (a.to_vec(), vec![page_checksum(&a)]));
        let dir = tempfile::tempdir().unwrap();
        let mirror = Mirror::create(dir.path(), 256, 8).unwrap();
        let err = write_pages(&mirror, &a, &[0, 1], &[page_checksum(&a)], None).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Internal, "{}", err.message());
    }

    fn deepseek_bf16() -> KvLayout {
        pdmesh_kv::KvLayout::deepseek_v32(
            1,
            pdmesh_kv::MlaDims::V32,
            pdmesh_kv::MlaCacheDtype::Bf16,
            pdmesh_kv::IndexKDtype::Bf16,
            1,
        )
        .unwrap()
    }

    #[test]
    fn the_seeds_fault_unchecked_writes_its_loss_behind_valid_checksums() {
        let layout = deepseek_bf16();
        let page_bytes = layout.bytes_per_page();
        let dir = tempfile::tempdir().unwrap();
        let mirror = Mirror::create(dir.path(), page_bytes, 4).unwrap();
        let (buf, sums) = staged(page_bytes);
        let got = write_pages(
            &mirror,
            &buf,
            &[0, 1, 2],
            &sums,
            Some((Missize::Unchecked, &layout)),
        )
        .unwrap()
        .unwrap();
        let mut scratch = Vec::new();
        for (i, &sum) in got.iter().enumerate() {
            assert_ne!(sum, sums[i], "page {i} lost nothing");
            assert_eq!(mirror.checksum(i as u32, &mut scratch), sum);
        }
    }

    #[test]
    fn the_seeds_fault_is_caught_by_the_engines_checksums_and_reported_with_both_layouts() {
        let layout = deepseek_bf16();
        let page_bytes = layout.bytes_per_page();
        let dir = tempfile::tempdir().unwrap();
        let mirror = Mirror::create(dir.path(), page_bytes, 4).unwrap();
        let (buf, sums) = staged(page_bytes);
        let bad = write_pages(
            &mirror,
            &buf,
            &[0, 1, 2],
            &sums,
            Some((Missize::Checked, &layout)),
        )
        .unwrap()
        .unwrap_err();
        assert_eq!(bad.iter().map(|b| b.index).collect::<Vec<_>>(), [0, 1, 2]);
        let reports = tempfile::tempdir().unwrap();
        let inc = Incidents::from_flags(
            Some(reports.path()),
            (None, None, false),
            "prefill pid 1".into(),
            Default::default(),
        )
        .unwrap()
        .unwrap();
        let req = GenRequest {
            id: "req-1".into(),
            prompt: vec![1, 2, 3],
            params: Default::default(),
        };
        report_write(
            &inc,
            (&req, "trace-1", 9),
            &bad,
            3,
            &layout,
            Some(Missize::Checked),
        );
        let all = pdmesh_incident::list(reports.path()).unwrap();
        let i = &all[0];
        assert_eq!(i.kind, pdmesh_incident::Kind::Checksum);
        assert_eq!(i.place.room, Some(9));
        assert_eq!(i.pages.len(), 3);
        let l = i.layouts.as_ref().unwrap();
        assert_eq!(
            l.differences(),
            ["index_k: 256 B/token (bf16) vs 132 B/token (fp8_e4m3)"]
        );
        // Without --incident-include-prompts: the prompt's length, not its ids.
        let replay = i.replay.as_ref().unwrap();
        assert!(replay.prompt_token_ids.is_empty() && replay.body.get("prompt").is_none());
        assert_eq!(i.details["prompt tokens"], "3");
    }
}

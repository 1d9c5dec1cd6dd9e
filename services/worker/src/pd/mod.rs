//! Prefill/decode disaggregation on the worker side: a prefill worker computes a prompt and
//! sends its KV pages through a room at the cache service; a decode worker reserves pages
//! first, receives them and generates. Every wait is bounded (the room's deadlines at the
//! service, this worker's transfer deadline here), and whatever ends a request early —
//! an error, a deadline, the caller leaving, a panic in the task — aborts its room, so the
//! other side learns it at its next call, and lets go of the pages it held.
//!
//! A request's side runs in `prefill` or `decode`; `room` holds the link to the cache
//! service and its room calls with their deadlines, `pages` the staging, writing and
//! checksums of the pages that travel, and `stats` what the hand-overs count.

mod decode;
mod error;
mod pages;
mod prefill;
mod stats;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_cache_client::client::{HostClient, RoomOpen};
use pdmesh_engine::{GenRequest, Part};
use pdmesh_kv::KvLayout;
use pdmesh_proto::cache::v1 as cpb;
use pdmesh_telemetry::KeyValue;
use tokio::sync::mpsc;
use tonic::Status;
use tracing::Instrument as _;

use crate::actor::EngineHandle;
use crate::engine_core::Event;
use crate::incidents::Incidents;
pub(crate) use error::PdError;
use pdmesh_cache_client::rooms::{HandoverError, RELINK_GRACE, RoomGuard, RoomLink};
use stats::PdStats;

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

type Item = Result<Event, Status>;

impl Pd {
    pub(crate) fn new(
        role: Role,
        cache_url: Option<&str>,
        advertised: Option<&str>,
        (layout, model): (&KvLayout, &str),
        times: PdTimes,
        eos: Vec<u32>,
        auth: pdmesh_tls::MeshAuth,
    ) -> Self {
        let link = match (role, cache_url) {
            (Role::Unified, _) | (_, None) => None,
            (_, Some(url)) => Some(RoomLink::start(
                url.to_owned(),
                (
                    format!("{}-{}", role.name(), std::process::id()),
                    model.to_owned(),
                ),
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

    fn link(&self) -> Result<&RoomLink, PdError> {
        self.link
            .as_ref()
            .ok_or_else(|| PdError::Internal("this worker has no cache service".into()))
    }

    async fn client(&self) -> Result<Arc<HostClient>, PdError> {
        Ok(self.link()?.wait(RELINK_GRACE).await?)
    }

    /// Runs one request's side of a room; the returned channel carries its events.
    pub(crate) async fn generate(
        self: &Arc<Self>,
        engine: &EngineHandle,
        (req, group): (GenRequest, Option<(String, usize)>),
        room: u64,
        trace_id: String,
        kv_home: String,
    ) -> Result<mpsc::Receiver<Item>, PdError> {
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
                    .link()?
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
                    return Err(HandoverError::Failed(st.reason).into());
                }
                let guard = RoomGuard {
                    client: client.clone(),
                    room,
                    reason: "prefill ended before its pages were sent",
                    armed: true,
                };
                let generation = engine
                    .generate_shared(req.clone(), Part::Prefill, group)
                    .await?;
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
                let generation = engine.generate_part(req.clone(), Part::Decode).await?;
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
    async fn drive(
        &self,
        work: impl Future<Output = Result<(), PdError>>,
        tx: &mpsc::Sender<Item>,
    ) {
        let out = tokio::select! {
            r = work => r,
            () = tx.closed() => Err(PdError::CallerLeft),
        };
        if let Err(e) = out {
            self.fail(&e);
            let why = e.failure();
            let span = tracing::Span::current();
            span.record("otel.status_code", "ERROR");
            pdmesh_telemetry::event(
                &span,
                "kv_cache_transfer_failed",
                vec![
                    KeyValue::new("error.type", why.name()),
                    KeyValue::new("pdmesh.error", e.to_string()),
                ],
            );
            if why != pdmesh_telemetry::labels::TransferFailure::CallerLeft {
                tracing::warn!(error = %e, "KV transfer failed");
            }
            let _ = tx.send(Err(e.into())).await;
        }
    }
}

//! The engine's device actor: an actix `SyncArbiter` of one on its own OS thread, a thin
//! shell over [`EngineCore`]. It steps the engine one scheduler iteration per `Step`
//! message and re-queues `Step` while there is work, so `Submit` and `Abort` interleave
//! between steps. [`EngineHandle`] is the tokio side's cloneable address.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use actix::{Actor, Addr, Handler, Message, SyncArbiter, SyncContext};
use futures::Stream;
use pdmesh_engine::{Engine, EngineError, GenRequest, Logprob, ModelInfo, Part};
use pdmesh_kv::CacheEvent;
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::engine_core::{EngineCore, Event, ExportFn, ImportFn, PoolNow};

/// Hand (a part of) a request to the engine; its events go to `tx`.
struct Submit {
    req: GenRequest,
    part: Part,
    /// The prompt group it shares its prompt with (`n` > 1) and the group's size.
    group: Option<(String, usize)>,
    ticket: u64,
    tx: mpsc::UnboundedSender<Event>,
}

/// Hand a prefilled prompt's pages to a writer, then let them go.
struct Export {
    id: String,
    ticket: u64,
    f: ExportFn,
}
impl Message for Export {
    type Result = Result<Vec<u64>, EngineError>;
}

/// Let go of a prefilled prompt's pages unsent.
struct DropExport {
    id: String,
    ticket: u64,
}
impl Message for DropExport {
    type Result = bool;
}

/// Give a decode request its prompt's KV and first token.
struct Import {
    id: String,
    ticket: u64,
    token: u32,
    logprob: Option<Logprob>,
    cached: usize,
    fill: ImportFn,
}
impl Message for Import {
    type Result = Result<(), EngineError>;
}

/// How the engine loop is doing, readable without a message (for the watchdog, which
/// must see a loop that stopped answering messages).
#[derive(Debug, Default)]
pub(crate) struct Progress {
    pub steps: AtomicU64,
    /// Milliseconds since `start` when the last step ended (or work arrived).
    pub last_ms: AtomicU64,
    /// Whether there was work after the last step.
    pub busy: std::sync::atomic::AtomicBool,
    pub start: std::sync::OnceLock<std::time::Instant>,
}

impl Progress {
    fn now_ms(&self) -> u64 {
        self.start
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_millis() as u64
    }

    fn mark(&self, busy: bool) {
        self.last_ms.store(self.now_ms(), Ordering::Relaxed);
        self.busy.store(busy, Ordering::Relaxed);
    }

    /// Seconds since the loop last moved while it had work; 0 when idle.
    pub fn idle_seconds(&self) -> f64 {
        if !self.busy.load(Ordering::Relaxed) {
            return 0.0;
        }
        self.now_ms()
            .saturating_sub(self.last_ms.load(Ordering::Relaxed)) as f64
            / 1000.0
    }
}
impl Message for Submit {
    type Result = Result<(), EngineError>;
}

/// Abort request `id`; with a ticket, only that submission of it.
struct Abort {
    id: String,
    ticket: Option<u64>,
}
impl Message for Abort {
    type Result = bool;
}

/// Abort everything (shutdown).
struct AbortAll;
impl Message for AbortAll {
    type Result = usize;
}

/// Run one engine step.
struct Step;
impl Message for Step {
    type Result = ();
}

/// The model's facts and the free pages now.
struct Info;
impl Message for Info {
    type Result = Result<(ModelInfo, PoolNow), EngineError>;
}

/// Evict every cached page no request uses; how many were freed.
struct FlushCache;
impl Message for FlushCache {
    type Result = Result<usize, EngineError>;
}

/// Changes to the device prefix cache, numbered from 1 in this worker's life.
pub(crate) type KvBatch = Arc<[(u64, CacheEvent)]>;

/// Subscribe to the device prefix cache: the last change's number, every page held now
/// (as events), and a receiver of the changes after those.
struct SubscribeKv;
impl Message for SubscribeKv {
    type Result = (u64, Vec<CacheEvent>, broadcast::Receiver<KvBatch>);
}

/// A host-tier answer arrived: the engine has work again.
struct HostReady;
impl Message for HostReady {
    type Result = ();
}

/// The engine's host-tier waker: tells the actor, once its address exists, that an answer
/// arrived. The engine thread never waits for one.
struct WakeActor(Arc<std::sync::OnceLock<Addr<EngineActor>>>);

impl std::task::Wake for WakeActor {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(addr) = self.0.get() {
            addr.do_send(HostReady);
        }
    }
}

/// Batches of changes kept for subscribers that fall behind, before they lose events.
const KV_BACKLOG: usize = 1024;

/// The actor: [`EngineCore`] plus the one-`Step`-in-flight flag.
struct EngineActor {
    core: EngineCore<Engine>,
    step_queued: bool,
    progress: Arc<Progress>,
    kv: broadcast::Sender<KvBatch>,
    kv_seq: u64,
    /// Test-only fault: before step number `.0`, the loop sleeps `.1`.
    stall_fault: Option<(u64, std::time::Duration)>,
    /// Dropped with the actor, which tells [`EngineThread::stop`] the engine is released.
    _released: Option<oneshot::Sender<()>>,
}

impl EngineActor {
    /// Sends the prefix cache's changes to subscribers (each message that reaches the
    /// engine ends here, through `kick`).
    fn publish(&mut self) {
        let events = self.core.take_cache_events();
        if events.is_empty() {
            return;
        }
        let batch: KvBatch = events
            .into_iter()
            .map(|e| {
                self.kv_seq += 1;
                (self.kv_seq, e)
            })
            .collect();
        // No subscriber is fine: the changes are for whoever listens now.
        let _ = self.kv.send(batch);
    }

    /// Publishes the cache's changes, then queues a `Step` unless one is already queued or
    /// there is nothing to do.
    fn kick(&mut self, ctx: &mut SyncContext<Self>) {
        self.publish();
        let work = self.core.has_work();
        if work && !self.progress.busy.load(Ordering::Relaxed) {
            self.progress.mark(true);
        }
        if !self.step_queued && work {
            self.step_queued = true;
            ctx.address().do_send(Step);
        }
    }
}

impl Actor for EngineActor {
    type Context = SyncContext<Self>;
}

impl Handler<Submit> for EngineActor {
    type Result = Result<(), EngineError>;
    fn handle(&mut self, msg: Submit, ctx: &mut Self::Context) -> Self::Result {
        self.core.submit(
            msg.req,
            msg.part,
            msg.group.as_ref().map(|(g, n)| (g.as_str(), *n)),
            msg.ticket,
            msg.tx,
        )?;
        self.kick(ctx);
        Ok(())
    }
}

impl Handler<HostReady> for EngineActor {
    type Result = ();
    fn handle(&mut self, _msg: HostReady, ctx: &mut Self::Context) {
        self.kick(ctx);
    }
}

impl Handler<Export> for EngineActor {
    type Result = Result<Vec<u64>, EngineError>;
    fn handle(&mut self, msg: Export, ctx: &mut Self::Context) -> Self::Result {
        let out = self.core.export(&msg.id, msg.ticket, msg.f);
        self.kick(ctx);
        out
    }
}

impl Handler<DropExport> for EngineActor {
    type Result = bool;
    fn handle(&mut self, msg: DropExport, ctx: &mut Self::Context) -> bool {
        let out = self.core.drop_export(&msg.id, msg.ticket);
        self.kick(ctx);
        out
    }
}

impl Handler<Import> for EngineActor {
    type Result = Result<(), EngineError>;
    fn handle(&mut self, msg: Import, ctx: &mut Self::Context) -> Self::Result {
        let out = self.core.import(
            (&msg.id, msg.ticket),
            msg.token,
            msg.logprob,
            msg.cached,
            msg.fill,
        );
        self.kick(ctx);
        out
    }
}

impl Handler<Abort> for EngineActor {
    type Result = bool;
    fn handle(&mut self, msg: Abort, ctx: &mut Self::Context) -> bool {
        let out = self.core.abort(&msg.id, msg.ticket);
        // An abort may free pages a queued request waits for.
        self.kick(ctx);
        out
    }
}

impl Handler<AbortAll> for EngineActor {
    type Result = usize;
    fn handle(&mut self, _msg: AbortAll, _ctx: &mut Self::Context) -> usize {
        self.core.abort_all()
    }
}

impl Handler<Step> for EngineActor {
    type Result = ();
    fn handle(&mut self, _msg: Step, ctx: &mut Self::Context) {
        self.step_queued = false;
        if let Some((at, pause)) = self.stall_fault
            && self.progress.steps.load(Ordering::Relaxed) == at
        {
            tracing::warn!(?pause, "fault injection: the engine loop stalls");
            std::thread::sleep(pause);
        }
        self.core.step();
        self.progress.steps.fetch_add(1, Ordering::Relaxed);
        self.progress.mark(self.core.has_work());
        self.kick(ctx);
    }
}

impl Handler<SubscribeKv> for EngineActor {
    type Result = actix::MessageResult<SubscribeKv>;
    fn handle(&mut self, _msg: SubscribeKv, _ctx: &mut Self::Context) -> Self::Result {
        // Changes before the snapshot go out first, so none is both in it and after it.
        self.publish();
        actix::MessageResult((self.kv_seq, self.core.cache_snapshot(), self.kv.subscribe()))
    }
}

impl Handler<FlushCache> for EngineActor {
    type Result = Result<usize, EngineError>;
    fn handle(&mut self, _msg: FlushCache, ctx: &mut Self::Context) -> Self::Result {
        let out = self.core.flush_cache();
        // Subscribers see the pages removed; freed pages may admit a queued request.
        self.kick(ctx);
        out
    }
}

impl Handler<Info> for EngineActor {
    type Result = Result<(ModelInfo, PoolNow), EngineError>;
    fn handle(&mut self, _msg: Info, _ctx: &mut Self::Context) -> Self::Result {
        self.core.info()
    }
}

/// The OS thread running the actix system that hosts the engine actor.
pub(crate) struct EngineThread {
    system: actix::System,
    /// Both `Some` until [`EngineThread::stop`] takes them.
    thread: Option<std::thread::JoinHandle<()>>,
    released: Option<oneshot::Receiver<()>>,
}

impl EngineThread {
    /// Stops the actor system and waits until the engine has been dropped. Call it after
    /// every [`EngineHandle`] is gone, or the engine finishes its queued messages first.
    pub(crate) async fn stop(mut self) {
        self.system.stop();
        if let Some(released) = self.released.take() {
            // Err means the sender was dropped with the actor: the engine is released.
            let _ = released.await;
        }
        if let Some(thread) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

impl Drop for EngineThread {
    /// Without an orderly [`EngineThread::stop`] (the `run` future was dropped), still
    /// stop the system so its thread does not outlive the service.
    fn drop(&mut self) {
        self.system.stop();
    }
}

/// Starts the actor system on a dedicated thread and moves `engine` into a `SyncArbiter`
/// of one. Returns the handle the gRPC side uses and the thread to stop at shutdown.
pub(crate) fn start(
    mut engine: Engine,
    stall: Option<crate::faults::StallStep>,
) -> std::io::Result<(EngineHandle, EngineThread)> {
    // Fault injection for the watchdog test, only from `--fault-stall-step`.
    let stall_fault = stall.map(|s| (s.step, s.pause));
    engine.record_cache_events();
    let actor: Arc<std::sync::OnceLock<Addr<EngineActor>>> = Arc::default();
    engine.set_host_waker(std::task::Waker::from(Arc::new(WakeActor(actor.clone()))));
    let kv = broadcast::channel(KV_BACKLOG).0;
    let (released_tx, released) = oneshot::channel();
    // SyncArbiter wants a factory it could call again (it restarts a stopped actor); the
    // engine exists once, so a restarted actor is offline.
    let slot = Arc::new(Mutex::new(Some((engine, released_tx))));
    let progress: Arc<Progress> = Arc::default();
    progress.mark(false);
    let factory_progress = progress.clone();
    let factory = move || {
        let progress = factory_progress.clone();
        let taken = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        match taken {
            Some((engine, released)) => EngineActor {
                core: EngineCore::new(engine),
                step_queued: false,
                progress,
                kv: kv.clone(),
                kv_seq: 0,
                stall_fault,
                _released: Some(released),
            },
            None => EngineActor {
                core: EngineCore::offline(),
                step_queued: false,
                progress,
                kv: kv.clone(),
                kv_seq: 0,
                stall_fault,
                _released: None,
            },
        }
    };
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("pdmesh-engine-system".into())
        .spawn(move || {
            let runner = actix::System::new();
            let addr = runner.block_on(async move { SyncArbiter::start(1, factory) });
            if ready_tx.send((addr, actix::System::current())).is_err() {
                return;
            }
            if let Err(e) = runner.run() {
                tracing::error!(error = %e, "engine actor system failed");
            }
        })?;
    let (addr, system) = ready_rx
        .recv()
        .map_err(|_| std::io::Error::other("the engine actor system did not start"))?;
    // No fetch starts before a request comes through the handle made below, so no answer
    // comes before this.
    let _ = actor.set(addr.clone());
    let handle = EngineHandle {
        addr,
        tickets: Arc::new(AtomicU64::new(0)),
        progress,
    };
    Ok((
        handle,
        EngineThread {
            system,
            thread: Some(thread),
            released: Some(released),
        },
    ))
}

fn offline(_: actix::MailboxError) -> EngineError {
    EngineError::Offline
}

/// Cloneable address of the engine actor, for async code.
#[derive(Clone)]
pub(crate) struct EngineHandle {
    addr: Addr<EngineActor>,
    tickets: Arc<AtomicU64>,
    progress: Arc<Progress>,
}

impl EngineHandle {
    /// Submits `part` of `req` (see [`Part`]); engine validation errors come back here,
    /// before any token.
    pub(crate) async fn generate_part(
        &self,
        req: GenRequest,
        part: Part,
    ) -> Result<Generation, EngineError> {
        self.generate_shared(req, part, None).await
    }

    /// Submits `part` of `req`, one of the choices sharing prompt `group` when given.
    pub(crate) async fn generate_shared(
        &self,
        req: GenRequest,
        part: Part,
        group: Option<(String, usize)>,
    ) -> Result<Generation, EngineError> {
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        let id = req.id.clone();
        let (tx, rx) = mpsc::unbounded_channel();
        self.addr
            .send(Submit {
                req,
                part,
                group,
                ticket,
                tx,
            })
            .await
            .map_err(offline)??;
        Ok(Generation {
            rx,
            guard: AbortOnDrop {
                addr: Some(self.addr.clone()),
                id,
                ticket,
            },
            done: false,
        })
    }

    /// Aborts request `id`; whether it was running.
    pub(crate) async fn abort(&self, id: String) -> Result<bool, EngineError> {
        self.addr
            .send(Abort { id, ticket: None })
            .await
            .map_err(offline)
    }

    /// Aborts every running request; how many there were.
    pub(crate) async fn abort_all(&self) -> Result<usize, EngineError> {
        self.addr.send(AbortAll).await.map_err(offline)
    }

    /// The device prefix cache now and its changes from now on (see [`SubscribeKv`]).
    pub(crate) async fn subscribe_kv(
        &self,
    ) -> Result<(u64, Vec<CacheEvent>, broadcast::Receiver<KvBatch>), EngineError> {
        self.addr.send(SubscribeKv).await.map_err(offline)
    }

    /// Evicts every cached page no request uses (see [`Engine::flush_cache`]); how many
    /// were freed.
    pub(crate) async fn flush_cache(&self) -> Result<usize, EngineError> {
        self.addr.send(FlushCache).await.map_err(offline)?
    }

    pub(crate) async fn info(&self) -> Result<(ModelInfo, PoolNow), EngineError> {
        self.addr.send(Info).await.map_err(offline)?
    }

    pub(crate) fn connected(&self) -> bool {
        self.addr.connected()
    }

    pub(crate) fn progress(&self) -> &Progress {
        &self.progress
    }

    /// Hands the pages held for prefilled request `id`, submission `ticket` (see
    /// [`Generation::ticket`]), to `f` (on the engine's thread).
    pub(crate) async fn export(
        &self,
        id: String,
        ticket: u64,
        f: ExportFn,
    ) -> Result<Vec<u64>, EngineError> {
        self.addr
            .send(Export { id, ticket, f })
            .await
            .map_err(offline)?
    }

    /// Lets go of the pages held for prefilled request `id`, submission `ticket` only (fire
    /// and forget: it also runs from `Drop`, possibly after a later submission of the same
    /// id holds pages of its own).
    pub(crate) fn drop_export(&self, id: String, ticket: u64) {
        self.addr.do_send(DropExport { id, ticket });
    }

    /// Gives decode request `id` its prompt's KV (`fill` writes it, on the engine's
    /// thread) and first token.
    pub(crate) async fn import(
        &self,
        (id, ticket): (String, u64),
        token: u32,
        logprob: Option<Logprob>,
        cached: usize,
        fill: ImportFn,
    ) -> Result<(), EngineError> {
        self.addr
            .send(Import {
                id,
                ticket,
                token,
                logprob,
                cached,
                fill,
            })
            .await
            .map_err(offline)?
    }
}

/// Aborts its request in the engine when dropped, unless disarmed: a client that goes
/// away mid-generation must not keep holding KV pages.
struct AbortOnDrop {
    /// `None` once disarmed.
    addr: Option<Addr<EngineActor>>,
    id: String,
    ticket: u64,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(addr) = self.addr.take() {
            tracing::debug!(request_id = %self.id, "generation dropped before it finished; aborting");
            addr.do_send(Abort {
                id: std::mem::take(&mut self.id),
                ticket: Some(self.ticket),
            });
        }
    }
}

/// The events of one request: tokens, then one `Finished`, then the end. If the engine
/// goes away first, the last item is `Err(Offline)`. Dropping it early aborts the request.
pub(crate) struct Generation {
    rx: mpsc::UnboundedReceiver<Event>,
    guard: AbortOnDrop,
    done: bool,
}

impl Generation {
    /// Which submission of its request id this is: a later one under the same id (a
    /// request the gateway tries again) has another.
    pub(crate) fn ticket(&self) -> u64 {
        self.guard.ticket
    }

    fn end(&mut self) {
        self.done = true;
        self.guard.addr = None;
    }
}

impl Stream for Generation {
    type Item = Result<Event, EngineError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        match this.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Event::Failed(e))) => {
                this.end();
                Poll::Ready(Some(Err(EngineError::Cuda(e))))
            }
            Poll::Ready(Some(event)) => {
                if matches!(event, Event::Finished(_)) {
                    this.end();
                }
                Poll::Ready(Some(Ok(event)))
            }
            Poll::Ready(None) => {
                this.end();
                Poll::Ready(Some(Err(EngineError::Offline)))
            }
        }
    }
}

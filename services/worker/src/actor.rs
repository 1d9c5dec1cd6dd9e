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
use pdmesh_engine::{Engine, EngineError, GenRequest, ModelInfo};
use tokio::sync::{mpsc, oneshot};

use crate::engine_core::{EngineCore, Event, PoolNow};

/// Hand a request to the engine; its events go to `tx`.
struct Submit {
    req: GenRequest,
    ticket: u64,
    tx: mpsc::UnboundedSender<Event>,
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

/// The actor: [`EngineCore`] plus the one-`Step`-in-flight flag.
struct EngineActor {
    core: EngineCore<Engine>,
    step_queued: bool,
    /// Dropped with the actor, which tells [`EngineThread::stop`] the engine is released.
    _released: Option<oneshot::Sender<()>>,
}

impl EngineActor {
    /// Queues a `Step` unless one is already queued or there is nothing to do.
    fn kick(&mut self, ctx: &mut SyncContext<Self>) {
        if !self.step_queued && self.core.has_work() {
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
        self.core.submit(msg.req, msg.ticket, msg.tx)?;
        self.kick(ctx);
        Ok(())
    }
}

impl Handler<Abort> for EngineActor {
    type Result = bool;
    fn handle(&mut self, msg: Abort, _ctx: &mut Self::Context) -> bool {
        self.core.abort(&msg.id, msg.ticket)
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
        self.core.step();
        self.kick(ctx);
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
pub(crate) fn start(engine: Engine) -> std::io::Result<(EngineHandle, EngineThread)> {
    let (released_tx, released) = oneshot::channel();
    // SyncArbiter wants a factory it could call again (it restarts a stopped actor); the
    // engine exists once, so a restarted actor is offline.
    let slot = Arc::new(Mutex::new(Some((engine, released_tx))));
    let factory = move || {
        let taken = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        match taken {
            Some((engine, released)) => EngineActor {
                core: EngineCore::new(engine),
                step_queued: false,
                _released: Some(released),
            },
            None => EngineActor {
                core: EngineCore::offline(),
                step_queued: false,
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
    let handle = EngineHandle {
        addr,
        tickets: Arc::new(AtomicU64::new(0)),
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
}

impl EngineHandle {
    /// Submits `req`; engine validation errors come back here, before any token.
    pub(crate) async fn generate(&self, req: GenRequest) -> Result<Generation, EngineError> {
        let ticket = self.tickets.fetch_add(1, Ordering::Relaxed);
        let id = req.id.clone();
        let (tx, rx) = mpsc::unbounded_channel();
        self.addr
            .send(Submit { req, ticket, tx })
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

    pub(crate) async fn info(&self) -> Result<(ModelInfo, PoolNow), EngineError> {
        self.addr.send(Info).await.map_err(offline)?
    }

    pub(crate) fn connected(&self) -> bool {
        self.addr.connected()
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

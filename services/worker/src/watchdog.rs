//! The engine-loop watchdog. The engine actor marks its progress after every step
//! ([`crate::actor::Progress`]); this task looks every 250 ms. A loop that has work and has
//! finished no step for the stall limit is stuck: `soft` logs it and counts a stall;
//! `hard` also ends every request in flight on this worker with UNAVAILABLE and refuses
//! new ones until the loop moves again. Ending a request's stream drops what it holds
//! outside the engine at once — its room is aborted at the cache service, which frees the
//! host slots and tells the peer — and queues its abort for the engine, which frees its
//! pages as soon as the loop runs again.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::{Stream, StreamExt};
use pdmesh_cache_client::Watchdog;
use tokio::sync::watch;
use tonic::Status;

use crate::actor::EngineHandle;
use crate::incidents::Incidents;

/// What the gRPC side needs from the watchdog.
pub(crate) struct EngineWatch {
    mode: Watchdog,
    limit: Duration,
    /// Bumped at each stall in hard mode: streams watching it end.
    stalls_rx: watch::Receiver<u64>,
    /// Stalls seen (any mode).
    pub stalls: Arc<AtomicU64>,
    /// Requests the hard watchdog ended.
    pub aborts: Arc<AtomicU64>,
    /// Set when the worker drains (SIGTERM): new requests are refused, Health says no.
    draining: std::sync::atomic::AtomicBool,
    engine: EngineHandle,
}

/// Files an `engine_stall` report.
fn report_stall(r: &Incidents, hard: bool, idle: f64, limit: Duration) {
    let mut i = pdmesh_incident::Incident::new(
        pdmesh_incident::Kind::EngineStall,
        format!(
            "The engine loop of this worker had work but finished no step for {idle:.1} s \
             (the watchdog's limit is {:.1} s); {}.",
            limit.as_secs_f64(),
            if hard {
                "the hard watchdog ended every request in flight with UNAVAILABLE and \
                 refuses new ones until the loop moves again"
            } else {
                "the soft watchdog only logged and counted it"
            }
        ),
        r.place("engine loop"),
    );
    i.details
        .insert("idle seconds".into(), format!("{idle:.3}"));
    i.details
        .insert("watchdog".into(), if hard { "hard" } else { "soft" }.into());
    i.config
        .insert("watchdog_stall_ms".into(), limit.as_millis().to_string());
    r.file(i);
}

impl EngineWatch {
    /// Starts the watchdog task (ended by `stop`).
    pub(crate) fn start(
        engine: EngineHandle,
        (mode, incidents): (Watchdog, Option<Arc<Incidents>>),
        limit: Duration,
        stop: tokio_util::sync::CancellationToken,
    ) -> Self {
        let (tx, stalls_rx) = watch::channel(0u64);
        // The reports' stall count is this one.
        let stalls: Arc<AtomicU64> = incidents
            .as_ref()
            .map_or_else(Arc::default, |i| i.stalls.clone());
        let (h, count) = (engine.clone(), stalls.clone());
        tokio::spawn(async move {
            if mode == Watchdog::Off {
                return;
            }
            let secs = limit.as_secs_f64();
            let mut stalled = false;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                    _ = stop.cancelled() => return,
                }
                let idle = h.progress().idle_seconds();
                if idle >= secs && !stalled {
                    count.fetch_add(1, Ordering::Relaxed);
                    let hard = mode == Watchdog::Hard;
                    tracing::warn!(
                        idle_seconds = idle,
                        action = if hard {
                            "ending every request in flight"
                        } else {
                            "none (soft mode)"
                        },
                        "watchdog: the engine loop has work but made no step"
                    );
                    if hard {
                        tx.send_modify(|n| *n += 1);
                    }
                    if let Some(r) = &incidents {
                        report_stall(r, hard, idle, limit);
                    }
                }
                stalled = idle >= secs;
            }
        });
        Self {
            mode,
            limit,
            stalls_rx,
            stalls,
            aborts: Arc::default(),
            draining: Default::default(),
            engine,
        }
    }

    /// From now on new requests are refused (the worker is shutting down).
    pub(crate) fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    pub(crate) fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// In hard mode, whether the loop is stuck now.
    pub(crate) fn refusing(&self) -> bool {
        self.mode == Watchdog::Hard
            && self.engine.progress().idle_seconds() >= self.limit.as_secs_f64()
    }

    /// UNAVAILABLE while [`Self::refusing`] or draining.
    pub(crate) fn admit(&self) -> Result<(), crate::error::Error> {
        if self.draining() {
            return Err(crate::error::Error::Draining);
        }
        if self.refusing() {
            return Err(crate::error::Error::Stalled { limit: self.limit });
        }
        Ok(())
    }

    /// `inner`, ended with UNAVAILABLE at the next stall (hard mode).
    pub(crate) fn fuse<T: Send + 'static>(
        &self,
        inner: Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>,
    ) -> Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>> {
        if self.mode != Watchdog::Hard {
            return inner;
        }
        let mut stalls = self.stalls_rx.clone();
        stalls.mark_unchanged();
        let (aborts, limit) = (self.aborts.clone(), self.limit);
        Box::pin(async_stream::stream! {
            let mut inner = inner;
            loop {
                tokio::select! {
                    item = inner.next() => match item {
                        Some(item) => yield item,
                        None => break,
                    },
                    changed = stalls.changed() => {
                        if changed.is_err() {
                            // The watchdog is gone (shutdown): just forward.
                            while let Some(item) = inner.next().await {
                                yield item;
                            }
                            break;
                        }
                        aborts.fetch_add(1, Ordering::Relaxed);
                        yield Err(Status::unavailable(format!(
                            "the engine loop made no step for {limit:?}: the watchdog ended this request"
                        )));
                        break;
                    }
                }
            }
        })
    }
}

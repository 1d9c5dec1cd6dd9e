//! The standard gRPC health service (`grpc.health.v1.Health`) on the worker's port, for
//! Kubernetes' gRPC probes and any load balancer that speaks it:
//! - `readiness` (and the empty name): SERVING once the model is loaded, a disaggregated
//!   worker's cache service link is registered, the hard watchdog is not refusing, and
//!   the worker is not draining; NOT_SERVING otherwise, so traffic goes elsewhere.
//! - `liveness`: NOT_SERVING only while the engine loop has had work and made no step
//!   for the watchdog's limit (or the engine is gone): a restart is the cure then, and
//!   an open port says nothing about it.
//!
//! Both are refreshed every 250 ms.

use std::sync::Arc;
use std::time::Duration;

use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::actor::EngineHandle;
use crate::pd::Pd;
use crate::watchdog::EngineWatch;

pub(crate) const READINESS: &str = "readiness";
pub(crate) const LIVENESS: &str = "liveness";

fn status(ok: bool) -> ServingStatus {
    if ok {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

/// Keeps `reporter`'s statuses up to date until `stop`.
pub(crate) async fn run(
    reporter: HealthReporter,
    (engine, pd, watch): (EngineHandle, Arc<Pd>, Arc<EngineWatch>),
    limit: Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        let ready = engine.connected() && pd.ready() && !watch.refusing() && !watch.draining();
        let live = engine.connected() && engine.progress().idle_seconds() < limit.as_secs_f64();
        for name in ["", READINESS] {
            reporter.set_service_status(name, status(ready)).await;
        }
        reporter.set_service_status(LIVENESS, status(live)).await;
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
            () = stop.cancelled() => return,
        }
    }
}

//! Worker service: the engine in an actix actor behind pdmesh.worker.v1.
//!
//! [`run`] loads the model, moves the engine onto its own OS thread (an actix
//! `SyncArbiter` of one, see `actor`) and serves gRPC on tokio; the two sides talk only
//! through actor messages. Token ids in, token ids out: the worker never tokenizes.

#![forbid(unsafe_code)]

mod actor;
mod bundle;
mod config;
mod engine_core;
mod error;
mod faults;
mod grpc;
mod identity;
mod incidents;
mod pd;
mod probes;
mod sglang;
mod watchdog;

use pdmesh_engine::WritePolicy;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::{Config, Device, IndexKDtypeArg, KvCacheDtype, WritePolicyArg};
pub use error::Error;
pub use faults::{FaultArgs, StallStep};
pub use pd::Role;

/// The worker's listeners: its gRPC port and, for `--health-listen`, the plaintext port
/// that serves only health (without one, `run` binds `cfg.health_listen` if set).
#[derive(Debug)]
pub struct Listeners {
    pub grpc: TcpListener,
    pub health: Option<TcpListener>,
}

impl From<TcpListener> for Listeners {
    fn from(grpc: TcpListener) -> Self {
        Self { grpc, health: None }
    }
}

/// Binds `--health-listen` when it is set.
pub async fn bind_health(cfg: &Config) -> Result<Option<TcpListener>, Error> {
    match cfg.health_listen {
        Some(a) => {
            Ok(Some(TcpListener::bind(a).await.map_err(|e| {
                Error::Config(format!("--health-listen {a}: {e}"))
            })?))
        }
        None => Ok(None),
    }
}

/// Loads the model named by `cfg`, then serves `pdmesh.worker.v1.Worker` on the gRPC
/// listener until `shutdown` is cancelled. At shutdown running requests finish with
/// `abort`, and the function returns once the engine has been released.
pub async fn run(
    cfg: Config,
    listeners: impl Into<Listeners>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let Listeners {
        grpc: listener,
        health,
    } = listeners.into();
    let engine_cfg = cfg.engine_config()?;
    let auth = cfg.tls.auth().map_err(|e| Error::Config(e.to_string()))?;
    if let Ok(a) = listener.local_addr() {
        auth.check_listen("the worker", a)
            .map_err(|e| Error::Config(e.to_string()))?;
    }
    // Bound before the model loads, so a taken port fails at once.
    let health_listener = match health {
        Some(l) => Some(l),
        None => bind_health(&cfg).await?,
    };
    cfg.faults.announce();
    let mut engine = tokio::task::spawn_blocking(move || pdmesh_engine::Engine::load(engine_cfg))
        .await
        .map_err(|e| {
            Error::Thread(std::io::Error::other(format!("model loader panicked: {e}")))
        })??;
    let incidents = incidents::Incidents::from_flags(
        cfg.incidents.dir.as_deref(),
        (
            cfg.incidents.trace_link.clone(),
            cfg.incident_replay_url.clone(),
            cfg.incident_include_prompts,
        ),
        format!("{} pid {}", cfg.role.name(), std::process::id()),
        cfg.report_config(engine.pool().layout().as_ref()),
    )
    .map_err(|e| Error::Config(e.to_string()))?;
    // What this worker serves, as its cache service names disk pages by it.
    let model = {
        let (id, path) = (engine.info().model_id, cfg.model.clone());
        tokio::task::spawn_blocking(move || identity::model_identity(&id, &path))
            .await
            .map_err(|e| Error::Thread(std::io::Error::other(e.to_string())))?
            .map_err(|e| {
                Error::Config(format!(
                    "reading {} for its digest: {e}",
                    cfg.model.display()
                ))
            })?
    };
    if let Some(url) = cfg.cache_url.as_ref().filter(|_| !cfg.no_host_tier) {
        let mut tier_cfg = pdmesh_cache_client::TierConfig::new(
            url.clone(),
            format!("worker-{}", std::process::id()),
            cfg.cache_data_plane,
            auth.clone(),
        );
        tier_cfg.model = model.clone();
        let tier = pdmesh_cache_client::RemoteTier::start(
            tokio::runtime::Handle::current(),
            tier_cfg,
            engine.pool().layout().as_ref().clone(),
        );
        let tier = match &incidents {
            Some(inc) => tier.on_corrupt(inc.on_corrupt()),
            None => tier,
        };
        let policy = match cfg.cache_write_policy {
            WritePolicyArg::WriteThrough => WritePolicy::WriteThrough,
            WritePolicyArg::WriteThroughSelective => WritePolicy::WriteThroughSelective {
                hits: cfg.cache_write_hits,
            },
            WritePolicyArg::WriteBack => WritePolicy::WriteBack,
        };
        tracing::info!(%url, plane = ?cfg.cache_data_plane, ?policy, "host tier enabled");
        engine.set_host_tier(Box::new(tier), policy);
    }
    let pd = std::sync::Arc::new(
        pd::Pd::new(
            cfg.role,
            cfg.cache_url.as_deref(),
            cfg.cache_advertise_url
                .as_deref()
                .or(cfg.cache_url.as_deref()),
            (engine.pool().layout(), &model),
            pd::PdTimes {
                admission: std::time::Duration::from_millis(cfg.admission_timeout_ms),
                transfer: std::time::Duration::from_millis(cfg.transfer_timeout_ms),
                // Fault injection, only from explicit --fault-* flags (see `faults`).
                write_delay: cfg
                    .faults
                    .write_delay_ms
                    .map(std::time::Duration::from_millis),
                fault_count: cfg.faults.count.unwrap_or(u64::MAX),
                missize: cfg.faults.missize(),
            },
            engine.info().eos_token_ids,
            auth.clone(),
        )
        .with_incidents(incidents.clone()),
    );
    if let Some(inc) = &incidents {
        let weak = std::sync::Arc::downgrade(&pd);
        inc.set_source(move || weak.upgrade().map(|p| p.figures()).unwrap_or_default());
        let (inc, stop) = (inc.clone(), shutdown.child_token());
        tokio::spawn(async move {
            let mut every = tokio::time::interval(std::time::Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = every.tick() => inc.tick(),
                    () = stop.cancelled() => return,
                }
            }
        });
    }
    let info = engine.info();
    let addr = listener.local_addr().ok();
    tracing::info!(
        ?addr,
        model = %info.model_id,
        kv_pages = info.total_pages,
        page_size = info.page_size,
        max_batch = info.max_batch,
        role = cfg.role.name(),
        "worker listening"
    );

    let grammars = engine.grammar_compiler();
    let (handle, engine_thread) =
        actor::start(engine, cfg.faults.stall_step).map_err(Error::Thread)?;
    let watch = std::sync::Arc::new(watchdog::EngineWatch::start(
        handle.clone(),
        (cfg.watchdog, incidents),
        std::time::Duration::from_millis(cfg.watchdog_stall_ms),
        shutdown.child_token(),
    ));
    // At shutdown the worker drains (see --drain-timeout-ms), then stops serving: the
    // server's graceful stop waits for open streams, which the drain has ended.
    let serving = CancellationToken::new();
    let drainer = tokio::spawn(drain(
        (handle.clone(), pd.clone(), watch.clone()),
        std::time::Duration::from_millis(cfg.drain_timeout_ms),
        shutdown.clone(),
        serving.clone(),
    ));
    // grpc.health.v1 for the probes, refreshed until the server stops.
    let (health, health_service) = tonic_health::server::health_reporter();
    let prober = tokio::spawn(probes::run(
        health,
        (handle.clone(), pd.clone(), watch.clone()),
        std::time::Duration::from_millis(cfg.watchdog_stall_ms),
        serving.clone(),
    ));
    let worker = std::sync::Arc::new(grpc::WorkerService::new(
        (handle, grammars),
        pd,
        watch,
        cfg.faults.active(),
        shutdown.clone(),
    ));
    let sglang = sglang::SglangService::new(worker.clone(), cfg.model.clone(), cfg.role);
    let health_port = health_listener.map(|l| {
        let (service, stop) = (health_service.clone(), serving.clone());
        tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(l),
                    stop.cancelled_owned(),
                )
                .await;
            if let Err(e) = served {
                tracing::error!(error = %e, "the health port stopped");
            }
        })
    });
    let router = auth
        .traced_server()?
        .add_service(auth.guard(
            &grpc::POLICY,
            pdmesh_proto::worker::v1::worker_server::WorkerServer::from_arc(worker),
        ))
        // The standard health check answers without the credential (it tells only
        // whether the worker serves), for probes that cannot present one.
        .add_service(health_service)
        // The SGLang scheduler protocol on the same port, for gateways built for SGLang.
        .add_service(auth.guard(
            &sglang::POLICY,
            pdmesh_proto::sglang::grpc::scheduler::sglang_scheduler_server::SglangSchedulerServer::new(
                sglang,
            ),
        ));
    let served = pdmesh_tls::serve(router, listener, serving.cancelled_owned()).await;
    drainer.abort();
    let _ = drainer.await;
    if let Some(h) = health_port {
        let _ = h.await;
    }
    prober.abort();
    let _ = prober.await;
    engine_thread.stop().await;
    tracing::info!(?addr, "worker stopped");
    served.map_err(Error::from)
}

/// Once `shutdown` is cancelled: refuses new requests, waits until nothing runs (no
/// request in the engine, no hand-over under way) or `timeout` passes, aborts what is
/// left, then cancels `serving`.
async fn drain(
    (engine, pd, watch): (
        actor::EngineHandle,
        std::sync::Arc<pd::Pd>,
        std::sync::Arc<watchdog::EngineWatch>,
    ),
    timeout: std::time::Duration,
    shutdown: CancellationToken,
    serving: CancellationToken,
) {
    shutdown.cancelled().await;
    watch.drain();
    tracing::info!(
        ?timeout,
        "draining: new requests are refused, running ones finish"
    );
    let (engine, pd) = (&engine, &pd);
    let busy = || async move {
        match engine.info().await {
            Ok((_, pool)) => {
                pool.load.waiting + pool.load.reserved + pool.load.running + pd.stats().handovers
            }
            Err(_) => 0,
        }
    };
    let end = pdmesh_tls::DrainEnd {
        drained: "drained: nothing runs",
        timed_out: "drain timed out: aborting what is left",
    };
    pdmesh_tls::wait_drained(timeout, busy, end).await;
    if let Ok(n) = engine.abort_all().await {
        tracing::info!(aborted = n, "worker shutting down");
    }
    serving.cancel();
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_worker_links_the_cache_client_never_the_cache_server() {
        // A worker runs on any host and talks to that host's cache service; linking the
        // server would let it reach into the server's state. Only the client crate.
        let manifest = include_str!("../Cargo.toml");
        let deps = manifest
            .split("\n[")
            .find(|s| s.starts_with("dependencies]"))
            .expect("a [dependencies] table");
        let names: Vec<&str> = deps
            .lines()
            .skip(1)
            .filter_map(|l| l.split(['.', ' ', '=']).next())
            .filter(|n| n.starts_with("pdmesh-cache"))
            .collect();
        assert_eq!(names, ["pdmesh-cache-client"], "{deps}");
    }
}

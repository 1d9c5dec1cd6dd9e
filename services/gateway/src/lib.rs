//! OpenAI-compatible HTTP gateway: `/v1/chat/completions`, `/v1/completions`,
//! `/v1/responses`, `/v1/models`, `/health` and `/metrics` (and Anthropic's `/v1/messages`)
//! in front of the tokenizer and worker services.
//!
//! A library with one entry point, [`run`], so the `pdmesh` binary and the integration
//! tests start the same server. The `clients` and `route` modules are the only ones that
//! touch prost types; handlers work on the domain types they return.
//!
//! The modules follow a request's path, and each depends only on those after it: `http`
//! (router, middleware, the operators' routes) → `api` (one module per protocol, none
//! using another) → `generate` (the protocol-independent generation) → `state` →
//! `clients` (tokenizer and workers) → `config` → `route` (which workers) → `metrics`,
//! with `json` and `error` beneath them all.

#![forbid(unsafe_code)]

mod api;
mod clients;
mod config;
mod error;
mod generate;
mod http;
mod json;
mod metrics;
mod route;
mod state;

use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use crate::config::{Config, DEFAULT_MAX_CONCURRENT_REQUESTS};
pub use crate::error::Error;

/// Serves the gateway on `listener` until `shutdown` is cancelled. Backends are connected
/// lazily, so the gateway starts even while they are still loading; `/health` tells when
/// everything is ready. Returns once the server has stopped.
pub async fn run(
    cfg: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    cfg.validate()?;
    let auth = cfg.tls.auth().map_err(|e| Error::Config(e.to_string()))?;
    auth.require("the gateway")
        .map_err(|e| Error::Config(e.to_string()))?;
    let mut backends = clients::Backends::connect_pd(
        &cfg.tokenizer_url,
        &cfg.worker_url,
        (cfg.disaggregated(), &cfg.prefill_url, &cfg.decode_url),
        auth,
    )?;
    for url in &cfg.cache_url {
        backends = backends.with_cache(url)?;
    }
    backends
        .workers
        .set_start_timeout(Duration::from_millis(cfg.worker_start_timeout_ms));
    backends.workers.run_tasks(shutdown.child_token());
    let every = Duration::from_millis(cfg.discovery_interval_ms);
    for (prefill, names) in [(true, &cfg.prefill_dns), (false, &cfg.decode_dns)] {
        if !names.is_empty() {
            backends.discover(prefill, names.clone(), every, shutdown.child_token());
        }
    }
    backends
        .workers
        .watch_hosts(backends.caches(), shutdown.child_token());
    if cfg.cache_url.is_empty() && cfg.disaggregated() {
        tokio::spawn(learn_caches(backends.clone(), shutdown.child_token()));
    }
    let local = match cfg.model.clone() {
        None => None,
        Some(path) => Some(
            tokio::task::spawn_blocking(move || {
                pdmesh_tokenize::TextTokenizer::from_path(&path)
                    .map_err(|e| Error::Config(format!("--model {}: {e}", path.display())))
            })
            .await
            .map_err(|e| Error::Config(format!("loading --model's tokenizer panicked: {e}")))??,
        ),
    };
    // Streams end only when the drain is over (see --drain-timeout-ms).
    let streams_end = CancellationToken::new();
    let drain_for = Duration::from_millis(cfg.drain_timeout_ms);
    let state = state::AppState::new(cfg, backends, local, streams_end.clone())?;
    let drainer = tokio::spawn(drain(
        state.clone(),
        drain_for,
        shutdown.clone(),
        streams_end,
    ));
    tokio::spawn(watch_event_loop(state.clone(), shutdown.child_token()));
    tokio::spawn(write_incident_repeats(
        state.clone(),
        shutdown.child_token(),
    ));
    let app = http::router(state);
    let addr = listener.local_addr().ok();
    tracing::info!(?addr, "gateway listening");
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .map_err(Error::Serve)?;
    // Every connection has closed, so every stream has ended: the drain says so.
    let _ = drainer.await;
    tracing::info!(?addr, "gateway stopped");
    Ok(())
}

/// How often the workers' homes are looked at for cache services not yet followed.
const LEARN_CACHES_EVERY: Duration = Duration::from_secs(1);

/// Without --cache-url: follows (for routing by host tier and for `/metrics`) every cache
/// service a prefill or decode worker names as its home, as the workers come to name
/// them, until `stop`. On Kubernetes, where each node's cache service is known only to
/// that node's workers, this is how the gateway finds them.
async fn learn_caches(backends: clients::Backends, stop: CancellationToken) {
    loop {
        for home in backends.workers.homes() {
            match backends.learn_cache(&home) {
                Ok(Some(cache)) => {
                    tracing::info!(cache = %home, "following a cache service a worker names as its home");
                    backends
                        .workers
                        .watch_hosts(vec![cache], stop.child_token());
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(cache = %home, error = %e, "a worker names a cache service that cannot be dialled")
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(LEARN_CACHES_EVERY) => {}
            () = stop.cancelled() => return,
        }
    }
}

/// Once `shutdown` is cancelled (the server then stops accepting connections): says
/// `draining` in `/health`, waits until no stream is open or `timeout` passes, then ends
/// what is left (`streams_end`).
pub(crate) async fn drain(
    st: state::AppState,
    timeout: Duration,
    shutdown: CancellationToken,
    streams_end: CancellationToken,
) {
    shutdown.cancelled().await;
    st.draining
        .store(true, std::sync::atomic::Ordering::Relaxed);
    tracing::info!(
        ?timeout,
        open = st.backends.workers.in_flight(),
        "draining: open streams run on"
    );
    // A request still in its handler starts a stream soon: wait for it too.
    let open = || {
        std::future::ready(
            st.backends.workers.in_flight()
                + st.handling.load(std::sync::atomic::Ordering::Relaxed),
        )
    };
    let end = pdmesh_tls::DrainEnd {
        drained: "drained: no stream is open",
        timed_out: "drain timed out: ending the open streams",
    };
    pdmesh_tls::wait_drained(timeout, open, end).await;
    streams_end.cancel();
}

/// Brings the incident reports' repeat counts up to date once a second, until `stop`.
async fn write_incident_repeats(st: state::AppState, stop: CancellationToken) {
    let Some(r) = &st.incidents else {
        return;
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        st.keep_figures();
        if let Err(e) = r.tick() {
            tracing::warn!(error = %e, "incident reports: repeats not written");
        }
    }
    if let Err(e) = r.flush() {
        tracing::warn!(error = %e, "incident reports: last repeats not written");
    }
}

/// Measures how late the runtime runs a timer due every 100 ms, until `stop`.
async fn watch_event_loop(st: state::AppState, stop: CancellationToken) {
    const PERIOD: Duration = Duration::from_millis(100);
    loop {
        let due = tokio::time::Instant::now() + PERIOD;
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep_until(due) => {}
        }
        let late = tokio::time::Instant::now().saturating_duration_since(due);
        st.metrics.event_loop_delay.observe(late.as_secs_f64());
    }
}

#[cfg(test)]
mod tests;

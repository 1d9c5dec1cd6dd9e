//! Health, readiness, liveness and `/metrics`: what orchestrators and Prometheus ask of the
//! gateway, answered from the backends' state and the gateway's own metrics.

use std::sync::atomic::Ordering;

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use pdmesh_telemetry::labels::RoomState;
use serde_json::json;

use crate::metrics::ROOM_AGE_THRESHOLDS;
use crate::route::Role;
use crate::state::AppState;

/// Whether every backend answers.
///
/// 200 when both backends answer their Health call, else 503 naming the one that does not
/// (and 503 `draining` once the gateway is stopping).
#[utoipa::path(
    get,
    path = "/health",
    tag = "Operations",
    responses(
        (status = 200, description = "`{\"status\": \"ok\", \"tokenizer\", \"worker\", \"fault_injection\", \"faults\"}`.", body = Object),
        (status = 503, description = "A backend does not answer (named), or the gateway is draining.", body = Object),
    ),
)]
pub(crate) async fn health(State(st): State<AppState>) -> Response {
    if let Some(r) = draining(&st) {
        return r;
    }
    let h = st.backends.health().await;
    let word = |ok: bool| if ok { "ok" } else { "unavailable" };
    // `fault_injection` is true only for a worker started with test-only `--fault-*`
    // flags, which break requests on purpose.
    let body = json!({
        "status": word(h.tokenizer && h.all_workers),
        "tokenizer": word(h.tokenizer),
        "worker": word(h.all_workers),
        "fault_injection": !h.faults.is_empty(),
        "faults": h.faults,
    });
    (ok_or_503(h.tokenizer && h.all_workers), Json(body)).into_response()
}

/// 503 `draining` once SIGTERM has come (for `/health` and `/ready`).
fn draining(st: &AppState) -> Option<Response> {
    st.draining
        .load(std::sync::atomic::Ordering::Relaxed)
        .then(|| {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({"status": "draining"})),
            )
                .into_response()
        })
}

fn ok_or_503(ok: bool) -> StatusCode {
    if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// Whether the gateway itself answers.
///
/// The gateway's own event loop answers (it asks no backend, so a worker that hangs
/// cannot make a liveness probe restart the gateway). 200 while draining too.
#[utoipa::path(
    get,
    path = "/live",
    tag = "Operations",
    responses((status = 200, description = "`{\"status\": \"ok\"}`.", body = Object)),
)]
pub(crate) async fn live() -> Response {
    (StatusCode::OK, Json(json!({"status": "ok"}))).into_response()
}

/// Whether this gateway can serve a request now.
///
/// For a load balancer's (or Kubernetes') readiness: the tokenizer and at least one worker
/// of each side answer. A worker restarting or draining (a rolling update) leaves the
/// gateway ready as long as another takes its place; `/health` asks for every one.
#[utoipa::path(
    get,
    path = "/ready",
    tag = "Operations",
    responses(
        (status = 200, description = "`{\"status\": \"ok\", \"tokenizer\", \"workers_ok\", \"workers\"}`.", body = Object),
        (status = 503, description = "No worker (or no tokenizer) answers, or the gateway is draining.", body = Object),
    ),
)]
pub(crate) async fn ready(State(st): State<AppState>) -> Response {
    if let Some(r) = draining(&st) {
        return r;
    }
    let h = st.backends.health().await;
    let body = json!({
        "status": if h.serving { "ok" } else { "unavailable" },
        "tokenizer": if h.tokenizer { "ok" } else { "unavailable" },
        "workers_ok": h.workers_ok,
        "workers": h.workers,
    });
    (ok_or_503(h.serving), Json(body)).into_response()
}

/// The mesh's metrics.
///
/// Prometheus text; the KV page gauges are read from the worker at scrape time.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "Operations",
    responses((status = 200, description = "Prometheus' text format.", content_type = "text/plain", body = String)),
)]
pub(crate) async fn metrics(State(st): State<AppState>) -> Response {
    st.metrics
        .insecure_plaintext
        .with_label_values(&["gateway"])
        .set(i64::from(pdmesh_tls::auth::insecure()));
    match st.backends.model_info().await {
        Ok(info) => {
            st.metrics.workers_read.set(1);
            st.metrics
                .fault_injection_enabled
                .set(i64::from(!info.faults.is_empty()));
            st.metrics.kv_pages_free.set(i64::from(info.free_pages));
            st.metrics
                .kv_pages_capacity
                .set(i64::from(info.total_pages));
            st.metrics.kv_pages_cached.set(i64::from(info.cached_pages));
            let m = &st.metrics;
            m.auth_refused.observe("worker", info.auth_refused as f64);
            m.insecure_plaintext
                .with_label_values(&["worker"])
                .set(i64::from(info.insecure_plaintext));
            m.kv_evictions.observe("device", info.evicted_pages as f64);
            m.kv_hit_tokens
                .observe("device", info.device_hit_tokens as f64);
            m.kv_hit_tokens.observe("host", info.host.hit_tokens as f64);
            m.kv_load_back_bytes
                .observe("host", info.host.load_bytes as f64);
            m.kv_load_back_seconds
                .observe("host", info.host.load_seconds);
            m.kv_write_back_bytes
                .observe("host", info.host.written_bytes as f64);
            m.kv_write_back_seconds
                .observe("host", info.host.written_seconds);
            m.engine_steps.observe("all", info.pd.engine_steps as f64);
            m.engine_idle_seconds.set(info.pd.engine_idle_seconds);
            m.kv_checksum_failures
                .observe("host", info.host.checksum_failures as f64);
            m.kv_write_back_dropped_pages
                .observe("host", info.host.dropped_pages as f64);
            m.kv_write_back_queued_pages
                .set(info.host.queued_pages as i64);
            m.kv_host_fetching_requests
                .set(info.host.fetching_requests as i64);
            for (url, counts) in &info.incidents {
                m.remote_incidents(&format!("worker {url}"), counts);
            }
            let (pd, side) = (&m.pd, "all");
            for (state, n) in [
                ("waiting", info.pd.waiting_requests),
                ("reserved", info.pd.reserved_requests),
                ("running", info.pd.running_requests),
            ] {
                pd.requests.with_label_values(&[state]).set(n as i64);
            }
            pd.reserved_pages.set(info.pd.reserved_pages as i64);
            pd.transfer_bytes
                .observe(side, info.pd.transfer_bytes as f64);
            pd.transfer_seconds.observe(side, info.pd.transfer_seconds);
            for (reason, n) in &info.pd.transfer_failures {
                pd.transfer_failures.observe(reason, *n as f64);
            }
            pd.admission_timeouts
                .observe(side, info.pd.admission_timeouts as f64);
            pd.engine_stalls.observe(side, info.pd.engine_stalls as f64);
            pd.watchdog_aborts
                .observe("engine", info.pd.watchdog_aborts as f64);
            pd.room_stalls
                .observe("engine", info.pd.engine_stalls as f64);
            pd.transfers.observe("ok", info.pd.transfers_ok as f64);
            pd.transfers
                .observe("failed", info.pd.transfers_failed as f64);
            for side in [Role::Prefill, Role::Decode] {
                let (n, oldest) = info.pd.handovers.get(&side).copied().unwrap_or_default();
                pd.handovers
                    .with_label_values(&[side.as_str()])
                    .set(n as i64);
                pd.handover_oldest_seconds
                    .with_label_values(&[side.as_str()])
                    .set(oldest);
            }
        }
        Err(e) => {
            st.metrics.workers_read.set(0);
            tracing::debug!(error = %e.message, "worker model info unavailable for metrics");
        }
    }
    {
        let (pd, w) = (&st.metrics.pd, &st.backends.workers);
        for (url, pages) in w.cache_views() {
            pd.router_cached_pages
                .with_label_values(&[url.as_str()])
                .set(pages as i64);
        }
        pd.route_prefill
            .observe("prefix", w.counts.prefix.load(Ordering::Relaxed) as f64);
        pd.route_prefill
            .observe("load", w.counts.load.load(Ordering::Relaxed) as f64);
    }
    if let Some((c, all, incidents)) = st.backends.cache_stats().await {
        let m = &st.metrics;
        m.caches_read.set(i64::from(all));
        m.pd.peer_pages.observe("sent", c.peer_pages_sent as f64);
        m.pd.peer_pages
            .observe("received", c.peer_pages_received as f64);
        m.pd.peer_bytes.observe("sent", c.peer_bytes_sent as f64);
        m.pd.peer_bytes
            .observe("received", c.peer_bytes_received as f64);
        m.pd.peer_layout_refusals
            .observe("host", c.peer_layout_refusals as f64);
        m.pd.peer_transfer_failures
            .observe("host", c.peer_transfer_failures as f64);
        m.pd.held_pages_skipped
            .observe("host", c.held_pages_skipped as f64);
        m.auth_refused.observe("cache", c.auth_refused as f64);
        m.insecure_plaintext
            .with_label_values(&["cache"])
            .set(i64::from(c.insecure_plaintext));
        for (state, n) in [
            ("total", c.total_pages),
            ("used", c.used_pages),
            ("pinned", c.pinned_pages),
        ] {
            m.host_mirror_pages
                .with_label_values(&[state])
                .set(i64::from(n));
        }
        m.host_mirror_leases.set(i64::from(c.leases));
        for (url, counts) in &incidents {
            m.remote_incidents(&format!("cache {url}"), counts);
        }
        m.kv_evictions.observe("host", c.evicted_pages as f64);
        if let Some(d) = &c.disk {
            m.kv_evictions.observe("disk", d.evicted_pages as f64);
            m.kv_hit_tokens.observe("disk", d.hit_tokens as f64);
            m.disk.observe(d);
        }
        m.host_mirror_expired_leases
            .observe("host", c.expired_leases as f64);
        m.host_mirror_commit_rejections
            .observe("host", c.checksum_failures as f64);
        let pd = &m.pd;
        // Only the service's own states become label values.
        let known = |state: &str| RoomState::from_name(state).map(RoomState::name);
        for (state, n) in &c.rooms {
            if let Some(state) = known(state) {
                pd.rooms.with_label_values(&[state]).set(i64::from(*n));
            }
        }
        for (secs, n) in &c.rooms_older_than {
            // Only the service's own thresholds become label values.
            if ROOM_AGE_THRESHOLDS.contains(&secs.as_str()) {
                pd.rooms_older_than
                    .with_label_values(&[secs.as_str()])
                    .set(i64::from(*n));
            }
        }
        for (state, secs) in &c.oldest_room_seconds {
            let Some(state) = known(state) else { continue };
            pd.room_oldest_seconds
                .with_label_values(&[state])
                .set(*secs);
        }
        for (stage, n) in &c.room_timeouts {
            pd.room_timeouts.observe(stage, *n as f64);
        }
        for (reason, n) in &c.room_aborts {
            pd.room_aborts.observe(reason, *n as f64);
        }
        pd.room_stalls.observe("room", c.room_stalls as f64);
        pd.late_writes_rejected
            .observe("host", c.late_writes_rejected as f64);
        pd.room_slots
            .with_label_values(&["transferring"])
            .set(i64::from(c.room_slots));
        pd.room_slots
            .with_label_values(&["quarantined"])
            .set(i64::from(c.quarantined_slots));
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        st.metrics.render(),
    )
        .into_response()
}

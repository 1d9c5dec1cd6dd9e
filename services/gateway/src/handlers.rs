//! HTTP routes and middleware: authentication on `/v1/*`, request metrics on everything,
//! and the handlers that turn OpenAI requests into generations and back.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use pdmesh_telemetry::labels::RoomState;
use serde_json::{Value, json};
use tracing::Instrument as _;

use crate::backend::{GenParams, Parsing, WorkerInfo};
use crate::error::{ApiError, ErrorClass};
use crate::generate::{self, GenEvent, GenStream, LogprobEntry, Usage};
use crate::metrics::{Endpoint, ROOM_AGE_THRESHOLDS, Stage, endpoint_label};
use crate::openai::{
    self, ChatRequest, CompletionRequest, PromptInput, ResponseMeta, SamplingFields,
};
use crate::state::{AppState, unix_now};
use crate::tools::{self, ToolChoice, ToolFormat};

pub(crate) fn router(st: AppState) -> Router {
    let generating = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route("/v1/responses", post(crate::responses::create))
        .route_layer(middleware::from_fn_with_state(st.clone(), admit));
    let v1 = Router::new()
        .merge(generating)
        .route("/v1/models", get(list_models))
        .route("/v1/models/{model}", get(get_model))
        .route("/flush_cache", post(flush_cache))
        .route(
            "/v1/responses/{id}",
            get(crate::responses::get).delete(crate::responses::delete),
        )
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(middleware::from_fn_with_state(st.clone(), auth));
    let admin = Router::new()
        .route("/debug/incidents", get(list_incidents))
        .route("/debug/incidents/{id}", get(get_incident))
        .route_layer(middleware::from_fn_with_state(st.clone(), admin_auth));
    Router::new()
        .merge(v1)
        .merge(admin)
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/live", get(live))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(crate::openapi::openapi_json))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(st.clone(), observe))
        .layer(DefaultBodyLimit::max(st.cfg.max_body_bytes))
        .with_state(st)
}

/// Admission: a generating request takes a permit for as long as its answer is being
/// sent (a stream's body holds it to its last event); with none left it is shed at once,
/// 503 with `Retry-After`, before its body is read. Runs after `auth`, so a caller
/// without the key cannot take permits.
async fn admit(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let Ok(permit) = st.admission.clone().try_acquire_owned() else {
        // Counted by `observe` as mesh_errors_total{error_type="overloaded"}.
        return ApiError::shed(st.cfg.max_concurrent_requests).into_response();
    };
    let resp = next.run(req).await;
    if axum::body::HttpBody::size_hint(resp.body())
        .exact()
        .is_some()
    {
        // A whole answer (a JSON body, an error): the work is done, and the response keeps
        // its Content-Length.
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let body = body.into_data_stream().map(move |chunk| {
        let _held = &permit;
        chunk
    });
    Response::from_parts(parts, axum::body::Body::from_stream(body))
}

/// Counts every response by endpoint and status, and every error by class.
async fn observe(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let start = Instant::now();
    let _handling = Handling::new(&st);
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map_or(Endpoint::Other, |p| endpoint_label(p.as_str()));
    let resp = next.run(req).await;
    st.metrics.observe_request(
        endpoint,
        resp.status().as_u16(),
        start.elapsed().as_secs_f64(),
    );
    if let Some(ErrorClass(class)) = resp.extensions().get::<ErrorClass>() {
        st.metrics.error(*class);
    }
    resp
}

/// Counts a request in `handling` until its handler has answered (a stream it started is
/// counted by its worker from then on).
struct Handling(AppState);

impl Handling {
    fn new(st: &AppState) -> Self {
        st.handling
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self(st.clone())
    }
}

impl Drop for Handling {
    fn drop(&mut self) {
        self.0
            .handling
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Constant-time comparison, so the key cannot be guessed byte by byte from timings.
fn same_key(given: &[u8], expected: &[u8]) -> bool {
    subtle::ConstantTimeEq::ct_eq(given, expected).into()
}

/// The key in an `Authorization: Bearer <key>` header, if there is one.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    v.strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))
}

/// `/debug/*` requires `Authorization: Bearer <admin key>`: 403 when the gateway has no
/// `--admin-key` (nobody may read them), 401 when the key is missing or wrong. The API
/// key opens nothing here.
async fn admin_auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let Some(key) = &st.cfg.admin_key else {
        return ApiError::forbidden(
            "The operators' routes are closed: start the gateway with --admin-key (PDMESH_ADMIN_KEY) to open them.",
        )
        .into_response();
    };
    match bearer(req.headers()) {
        None => ApiError::unauthorized(
            "You didn't provide the admin key. Send it in an `Authorization: Bearer <key>` header.",
        )
        .into_response(),
        Some(k) if !same_key(k.trim().as_bytes(), key.as_bytes()) => {
            ApiError::unauthorized("Incorrect admin key provided.").into_response()
        }
        Some(_) => next.run(req).await,
    }
}

/// With `--api-key`, `/v1/*` requires `Authorization: Bearer <key>` (or `x-api-key`).
async fn auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let given = bearer(req.headers())
            // Anthropic's clients send the key as `x-api-key`.
            .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()));
        match given {
            None => {
                return ApiError::unauthorized(
                    "You didn't provide an API key. Send it in an `Authorization: Bearer <key>` header.",
                )
                .into_response();
            }
            Some(k) if !same_key(k.trim().as_bytes(), key.as_bytes()) => {
                return ApiError::unauthorized("Incorrect API key provided.").into_response();
            }
            Some(_) => {}
        }
    }
    next.run(req).await
}

fn incident_dir(st: &AppState) -> Result<&std::path::Path, ApiError> {
    st.incidents.as_ref().map(|r| r.dir()).ok_or_else(|| {
        ApiError::not_found("incident reports are off: start the gateway with --incident-dir")
    })
}

fn incident_error(e: pdmesh_incident::Error) -> ApiError {
    match e {
        pdmesh_incident::Error::NotFound(_) | pdmesh_incident::Error::BadId(_) => {
            ApiError::not_found(e.to_string())
        }
        e => ApiError::backend(e.to_string()),
    }
}

/// The incident reports.
///
/// The reports in `--incident-dir`, newest first, summarized (404 without the flag).
#[utoipa::path(
    get,
    path = "/debug/incidents",
    tag = "Admin",
    responses(
        (status = 200, description = "`{\"object\": \"list\", \"data\": [...]}`, a summary per report.", body = Object),
        crate::openapi::AdminErrors,
    ),
    security(("admin" = [])),
)]
pub(crate) async fn list_incidents(State(st): State<AppState>) -> Result<Json<Value>, ApiError> {
    let dir = incident_dir(&st)?.to_owned();
    let all = tokio::task::spawn_blocking(move || pdmesh_incident::list(&dir))
        .await
        .map_err(|e| ApiError::backend(format!("listing incidents: {e}")))?
        .map_err(incident_error)?;
    let data: Vec<Value> = all
        .iter()
        .map(|i| {
            json!({
                "id": i.id,
                "kind": i.kind.name(),
                "title": i.kind.title(),
                "summary": i.summary,
                "first_seen": i.first_seen,
                "last_seen": i.last_seen,
                "repeats": i.repeats,
                "service": i.place.service,
                "request_id": i.place.request_id,
                "trace_id": i.place.trace_id,
            })
        })
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

#[derive(serde::Deserialize)]
pub(crate) struct IncidentQuery {
    format: Option<String>,
}

/// An incident report.
///
/// A report as JSON, or as Markdown with `?format=markdown`.
#[utoipa::path(
    get,
    path = "/debug/incidents/{id}",
    tag = "Admin",
    params(
        ("id" = String, Path, description = "The report's id."),
        ("format" = Option<String>, Query, description = "`json` (the default), `markdown` or `md`."),
    ),
    responses(
        (status = 200, description = "The report.", content(
            (Object = "application/json"),
            (String = "text/markdown"),
        )),
        crate::openapi::AdminErrors,
    ),
    security(("admin" = [])),
)]
pub(crate) async fn get_incident(
    State(st): State<AppState>,
    Path(id): Path<String>,
    axum::extract::Query(q): axum::extract::Query<IncidentQuery>,
) -> Result<Response, ApiError> {
    let dir = incident_dir(&st)?.to_owned();
    let i = tokio::task::spawn_blocking(move || pdmesh_incident::read(&dir, &id))
        .await
        .map_err(|e| ApiError::backend(format!("reading an incident: {e}")))?
        .map_err(incident_error)?;
    Ok(match q.format.as_deref() {
        None | Some("json") => Json(serde_json::to_value(&i).unwrap_or_default()).into_response(),
        Some("markdown" | "md") => (
            [(header::CONTENT_TYPE, "text/markdown; charset=utf-8")],
            pdmesh_incident::render(&i),
        )
            .into_response(),
        Some(other) => {
            return Err(ApiError::invalid_param(
                "format",
                format!("format is json or markdown, not {other:?}"),
            ));
        }
    })
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

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
            for side in ["prefill", "decode"] {
                let (n, oldest) = info.pd.handovers.get(side).copied().unwrap_or_default();
                pd.handovers.with_label_values(&[side]).set(n as i64);
                pd.handover_oldest_seconds
                    .with_label_values(&[side])
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

/// Empties the workers' prefix caches.
///
/// SGLang's route: every worker evicts the pages of its device prefix cache that no
/// request uses. 200 with the pages each worker freed; 503 naming the workers that did
/// not flush (the others still did).
#[utoipa::path(
    post,
    path = "/flush_cache",
    tag = "Tokens",
    responses(
        (status = 200, description = "`{\"pages_flushed\", \"workers\": [{\"role\", \"url\", \"pages_flushed\"}]}`.", body = Object),
        crate::openapi::BackendErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn flush_cache(State(st): State<AppState>) -> Result<Json<Value>, ApiError> {
    let flushed = st.backends.flush_cache().await;
    let failed: Vec<String> = flushed
        .iter()
        .filter_map(|f| match &f.pages {
            Err(why) => Some(format!("the {} worker {}: {why}", f.role, f.url)),
            Ok(_) => None,
        })
        .collect();
    let total: u64 = flushed.iter().filter_map(|f| f.pages.as_ref().ok()).sum();
    if !failed.is_empty() {
        return Err(ApiError::unavailable(format!(
            "the cache flush failed on {} (the other workers flushed {total} pages)",
            failed.join("; ")
        )));
    }
    tracing::info!(pages = total, "flushed every worker's device prefix cache");
    let workers: Vec<Value> = flushed
        .iter()
        .map(|f| json!({ "role": f.role, "url": f.url, "pages_flushed": f.pages.as_ref().ok() }))
        .collect();
    Ok(Json(json!({ "pages_flushed": total, "workers": workers })))
}

/// Tokenizes a prompt or chat messages.
///
/// As vLLM serves it: a prompt, or chat messages through the chat template (the ids a
/// chat request with them would run).
#[utoipa::path(
    post,
    path = "/tokenize",
    tag = "Tokens",
    request_body = crate::openapi::TokenizeBody,
    responses(
        (status = 200, description = "`{\"count\", \"max_model_len\", \"tokens\", \"token_strs\"}`.", body = Object),
        crate::openapi::TokenizeErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn tokenize(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let body = body_bytes(&st, body)?;
    let req: openai::TokenizeRequest = openai::parse(&body)?;
    if let Some(m) = &req.model {
        st.check_model(m).await?;
    }
    let ids = match req.input()? {
        openai::ToTokenize::Prompt { text, add_special } => {
            st.backends.tokenize(text, add_special).await?
        }
        openai::ToTokenize::Chat {
            messages,
            tools_json,
        } => {
            st.backends
                .apply_chat_template(messages, tools_json, false)
                .await?
        }
    };
    let info = st.worker_info().await?;
    Ok(Json(json!({
        "count": ids.len(),
        "max_model_len": info.context_length,
        "tokens": ids,
        "token_strs": null,
    })))
}

/// The text of token ids.
///
/// As vLLM serves it: the text of token ids, special tokens included.
#[utoipa::path(
    post,
    path = "/detokenize",
    tag = "Tokens",
    request_body = openai::DetokenizeRequest,
    responses(
        (status = 200, description = "`{\"prompt\": text}`.", body = Object),
        crate::openapi::TokenizeErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn detokenize(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let body = body_bytes(&st, body)?;
    let req: openai::DetokenizeRequest = openai::parse(&body)?;
    if let Some(m) = &req.model {
        st.check_model(m).await?;
    }
    let vocab = st.worker_info().await?.vocab_size;
    if let Some((i, t)) = req
        .tokens
        .iter()
        .enumerate()
        .find(|&(_, &t)| vocab > 0 && t >= vocab)
    {
        return Err(ApiError::invalid_param(
            "tokens",
            format!("tokens[{i}]: token id {t} is outside the vocabulary of {vocab} tokens"),
        ));
    }
    let text = match st.local_tokenizer().await {
        Some(tok) => tok
            .decode(&req.tokens, false)
            .map_err(|e| ApiError::invalid_param("tokens", e.to_string()))?,
        None => st.backends.detokenize(req.tokens).await?,
    };
    Ok(Json(json!({ "prompt": text })))
}

fn model_object(st: &AppState, id: &str) -> Value {
    json!({ "id": id, "object": "model", "created": st.started, "owned_by": "pdmesh" })
}

/// The served model.
#[utoipa::path(
    get,
    path = "/v1/models",
    tag = "OpenAI",
    responses(
        (status = 200, description = "`{\"object\": \"list\", \"data\": [{\"id\", \"object\": \"model\", \"created\", \"owned_by\"}]}`: the one served model.", body = Object),
        crate::openapi::BackendErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn list_models(State(st): State<AppState>) -> Result<Json<Value>, ApiError> {
    let id = st.served_model().await?;
    Ok(Json(
        json!({ "object": "list", "data": [model_object(&st, &id)] }),
    ))
}

/// A model, if it is the served one.
#[utoipa::path(
    get,
    path = "/v1/models/{model}",
    tag = "OpenAI",
    params(("model" = String, Path, description = "The model's name.")),
    responses(
        (status = 200, description = "`{\"id\", \"object\": \"model\", \"created\", \"owned_by\"}`.", body = Object),
        crate::openapi::LookupErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn get_model(
    State(st): State<AppState>,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = st.check_model(&model).await?;
    Ok(Json(model_object(&st, &id)))
}

pub(crate) fn body_bytes(
    st: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Bytes, ApiError> {
    body.map_err(|rej| {
        if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::payload_too_large(st.cfg.max_body_bytes)
        } else {
            ApiError::invalid_request(
                format!("could not read the request body: {}", rej.body_text()),
                None,
            )
        }
    })
}

/// The prompt must leave room for at least one token, and for `max_tokens` if given
/// (`max_param`: the field the request gave it in).
fn check_context(
    info: &WorkerInfo,
    prompt_len: usize,
    (max_tokens, max_param): (Option<u32>, &str),
    prompt_param: &str,
) -> Result<(), ApiError> {
    let ctx = info.context_length as usize;
    if ctx == 0 {
        return Ok(());
    }
    if prompt_len >= ctx {
        return Err(ApiError::context_length(
            format!(
                "This model's maximum context length is {ctx} tokens, but the prompt has {prompt_len} tokens \
                 (no room to generate). Please shorten the prompt."
            ),
            Some(prompt_param),
        ));
    }
    if let Some(m) = max_tokens
        && prompt_len + m as usize > ctx
    {
        return Err(ApiError::context_length(
            format!(
                "This model's maximum context length is {ctx} tokens. However, you requested {} tokens \
                 ({prompt_len} in the prompt, {m} for the completion). Please reduce the prompt or {max_param}.",
                prompt_len + m as usize
            ),
            Some(max_param),
        ));
    }
    Ok(())
}

/// `max_tokens` alone already beyond the context: rejected before tokenizing.
/// Logprobs name tokens by their text, which the gateway reads from its own copy of the
/// tokenizer (the one it detokenizes with).
async fn check_logprobs(st: &AppState, params: &GenParams) -> Result<(), ApiError> {
    if params.logprobs.is_some() && st.local_tokenizer().await.is_none() {
        return Err(ApiError::unsupported(
            "logprobs",
            "logprobs need the gateway to hold the model's tokenizer (start it with --model, as `pdmesh up` does)",
        ));
    }
    Ok(())
}

fn check_max_tokens(info: &WorkerInfo, max: (Option<u32>, &str)) -> Result<(), ApiError> {
    check_context(info, 0, max, "max_tokens")
}

fn with_request_id(mut resp: Response, id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

#[derive(Clone, Copy)]
enum Kind {
    Chat,
    Completion,
}

/// Records the time from request to the end of a stream, however it ends.
pub(crate) struct StreamTimer {
    pub(crate) st: AppState,
    pub(crate) start: Instant,
}

impl Drop for StreamTimer {
    fn drop(&mut self) {
        self.st
            .metrics
            .stream_duration
            .observe(self.start.elapsed().as_secs_f64());
    }
}

fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

/// The SSE response: `data: {chunk}` per delta of each choice (chunks of different
/// choices interleave, as they arrive), each choice's finish chunk, the optional usage
/// chunk, then `data: [DONE]`. An error after the stream began is sent as
/// `data: {"error": …}` and ends every choice.
fn sse(
    st: AppState,
    start: Instant,
    meta: ResponseMeta,
    choices: Vec<GenStream>,
    kind: Kind,
    include_usage: bool,
) -> Response {
    let timer = StreamTimer {
        st: st.clone(),
        start,
    };
    let request_id = meta.id.clone();
    let n = choices.len();
    let mut merged = futures::stream::select_all(
        choices
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.map(move |ev| (i, ev)).boxed()),
    );
    let events = async_stream::stream! {
        let _timer = timer;
        // Logprobs ride on the next content chunk (or the finish chunk) of their choice
        // after their token arrived; the text a token adds may be held back (stop
        // strings, markup).
        // Per choice: logprobs not sent yet, and the text offset reached (completions).
        let mut pending: Vec<(Vec<LogprobEntry>, usize)> = vec![(Vec::new(), 0); n];
        let logprobs = |(entries, offset): &mut (Vec<LogprobEntry>, usize)| {
            let entries = std::mem::take(entries);
            match kind {
                _ if !meta.logprobs => Value::Null,
                Kind::Chat => openai::chat_logprobs(&entries),
                Kind::Completion => openai::completion_logprobs(&entries, offset),
            }
        };
        if let Kind::Chat = kind {
            for i in 0..n {
                yield Ok::<Event, Infallible>(data(&openai::chat_chunk(&meta, i, json!({"role": "assistant", "content": ""}), None, Value::Null)));
            }
        }
        // An echoed prompt comes first; with logprobs, once its logprobs are there.
        if let (Some(e), false) = (&meta.echo, meta.logprobs) {
            for i in 0..n {
                yield Ok(data(&openai::completion_chunk(&meta, i, &e.text, None, Value::Null)));
            }
        }
        let mut usages = Vec::with_capacity(n);
        while let Some((i, ev)) = merged.next().await {
            match ev {
                Ok(GenEvent::Prompt(entries)) => {
                    if let Some(e) = &meta.echo {
                        let lp = openai::echo_logprobs(e, &entries, &mut pending[i].1);
                        yield Ok(data(&openai::completion_chunk(&meta, i, &e.text, None, lp)));
                    }
                }
                Ok(GenEvent::Logprob(e)) => pending[i].0.push(e),
                Ok(GenEvent::Text(t)) => {
                    let lp = logprobs(&mut pending[i]);
                    let chunk = match kind {
                        Kind::Chat => openai::chat_chunk(&meta, i, json!({ "content": t }), None, lp),
                        Kind::Completion => openai::completion_chunk(&meta, i, &t, None, lp),
                    };
                    yield Ok(data(&chunk));
                }
                // Only chat requests ask for parsing.
                Ok(GenEvent::Reasoning(t)) => {
                    yield Ok(data(&openai::chat_chunk(&meta, i, json!({ "reasoning_content": t }), None, Value::Null)));
                }
                Ok(GenEvent::ToolCall(d)) => {
                    yield Ok(data(&openai::chat_chunk(&meta, i, openai::tool_call_delta(&d), None, Value::Null)));
                }
                Ok(GenEvent::Done(d)) => {
                    let lp = logprobs(&mut pending[i]);
                    let chunk = match kind {
                        Kind::Chat => openai::chat_chunk(&meta, i, json!({}), Some(d.finish_reason), lp),
                        Kind::Completion => openai::completion_chunk(&meta, i, "", Some(d.finish_reason), lp),
                    };
                    yield Ok(data(&chunk));
                    usages.push(d.usage);
                    if usages.len() < n {
                        continue;
                    }
                    if include_usage {
                        let object = match kind {
                            Kind::Chat => "chat.completion.chunk",
                            Kind::Completion => "text_completion",
                        };
                        yield Ok(data(&openai::usage_chunk(&meta, object, &Usage::of_choices(&usages))));
                    }
                    yield Ok(Event::default().data("[DONE]"));
                    return;
                }
                Err(e) => {
                    // Dropping the other choices' streams aborts them on the worker.
                    st.metrics.error(e.error_type);
                    yield Ok(data(&e.body()));
                    return;
                }
            }
        }
    };
    let resp = Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response();
    with_request_id(resp, &request_id)
}

/// The span of one API request: the root of its trace (a child of the client's
/// `traceparent` when it sent one), named and attributed as OpenTelemetry's GenAI
/// conventions say. The generation's stream holds it open until the answer ends.
fn request_span(operation: &'static str, headers: &HeaderMap) -> tracing::Span {
    use tracing::field::Empty;
    let span = tracing::info_span!(
        "request",
        otel.name = operation,
        otel.kind = "server",
        otel.status_code = Empty,
        gen_ai.operation.name = operation,
        gen_ai.request.model = Empty,
        gen_ai.response.id = Empty,
        gen_ai.response.finish_reasons = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        request_id = Empty,
        pdmesh.room = Empty,
        error.type = Empty,
    );
    pdmesh_telemetry::set_parent_from(&span, headers);
    span
}

/// Runs one API request in its span; an error is recorded on it.
pub(crate) async fn traced(
    operation: &'static str,
    headers: &HeaderMap,
    handler: impl Future<Output = Result<Response, ApiError>>,
) -> Result<Response, ApiError> {
    let span = request_span(operation, headers);
    let out = handler.instrument(span.clone()).await;
    if let Err(e) = &out {
        generate::record_error(&span, e);
    }
    out
}

/// Names the request's span after the model, as the GenAI conventions do.
fn record_model(operation: &str, model: &str) {
    let span = tracing::Span::current();
    span.record("gen_ai.request.model", model);
    pdmesh_telemetry::rename(&span, format!("{operation} {model}"));
}

/// Creates a chat completion.
///
/// OpenAI's chat completions, with vLLM's extra sampling fields. Tool calls and JSON
/// answers are constrained by a grammar; `n` choices share the prompt's computation.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    tag = "OpenAI",
    request_body = crate::openapi::ChatCompletionRequest,
    responses(
        (status = 200, description = "The completion; with `stream`, its chunks as server-sent events (`data: {chunk}`), then `data: [DONE]`.", content(
            (Object = "application/json"),
            (crate::openapi::SseEvent = "text/event-stream"),
        )),
        crate::openapi::GenerationErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn chat_completions(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    traced("chat", &headers, chat(st, body)).await
}

async fn chat(st: AppState, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let start = Instant::now();
    let body = body_bytes(&st, body)?;
    let req: ChatRequest = openai::parse(&body)?;
    let fields = openai::parse::<SamplingFields>(&body)?;
    let mut chat = prepare_chat(&st, &req, &fields).await?;
    if st.incidents.is_some() {
        chat.params.request = Some(body.clone());
    }
    let stream = req.stream.unwrap_or(false);
    let grammar_from = chat.grammar_from;
    respond(
        st,
        start,
        chat.model,
        Kind::Chat,
        chat.ids,
        (chat.params, chat.parsing),
        (stream, None),
        req.include_usage(),
    )
    .await
    .map_err(|e| blame_grammar(e, grammar_from))
}

/// A chat request made ready to generate: the served model's name, the prompt's ids
/// (through the chat template), the worker's parameters and the output's parsing.
pub(crate) struct PreparedChat {
    pub model: String,
    pub ids: Vec<u32>,
    pub params: GenParams,
    pub parsing: Option<Parsing>,
    /// The field the grammar was made from (`response_format`, or `tools` for a forced
    /// call), if there is one: see [`blame_grammar`].
    pub grammar_from: Option<&'static str>,
}

/// A worker's refusal of the request's grammar (its schema does not compile: a bad
/// `pattern`, an unsatisfiable `required`) names the field the grammar came from. The
/// worker's engine says `invalid grammar: …` and knows no field of the request.
pub(crate) fn blame_grammar(mut e: ApiError, from: Option<&'static str>) -> ApiError {
    if e.param.is_none()
        && e.status == StatusCode::BAD_REQUEST
        && e.message.starts_with("invalid grammar")
    {
        e.param = from.map(str::to_owned);
    }
    e
}

/// Everything a chat request is checked and turned into before generating (the OpenAI
/// endpoint's, and the Anthropic one's once translated).
pub(crate) async fn prepare_chat(
    st: &AppState,
    req: &ChatRequest,
    fields: &SamplingFields,
) -> Result<PreparedChat, ApiError> {
    let mut params = fields.to_params()?;
    params.logprobs = req.logprobs()?;
    check_logprobs(st, &params).await?;
    let messages = req.messages()?;
    let tools = tools::parse_tools(req.tools.as_ref())?;
    let choice = tools::parse_tool_choice(req.tool_choice.as_ref(), &tools)?;
    let schema = tools::response_schema(req.response_format.as_ref())?;
    let thinking = req.thinking()?;
    let model = st.check_model(&req.model).await?;
    record_model("chat", &model);
    let info = st.worker_info().await?.clone();
    let max = (params.max_tokens, fields.max_param());
    check_max_tokens(&info, max)?;
    let format = st.output_format().await?;
    let (tools_json, parallel) = (req.tools_json(), req.parallel_tool_calls.unwrap_or(true));
    let grammar_from = if schema.is_some() {
        Some("response_format")
    } else if matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        Some("tools")
    } else {
        None
    };
    let grammar = grammar_from.is_some();
    let plan = if !grammar {
        tools::plan(
            &tools, tools_json, &choice, parallel, schema, format, thinking,
        )?
    } else {
        let choice = choice.clone();
        // Schemas become grammars off the async runtime, within a step budget and a
        // deadline: no request holds the gateway's threads (its `/live` must answer).
        let work = tokio::task::spawn_blocking(move || {
            tools::plan(
                &tools, tools_json, &choice, parallel, schema, format, thinking,
            )
        });
        match tokio::time::timeout(tools::SCHEMA_DEADLINE, work).await {
            Ok(Ok(plan)) => plan?,
            Ok(Err(e)) => {
                return Err(ApiError::backend(format!(
                    "preparing the grammar failed: {e}"
                )));
            }
            Err(_) => return Err(tools::past_deadline()),
        }
    };
    params.grammar = plan.grammar;
    let parsing = (plan.parse_tools.is_some() || format.reasoning).then(|| Parsing {
        tool_format: if plan.parse_tools.is_some() {
            format.tools
        } else {
            ToolFormat::None
        },
        tool_names: plan.parse_tools.unwrap_or_default(),
        reasoning: format.reasoning,
        thinking,
        call_id_prefix: format!("call_{}_", &uuid::Uuid::new_v4().simple().to_string()[..12]),
    });

    let t0 = Instant::now();
    let ids = st
        .backends
        .apply_chat_template(messages, plan.render, thinking)
        .await?;
    st.metrics
        .stage(Stage::Tokenize, t0.elapsed().as_secs_f64());
    check_context(&info, ids.len(), max, "messages")?;
    Ok(PreparedChat {
        model,
        ids,
        params,
        parsing,
        grammar_from,
    })
}

/// Starts the generation and answers with a Server-Sent Events stream or one JSON body.
#[allow(clippy::too_many_arguments)]
async fn respond(
    st: AppState,
    start: Instant,
    model: String,
    kind: Kind,
    ids: Vec<u32>,
    (params, parsing): (GenParams, Option<Parsing>),
    (stream, echo): (bool, Option<openai::Echo>),
    include_usage: bool,
) -> Result<Response, ApiError> {
    let prefix = match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
    };
    let id = format!("{prefix}-{}", uuid::Uuid::new_v4().simple());
    let span = tracing::Span::current();
    span.record("request_id", id.as_str());
    span.record("gen_ai.response.id", id.as_str());
    let meta = ResponseMeta {
        id: id.clone(),
        created: unix_now(),
        model,
        logprobs: params.logprobs.is_some(),
        echo,
    };
    let choices = start_choices(&st, &id, ids, params, parsing, start).await?;
    if stream {
        return Ok(sse(st.clone(), start, meta, choices, kind, include_usage));
    }
    let outs = futures::future::try_join_all(choices.into_iter().map(generate::collect)).await?;
    let usage = Usage::of_choices(&outs.iter().map(|(_, d)| d.usage).collect::<Vec<_>>());
    let body = match kind {
        Kind::Chat => {
            let choices = outs
                .iter()
                .enumerate()
                .map(|(i, (out, done))| openai::chat_choice(&meta, i, out, done.finish_reason))
                .collect();
            openai::chat_completion(&meta, choices, &usage)
        }
        Kind::Completion => {
            let choices = outs
                .iter()
                .enumerate()
                .map(|(i, (out, done))| {
                    openai::completion_choice(&meta, i, out, done.finish_reason)
                })
                .collect();
            openai::completion(&meta, choices, &usage)
        }
    };
    Ok(with_request_id(Json(body).into_response(), &id))
}

/// Starts the request's `n` choices together. With `n` > 1 they form a prompt group (the
/// worker computes the prompt once for all of them) and choice `i` samples with seed
/// `seed + i` (a random `seed` when the request gave none), so a choice is reproduced
/// alone by a request with that seed. If any choice cannot start, the others are aborted.
async fn start_choices(
    st: &AppState,
    id: &str,
    ids: Vec<u32>,
    params: GenParams,
    parsing: Option<Parsing>,
    start: Instant,
) -> Result<Vec<GenStream>, ApiError> {
    let n = params.n.max(1);
    if n == 1 {
        return Ok(vec![
            generate::start(st, id.to_owned(), ids, params, parsing, start).await?,
        ]);
    }
    let seed = params
        .seed
        .unwrap_or_else(|| uuid::Uuid::new_v4().as_u64_pair().0);
    let starts = (0..n).map(|i| {
        let mut p = params.clone();
        p.seed = Some(seed.wrapping_add(u64::from(i)));
        p.prompt_group = Some((id.to_owned(), n));
        let parsing = parsing.clone().map(|mut x| {
            // Tool-call ids stay unique across choices.
            x.call_id_prefix.push_str(&format!("{i}_"));
            x
        });
        generate::start(st, format!("{id}-{i}"), ids.clone(), p, parsing, start)
    });
    futures::future::try_join_all(starts).await
}

/// Creates a completion of a prompt.
///
/// OpenAI's legacy completions, with vLLM's extra sampling fields; the prompt may be
/// token ids.
#[utoipa::path(
    post,
    path = "/v1/completions",
    tag = "OpenAI",
    request_body = crate::openapi::CompletionsRequest,
    responses(
        (status = 200, description = "The completion; with `stream`, its chunks as server-sent events (`data: {chunk}`), then `data: [DONE]`.", content(
            (Object = "application/json"),
            (crate::openapi::SseEvent = "text/event-stream"),
        )),
        crate::openapi::GenerationErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn completions(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    traced("text_completion", &headers, completion(st, body)).await
}

async fn completion(
    st: AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let start = Instant::now();
    let body = body_bytes(&st, body)?;
    let req: CompletionRequest = openai::parse(&body)?;
    let fields = openai::parse::<SamplingFields>(&body)?;
    let mut params = fields.to_params()?;
    req.check_supported()?;
    params.logprobs = req.logprobs()?;
    check_logprobs(&st, &params).await?;
    if st.incidents.is_some() {
        params.request = Some(body.clone());
    }
    let echo = req.echo == Some(true);
    if echo {
        // The prompt's logprobs too, with as many alternatives (what `echo` scores).
        params.prompt_logprobs = params.logprobs;
    }
    let prompt = req.prompt()?;
    let echo_text = match (&prompt, echo) {
        (PromptInput::Text(t), true) => Some(t.clone()),
        _ => None,
    };
    let model = st.check_model(&req.model).await?;
    record_model("text_completion", &model);
    let info = st.worker_info().await?.clone();
    let max = (params.max_tokens, fields.max_param());
    check_max_tokens(&info, max)?;

    let ids = match prompt {
        PromptInput::Text(text) => {
            let t0 = Instant::now();
            let ids = st.backends.tokenize(text, true).await?;
            st.metrics
                .stage(Stage::Tokenize, t0.elapsed().as_secs_f64());
            ids
        }
        PromptInput::Ids(ids) => {
            if let Some((i, t)) = ids
                .iter()
                .enumerate()
                .find(|&(_, &t)| info.vocab_size > 0 && t >= info.vocab_size)
            {
                return Err(ApiError::invalid_param(
                    "prompt",
                    format!(
                        "prompt[{i}]: token id {t} is outside the vocabulary of {} tokens",
                        info.vocab_size
                    ),
                ));
            }
            ids
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid_param(
            "prompt",
            "the prompt tokenized to zero tokens",
        ));
    }
    check_context(&info, ids.len(), max, "prompt")?;
    let echo = match echo {
        false => None,
        true => Some(openai::Echo {
            // A prompt of ids echoes as their text.
            text: match echo_text {
                Some(t) => t,
                None => st.backends.detokenize(ids.clone()).await?,
            },
            first: match st.local_tokenizer().await {
                Some(tok) => generate::TokenText::of(tok, ids[0]),
                None => generate::TokenText::default(),
            },
        }),
    };
    let stream = req.stream.unwrap_or(false);
    respond(
        st,
        start,
        model,
        Kind::Completion,
        ids,
        (params, None),
        (stream, echo),
        req.include_usage(),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(ctx: u32) -> WorkerInfo {
        WorkerInfo {
            model_id: "m".into(),
            context_length: ctx,
            vocab_size: 100,
            total_pages: 1,
            free_pages: 1,
            cached_pages: 0,
            evicted_pages: 0,
            device_hit_tokens: 0,
            host: Default::default(),
            pd: Default::default(),
            faults: Vec::new(),
            auth_refused: 0,
            insecure_plaintext: false,
            incidents: Default::default(),
        }
    }

    #[test]
    fn context_checks_name_the_limit_and_the_param() {
        let m = |n| (n, "max_tokens");
        let e = check_context(&info(100), 100, m(None), "prompt").unwrap_err();
        assert_eq!(e.code, Some("context_length_exceeded"));
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert!(e.message.contains("100 tokens"), "{}", e.message);
        let e = check_context(&info(100), 60, m(Some(41)), "prompt").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(check_context(&info(100), 60, m(Some(40)), "prompt").is_ok());
        assert!(check_context(&info(100), 99, m(None), "prompt").is_ok());
        assert!(check_max_tokens(&info(100), m(Some(101))).is_err());
        // The limit is blamed on the field the request gave it in.
        let e = check_max_tokens(&info(100), (Some(101), "max_completion_tokens")).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_completion_tokens"));
        assert!(
            e.message.ends_with("or max_completion_tokens."),
            "{}",
            e.message
        );
    }

    #[test]
    fn api_key_comparison() {
        assert!(same_key(b"abc", b"abc"));
        assert!(!same_key(b"abd", b"abc"));
        assert!(!same_key(b"ab", b"abc"));
    }
}

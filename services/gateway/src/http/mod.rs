//! The HTTP front: the router, the middleware every request passes (metrics, the key
//! checks, admission), and the answers of routes that do not exist. The handlers of the
//! protocols are in `api`; the operators' and tokenizer routes are here.

pub(crate) mod admin;
mod auth;
pub(crate) mod openapi;
pub(crate) mod ops;
pub(crate) mod tokens;

use std::time::Instant;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use futures::StreamExt;

use self::admin::{get_incident, list_incidents};
use self::auth::{admin_auth, auth};
use self::ops::{health, live, metrics, ready};
use self::tokens::{detokenize, flush_cache, tokenize};
use crate::api::{anthropic, openai, responses};
use crate::error::{ApiError, ErrorClass};
use crate::metrics::{Endpoint, endpoint_label};
use crate::state::AppState;

pub(crate) fn router(st: AppState) -> Router {
    let generating = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/responses", post(responses::create))
        .route_layer(middleware::from_fn_with_state(st.clone(), admit));
    let v1 = Router::new()
        .merge(generating)
        .route("/v1/models", get(openai::list_models))
        .route("/v1/models/{model}", get(openai::get_model))
        .route("/flush_cache", post(flush_cache))
        .route(
            "/v1/responses/{id}",
            get(responses::get).delete(responses::delete),
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
        .route("/openapi.json", get(openapi::openapi_json))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(st.clone(), observe))
        .layer(DefaultBodyLimit::max(st.cfg.max_body_bytes))
        .layer(Extension(std::sync::Arc::new(responses::new_store(
            st.cfg.responses_max_stored,
            st.cfg.responses_max_stored_bytes,
            st.cfg.responses_ttl_secs,
        ))))
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

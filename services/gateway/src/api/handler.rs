//! What every protocol's handler does around its generation: read the body, run in the
//! request's span, time the stream, and tag the answer with the request's id.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use tracing::Instrument as _;

use crate::error::ApiError;
use crate::generate;
use crate::state::AppState;

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

pub(crate) fn with_request_id(mut resp: Response, id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
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

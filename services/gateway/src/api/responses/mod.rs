//! OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`),
//! translated to the chat endpoint's own request and back, as `anthropic` does for
//! Messages: input items (messages, function calls and their outputs, reasoning),
//! `instructions`, function tools and `tool_choice`, `text.format`, `reasoning`, and
//! streaming with the Responses event types. Responses are remembered (in memory,
//! bounded, see [`store`]) so that `previous_response_id` continues a conversation.
//! Fields that would change the answer and that this server cannot honour (built-in
//! tools, `background`, `truncation: "auto"`, `include`) are a 400 naming them, never
//! dropped.
//!
//! Reasoning given back as `reasoning` items becomes the assistant turn's
//! `reasoning_content`, as the chat endpoint takes it (the chat template decides whether
//! to render it; encrypted-only items carry no text and are dropped). `reasoning.effort`
//! other than `none` turns thinking on, like `chat_template_kwargs.thinking`; reasoning
//! comes back as a `reasoning` item with its text in `content` and no summary, and is not
//! counted apart (`reasoning_tokens` is 0). `text.verbosity` is accepted and not acted on.

mod output;
pub(crate) mod request;
mod store;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures::StreamExt;
use serde_json::{Map, Value, json};

use self::output::{Builder, Echo, StreamEvent, new_id};
use self::request::{Item, ResponsesRequest, check_fields, check_metadata, responses_param};
use super::handler::{StreamTimer, body_bytes, traced};
use crate::error::ApiError;
use crate::generate::chat::{ChatRequest, blame_grammar, prepare_chat};
use crate::generate::sampling::SamplingFields;
use crate::generate::{self, GenEvent};
use crate::json;
use crate::state::AppState;

/// What a stored response keeps: its JSON (for `GET`), and the conversation so far —
/// every earlier turn's input and output items, then its own — for a later
/// `previous_response_id` (its `instructions` are not carried over, as OpenAI does).
pub(crate) struct Stored {
    body: Value,
    history: Vec<Item>,
}

pub(crate) type Store = store::Store<Stored>;

/// The gateway's store, sized by its configuration.
pub(crate) fn new_store(max: usize, max_bytes: usize, ttl_secs: u64) -> Store {
    Store::new(max, max_bytes, Duration::from_secs(ttl_secs))
}

fn not_found(what: &str, id: &str, param: Option<&str>) -> ApiError {
    ApiError {
        param: param.map(str::to_owned),
        ..ApiError::not_found(format!("{what} with id '{id}' not found."))
    }
}

/// Creates a response (OpenAI's Responses API).
///
/// Translated to a chat completion and back; stored (unless `store` is false) for
/// `GET /v1/responses/{id}` and `previous_response_id`. Fields that would change the
/// answer and that this server cannot honour are a 400 naming them.
#[utoipa::path(
    post,
    path = "/v1/responses",
    tag = "OpenAI",
    request_body = crate::api::responses::request::ResponseCreateRequest,
    responses(
        (status = 200, description = "The response; with `stream`, the Responses API's server-sent events (`response.created` ... `response.completed`).", content(
            (Object = "application/json"),
            (crate::api::schema::SseEvent = "text/event-stream"),
        )),
        crate::api::schema::GenerationErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn create(
    State(st): State<AppState>,
    Extension(store): Extension<Arc<Store>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    traced("chat", &headers, run(st, store, body)).await
}

/// A stored response, as it was returned.
#[utoipa::path(
    get,
    path = "/v1/responses/{id}",
    tag = "OpenAI",
    params(("id" = String, Path, description = "The response's id (`resp_...`).")),
    responses(
        (status = 200, description = "The response object.", body = Object),
        crate::api::schema::StoredErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn get(
    Extension(store): Extension<Arc<Store>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    match store.get(&id) {
        Some(s) => Ok(Json(s.body.clone())),
        None => Err(not_found("Response", &id, None)),
    }
}

/// Forgets a stored response.
#[utoipa::path(
    delete,
    path = "/v1/responses/{id}",
    tag = "OpenAI",
    params(("id" = String, Path, description = "The response's id (`resp_...`).")),
    responses(
        (status = 200, description = "`{\"id\", \"object\": \"response\", \"deleted\": true}`.", body = Object),
        crate::api::schema::StoredErrors,
    ),
    security(("bearer" = []), ("api_key" = [])),
)]
pub(crate) async fn delete(
    Extension(store): Extension<Arc<Store>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if store.remove(&id) {
        Ok(Json(
            json!({"id": id, "object": "response", "deleted": true}),
        ))
    } else {
        Err(not_found("Response", &id, None))
    }
}

async fn run(
    st: AppState,
    store: Arc<Store>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let start = Instant::now();
    let body = body_bytes(&st, body)?;
    check_fields(&json::parse::<Map<String, Value>>(&body)?)?;
    let req: ResponsesRequest = json::parse(&body)?;
    check_metadata(req.metadata.as_ref())?;
    if let Some(m) = req.max_output_tokens.filter(|&m| m < 1) {
        return Err(ApiError::invalid_param(
            "max_output_tokens",
            format!("max_output_tokens must be at least 1, got {m}"),
        ));
    }
    let mut history = match &req.previous_response_id {
        None => Vec::new(),
        Some(prev) => match store.get(prev) {
            Some(s) => s.history.clone(),
            None => {
                return Err(ApiError {
                    code: Some("previous_response_not_found"),
                    ..not_found("Previous response", prev, Some("previous_response_id"))
                });
            }
        },
    };
    history.extend(req.input_items()?);
    let chat_body = req.to_chat(&history)?;
    let chat: ChatRequest = serde_json::from_value(chat_body)
        .map_err(|e| ApiError::invalid_request(format!("invalid request: {e}"), None))?;
    // The extra sampling fields, read where the client put them; the length limit is
    // Responses' own.
    let mut sampling: SamplingFields = json::parse(&body)?;
    sampling.max_tokens = req.max_output_tokens;
    let prep = prepare_chat(&st, &chat, &sampling)
        .await
        .map_err(responses_param)?;
    let grammar_from = prep.grammar_from;
    let id = new_id("resp");
    let span = tracing::Span::current();
    span.record("request_id", id.as_str());
    span.record("gen_ai.response.id", id.as_str());
    let echo = Echo::new(&req, id.clone(), prep.model);
    let gen_stream = generate::start(&st, id.clone(), prep.ids, prep.params, prep.parsing, start)
        .await
        .map_err(|e| responses_param(blame_grammar(e, grammar_from)))?;
    let mut resp = if req.stream.unwrap_or(false) {
        stream(st, store, start, echo, history, gen_stream)
    } else {
        let mut b = Builder::default();
        let mut gen_stream = gen_stream;
        let done = loop {
            match gen_stream.next().await {
                Some(Ok(GenEvent::Done(d))) => break d,
                Some(Ok(ev)) => drop(b.push(ev)),
                Some(Err(e)) => return Err(responses_param(blame_grammar(e, grammar_from))),
                None => {
                    return Err(ApiError::backend(
                        "the generation ended without a finish reason",
                    ));
                }
            }
        };
        let (status, _) = b.finish(&done);
        let obj = echo.object(status, &b.items, Some(&done), None);
        remember(&st, &store, &echo, &obj, history, b.history);
        Json(obj).into_response()
    };
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    Ok(resp)
}

/// Stores a finished response unless the request said `store: false`.
fn remember(
    st: &AppState,
    store: &Store,
    echo: &Echo,
    obj: &Value,
    mut history: Vec<Item>,
    output: Vec<Item>,
) {
    if echo.store {
        history.extend(output);
        let bytes = obj.to_string().len() + history.iter().map(Item::bytes).sum::<usize>();
        let stored = Stored {
            body: obj.clone(),
            history,
        };
        if !store.insert(echo.id.clone(), stored, bytes) {
            tracing::warn!(
                id = %echo.id,
                bytes,
                limit = st.cfg.responses_max_stored_bytes,
                "a response larger than --responses-max-stored-bytes is not stored"
            );
        }
    }
}

/// The SSE response: `response.created` and `response.in_progress`, each output item's
/// events as the model writes it, then `response.completed` (or `response.incomplete`)
/// with the whole response. An error after the stream began ends it with
/// `response.failed`, whose response carries the error and the output so far.
fn stream(
    st: AppState,
    store: Arc<Store>,
    start: Instant,
    echo: Echo,
    history: Vec<Item>,
    mut gen_stream: generate::GenStream,
) -> Response {
    let timer = StreamTimer {
        st: st.clone(),
        start,
    };
    let events = async_stream::stream! {
        let _timer = timer;
        let mut b = Builder::default();
        let sse = |(kind, body): StreamEvent| Ok::<Event, Infallible>(Event::default().event(kind).data(body.to_string()));
        let created = echo.object("in_progress", &[], None, None);
        yield sse(b.event("response.created", json!({"response": created})));
        yield sse(b.event("response.in_progress", json!({"response": created})));
        while let Some(item) = gen_stream.next().await {
            match item {
                Ok(GenEvent::Done(d)) => {
                    let (status, events) = b.finish(&d);
                    for e in events {
                        yield sse(e);
                    }
                    let obj = echo.object(status, &b.items, Some(&d), None);
                    remember(&st, &store, &echo, &obj, history, std::mem::take(&mut b.history));
                    let kind = if status == "completed" { "response.completed" } else { "response.incomplete" };
                    yield sse(b.event(kind, json!({"response": obj})));
                    return;
                }
                Ok(ev) => {
                    for e in b.push(ev) {
                        yield sse(e);
                    }
                }
                Err(e) => {
                    st.metrics.error(e.error_type);
                    let closed = b.close("incomplete");
                    for e in closed {
                        yield sse(e);
                    }
                    let obj = echo.object("failed", &b.items, None, Some(&e));
                    yield sse(b.event("response.failed", json!({"response": obj})));
                    return;
                }
            }
        }
    };
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests;

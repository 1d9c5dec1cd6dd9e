//! OpenAI's chat completions and legacy completions (`POST /v1/chat/completions`,
//! `/v1/completions`) and the models list: each request is generated as one or `n` choices
//! and answered with one JSON body or a stream of chunks.

pub(crate) mod encode;
pub(crate) mod request;

use std::convert::Infallible;
use std::time::Instant;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{Value, json};

use self::encode::{Echo, ResponseMeta};
use self::request::{CompletionRequest, PromptInput};
use super::handler::{StreamTimer, body_bytes, traced, with_request_id};
use crate::clients::GenParams;
use crate::clients::output::Parsing;
use crate::error::ApiError;
use crate::generate::chat::{
    ChatRequest, blame_grammar, check_context, check_logprobs, check_max_tokens, prepare_chat,
    record_model,
};
use crate::generate::sampling::SamplingFields;
use crate::generate::{self, GenEvent, GenStream, LogprobEntry, Usage};
use crate::json;
use crate::metrics::Stage;
use crate::state::{AppState, unix_now};

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
        crate::api::schema::BackendErrors,
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
        crate::api::schema::LookupErrors,
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

#[derive(Clone, Copy)]
enum Kind {
    Chat,
    Completion,
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
                Kind::Chat => encode::chat_logprobs(&entries),
                Kind::Completion => encode::completion_logprobs(&entries, offset),
            }
        };
        if let Kind::Chat = kind {
            for i in 0..n {
                yield Ok::<Event, Infallible>(data(&encode::chat_chunk(&meta, i, json!({"role": "assistant", "content": ""}), None, Value::Null)));
            }
        }
        // An echoed prompt comes first; with logprobs, once its logprobs are there.
        if let (Some(e), false) = (&meta.echo, meta.logprobs) {
            for i in 0..n {
                yield Ok(data(&encode::completion_chunk(&meta, i, &e.text, None, Value::Null)));
            }
        }
        let mut usages = Vec::with_capacity(n);
        while let Some((i, ev)) = merged.next().await {
            match ev {
                Ok(GenEvent::Prompt(entries)) => {
                    if let Some(e) = &meta.echo {
                        let lp = encode::echo_logprobs(e, &entries, &mut pending[i].1);
                        yield Ok(data(&encode::completion_chunk(&meta, i, &e.text, None, lp)));
                    }
                }
                Ok(GenEvent::Logprob(e)) => pending[i].0.push(e),
                Ok(GenEvent::Text(t)) => {
                    let lp = logprobs(&mut pending[i]);
                    let chunk = match kind {
                        Kind::Chat => encode::chat_chunk(&meta, i, json!({ "content": t }), None, lp),
                        Kind::Completion => encode::completion_chunk(&meta, i, &t, None, lp),
                    };
                    yield Ok(data(&chunk));
                }
                // Only chat requests ask for parsing.
                Ok(GenEvent::Reasoning(t)) => {
                    yield Ok(data(&encode::chat_chunk(&meta, i, json!({ "reasoning_content": t }), None, Value::Null)));
                }
                Ok(GenEvent::ToolCall(d)) => {
                    yield Ok(data(&encode::chat_chunk(&meta, i, encode::tool_call_delta(&d), None, Value::Null)));
                }
                Ok(GenEvent::Done(d)) => {
                    let lp = logprobs(&mut pending[i]);
                    let chunk = match kind {
                        Kind::Chat => encode::chat_chunk(&meta, i, json!({}), Some(d.finish_reason), lp),
                        Kind::Completion => encode::completion_chunk(&meta, i, "", Some(d.finish_reason), lp),
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
                        yield Ok(data(&encode::usage_chunk(&meta, object, &Usage::of_choices(&usages))));
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

/// Creates a chat completion.
///
/// OpenAI's chat completions, with vLLM's extra sampling fields. Tool calls and JSON
/// answers are constrained by a grammar; `n` choices share the prompt's computation.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    tag = "OpenAI",
    request_body = crate::api::openai::request::ChatCompletionRequest,
    responses(
        (status = 200, description = "The completion; with `stream`, its chunks as server-sent events (`data: {chunk}`), then `data: [DONE]`.", content(
            (Object = "application/json"),
            (crate::api::schema::SseEvent = "text/event-stream"),
        )),
        crate::api::schema::GenerationErrors,
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
    let req: ChatRequest = json::parse(&body)?;
    let fields = json::parse::<SamplingFields>(&body)?;
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

/// Starts the generation and answers with a Server-Sent Events stream or one JSON body.
#[allow(clippy::too_many_arguments)]
async fn respond(
    st: AppState,
    start: Instant,
    model: String,
    kind: Kind,
    ids: Vec<u32>,
    (params, parsing): (GenParams, Option<Parsing>),
    (stream, echo): (bool, Option<Echo>),
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
                .map(|(i, (out, done))| encode::chat_choice(&meta, i, out, done.finish_reason))
                .collect();
            encode::chat_completion(&meta, choices, &usage)
        }
        Kind::Completion => {
            let choices = outs
                .iter()
                .enumerate()
                .map(|(i, (out, done))| {
                    encode::completion_choice(&meta, i, out, done.finish_reason)
                })
                .collect();
            encode::completion(&meta, choices, &usage)
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
    request_body = crate::api::openai::request::CompletionsRequest,
    responses(
        (status = 200, description = "The completion; with `stream`, its chunks as server-sent events (`data: {chunk}`), then `data: [DONE]`.", content(
            (Object = "application/json"),
            (crate::api::schema::SseEvent = "text/event-stream"),
        )),
        crate::api::schema::GenerationErrors,
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
    let req: CompletionRequest = json::parse(&body)?;
    let fields = json::parse::<SamplingFields>(&body)?;
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
        true => Some(Echo {
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
mod tests;

//! One generation, shared by both endpoints: worker.Generate → detokenize (in process with
//! `--model`'s tokenizer once it is known to equal the tokenizer service's, else through
//! tokenizer.Detokenize; either also splits reasoning and tool calls from content when
//! asked) → stop-string filter →
//! deltas, then the finish reason and usage. A tool call or reasoning block that fails to
//! parse ends the generation with an error: its markup is never shown as content. If the consumer
//! drops the stream early (client disconnect), the worker is told to abort the request,
//! so the engine frees its KV pages at once instead of generating to the end.

pub(crate) mod chat;
pub(crate) mod sampling;
pub(crate) mod schema;
mod stop;
pub(crate) mod tools;

use std::pin::Pin;

use futures::{Stream, StreamExt};

use self::stop::StopFilter;
use crate::clients::output::{Parsed, Parsing, ToolCallDelta};
use crate::clients::{Backends, FinishReason, GenParams, TokenLogprob, WorkerEvent};
use crate::error::ApiError;
use crate::metrics::Stage;
use crate::state::AppState;

/// Token counts for the `usage` object.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
}

impl Usage {
    /// The usage of a request's choices together: the prompt counted once (with what
    /// its first choice found cached: the others shared that computation), the
    /// completions summed.
    pub fn of_choices(choices: &[Usage]) -> Usage {
        Usage {
            prompt_tokens: choices.iter().map(|u| u.prompt_tokens).max().unwrap_or(0),
            completion_tokens: choices.iter().map(|u| u.completion_tokens).sum(),
            cached_tokens: choices.iter().map(|u| u.cached_tokens).min().unwrap_or(0),
        }
    }
}

/// How a generation ended.
#[derive(Clone, Debug)]
pub(crate) struct Done {
    /// `"stop"`, `"length"` or `"tool_calls"`.
    pub finish_reason: &'static str,
    pub usage: Usage,
    /// The stop string that ended the answer, if one did.
    pub stop_sequence: Option<String>,
}

/// One generated token's log-probability as the APIs show it: the token's text (lossy
/// where its bytes are part of a UTF-8 character) and exact bytes, and its alternatives.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct LogprobEntry {
    pub token: TokenText,
    pub logprob: f32,
    pub top: Vec<(TokenText, f32)>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct TokenText {
    pub text: String,
    pub bytes: Vec<u8>,
}

impl TokenText {
    pub(crate) fn of(tok: &pdmesh_tokenize::TextTokenizer, id: u32) -> Self {
        let bytes = tok.token_bytes(id).unwrap_or_default().to_vec();
        Self {
            text: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
        }
    }
}

impl LogprobEntry {
    fn of(tok: &pdmesh_tokenize::TextTokenizer, lp: &TokenLogprob) -> Self {
        Self {
            token: TokenText::of(tok, lp.token),
            logprob: lp.logprob,
            top: lp
                .top
                .iter()
                .map(|&(t, v)| (TokenText::of(tok, t), v))
                .collect(),
        }
    }
}

#[derive(Debug)]
pub(crate) enum GenEvent {
    /// The prompt's tokens' log-probabilities from its second token on (`echo` with
    /// `logprobs`); before anything else.
    Prompt(Vec<LogprobEntry>),
    /// A generated token's log-probability (before the text it adds, which may be held
    /// back); only when the request asked for them.
    Logprob(LogprobEntry),
    /// Content safe to show (never part of a stop string, never markup).
    Text(String),
    /// Reasoning (`reasoning_content`).
    Reasoning(String),
    ToolCall(ToolCallDelta),
    Done(Done),
}

pub(crate) type GenStream = Pin<Box<dyn Stream<Item = Result<GenEvent, ApiError>> + Send>>;

/// Sends worker.Abort for the request when dropped while still armed.
struct AbortGuard {
    backends: Backends,
    request_id: String,
    armed: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let backends = self.backends.clone();
        let id = std::mem::take(&mut self.request_id);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                match backends.abort(&id).await {
                    Ok(found) => tracing::debug!(request_id = %id, found, "aborted on the worker"),
                    Err(e) => {
                        tracing::warn!(request_id = %id, error = %e.message, "worker abort failed")
                    }
                }
            });
        }
    }
}

/// Starts generating. Errors the worker reports before its first message (and a worker
/// that cannot be reached) are returned here, so the handler can still answer with an
/// HTTP error status instead of a broken stream.
pub(crate) async fn start(
    st: &AppState,
    request_id: String,
    prompt: Vec<u32>,
    params: GenParams,
    parsing: Option<Parsing>,
    arrived: std::time::Instant,
) -> Result<GenStream, ApiError> {
    let prompt_len = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
    let stops = params.stop.clone();
    let min_tokens = params.min_tokens as usize;
    // Token texts for logprobs: the handlers refuse logprobs without this tokenizer.
    let vocab = match params.logprobs {
        Some(_) => st.local_tokenizer().await.cloned(),
        None => None,
    };
    let evidence = Evidence {
        request_id: request_id.clone(),
        trace_id: pdmesh_telemetry::trace_id(&tracing::Span::current()).unwrap_or_default(),
        prompt: if st.incidents.is_some() {
            prompt.clone()
        } else {
            Vec::new()
        },
        request: params.request.clone(),
    };
    let mut guard = AbortGuard {
        backends: st.backends.clone(),
        request_id: request_id.clone(),
        armed: true,
    };
    let mut worker = match st.backends.generate(&request_id, prompt, params).await {
        Ok(w) => w,
        Err(e) => {
            // Nothing was admitted; no abort needed.
            guard.armed = e.status.is_server_error();
            return Err(e);
        }
    };
    let first = match worker.next().await {
        Some(Err(e)) => {
            guard.armed = e.status.is_server_error();
            return Err(e);
        }
        Some(Ok(ev)) => ev,
        None => {
            return Err(ApiError::backend(
                "the worker ended the stream before generating anything",
            ));
        }
    };
    let st = st.clone();
    // The request's span stays open until the stream ends, and the calls the stream
    // makes (Detokenize) join its trace.
    let span = tracing::Span::current();
    let span2 = span.clone();
    let stream = async_stream::stream! {
        let mut guard = guard;
        let mut worker = futures::stream::iter([Ok(first)]).chain(worker);
        let mut detok = st.backends.detokenizer(parsing, st.local_tokenizer().await, span.clone());
        let place = st.metrics.detokenized_tokens.with_label_values(&[if detok.is_local() { "gateway" } else { "tokenizer" }]);
        let mut filter = StopFilter::new(&stops);
        let mut calls = 0usize;
        let mut generated = 0usize;
        let mut last_token: Option<std::time::Instant> = None;
        loop {
            let item = tokio::select! {
                biased;
                () = st.shutdown.cancelled() => Some(Err(ApiError::unavailable("the gateway is shutting down"))),
                item = worker.next() => item,
            };
            match item {
                None => {
                    yield Err(ApiError::backend("the worker ended the stream without a Finished message"));
                    return;
                }
                Some(Err(e)) => {
                    if e.code == Some(crate::error::DATA_LOSS)
                        && e.message.contains(crate::route::pd::FIRST_TOKEN_MISMATCH)
                    {
                        report_data_loss(&st, &evidence, &e.message);
                    }
                    yield Err(e);
                    return;
                }
                Some(Ok(WorkerEvent::Prompt(lps))) => {
                    if let Some(v) = &vocab {
                        yield Ok(GenEvent::Prompt(lps.iter().map(|l| LogprobEntry::of(v, l)).collect()));
                    }
                }
                Some(Ok(WorkerEvent::Tokens(ids, lp))) => {
                    if ids.is_empty() {
                        continue;
                    }
                    let now = std::time::Instant::now();
                    match last_token {
                        None => st.metrics.ttft.observe((now - arrived).as_secs_f64()),
                        Some(t) => {
                            // A chunk of several tokens: its gap, shared between them.
                            let gap = (now - t).as_secs_f64() / ids.len() as f64;
                            for _ in 0..ids.len() {
                                st.metrics.itl.observe(gap);
                            }
                        }
                    }
                    last_token = Some(now);
                    if filter.stopped() {
                        continue;
                    }
                    if let (Some(lp), Some(v)) = (&lp, &vocab) {
                        yield Ok(GenEvent::Logprob(LogprobEntry::of(v, lp)));
                    }
                    place.inc_by(ids.len() as u64);
                    generated += ids.len();
                    // Before min_tokens, stop strings do not match (as in the engine).
                    let protect = generated < min_tokens;
                    match detok.push(ids).await.and_then(|p| split(&st, p, (&mut filter, &evidence), protect, false)) {
                        Ok(events) => {
                            for ev in events {
                                calls += usize::from(matches!(ev, GenEvent::ToolCall(ref c) if !c.name.is_empty()));
                                yield Ok(ev);
                            }
                        }
                        Err(e) => {
                            yield Err(e);
                            return;
                        }
                    }
                }
                Some(Ok(WorkerEvent::Finished(f))) => {
                    guard.armed = false;
                    if f.reason == FinishReason::Abort {
                        yield Err(ApiError::aborted());
                        return;
                    }
                    if !filter.stopped() {
                        // A call cut off by max_tokens is not the model's error: the
                        // answer keeps the calls that completed and ends with "length";
                        // the unfinished one is dropped whole (never streamed, since a
                        // call is sent only once its markup is complete, and never shown
                        // as content).
                        let cut = f.reason == FinishReason::Length;
                        match detok
                            .finish(cut)
                            .await
                            .and_then(|p| split(&st, p, (&mut filter, &evidence), false, true))
                        {
                            Ok(events) => {
                                for ev in events {
                                    calls += usize::from(matches!(ev, GenEvent::ToolCall(ref c) if !c.name.is_empty()));
                                    yield Ok(ev);
                                }
                            }
                            Err(e) => {
                                // The guard is disarmed: the worker already finished.
                                yield Err(e);
                                return;
                            }
                        }
                    }
                    let finish_reason = if filter.stopped() || f.reason == FinishReason::Stop {
                        if calls > 0 { "tool_calls" } else { "stop" }
                    } else {
                        "length"
                    };
                    if f.matched_stop.is_some() && !filter.stopped() {
                        tracing::debug!(matched = ?f.matched_stop, "worker matched a stop string the text does not contain");
                    }
                    let usage = Usage {
                        prompt_tokens: if f.prompt_tokens > 0 { f.prompt_tokens } else { prompt_len },
                        completion_tokens: f.completion_tokens,
                        cached_tokens: f.cached_tokens,
                    };
                    st.metrics.prompt_tokens.inc_by(u64::from(usage.prompt_tokens));
                    st.metrics.generated_tokens.inc_by(u64::from(usage.completion_tokens));
                    st.metrics.cached_prompt_tokens.inc_by(u64::from(usage.cached_tokens));
                    let cached = f.cached_tokens.min(usage.prompt_tokens);
                    let host = f.host_cached_tokens.min(cached);
                    st.metrics.prompt_sources(usage.prompt_tokens - cached, cached - host, host, f.transferred_tokens);
                    for (stage, secs) in f.stages {
                        // A unified worker's requests have no transfer stage.
                        if stage != Stage::Transfer || f.transferred_tokens > 0 {
                            st.metrics.stage(stage, secs);
                        }
                    }
                    // As i64: OpenTelemetry has no unsigned attributes.
                    span.record("gen_ai.usage.input_tokens", i64::from(usage.prompt_tokens));
                    span.record("gen_ai.usage.output_tokens", i64::from(usage.completion_tokens));
                    span.record("gen_ai.response.finish_reasons", finish_reason);
                    let stop_sequence = match filter.matched() {
                        Some(m) => Some(m.to_owned()),
                        None => f.matched_stop.clone(),
                    };
                    yield Ok(GenEvent::Done(Done { finish_reason, usage, stop_sequence }));
                    return;
                }
            }
        }
    };
    Ok(Box::pin(stream.inspect(move |item| {
        if let Err(e) = item {
            record_error(&span2, e);
        }
    })))
}

/// Marks a request's span failed, with the error's class.
pub(crate) fn record_error(span: &tracing::Span, e: &ApiError) {
    span.record("error.type", e.error_type.name());
    span.record("otel.status_code", "ERROR");
}

/// Files a `first_token_mismatch` report: decode's first token was not prefill's, so
/// decode computed from other KV than prefill sent.
fn report_data_loss(st: &AppState, ev: &Evidence, message: &str) {
    let mut i = pdmesh_incident::Incident::new(
        pdmesh_incident::Kind::FirstTokenMismatch,
        format!(
            "Request {} failed with DATA_LOSS: the decode worker's first token differs from \
             the one prefill sampled, so decode did not compute from the KV prefill sent \
             (pages damaged or misplaced in the hand-over). Nothing past the first token \
             was shown.",
            ev.request_id
        ),
        pdmesh_incident::Place {
            request_id: ev.request_id.clone(),
            trace_id: ev.trace_id.clone(),
            ..Default::default()
        },
    );
    i.details.insert("error".into(), message.to_owned());
    i.replay = Some(ev.replay());
    st.incident(i);
}

/// What an incident report about this generation says of its request.
struct Evidence {
    request_id: String,
    trace_id: String,
    /// The prompt's ids (only when reports are written).
    prompt: Vec<u32>,
    request: Option<axum::body::Bytes>,
}

impl Evidence {
    /// The replay part of a report: the body (parsed only now, when a report is filed)
    /// and the prompt's ids; the reporter keeps only its allowlist of them unless
    /// `--incident-include-prompts` (see `pdmesh_incident::redact`).
    fn replay(&self) -> pdmesh_incident::Replay {
        let body: serde_json::Value = self
            .request
            .as_deref()
            .and_then(|b| serde_json::from_slice(b).ok())
            .unwrap_or_default();
        pdmesh_incident::Replay {
            body,
            prompt_token_ids: self.prompt.clone(),
            command: String::new(),
        }
    }
}

/// Orders what one Detokenize answer completed into events: reasoning, content (through
/// the stop filter, `protect`ed from matching before min_tokens; `last` flushes it), then
/// tool calls. A parse failure is counted and becomes the generation's error.
fn split(
    st: &AppState,
    p: Parsed,
    (filter, ev): (&mut StopFilter, &Evidence),
    protect: bool,
    last: bool,
) -> Result<Vec<GenEvent>, ApiError> {
    if let Some(f) = p.failures.first() {
        for f in &p.failures {
            st.metrics.parse_failure(&f.parser, &f.reason);
        }
        let mut i = pdmesh_incident::Incident::new(
            pdmesh_incident::Kind::ToolParse,
            format!(
                "The model's output for request {} held {} markup that failed to parse ({}); \
                 the request ended with an error instead of showing the markup as content.",
                ev.request_id, f.parser, f.reason
            ),
            pdmesh_incident::Place {
                request_id: ev.request_id.clone(),
                trace_id: ev.trace_id.clone(),
                ..Default::default()
            },
        );
        i.details.insert("parser".into(), f.parser.clone());
        i.details.insert("reason".into(), f.reason.clone());
        i.details.insert("detail".into(), f.detail.clone());
        i.details.insert(
            "failures in this output".into(),
            p.failures.len().to_string(),
        );
        i.replay = Some(ev.replay());
        st.incident(i);
        return Err(ApiError::unparsable_output(&f.parser, &f.reason, &f.detail));
    }
    let mut out = Vec::new();
    if !p.reasoning.is_empty() {
        out.push(GenEvent::Reasoning(p.reasoning));
    }
    let mut text = filter.push(&p.text, protect);
    if last {
        text.push_str(&filter.finish());
    }
    if !text.is_empty() {
        out.push(GenEvent::Text(text));
    }
    out.extend(p.tool_calls.into_iter().map(GenEvent::ToolCall));
    Ok(out)
}

/// A whole response: content, reasoning and complete tool calls.
#[derive(Debug, Default)]
pub(crate) struct Collected {
    pub text: String,
    pub reasoning: String,
    /// `(id, name, arguments JSON)` in call order.
    pub tool_calls: Vec<(String, String, String)>,
    /// Every generated token's, when asked for.
    pub logprobs: Vec<LogprobEntry>,
    /// The prompt's tokens' from the second on, when asked for.
    pub prompt_logprobs: Vec<LogprobEntry>,
}

/// Drains a generation (the non-streaming responses).
pub(crate) async fn collect(mut stream: GenStream) -> Result<(Collected, Done), ApiError> {
    let mut c = Collected::default();
    while let Some(ev) = stream.next().await {
        match ev? {
            GenEvent::Prompt(e) => c.prompt_logprobs = e,
            GenEvent::Logprob(e) => c.logprobs.push(e),
            GenEvent::Text(t) => c.text.push_str(&t),
            GenEvent::Reasoning(t) => c.reasoning.push_str(&t),
            GenEvent::ToolCall(d) => {
                let i = d.index as usize;
                if c.tool_calls.len() <= i {
                    c.tool_calls.resize(i + 1, Default::default());
                }
                let call = &mut c.tool_calls[i];
                if !d.id.is_empty() {
                    call.0 = d.id;
                }
                if !d.name.is_empty() {
                    call.1 = d.name;
                }
                call.2.push_str(&d.arguments);
            }
            GenEvent::Done(d) => return Ok((c, d)),
        }
    }
    Err(ApiError::backend(
        "the generation ended without a finish reason",
    ))
}

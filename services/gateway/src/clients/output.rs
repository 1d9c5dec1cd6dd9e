//! What the worker's and the tokenizer's answers become: worker events from generated tokens,
//! and the detokenized text split into content, reasoning and tool calls (in this process
//! or by the tokenizer service).

use pdmesh_proto::tokenizer::v1 as tk;
use pdmesh_proto::worker::v1 as wk;

use pdmesh_tls::AuthChannel;
use tk::tokenizer_client::TokenizerClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use pdmesh_chat::ToolFormat;

use super::{Finish, FinishReason, TokenLogprob, WorkerEvent, tool_format_to_wire};
use crate::error::ApiError;
use crate::metrics::Stage;

/// A worker's message as events: a chunk may carry the prompt's logprobs before its tokens.
pub(super) fn convert_generate(msg: wk::GenerateResponse) -> Vec<Result<WorkerEvent, ApiError>> {
    let mut out = Vec::new();
    if let Some(wk::generate_response::Kind::Chunk(c)) = &msg.kind
        && !c.prompt_logprobs.is_empty()
    {
        out.push(Ok(WorkerEvent::Prompt(
            c.prompt_logprobs
                .iter()
                .map(|p| TokenLogprob {
                    token: p.token_id,
                    logprob: p.logprob,
                    top: p.top.iter().map(|t| (t.token_id, t.logprob)).collect(),
                })
                .collect(),
        )));
        if c.token_ids.is_empty() {
            return out;
        }
    }
    out.push(convert_one(msg));
    out
}

fn convert_one(msg: wk::GenerateResponse) -> Result<WorkerEvent, ApiError> {
    match msg.kind {
        Some(wk::generate_response::Kind::Chunk(c)) => {
            let lp = match (c.logprob, c.token_ids.last()) {
                (Some(logprob), Some(&token)) => Some(TokenLogprob {
                    token,
                    logprob,
                    top: c
                        .top_logprobs
                        .iter()
                        .map(|t| (t.token_id, t.logprob))
                        .collect(),
                }),
                _ => None,
            };
            Ok(WorkerEvent::Tokens(c.token_ids, lp))
        }
        Some(wk::generate_response::Kind::Finished(f)) => {
            let reason = match wk::FinishReason::try_from(f.reason) {
                Ok(wk::FinishReason::Stop) => FinishReason::Stop,
                Ok(wk::FinishReason::Length) => FinishReason::Length,
                Ok(wk::FinishReason::Abort) => FinishReason::Abort,
                _ => {
                    return Err(ApiError::backend(format!(
                        "the worker sent an unknown finish reason {}",
                        f.reason
                    )));
                }
            };
            let matched_stop = if f.matched_stop.is_empty() {
                None
            } else {
                Some(String::from_utf8_lossy(&f.matched_stop).into_owned())
            };
            Ok(WorkerEvent::Finished(Finish {
                reason,
                matched_stop,
                prompt_tokens: f.prompt_tokens,
                completion_tokens: f.completion_tokens,
                cached_tokens: f.cached_tokens,
                host_cached_tokens: f.host_cached_tokens,
                transferred_tokens: f.transferred_tokens,
                stages: {
                    let t = f.stages.unwrap_or_default();
                    [
                        (Stage::Queue, t.queue_seconds),
                        (Stage::Prefill, t.prefill_seconds),
                        (Stage::Transfer, t.transfer_seconds),
                        (Stage::Decode, t.decode_seconds),
                    ]
                },
            }))
        }
        None => Err(ApiError::backend(
            "the worker sent an empty Generate message",
        )),
    }
}

/// How a chat response's text is split (the tokenizer runs the parsers).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Parsing {
    /// Tool calls in this markup are parsed out (`None`: no tool-call parsing).
    pub tool_format: Option<ToolFormat>,
    /// Calls to other names are parse failures.
    pub tool_names: Vec<String>,
    pub reasoning: bool,
    /// The prompt opened `<think>`: the output starts as reasoning.
    pub thinking: bool,
    pub call_id_prefix: String,
}

/// What a batch of ids completed: content, reasoning, tool-call deltas and parse failures.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Parsed {
    pub text: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCallDelta>,
    pub failures: Vec<ParseFailure>,
}

/// One piece of a tool call: the first carries id and name, later ones argument JSON.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ToolCallDelta {
    pub index: u32,
    pub id: String,
    pub name: String,
    pub arguments: String,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ParseFailure {
    pub parser: String,
    pub reason: String,
    pub detail: String,
}

fn parsed(r: tk::DetokenizeResponse) -> Parsed {
    Parsed {
        text: r.text,
        reasoning: r.reasoning,
        tool_calls: r
            .tool_calls
            .into_iter()
            .map(|c| ToolCallDelta {
                index: c.index,
                id: c.id,
                name: c.name,
                arguments: c.arguments,
            })
            .collect(),
        failures: r
            .failures
            .into_iter()
            .map(|f| ParseFailure {
                parser: f.parser,
                reason: f.reason,
                detail: f.detail,
            })
            .collect(),
    }
}

/// The parser the tokenizer service would build for `p` (none for plain text).
pub(super) fn output_parser(p: &Parsing) -> Option<pdmesh_chat::OutputParser> {
    pdmesh_chat::OutputParser::for_output(
        p.tool_format,
        p.reasoning,
        p.thinking,
        &p.tool_names,
        &p.call_id_prefix,
    )
}

/// Deltas as one [`Parsed`], as the tokenizer service answers them: content and reasoning
/// each concatenated, calls and failures in order.
fn parsed_deltas(deltas: Vec<pdmesh_chat::Delta>) -> Parsed {
    use pdmesh_chat::Delta;
    let mut p = Parsed::default();
    for d in deltas {
        match d {
            Delta::Content(t) => p.text.push_str(&t),
            Delta::Reasoning(t) => p.reasoning.push_str(&t),
            Delta::ToolCall {
                index,
                id,
                name,
                arguments,
            } => p.tool_calls.push(ToolCallDelta {
                index: u32::try_from(index).unwrap_or(u32::MAX),
                id: id.unwrap_or_default(),
                name: name.unwrap_or_default(),
                arguments,
            }),
            Delta::Error(e) => {
                tracing::warn!(parser = e.parser, reason = e.reason, detail = %e.detail, "model output failed to parse");
                p.failures.push(ParseFailure {
                    parser: e.parser.into(),
                    reason: e.reason.into(),
                    detail: e.detail,
                });
            }
        }
    }
    p
}

/// One generation's detokenization: in process (`local`), or one Detokenize stream where
/// each `push` sends ids and returns what they completed.
pub(crate) struct Detokenizer {
    pub(super) local: Option<pdmesh_chat::TextStream>,
    /// Some ids were pushed (a stream that saw none ends with nothing, as a Detokenize
    /// call never opened).
    pub(super) pushed: bool,
    pub(super) client: TokenizerClient<AuthChannel>,
    pub(super) session: Option<(
        mpsc::Sender<tk::DetokenizeRequest>,
        tonic::Streaming<tk::DetokenizeResponse>,
    )>,
    pub(super) parsing: Option<Parsing>,
    /// The request's span, whose trace the Detokenize call joins (the stream is polled
    /// outside it).
    pub(super) span: tracing::Span,
}

impl Detokenizer {
    /// Whether the text is made in this process.
    pub fn is_local(&self) -> bool {
        self.local.is_some()
    }

    pub async fn push(&mut self, ids: Vec<u32>) -> Result<Parsed, ApiError> {
        self.pushed = true;
        if let Some(s) = &mut self.local {
            // The worker sent an id outside the vocabulary: a backend fault, as the
            // tokenizer service's INVALID_ARGUMENT would be.
            return s
                .push(&ids)
                .map(parsed_deltas)
                .map_err(|e| ApiError::backend(format!("the worker sent {e}")));
        }
        let parsing = self
            .session
            .is_none()
            .then_some(self.parsing.as_ref())
            .flatten()
            .map(|p| tk::OutputParsing {
                tool_format: tool_format_to_wire(p.tool_format).into(),
                tool_names: p.tool_names.clone(),
                reasoning: p.reasoning,
                thinking: p.thinking,
                call_id_prefix: p.call_id_prefix.clone(),
            });
        let msg = tk::DetokenizeRequest {
            ids,
            skip_special_tokens: true,
            parsing,
            truncated: false,
        };
        let rx = match &mut self.session {
            Some((tx, rx)) => {
                tx.send(msg)
                    .await
                    .map_err(|_| ApiError::backend("the tokenizer closed the detokenize stream"))?;
                rx
            }
            None => {
                // Queue the first message before opening the call, so it does not matter
                // whether the server answers headers before it reads a message.
                let (tx, rx) = mpsc::channel(16);
                tx.try_send(msg)
                    .map_err(|_| ApiError::backend("detokenize queue full"))?;
                let mut call = tonic::Request::new(ReceiverStream::new(rx));
                pdmesh_telemetry::inject_from(&self.span, &mut call);
                let inbound = self.client.clone().detokenize(call).await?.into_inner();
                &mut self.session.insert((tx, inbound)).1
            }
        };
        match rx.message().await? {
            Some(r) => Ok(parsed(r)),
            None => Err(ApiError::backend(
                "the tokenizer ended the detokenize stream early",
            )),
        }
    }

    /// Ends the stream and returns whatever the tokenizer still held back. `truncated`:
    /// the generation stopped at its length limit, so unfinished markup is dropped and
    /// the calls before it kept; otherwise an open block that never closed is a failure.
    pub async fn finish(&mut self, truncated: bool) -> Result<Parsed, ApiError> {
        if let Some(s) = self.local.take() {
            return Ok(if self.pushed {
                parsed_deltas(s.finish(truncated))
            } else {
                Parsed::default()
            });
        }
        let Some((tx, mut rx)) = self.session.take() else {
            return Ok(Parsed::default());
        };
        if truncated {
            let last = tk::DetokenizeRequest {
                truncated,
                ..Default::default()
            };
            tx.send(last)
                .await
                .map_err(|_| ApiError::backend("the tokenizer closed the detokenize stream"))?;
        }
        drop(tx);
        let mut rest = Parsed::default();
        while let Some(r) = rx.message().await? {
            let p = parsed(r);
            rest.text.push_str(&p.text);
            rest.reasoning.push_str(&p.reasoning);
            rest.tool_calls.extend(p.tool_calls);
            rest.failures.extend(p.failures);
        }
        Ok(rest)
    }
}

/// Adds one host's cache state to `sum`.
pub(super) fn add_stats(
    sum: &mut pdmesh_proto::cache::v1::StatsResponse,
    s: pdmesh_proto::cache::v1::StatsResponse,
) {
    fn add<K: Ord + std::hash::Hash + Eq, V: std::ops::AddAssign + Default>(
        into: &mut std::collections::HashMap<K, V>,
        from: std::collections::HashMap<K, V>,
    ) {
        for (k, v) in from {
            *into.entry(k).or_default() += v;
        }
    }
    sum.total_pages += s.total_pages;
    sum.used_pages += s.used_pages;
    sum.pinned_pages += s.pinned_pages;
    sum.leases += s.leases;
    sum.evicted_pages += s.evicted_pages;
    sum.checksum_failures += s.checksum_failures;
    sum.expired_leases += s.expired_leases;
    if sum.layout.is_empty() {
        sum.layout = s.layout;
    }
    add(&mut sum.rooms, s.rooms);
    for (k, v) in s.oldest_room_seconds {
        let e = sum.oldest_room_seconds.entry(k).or_default();
        *e = e.max(v);
    }
    add(&mut sum.room_timeouts, s.room_timeouts);
    add(&mut sum.room_aborts, s.room_aborts);
    add(&mut sum.incidents, s.incidents);
    sum.rooms_finished += s.rooms_finished;
    sum.transfer_pages += s.transfer_pages;
    sum.transfer_bytes += s.transfer_bytes;
    sum.room_slots += s.room_slots;
    sum.quarantined_slots += s.quarantined_slots;
    sum.room_stalls += s.room_stalls;
    sum.late_writes_rejected += s.late_writes_rejected;
    add(&mut sum.rooms_older_than, s.rooms_older_than);
    sum.peer_layout_refusals += s.peer_layout_refusals;
    sum.peer_pages_received += s.peer_pages_received;
    sum.peer_bytes_received += s.peer_bytes_received;
    sum.peer_pages_sent += s.peer_pages_sent;
    sum.peer_bytes_sent += s.peer_bytes_sent;
    sum.peer_transfer_failures += s.peer_transfer_failures;
    sum.auth_refused += s.auth_refused;
    sum.insecure_plaintext |= s.insecure_plaintext;
    sum.held_pages_skipped += s.held_pages_skipped;
    if let Some(d) = &s.disk {
        crate::metrics::disk::add_disk(sum.disk.get_or_insert_default(), d);
    }
}

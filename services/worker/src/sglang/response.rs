//! pdmesh's answers in SGLang's form: the token stream as SGLang's chunks and `complete`
//! (with output and input logprobs), and JSON values as protobuf ones for the info RPCs.

use std::pin::Pin;

use futures::{Stream, StreamExt};
use pdmesh_proto::sglang::grpc::scheduler as s;
use pdmesh_proto::worker::v1 as pb;
use tonic::Status;

/// Turns pdmesh's token stream into SGLang's: with `stream`, a chunk per token (counts
/// cumulative) and, at the end, `complete` repeating the last chunk's tokens as SGLang
/// does; without, one `complete` with every token.
pub(super) fn responses(
    (request_id, index): (String, u32),
    prompt: Prompt,
    stream: bool,
    logprobs: bool,
    mut inner: Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>,
) -> impl Stream<Item = Result<s::GenerateResponse, Status>> + Send {
    let (prompt_len, ids, start) = (prompt.len, prompt.ids, prompt.logprob_start);
    async_stream::stream! {
        // SGLang's input_logprobs: the prompt's from `start` (the first token has none).
        let mut input: Option<s::InputLogProbs> = None;
        let (mut all, mut all_lp, mut last) = (Vec::<u32>::new(), Vec::<f32>::new(), Vec::<u32>::new());
        let mut last_lp = Vec::<f32>::new();
        // Per position, its alternatives (when top_logprobs_num asked for some).
        let (mut all_top, mut last_top) = (Vec::<s::TopLogProbs>::new(), Vec::<s::TopLogProbs>::new());
        let lp = |ids: &[u32], vals: &[f32], tops: &[s::TopLogProbs]| {
            logprobs.then(|| s::OutputLogProbs {
                token_logprobs: vals.to_vec(),
                token_ids: ids.to_vec(),
                top_logprobs: tops.to_vec(),
                ..Default::default()
            })
        };
        while let Some(item) = inner.next().await {
            let msg = match item {
                Ok(m) => m,
                Err(status) => {
                    yield Err(status);
                    return;
                }
            };
            match msg.kind {
                Some(pb::generate_response::Kind::Chunk(ch)) if ch.token_ids.is_empty() => {
                    if let Some(start) = start {
                        input = Some(input_logprobs(&ids, &ch.prompt_logprobs, start));
                    }
                }
                Some(pb::generate_response::Kind::Chunk(ch)) => {
                    all.extend(&ch.token_ids);
                    let vals: Vec<f32> = ch.logprob.into_iter().collect();
                    all_lp.extend(&vals);
                    let tops: Vec<s::TopLogProbs> = if ch.top_logprobs.is_empty() {
                        Vec::new()
                    } else {
                        vec![s::TopLogProbs {
                            values: ch.top_logprobs.iter().map(|t| t.logprob).collect(),
                            token_ids: ch.top_logprobs.iter().map(|t| t.token_id).collect(),
                        }]
                    };
                    all_top.extend(tops.iter().cloned());
                    if stream {
                        yield Ok(s::GenerateResponse {
                            request_id: request_id.clone(),
                            response: Some(s::generate_response::Response::Chunk(s::GenerateStreamChunk {
                                token_ids: ch.token_ids.clone(),
                                prompt_tokens: prompt_len,
                                completion_tokens: all.len() as u32,
                                output_logprobs: lp(&ch.token_ids, &vals, &tops),
                                index,
                                ..Default::default()
                            })),
                        });
                    }
                    last = ch.token_ids;
                    last_lp = vals;
                    last_top = tops;
                }
                Some(pb::generate_response::Kind::Finished(f)) => {
                    let finish_reason = match pb::FinishReason::try_from(f.reason) {
                        Ok(pb::FinishReason::Length) => "length",
                        Ok(pb::FinishReason::Abort) => "abort",
                        _ => "stop",
                    };
                    let matched_stop = match (f.matched_token, f.matched_stop.is_empty()) {
                        (Some(t), _) => Some(s::generate_complete::MatchedStop::MatchedTokenId(t)),
                        (None, false) => Some(s::generate_complete::MatchedStop::MatchedStopStr(
                            String::from_utf8_lossy(&f.matched_stop).into_owned(),
                        )),
                        (None, true) => None,
                    };
                    let (ids, vals, tops) = if stream {
                        (&last, &last_lp, &last_top)
                    } else {
                        (&all, &all_lp, &all_top)
                    };
                    yield Ok(s::GenerateResponse {
                        request_id: request_id.clone(),
                        response: Some(s::generate_response::Response::Complete(s::GenerateComplete {
                            output_ids: ids.clone(),
                            finish_reason: finish_reason.into(),
                            prompt_tokens: if f.prompt_tokens > 0 { f.prompt_tokens } else { prompt_len },
                            completion_tokens: f.completion_tokens,
                            cached_tokens: f.cached_tokens,
                            output_logprobs: lp(ids, vals, tops),
                            input_logprobs: input.take(),
                            matched_stop,
                            index,
                            ..Default::default()
                        })),
                    });
                    return;
                }
                None => {
                    yield Err(Status::internal("the engine sent an empty message"));
                    return;
                }
            }
        }
        yield Err(Status::internal("the generation ended without a finish"));
    }
}

/// What [`responses`] needs of the prompt: its length, and for input logprobs its ids and
/// the first position reported.
#[derive(Clone)]
pub(super) struct Prompt {
    pub(super) len: u32,
    pub(super) ids: Vec<u32>,
    pub(super) logprob_start: Option<usize>,
}

/// SGLang's input logprobs of `ids[start..]` from pdmesh's prompt logprobs (of `ids[1..]`).
fn input_logprobs(ids: &[u32], lps: &[pb::PromptLogprob], start: usize) -> s::InputLogProbs {
    let start = start.min(ids.len());
    let at = |i: usize| i.checked_sub(1).and_then(|j| lps.get(j));
    s::InputLogProbs {
        token_logprobs: (start..ids.len())
            .map(|i| s::InputTokenLogProb {
                value: at(i).map(|l| l.logprob),
            })
            .collect(),
        token_ids: ids[start..].to_vec(),
        top_logprobs: (start..ids.len())
            .map(|i| s::TopLogProbs {
                values: at(i).map_or_else(Vec::new, |l| l.top.iter().map(|t| t.logprob).collect()),
                token_ids: at(i)
                    .map_or_else(Vec::new, |l| l.top.iter().map(|t| t.token_id).collect()),
            })
            .collect(),
    }
}

/// A JSON value as a protobuf `Value`.
fn pvalue(v: serde_json::Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match v {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        serde_json::Value::String(s) => Kind::StringValue(s),
        serde_json::Value::Array(a) => Kind::ListValue(prost_types::ListValue {
            values: a.into_iter().map(pvalue).collect(),
        }),
        serde_json::Value::Object(o) => Kind::StructValue(pstruct(o)),
    };
    prost_types::Value { kind: Some(kind) }
}

pub(super) fn pstruct(o: serde_json::Map<String, serde_json::Value>) -> prost_types::Struct {
    prost_types::Struct {
        fields: o.into_iter().map(|(k, v)| (k, pvalue(v))).collect(),
    }
}

pub(super) fn i32_of(n: u32) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

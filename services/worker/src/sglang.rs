//! `sglang.grpc.scheduler.SglangScheduler`, served beside `pdmesh.worker.v1` on the same
//! port, so gateways built for SGLang and vLLM workers (smg) drive pdmesh workers in
//! token ids. Every call is translated to the pdmesh service's own: the same admission,
//! watchdog, rooms and engine. Like `grpc.rs`, this is an ingress module: prost types stop
//! here.
//!
//! proto3 zero values are read as SGLang reads them where a zero is meaningful
//! (temperature 0 is greedy) and as "unset" where it is not (top_p 0, top_k 0,
//! repetition_penalty 0); features pdmesh does not have (n > 1, chosen ids' logprobs,
//! hidden states, embeddings, EBNF grammars, multimodal input) are INVALID_ARGUMENT
//! naming the field, never silently dropped.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use futures::{Stream, StreamExt};
use pdmesh_proto::cache::v1 as cpb;
use pdmesh_proto::sglang::grpc::scheduler as s;
use pdmesh_proto::smg::grpc::common as c;
use pdmesh_proto::worker::v1 as pb;
use pdmesh_proto::worker::v1::worker_server::Worker;
use tonic::{Request, Response, Status};

use crate::bundle::{self, TokenizerBundle};
use crate::grpc::WorkerService;
use crate::pd::Role;

/// Bytes per `GetTokenizer` chunk.
const TOKENIZER_CHUNK: usize = 1 << 20;

/// The SGLang face of one worker.
pub(crate) struct SglangService {
    worker: Arc<WorkerService>,
    model: PathBuf,
    bundle_dir: PathBuf,
    bundle: tokio::sync::OnceCell<TokenizerBundle>,
    role: Role,
    started: SystemTime,
    /// Requests with `n` > 1 running now: their choices run as `{id}-{i}`, so Abort of
    /// `id` aborts each.
    groups: Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>,
}

/// Most choices one request may ask for (`sampling_params.n`), as at the gateway.
const MAX_CHOICES: u32 = 16;

/// Forgets a running `n` > 1 request when its stream ends.
struct GroupEntry {
    groups: Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>,
    id: String,
}

impl Drop for GroupEntry {
    fn drop(&mut self) {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}

impl SglangService {
    pub(crate) fn new(worker: Arc<WorkerService>, model: PathBuf, role: Role) -> Self {
        Self {
            bundle_dir: bundle::default_dir(&model),
            worker,
            model,
            bundle: tokio::sync::OnceCell::new(),
            role,
            started: SystemTime::now(),
            groups: Default::default(),
        }
    }

    async fn info(&self) -> Result<pb::ModelInfoResponse, Status> {
        Ok(self
            .worker
            .model_info(Request::new(pb::ModelInfoRequest {}))
            .await?
            .into_inner())
    }

    /// The tokenizer directory and zip, written on first need (off the async threads).
    async fn bundle(&self) -> Result<&TokenizerBundle, Status> {
        self.bundle
            .get_or_try_init(|| async {
                let info = self.info().await?;
                let (model, dir) = (self.model.clone(), self.bundle_dir.clone());
                let facts = pdmesh_engine::ModelInfo {
                    model_id: info.model_id,
                    context_length: info.context_length,
                    vocab_size: info.vocab_size,
                    eos_token_ids: info.eos_token_ids,
                    kv_layout: info.kv_layout,
                    kv_layout_fingerprint: info.kv_layout_fingerprint,
                    page_size: info.page_size,
                    total_pages: info.total_pages,
                    max_batch: info.max_batch,
                };
                tokio::task::spawn_blocking(move || bundle::build(&model, &dir, &facts))
                    .await
                    .map_err(|e| Status::internal(format!("tokenizer bundle task: {e}")))?
                    .map_err(|e| Status::internal(e.to_string()))
            })
            .await
    }

    fn disaggregation_mode(&self) -> &'static str {
        match self.role {
            Role::Unified => "null",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

fn invalid(field: &str, msg: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {msg}"))
}

/// A Lark grammar for a JSON schema, as pdmesh's gateway builds one: strict (an object
/// schema silent on `additionalProperties` takes only the properties it names, SGLang's
/// default too) and compact.
fn json_schema_grammar(schema: &str) -> Result<String, Status> {
    let v: serde_json::Value = serde_json::from_str(schema)
        .map_err(|e| invalid("sampling_params.json_schema", format!("not JSON: {e}")))?;
    // The rewrite has a step budget, so this stays short on the async runtime.
    let rule = pdmesh_chat::schema::json_rule(&v)
        .map_err(|e| invalid("sampling_params.json_schema", e))?;
    Ok(format!("start: {rule}\n"))
}

/// SGLang sampling parameters → pdmesh's. `None` means the proto's zero values.
fn sampling(p: Option<s::SamplingParams>) -> Result<pb::SamplingParams, Status> {
    let p = p.unwrap_or_default();
    if p.n > MAX_CHOICES {
        return Err(invalid(
            "sampling_params.n",
            format!("at most {MAX_CHOICES} choices per request (got {})", p.n),
        ));
    }
    // Token ids as decimal strings (SGLang's JSON-born map keys).
    let logit_bias = p
        .logit_bias
        .iter()
        .map(|(k, &v)| match k.parse::<u32>() {
            Ok(t) => Ok((t, v)),
            Err(_) => Err(invalid(
                "sampling_params.logit_bias",
                format!("keys are token ids, not {k:?}"),
            )),
        })
        .collect::<Result<_, _>>()?;
    let max_tokens = match p.max_new_tokens {
        None => 0,
        Some(0) => {
            return Err(invalid(
                "sampling_params.max_new_tokens",
                "0 (prompt scoring only) is not supported; ask for at least 1 token",
            ));
        }
        Some(n) => n,
    };
    let grammar = match p.constraint {
        None => String::new(),
        Some(s::sampling_params::Constraint::JsonSchema(js)) => json_schema_grammar(&js)?,
        Some(s::sampling_params::Constraint::Regex(rx)) => {
            // A Lark regex literal: `/` inside it is escaped.
            format!("start: /{}/\n", rx.replace('/', "\\/"))
        }
        Some(s::sampling_params::Constraint::EbnfGrammar(_)) => {
            return Err(invalid(
                "sampling_params.ebnf_grammar",
                "is not supported; use json_schema or regex",
            ));
        }
        Some(s::sampling_params::Constraint::StructuralTag(_)) => {
            return Err(invalid(
                "sampling_params.structural_tag",
                "is not supported; use json_schema or regex",
            ));
        }
    };
    Ok(pb::SamplingParams {
        temperature: Some(p.temperature),
        top_p: (p.top_p > 0.0).then_some(p.top_p),
        top_k: (p.top_k > 0).then_some(p.top_k),
        min_p: Some(p.min_p),
        frequency_penalty: p.frequency_penalty,
        presence_penalty: p.presence_penalty,
        repetition_penalty: (p.repetition_penalty > 0.0).then_some(p.repetition_penalty),
        seed: None,
        max_tokens,
        stop: p.stop.into_iter().map(String::into_bytes).collect(),
        stop_token_ids: p.stop_token_ids,
        ignore_eos: p.ignore_eos,
        logprobs: false,
        top_logprobs: 0,
        logit_bias,
        min_tokens: p.min_new_tokens,
        grammar,
        prompt_logprobs: None,
    })
}

/// SGLang's 32-bit bootstrap room as a pdmesh room: never 0 (SGLang's room 0 is a room;
/// pdmesh's 0 is "none"), the same on the prefill and the decode side.
fn room(bootstrap_room: i32) -> u64 {
    (1 << 32) | u64::from(bootstrap_room as u32)
}

/// The pdmesh request for an SGLang one; `role` decides whether rooms apply.
fn generate_request(r: s::GenerateRequest, role: Role) -> Result<pb::GenerateRequest, Status> {
    let Some(tokenized) = r.tokenized else {
        return Err(invalid(
            "tokenized",
            "input must be token ids (`tokenized.input_ids`)",
        ));
    };
    if r.mm_inputs.is_some() {
        return Err(invalid("mm_inputs", "this model takes text only"));
    }
    if !r.input_embeds.is_empty() {
        return Err(invalid("input_embeds", "is not supported"));
    }
    if r.return_hidden_states {
        return Err(invalid("return_hidden_states", "is not supported"));
    }
    if !r.token_ids_logprob.is_empty() {
        return Err(invalid(
            "token_ids_logprob",
            "the logprobs of chosen ids are not returned; use top_logprobs_num",
        ));
    }
    if !(0..=pdmesh_engine::MAX_TOP_LOGPROBS as i32).contains(&r.top_logprobs_num) {
        return Err(invalid(
            "top_logprobs_num",
            format!(
                "must be between 0 and {} (got {})",
                pdmesh_engine::MAX_TOP_LOGPROBS,
                r.top_logprobs_num
            ),
        ));
    }
    if !r.lora_id.is_empty() {
        return Err(invalid("lora_id", "LoRA adapters are not supported"));
    }
    let mut sampling = sampling(r.sampling_params)?;
    sampling.logprobs = r.return_logprob;
    // SGLang's input logprobs: from logprob_start_len on (-1: none).
    if r.return_logprob && r.logprob_start_len >= 0 {
        sampling.prompt_logprobs = Some(r.top_logprobs_num as u32);
    }
    sampling.top_logprobs = if r.return_logprob {
        r.top_logprobs_num as u32
    } else {
        0
    };
    let room = match (role, r.disaggregated_params) {
        (Role::Unified, _) | (_, None) => 0,
        (_, Some(d)) => room(d.bootstrap_room),
    };
    Ok(pb::GenerateRequest {
        request_id: r.request_id,
        input_ids: tokenized.input_ids,
        sampling: Some(sampling),
        room,
        trace_id: String::new(),
        kv_home: String::new(),
        prompt_group: String::new(),
        prompt_group_size: 0,
        // SGLang's GenerateRequest has no salt.
        cache_salt: None,
    })
}

/// Turns pdmesh's token stream into SGLang's: with `stream`, a chunk per token (counts
/// cumulative) and, at the end, `complete` repeating the last chunk's tokens as SGLang
/// does; without, one `complete` with every token.
fn responses(
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
struct Prompt {
    len: u32,
    ids: Vec<u32>,
    logprob_start: Option<usize>,
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

fn pstruct(o: serde_json::Map<String, serde_json::Value>) -> prost_types::Struct {
    prost_types::Struct {
        fields: o.into_iter().map(|(k, v)| (k, pvalue(v))).collect(),
    }
}

fn i32_of(n: u32) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<s::GenerateResponse, Status>> + Send>>;
type TokenizerStream = Pin<Box<dyn Stream<Item = Result<c::GetTokenizerChunk, Status>> + Send>>;
type KvStream = Pin<Box<dyn Stream<Item = Result<c::KvEventBatch, Status>> + Send>>;

/// Who may call each SGLang scheduler RPC over mutual TLS: a gateway (smg, or anything
/// holding a gateway's certificate); any member may ask the health check.
pub static POLICY: pdmesh_tls::Policy = {
    use pdmesh_tls::Roles;
    const G: Roles = Roles::GATEWAY;
    pdmesh_tls::Policy {
        service: "sglang.grpc.scheduler.SglangScheduler",
        methods: &[
            ("Generate", G),
            ("Embed", G),
            ("HealthCheck", Roles::ANY),
            ("Abort", G),
            ("GetModelInfo", G),
            ("GetServerInfo", G),
            ("GetLoads", G),
            ("FlushCache", G),
            ("GetTokenizer", G),
            ("SubscribeKvEvents", G),
        ],
    }
};

#[tonic::async_trait]
impl s::sglang_scheduler_server::SglangScheduler for SglangService {
    type GenerateStream = GenerateStream;
    type GetTokenizerStream = TokenizerStream;
    type SubscribeKvEventsStream = KvStream;

    #[tracing::instrument(skip_all, fields(request_id = %request.get_ref().request_id, api = "sglang"))]
    async fn generate(
        &self,
        request: Request<s::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let r = request.into_inner();
        let (id, stream) = (r.request_id.clone(), r.stream);
        let logprobs = r.return_logprob;
        let n = r.sampling_params.as_ref().map_or(1, |p| p.n.max(1));
        let logprob_start =
            (r.return_logprob && r.logprob_start_len >= 0).then_some(r.logprob_start_len as usize);
        let req = generate_request(r, self.role)?;
        let prompt = Prompt {
            len: u32::try_from(req.input_ids.len()).unwrap_or(u32::MAX),
            ids: if logprob_start.is_some() {
                req.input_ids.clone()
            } else {
                Vec::new()
            },
            logprob_start,
        };
        if n == 1 {
            let inner = self.worker.generate(Request::new(req)).await?.into_inner();
            return Ok(Response::new(Box::pin(responses(
                (id, 0),
                prompt,
                stream,
                logprobs,
                inner,
            ))));
        }
        if self.role != Role::Unified {
            // Each choice would need its own bootstrap room from the client.
            return Err(invalid(
                "sampling_params.n",
                "n > 1 is served by unified workers; a prefill or decode worker takes one choice per room",
            ));
        }
        // The choices as requests `{id}-{i}` of one prompt group (the prompt computed
        // once), choice i seeded with seed + i, their messages tagged with their index.
        let seed = req
            .sampling
            .as_ref()
            .and_then(|p| p.seed)
            .unwrap_or_else(|| uuid::Uuid::new_v4().as_u64_pair().0);
        let entry = GroupEntry {
            groups: self.groups.clone(),
            id: id.clone(),
        };
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.clone(), n);
        let mut choices = Vec::with_capacity(n as usize);
        for i in 0..n {
            let mut ri = req.clone();
            ri.request_id = format!("{id}-{i}");
            ri.prompt_group = id.clone();
            ri.prompt_group_size = n;
            if let Some(p) = &mut ri.sampling {
                p.seed = Some(seed.wrapping_add(u64::from(i)));
            }
            // Dropping those already started (on an error) aborts them.
            let inner = self.worker.generate(Request::new(ri)).await?.into_inner();
            choices.push(Box::pin(responses(
                (id.clone(), i),
                prompt.clone(),
                stream,
                logprobs,
                inner,
            )));
        }
        let mut merged = futures::stream::select_all(choices);
        Ok(Response::new(Box::pin(async_stream::stream! {
            let _entry = entry;
            while let Some(item) = merged.next().await {
                let failed = item.is_err();
                yield item;
                if failed {
                    return;
                }
            }
        })))
    }

    async fn embed(
        &self,
        _request: Request<s::EmbedRequest>,
    ) -> Result<Response<s::EmbedResponse>, Status> {
        Err(Status::unimplemented(
            "pdmesh workers serve generative models; Embed is not available",
        ))
    }

    async fn health_check(
        &self,
        _request: Request<s::HealthCheckRequest>,
    ) -> Result<Response<s::HealthCheckResponse>, Status> {
        let ok = self
            .worker
            .health(Request::new(pb::HealthRequest {}))
            .await?
            .into_inner()
            .ok;
        Ok(Response::new(s::HealthCheckResponse {
            healthy: ok,
            message: if ok {
                "healthy".into()
            } else {
                "the engine is not serving (loading, stalled or disconnected)".into()
            },
        }))
    }

    async fn abort(
        &self,
        request: Request<s::AbortRequest>,
    ) -> Result<Response<s::AbortResponse>, Status> {
        let id = request.into_inner().request_id;
        let n = self
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .copied();
        let ids = match n {
            Some(n) => (0..n).map(|i| format!("{id}-{i}")).collect(),
            None => vec![id.clone()],
        };
        let mut found = false;
        for request_id in ids {
            found |= self
                .worker
                .abort(Request::new(pb::AbortRequest { request_id }))
                .await?
                .into_inner()
                .found;
        }
        Ok(Response::new(s::AbortResponse {
            success: found,
            message: format!(
                "request {id:?} {}",
                if found { "aborted" } else { "not found" }
            ),
        }))
    }

    async fn get_model_info(
        &self,
        _request: Request<s::GetModelInfoRequest>,
    ) -> Result<Response<s::GetModelInfoResponse>, Status> {
        let info = self.info().await?;
        let b = self.bundle().await?;
        let config: serde_json::Value = std::fs::read(b.dir.join("config.json"))
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default();
        let strings = |key: &str| -> Vec<String> {
            config[key]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default()
        };
        let id = |key: &str| config[key].as_i64().and_then(|v| i32::try_from(v).ok());
        Ok(Response::new(s::GetModelInfoResponse {
            model_path: self.model.to_string_lossy().into_owned(),
            tokenizer_path: b.dir.to_string_lossy().into_owned(),
            is_generation: true,
            served_model_name: info.model_id,
            max_context_length: i32_of(info.context_length),
            vocab_size: i32_of(info.vocab_size),
            model_type: config["model_type"].as_str().unwrap_or_default().to_owned(),
            architectures: strings("architectures"),
            eos_token_ids: info.eos_token_ids.into_iter().map(i32_of).collect(),
            pad_token_id: id("pad_token_id").unwrap_or(0),
            bos_token_id: id("bos_token_id").unwrap_or(0),
            max_req_input_len: i32_of(info.context_length.saturating_sub(1)),
            ..Default::default()
        }))
    }

    async fn get_server_info(
        &self,
        _request: Request<s::GetServerInfoRequest>,
    ) -> Result<Response<s::GetServerInfoResponse>, Status> {
        let info = self.info().await?;
        let tokens = u64::from(info.total_pages) * u64::from(info.page_size);
        let args = serde_json::json!({
            "model_path": self.model.to_string_lossy(),
            "tokenizer_path": self.bundle_dir.to_string_lossy(),
            "served_model_name": info.model_id,
            "disaggregation_mode": self.disaggregation_mode(),
            "max_running_requests": info.max_batch,
            "dp_size": 1,
            "tp_size": 1,
            "context_length": info.context_length,
            "page_size": info.page_size,
            "max_total_tokens": tokens,
            "load_balance_method": "round_robin",
        });
        let scheduler = serde_json::json!({
            "is_generation": true,
            "max_total_num_tokens": tokens,
            "max_req_input_len": info.context_length.saturating_sub(1),
        });
        let (serde_json::Value::Object(args), serde_json::Value::Object(scheduler)) =
            (args, scheduler)
        else {
            unreachable!("json! of an object literal");
        };
        let since = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap_or_default();
        let started = since(self.started);
        Ok(Response::new(s::GetServerInfoResponse {
            server_args: Some(pstruct(args)),
            scheduler_info: Some(pstruct(scheduler)),
            active_requests: i32_of(info.running_requests + info.waiting_requests),
            is_paused: false,
            last_receive_timestamp: 0.0,
            uptime_seconds: self.started.elapsed().unwrap_or_default().as_secs_f64(),
            sglang_version: format!("pdmesh-{}", env!("CARGO_PKG_VERSION")),
            server_type: "grpc".into(),
            start_time: Some(prost_types::Timestamp {
                seconds: started.as_secs() as i64,
                nanos: started.subsec_nanos() as i32,
            }),
            max_total_num_tokens: i32::try_from(tokens).unwrap_or(i32::MAX),
        }))
    }

    async fn get_loads(
        &self,
        request: Request<s::GetLoadsRequest>,
    ) -> Result<Response<s::GetLoadsResponse>, Status> {
        if let Some(rank) = request.get_ref().dp_rank
            && rank != 0
        {
            return Err(invalid(
                "dp_rank",
                format!("this worker has rank 0 only, not {rank}"),
            ));
        }
        let info = self.info().await?;
        let page = u64::from(info.page_size);
        let total = u64::from(info.total_pages) * page;
        // Pages cached but unreferenced are free to take: "used" is what requests hold.
        let used = u64::from(
            info.total_pages
                .saturating_sub(info.free_pages)
                .saturating_sub(info.cached_pages),
        ) * page;
        let usage = if total > 0 {
            used as f64 / total as f64
        } else {
            0.0
        };
        let (running, waiting) = (
            i32_of(info.running_requests),
            i32_of(info.waiting_requests + info.reserved_requests),
        );
        let load = s::SchedulerLoad {
            dp_rank: 0,
            num_running_reqs: running,
            num_waiting_reqs: waiting,
            num_total_reqs: running + waiting,
            num_used_tokens: i32::try_from(used).unwrap_or(i32::MAX),
            max_total_num_tokens: i32::try_from(total).unwrap_or(i32::MAX),
            token_usage: usage,
            utilization: usage,
            max_running_requests: i32_of(info.max_batch),
            disaggregation: (self.role != Role::Unified).then(|| s::DisaggregationMetrics {
                mode: self.disaggregation_mode().into(),
                decode_prealloc_queue_reqs: i32_of(info.reserved_requests),
                ..Default::default()
            }),
            ..Default::default()
        };
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        Ok(Response::new(s::GetLoadsResponse {
            timestamp: format!("{secs}"),
            version: format!("pdmesh-{}", env!("CARGO_PKG_VERSION")),
            dp_rank_count: 1,
            aggregate: Some(s::AggregateMetrics {
                total_running_reqs: running,
                total_waiting_reqs: waiting,
                total_reqs: running + waiting,
                avg_token_usage: usage,
                avg_throughput: 0.0,
                avg_utilization: usage,
            }),
            loads: vec![load],
        }))
    }

    /// pdmesh's FlushCache: every cached page no request uses is evicted at once. Pages
    /// running requests hold stay cached rather than failing the call, so there is nothing
    /// to drain and `timeout_s` is not waited for.
    async fn flush_cache(
        &self,
        _request: Request<c::FlushCacheRequest>,
    ) -> Result<Response<c::FlushCacheResponse>, Status> {
        let pages = self
            .worker
            .flush_cache(Request::new(pb::FlushCacheRequest {}))
            .await?
            .into_inner()
            .pages_flushed;
        Ok(Response::new(c::FlushCacheResponse {
            success: true,
            message: format!(
                "flushed {pages} pages of the device prefix cache (pages running requests use stay cached)"
            ),
        }))
    }

    async fn get_tokenizer(
        &self,
        _request: Request<c::GetTokenizerRequest>,
    ) -> Result<Response<Self::GetTokenizerStream>, Status> {
        let b = self.bundle().await?;
        let n = b.zip.len().div_ceil(TOKENIZER_CHUNK).max(1);
        let chunks: Vec<Result<c::GetTokenizerChunk, Status>> = (0..n)
            .map(|i| {
                let end = ((i + 1) * TOKENIZER_CHUNK).min(b.zip.len());
                Ok(c::GetTokenizerChunk {
                    data: b.zip[i * TOKENIZER_CHUNK..end].to_vec(),
                    sha256: if i + 1 == n {
                        b.sha256.clone()
                    } else {
                        String::new()
                    },
                })
            })
            .collect();
        Ok(Response::new(Box::pin(futures::stream::iter(chunks))))
    }

    /// The device prefix cache's pages in SGLang's form: the pdmesh stream (`cleared`, a
    /// snapshot, then each change) one batch per change, pages as blocks with their token
    /// ids, numbered from 1 on each subscription (a resumed subscriber starts afresh: its
    /// first batch clears what it knew).
    async fn subscribe_kv_events(
        &self,
        _request: Request<c::SubscribeKvEventsRequest>,
    ) -> Result<Response<Self::SubscribeKvEventsStream>, Status> {
        let info = self.info().await?;
        let page = info.page_size;
        let mut inner = self
            .worker
            .subscribe_kv_events(Request::new(pb::SubscribeKvEventsRequest {}))
            .await?
            .into_inner();
        let stream = async_stream::stream! {
            let mut n = 0u64;
            while let Some(item) = inner.next().await {
                let ev = match item {
                    Ok(ev) => ev,
                    Err(status) => {
                        yield Err(status);
                        return;
                    }
                };
                n += 1;
                let data = match ev.kind {
                    Some(cpb::kv_event::Kind::Stored(st)) => {
                        let blocks = st
                            .hashes
                            .iter()
                            .zip(st.token_ids.chunks(page as usize))
                            .map(|(&h, toks)| c::KvBlock {
                                block_hash: h as i64,
                                token_ids: toks.to_vec(),
                                block_size: i32_of(page),
                                ..Default::default()
                            })
                            .collect();
                        c::kv_cache_event::Data::Stored(c::KvBlocksStored {
                            blocks,
                            parent_block_hash: Some(st.parent_hash as i64),
                            tier: Some(c::KvCacheTier::Device.into()),
                            ..Default::default()
                        })
                    }
                    Some(cpb::kv_event::Kind::Removed(r)) => {
                        c::kv_cache_event::Data::Removed(c::KvBlocksRemoved {
                            block_hashes: r.hashes.iter().map(|&h| h as i64).collect(),
                            ..Default::default()
                        })
                    }
                    Some(cpb::kv_event::Kind::Cleared(_)) => {
                        c::kv_cache_event::Data::Cleared(c::KvCacheCleared::default())
                    }
                    None => continue,
                };
                yield Ok(c::KvEventBatch {
                    sequence_number: n,
                    timestamp: SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .unwrap_or_default()
                        .as_secs_f64(),
                    events: vec![c::KvCacheEvent {
                        event_id: n,
                        data: Some(data),
                    }],
                    dp_rank: Some(0),
                    ..Default::default()
                });
            }
        };
        Ok(Response::new(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proto_zeros_read_as_sglang_reads_them() {
        let p = sampling(Some(s::SamplingParams::default())).unwrap();
        assert_eq!(p.temperature, Some(0.0), "temperature 0 is greedy");
        assert_eq!((p.top_p, p.top_k, p.repetition_penalty), (None, None, None));
        assert_eq!(p.max_tokens, 0, "absent max_new_tokens: up to the context");
        let p = sampling(Some(s::SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 40,
            repetition_penalty: 1.1,
            max_new_tokens: Some(12),
            stop: vec!["\n".into()],
            stop_token_ids: vec![2],
            ignore_eos: true,
            min_new_tokens: 3,
            logit_bias: [("28".to_owned(), -100.0)].into(),
            ..Default::default()
        }))
        .unwrap();
        assert_eq!(
            (
                p.temperature,
                p.top_p,
                p.top_k,
                p.repetition_penalty,
                p.max_tokens
            ),
            (Some(0.7), Some(0.9), Some(40), Some(1.1), 12)
        );
        assert_eq!(
            (p.stop, p.stop_token_ids, p.ignore_eos),
            (vec![b"\n".to_vec()], vec![2], true)
        );
        assert_eq!((p.min_tokens, p.logit_bias), (3, [(28, -100.0)].into()));
    }

    #[test]
    fn unsupported_features_are_invalid_argument_naming_the_field() {
        for (params, field) in [
            (
                s::SamplingParams {
                    n: 17,
                    ..Default::default()
                },
                "sampling_params.n",
            ),
            (
                s::SamplingParams {
                    logit_bias: [("the".to_owned(), 1.0)].into(),
                    ..Default::default()
                },
                "sampling_params.logit_bias",
            ),
            (
                s::SamplingParams {
                    max_new_tokens: Some(0),
                    ..Default::default()
                },
                "sampling_params.max_new_tokens",
            ),
            (
                s::SamplingParams {
                    constraint: Some(s::sampling_params::Constraint::EbnfGrammar(
                        "root ::= \"a\"".into(),
                    )),
                    ..Default::default()
                },
                "sampling_params.ebnf_grammar",
            ),
            (
                s::SamplingParams {
                    constraint: Some(s::sampling_params::Constraint::JsonSchema("{".into())),
                    ..Default::default()
                },
                "sampling_params.json_schema",
            ),
        ] {
            let e = sampling(Some(params)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().starts_with(field), "{}", e.message());
        }
        let no_ids = s::GenerateRequest::default();
        let e = generate_request(no_ids, Role::Unified).unwrap_err();
        assert!(e.message().starts_with("tokenized"), "{}", e.message());
    }

    #[test]
    fn rooms_are_never_zero_and_only_for_pd_roles() {
        assert_eq!(room(0), 1 << 32);
        assert_eq!(room(-1), (1 << 32) | 0xffff_ffff);
        assert_ne!(room(5), room(6));
        let req = |role| {
            generate_request(
                s::GenerateRequest {
                    tokenized: Some(s::TokenizedInput {
                        original_text: String::new(),
                        input_ids: vec![1, 2],
                    }),
                    disaggregated_params: Some(s::DisaggregatedParams {
                        bootstrap_host: "127.0.0.1".into(),
                        bootstrap_port: 1,
                        bootstrap_room: 7,
                    }),
                    ..Default::default()
                },
                role,
            )
            .unwrap()
            .room
        };
        assert_eq!(req(Role::Unified), 0);
        assert_eq!(req(Role::Decode), room(7));
        assert_eq!(req(Role::Prefill), room(7));
    }

    #[test]
    fn json_schemas_and_regexes_become_grammars() {
        let p = sampling(Some(s::SamplingParams {
            constraint: Some(s::sampling_params::Constraint::JsonSchema(
                r#"{"type":"object"}"#.into(),
            )),
            ..Default::default()
        }))
        .unwrap();
        assert_eq!(
            p.grammar,
            "start: %json{\"type\":\"object\",\"x-guidance\":{\"whitespace_flexible\":false}}\n"
        );
        // Strict, as SGLang's default: properties the schema does not name are not
        // generated unless it says so.
        let grammar = |schema: &str| {
            sampling(Some(s::SamplingParams {
                constraint: Some(s::sampling_params::Constraint::JsonSchema(schema.into())),
                ..Default::default()
            }))
            .unwrap()
            .grammar
        };
        assert_eq!(
            grammar(r#"{"type":"object","properties":{"a":{"type":"integer"}}}"#),
            "start: %json{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"additionalProperties\":false,\"x-guidance\":{\"whitespace_flexible\":false}}\n"
        );
        assert_eq!(
            grammar(r#"{"properties":{"a":{}},"additionalProperties":true}"#),
            "start: %json{\"properties\":{\"a\":{}},\"additionalProperties\":true,\"x-guidance\":{\"whitespace_flexible\":false}}\n"
        );
        let p = sampling(Some(s::SamplingParams {
            constraint: Some(s::sampling_params::Constraint::Regex("a/b+".into())),
            ..Default::default()
        }))
        .unwrap();
        assert_eq!(p.grammar, "start: /a\\/b+/\n");
    }
}

#[cfg(test)]
#[test]
fn every_scheduler_rpc_has_the_roles_that_may_call_it() {
    let proto = include_str!("../../../proto/sglang/grpc/scheduler/scheduler.proto");
    assert_eq!(POLICY.unlisted(proto), Vec::<&str>::new());
}

//! gRPC ingress for `pdmesh.worker.v1.Worker`: the only module that touches prost types.
//! It converts requests to engine types (proto3 `optional` defaults, UTF-8 checks) and
//! engine events back to messages; all scheduling happens in the engine actor.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use pdmesh_engine::{FinishReason, GenRequest, Logprob, ModelInfo, Part, SamplingParams};
use pdmesh_kv::CacheEvent;
use pdmesh_proto::cache::v1 as cpb;
use pdmesh_proto::worker::v1 as pb;
use tonic::{Request, Response, Status};

use crate::actor::EngineHandle;
use crate::engine_core::{Event, Finish, PoolNow};
use crate::error::Error;
use crate::pd::{Pd, Role};
use crate::watchdog::EngineWatch;

/// The tonic service: a handle to the engine actor and the disaggregation state.
pub(crate) struct WorkerService {
    pub(crate) engine: EngineHandle,
    /// Compiles requests' grammars here, before the engine thread sees them.
    grammars: pdmesh_engine::GrammarCompiler,
    pd: Arc<Pd>,
    watch: Arc<EngineWatch>,
    /// The test-only faults switched on (`--fault-*`), reported in Health and ModelInfo.
    faults: Vec<String>,
    /// Ends the KV event streams, which would otherwise hold a graceful shutdown forever.
    shutdown: tokio_util::sync::CancellationToken,
}

impl WorkerService {
    pub(crate) fn new(
        (engine, grammars): (EngineHandle, pdmesh_engine::GrammarCompiler),
        pd: Arc<Pd>,
        watch: Arc<EngineWatch>,
        faults: Vec<String>,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Self {
        Self {
            engine,
            grammars,
            pd,
            watch,
            faults,
            shutdown,
        }
    }

    /// Compiles `lark` on a blocking thread within [`GRAMMAR_DEADLINE`]; the request
    /// carries it compiled, so the engine thread never compiles: a grammar that takes long
    /// to compile delays its own request, never the batch.
    async fn compile_grammar(&self, lark: String) -> Result<pdmesh_engine::Grammar, Error> {
        let compiler = self.grammars.clone();
        let work = tokio::task::spawn_blocking(move || compiler.compile(&lark));
        match tokio::time::timeout(GRAMMAR_DEADLINE, work).await {
            Ok(Ok(compiled)) => Ok(compiled?),
            Ok(Err(error)) => Err(Error::Task {
                what: "compiling the grammar",
                error,
            }),
            Err(_) => Err(Error::GrammarTooSlow {
                limit: GRAMMAR_DEADLINE,
            }),
        }
    }
}

/// How long a request's grammar may take to compile.
const GRAMMAR_DEADLINE: std::time::Duration = std::time::Duration::from_secs(5);

/// A prefix cache change as the wire has it.
fn kv_event(seq: u64, e: &CacheEvent) -> cpb::KvEvent {
    let kind = match e {
        CacheEvent::Stored {
            parent_hash,
            hashes,
            tokens,
            unservable,
        } => cpb::kv_event::Kind::Stored(cpb::PagesStored {
            parent_hash: *parent_hash,
            hashes: hashes.clone(),
            token_ids: tokens.clone(),
            tier: cpb::KvTier::Memory.into(),
            unservable: unservable.clone(),
        }),
        CacheEvent::Removed { hashes } => cpb::kv_event::Kind::Removed(cpb::PagesRemoved {
            hashes: hashes.clone(),
            tier: cpb::KvTier::Memory.into(),
        }),
        CacheEvent::Cleared => cpb::kv_event::Kind::Cleared(cpb::PagesCleared {}),
    };
    cpb::KvEvent {
        seq,
        kind: Some(kind),
    }
}

/// Proto sampling parameters → engine parameters. Absent optionals take the documented
/// defaults; range checks are the engine's (`SamplingParams::validate`). The grammar is
/// not among them: the caller compiles it ([`WorkerService::compile_grammar`]).
pub(crate) fn sampling_params(p: Option<pb::SamplingParams>) -> Result<SamplingParams, Error> {
    let p = p.unwrap_or_default();
    let stop = p
        .stop
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            String::from_utf8(s).map_err(|_| Error::InvalidUtf8 {
                field: format!("stop[{i}]"),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(SamplingParams {
        temperature: p.temperature.unwrap_or(1.0),
        top_p: p.top_p.unwrap_or(1.0),
        top_k: p.top_k.filter(|&k| k > 0).map_or(0, |k| k.unsigned_abs()),
        min_p: p.min_p.unwrap_or(0.0),
        frequency_penalty: p.frequency_penalty,
        presence_penalty: p.presence_penalty,
        repetition_penalty: p.repetition_penalty.unwrap_or(1.0),
        seed: p.seed,
        max_tokens: (p.max_tokens > 0).then_some(p.max_tokens),
        stop,
        stop_token_ids: p.stop_token_ids,
        ignore_eos: p.ignore_eos,
        logprobs: p.logprobs,
        top_logprobs: p.top_logprobs,
        logit_bias: p.logit_bias.into_iter().collect(),
        min_tokens: p.min_tokens,
        grammar: None,
        prompt_logprobs: p.prompt_logprobs,
        // The request's, not a sampling parameter on the wire (GenerateRequest.cache_salt).
        cache_salt: None,
    })
}

fn finish_reason(r: FinishReason) -> pb::FinishReason {
    match r {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Abort => pb::FinishReason::Abort,
    }
}

fn top(top: &[(u32, f32)]) -> Vec<pb::TopLogprob> {
    top.iter()
        .map(|&(token_id, logprob)| pb::TopLogprob { token_id, logprob })
        .collect()
}

/// The prompt's log-probabilities as the proto carries them: `tokens` is the prompt after
/// its first token, each with its entry of `logprobs`.
pub(crate) fn prompt_logprobs(tokens: &[u32], logprobs: &[Logprob]) -> Vec<pb::PromptLogprob> {
    tokens
        .iter()
        .zip(logprobs)
        .map(|(&token_id, l)| pb::PromptLogprob {
            token_id,
            logprob: l.logprob,
            top: top(&l.top),
        })
        .collect()
}

/// Most choices one prompt group may have (the gateway and the SGLang facade send at
/// most 16).
const MAX_GROUP: u32 = 64;

/// The client's message for an event; `None` for the engine's internal hand-over events
/// and for a failure (the stream yields it as its error, see `Generation`).
fn response(event: Event) -> Option<pb::GenerateResponse> {
    let kind = match event {
        Event::Exported { .. } | Event::Reserved { .. } | Event::Failed(_) => return None,
        Event::Token { token, logprob } => pb::generate_response::Kind::Chunk(pb::TokenChunk {
            token_ids: vec![token],
            top_logprobs: logprob.as_ref().map_or_else(Vec::new, |l| top(&l.top)),
            logprob: logprob.map(|l| l.logprob),
            prompt_logprobs: Vec::new(),
        }),
        Event::PromptLogprobs { tokens, logprobs } => {
            pb::generate_response::Kind::Chunk(pb::TokenChunk {
                prompt_logprobs: prompt_logprobs(&tokens, &logprobs),
                ..Default::default()
            })
        }
        Event::Finished(Finish {
            reason,
            matched_stop,
            matched_token,
            prompt_tokens,
            completion_tokens,
            cached_tokens,
            host_cached_tokens,
            transferred_tokens,
            stages,
        }) => pb::generate_response::Kind::Finished(pb::Finished {
            reason: finish_reason(reason).into(),
            matched_stop: matched_stop.map(String::into_bytes).unwrap_or_default(),
            matched_token,
            prompt_tokens,
            completion_tokens,
            cached_tokens,
            host_cached_tokens,
            transferred_tokens,
            stages: Some(pb::StageTimes {
                queue_seconds: stages.queue,
                prefill_seconds: stages.prefill,
                transfer_seconds: stages.transfer,
                decode_seconds: stages.decode,
            }),
        }),
    };
    Some(pb::GenerateResponse { kind: Some(kind) })
}

fn model_info(info: ModelInfo, pool: PoolNow, w: &WorkerService) -> pb::ModelInfoResponse {
    let pd = w.pd.stats();
    let progress = w.engine.progress();
    pb::ModelInfoResponse {
        model_id: info.model_id,
        context_length: info.context_length,
        vocab_size: info.vocab_size,
        eos_token_ids: info.eos_token_ids,
        kv_layout: info.kv_layout,
        kv_layout_fingerprint: info.kv_layout_fingerprint,
        page_size: info.page_size,
        total_pages: info.total_pages,
        free_pages: u32::try_from(pool.free_pages).unwrap_or(u32::MAX),
        max_batch: info.max_batch,
        cached_pages: u32::try_from(pool.cached_pages).unwrap_or(u32::MAX),
        prefix_hit_tokens: pool.cache.hit_tokens,
        prefix_evicted_pages: pool.cache.evicted_pages,
        host_hit_tokens: pool.host.hit_tokens,
        host_load_bytes: pool.host.load_bytes,
        host_load_seconds: pool.host.load_seconds,
        host_written_pages: pool.host.written_pages,
        host_written_bytes: pool.host.written_bytes,
        host_written_seconds: pool.host.written_seconds,
        host_checksum_failures: pool.host.checksum_failures,
        host_dropped_pages: pool.host.dropped_pages,
        host_queued_pages: pool.host.queued_pages,
        host_fetching_requests: pool.load.fetching as u32,
        role: w.pd.role().name().to_owned(),
        waiting_requests: pool.load.waiting as u32,
        reserved_requests: pool.load.reserved as u32,
        running_requests: pool.load.running as u32,
        reserved_pages: pool.load.reserved_pages as u32,
        transfer_pages: pd.pages,
        transfer_bytes: pd.bytes,
        transfer_seconds: pd.seconds,
        transfer_failures: pd
            .failures
            .iter()
            .map(|(k, v)| (k.name().to_owned(), *v))
            .collect(),
        admission_timeouts: pd.admission_timeouts,
        engine_steps: progress.steps.load(std::sync::atomic::Ordering::Relaxed),
        engine_idle_seconds: progress.idle_seconds(),
        engine_stalls: w.watch.stalls.load(std::sync::atomic::Ordering::Relaxed),
        watchdog_aborts: w.watch.aborts.load(std::sync::atomic::Ordering::Relaxed),
        transfers: pd.transfers,
        handovers: u32::try_from(pd.handovers).unwrap_or(u32::MAX),
        handover_oldest_seconds: pd.handover_oldest_seconds,
        faults: w.faults.clone(),
        cache_url: w.pd.home().to_owned(),
        incidents: w.pd.incident_counts(),
        auth_refused: pdmesh_tls::auth::refused_total(),
        insecure_plaintext: pdmesh_tls::auth::insecure(),
    }
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;
type KvEventStream = Pin<Box<dyn Stream<Item = Result<cpb::KvEvent, Status>> + Send>>;

/// Who may call each RPC (over mutual TLS, by the roles in the caller's certificate): the
/// gateway generates, aborts, flushes and follows KV events (they carry prompts' token
/// ids); any member may ask Health and ModelInfo (`pdmesh up` probes with them).
pub static POLICY: pdmesh_tls::Policy = {
    use pdmesh_tls::Roles;
    pdmesh_tls::Policy {
        service: "pdmesh.worker.v1.Worker",
        methods: &[
            ("Generate", Roles::GATEWAY),
            ("Abort", Roles::GATEWAY),
            ("Health", Roles::ANY),
            ("ModelInfo", Roles::ANY),
            ("SubscribeKvEvents", Roles::GATEWAY),
            ("FlushCache", Roles::GATEWAY),
        ],
    }
};

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    type GenerateStream = GenerateStream;
    type SubscribeKvEventsStream = KvEventStream;

    /// `cleared`, the pages held now, then each change; DATA_LOSS for a subscriber that
    /// fell more than the backlog behind (it subscribes again and starts afresh).
    async fn subscribe_kv_events(
        &self,
        _request: Request<pb::SubscribeKvEventsRequest>,
    ) -> Result<Response<Self::SubscribeKvEventsStream>, Status> {
        let (seq, snapshot, mut rx) = self.engine.subscribe_kv().await.map_err(Error::from)?;
        let shutdown = self.shutdown.clone();
        let stream = async_stream::stream! {
            yield Ok(kv_event(seq, &CacheEvent::Cleared));
            for e in &snapshot {
                yield Ok(kv_event(seq, e));
            }
            loop {
                let batch = tokio::select! {
                    b = rx.recv() => b,
                    _ = shutdown.cancelled() => break,
                };
                match batch {
                    Ok(batch) => {
                        for (n, e) in batch.iter() {
                            yield Ok(kv_event(*n, e));
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        yield Err(Status::data_loss(format!(
                            "this subscriber fell {n} batches of KV events behind; subscribe again"
                        )));
                        break;
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                }
            }
        };
        Ok(Response::new(Box::pin(stream)))
    }

    /// Streams one `TokenChunk` per token, then `Finished`. Dropping the response stream
    /// (the client went away) aborts the request in the engine.
    #[tracing::instrument(skip_all, fields(
        request_id = %request.get_ref().request_id,
        prompt_tokens = request.get_ref().input_ids.len(),
        pdmesh.role = self.pd.role().name(),
        pdmesh.room = request.get_ref().room,
    ))]
    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let mut req = request.into_inner();
        let lark = req
            .sampling
            .as_mut()
            .map(|p| std::mem::take(&mut p.grammar))
            .filter(|g| !g.is_empty());
        let mut params = sampling_params(req.sampling)?;
        // Checked with the sampling parameters (`SamplingParams::validate`).
        params.cache_salt = req.cache_salt;
        // A group waits for all its choices: a size no caller sends would hold the ones
        // that came until their clients leave.
        if !req.prompt_group.is_empty() && !(1..=MAX_GROUP).contains(&req.prompt_group_size) {
            return Err(Status::invalid_argument(format!(
                "prompt_group_size must be between 1 and {MAX_GROUP} with a prompt_group, got {}",
                req.prompt_group_size
            )));
        }
        self.watch.admit()?;
        if let Some(lark) = lark {
            params.grammar = Some(self.compile_grammar(lark).await?);
        }
        let id = if req.request_id.is_empty() {
            uuid::Uuid::new_v4().to_string()
        } else {
            req.request_id
        };
        let group = (!req.prompt_group.is_empty())
            .then_some((req.prompt_group, req.prompt_group_size as usize));
        let gen_req = GenRequest {
            id,
            prompt: req.input_ids,
            params,
        };
        // A room, or none, where the worker's role wants the other: the mesh routed the
        // request wrong, which is no fault of the client's request.
        match (self.pd.role(), req.room) {
            (Role::Unified, 0) => {}
            (Role::Unified, room) => {
                return Err(Status::internal(format!(
                    "this is a unified worker; it takes no room (got room {room})"
                )));
            }
            (role, 0) => {
                return Err(Status::internal(format!(
                    "this is a {} worker: a request needs a room",
                    role.name()
                )));
            }
            (_, room) => {
                let rx = self
                    .pd
                    .generate(
                        &self.engine,
                        (gen_req, group),
                        room,
                        req.trace_id,
                        req.kv_home,
                    )
                    .await?;
                let stream = tokio_stream::wrappers::ReceiverStream::new(rx)
                    .filter_map(|item| async move { item.map(response).transpose() });
                return Ok(Response::new(self.watch.fuse(Box::pin(stream))));
            }
        }
        let generation = self
            .engine
            .generate_shared(gen_req, Part::Whole, group)
            .await
            .map_err(|e| Status::from(Error::from(e)))?;
        let stream = generation.filter_map(|item| async move {
            item.map(response)
                .map_err(|e| Status::from(Error::from(e)))
                .transpose()
        });
        Ok(Response::new(self.watch.fuse(Box::pin(stream))))
    }

    #[tracing::instrument(skip_all, fields(request_id = %request.get_ref().request_id))]
    async fn abort(
        &self,
        request: Request<pb::AbortRequest>,
    ) -> Result<Response<pb::AbortResponse>, Status> {
        let found = self
            .engine
            .abort(request.into_inner().request_id)
            .await
            .map_err(Error::from)?;
        Ok(Response::new(pb::AbortResponse { found }))
    }

    async fn health(
        &self,
        _request: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthResponse>, Status> {
        Ok(Response::new(pb::HealthResponse {
            ok: self.engine.connected()
                && self.pd.ready()
                && !self.watch.refusing()
                && !self.watch.draining()
                && self.engine.info().await.is_ok(),
            faults: self.faults.clone(),
        }))
    }

    async fn model_info(
        &self,
        _request: Request<pb::ModelInfoRequest>,
    ) -> Result<Response<pb::ModelInfoResponse>, Status> {
        let (info, pool) = self.engine.info().await.map_err(Error::from)?;
        Ok(Response::new(model_info(info, pool, self)))
    }

    #[tracing::instrument(skip_all)]
    async fn flush_cache(
        &self,
        _request: Request<pb::FlushCacheRequest>,
    ) -> Result<Response<pb::FlushCacheResponse>, Status> {
        let pages = self.engine.flush_cache().await.map_err(Error::from)?;
        tracing::info!(pages, "flushed the device prefix cache");
        Ok(Response::new(pb::FlushCacheResponse {
            pages_flushed: pages as u64,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_optionals_take_the_documented_defaults() {
        let p = sampling_params(Some(pb::SamplingParams::default())).unwrap();
        assert_eq!(p, SamplingParams::default());
        assert_eq!(sampling_params(None).unwrap(), SamplingParams::default());
    }

    #[test]
    fn present_fields_are_kept_and_zero_means_unset() {
        let p = sampling_params(Some(pb::SamplingParams {
            temperature: Some(0.0),
            top_p: Some(0.5),
            top_k: Some(-3),
            max_tokens: 0,
            seed: Some(9),
            stop: vec![b"\n\n".to_vec()],
            ..Default::default()
        }))
        .unwrap();
        assert_eq!(p.temperature, 0.0, "explicit 0 is greedy, not the default");
        assert_eq!(p.top_p, 0.5);
        assert_eq!(p.top_k, 0, "negative top_k disables it");
        assert_eq!(p.max_tokens, None);
        assert_eq!(p.seed, Some(9));
        assert_eq!(p.stop, ["\n\n"]);
        let p = sampling_params(Some(pb::SamplingParams {
            top_k: Some(40),
            max_tokens: 8,
            ..Default::default()
        }))
        .unwrap();
        assert_eq!((p.top_k, p.max_tokens), (40, Some(8)));
    }

    #[test]
    fn invalid_utf8_stop_is_invalid_argument_naming_its_index() {
        let err = sampling_params(Some(pb::SamplingParams {
            stop: vec![b"ok".to_vec(), vec![0xc3]],
            ..Default::default()
        }))
        .unwrap_err();
        assert_eq!(err.to_string(), "stop[1] is not valid UTF-8");
        assert_eq!(Status::from(err).code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn engine_errors_map_to_client_and_server_codes() {
        use pdmesh_engine::EngineError;
        let code = |e: EngineError| Status::from(Error::from(e)).code();
        assert_eq!(code(EngineError::EmptyPrompt), tonic::Code::InvalidArgument);
        assert_eq!(
            code(EngineError::PromptTooLong {
                prompt: 9,
                context: 8
            }),
            tonic::Code::InvalidArgument
        );
        assert_eq!(code(EngineError::Offline), tonic::Code::Unavailable);
        assert_eq!(
            code(EngineError::Unsupported("x".into())),
            tonic::Code::Internal
        );
        // The kind travels typed beside the code: the gateway never reads the words.
        let too_long = Status::from(Error::from(EngineError::MaxTokensTooLarge {
            prompt: 5,
            max_tokens: 9,
            context: 8,
        }));
        assert_eq!(
            pdmesh_proto::error_kind::of(&too_long).as_deref(),
            Some(pdmesh_proto::error_kind::CONTEXT_LENGTH)
        );
        let full = Status::from(Error::from(EngineError::QueueFull { limit: 3 }));
        assert_eq!(
            pdmesh_proto::error_kind::of(&full).as_deref(),
            Some("queue_full")
        );
    }
}

#[cfg(test)]
#[test]
fn every_rpc_has_the_roles_that_may_call_it() {
    let proto = include_str!("../../../proto/pdmesh/worker/v1/worker.proto");
    assert_eq!(POLICY.unlisted(proto), Vec::<&str>::new());
}

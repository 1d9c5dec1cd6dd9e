//! The `SglangScheduler` RPCs, each served through the pdmesh service: generation (with
//! `n` > 1 as a prompt group), abort, health, the model, server and load reports, the
//! tokenizer bundle and the device prefix cache's events.

use std::pin::Pin;
use std::time::{SystemTime, UNIX_EPOCH};

use futures::{Stream, StreamExt};
use pdmesh_proto::cache::v1 as cpb;
use pdmesh_proto::sglang::grpc::scheduler as s;
use pdmesh_proto::smg::grpc::common as c;
use pdmesh_proto::worker::v1 as pb;
use pdmesh_proto::worker::v1::worker_server::Worker;
use tonic::{Request, Response, Status};

use super::request::generate_request;
use super::response::{Prompt, i32_of, pstruct, responses};
use super::{GroupEntry, SglangService, invalid};
use crate::pd::Role;

/// Bytes per `GetTokenizer` chunk.
const TOKENIZER_CHUNK: usize = 1 << 20;

type GenerateStream = Pin<Box<dyn Stream<Item = Result<s::GenerateResponse, Status>> + Send>>;
type TokenizerStream = Pin<Box<dyn Stream<Item = Result<c::GetTokenizerChunk, Status>> + Send>>;
type KvStream = Pin<Box<dyn Stream<Item = Result<c::KvEventBatch, Status>> + Send>>;

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
            )
            .into());
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
            )
            .into());
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
                let data = match ev.kind {
                    Some(cpb::kv_event::Kind::Stored(st)) => {
                        // A page no hit could end at is not claimed (SGLang's blocks have
                        // no way to say "held, but not servable"): the chain is sent from
                        // the page after the last such one.
                        let from = st
                            .hashes
                            .iter()
                            .rposition(|h| st.unservable.contains(h))
                            .map_or(0, |i| i + 1);
                        let parent = match from {
                            0 => st.parent_hash,
                            i => st.hashes[i - 1],
                        };
                        let blocks: Vec<_> = st.hashes[from..]
                            .iter()
                            .zip(st.token_ids.chunks(page as usize).skip(from))
                            .map(|(&h, toks)| c::KvBlock {
                                block_hash: h as i64,
                                token_ids: toks.to_vec(),
                                block_size: i32_of(page),
                                ..Default::default()
                            })
                            .collect();
                        if blocks.is_empty() {
                            continue;
                        }
                        c::kv_cache_event::Data::Stored(c::KvBlocksStored {
                            blocks,
                            parent_block_hash: Some(parent as i64),
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
                n += 1;
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

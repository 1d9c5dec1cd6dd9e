//! The engine: a continuous-batching scheduler ([`sched`]) over one model ([`models`])
//! and one paged KV pool. Each `step` plans (admits waiting requests while pages allow,
//! picks every running sequence's next token plus a budget of prompt tokens), runs one
//! forward pass over the plan, then samples and retires finished sequences, returning
//! their pages to the pool.

mod config;
mod models;
mod sched;

use std::sync::Arc;

use pdmesh_kv::{CacheEvent, HostTier, PagePool, PrefixCacheStats};

pub use config::{DEFAULT_MAX_QUEUED, EngineConfig, HostStats, WritePolicy};
use models::{Loaded, Model};
use sched::Scheduler;

use crate::grammar::GrammarCompiler;
use crate::tp::RankWork;
use crate::{EngineError, GenRequest, Logprob, ModelInfo, Part, StepEvent};

/// The engine. See the crate docs.
pub struct Engine {
    sched: Scheduler,
    model: Box<dyn Model>,
    tp: rayon::ThreadPool,
    info: ModelInfo,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (waiting, running) = self.sched.load_counts();
        f.debug_struct("Engine")
            .field("model", &self.info.model_id)
            .field("running", &running)
            .field("waiting", &waiting)
            .field("pool", self.sched.pool())
            .finish()
    }
}

impl Engine {
    /// Load the model and allocate the KV pool.
    pub fn load(cfg: EngineConfig) -> Result<Self, EngineError> {
        if cfg.max_batch == 0 || cfg.page_size == 0 || cfg.kv_pages == 0 || cfg.prefill_chunk == 0 {
            return Err(EngineError::InvalidParam {
                field: "engine config",
                msg: "max_batch, page_size, kv_pages and prefill_chunk must be > 0".into(),
            });
        }
        if cfg.tp == 0 {
            return Err(EngineError::InvalidParam {
                field: "tp",
                msg: "tensor parallelism needs at least 1 rank (1 = unsharded)".into(),
            });
        }
        let loaded = Loaded::load(&cfg)?;
        let (model, layout) = (loaded.model, Arc::new(loaded.layout));
        let window = layout
            .groups()
            .iter()
            .filter_map(|g| match g.attention {
                pdmesh_kv::Attention::SlidingWindow { window } => Some(window),
                pdmesh_kv::Attention::Full => None,
            })
            .max();
        let pool = match window {
            None => PagePool::new(layout.clone(), cfg.kv_pages),
            Some(window) => {
                let (have, need) = (
                    cfg.window_pages(window),
                    cfg.window_pages_per_sequence(window).min(cfg.kv_pages),
                );
                if have < need {
                    return Err(EngineError::InvalidParam {
                        field: "kv_window_pages",
                        msg: format!(
                            "{have} window pages cannot hold one sequence's window of {window} \
                             tokens and a prefill chunk of {}: at least {need} (--kv-window-pages)",
                            cfg.prefill_chunk
                        ),
                    });
                }
                PagePool::with_window_pages(layout.clone(), cfg.kv_pages, have)
            }
        };
        let threads = if cfg.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            cfg.threads
        };
        let tp = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("pdmesh-compute-{i}"))
            .build()
            .map_err(|e| EngineError::Unsupported(format!("thread pool: {e}")))?;
        let context = cfg
            .max_context
            .map_or(loaded.context_length, |m| m.min(loaded.context_length));
        let (token_bytes, eog) = (loaded.token_bytes, loaded.eog);
        let model_id = cfg
            .model_path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.split('.').next())
            .unwrap_or("model")
            .to_owned();
        let info = ModelInfo {
            model_id,
            context_length: context as u32,
            vocab_size: model.vocab() as u32,
            eos_token_ids: eog.clone(),
            kv_layout: layout.describe(),
            kv_layout_fingerprint: layout.fingerprint_hex(),
            page_size: cfg.page_size as u32,
            total_pages: cfg.kv_pages as u32,
            max_batch: cfg.max_batch as u32,
        };
        tracing::info!(model = %info.model_id, layout = %layout, threads, simd = pdmesh_kernels::simd_level(), "engine loaded");
        let vocab = model.vocab();
        Ok(Self {
            sched: Scheduler::new(cfg, pool, (vocab, token_bytes, eog), context),
            model,
            tp,
            info,
        })
    }

    pub fn info(&self) -> ModelInfo {
        self.info.clone()
    }

    /// What each tensor-parallel rank of the CPU llama forward has computed so far, in
    /// rank order (at `tp` 1, one rank owning the whole model); empty for the models that
    /// do not count it (DeepSeek, the CUDA backend).
    pub fn rank_work(&self) -> Vec<RankWork> {
        self.model.rank_work()
    }

    /// One scheduler iteration: plan, run the model on the plan, apply its logits.
    pub fn step(&mut self) -> Vec<StepEvent> {
        let mut events = Vec::new();
        if let Some(plan) = self.sched.plan(&mut events) {
            let (model, tp) = (&self.model, &self.tp);
            let logits = self.sched.execute(&plan, |pool, pages, batch| {
                model.forward(tp, pool, pages, batch)
            });
            match logits {
                Ok(logits) => self.sched.apply(plan, logits, &mut events),
                Err(e) => {
                    tracing::error!(error = %e, requests = plan.work.len(), "the forward pass failed: its requests end with the error");
                    self.sched.fail(plan, &e, &mut events);
                }
            }
        }
        events
    }

    pub fn free_pages(&self) -> usize {
        self.sched.free_pages()
    }

    /// Pages only the prefix cache holds: free for the taking when the pool runs short.
    /// When idle, `free_pages() + cached_pages()` is the whole pool.
    pub fn cached_pages(&self) -> usize {
        self.sched.cached_pages()
    }

    /// Prefix-cache counters (zero when the cache is off).
    pub fn cache_stats(&self) -> PrefixCacheStats {
        self.sched.cache_stats()
    }

    /// Attach the host tier of the KV cache (needs the prefix cache, whose page hashes name
    /// host pages). An admitted prompt's pages the device tier lacks are then fetched
    /// from there while other sequences run, before its forward pass; pages go the other
    /// way as `policy` says, through the tier's store queue.
    pub fn set_host_tier(&mut self, host: Box<dyn HostTier>, policy: WritePolicy) {
        self.sched.set_host_tier(host, policy)
    }

    /// Woken when a host-tier answer arrives: the driver then steps the engine again
    /// ([`Self::has_work`] says so). Without a host tier, never woken.
    pub fn set_host_waker(&mut self, waker: std::task::Waker) {
        self.sched.set_host_waker(waker)
    }

    /// Admitted sequences waiting for host-tier answers. They need no step: the waker set
    /// with [`Self::set_host_waker`] says when an answer is there.
    pub fn awaiting_host(&self) -> usize {
        self.sched.awaiting_host()
    }

    pub fn host_stats(&self) -> HostStats {
        self.sched.host_stats()
    }

    /// From now on, remember each change to the device prefix cache for
    /// [`Self::take_cache_events`] (the caller must take them). No-op without a cache.
    pub fn record_cache_events(&mut self) {
        self.sched.record_cache_events()
    }

    /// Changes to the device prefix cache since the last call.
    pub fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.sched.take_cache_events()
    }

    /// Every page the device prefix cache holds now, as events (see
    /// [`PrefixCache::snapshot`]).
    pub fn cache_snapshot(&self) -> Vec<CacheEvent> {
        self.sched.cache_snapshot()
    }

    /// Evicts every page of the device prefix cache that no request references, as
    /// eviction under pool pressure does (under write-back, pages the host tier lacks are
    /// written there first); pages requests use stay cached. Returns how many pages went
    /// back to the free list.
    pub fn flush_cache(&mut self) -> usize {
        self.sched.flush_cache()
    }

    pub fn pool(&self) -> &PagePool {
        self.sched.pool()
    }

    pub fn has_work(&self) -> bool {
        self.sched.has_work()
    }

    /// Sequences preempted (and recomputed later) because the pool was full.
    pub fn preemptions(&self) -> u64 {
        self.sched.preemptions()
    }

    /// Requests waiting for admission (or, with their KV, for a batch slot or the host
    /// tier) and running.
    pub fn load_counts(&self) -> (usize, usize) {
        self.sched.load_counts()
    }

    /// Decode-side requests holding pages while their KV travels, and those pages.
    pub fn reserved(&self) -> (usize, usize) {
        self.sched.reserved()
    }

    /// Prefilled prompts whose pages are held for export, and those pages.
    pub fn exports(&self) -> (usize, usize) {
        self.sched.exports()
    }

    /// Compiles grammars for this engine's vocabulary on other threads: a request carries
    /// its grammar compiled, and the engine thread only copies the parser.
    pub fn grammar_compiler(&self) -> GrammarCompiler {
        self.sched.grammar_compiler()
    }

    /// Validate and queue a request.
    pub fn submit(&mut self, req: GenRequest) -> Result<(), EngineError> {
        self.sched.submit(req)
    }

    /// Validate and queue `part` of a request (see [`Part`]).
    pub fn submit_part(&mut self, req: GenRequest, part: Part) -> Result<(), EngineError> {
        self.sched.submit_part(req, part)
    }

    /// Drop a request wherever it is; its pages return to the pool at once.
    pub fn abort(&mut self, id: &str) -> bool {
        self.sched.abort(id)
    }

    /// Logits rows captured for a request (only with `capture_logits`).
    pub fn take_logits(&mut self, id: &str) -> Option<Vec<Vec<f32>>> {
        self.sched.take_logits(id)
    }

    /// Like [`Self::submit_part`], for one of the `size` choices of a request with `n` > 1,
    /// which share their prompt and the name `group`. The group is held until all its
    /// choices have arrived (or were aborted); then the first computes the prompt and
    /// the others wait for it, take references to its KV pages (the last, partly filled
    /// page copied, since each choice writes its own tokens there) and sample their first
    /// token from the same logits with their own sampler. Each choice's output is the one
    /// it would have had alone: the prompt's KV and logits are the same bits whoever
    /// computes them. Choices whose prompt differs from the first's run alone; so do
    /// decode-side parts (their KV arrives from a prefill worker).
    pub fn submit_shared(
        &mut self,
        req: GenRequest,
        part: Part,
        group: &str,
        size: usize,
    ) -> Result<(), EngineError> {
        self.sched.submit_shared(req, part, group, size)
    }

    /// Hands `f` the KV pages of prefilled request `id` (in prompt order) and lets them
    /// go; returns what `f` returned.
    pub fn export<R>(&mut self, id: &str, f: impl FnOnce(&[&[u8]]) -> R) -> Result<R, EngineError> {
        self.sched.export(id, f)
    }

    /// Lets go of the pages held for prefilled request `id` without exporting them.
    pub fn drop_export(&mut self, id: &str) -> bool {
        self.sched.drop_export(id)
    }

    /// Gives decode-side request `id` its prompt's KV and first token: `fill` writes the
    /// pages reserved for it after the `held` ones its prefix cache had (in prompt order)
    /// and says whether the bytes arrived intact.
    /// The request then generates from its second token, exactly as a unified engine
    /// would have. Returns the events for the first token (it may already finish).
    pub fn import(
        &mut self,
        id: &str,
        first_token: u32,
        logprob: Option<Logprob>,
        cached: usize,
        fill: impl FnOnce(&mut [&mut [u8]]) -> Result<(), crate::FillError>,
    ) -> Result<Vec<StepEvent>, EngineError> {
        self.sched.import(id, first_token, logprob, cached, fill)
    }
}

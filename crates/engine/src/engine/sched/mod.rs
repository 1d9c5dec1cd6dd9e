//! The scheduler: the requests' queues (waiting, loading from the host tier, running,
//! parked for a hand-over, ready for a batch slot), the paged KV pool and its prefix
//! cache. A step is three phases: [`Scheduler::plan`] decides what the forward pass
//! computes (admission by pages, chunk budgets, preemption, reservations) as a plain
//! [`StepPlan`]; [`Scheduler::execute`] runs the forward pass it is given over it;
//! [`Scheduler::apply`] samples, checks stops and retires. The scheduler never touches
//! the model, so its unit tests give it a fake forward pass.

mod apply;
mod groups;
mod handover;
mod host;
mod pages;
mod plan;
mod sample;
mod seq;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use pdmesh_kv::{CacheEvent, HostTier, PageId, PagePool, PrefixCache, PrefixCacheStats};

pub(crate) use plan::StepPlan;
use seq::{Gathering, Loading, Seq};

use super::{EngineConfig, HostStats, WritePolicy};
use crate::budget::PrefillBudget;
use crate::grammar::{GrammarCompiler, Grammars};
use crate::sampler::Sampler;
use crate::{EngineError, GenRequest, Part, StepEvent};

/// The scheduler: every request's state and the KV pool, without the model. See the
/// module docs.
pub(crate) struct Scheduler {
    cfg: EngineConfig,
    pool: PagePool,
    /// Tokens the model knows.
    vocab: usize,
    token_bytes: Vec<Vec<u8>>,
    eog: Vec<u32>,
    grammars: Arc<Grammars>,
    context: usize,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Decode-side sequences holding pages for their prompt while its KV travels. Bounded
    /// by pages, not by `max_batch`: a reservation needs no batch slot.
    parked: Vec<Seq>,
    /// Sequences admitted while their prompt's pages come from the host tier. They hold
    /// their pages and count against `max_batch`; the engine never waits for them.
    loading: Vec<Loading>,
    /// The last host-tier fetch's ticket.
    fetches: u64,
    /// Decode-side sequences whose KV arrived while the batch was full: they keep their
    /// pages and join the batch, first in line, as slots free.
    ready: VecDeque<Seq>,
    /// Prefilled prompts' pages held (one reference each) until exported or dropped.
    exports: HashMap<Arc<str>, Vec<PageId>>,
    /// Events produced outside `step` (admission), handed out by the next `step`.
    pending: Vec<StepEvent>,
    /// Nothing running and the queue's head cannot be admitted: stepping is pointless
    /// until something changes.
    stalled: bool,
    /// The running sequence cannot grow until pages reserved for transfers come back:
    /// stepping is pointless until an import, abort or submit changes the pool.
    blocked: bool,
    ids: HashSet<Arc<str>>,
    captured: HashMap<Arc<str>, Vec<Vec<f32>>>,
    preemptions: u64,
    /// Prompt tokens per step (chunked prefill), sized by the step target.
    budget: PrefillBudget,
    cache: Option<PrefixCache>,
    host: Option<(Box<dyn HostTier>, WritePolicy)>,
    /// The host tier's generation the cache's `on_host` marks refer to.
    host_generation: u64,
    host_stats: HostStats,
    /// Prompt groups some of whose choices have not arrived: held until all have.
    gathering: HashMap<Arc<str>, Gathering>,
    /// Leader's id → requests waiting to share its prompt's KV once it is computed.
    followers: HashMap<Arc<str>, Vec<Seq>>,
}

impl Scheduler {
    /// A scheduler over `pool` for a model of `vocab` tokens whose bytes are
    /// `token_bytes`, ending generations at `eog`, with `context` positions.
    pub(crate) fn new(
        cfg: EngineConfig,
        pool: PagePool,
        (vocab, token_bytes, eog): (usize, Vec<Vec<u8>>, Vec<u32>),
        context: usize,
    ) -> Self {
        let page_size = cfg.page_size;
        let cache = cfg
            .prefix_cache
            .then(|| PrefixCache::new(page_size, pool.layout().fingerprint()));
        Self {
            budget: PrefillBudget::new(cfg.prefill_chunk, page_size, cfg.step_target),
            cfg,
            pool,
            vocab,
            grammars: Arc::new(Grammars::new(token_bytes.clone(), eog.clone())),
            token_bytes,
            eog,
            context,
            waiting: VecDeque::new(),
            running: Vec::new(),
            loading: Vec::new(),
            fetches: 0,
            parked: Vec::new(),
            ready: VecDeque::new(),
            exports: HashMap::new(),
            pending: Vec::new(),
            stalled: false,
            blocked: false,
            ids: HashSet::new(),
            captured: HashMap::new(),
            preemptions: 0,
            cache,
            host: None,
            host_generation: 0,
            host_stats: HostStats::default(),
            gathering: HashMap::new(),
            followers: HashMap::new(),
        }
    }

    pub(crate) fn free_pages(&self) -> usize {
        self.pool.free_pages()
    }

    pub(crate) fn cached_pages(&self) -> usize {
        self.cache
            .as_ref()
            .map_or(0, |c| c.evictable_pages(&self.pool))
    }

    pub(crate) fn cache_stats(&self) -> PrefixCacheStats {
        self.cache
            .as_ref()
            .map_or_else(Default::default, PrefixCache::stats)
    }

    pub(crate) fn set_host_tier(&mut self, host: Box<dyn HostTier>, policy: WritePolicy) {
        assert!(self.cache.is_some(), "the host tier needs the prefix cache");
        self.host = Some((host, policy));
    }

    pub(crate) fn set_host_waker(&mut self, waker: std::task::Waker) {
        if let Some((host, _)) = &mut self.host {
            host.set_waker(waker);
        }
    }

    pub(crate) fn awaiting_host(&self) -> usize {
        self.loading.len()
    }

    pub(crate) fn host_stats(&self) -> HostStats {
        let mut st = self.host_stats;
        if let Some((host, _)) = &self.host {
            let w = host.store_stats();
            st.written_pages = w.written_pages;
            st.written_bytes = w.written_bytes;
            st.written_seconds = w.written_seconds;
            st.dropped_pages = w.dropped_pages;
            st.queued_pages = w.queued_pages;
        }
        st
    }

    pub(crate) fn record_cache_events(&mut self) {
        if let Some(c) = &mut self.cache {
            c.record_events();
        }
    }

    pub(crate) fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.cache
            .as_mut()
            .map(PrefixCache::take_events)
            .unwrap_or_default()
    }

    pub(crate) fn cache_snapshot(&self) -> Vec<CacheEvent> {
        self.cache
            .as_ref()
            .map(PrefixCache::snapshot)
            .unwrap_or_default()
    }

    pub(crate) fn flush_cache(&mut self) -> usize {
        self.check_host_generation();
        self.evict_cached(usize::MAX)
    }

    pub(crate) fn pool(&self) -> &PagePool {
        &self.pool
    }

    pub(crate) fn has_work(&self) -> bool {
        (!self.running.is_empty() && !self.blocked)
            || !self.ready.is_empty()
            || !self.pending.is_empty()
            || (!self.waiting.is_empty() && !self.stalled)
            || self.host.as_ref().is_some_and(|(h, _)| h.has_fetched())
    }

    pub(crate) fn preemptions(&self) -> u64 {
        self.preemptions
    }

    pub(crate) fn load_counts(&self) -> (usize, usize) {
        (
            self.waiting.len() + self.ready.len() + self.loading.len(),
            self.running.len(),
        )
    }

    pub(crate) fn reserved(&self) -> (usize, usize) {
        (
            self.parked.len(),
            self.parked.iter().map(|s| s.pages.len()).sum(),
        )
    }

    pub(crate) fn exports(&self) -> (usize, usize) {
        (
            self.exports.len(),
            self.exports.values().map(Vec::len).sum(),
        )
    }

    pub(crate) fn grammar_compiler(&self) -> GrammarCompiler {
        GrammarCompiler(self.grammars.clone())
    }

    pub(crate) fn submit(&mut self, req: GenRequest) -> Result<(), EngineError> {
        self.submit_part(req, Part::Whole)
    }

    pub(crate) fn submit_part(&mut self, req: GenRequest, part: Part) -> Result<(), EngineError> {
        self.check_queue()?;
        let s = self.new_seq(req, part)?;
        self.queue(s);
        Ok(())
    }

    /// Refuses a new request while [`EngineConfig::max_queued`] wait already.
    fn check_queue(&self) -> Result<(), EngineError> {
        match self.cfg.max_queued {
            Some(limit) if self.waiting.len() + self.ready.len() >= limit => {
                Err(EngineError::QueueFull { limit })
            }
            _ => Ok(()),
        }
    }

    fn queue(&mut self, s: Seq) {
        self.waiting.push_back(s);
        self.stalled = false;
        self.blocked = false;
    }

    /// A checked request as a sequence (its id now taken).
    fn new_seq(&mut self, req: GenRequest, part: Part) -> Result<Seq, EngineError> {
        req.params.validate()?;
        let n = req.prompt.len();
        if n == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        if n >= self.context {
            return Err(EngineError::PromptTooLong {
                prompt: n,
                context: self.context,
            });
        }
        if let Some(m) = req.params.max_tokens
            && n + m as usize > self.context
        {
            return Err(EngineError::MaxTokensTooLarge {
                prompt: n,
                max_tokens: m as usize,
                context: self.context,
            });
        }
        let vocab = self.vocab;
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::TokenOutOfRange { token: bad, vocab });
        }
        if let Some(&(t, _)) = req
            .params
            .logit_bias
            .iter()
            .find(|(t, _)| *t as usize >= vocab)
        {
            return Err(EngineError::InvalidParam {
                field: "logit_bias",
                msg: format!("token {t} is outside the vocabulary ({vocab} tokens)"),
            });
        }
        if self.ids.contains(req.id.as_str()) {
            return Err(EngineError::DuplicateId(req.id));
        }
        let constraint = match &req.params.grammar {
            Some(g) => Some(Box::new(self.grammars.matcher(g)?)),
            None => None,
        };
        let max_new = req
            .params
            .max_tokens
            .map_or(self.context - n, |m| m as usize);
        // The sequence must fit in the pool on its own, or it could never finish.
        let need = self.pool.pages_for_tokens(n + max_new);
        let need_now = self.pool.pages_for_tokens(n + 1);
        if need_now > self.pool.total_pages()
            || (req.params.max_tokens.is_some() && need > self.pool.total_pages())
        {
            return Err(EngineError::TooLargeForPool {
                need: need.max(need_now),
                total: self.pool.total_pages(),
                pages: "KV pages",
            });
        }
        // A prefill hands its prompt over whole: every page keeps its window layers.
        let windows = self.pool.total_window_pages();
        if part == Part::Prefill && windows > 0 && need_now > windows {
            return Err(EngineError::TooLargeForPool {
                need: need_now,
                total: windows,
                pages: "window KV pages (a prefill keeps its prompt's; see --kv-window-pages)",
            });
        }
        let id: Arc<str> = Arc::from(req.id.as_str());
        self.ids.insert(id.clone());
        Ok(Seq {
            id,
            tokens: req.prompt,
            prompt_len: n,
            computed: 0,
            cached: None,
            pages: Vec::new(),
            behind: Vec::new(),
            sampler: Sampler::new(req.params.seed),
            params: req.params,
            max_new,
            tail: Vec::new(),
            logits: Vec::new(),
            part,
            constraint,
            held: 0,
            prompt_lp: Vec::new(),
            group: None,
        })
    }

    pub(crate) fn abort(&mut self, id: &str) -> bool {
        let exported = self.drop_export(id);
        if !self.ids.remove(id) {
            return exported;
        }
        self.stalled = false;
        self.blocked = false;
        let mut gone = None;
        if let Some(i) = self.parked.iter().position(|s| &*s.id == id) {
            // Its KV never arrived: nothing computed to keep.
            let s = self.parked.remove(i);
            self.release(s.pages);
        } else if let Some(i) = self.waiting.iter().position(|s| &*s.id == id) {
            gone = self.waiting.remove(i);
        } else if let Some(i) = self.ready.iter().position(|s| &*s.id == id) {
            gone = self.ready.remove(i);
        } else if let Some(i) = self.running.iter().position(|s| &*s.id == id) {
            gone = Some(self.running.remove(i));
        } else if let Some(i) = self.loading.iter().position(|l| &*l.seq.id == id) {
            // Nothing computed yet: its pages go back; a late answer finds no ticket.
            gone = Some(self.loading.remove(i).seq);
        } else {
            // A choice waiting for its group's prompt, or for its group's other choices,
            // holds nothing yet.
            for fs in self.followers.values_mut() {
                fs.retain(|s| &*s.id != id);
            }
            self.followers.retain(|_, fs| !fs.is_empty());
            let gathering = self
                .gathering
                .iter_mut()
                .find(|(_, g)| g.seqs.iter().any(|s| &*s.id == id));
            if let Some((name, g)) = gathering {
                g.seqs.retain(|s| &*s.id != id);
                g.gone += 1;
                let name = name.clone();
                self.release_gathered(&name);
            }
        }
        if let Some(mut s) = gone {
            self.retire_pages(&mut s);
            self.promote_follower(&mut s);
        }
        true
    }

    pub(crate) fn take_logits(&mut self, id: &str) -> Option<Vec<Vec<f32>>> {
        self.captured.remove(id)
    }
}

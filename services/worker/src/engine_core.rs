//! The engine's bookkeeping outside actix: which request's events go to which client
//! channel, what an abort or a departed client does, and how a panicking step takes the
//! engine offline instead of the process. Plain code, so unit tests drive it with a fake
//! engine and no actor system.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use pdmesh_engine::{
    Engine, EngineError, FinishReason, GenRequest, HostStats, Logprob, ModelInfo, Part, StepEvent,
};
use pdmesh_kv::{CacheEvent, PrefixCacheStats};
use tokio::sync::mpsc::UnboundedSender;

/// The clock stage times are read from: the system's; in unit tests, one the test moves.
#[cfg(not(test))]
fn now() -> Instant {
    Instant::now()
}
#[cfg(test)]
use tests::clock::now;

/// What the engine does for [`EngineCore`]; implemented by [`pdmesh_engine::Engine`].
pub(crate) trait Backend {
    fn info(&self) -> ModelInfo;
    fn free_pages(&self) -> usize;
    /// Pages only the prefix cache holds.
    fn cached_pages(&self) -> usize {
        0
    }
    fn cache_stats(&self) -> PrefixCacheStats {
        PrefixCacheStats::default()
    }
    fn host_stats(&self) -> HostStats {
        HostStats::default()
    }
    /// Changes to the device prefix cache since the last call (for routers).
    fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        Vec::new()
    }
    /// Every page the device prefix cache holds now, as events.
    fn cache_snapshot(&self) -> Vec<CacheEvent> {
        Vec::new()
    }
    /// Evicts every cached page no request uses; how many were freed.
    fn flush_cache(&mut self) -> usize {
        0
    }
    /// `group`: the prompt group of a choice of an `n` > 1 request (see
    /// [`Engine::submit_shared`]).
    fn submit(
        &mut self,
        req: GenRequest,
        part: Part,
        group: Option<(&str, usize)>,
    ) -> Result<(), EngineError>;
    fn abort(&mut self, id: &str) -> bool;
    fn step(&mut self) -> Vec<StepEvent>;
    fn has_work(&self) -> bool;
    /// Requests waiting, holding reserved pages (decode), running; reserved pages.
    fn load(&self) -> Load {
        Load::default()
    }
    fn export(&mut self, id: &str, f: ExportFn) -> Result<Vec<u64>, EngineError> {
        let _ = f;
        Err(EngineError::Transfer(format!(
            "{id:?}: this engine exports nothing"
        )))
    }
    fn drop_export(&mut self, _id: &str) -> bool {
        false
    }
    fn import(
        &mut self,
        id: &str,
        _token: u32,
        _logprob: Option<Logprob>,
        _cached: usize,
        _fill: ImportFn,
    ) -> Result<Vec<StepEvent>, EngineError> {
        Err(EngineError::Transfer(format!(
            "{id:?}: this engine imports nothing"
        )))
    }
}

/// Writes a prefilled prompt's pages somewhere; returns each page's checksum.
pub(crate) type ExportFn = Box<dyn FnOnce(&[&[u8]]) -> Vec<u64> + Send>;
/// Fills a decode request's reserved pages; an error names what did not arrive intact.
pub(crate) type ImportFn =
    Box<dyn FnOnce(&mut [&mut [u8]]) -> Result<(), pdmesh_engine::FillError> + Send>;

/// Where the engine's requests are now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    pub waiting: usize,
    pub reserved: usize,
    pub running: usize,
    pub reserved_pages: usize,
    /// Prefilled prompts whose pages wait for export, and those pages.
    pub exports: usize,
    pub export_pages: usize,
    /// Of `waiting`, admitted requests whose prompt pages come from the host tier.
    pub fetching: usize,
}

impl Backend for Engine {
    fn info(&self) -> ModelInfo {
        Engine::info(self)
    }
    fn free_pages(&self) -> usize {
        Engine::free_pages(self)
    }
    fn cached_pages(&self) -> usize {
        Engine::cached_pages(self)
    }
    fn cache_stats(&self) -> PrefixCacheStats {
        Engine::cache_stats(self)
    }
    fn host_stats(&self) -> HostStats {
        Engine::host_stats(self)
    }
    fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        Engine::take_cache_events(self)
    }
    fn cache_snapshot(&self) -> Vec<CacheEvent> {
        Engine::cache_snapshot(self)
    }
    fn flush_cache(&mut self) -> usize {
        Engine::flush_cache(self)
    }
    fn submit(
        &mut self,
        req: GenRequest,
        part: Part,
        group: Option<(&str, usize)>,
    ) -> Result<(), EngineError> {
        match group {
            Some((g, n)) => Engine::submit_shared(self, req, part, g, n),
            None => Engine::submit_part(self, req, part),
        }
    }
    fn abort(&mut self, id: &str) -> bool {
        Engine::abort(self, id)
    }
    fn step(&mut self) -> Vec<StepEvent> {
        Engine::step(self)
    }
    fn has_work(&self) -> bool {
        Engine::has_work(self)
    }
    fn load(&self) -> Load {
        let (waiting, running) = self.load_counts();
        let (reserved, reserved_pages) = self.reserved();
        let (exports, export_pages) = self.exports();
        Load {
            waiting,
            reserved,
            running,
            reserved_pages,
            exports,
            export_pages,
            fetching: self.awaiting_host(),
        }
    }
    fn export(&mut self, id: &str, f: ExportFn) -> Result<Vec<u64>, EngineError> {
        Engine::export(self, id, f)
    }
    fn drop_export(&mut self, id: &str) -> bool {
        Engine::drop_export(self, id)
    }
    fn import(
        &mut self,
        id: &str,
        token: u32,
        logprob: Option<Logprob>,
        cached: usize,
        fill: ImportFn,
    ) -> Result<Vec<StepEvent>, EngineError> {
        Engine::import(self, id, token, logprob, cached, fill)
    }
}

/// The end of one generation.
#[derive(Clone, Debug, PartialEq)]
pub struct Finish {
    pub reason: FinishReason,
    pub matched_stop: Option<String>,
    pub matched_token: Option<u32>,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
    /// Of `cached_tokens`, those loaded from the host tier.
    pub host_cached_tokens: u32,
    /// Prompt tokens whose KV arrived from a prefill worker.
    pub transferred_tokens: u32,
    pub stages: Stages,
}

/// Seconds a request spent in each stage (0: a stage it did not pass here).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stages {
    /// Submitted until admitted (pages found for it; for decode, its reservation).
    pub queue: f64,
    /// Admitted until the first token.
    pub prefill: f64,
    /// First token until the prompt's KV is verified in the decode pool (disaggregated).
    pub transfer: f64,
    /// First token until the last.
    pub decode: f64,
}

/// What a client receives for its request: tokens, then exactly one `Finished`.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token {
        token: u32,
        logprob: Option<Logprob>,
    },
    Finished(Finish),
    /// The prompt's log-probabilities: `tokens` are the prompt's after its first, with
    /// their `logprobs`. Before the first token.
    PromptLogprobs {
        tokens: Vec<u32>,
        logprobs: Vec<Logprob>,
    },
    /// Prefill: the first token; the prompt's KV (`pages` pages) waits for export.
    Exported {
        token: u32,
        logprob: Option<Logprob>,
        pages: usize,
        cached: usize,
        /// Of `cached`, the tokens loaded from the host tier.
        host_cached: usize,
        /// Queue and prefill times so far.
        stages: Stages,
    },
    /// Decode: `pages` pages are reserved for the prompt's KV; the first `held` were in
    /// this worker's prefix cache, so only the rest travel.
    Reserved {
        pages: usize,
        held: usize,
    },
    /// The request ended with this error: its batch's forward pass failed on the GPU.
    Failed(pdmesh_engine::CudaError),
}

/// A running request: where its events go and what it has produced so far.
struct Entry {
    /// Distinguishes this submission from a later one that reuses the request id.
    ticket: u64,
    tx: UnboundedSender<Event>,
    prompt_tokens: u32,
    completion_tokens: u32,
    host_cached: u32,
    /// When it was submitted, admitted, and produced its first token.
    submitted: Instant,
    admitted: Option<Instant>,
    first: Option<Instant>,
}

impl Entry {
    /// Its stage times until `now` (admission and first token default to `now`).
    fn stages(&self, now: Instant) -> Stages {
        let admitted = self.admitted.unwrap_or(now);
        let first = self.first.unwrap_or(now);
        Stages {
            queue: admitted.duration_since(self.submitted).as_secs_f64(),
            prefill: first.duration_since(admitted).as_secs_f64(),
            transfer: 0.0,
            decode: now.duration_since(first).as_secs_f64(),
        }
    }
}

/// The engine plus the routing table from request id to client channel.
pub(crate) struct EngineCore<B> {
    /// `None` once a step panicked: the engine's state can no longer be trusted.
    engine: Option<B>,
    requests: HashMap<String, Entry>,
    /// Prefilled requests whose pages wait for their hand-over (their entries are gone,
    /// as the prefill finished), with the ticket of the submission that holds them.
    exported: HashMap<String, u64>,
}

impl<B: Backend> EngineCore<B> {
    pub(crate) fn new(engine: B) -> Self {
        Self {
            engine: Some(engine),
            requests: HashMap::new(),
            exported: HashMap::new(),
        }
    }

    /// A core without an engine: every request is answered `Offline`.
    pub(crate) fn offline() -> Self {
        Self {
            engine: None,
            requests: HashMap::new(),
            exported: HashMap::new(),
        }
    }

    /// See [`Backend::take_cache_events`]; nothing once offline.
    pub(crate) fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.engine
            .as_mut()
            .map(Backend::take_cache_events)
            .unwrap_or_default()
    }

    /// See [`Backend::cache_snapshot`]; nothing once offline.
    pub(crate) fn cache_snapshot(&self) -> Vec<CacheEvent> {
        self.engine
            .as_ref()
            .map(Backend::cache_snapshot)
            .unwrap_or_default()
    }

    /// See [`Backend::flush_cache`]; `Offline` once the engine is gone.
    pub(crate) fn flush_cache(&mut self) -> Result<usize, EngineError> {
        Ok(self.engine()?.flush_cache())
    }

    fn engine(&mut self) -> Result<&mut B, EngineError> {
        self.engine.as_mut().ok_or(EngineError::Offline)
    }

    /// Hands `req` to the engine; on success its events will be sent on `tx`.
    pub(crate) fn submit(
        &mut self,
        req: GenRequest,
        part: Part,
        group: Option<(&str, usize)>,
        ticket: u64,
        tx: UnboundedSender<Event>,
    ) -> Result<(), EngineError> {
        let id = req.id.clone();
        let prompt_tokens = u32::try_from(req.prompt.len()).unwrap_or(u32::MAX);
        self.engine()?.submit(req, part, group)?;
        self.requests.insert(
            id,
            Entry {
                ticket,
                tx,
                prompt_tokens,
                completion_tokens: 0,
                host_cached: 0,
                submitted: now(),
                admitted: None,
                first: None,
            },
        );
        Ok(())
    }

    /// Aborts request `id` (only the submission `ticket`, when given): its pages are freed
    /// and its client gets `Finished(Abort)`; a prefill's pages held for export are let go
    /// of too. Returns whether such a request was running or held pages.
    pub(crate) fn abort(&mut self, id: &str, ticket: Option<u64>) -> bool {
        let held = self
            .exported
            .get(id)
            .is_some_and(|&t| ticket.is_none_or(|w| w == t));
        let dropped = held && {
            self.exported.remove(id);
            self.engine.as_mut().is_some_and(|e| e.drop_export(id))
        };
        let Some(entry) = self.requests.get(id) else {
            return dropped;
        };
        if ticket.is_some_and(|t| t != entry.ticket) {
            return dropped;
        }
        let entry = self.requests.remove(id).expect("entry checked above");
        self.exported.remove(id);
        if let Some(engine) = self.engine.as_mut() {
            engine.abort(id);
        }
        let _ = entry.tx.send(Event::Finished(Finish {
            reason: FinishReason::Abort,
            matched_stop: None,
            matched_token: None,
            prompt_tokens: entry.prompt_tokens,
            completion_tokens: entry.completion_tokens,
            cached_tokens: 0,
            host_cached_tokens: 0,
            transferred_tokens: 0,
            stages: entry.stages(now()),
        }));
        true
    }

    /// Aborts every running request (shutdown).
    pub(crate) fn abort_all(&mut self) -> usize {
        let ids: Vec<String> = self.requests.keys().cloned().collect();
        ids.iter().filter(|id| self.abort(id, None)).count()
    }

    /// Whether another step would do anything.
    pub(crate) fn has_work(&self) -> bool {
        self.engine.as_ref().is_some_and(|e| e.has_work())
    }

    /// Drops requests whose client left, then runs one engine step and routes its events.
    pub(crate) fn step(&mut self) {
        self.drop_departed();
        let Some(engine) = self.engine.as_mut() else {
            return;
        };
        if !engine.has_work() {
            return;
        }
        let events = match catch_unwind(AssertUnwindSafe(|| engine.step())) {
            Ok(events) => events,
            Err(_) => {
                tracing::error!(
                    running = self.requests.len(),
                    "engine step panicked; the engine is offline"
                );
                // Dropping the senders ends every stream without a Finished: clients see
                // the engine as unavailable.
                self.engine = None;
                self.requests.clear();
                self.exported.clear();
                return;
            }
        };
        for event in events {
            self.route(event);
        }
    }

    /// Hands the pages held for prefilled request `id` to `f` and lets them go, if they
    /// are submission `ticket`'s: an earlier submission of the same id (the gateway tried
    /// the request again after aborting it here) holds nothing any more.
    pub(crate) fn export(
        &mut self,
        id: &str,
        ticket: u64,
        f: ExportFn,
    ) -> Result<Vec<u64>, EngineError> {
        if !self.holds_export(id, ticket) {
            return Err(EngineError::Transfer(format!(
                "no prefilled pages held for {id:?}: this submission of it was aborted"
            )));
        }
        self.exported.remove(id);
        self.engine()?.export(id, f)
    }

    /// Lets go of the pages held for prefilled request `id` if they are submission
    /// `ticket`'s; a stale submission's late call leaves a newer one's pages alone.
    pub(crate) fn drop_export(&mut self, id: &str, ticket: u64) -> bool {
        self.holds_export(id, ticket)
            && self.exported.remove(id).is_some()
            && self.engine.as_mut().is_some_and(|e| e.drop_export(id))
    }

    /// Whether the pages held for export under `id` are submission `ticket`'s.
    fn holds_export(&self, id: &str, ticket: u64) -> bool {
        self.exported.get(id) == Some(&ticket)
    }

    /// Whether `ticket` is the running submission of request `id`.
    fn is_current(&self, id: &str, ticket: u64) -> bool {
        self.requests.get(id).is_some_and(|e| e.ticket == ticket)
    }

    /// Gives decode request `id` its prompt's KV and first token; the first token's events
    /// reach its client before any later step's.
    pub(crate) fn import(
        &mut self,
        (id, ticket): (&str, u64),
        token: u32,
        logprob: Option<Logprob>,
        cached: usize,
        fill: ImportFn,
    ) -> Result<(), EngineError> {
        if !self.is_current(id, ticket) {
            return Err(EngineError::Transfer(format!(
                "{id:?} holds no reserved pages: this submission of it was aborted"
            )));
        }
        let events = self.engine()?.import(id, token, logprob, cached, fill)?;
        for event in events {
            self.route(event);
        }
        Ok(())
    }

    fn route(&mut self, event: StepEvent) {
        match event {
            StepEvent::Token { id, token, logprob } => {
                let Some(entry) = self.requests.get_mut(&*id) else {
                    return;
                };
                entry.completion_tokens += 1;
                entry.first.get_or_insert_with(now);
                if entry.tx.send(Event::Token { token, logprob }).is_err() {
                    self.client_left(&id);
                }
            }
            StepEvent::Finished {
                id,
                reason,
                matched_stop,
                matched_token,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            } => {
                if let Some(entry) = self.requests.remove(&*id) {
                    let _ = entry.tx.send(Event::Finished(Finish {
                        reason,
                        matched_stop,
                        matched_token,
                        prompt_tokens,
                        completion_tokens,
                        cached_tokens,
                        host_cached_tokens: entry.host_cached.min(cached_tokens),
                        transferred_tokens: 0,
                        stages: entry.stages(now()),
                    }));
                }
            }
            StepEvent::Exported {
                id,
                token,
                logprob,
                pages,
                cached,
            } => {
                let mut ticket = None;
                let sent = self.requests.get_mut(&*id).is_some_and(|entry| {
                    ticket = Some(entry.ticket);
                    let at = now();
                    entry.first.get_or_insert(at);
                    let ev = Event::Exported {
                        token,
                        logprob,
                        pages,
                        cached,
                        host_cached: (entry.host_cached as usize).min(cached),
                        stages: entry.stages(at),
                    };
                    entry.tx.send(ev).is_ok()
                });
                match ticket {
                    // Its hand-over names this submission when it takes the pages.
                    Some(t) if sent => {
                        self.exported.insert(id.to_string(), t);
                    }
                    _ => {
                        // Nobody will send these pages.
                        self.exported.remove(&*id);
                        if let Some(engine) = self.engine.as_mut() {
                            engine.drop_export(&id);
                        }
                    }
                }
            }
            StepEvent::Admitted {
                id,
                host_cached,
                at,
                ..
            } => {
                if let Some(entry) = self.requests.get_mut(&*id) {
                    entry.admitted = Some(at);
                    entry.host_cached = u32::try_from(host_cached).unwrap_or(u32::MAX);
                }
            }
            StepEvent::PromptLogprobs {
                id,
                tokens,
                logprobs,
            } => {
                let Some(entry) = self.requests.get_mut(&*id) else {
                    return;
                };
                if entry
                    .tx
                    .send(Event::PromptLogprobs { tokens, logprobs })
                    .is_err()
                {
                    self.client_left(&id);
                }
            }
            StepEvent::Failed { id, error } => {
                if let Some(entry) = self.requests.remove(&*id) {
                    let _ = entry.tx.send(Event::Failed(error));
                }
            }
            StepEvent::Reserved { id, pages, held } => {
                let Some(entry) = self.requests.get_mut(&*id) else {
                    return;
                };
                entry.admitted = Some(now());
                if entry.tx.send(Event::Reserved { pages, held }).is_err() {
                    self.client_left(&id);
                }
            }
        }
    }

    /// Aborts every request whose receiver is gone.
    fn drop_departed(&mut self) {
        let gone: Vec<String> = self
            .requests
            .iter()
            .filter(|(_, e)| e.tx.is_closed())
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            self.client_left(&id);
        }
    }

    fn client_left(&mut self, id: &str) {
        tracing::debug!(request_id = id, "client left; aborting");
        self.requests.remove(id);
        if let Some(engine) = self.engine.as_mut() {
            engine.abort(id);
        }
    }

    /// The model's facts and the pool's state right now.
    pub(crate) fn info(&self) -> Result<(ModelInfo, PoolNow), EngineError> {
        let engine = self.engine.as_ref().ok_or(EngineError::Offline)?;
        let pool = PoolNow {
            free_pages: engine.free_pages(),
            cached_pages: engine.cached_pages(),
            cache: engine.cache_stats(),
            host: engine.host_stats(),
            load: engine.load(),
        };
        Ok((engine.info(), pool))
    }
}

/// The KV pool's state at one moment.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PoolNow {
    pub free_pages: usize,
    pub cached_pages: usize,
    pub cache: PrefixCacheStats,
    pub host: HostStats,
    pub load: Load,
}

#[cfg(test)]
mod tests;

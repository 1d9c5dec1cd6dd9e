//! Prefill/decode hand-overs: a prefill holds its prompt's pages until they are exported
//! (or dropped); a decode reserves pages for the prompt (see the planner) and imports
//! them with the first token, then generates as a unified engine would.

use std::collections::HashMap;
use std::sync::Arc;

use pdmesh_kv::{PageId, PagePool};

use super::Scheduler;
use super::sample::after_sample;
use super::seq::Seq;
use crate::{EngineError, FinishReason, Logprob, StepEvent};

impl Scheduler {
    pub(crate) fn export<R>(
        &mut self,
        id: &str,
        f: impl FnOnce(&[&[u8]]) -> R,
    ) -> Result<R, EngineError> {
        let pages = self
            .exports
            .remove(id)
            .ok_or_else(|| EngineError::Transfer(format!("no prefilled pages held for {id:?}")))?;
        let out = {
            let whole: Result<Vec<_>, _> = pages.iter().map(|&p| self.pool.page(p)).collect();
            match whole {
                Ok(whole) => Ok(f(&whole.iter().map(|b| &b[..]).collect::<Vec<_>>())),
                Err(e) => Err(EngineError::Transfer(format!(
                    "prefilled pages of {id:?}: {e}"
                ))),
            }
        };
        self.release(pages);
        self.stalled = false;
        self.blocked = false;
        out
    }

    pub(crate) fn drop_export(&mut self, id: &str) -> bool {
        match self.exports.remove(id) {
            Some(pages) => {
                self.release(pages);
                self.stalled = false;
                self.blocked = false;
                true
            }
            None => false,
        }
    }

    pub(crate) fn import(
        &mut self,
        id: &str,
        first_token: u32,
        logprob: Option<Logprob>,
        cached: usize,
        fill: impl FnOnce(&mut [&mut [u8]]) -> Result<(), crate::FillError>,
    ) -> Result<Vec<StepEvent>, EngineError> {
        let i = self
            .parked
            .iter()
            .position(|s| &*s.id == id)
            .ok_or_else(|| EngineError::Transfer(format!("{id:?} holds no reserved pages")))?;
        if first_token as usize >= self.vocab {
            return Err(EngineError::Transfer(format!(
                "first token {first_token} is outside the vocabulary"
            )));
        }
        if let Some(c) = &mut self.parked[i].constraint {
            c.commit(first_token, &self.eog).map_err(|e| {
                EngineError::Transfer(format!(
                    "first token {first_token} breaks the request's grammar: {e}"
                ))
            })?;
        }
        let held = self.parked[i].held;
        if self.pool.layout().is_hybrid() {
            // A hybrid's pages are not one piece in the pool: the pages arrive whole
            // and each keeps the layers it holds (see the reservation).
            let bpp = self.pool.layout().bytes_per_page();
            let n = self.parked[i].pages.len() - held;
            let mut whole = vec![vec![0u8; bpp]; n];
            let mut bufs: Vec<&mut [u8]> = whole.iter_mut().map(|b| &mut b[..]).collect();
            fill(&mut bufs).map_err(EngineError::Fill)?;
            for (&p, bytes) in self.parked[i].pages[held..].iter().zip(&whole) {
                self.pool
                    .write_page(p, bytes)
                    .expect("reserved pages are allocated, arrived pages whole");
            }
        } else {
            let mut bufs = self
                .pool
                .pages_mut(&self.parked[i].pages[held..])
                .expect("reserved pages are allocated");
            fill(&mut bufs).map_err(EngineError::Fill)?;
        }
        let mut s = self.parked.remove(i);
        s.computed = s.prompt_len;
        // What the prefill side found cached is what this request was spared.
        s.cached = Some(cached.min(s.prompt_len));
        s.sampler.skip_sample(&s.params);
        s.sampler.record(first_token);
        s.tokens.push(first_token);
        let mut events = Vec::new();
        let finished = self.after_sample(&mut s, first_token, logprob, &mut events);
        self.stalled = false;
        self.blocked = false;
        if finished {
            self.ids.remove(&s.id);
            self.retire_pages(&mut s);
        } else if self.running.len() < self.cfg.max_batch {
            self.running.push(s);
        } else {
            self.ready.push_back(s);
        }
        Ok(events)
    }

    /// Emits the events for a token just appended to `s`; whether `s` is finished.
    pub(super) fn after_sample(
        &self,
        s: &mut Seq,
        tok: u32,
        logprob: Option<Logprob>,
        events: &mut Vec<StepEvent>,
    ) -> bool {
        after_sample(
            s,
            tok,
            logprob,
            (&self.eog, &self.token_bytes, self.context),
            events,
        )
    }
}

/// A prefill's prompt is done: its pages are held (one more reference each) for
/// [`Engine::export`], and its first token reported.
pub(super) fn hold_export(
    pool: &mut PagePool,
    exports: &mut HashMap<Arc<str>, Vec<PageId>>,
    s: &Seq,
    tok: u32,
    logprob: Option<Logprob>,
    events: &mut Vec<StepEvent>,
) {
    let n = pool.pages_for_tokens(s.prompt_len);
    let held = s.pages[..n].to_vec();
    for &p in &held {
        pool.retain(p).expect("the sequence holds its pages");
    }
    if let Some(old) = exports.insert(s.id.clone(), held) {
        pool.release_all(&old).expect("held pages are allocated");
    }
    events.push(StepEvent::Exported {
        id: s.id.clone(),
        token: tok,
        logprob,
        pages: n,
        cached: s.cached.unwrap_or(0),
    });
    events.push(s.finished((FinishReason::Length, None, None), 1));
}

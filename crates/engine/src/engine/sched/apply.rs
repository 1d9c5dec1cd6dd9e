//! Phases two and three of a step: running the forward pass the engine gives over the
//! plan's tokens, then sampling (grammar masks, `min_tokens`, penalties), stop checks,
//! and retirement. Sampling state advances exactly as it would for the sequence alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdmesh_kv::{PageId, PagePool};

use super::handover::hold_export;
use super::sample::{after_sample, prompt_logprobs, sample_row};
use super::{Scheduler, StepPlan};
use crate::grammar::Constraint;
use crate::model::BatchToken;
use crate::{CudaError, Logprob, Part, StepEvent};

impl Scheduler {
    /// Phase two: runs `forward` (the model's pass over the pool) on the plan's tokens,
    /// preparing the grammar masks of the tokens this step samples on another thread
    /// meanwhile. Returns the logits rows, in the plan's order, or the pass's failure.
    pub(crate) fn execute<E>(
        &mut self,
        plan: &StepPlan,
        forward: impl FnOnce(&mut PagePool, &[&[PageId]], &[BatchToken]) -> Result<Vec<Vec<f32>>, E>,
    ) -> Result<Vec<Vec<f32>>, E> {
        let plan = &plan.work;
        // A sequence with one token left to compute is decoding; the rest are prompts.
        let decoded = plan
            .iter()
            .filter(|&&(i, _)| self.running[i].tokens.len() - self.running[i].computed == 1)
            .count();
        let mut batch = Vec::new();
        for (slot, &(i, take)) in plan.iter().enumerate() {
            let s = &self.running[i];
            for pos in s.computed..s.computed + take {
                batch.push(BatchToken {
                    seq: slot,
                    pos,
                    token: s.tokens[pos],
                    want_logits: s.wants_logits(pos),
                });
            }
        }
        // Grammar masks for the tokens this step samples are computed on another thread
        // while the forward pass runs.
        let mut masks: Vec<(usize, Box<Constraint>)> = Vec::new();
        for &(i, take) in plan {
            let s = &mut self.running[i];
            if s.computed + take >= s.tokens.len()
                && let Some(c) = s.constraint.take()
            {
                masks.push((i, c));
            }
        }
        let seq_pages: Vec<&[PageId]> = plan
            .iter()
            .map(|&(i, _)| self.running[i].pages.as_slice())
            .collect();
        let pool = &mut self.pool;
        let mut took = Duration::ZERO;
        let logits = std::thread::scope(|scope| {
            let prep = (!masks.is_empty()).then(|| {
                scope.spawn(|| {
                    for (_, c) in &mut masks {
                        c.prepare();
                    }
                })
            });
            let started = Instant::now();
            let logits = forward(pool, &seq_pages, &batch);
            took = started.elapsed();
            if let Some(h) = prep {
                h.join().expect("grammar mask thread panicked");
            }
            logits
        });
        drop(seq_pages);
        if logits.is_ok() {
            self.budget.observe(decoded, batch.len() - decoded, took);
        }
        for (i, c) in masks {
            self.running[i].constraint = Some(c);
        }
        logits
    }

    /// Phase three when the forward pass failed (a GPU's `error`): every sequence of the
    /// plan ends with it, releasing its pages as an abort does (the failed pass wrote none
    /// of their KV); the others go on.
    pub(crate) fn fail(&mut self, plan: StepPlan, error: &CudaError, events: &mut Vec<StepEvent>) {
        let ids: Vec<Arc<str>> = plan
            .work
            .iter()
            .map(|&(i, _)| self.running[i].id.clone())
            .collect();
        for id in ids {
            self.abort(&id);
            events.push(StepEvent::Failed {
                id,
                error: error.clone(),
            });
        }
    }

    /// Phase three: takes the logits rows in the plan's order: prompt log-probabilities,
    /// then for each sequence whose tokens are all computed, samples its next token,
    /// checks its stops, and retires finished ones (a prefill holds its pages for export);
    /// a group's prompt, once computed, starts its other choices.
    pub(crate) fn apply(
        &mut self,
        plan: StepPlan,
        logits: Vec<Vec<f32>>,
        events: &mut Vec<StepEvent>,
    ) {
        let mut logits = logits.into_iter();
        let mut done = Vec::new();
        let mut forks = Vec::new();
        for (i, take) in plan.work {
            let s = &mut self.running[i];
            let from = s.computed;
            s.computed += take;
            if let Some(k) = s.params.prompt_logprobs {
                for pos in (from..s.computed).filter(|&p| p + 1 < s.tokens.len()) {
                    if s.wants_logits(pos) {
                        let row = logits
                            .next()
                            .expect("a logits row per prompt position asked");
                        s.prompt_lp
                            .push(Logprob::of(&row, s.tokens[pos + 1], k as usize));
                    }
                }
            }
            if s.computed < s.tokens.len() {
                continue; // prompt not finished yet
            }
            let row = logits
                .next()
                .expect("one logits row per completed sequence");
            if s.generated() == 0 && s.group.take().is_some() {
                // The group's prompt is computed: the choices waiting for it take
                // references to its pages and the same logits.
                let n = self.pool.pages_for_tokens(s.prompt_len);
                for mut f in self.followers.remove(&s.id).unwrap_or_default() {
                    for &p in &s.pages[..n] {
                        self.pool.retain(p).expect("the sequence holds its pages");
                    }
                    f.pages = s.pages[..n].to_vec();
                    f.computed = s.prompt_len;
                    f.prompt_lp = s.prompt_lp.clone();
                    forks.push((f, row.clone()));
                }
            }
            prompt_logprobs(s, events);
            let (tok, logprob) = sample_row(s, row, &self.eog, self.cfg.capture_logits);
            if s.part == Part::Prefill {
                hold_export(&mut self.pool, &mut self.exports, s, tok, logprob, events);
                done.push(i);
                continue;
            }
            let ends = (&self.eog[..], &self.token_bytes[..], self.context);
            if after_sample(s, tok, logprob, ends, events) {
                done.push(i);
            }
        }
        done.sort_unstable();
        for &i in done.iter().rev() {
            let mut s = self.running.remove(i);
            self.ids.remove(&s.id);
            if self.cfg.capture_logits {
                self.captured
                    .insert(s.id.clone(), std::mem::take(&mut s.logits));
            }
            self.retire_pages(&mut s);
        }
        for (f, row) in forks {
            self.fork(f, row, events);
        }
    }
}

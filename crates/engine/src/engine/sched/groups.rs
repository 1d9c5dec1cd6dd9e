//! Prompt groups: the `n` > 1 choices of one request share their prompt. The group is
//! held until every choice has arrived; the first computes the prompt and the others take
//! references to its pages (the last, partly filled one copied) and its logits.

use std::sync::Arc;
use std::time::Instant;

use super::Scheduler;
use super::handover::hold_export;
use super::sample::{after_sample, prompt_logprobs, sample_row};
use super::seq::{Gathering, Seq};
use crate::{EngineError, GenRequest, Part, StepEvent};

impl Scheduler {
    pub(crate) fn submit_shared(
        &mut self,
        req: GenRequest,
        part: Part,
        group: &str,
        size: usize,
    ) -> Result<(), EngineError> {
        self.check_queue()?;
        let s = self.new_seq(req, part)?;
        if part == Part::Decode || size <= 1 {
            self.queue(s);
            return Ok(());
        }
        let g = self.gathering.entry(Arc::from(group)).or_insert(Gathering {
            size,
            seqs: Vec::new(),
            gone: 0,
        });
        g.seqs.push(s);
        self.release_gathered(group);
        Ok(())
    }

    /// Releases prompt group `group` once every choice has arrived or gone: the first
    /// computes the prompt, the others with the same prompt wait for it.
    pub(super) fn release_gathered(&mut self, group: &str) {
        let Some(g) = self.gathering.get(group) else {
            return;
        };
        if g.seqs.len() + g.gone < g.size {
            return;
        }
        let (name, g) = self.gathering.remove_entry(group).expect("present");
        let mut seqs = g.seqs.into_iter();
        let Some(mut leader) = seqs.next() else {
            return;
        };
        let mut followers = Vec::new();
        for s in seqs {
            if s.tokens == leader.tokens && s.part == leader.part {
                followers.push(s);
            } else {
                self.queue(s);
            }
        }
        if !followers.is_empty() {
            leader.group = Some(name);
            self.followers.insert(leader.id.clone(), followers);
        }
        self.queue(leader);
    }

    /// `s` leaves before computing its prompt for its group: the first choice waiting
    /// for it computes the prompt instead, for itself and the others.
    pub(super) fn promote_follower(&mut self, s: &mut Seq) {
        let group = s.group.take();
        let Some(mut fs) = self.followers.remove(&s.id) else {
            return;
        };
        let mut next = fs.remove(0);
        if !fs.is_empty() {
            next.group = group;
            self.followers.insert(next.id.clone(), fs);
        }
        self.waiting.push_back(next);
    }

    /// Starts choice `f` of a group from its leader's prompt (whose pages it references)
    /// and logits `row`.
    pub(super) fn fork(&mut self, mut f: Seq, row: Vec<f32>, events: &mut Vec<StepEvent>) {
        // Nothing of its prompt was computed for it.
        f.cached = Some(f.prompt_len);
        events.push(StepEvent::Admitted {
            id: f.id.clone(),
            device_cached: f.prompt_len,
            host_cached: 0,
            at: Instant::now(),
        });
        prompt_logprobs(&f, events);
        let (tok, logprob) = sample_row(&mut f, row, &self.eog, self.cfg.capture_logits);
        let finished = if f.part == Part::Prefill {
            hold_export(&mut self.pool, &mut self.exports, &f, tok, logprob, events);
            true
        } else {
            let ends = (&self.eog[..], &self.token_bytes[..], self.context);
            after_sample(&mut f, tok, logprob, ends, events)
        };
        if finished {
            self.ids.remove(&f.id);
            if self.cfg.capture_logits {
                self.captured
                    .insert(f.id.clone(), std::mem::take(&mut f.logits));
            }
            self.retire_pages(&mut f);
            return;
        }
        if !f.prompt_len.is_multiple_of(self.cfg.page_size) {
            // Copy on write: the prompt's last page is partly filled and this choice
            // writes its own tokens after the prompt's.
            let shared = *f.pages.last().expect("a prompt has pages");
            let fresh = match self.alloc(1) {
                Ok(p) if self.attach(&p) => Some(p),
                Ok(p) => {
                    self.release(p);
                    None
                }
                Err(_) => None,
            };
            let Some(fresh) = fresh else {
                // No page to copy into: it waits and recomputes, as a preempted sequence.
                self.retire_pages(&mut f);
                f.computed = 0;
                self.preemptions += 1;
                self.waiting.push_front(f);
                return;
            };
            self.pool
                .copy_page(fresh[0], shared)
                .expect("a prompt's last page is whole: every window reads it");
            self.release(vec![shared]);
            *f.pages.last_mut().expect("a prompt has pages") = fresh[0];
        }
        if self.running.len() < self.cfg.max_batch {
            self.running.push(f);
        } else {
            self.ready.push_back(f);
        }
    }
}

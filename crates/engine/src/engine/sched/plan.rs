//! Phase one of a step, the planner: admission by pages (host-tier fetches started,
//! decode-side reservations made), a page for every decoding sequence's next token
//! (preempting the newest when the pool is full), and the prompt tokens the step's budget
//! allows (chunked prefill). Its output is a plain [`StepPlan`].

use super::seq::Loading;

use super::Scheduler;
use crate::{FinishReason, Part, StepEvent};

/// What one forward pass computes: running sequences (by index, decoding ones first) and
/// how many of each one's tokens, from its first uncomputed one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct StepPlan {
    pub(crate) work: Vec<(usize, usize)>,
}

impl Scheduler {
    /// One scheduler iteration.
    /// Phase one of a step: admits what the pool allows, makes sure every decoding
    /// sequence has a page for its next token (preempting the newest when the pool is
    /// full), then gives prompts the step's token budget. Events of the planning
    /// (admissions, a sequence ended because the pool cannot hold it) go to `events`.
    /// `None`: nothing to compute this step.
    pub(crate) fn plan(&mut self, events: &mut Vec<StepEvent>) -> Option<StepPlan> {
        self.admit();
        self.drop_behind_windows();
        events.append(&mut self.pending);
        // (running index, tokens to compute this step)
        let mut plan: Vec<(usize, usize)> = Vec::new();
        self.stalled = self.running.is_empty() && !self.waiting.is_empty();
        let mut blocked = false;
        let mut i = 0;
        while i < self.running.len() {
            let pending = self.running[i].tokens.len() - self.running[i].computed;
            if pending == 1 {
                let upto = self.running[i].tokens.len();
                let fits = self.ensure_pages(i, upto);
                if !fits && self.running.len() > 1 {
                    // This is the newest sequence and nothing newer can give way: it
                    // waits (and is recomputed) until older ones finish.
                    self.preempt(i);
                    continue;
                }
                if !fits {
                    if let Some(mut r) = self.ready.pop_back() {
                        // KV waiting for a batch slot gives way; it is recomputed when
                        // its turn comes, as any preempted sequence.
                        self.retire_pages(&mut r);
                        r.computed = 0;
                        self.preemptions += 1;
                        self.waiting.push_front(r);
                        continue;
                    }
                    if !self.parked.is_empty() {
                        // The pool is not too small: pages are reserved for transfers
                        // under way. They come back soon — the KV arrives (and that
                        // sequence runs, and can give way) or the transfer's deadline
                        // passes — so this one waits instead of ending short.
                        blocked = true;
                        i += 1;
                        continue;
                    }
                    // Alone and still unable to grow: the pool is smaller than its
                    // context. End it rather than livelock.
                    let mut s = self.running.remove(i);
                    tracing::warn!(id = %s.id, pages = s.pages.len(), "KV pool exhausted by one sequence");
                    self.ids.remove(&s.id);
                    events.push(s.finished((FinishReason::Length, None, None), s.generated()));
                    if self.cfg.capture_logits {
                        self.captured
                            .insert(s.id.clone(), std::mem::take(&mut s.logits));
                    }
                    self.retire_pages(&mut s);
                    continue;
                }
                plan.push((i, 1));
            }
            i += 1;
        }
        let decodes = plan.len();
        let mut budget = self.budget.tokens(decodes);
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            let pending = s.tokens.len() - s.computed;
            if pending > 1 {
                let take = pending.min(budget);
                let upto = s.computed + take;
                if self.ensure_pages(i, upto) {
                    plan.push((i, take));
                    budget -= take;
                }
            }
            i += 1;
        }
        // Preemption may have shifted indices: drop entries that no longer exist.
        plan.retain(|&(i, _)| i < self.running.len());
        // Nothing to compute while the only sequence waits for reserved pages: the caller
        // stops stepping (no busy loop beside the prefill it waits for) until the pool
        // changes.
        self.blocked = blocked && plan.is_empty();
        (!plan.is_empty()).then_some(StepPlan { work: plan })
    }

    pub(super) fn admit(&mut self) {
        self.take_fetched();
        while self.running.len() < self.cfg.max_batch
            && let Some(s) = self.ready.pop_front()
        {
            self.running.push(s);
        }
        while let Some(front) = self.waiting.front() {
            let reserve =
                front.part == Part::Decode && front.computed == 0 && front.generated() == 0;
            if !reserve
                && self.running.len() + self.ready.len() + self.loading.len() >= self.cfg.max_batch
            {
                break;
            }
            if reserve {
                // Reserve the prompt's pages; its KV arrives from a prefill worker. Only
                // pages bound reservations (as a decode server preallocates for every
                // transfer memory allows), so a request waiting for a batch slot is not
                // also waiting to be told it has pages.
                // Whole pages this engine's prefix cache holds already (never the
                // prompt's last token's page, as on a prefill) stay here: only the rest
                // travel.
                let len = front.tokens.len();
                let hit = match &mut self.cache {
                    Some(c) => {
                        let ns = c.namespace(front.params.cache_salt.as_deref());
                        c.match_prefix_in(&mut self.pool, ns, &front.tokens, len - 1)
                    }
                    None => Vec::new(),
                };
                let total = self.pool.pages_for_tokens(len);
                let need = total - hit.len();
                let (free, headroom) = (
                    self.pool.free_pages(),
                    self.running.len() + self.ready.len(),
                );
                if free < need + headroom
                    && !self.running.is_empty()
                    && free + self.cached_pages() < need + headroom
                {
                    self.release(hit);
                    break;
                }
                let Ok(pages) = self.alloc(need) else {
                    self.release(hit);
                    break;
                };
                // The arriving pages a window reads from the first decode step keep
                // their window layers; the others arrive with their global layers only.
                let mut all = hit.clone();
                all.extend(&pages);
                let from = self.window_start(len, all.len()).max(hit.len());
                if !self.attach(&all[from..]) {
                    self.release(all);
                    break;
                }
                let mut s = self.waiting.pop_front().expect("front exists");
                s.held = hit.len();
                s.pages = hit;
                s.pages.extend(pages);
                self.pending.push(StepEvent::Reserved {
                    id: s.id.clone(),
                    pages: total,
                    held: s.held,
                });
                self.parked.push(s);
                continue;
            }
            // The longest cached prefix, in whole pages, leaving at least the last token to
            // compute (its logits are needed). A request for the prompt's log-probabilities
            // computes every position's logits: nothing cached serves it.
            let len = front.tokens.len();
            let every_row = front.params.prompt_logprobs.is_some();
            let hit = match &mut self.cache {
                Some(c) if !every_row => {
                    let ns = c.namespace(front.params.cache_salt.as_deref());
                    c.match_prefix_in(&mut self.pool, ns, &front.tokens, len - 1)
                }
                _ => Vec::new(),
            };
            // Pages for everything to compute now, plus one page of headroom per running
            // sequence so admission does not immediately force a preemption. (Host-tier
            // hits need fresh pages too, so they do not change this.)
            let need = self.pool.pages_for_tokens(len) - hit.len();
            let free = self.pool.free_pages();
            let headroom = self.running.len();
            // Evictable pages are only counted when free pages alone fall short.
            if free < need + headroom && !self.running.is_empty() {
                let available = free + self.cached_pages();
                if available < need + headroom.min(available) {
                    self.release(hit);
                    break;
                }
            }
            let Ok(pages) = self.alloc(need) else {
                self.release(hit);
                break;
            };
            // Admitted: only now ask the host tier for the pages after the device hit; the
            // sequence holds its pages meanwhile and the others run.
            let mut s = self.waiting.pop_front().expect("front exists");
            let device = hit.len();
            s.pages = hit;
            s.pages.extend(pages);
            if !every_row
                && let Some(fetch) = self.host_fetch(&s, device)
                && let Some((host, _)) = &mut self.host
            {
                self.loading.push(Loading {
                    ticket: fetch.ticket,
                    seq: s,
                    device,
                });
                host.fetch(fetch);
                continue;
            }
            self.admitted(s, device, 0);
        }
    }

    /// Make sure `running[i]` has pages for `upto` tokens; preempts the newest other
    /// sequence (recompute later) when the pool is full. False if even that fails.
    /// A hybrid model's pages written in this step get their window segments too.
    pub(super) fn ensure_pages(&mut self, i: usize, upto: usize) -> bool {
        loop {
            let need = self
                .pool
                .pages_for_tokens(upto)
                .saturating_sub(self.running[i].pages.len());
            if need > 0
                && let Ok(p) = self.alloc(need)
            {
                self.running[i].pages.extend(p);
            }
            let s = &self.running[i];
            if s.pages.len() >= self.pool.pages_for_tokens(upto) {
                if !self.pool.layout().is_hybrid() {
                    return true;
                }
                let ps = self.cfg.page_size;
                let written = s.pages[s.computed / ps..upto.div_ceil(ps)].to_vec();
                if self.attach(&written) {
                    return true;
                }
            }
            let victim = self.running.len() - 1;
            if victim == i {
                return false;
            }
            self.preempt(victim);
        }
    }

    /// Put a running sequence back at the head of the queue; its KV is recomputed later
    /// through the same per-token path (or found again in the prefix cache, where it went),
    /// so its output does not change.
    pub(super) fn preempt(&mut self, i: usize) {
        let mut s = self.running.remove(i);
        self.retire_pages(&mut s);
        s.computed = 0;
        self.preemptions += 1;
        tracing::debug!(id = %s.id, "preempted: KV pool full");
        self.waiting.push_front(s);
    }
}

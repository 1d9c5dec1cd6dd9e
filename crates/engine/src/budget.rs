//! How many prompt tokens one step computes beside the sequences that are decoding.
//!
//! A step's prompt tokens and its decode tokens go through one forward pass, so every
//! decoding sequence waits for the whole chunk: on a CPU a 512-token chunk is seconds,
//! and each such step is one inter-token gap of every stream. With a step target the
//! budget is sized so that a step with decode tokens stays near the target: the engine
//! times each forward pass and keeps two running estimates, the time of a step's decode
//! part (from steps that computed no prompt tokens) and the time of one prompt token
//! (from the rest of the steps that did). A step with no decode tokens takes the whole
//! chunk: nobody waits on it. Prompts always advance by at least `floor` tokens a step.
//!
//! Only how a prompt is cut into chunks changes, never what is computed: results do not
//! depend on the chunking (the invariance tests' oracle), so the budget cannot change a
//! token of output whatever the timing.

use std::time::Duration;

/// Weight of the newest sample in the running estimates.
const ALPHA: f64 = 0.3;

/// The prompt-token budget of each step.
#[derive(Clone, Debug)]
pub struct PrefillBudget {
    chunk: usize,
    floor: usize,
    target: Option<f64>,
    /// Seconds of a step that computed decode tokens only.
    decode_s: Option<f64>,
    /// Seconds per prompt token beyond the decode part.
    token_s: Option<f64>,
}

impl PrefillBudget {
    /// At most `chunk` prompt tokens a step; with `target`, steps that decode are kept
    /// near it, never below `floor` prompt tokens (capped at `chunk`).
    pub fn new(chunk: usize, floor: usize, target: Option<Duration>) -> Self {
        Self {
            chunk,
            floor: floor.clamp(1, chunk.max(1)),
            target: target.map(|t| t.as_secs_f64()).filter(|&t| t > 0.0),
            decode_s: None,
            token_s: None,
        }
    }

    /// Prompt tokens for a step that also computes `decodes` decode tokens.
    pub fn tokens(&self, decodes: usize) -> usize {
        let Some(target) = self.target else {
            return self.chunk;
        };
        if decodes == 0 {
            return self.chunk;
        }
        let Some(per_token) = self.token_s else {
            // Nothing measured yet: the smallest step, so one unknown step cannot make
            // every stream wait for a whole chunk.
            return self.floor;
        };
        let room = target - self.decode_s.unwrap_or(0.0);
        let fit = if room <= 0.0 || per_token <= 0.0 {
            0.0
        } else {
            room / per_token
        };
        (fit.min(self.chunk as f64) as usize).clamp(self.floor, self.chunk)
    }

    /// A forward pass of `decodes` decode tokens and `prompt` prompt tokens took `took`.
    pub fn observe(&mut self, decodes: usize, prompt: usize, took: Duration) {
        let s = took.as_secs_f64();
        if prompt == 0 {
            if decodes > 0 {
                self.decode_s = Some(mix(self.decode_s, s));
            }
            return;
        }
        let decode_part = if decodes > 0 {
            self.decode_s.unwrap_or(0.0)
        } else {
            0.0
        };
        let per_token = (s - decode_part).max(0.0) / prompt as f64;
        self.token_s = Some(mix(self.token_s, per_token));
    }
}

fn mix(old: Option<f64>, new: f64) -> f64 {
    match old {
        Some(o) => o + ALPHA * (new - o),
        None => new,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn without_a_target_every_step_takes_the_chunk() {
        let mut b = PrefillBudget::new(512, 16, None);
        b.observe(0, 512, ms(3000));
        b.observe(16, 512, ms(3100));
        assert_eq!(b.tokens(16), 512);
        assert_eq!(b.tokens(0), 512);
        // A zero target is off too.
        assert_eq!(PrefillBudget::new(512, 16, Some(ms(0))).tokens(16), 512);
    }

    #[test]
    fn a_step_nobody_waits_on_takes_the_chunk() {
        let b = PrefillBudget::new(512, 16, Some(ms(200)));
        assert_eq!(b.tokens(0), 512);
    }

    #[test]
    fn before_any_measurement_a_decoding_step_takes_the_floor() {
        let b = PrefillBudget::new(512, 16, Some(ms(200)));
        assert_eq!(b.tokens(3), 16);
    }

    #[test]
    fn the_budget_fills_the_target_beside_the_decode_part() {
        let mut b = PrefillBudget::new(512, 16, Some(ms(200)));
        // 5 ms a prompt token (a prompt alone), 50 ms a decode step.
        b.observe(0, 100, ms(500));
        b.observe(8, 0, ms(50));
        // (200 - 50) / 5 = 30 tokens.
        assert_eq!(b.tokens(8), 30);
        // A mixed step measured at the same rates keeps it there.
        b.observe(8, 30, ms(200));
        assert_eq!(b.tokens(8), 30);
    }

    #[test]
    fn slower_prompt_tokens_shrink_the_budget_and_faster_grow_it() {
        let mut b = PrefillBudget::new(512, 16, Some(ms(200)));
        b.observe(0, 100, ms(500));
        b.observe(8, 0, ms(50));
        let before = b.tokens(8);
        // Later chunks of a long prompt attend to more keys: each token costs more.
        for _ in 0..5 {
            b.observe(8, 30, ms(50 + 30 * 8));
        }
        let slower = b.tokens(8);
        assert!(slower < before, "{slower} !< {before}");
        for _ in 0..20 {
            b.observe(8, 30, ms(50 + 30));
        }
        let faster = b.tokens(8);
        assert!(faster > before, "{faster} !> {before}");
    }

    #[test]
    fn the_budget_stays_between_the_floor_and_the_chunk() {
        let mut b = PrefillBudget::new(512, 16, Some(ms(200)));
        // A decode step alone past the target: prompts still move by the floor.
        b.observe(0, 10, ms(100));
        b.observe(64, 0, ms(400));
        assert_eq!(b.tokens(64), 16);
        // Prompt tokens nearly free (a GPU): never more than the chunk.
        let mut g = PrefillBudget::new(512, 16, Some(ms(200)));
        g.observe(0, 512, Duration::from_micros(500));
        g.observe(64, 0, ms(2));
        assert_eq!(g.tokens(64), 512);
        // A floor above the chunk is the chunk.
        assert_eq!(PrefillBudget::new(8, 16, Some(ms(200))).tokens(4), 8);
    }
}

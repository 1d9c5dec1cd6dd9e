//! Turning logits into the next token: penalties, logit bias, temperature, top-k, top-p,
//! min-p, and a per-sequence seeded RNG so a seeded request samples the same tokens in any
//! batch. (Log-probabilities are the raw logits', taken before any of this: see
//! [`crate::Logprob`].)

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::SamplingParams;

/// Per-sequence sampling state.
#[derive(Debug)]
pub(crate) struct Sampler {
    rng: ChaCha8Rng,
    /// How often each token was generated (frequency/presence penalties).
    counts: HashMap<u32, u32>,
}

impl Sampler {
    pub fn new(seed: Option<u64>) -> Self {
        let rng = match seed {
            Some(s) => ChaCha8Rng::seed_from_u64(s),
            None => ChaCha8Rng::from_os_rng(),
        };
        Self {
            rng,
            counts: HashMap::new(),
        }
    }

    /// Advances the RNG past one [`Self::sample`] made elsewhere with `p` (the prefill
    /// worker sampled the first token; decode continues the same stream).
    pub fn skip_sample(&mut self, p: &SamplingParams) {
        if p.temperature != 0.0 {
            let _ = self.rng.random::<f64>();
        }
    }

    pub fn record(&mut self, token: u32) {
        *self.counts.entry(token).or_default() += 1;
    }

    /// Pick the next token (`logits` is changed on the way: penalties and bias).
    pub fn sample(&mut self, logits: &mut [f32], p: &SamplingParams, context: &[u32]) -> u32 {
        if p.repetition_penalty != 1.0 {
            let mut seen = std::collections::HashSet::new();
            for &t in context {
                if seen.insert(t)
                    && let Some(l) = logits.get_mut(t as usize)
                {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&t, &n) in &self.counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= n as f32 * p.frequency_penalty + p.presence_penalty;
                }
            }
        }
        for &(t, b) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        if p.temperature == 0.0 {
            argmax(logits)
        } else {
            self.draw(logits, p)
        }
    }

    fn draw(&mut self, logits: &[f32], p: &SamplingParams) -> u32 {
        let inv_t = 1.0 / p.temperature;
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let probs: Vec<f32> = logits.iter().map(|&l| ((l - max) * inv_t).exp()).collect();
        let total: f64 = probs.iter().map(|&x| x as f64).sum();
        let filtering = p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0.0;
        if !filtering {
            let u = self.rng.random::<f64>() * total;
            return pick(probs.iter().enumerate().map(|(i, &x)| (i as u32, x)), u);
        }
        // Candidates in descending probability, ties by token id: a total order, so the
        // result never depends on sort stability.
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let mut cand: Vec<(u32, f32)> = probs
            .iter()
            .enumerate()
            .map(|(i, &x)| (i as u32, x))
            .collect();
        let k = if p.top_k > 0 {
            (p.top_k as usize).min(cand.len())
        } else {
            cand.len()
        };
        // Most nuclei are small: look at the top 256 first and sort everything only if needed.
        let mut head = k.min(256);
        loop {
            if head < cand.len() {
                cand.select_nth_unstable_by(head - 1, order);
            }
            let mut top: Vec<(u32, f32)> = cand[..head].to_vec();
            top.sort_unstable_by(order);
            let mass: f64 = top.iter().map(|c| c.1 as f64).sum();
            if head == k || mass >= p.top_p as f64 * total {
                return self.finish_draw(top, total, p);
            }
            head = k;
        }
    }

    fn finish_draw(&mut self, mut top: Vec<(u32, f32)>, total: f64, p: &SamplingParams) -> u32 {
        if p.min_p > 0.0 {
            let floor = top[0].1 * p.min_p;
            top.retain(|c| c.1 >= floor);
        }
        if p.top_p < 1.0 {
            let want = p.top_p as f64 * total;
            let mut acc = 0f64;
            let mut keep = top.len();
            for (i, c) in top.iter().enumerate() {
                acc += c.1 as f64;
                if acc >= want {
                    keep = i + 1;
                    break;
                }
            }
            top.truncate(keep.max(1));
        }
        let mass: f64 = top.iter().map(|c| c.1 as f64).sum();
        let u = self.rng.random::<f64>() * mass;
        pick(top.into_iter(), u)
    }
}

fn pick(items: impl Iterator<Item = (u32, f32)>, u: f64) -> u32 {
    let mut acc = 0f64;
    let mut last = 0;
    for (i, x) in items {
        acc += x as f64;
        last = i;
        if u < acc {
            return i;
        }
    }
    last
}

/// Index of the largest logit; the lowest index wins ties.
pub(crate) fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(Some(1));
        let mut l = vec![0.0, 3.0, 3.0, -1.0];
        assert_eq!(s.sample(&mut l, &SamplingParams::greedy(1), &[]), 1);
    }

    #[test]
    fn logit_bias_moves_the_choice_and_ignores_tokens_outside_the_vocabulary() {
        let mut s = Sampler::new(Some(1));
        let p = SamplingParams {
            logit_bias: vec![(2, 5.0), (0, -100.0), (99, 100.0)],
            ..SamplingParams::greedy(1)
        };
        let mut l = vec![3.0, 1.0, -1.0];
        assert_eq!(s.sample(&mut l, &p, &[]), 2, "-1 + 5 > 3 - 100 and 1");
        assert_eq!(l, vec![-97.0, 1.0, 4.0]);
        // Sampled: a -100 bias leaves a token practically never drawn.
        let p = SamplingParams {
            logit_bias: vec![(0, -100.0)],
            ..params()
        };
        for _ in 0..200 {
            assert_ne!(s.sample(&mut [5.0, 0.0, 0.0], &p, &[]), 0);
        }
    }

    #[test]
    fn raw_logprobs_are_the_log_softmax_with_the_top_tokens_in_order() {
        let l = vec![1.0f32, 3.0, 3.0, -1.0, 2.0];
        let lp = crate::Logprob::of(&l, 4, 3);
        let norm: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        let want = |t: usize| (l[t] as f64 - norm.ln()) as f32;
        assert!((lp.logprob - want(4)).abs() < 1e-6);
        // Ties by lower id first; the rest in descending order.
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2, 4]);
        assert_eq!(lp.top[0].1, lp.top[1].1);
        assert!(
            lp.top
                .iter()
                .all(|&(t, v)| (v - want(t as usize)).abs() < 1e-6)
        );
        // As many as asked, all of them at most; none when asked for none.
        assert_eq!(crate::Logprob::of(&l, 0, 9).top.len(), 5);
        assert!(crate::Logprob::of(&l, 0, 0).top.is_empty());
        let total: f64 = (0..5)
            .map(|t| (crate::Logprob::of(&l, t, 0).logprob as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 101) as f32 * 0.05)
            .collect();
        let run = |seed| {
            let mut s = Sampler::new(Some(seed));
            (0..20)
                .map(|_| s.sample(&mut logits.clone(), &params(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn top_k_top_p_and_min_p_restrict_the_candidates() {
        let logits = vec![5.0, 4.0, 3.0, 0.0, -1.0];
        let mut s = Sampler::new(Some(7));
        for _ in 0..200 {
            let p = SamplingParams {
                top_k: 2,
                ..params()
            };
            assert!(s.sample(&mut logits.clone(), &p, &[]) < 2);
            let p = SamplingParams {
                top_p: 0.5,
                ..params()
            };
            assert_eq!(
                s.sample(&mut logits.clone(), &p, &[]),
                0,
                "token 0 alone holds > 50%"
            );
            let p = SamplingParams {
                min_p: 0.3,
                ..params()
            };
            assert!(s.sample(&mut logits.clone(), &p, &[]) < 2, "exp(-2) < 0.3");
        }
    }

    #[test]
    fn penalties_move_logits() {
        let mut s = Sampler::new(Some(1));
        s.record(0);
        s.record(0);
        let mut l = vec![2.0, 1.9, -1.0];
        let p = SamplingParams {
            frequency_penalty: 0.1,
            ..SamplingParams::greedy(1)
        };
        assert_eq!(s.sample(&mut l, &p, &[]), 1, "2.0 - 2*0.1 < 1.9");
        let mut l = vec![2.0, 1.5];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::greedy(1)
        };
        assert_eq!(s.sample(&mut l, &p, &[0]), 1, "2.0 / 2 < 1.5");
        let mut l = vec![2.0, 1.5];
        let p = SamplingParams {
            presence_penalty: 1.0,
            ..SamplingParams::greedy(1)
        };
        assert_eq!(s.sample(&mut l, &p, &[]), 1);
    }
}

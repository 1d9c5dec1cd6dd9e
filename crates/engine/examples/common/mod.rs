//! What the engine's benchmarks share: counting tokens and timing greedy decode streams.

#![allow(dead_code)]

use std::time::Instant;

use pdmesh_engine::{Engine, GenRequest, Grammar, SamplingParams, StepEvent};

/// How many tokens `events` hold.
pub fn tokens_of(events: &[StepEvent]) -> usize {
    events
        .iter()
        .filter(|ev| matches!(ev, StepEvent::Token { .. }))
        .count()
}

/// `n` greedy streams of `tokens` tokens each (every stream its own short chat-like
/// prompt, so nothing is shared), under `grammar` if given, decoded to the end: the
/// seconds the decode took (prefill and every stream's first token untimed) and the
/// tokens it made.
pub fn decode_streams(
    e: &mut Engine,
    n: usize,
    tokens: u32,
    grammar: Option<Grammar>,
) -> (f64, usize) {
    for i in 0..n {
        let prompt: Vec<u32> = [1, 9690, 198, 2683, 359, 253, 5356, 1, 4093, 198]
            .iter()
            .map(|&t| t + i as u32)
            .collect();
        let params = SamplingParams {
            ignore_eos: true,
            grammar: grammar.clone(),
            ..SamplingParams::greedy(tokens)
        };
        e.submit(GenRequest {
            id: format!("s{i}"),
            prompt,
            params,
        })
        .unwrap();
    }
    let mut first = 0;
    while first < n {
        first += tokens_of(&e.step());
    }
    let t0 = Instant::now();
    let mut count = 0;
    while e.has_work() {
        count += tokens_of(&e.step());
    }
    (t0.elapsed().as_secs_f64(), count)
}

//! Decode throughput of the engine on the default model: single-stream tokens/s and the
//! aggregate tokens/s of N concurrent greedy streams (decode only: prefill is timed apart).
//!
//! `cargo run --release -p pdmesh-engine --example bench_decode -- [TOKENS] [CONCURRENCY] [THREADS]`
//! The llama.cpp peer on the same file: `python3 scripts/bench/llama_cpp_decode.py`.

use std::time::Instant;

use pdmesh_engine::{Engine, EngineConfig, GenRequest, SamplingParams, StepEvent};

fn run(e: &mut Engine, n: usize, tokens: u32) -> (f64, usize) {
    // A short chat-like prompt; each stream gets a distinct one so nothing is shared.
    for i in 0..n {
        let prompt: Vec<u32> = [1, 9690, 198, 2683, 359, 253, 5356, 1, 4093, 198]
            .iter()
            .map(|&t| t + i as u32)
            .collect();
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(tokens)
        };
        e.submit(GenRequest {
            id: format!("s{i}"),
            prompt,
            params,
        })
        .unwrap();
    }
    // Prefill and the first token of every stream, untimed.
    let mut first = 0;
    while first < n {
        first += e
            .step()
            .iter()
            .filter(|ev| matches!(ev, StepEvent::Token { .. }))
            .count();
    }
    let t0 = Instant::now();
    let mut count = 0;
    while e.has_work() {
        count += e
            .step()
            .iter()
            .filter(|ev| matches!(ev, StepEvent::Token { .. }))
            .count();
    }
    (t0.elapsed().as_secs_f64(), count)
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("number"))
        .collect();
    let tokens = *args.first().unwrap_or(&128) as u32;
    let conc = *args.get(1).unwrap_or(&16);
    let threads = *args.get(2).unwrap_or(&0);
    let mut cfg = EngineConfig::new(pdmesh_gguf::models::require_default_model());
    cfg.threads = threads;
    cfg.kv_pages = 1024;
    let mut e = Engine::load(cfg).expect("load");
    run(&mut e, 1, 8); // warm up
    // Medians of several runs: this machine class is noisy.
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let single = median(
        (0..5)
            .map(|_| {
                let (dt, n) = run(&mut e, 1, tokens);
                n as f64 / dt
            })
            .collect(),
    );
    let agg = median(
        (0..3)
            .map(|_| {
                let (dt, n) = run(&mut e, conc, tokens);
                n as f64 / dt
            })
            .collect(),
    );
    println!("single-stream decode: {single:.1} tokens/s (median of 5 runs of {tokens} tokens)");
    println!(
        "{conc}-concurrent aggregate decode: {agg:.1} tokens/s (median of 3 runs of {conc} x {tokens} tokens)"
    );
    println!("aggregate / single = {:.2}x", agg / single);
}

//! Decode throughput of the engine on the default model: single-stream tokens/s and the
//! aggregate tokens/s of N concurrent greedy streams (decode only: prefill is timed apart).
//!
//! `cargo run --release -p pdmesh-engine --example bench_decode -- [TOKENS] [CONCURRENCY] [THREADS] [--tp N]`
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
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // `--tp N`: tensor-parallel ranks (1, unsharded, by default).
    let tp = match args.iter().position(|a| a == "--tp") {
        Some(i) => {
            let n = args
                .get(i + 1)
                .and_then(|a| a.parse().ok())
                .expect("--tp N");
            args.drain(i..i + 2);
            n
        }
        None => 1,
    };
    let args: Vec<usize> = args.iter().map(|a| a.parse().expect("number")).collect();
    let tokens = *args.first().unwrap_or(&128) as u32;
    let conc = *args.get(1).unwrap_or(&16);
    let threads = *args.get(2).unwrap_or(&0);
    let mut cfg = EngineConfig::new(pdmesh_gguf::models::require_default_model());
    cfg.threads = threads;
    cfg.kv_pages = 1024;
    cfg.tp = tp;
    let mut e = Engine::load(cfg).expect("load");
    run(&mut e, 1, 8); // warm up
    // This machine class is noisy: single-stream and concurrent runs alternate, so slow
    // phases hit both, and the ratio is taken per round before the median.
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let rate = |e: &mut Engine, n: usize| {
        let (dt, count) = run(e, n, tokens);
        count as f64 / dt
    };
    let (mut singles, mut aggs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        let single = rate(&mut e, 1);
        let agg = rate(&mut e, conc);
        singles.push(single);
        aggs.push(agg);
        ratios.push(agg / single);
    }
    println!(
        "single-stream decode: {:.1} tokens/s (median of 5 runs of {tokens} tokens)",
        median(singles)
    );
    println!(
        "{conc}-concurrent aggregate decode: {:.1} tokens/s (median of 5 runs of {conc} x {tokens} tokens)",
        median(aggs)
    );
    println!(
        "aggregate / single = {:.2}x (median of the 5 rounds' ratios)",
        median(ratios)
    );
}

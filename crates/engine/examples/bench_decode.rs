//! Decode throughput of the engine on the default model: single-stream tokens/s and the
//! aggregate tokens/s of N concurrent greedy streams (decode only: prefill is timed apart).
//!
//! `cargo run --release -p pdmesh-engine --example bench_decode -- [TOKENS] [CONCURRENCY] [THREADS] [--tp N]`
//! The llama.cpp peer on the same file: `python3 scripts/bench/llama_cpp_decode.py`.

use pdmesh_engine::{Engine, EngineConfig};
use pdmesh_testkit::bench::{args, median, numbers, take_flag};

mod common;

/// Seconds of decode and tokens decoded for `n` greedy streams of `tokens` tokens.
fn run(e: &mut Engine, n: usize, tokens: u32) -> (f64, usize) {
    common::decode_streams(e, n, tokens, None)
}

fn main() {
    let mut args = args();
    // `--tp N`: tensor-parallel ranks (1, unsharded, by default).
    let tp = take_flag(&mut args, "--tp").unwrap_or(1);
    let args = numbers(&args);
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

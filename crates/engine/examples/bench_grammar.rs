//! Constrained-decoding overhead per token on the default model: the same greedy decode
//! with and without a grammar (a JSON object whose one string field must be long, so the
//! grammar stays open for every token), in alternating rounds; prints ms/step for both,
//! the difference per token and the ratio. The grammar's masks are computed beside the forward pass,
//! so the difference is what that does not hide.
//!
//! `cargo run --release -p pdmesh-engine --example bench_grammar -- [TOKENS] [CONCURRENCY] [ROUNDS]`

use std::time::Instant;

use pdmesh_engine::{Engine, EngineConfig};
use pdmesh_testkit::bench::{args, median, numbers};

mod common;

const GRAMMAR: &str = r#"start: %json{"type":"object","properties":{"story":{"type":"string","minLength":2000}},"required":["story"],"additionalProperties":false,"x-guidance":{"whitespace_flexible":false}}"#;

/// Seconds per decode step (every stream gets one token a step; prefill and first tokens
/// untimed) and the tokens decoded.
fn run(e: &mut Engine, n: usize, tokens: u32, grammar: bool) -> (f64, usize) {
    // Compiled once, as a worker compiles a request's grammar before submitting it.
    let compiled = grammar.then(|| e.grammar_compiler().compile(GRAMMAR).expect("compiles"));
    let (seconds, count) = common::decode_streams(e, n, tokens, compiled);
    (seconds / count.max(1) as f64 * n as f64, count)
}

fn main() {
    let args = numbers(&args());
    let tokens = *args.first().unwrap_or(&64) as u32;
    let conc = *args.get(1).unwrap_or(&1);
    let rounds = *args.get(2).unwrap_or(&5);
    let mut cfg = EngineConfig::new(pdmesh_gguf::models::require_default_model());
    cfg.kv_pages = 1024;
    let mut e = Engine::load(cfg).expect("load");
    // Warm up both paths (the first grammar request builds the token trie).
    let t0 = Instant::now();
    run(&mut e, 1, 4, true);
    println!(
        "first grammar request (token trie + compile + 4 tokens): {:.1} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    run(&mut e, 1, 4, false);
    let (mut free, mut constrained, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let (f, _) = run(&mut e, conc, tokens, false);
        let (c, count) = run(&mut e, conc, tokens, true);
        assert_eq!(
            count,
            conc * (tokens as usize - 1),
            "the grammar stayed open"
        );
        free.push(f);
        constrained.push(c);
        ratios.push(c / f);
    }
    let (f, c) = (median(free), median(constrained));
    println!(
        "{conc} stream(s), {tokens} tokens: unconstrained {:.2} ms/step, constrained {:.2} ms/step, overhead {:+.3} ms per token, ratio {:.3} (median of {rounds})",
        f * 1e3,
        c * 1e3,
        (c - f) * 1e3 / conc as f64,
        median(ratios)
    );
}

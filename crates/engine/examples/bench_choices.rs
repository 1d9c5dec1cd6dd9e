//! What the API's extras cost the engine, each beside its plain form in the same run:
//! - `top_logprobs: 5` per generated token: one stream decoding with and without them;
//! - `n: 4`: four choices sharing one prompt computation (a prompt group) against four
//!   separate requests with the same prompt (no prefix cache, so each computes it);
//! - `echo` with logprobs: a prompt scored (every position's logits) against the same
//!   prompt computed for its first token only.
//!
//! `cargo run --release -p pdmesh-engine --example bench_choices -- [PROMPT_TOKENS] [NEW_TOKENS] [ROUNDS]`

use std::time::Instant;

use pdmesh_engine::{Engine, EngineConfig, GenRequest, Part, SamplingParams};
use pdmesh_testkit::bench::{args, median, numbers};

fn engine() -> Engine {
    let mut cfg = EngineConfig::new(pdmesh_gguf::models::require_default_model());
    cfg.kv_pages = 1024;
    // Every request computes its prompt unless it shares a group's.
    cfg.prefix_cache = false;
    Engine::load(cfg).expect("the default model loads")
}

fn req(id: &str, prompt: &[u32], params: SamplingParams) -> GenRequest {
    GenRequest {
        id: id.into(),
        prompt: prompt.to_vec(),
        params,
    }
}

/// Seconds until every submitted request is done.
fn drain(e: &mut Engine, t: Instant) -> f64 {
    while e.has_work() {
        e.step();
    }
    t.elapsed().as_secs_f64()
}

fn main() {
    let args = numbers(&args());
    let prompt_len = *args.first().unwrap_or(&512);
    let new = *args.get(1).unwrap_or(&64) as u32;
    let rounds = *args.get(2).unwrap_or(&3);
    let prompt: Vec<u32> = (0..prompt_len as u32)
        .map(|i| 100 + (i * 37) % 20_000)
        .collect();
    let mut e = engine();
    let sampled = |seed: u64, logprobs: bool| SamplingParams {
        temperature: 0.8,
        seed: Some(seed),
        max_tokens: Some(new),
        ignore_eos: true,
        logprobs,
        top_logprobs: if logprobs { 5 } else { 0 },
        ..Default::default()
    };
    let (mut plain, mut scored, mut separate, mut shared) = (vec![], vec![], vec![], vec![]);
    let (mut first, mut echo) = (vec![], vec![]);
    for r in 0..rounds {
        // Decode, with and without top-5 logprobs: tokens per second of one stream.
        for (logprobs, out) in [(false, &mut plain), (true, &mut scored)] {
            let t = Instant::now();
            e.submit(req(
                &format!("d{r}{logprobs}"),
                &prompt[..16],
                sampled(1, logprobs),
            ))
            .unwrap();
            out.push(f64::from(new) / drain(&mut e, t));
        }
        // n = 4: four separate requests, then one group of four.
        let t = Instant::now();
        for i in 0..4 {
            e.submit(req(&format!("s{r}-{i}"), &prompt, sampled(i, false)))
                .unwrap();
        }
        separate.push(drain(&mut e, t));
        let t = Instant::now();
        for i in 0..4 {
            let choice = req(&format!("g{r}-{i}"), &prompt, sampled(i, false));
            e.submit_shared(choice, Part::Whole, &format!("g{r}"), 4)
                .unwrap();
        }
        shared.push(drain(&mut e, t));
        // Echo: the prompt to its first token, then scored at every position.
        for (every, out) in [(None, &mut first), (Some(1), &mut echo)] {
            let t = Instant::now();
            let params = SamplingParams {
                prompt_logprobs: every,
                ..SamplingParams::greedy(1)
            };
            e.submit(req(&format!("e{r}{every:?}"), &prompt, params))
                .unwrap();
            out.push(drain(&mut e, t));
        }
    }
    let (plain, scored) = (median(plain), median(scored));
    let (separate, shared) = (median(separate), median(shared));
    let (first, echo) = (median(first), median(echo));
    println!("prompt {prompt_len} tokens, {new} new tokens, median of {rounds} rounds");
    println!(
        "decode, 1 stream: {plain:.1} tok/s plain, {scored:.1} tok/s with top_logprobs 5 (x{:.3})",
        scored / plain
    );
    println!(
        "n=4: {separate:.2} s as 4 requests, {shared:.2} s as one group (x{:.2} faster)",
        separate / shared
    );
    println!(
        "prompt: {first:.2} s to its first token, {echo:.2} s scored with echo logprobs (x{:.2})",
        echo / first
    );
}

//! Greedy generation from token ids given on the command line; prints ids, top-5 logits of
//! the first step and tokens/s. `cargo run --release -p pdmesh-engine --example generate -- 504 3575`

use pdmesh_engine::{Engine, EngineConfig, GenRequest, SamplingParams, StepEvent};

fn main() {
    let ids: Vec<u32> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("token id"))
        .collect();
    let mut cfg = EngineConfig::new(pdmesh_gguf::models::require_default_model());
    cfg.capture_logits = true;
    cfg.kv_pages = 128;
    let mut e = Engine::load(cfg).expect("load");
    e.submit(GenRequest {
        id: "x".into(),
        prompt: ids,
        params: SamplingParams::greedy(64),
    })
    .unwrap();
    let t0 = std::time::Instant::now();
    let mut out = Vec::new();
    while e.has_work() {
        for ev in e.step() {
            if let StepEvent::Token { token, .. } = ev {
                out.push(token);
            }
        }
    }
    let dt = t0.elapsed().as_secs_f64();
    let l = e.take_logits("x").unwrap();
    let mut top: Vec<(usize, f32)> = l[0].iter().copied().enumerate().collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1));
    println!("top5 {:?}", &top[..5]);
    println!("gen {:?}", out);
    println!(
        "{} tokens in {:.3}s = {:.1} tok/s (incl. prefill)",
        out.len(),
        dt,
        out.len() as f64 / dt
    );
}

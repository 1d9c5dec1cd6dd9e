//! Helpers shared by the engine's integration tests: load the real model, run requests to
//! completion, read the committed llama.cpp fixtures.

#![allow(dead_code)]

use std::collections::HashMap;

use pdmesh_engine::{Engine, EngineConfig, GenRequest, SamplingParams, StepEvent};

pub fn engine(f: impl FnOnce(&mut EngineConfig)) -> Engine {
    let mut cfg = EngineConfig::new(pdmesh_gguf::models::require_default_model());
    cfg.kv_pages = 256;
    cfg.capture_logits = true;
    f(&mut cfg);
    Engine::load(cfg).expect("engine loads the default model")
}

/// Pages a new request could get: free plus those only the prefix cache holds. When no
/// request runs, anything short of the whole pool is a leak.
pub fn available(e: &Engine) -> usize {
    e.free_pages() + e.cached_pages()
}

#[derive(Debug, Default, Clone, PartialEq)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub finished: Option<StepEvent>,
    pub logits: Vec<Vec<f32>>,
}

/// Submit every request, step until idle, collect per-request outcomes.
pub fn run_all(e: &mut Engine, reqs: Vec<GenRequest>) -> HashMap<String, Outcome> {
    let ids: Vec<String> = reqs.iter().map(|r| r.id.clone()).collect();
    for r in reqs {
        e.submit(r).expect("valid request");
    }
    let mut out: HashMap<String, Outcome> = ids
        .iter()
        .map(|i| (i.clone(), Outcome::default()))
        .collect();
    let mut steps = 0;
    while e.has_work() {
        steps += 1;
        assert!(steps < 100_000, "engine made no progress");
        for ev in e.step() {
            match &ev {
                StepEvent::Token { id, token, .. } => {
                    out.get_mut(&**id).unwrap().tokens.push(*token)
                }
                StepEvent::Finished { id, .. } => {
                    out.get_mut(&**id).unwrap().finished = Some(ev.clone())
                }
            }
        }
    }
    for id in &ids {
        out.get_mut(id).unwrap().logits = e.take_logits(id).unwrap_or_default();
    }
    out
}

pub fn greedy(id: &str, prompt: &[u32], n: u32) -> GenRequest {
    GenRequest {
        id: id.into(),
        prompt: prompt.to_vec(),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(n)
        },
    }
}

pub fn fixtures() -> serde_json::Value {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/reference.json"
    );
    serde_json::from_str(&std::fs::read_to_string(p).expect("reference fixture")).unwrap()
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

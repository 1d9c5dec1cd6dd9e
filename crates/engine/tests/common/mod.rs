//! Helpers shared by the engine's integration tests: load the real model, run requests to
//! completion, read the committed llama.cpp fixtures.

#![allow(dead_code)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pdmesh_engine::{Engine, EngineConfig, GenRequest, Logprob, SamplingParams, StepEvent};

pub fn engine(f: impl FnOnce(&mut EngineConfig)) -> Engine {
    let mut cfg = EngineConfig::new(pdmesh_gguf::models::require_default_model());
    cfg.kv_pages = 256;
    cfg.capture_logits = true;
    f(&mut cfg);
    Engine::load(cfg).expect("engine loads the default model")
}

/// Steps `e` until it has no work: every event, in order.
pub fn step_all(e: &mut Engine) -> Vec<StepEvent> {
    let mut out = Vec::new();
    let mut n = 0;
    while e.has_work() {
        n += 1;
        assert!(n < 100_000, "no progress");
        out.extend(e.step());
    }
    out
}

/// Runs a prefill engine to the end: each request's first token and logprob.
pub fn prefill_all(p: &mut Engine) -> HashMap<String, (u32, Option<Logprob>)> {
    step_all(p)
        .into_iter()
        .filter_map(|ev| match ev {
            StepEvent::Exported {
                id, token, logprob, ..
            } => Some((id.to_string(), (token, logprob))),
            _ => None,
        })
        .collect()
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
    /// The tokens' log-probabilities, when the request asked for them.
    pub logprobs: Vec<Logprob>,
    /// The prompt's (`prompt_logprobs`), when the request asked for them.
    pub prompt_logprobs: Option<Vec<Logprob>>,
}

/// Submit every request, step until idle, collect per-request outcomes.
pub fn run_all(e: &mut Engine, reqs: Vec<GenRequest>) -> HashMap<String, Outcome> {
    let ids: Vec<String> = reqs.iter().map(|r| r.id.clone()).collect();
    for r in reqs {
        e.submit(r).expect("valid request");
    }
    run_submitted(e, &ids)
}

/// Steps until idle and collects the outcomes of the requests `ids`, already submitted.
pub fn run_submitted(e: &mut Engine, ids: &[String]) -> HashMap<String, Outcome> {
    let mut out: HashMap<String, Outcome> = ids
        .iter()
        .map(|i| (i.clone(), Outcome::default()))
        .collect();
    let mut steps = 0;
    let mut waited = Duration::ZERO;
    while e.has_work() || e.awaiting_host() > 0 {
        if !e.has_work() {
            // Only host-tier answers are awaited: their waker (`wake_here`) unparks us.
            let t0 = Instant::now();
            std::thread::park_timeout(Duration::from_millis(100));
            waited += t0.elapsed();
            assert!(
                waited < Duration::from_secs(60),
                "the host tier never answered"
            );
            continue;
        }
        steps += 1;
        assert!(steps < 100_000, "engine made no progress");
        for ev in e.step() {
            match &ev {
                StepEvent::Token { id, token, logprob } => {
                    let o = out.get_mut(&**id).unwrap();
                    o.tokens.push(*token);
                    o.logprobs.extend(logprob.clone());
                }
                StepEvent::Finished { id, .. } => {
                    out.get_mut(&**id).unwrap().finished = Some(ev.clone())
                }
                StepEvent::PromptLogprobs { id, logprobs, .. } => {
                    let o = out.get_mut(&**id).unwrap();
                    assert!(o.tokens.is_empty(), "prompt logprobs come before any token");
                    assert!(
                        o.prompt_logprobs.replace(logprobs.clone()).is_none(),
                        "once"
                    );
                }
                // Where the prompt came from: the cache tests read it from Finished.
                StepEvent::Admitted { .. } => {}
                other => panic!("a unified engine emitted {other:?}"),
            }
        }
    }
    for id in ids {
        out.get_mut(id).unwrap().logits = e.take_logits(id).unwrap_or_default();
    }
    out
}

/// Waits until `e`'s host tier has written (or skipped) every page queued for it.
pub fn wait_stored(e: &Engine) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while e.host_stats().queued_pages > 0 {
        assert!(
            Instant::now() < deadline,
            "the host tier never wrote its queue"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `lark` compiled for the default model's vocabulary, as a worker compiles a request's
/// grammar before submitting it.
pub fn compiled(lark: &str) -> pdmesh_engine::Grammar {
    static COMPILER: std::sync::OnceLock<pdmesh_engine::GrammarCompiler> =
        std::sync::OnceLock::new();
    COMPILER
        .get_or_init(|| engine(|c| c.kv_pages = 8).grammar_compiler())
        .compile(lark)
        .expect("the grammar compiles")
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
    pdmesh_testkit::fixture("reference.json")
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

pub const TURNS: usize = 3;
pub const ANSWER: u32 = 6;

/// A fixture's JSON array of token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// Fixture prompts as token lists.
pub fn fixture_prompts() -> Vec<Vec<u32>> {
    fixtures()["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| ids(&p["prompt_ids"]))
        .collect()
}

pub fn cached_tokens(o: &Outcome) -> u32 {
    match &o.finished {
        Some(StepEvent::Finished { cached_tokens, .. }) => *cached_tokens,
        other => panic!("not finished: {other:?}"),
    }
}

/// Every session's outcome per turn. Each turn's prompt is the shared system prompt, the
/// session's history (its earlier questions and the engine's answers) and a new question;
/// all sessions of a turn run concurrently.
pub fn sessions(e: &mut Engine, sessions: usize) -> Vec<HashMap<String, Outcome>> {
    let fx = fixture_prompts();
    let system: Vec<u32> = fx[0].iter().chain(&fx[1]).copied().collect();
    let mut history: Vec<Vec<u32>> = vec![system; sessions];
    let mut turns = Vec::new();
    for turn in 0..TURNS {
        let reqs = (0..sessions)
            .map(|s| {
                let q = &fx[(s + turn) % fx.len()];
                history[s].extend_from_slice(&q[..q.len().min(5 + s % 7)]);
                greedy(&format!("s{s}t{turn}"), &history[s], ANSWER)
            })
            .collect();
        let out = run_all(e, reqs);
        // What a turn wrote to the host tier is there for the next one.
        wait_stored(e);
        for (s, h) in history.iter_mut().enumerate() {
            h.extend_from_slice(&out[&format!("s{s}t{turn}")].tokens);
        }
        turns.push(out);
    }
    turns
}

pub fn assert_same_turns(
    a: &[HashMap<String, Outcome>],
    b: &[HashMap<String, Outcome>],
    what: &str,
) {
    for (turn, (ta, tb)) in a.iter().zip(b).enumerate() {
        for (id, oa) in ta {
            let ob = &tb[id];
            assert_eq!(oa.tokens, ob.tokens, "{what}: {id} tokens differ");
            assert_eq!(oa.logits.len(), ob.logits.len(), "{what}: {id} logits rows");
            for (i, (x, y)) in oa.logits.iter().zip(&ob.logits).enumerate() {
                assert!(
                    bits(x) == bits(y),
                    "{what}: turn {turn} {id} logits row {i} differs"
                );
            }
        }
    }
}

/// The synthesized `deepseek-v32-tiny` checkpoint with the default model's tokenizer,
/// written once per test binary.
pub fn tiny_dir() -> &'static std::path::Path {
    static D: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    D.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = tempfile::tempdir().unwrap();
        pdmesh_tokenize::TextTokenizer::from_path(pdmesh_gguf::models::require_default_model())
            .unwrap()
            .write_hf_dir(tokenizer.path())
            .unwrap();
        pdmesh_engine::deepseek_synth::write(
            dir.path(),
            &pdmesh_engine::deepseek_synth::tiny_config(),
            7,
            Some(tokenizer.path()),
        )
        .unwrap();
        dir
    })
    .path()
}

/// An engine serving [`tiny_dir`]: 128 pages of 16 tokens, two threads.
pub fn tiny_engine(f: impl FnOnce(&mut EngineConfig)) -> Engine {
    let mut cfg = EngineConfig::new(tiny_dir());
    cfg.kv_pages = 128;
    cfg.threads = 2;
    cfg.capture_logits = true;
    f(&mut cfg);
    Engine::load(cfg).expect("the tiny DeepSeek checkpoint loads")
}

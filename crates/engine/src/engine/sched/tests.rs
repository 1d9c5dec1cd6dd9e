//! The planner without a model: a one-layer layout of 4-token pages, a 16-token
//! vocabulary and a fake forward pass whose logits pick "the last token plus one". Each
//! test reads the [`StepPlan`]s a scheduler makes and what applying them gives.

use std::collections::HashMap;
use std::sync::Arc;

use pdmesh_kv::{DType, KvLayout, PageId, PagePool};

use super::{Scheduler, StepPlan};
use crate::engine::EngineConfig;
use crate::model::BatchToken;
use crate::{CudaError, CudaErrorKind, GenRequest, SamplingParams, StepEvent};

const VOCAB: usize = 16;
const EOG: u32 = 15;
const PAGE: usize = 4;

fn scheduler(f: impl FnOnce(&mut EngineConfig)) -> Scheduler {
    let mut cfg = EngineConfig::new("no model");
    cfg.page_size = PAGE;
    cfg.kv_pages = 64;
    cfg.prefill_chunk = 8;
    cfg.prefix_cache = false;
    f(&mut cfg);
    let layout = Arc::new(KvLayout::llama(1, 1, 4, DType::F16, PAGE));
    let pool = PagePool::new(layout, cfg.kv_pages);
    let token_bytes = (0..VOCAB as u8).map(|b| vec![b'a' + b]).collect();
    Scheduler::new(cfg, pool, (VOCAB, token_bytes, vec![EOG]), 256)
}

/// The next token is the last one plus one, skipping the end-of-generation token.
fn fake_forward(_: &mut PagePool, _: &[&[PageId]], batch: &[BatchToken]) -> Vec<Vec<f32>> {
    batch
        .iter()
        .filter(|t| t.want_logits)
        .map(|t| {
            let mut row = vec![0.0; VOCAB];
            row[(t.token as usize + 1) % (VOCAB - 1)] = 1.0;
            row
        })
        .collect()
}

fn request(id: &str, prompt_len: usize, max_tokens: u32) -> GenRequest {
    GenRequest {
        id: id.into(),
        prompt: (0..prompt_len as u32).map(|i| i % 10).collect(),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
    }
}

/// One step: the plan, as (request id, tokens) pairs, and the events.
fn step(s: &mut Scheduler) -> (Vec<(String, usize)>, Vec<StepEvent>) {
    let mut events = Vec::new();
    let Some(plan) = s.plan(&mut events) else {
        return (Vec::new(), events);
    };
    let named = plan
        .work
        .iter()
        .map(|&(i, take)| (s.running[i].id.to_string(), take))
        .collect();
    let logits = s
        .execute(&plan, |p, pages, batch| {
            Ok::<_, CudaError>(fake_forward(p, pages, batch))
        })
        .unwrap();
    s.apply(plan, logits, &mut events);
    (named, events)
}

/// Steps until idle; each request's tokens.
fn run(s: &mut Scheduler) -> HashMap<String, Vec<u32>> {
    let mut out: HashMap<String, Vec<u32>> = HashMap::new();
    for _ in 0..1000 {
        if !s.has_work() {
            return out;
        }
        for ev in step(s).1 {
            if let StepEvent::Token { id, token, .. } = ev {
                out.entry(id.to_string()).or_default().push(token);
            }
        }
    }
    panic!("no progress in 1000 steps");
}

fn plan_of(work: &[(&str, usize)]) -> Vec<(String, usize)> {
    work.iter().map(|&(id, n)| (id.to_owned(), n)).collect()
}

#[test]
fn decodes_come_first_and_a_long_prompt_is_computed_in_budget_sized_chunks() {
    let mut s = scheduler(|_| {});
    s.submit(request("a", 3, 6)).unwrap();
    assert_eq!(step(&mut s).0, plan_of(&[("a", 3)]));
    s.submit(request("b", 20, 2)).unwrap();
    // a decodes one token per step; b gets the budget of 8 prompt tokens each time.
    assert_eq!(step(&mut s).0, plan_of(&[("a", 1), ("b", 8)]));
    assert_eq!(step(&mut s).0, plan_of(&[("a", 1), ("b", 8)]));
    assert_eq!(step(&mut s).0, plan_of(&[("a", 1), ("b", 4)]));
    assert_eq!(step(&mut s).0, plan_of(&[("a", 1), ("b", 1)]));
    let out = run(&mut s);
    assert_eq!(out["a"].len(), 1, "a's sixth token");
    assert!(!s.has_work());
    assert_eq!(s.free_pages(), 64, "every page came back");
}

#[test]
fn an_empty_plan_is_none_and_the_plan_is_a_plain_value() {
    let mut s = scheduler(|_| {});
    let mut events = Vec::new();
    assert_eq!(s.plan(&mut events), None);
    s.submit(request("a", 5, 1)).unwrap();
    let plan = s.plan(&mut events).expect("a's prompt");
    assert_eq!(plan, StepPlan { work: vec![(0, 5)] });
    assert!(
        matches!(&events[..], [StepEvent::Admitted { id, .. }] if &**id == "a"),
        "{events:?}"
    );
}

#[test]
fn admission_waits_for_pages_with_a_page_of_headroom_per_running_sequence() {
    // Six pages: a's prompt takes three; b's three more would leave a no room to grow.
    let mut s = scheduler(|c| c.kv_pages = 6);
    s.submit(request("a", 10, 4)).unwrap();
    s.submit(request("b", 10, 4)).unwrap();
    assert_eq!(step(&mut s).0, plan_of(&[("a", 8)]));
    assert_eq!(s.load_counts(), (1, 1), "b waits");
    let out = run(&mut s);
    assert_eq!(out["a"].len(), 4);
    assert_eq!(
        out["b"], out["a"],
        "the same prompt gives the same tokens, later"
    );
    assert_eq!(s.preemptions(), 0);
}

#[test]
fn max_batch_bounds_the_running_set() {
    let mut s = scheduler(|c| c.max_batch = 2);
    for id in ["a", "b", "c"] {
        s.submit(request(id, 2, 3)).unwrap();
    }
    assert_eq!(step(&mut s).0, plan_of(&[("a", 2), ("b", 2)]));
    assert_eq!(s.load_counts(), (1, 2));
    let out = run(&mut s);
    assert!(
        out.values().all(|t| t.len() == 3 || t.len() == 2),
        "{out:?}"
    );
    assert_eq!(out["c"].len(), 3);
}

#[test]
fn a_full_pool_preempts_the_newest_sequence_which_is_recomputed_to_the_same_tokens() {
    let alone = |id: &str| {
        let mut s = scheduler(|_| {});
        s.submit(request(id, 6, 12)).unwrap();
        run(&mut s).remove(id).unwrap()
    };
    // Eight pages: two sequences of 6 + 12 tokens need five each.
    let mut s = scheduler(|c| c.kv_pages = 8);
    s.submit(request("a", 6, 12)).unwrap();
    s.submit(request("b", 6, 12)).unwrap();
    let mut preempted_plan = None;
    let mut out: HashMap<String, Vec<u32>> = HashMap::new();
    for n in 0..200 {
        if !s.has_work() {
            break;
        }
        let before = s.preemptions();
        let (plan, events) = step(&mut s);
        if n == 0 {
            assert_eq!(plan, plan_of(&[("a", 6), ("b", 2)]));
        }
        if s.preemptions() > before && preempted_plan.is_none() {
            preempted_plan = Some(plan);
        }
        for ev in events {
            if let StepEvent::Token { id, token, .. } = ev {
                out.entry(id.to_string()).or_default().push(token);
            }
        }
    }
    let plan = preempted_plan.expect("the pool ran out and b gave way");
    assert!(
        plan.iter().all(|(id, _)| id == "a"),
        "only a ran in the step b gave way: {plan:?}"
    );
    assert_eq!(out["a"], alone("a"));
    assert_eq!(out["b"], alone("b"), "b recomputed gives the same tokens");
    assert_eq!(s.free_pages(), 8);
}

/// A GPU that fails a forward pass ends that batch's requests with its error and leaks
/// none of their pages; a request after it runs as it would have alone.
#[test]
fn a_failed_forward_pass_ends_its_batch_with_the_error_and_the_engine_goes_on() {
    let mut s = scheduler(|_| {});
    s.submit(request("a", 6, 4)).unwrap();
    s.submit(request("b", 3, 4)).unwrap();
    let mut events = Vec::new();
    let plan = s.plan(&mut events).expect("work");
    assert_eq!(plan.work.len(), 2);
    let oom = CudaError::new(CudaErrorKind::OutOfMemory, "cuMemAllocAsync");
    let failed = s.execute(&plan, |_, _, _| Err(oom.clone()));
    assert_eq!(failed, Err(oom.clone()));
    s.fail(plan, &oom, &mut events);
    let ended: Vec<(String, CudaError)> = events
        .into_iter()
        .filter_map(|e| match e {
            StepEvent::Failed { id, error } => Some((id.to_string(), error)),
            _ => None,
        })
        .collect();
    assert_eq!(
        ended,
        [("a".to_owned(), oom.clone()), ("b".to_owned(), oom)]
    );
    assert!(!s.has_work());
    assert_eq!(s.free_pages(), 64, "every page came back");
    let mut alone = scheduler(|_| {});
    alone.submit(request("c", 5, 4)).unwrap();
    s.submit(request("c", 5, 4)).unwrap();
    assert_eq!(run(&mut s)["c"], run(&mut alone)["c"]);
}

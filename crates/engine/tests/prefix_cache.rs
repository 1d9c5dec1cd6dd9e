//! The device tier of the KV cache: reused prefix pages give bit-identical outputs to
//! recomputing them, in multi-turn sessions sharing a system prompt, with a roomy pool
//! and with one so small that cached pages are evicted and sequences preempted. Cached
//! tokens are reported, and every page comes back.

mod common;

use std::collections::HashMap;

use common::{Outcome, available, bits, greedy, run_all};
use pdmesh_engine::{Engine, StepEvent};

const SESSIONS: usize = 32;
const TURNS: usize = 3;
const ANSWER: u32 = 6;

/// Fixture prompts as token lists.
fn fixture_prompts() -> Vec<Vec<u32>> {
    common::fixtures()["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            p["prompt_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

fn cached_tokens(o: &Outcome) -> u32 {
    match &o.finished {
        Some(StepEvent::Finished { cached_tokens, .. }) => *cached_tokens,
        other => panic!("not finished: {other:?}"),
    }
}

/// Every session's outcome per turn. Each turn's prompt is the shared system prompt, the
/// session's history (its earlier questions and the engine's answers) and a new question;
/// all sessions of a turn run concurrently.
fn sessions(e: &mut Engine) -> Vec<HashMap<String, Outcome>> {
    let fx = fixture_prompts();
    let system: Vec<u32> = fx[0].iter().chain(&fx[1]).copied().collect();
    let mut history: Vec<Vec<u32>> = vec![system; SESSIONS];
    let mut turns = Vec::new();
    for turn in 0..TURNS {
        let reqs = (0..SESSIONS)
            .map(|s| {
                let q = &fx[(s + turn) % fx.len()];
                history[s].extend_from_slice(&q[..q.len().min(5 + s % 7)]);
                greedy(&format!("s{s}t{turn}"), &history[s], ANSWER)
            })
            .collect();
        let out = run_all(e, reqs);
        for (s, h) in history.iter_mut().enumerate() {
            h.extend_from_slice(&out[&format!("s{s}t{turn}")].tokens);
        }
        turns.push(out);
    }
    turns
}

fn assert_same_turns(a: &[HashMap<String, Outcome>], b: &[HashMap<String, Outcome>], what: &str) {
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

#[test]
fn slow_multi_turn_sessions_are_bit_identical_with_and_without_the_prefix_cache() {
    let mut plain = common::engine(|c| {
        c.prefix_cache = false;
        c.kv_pages = 1024;
    });
    let reference = sessions(&mut plain);
    assert_eq!(plain.cached_pages(), 0);
    assert_eq!(plain.free_pages(), 1024);
    for t in &reference {
        assert!(t.values().all(|o| cached_tokens(o) == 0));
    }

    // Roomy pool: everything a session computed is still cached at its next turn.
    let mut roomy = common::engine(|c| c.kv_pages = 1024);
    let got = sessions(&mut roomy);
    assert_same_turns(&reference, &got, "device prefix cache");
    let ps = 16;
    for (turn, t) in got.iter().enumerate() {
        for (id, o) in t {
            let c = cached_tokens(o) as usize;
            assert_eq!(c % ps, 0, "{id}: cached tokens come in whole pages");
            if turn > 0 {
                // The whole previous prompt and answer (less the last answer token, whose
                // KV is never computed) sit in cached pages.
                assert!(c >= 48, "{id} turn {turn}: only {c} cached tokens");
            }
        }
    }
    let hits: u32 = got.iter().flat_map(|t| t.values()).map(cached_tokens).sum();
    assert_eq!(u64::from(hits), roomy.cache_stats().hit_tokens);
    assert_eq!(roomy.cache_stats().evicted_pages, 0);
    assert_eq!(available(&roomy), 1024);
    roomy.flush_cache();
    assert_eq!(roomy.free_pages(), 1024, "after a flush every page is free");

    // A pool of 4-token pages far smaller than the sessions' history: cached pages are
    // evicted, sequences preempted, and still nothing changes.
    let mut tight = common::engine(|c| {
        c.page_size = 4;
        c.kv_pages = 160;
    });
    let got = sessions(&mut tight);
    assert_same_turns(&reference, &got, "prefix cache under eviction");
    assert!(
        tight.cache_stats().evicted_pages > 0,
        "the small pool must evict"
    );
    assert!(tight.cache_stats().hit_tokens > 0);
    assert_eq!(available(&tight), 160);
    tight.flush_cache();
    assert_eq!(tight.free_pages(), 160);
}

#[test]
fn a_repeated_prompt_reports_its_cached_whole_pages_and_leaves_the_last_token() {
    let fx = fixture_prompts();
    let prompt: Vec<u32> = fx[2].iter().chain(&fx[3]).copied().collect();
    let mut e = common::engine(|c| c.page_size = 8);
    let first = run_all(&mut e, vec![greedy("a", &prompt, 4)])
        .remove("a")
        .unwrap();
    assert_eq!(cached_tokens(&first), 0);
    let second = run_all(&mut e, vec![greedy("b", &prompt, 4)])
        .remove("b")
        .unwrap();
    assert_eq!(second.tokens, first.tokens);
    assert_eq!(cached_tokens(&second) as usize, (prompt.len() - 1) / 8 * 8);

    // A prompt that is exactly whole pages still computes its last token itself.
    let exact = &prompt[..16];
    run_all(&mut e, vec![greedy("c", exact, 2)]);
    let again = run_all(&mut e, vec![greedy("d", exact, 2)])
        .remove("d")
        .unwrap();
    assert_eq!(cached_tokens(&again), 8);
    assert_eq!(available(&e), 256);
}

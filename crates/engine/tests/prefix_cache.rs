//! The device tier of the KV cache: reused prefix pages give bit-identical outputs to
//! recomputing them, in multi-turn sessions sharing a system prompt, with a roomy pool
//! and with one so small that cached pages are evicted and sequences preempted. Cached
//! tokens are reported, and every page comes back; a flush frees what no request uses.

mod common;

use pdmesh_engine::StepEvent;

use common::{
    assert_same_turns, available, cached_tokens, fixture_prompts, greedy, run_all, sessions,
};

#[test]
fn slow_multi_turn_sessions_are_bit_identical_with_and_without_the_prefix_cache() {
    let mut plain = common::engine(|c| {
        c.prefix_cache = false;
        c.kv_pages = 1024;
    });
    let reference = sessions(&mut plain, 32);
    assert_eq!(plain.cached_pages(), 0);
    assert_eq!(plain.free_pages(), 1024);
    for t in &reference {
        assert!(t.values().all(|o| cached_tokens(o) == 0));
    }

    // Roomy pool: everything a session computed is still cached at its next turn.
    let mut roomy = common::engine(|c| c.kv_pages = 1024);
    let got = sessions(&mut roomy, 32);
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
    let got = sessions(&mut tight, 32);
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

#[test]
fn admission_reports_where_the_prompt_came_from_once() {
    let fx = fixture_prompts();
    let prompt: Vec<u32> = fx[2].iter().chain(&fx[3]).copied().collect();
    let mut e = common::engine(|c| c.page_size = 8);
    let admitted = |e: &mut pdmesh_engine::Engine, id: &str| {
        e.submit(greedy(id, &prompt, 3)).expect("valid request");
        let mut seen = Vec::new();
        while e.has_work() {
            for ev in e.step() {
                if let StepEvent::Admitted {
                    id,
                    device_cached,
                    host_cached,
                    ..
                } = ev
                {
                    seen.push((id.to_string(), device_cached, host_cached));
                }
            }
        }
        seen
    };
    // Nothing cached yet; then the same prompt finds its whole pages but the last token's.
    assert_eq!(admitted(&mut e, "a"), vec![("a".to_owned(), 0, 0)]);
    let hit = (prompt.len() - 1) / 8 * 8;
    assert_eq!(admitted(&mut e, "b"), vec![("b".to_owned(), hit, 0)]);
}

/// A host tier that holds nothing and records what it is offered.
#[derive(Default)]
struct Recorder {
    stored: std::sync::Arc<std::sync::Mutex<Vec<u64>>>,
    answers: Vec<pdmesh_kv::Fetched>,
}

impl pdmesh_kv::HostTier for Recorder {
    fn fetch(&mut self, f: pdmesh_kv::Fetch) {
        self.answers.push(pdmesh_kv::Fetched {
            ticket: f.ticket,
            ..Default::default()
        });
    }
    fn take_fetched(&mut self) -> Vec<pdmesh_kv::Fetched> {
        std::mem::take(&mut self.answers)
    }
    fn has_fetched(&self) -> bool {
        !self.answers.is_empty()
    }
    fn set_waker(&mut self, _waker: std::task::Waker) {}
    fn store(&mut self, pages: Vec<pdmesh_kv::StorePage>) -> bool {
        let mut got = self.stored.lock().unwrap();
        got.extend(pages.iter().map(|p| p.hash));
        true
    }
    fn accepts_stores(&self) -> bool {
        true
    }
    fn store_stats(&self) -> pdmesh_kv::StoreStats {
        pdmesh_kv::StoreStats::default()
    }
    fn generation(&self) -> u64 {
        0
    }
}

#[test]
fn a_flush_evicts_only_pages_no_request_uses_and_writes_them_back_first() {
    let fx = fixture_prompts();
    let prompt: Vec<u32> = fx[2].iter().chain(&fx[3]).copied().collect();
    let mut e = common::engine(|c| c.page_size = 4);
    let stored = std::sync::Arc::default();
    e.set_host_tier(
        Box::new(Recorder {
            stored: std::sync::Arc::clone(&stored),
            answers: Vec::new(),
        }),
        pdmesh_engine::WritePolicy::WriteBack,
    );
    let first = run_all(&mut e, vec![greedy("a", &prompt, 12)])
        .remove("a")
        .unwrap();
    let cached = e.cached_pages();
    assert!(cached > 0);
    assert!(
        stored.lock().unwrap().is_empty(),
        "write-back waits for eviction"
    );

    // The same prompt again: once admitted, it holds the prompt's cached pages, which
    // the flush must leave alone; the first answer's own pages go.
    e.submit(greedy("b", &prompt, 12)).expect("valid request");
    let mut tokens = Vec::new();
    while tokens.is_empty() {
        for ev in e.step() {
            if let StepEvent::Token { token, .. } = ev {
                tokens.push(token);
            }
        }
    }
    let in_use = (prompt.len() - 1) / 4;
    let idle = e.cached_pages();
    assert_eq!(
        idle,
        cached - in_use,
        "the running request holds its prefix"
    );
    let flushed = e.flush_cache();
    assert_eq!(flushed, idle);
    assert_eq!(e.cached_pages(), 0);
    assert_eq!(
        stored.lock().unwrap().len(),
        flushed,
        "every flushed page was written back before it went"
    );
    assert_eq!(e.cache_stats().evicted_pages, flushed as u64);
    while e.has_work() {
        for ev in e.step() {
            if let StepEvent::Token { token, .. } = ev {
                tokens.push(token);
            }
        }
    }
    assert_eq!(tokens, first.tokens, "the running request did not notice");

    // Idle: a flush frees the whole pool; a second finds nothing.
    assert!(e.flush_cache() > 0);
    assert_eq!(e.free_pages(), 256);
    assert_eq!(e.flush_cache(), 0);
}

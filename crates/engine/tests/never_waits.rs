//! Architecture Invariant: the engine thread never waits on the host tier. A fetch is
//! started at admission and its answer joins the batch later; meanwhile every running
//! sequence advances one token per step, counted in steps (no clock). A late answer, a
//! hit, a miss or an abort changes no bit of anyone's output, and every page comes back.
//! The tier here is an in-memory fake whose answers the test releases by hand.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use common::{available, fixture_prompts, greedy, run_all};
use pdmesh_engine::{Engine, StepEvent, WritePolicy};
use pdmesh_kv::{Fetch, Fetched, HostTier, StorePage, StoreStats};

/// The fake's state, shared between the tier an engine owns and the test.
#[derive(Default)]
struct Mem {
    pages: HashMap<u64, Vec<u8>>,
    /// Fetches not answered yet.
    pending: Vec<Fetch>,
    answers: Vec<Fetched>,
    /// While set, fetches wait for [`release`].
    hold: bool,
    fetched: usize,
    /// The tier is unreachable: it accepts no store.
    down: bool,
}

impl Mem {
    fn answer(&mut self, f: Fetch) {
        let run: Vec<Vec<u8>> = f
            .hashes
            .iter()
            .map_while(|h| self.pages.get(h).cloned())
            .collect();
        let pages = if run.len() < f.min_pages {
            Vec::new()
        } else {
            run
        };
        self.answers.push(Fetched {
            ticket: f.ticket,
            pages,
            ..Fetched::default()
        });
    }
}

/// Answers every held fetch.
fn release(mem: &Mutex<Mem>) {
    let mut m = mem.lock().unwrap();
    m.hold = false;
    for f in std::mem::take(&mut m.pending) {
        m.answer(f);
    }
}

struct MemTier(Arc<Mutex<Mem>>);

impl HostTier for MemTier {
    fn fetch(&mut self, f: Fetch) {
        let mut m = self.0.lock().unwrap();
        m.fetched += 1;
        if m.hold {
            m.pending.push(f);
        } else {
            m.answer(f);
        }
    }
    fn take_fetched(&mut self) -> Vec<Fetched> {
        std::mem::take(&mut self.0.lock().unwrap().answers)
    }
    fn has_fetched(&self) -> bool {
        !self.0.lock().unwrap().answers.is_empty()
    }
    fn set_waker(&mut self, _waker: std::task::Waker) {}
    fn store(&mut self, pages: Vec<StorePage>) -> bool {
        let mut m = self.0.lock().unwrap();
        for p in pages {
            m.pages.entry(p.hash).or_insert(p.bytes);
        }
        true
    }
    fn accepts_stores(&self) -> bool {
        !self.0.lock().unwrap().down
    }
    fn store_stats(&self) -> StoreStats {
        StoreStats::default()
    }
    fn generation(&self) -> u64 {
        0
    }
}

fn with_tier(mem: &Arc<Mutex<Mem>>) -> Engine {
    let mut e = common::engine(|_| {});
    e.set_host_tier(Box::new(MemTier(mem.clone())), WritePolicy::WriteThrough);
    e
}

/// Steps `e` once; the tokens each request got.
fn step(e: &mut Engine) -> HashMap<String, Vec<u32>> {
    let mut got: HashMap<String, Vec<u32>> = HashMap::new();
    for ev in e.step() {
        if let StepEvent::Token { id, token, .. } = ev {
            got.entry(id.to_string()).or_default().push(token);
        }
    }
    got
}

#[test]
fn a_host_fetch_that_never_answers_costs_running_sequences_no_step() {
    let fx = fixture_prompts();
    // Shorter than a page and a token: it fetches nothing and runs at once.
    let short = &fx[3][..10];
    let long: Vec<u32> = fx[0].iter().chain(&fx[1]).chain(&fx[2]).copied().collect();
    assert!(long.len() > 48);
    let mut plain = common::engine(|c| c.prefix_cache = false);
    let want = run_all(
        &mut plain,
        vec![greedy("a", short, 40), greedy("b", &long, 8)],
    );

    // The long prompt's pages are in the host tier (written by another worker).
    let mem: Arc<Mutex<Mem>> = Arc::default();
    let mut writer = with_tier(&mem);
    run_all(&mut writer, vec![greedy("w", &long, 8)]);
    assert!(mem.lock().unwrap().pages.len() >= 3);

    let mut e = with_tier(&mem);
    let total = available(&e);
    let before = {
        let mut m = mem.lock().unwrap();
        m.hold = true;
        m.fetched
    };
    e.submit(greedy("a", short, 40)).unwrap();
    let mut a = Vec::new();
    while a.is_empty() {
        a.extend(step(&mut e).remove("a").unwrap_or_default());
    }
    e.submit(greedy("b", &long, 8)).unwrap();
    // Twenty steps while b's fetch is held: a gets a token in every one, b none.
    for n in 0..20 {
        let mut got = step(&mut e);
        let t = got.remove("a").unwrap_or_default();
        assert_eq!(t.len(), 1, "step {n}: a advances");
        assert!(got.is_empty(), "step {n}: {got:?}");
        a.extend(t);
        assert_eq!(e.awaiting_host(), 1);
    }
    assert_eq!(mem.lock().unwrap().fetched, before + 1, "one fetch, for b");

    // The answer arrives late: b joins the batch and both finish as they would have.
    release(&mem);
    assert!(e.has_work());
    let rest = common::run_submitted(&mut e, &["a".to_owned(), "b".to_owned()]);
    a.extend(&rest["a"].tokens);
    assert_eq!(a, want["a"].tokens);
    assert_eq!(rest["b"].tokens, want["b"].tokens);
    for (x, y) in rest["b"].logits.iter().zip(&want["b"].logits) {
        assert!(common::bits(x) == common::bits(y), "b's logits differ");
    }
    let st = e.host_stats();
    assert!(st.hit_tokens >= 48, "b's prefix came from the host: {st:?}");
    assert_eq!(e.awaiting_host(), 0);
    assert_eq!(available(&e), total, "pages leaked");
}

#[test]
fn a_request_aborted_while_its_fetch_is_out_gives_its_pages_back_and_the_late_answer_is_dropped() {
    let fx = fixture_prompts();
    let long: Vec<u32> = fx[0].iter().chain(&fx[1]).chain(&fx[2]).copied().collect();
    let mem: Arc<Mutex<Mem>> = Arc::default();
    let mut e = with_tier(&mem);
    let total = available(&e);
    mem.lock().unwrap().hold = true;
    e.submit(greedy("b", &long, 8)).unwrap();
    assert!(step(&mut e).is_empty());
    assert_eq!(e.awaiting_host(), 1);
    assert!(!e.has_work(), "nothing to step until the answer comes");
    assert!(available(&e) < total, "b holds its pages while it waits");
    assert_eq!(e.load_counts(), (1, 0), "b counts as waiting");

    assert!(e.abort("b"));
    assert_eq!(e.awaiting_host(), 0);
    assert_eq!(available(&e), total, "b's pages came back");
    release(&mem);
    // The answer for nobody is taken and dropped; nothing runs.
    assert!(e.has_work());
    assert!(e.step().is_empty());
    assert!(!e.has_work());
    assert_eq!(e.host_stats().hit_tokens, 0);

    // The same id again is a new request that computes (the fake holds nothing).
    let out = run_all(&mut e, vec![greedy("b", &long, 8)]);
    let mut plain = common::engine(|c| c.prefix_cache = false);
    let want = run_all(&mut plain, vec![greedy("b", &long, 8)]);
    assert_eq!(out["b"].tokens, want["b"].tokens);
    assert_eq!(available(&e), total);
}

#[test]
fn pages_a_down_tier_could_not_take_are_offered_again_once_it_is_back() {
    let fx = fixture_prompts();
    let long: Vec<u32> = fx[0].iter().chain(&fx[1]).chain(&fx[2]).copied().collect();
    let mem: Arc<Mutex<Mem>> = Arc::default();
    let mut e = with_tier(&mem);
    mem.lock().unwrap().down = true;
    run_all(&mut e, vec![greedy("a", &long, 4)]);
    assert!(
        mem.lock().unwrap().pages.is_empty(),
        "nothing is copied out for a down tier"
    );
    // Back: the same prompt (now a device hit) retires, and its pages are offered, since
    // none was marked written while the tier was down.
    mem.lock().unwrap().down = false;
    run_all(&mut e, vec![greedy("b", &long, 4)]);
    assert!(mem.lock().unwrap().pages.len() >= 3);
}

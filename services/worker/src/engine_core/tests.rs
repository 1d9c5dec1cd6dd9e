//! Unit tests of [`EngineCore`] without an actor system: a fake engine and a clock that
//! moves only when a test (or the fake) moves it, so stage times come out exact.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use super::*;

/// The clock of [`super::now`] in unit tests: it stands still until a test (or the
/// fake engine) moves it, so stage times come out exact.
pub(super) mod clock {
    use std::cell::Cell;
    use std::time::{Duration, Instant};

    thread_local! {
        static BASE: Instant = Instant::now();
        static MOVED: Cell<Duration> = const { Cell::new(Duration::ZERO) };
    }

    pub(crate) fn now() -> Instant {
        BASE.with(|b| *b) + MOVED.with(Cell::get)
    }

    pub(crate) fn advance(by: Duration) {
        MOVED.with(|m| m.set(m.get() + by));
    }
}

/// A fake engine: each running request produces token 7 per step until `max` tokens,
/// and holds one "page" while running. Admitting a request takes `prefill` on the
/// clock, before its first token.
#[derive(Default)]
struct Fake {
    running: Vec<(String, u32, u32)>, // id, produced, max
    aborted: Vec<String>,
    panic_on_step: bool,
    prefill: Duration,
    /// Prefill parts submitted: the next step prefills them (pages held for export,
    /// `Exported` then `Finished`, as the engine does).
    prefills: Vec<String>,
    /// Prefills whose pages wait for export.
    exports: Vec<String>,
}

const PAGES: usize = 10;

/// A one-token prompt's request `id` finished at its length limit.
fn length_reached(id: Arc<str>, completion_tokens: u32, cached_tokens: u32) -> StepEvent {
    StepEvent::Finished {
        id,
        reason: FinishReason::Length,
        matched_stop: None,
        matched_token: None,
        prompt_tokens: 1,
        completion_tokens,
        cached_tokens,
    }
}

impl Backend for Fake {
    fn info(&self) -> ModelInfo {
        ModelInfo {
            model_id: "fake".into(),
            context_length: 64,
            vocab_size: 100,
            eos_token_ids: vec![2],
            kv_layout: String::new(),
            kv_layout_fingerprint: "0".repeat(16),
            page_size: 16,
            total_pages: PAGES as u32,
            max_batch: 4,
        }
    }
    fn free_pages(&self) -> usize {
        PAGES - self.running.len()
    }
    fn submit(
        &mut self,
        req: GenRequest,
        part: Part,
        _group: Option<(&str, usize)>,
    ) -> Result<(), EngineError> {
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if part == Part::Prefill {
            self.prefills.push(req.id);
            return Ok(());
        }
        self.running
            .push((req.id, 0, req.params.max_tokens.unwrap_or(3)));
        Ok(())
    }
    fn abort(&mut self, id: &str) -> bool {
        self.drop_export(id);
        self.prefills.retain(|p| p != id);
        let before = self.running.len();
        self.running.retain(|r| r.0 != id);
        self.aborted.push(id.to_owned());
        before != self.running.len()
    }
    fn step(&mut self) -> Vec<StepEvent> {
        assert!(!self.panic_on_step, "kernel exploded");
        let mut out = Vec::new();
        for id in std::mem::take(&mut self.prefills) {
            let id: Arc<str> = id.into();
            self.exports.retain(|e| **e != *id);
            self.exports.push(id.to_string());
            out.push(StepEvent::Exported {
                id: id.clone(),
                token: 7,
                logprob: None,
                pages: 1,
                cached: 0,
            });
            out.push(length_reached(id, 1, 0));
        }
        for r in &mut self.running {
            let id: Arc<str> = r.0.as_str().into();
            if r.1 == 0 {
                out.push(StepEvent::Admitted {
                    id: id.clone(),
                    device_cached: 16,
                    host_cached: 16,
                    at: clock::now(),
                });
                clock::advance(self.prefill);
            }
            r.1 += 1;
            out.push(StepEvent::Token {
                id: id.clone(),
                token: 7,
                logprob: Some(Logprob {
                    logprob: -0.5,
                    top: vec![(7, -0.5)],
                }),
            });
            if r.1 == r.2 {
                out.push(length_reached(id, r.1, 32));
            }
        }
        self.running.retain(|r| r.1 < r.2);
        out
    }
    fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.prefills.is_empty()
    }
    fn export(&mut self, id: &str, f: ExportFn) -> Result<Vec<u64>, EngineError> {
        if !self.drop_export(id) {
            return Err(EngineError::Transfer(format!("no pages held for {id:?}")));
        }
        Ok(f(&[id.as_bytes()]))
    }
    fn drop_export(&mut self, id: &str) -> bool {
        let before = self.exports.len();
        self.exports.retain(|e| e != id);
        before != self.exports.len()
    }
}

fn req(id: &str, max_tokens: u32) -> GenRequest {
    GenRequest {
        id: id.into(),
        prompt: vec![5],
        params: pdmesh_engine::SamplingParams::greedy(max_tokens),
    }
}

/// A core on a [`Fake`] engine with `r` submitted whole (ticket 1), and its client's
/// channel.
fn submitted(r: GenRequest) -> (EngineCore<Fake>, UnboundedReceiver<Event>) {
    let mut core = EngineCore::new(Fake::default());
    let (tx, rx) = unbounded_channel();
    core.submit(r, Part::Whole, None, 1, tx).unwrap();
    (core, rx)
}

fn drain(rx: &mut UnboundedReceiver<Event>) -> Vec<Event> {
    std::iter::from_fn(|| rx.try_recv().ok()).collect()
}

fn run_to_end(core: &mut EngineCore<Fake>) {
    while core.has_work() {
        core.step();
    }
}

#[test]
fn tokens_then_one_finished_go_to_the_submitting_channel() {
    let (mut core, mut rx) = submitted(req("a", 2));
    run_to_end(&mut core);
    let events = drain(&mut rx);
    assert_eq!(events.len(), 3, "{events:?}");
    assert_eq!(
        events[0],
        Event::Token {
            token: 7,
            logprob: Some(Logprob {
                logprob: -0.5,
                top: vec![(7, -0.5)],
            })
        }
    );
    assert!(
        matches!(&events[2], Event::Finished(f) if f.reason == FinishReason::Length && f.completion_tokens == 2)
    );
    assert!(
        rx.try_recv().is_err() && rx.is_closed(),
        "the sender is dropped after Finished"
    );
}

/// The stages split where the engine says: the queue ends when the engine admitted
/// the request (not when the core heard of it, after the step), prefill runs from
/// there to the first token, decode from the first token to the end.
#[test]
fn finished_reports_stage_times_and_host_hits_from_admission() {
    let mut core = EngineCore::new(Fake {
        prefill: Duration::from_millis(500),
        ..Fake::default()
    });
    let (tx, mut rx) = unbounded_channel();
    core.submit(req("a", 2), Part::Whole, None, 1, tx).unwrap();
    clock::advance(Duration::from_secs(2)); // waiting in the queue
    core.step(); // admitted, 0.5 s of prefill, the first token
    clock::advance(Duration::from_secs(3)); // decoding
    core.step();
    let Some(Event::Finished(f)) = drain(&mut rx).pop() else {
        panic!("no Finished");
    };
    assert_eq!((f.cached_tokens, f.host_cached_tokens), (32, 16));
    assert_eq!(f.transferred_tokens, 0);
    let s = f.stages;
    assert_eq!((s.queue, s.prefill, s.decode), (2.0, 0.5, 3.0), "{s:?}");
    assert_eq!(s.transfer, 0.0);
}

/// The gateway aborts a half-started request and tries it again under the same id; the
/// first try's late "let go of my pages" must not take the second try's pages.
#[test]
fn a_stale_submission_neither_drops_nor_exports_a_newer_ones_pages() {
    let mut core = EngineCore::new(Fake::default());
    // The first try prefills; its entry is gone once it finished, its pages held.
    let (tx1, _rx1) = unbounded_channel();
    core.submit(req("a", 4), Part::Prefill, None, 1, tx1)
        .unwrap();
    run_to_end(&mut core);
    assert_eq!(core.engine.as_ref().unwrap().exports, ["a"]);
    // The second try, before the first's guard has let go: its pages replace the
    // first's (the engine releases those).
    let (tx2, _rx2) = unbounded_channel();
    core.submit(req("a", 4), Part::Prefill, None, 2, tx2)
        .unwrap();
    run_to_end(&mut core);
    assert!(
        !core.drop_export("a", 1),
        "the first try's guard drops nothing"
    );
    assert!(!core.abort("a", Some(1)), "nor does its generation's");
    assert!(
        matches!(core.export("a", 1, Box::new(|_| vec![1])), Err(EngineError::Transfer(m)) if m.contains("aborted")),
        "the first try exports nothing"
    );
    assert_eq!(
        core.export("a", 2, Box::new(|pages| vec![pages.len() as u64]))
            .unwrap(),
        vec![1],
        "the second try's pages are still there"
    );
    assert!(!core.drop_export("a", 2), "exported pages are gone");
    // The gateway letting go of a request (no ticket) drops the pages it holds.
    let (tx3, _rx3) = unbounded_channel();
    core.submit(req("b", 4), Part::Prefill, None, 3, tx3)
        .unwrap();
    run_to_end(&mut core);
    assert!(core.abort("b", None));
    assert!(core.engine.as_ref().unwrap().exports.is_empty());
    assert!(!core.drop_export("b", 3), "already let go of");
    // Decode's side: a stale submission's hand-over fills nothing of the newer one's.
    let (tx4, _rx4) = unbounded_channel();
    core.submit(req("c", 4), Part::Decode, None, 4, tx4)
        .unwrap();
    let fill = || -> ImportFn { Box::new(|_: &mut [&mut [u8]]| Ok(())) };
    assert!(
        matches!(core.import(("c", 1), 7, None, 0, fill()), Err(EngineError::Transfer(m)) if m.contains("aborted"))
    );
    assert!(
        matches!(core.import(("c", 4), 7, None, 0, fill()), Err(EngineError::Transfer(m)) if m.contains("imports nothing")),
        "the current submission reaches the engine"
    );
}

#[test]
fn rejected_submit_returns_the_engine_error_and_registers_nothing() {
    let mut core = EngineCore::new(Fake::default());
    let (tx, rx) = unbounded_channel();
    let mut bad = req("a", 2);
    bad.prompt.clear();
    assert!(matches!(
        core.submit(bad, Part::Whole, None, 1, tx),
        Err(EngineError::EmptyPrompt)
    ));
    assert!(rx.is_closed());
    assert_eq!(core.info().unwrap().1.free_pages, PAGES);
}

#[test]
fn abort_frees_the_request_and_tells_its_client() {
    let (mut core, mut rx) = submitted(req("a", 100));
    core.step();
    assert_eq!(core.info().unwrap().1.free_pages, PAGES - 1);
    assert!(
        !core.abort("a", Some(2)),
        "a stale ticket does not abort a newer submission"
    );
    assert!(core.abort("a", Some(1)));
    assert!(!core.abort("a", None), "already gone");
    assert_eq!(core.info().unwrap().1.free_pages, PAGES);
    let events = drain(&mut rx);
    assert!(
        matches!(events.last(), Some(Event::Finished(f)) if f.reason == FinishReason::Abort && f.completion_tokens == 1 && f.prompt_tokens == 1)
    );
}

#[test]
fn a_departed_client_is_aborted_at_the_next_step() {
    let (mut core, rx) = submitted(req("a", 100));
    core.step();
    drop(rx);
    core.step();
    assert_eq!(core.engine.as_ref().unwrap().aborted, ["a"]);
    assert_eq!(core.info().unwrap().1.free_pages, PAGES);
    assert!(!core.has_work());
}

#[test]
fn a_panicking_step_takes_the_engine_offline_and_ends_every_stream() {
    let (mut core, mut rx) = submitted(req("a", 100));
    core.engine.as_mut().unwrap().panic_on_step = true;
    core.step();
    assert!(
        drain(&mut rx).is_empty() && rx.is_closed(),
        "stream ends without Finished"
    );
    assert!(matches!(core.info(), Err(EngineError::Offline)));
    let (tx, _rx) = unbounded_channel();
    assert!(matches!(
        core.submit(req("b", 1), Part::Whole, None, 2, tx),
        Err(EngineError::Offline)
    ));
}

#[test]
fn abort_all_finishes_everyone() {
    let mut core = EngineCore::new(Fake::default());
    let (tx1, mut rx1) = unbounded_channel();
    let (tx2, mut rx2) = unbounded_channel();
    core.submit(req("a", 100), Part::Whole, None, 1, tx1)
        .unwrap();
    core.submit(req("b", 100), Part::Whole, None, 2, tx2)
        .unwrap();
    assert_eq!(core.abort_all(), 2);
    for rx in [&mut rx1, &mut rx2] {
        assert!(
            matches!(drain(rx).last(), Some(Event::Finished(f)) if f.reason == FinishReason::Abort)
        );
    }
    assert!(!core.has_work());
}

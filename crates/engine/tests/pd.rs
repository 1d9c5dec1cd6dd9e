//! Prefill/decode disaggregation at the engine level: a prefill engine computes each
//! prompt and its first token, a decode engine reserves pages, receives the prompt's KV
//! and the first token, and generates the rest. The output must be bit-identical to one
//! unified engine's, for greedy, seeded and constrained sampling, whatever order the two
//! sides meet in.

mod common;

use std::collections::HashMap;

use common::*;
use pdmesh_engine::{Engine, GenRequest, Logprob, Part, SamplingParams, StepEvent};

fn requests() -> Vec<GenRequest> {
    let fx = fixture_prompts();
    let mut out = Vec::new();
    for i in 0..24 {
        let mut prompt = fx[i % fx.len()].clone();
        // Lengths on both sides of page boundaries (16 tokens a page).
        prompt.extend(fx[(i + 1) % fx.len()].iter().take(i * 3));
        let params = match i % 3 {
            0 => SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(7)
            },
            1 => SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                seed: Some(i as u64),
                frequency_penalty: 0.5,
                max_tokens: Some(6),
                // Sampling changes that must act the same on both sides of a hand-over.
                logit_bias: vec![(13, 4.0), (2, -100.0)],
                min_tokens: 2,
                ..SamplingParams::default()
            },
            _ => SamplingParams {
                temperature: 1.1,
                top_k: 20,
                seed: Some(100 + i as u64),
                // A one-token request finishes on the prefill's token.
                max_tokens: Some(if i == 2 { 1 } else { 5 }),
                logprobs: true,
                top_logprobs: 3,
                ..SamplingParams::default()
            },
        };
        let mut params = params;
        if i % 8 == 7 {
            // Constrained decoding: the decode side's grammar must accept the prefill's
            // first token and go on exactly as a unified engine would.
            params.grammar = Some(compiled(
                r#"start: %json{"type":"object","properties":{"city":{"type":"string"},"n":{"type":"integer"}},"required":["city","n"],"x-guidance":{"whitespace_flexible":false}}"#,
            ));
            params.max_tokens = Some(10);
        }
        out.push(GenRequest {
            id: format!("r{i}"),
            prompt,
            params,
        });
    }
    out
}

/// A log-probability's bits and its top tokens' (token, bits).
type LogprobBits = (u32, Vec<(u32, u32)>);

#[derive(Debug, Default, Clone, PartialEq)]
struct Seen {
    /// Each token with its log-probability's bits (when asked).
    tokens: Vec<(u32, Option<LogprobBits>)>,
    finished: Option<StepEvent>,
}

fn record(out: &mut HashMap<String, Seen>, ev: StepEvent) {
    match ev {
        StepEvent::Token { id, token, logprob } => {
            out.entry(id.to_string()).or_default().tokens.push((
                token,
                logprob.map(|l| {
                    let top = l.top.iter().map(|&(t, v)| (t, v.to_bits())).collect();
                    (l.logprob.to_bits(), top)
                }),
            ))
        }
        StepEvent::Finished { ref id, .. } => {
            out.entry(id.to_string()).or_default().finished = Some(ev.clone())
        }
        StepEvent::Admitted { .. } => {}
        other => panic!("unexpected {other:?}"),
    }
}

fn unified(reqs: &[GenRequest]) -> HashMap<String, Seen> {
    let mut e = engine(|_| {});
    for r in reqs {
        e.submit(r.clone()).unwrap();
    }
    let mut out = HashMap::new();
    while e.has_work() {
        for ev in e.step() {
            record(&mut out, ev);
        }
    }
    out
}

/// Normalizes what differs by design: the decode side reports no cached prompt tokens.
fn without_cached(mut m: HashMap<String, Seen>) -> HashMap<String, Seen> {
    for s in m.values_mut() {
        if let Some(StepEvent::Finished { cached_tokens, .. }) = &mut s.finished {
            *cached_tokens = 0;
        }
    }
    m
}

#[test]
fn prefill_then_decode_is_bit_identical_to_unified() {
    let reqs = requests();
    let want = unified(&reqs);
    let mut p = engine(|_| {});
    // A small decode pool, so reservations queue behind each other.
    let mut d = engine(|c| c.kv_pages = 48);
    let (p_idle, d_idle) = (available(&p), available(&d));

    // Decode reserves first (as the rooms require), prefill computes meanwhile.
    for r in &reqs {
        d.submit_part(r.clone(), Part::Decode).unwrap();
        p.submit_part(r.clone(), Part::Prefill).unwrap();
    }
    let mut exported: HashMap<String, (u32, Option<Logprob>)> = HashMap::new();
    while p.has_work() {
        for ev in p.step() {
            match ev {
                StepEvent::Exported {
                    id, token, logprob, ..
                } => {
                    exported.insert(id.to_string(), (token, logprob));
                }
                StepEvent::Finished { .. } | StepEvent::Admitted { .. } => {}
                other => panic!("a prefill engine emitted {other:?}"),
            }
        }
    }
    assert_eq!(exported.len(), reqs.len());
    assert_eq!(p.exports().0, reqs.len(), "every prefill holds its pages");

    let mut got: HashMap<String, Seen> = HashMap::new();
    let mut done = 0;
    let mut steps = 0;
    while done < reqs.len() || d.has_work() {
        steps += 1;
        assert!(steps < 100_000, "decode made no progress");
        let events = d.step();
        for ev in events {
            match ev {
                StepEvent::Reserved { id, pages, held } => {
                    let (token, logprob) = exported[&*id].clone();
                    let kv: Vec<Vec<u8>> = p
                        .export(&id, |src| src.iter().map(|b| b.to_vec()).collect())
                        .unwrap();
                    assert_eq!(kv.len(), pages, "{id}: page counts agree");
                    let evs = d
                        .import(&id, token, logprob, 0, |dst| {
                            assert_eq!(dst.len(), pages - held, "only pages not held arrive");
                            for (d, s) in dst.iter_mut().zip(&kv[held..]) {
                                d.copy_from_slice(s);
                            }
                            Ok(())
                        })
                        .unwrap();
                    for ev in evs {
                        if matches!(ev, StepEvent::Finished { .. }) {
                            done += 1;
                        }
                        record(&mut got, ev);
                    }
                }
                ev @ StepEvent::Finished { .. } => {
                    done += 1;
                    record(&mut got, ev);
                }
                ev => record(&mut got, ev),
            }
        }
    }
    assert_eq!(without_cached(got), without_cached(want));
    assert_eq!(p.exports(), (0, 0));
    assert_eq!(d.reserved(), (0, 0));
    assert_eq!(
        (available(&p), available(&d)),
        (p_idle, d_idle),
        "no page leaked"
    );
}

#[test]
fn aborts_and_failed_imports_release_reservations_and_exports() {
    let reqs = requests();
    let mut p = engine(|_| {});
    let mut d = engine(|c| c.kv_pages = 48);
    let (p_idle, d_idle) = (available(&p), available(&d));
    for r in &reqs[..4] {
        d.submit_part(r.clone(), Part::Decode).unwrap();
        p.submit_part(r.clone(), Part::Prefill).unwrap();
    }
    let reserved: Vec<String> = step_all(&mut d)
        .into_iter()
        .filter_map(|ev| match ev {
            StepEvent::Reserved { id, .. } => Some(id.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(reserved.len(), 4);
    assert!(d.reserved().1 > 0);
    step_all(&mut p);
    assert_eq!(p.exports().0, 4);

    // r0: the client left during the transfer — both sides let go.
    assert!(d.abort("r0"));
    assert!(p.abort("r0"), "an abort reaches a held export");
    // r1: bytes that fail their check leave the request parked, then its abort frees it.
    let err = d
        .import("r1", 5, None, 0, |_| {
            Err("page 0 failed its checksum".into())
        })
        .unwrap_err();
    assert!(
        matches!(&err, pdmesh_engine::EngineError::Fill(e) if e.to_string() == "page 0 failed its checksum"),
        "{err}"
    );
    assert!(d.abort("r1"));
    assert!(p.drop_export("r1"));
    // r2: a token outside the vocabulary is refused before anything is written.
    assert!(d.import("r2", u32::MAX, None, 0, |_| Ok(())).is_err());
    assert!(d.abort("r2") && p.drop_export("r2"));
    // r3: an import for a request that holds nothing is an error, not a panic.
    assert!(d.import("nobody", 1, None, 0, |_| Ok(())).is_err());
    assert!(d.abort("r3") && p.drop_export("r3"));
    assert!(!p.drop_export("r3"), "an export is dropped once");

    assert_eq!(p.exports(), (0, 0));
    assert_eq!(d.reserved(), (0, 0));
    assert!(!d.has_work() && !p.has_work());
    assert_eq!(
        (available(&p), available(&d)),
        (p_idle, d_idle),
        "no page leaked"
    );
}

/// Moves request `id`'s KV from prefill engine `p` into decode engine `d`'s reserved
/// pages with its first token, recording the events the import produces.
fn hand_over(
    p: &mut Engine,
    d: &mut Engine,
    id: &str,
    (token, logprob): (u32, Option<Logprob>),
    got: &mut HashMap<String, Seen>,
) {
    let kv: Vec<Vec<u8>> = p
        .export(id, |src| src.iter().map(|b| b.to_vec()).collect())
        .unwrap();
    for ev in d
        .import(id, token, logprob, 0, |dst| {
            for (d, s) in dst.iter_mut().zip(&kv) {
                d.copy_from_slice(s);
            }
            Ok(())
        })
        .unwrap()
    {
        record(got, ev);
    }
}

#[test]
fn reservations_are_bounded_by_pages_not_by_batch_slots() {
    // A decode engine running two sequences at a time reserves pages for all six
    // requests at once: a request waiting for a batch slot must not also wait (and time
    // out) for its pages. KV that arrives while the batch is full waits, with its pages,
    // for a slot, and the output is still the unified engine's.
    let reqs: Vec<GenRequest> = requests().into_iter().take(6).collect();
    let want = unified(&reqs);
    let mut p = engine(|_| {});
    let mut d = engine(|c| c.max_batch = 2);
    let d_idle = available(&d);
    for r in &reqs {
        d.submit_part(r.clone(), Part::Decode).unwrap();
        p.submit_part(r.clone(), Part::Prefill).unwrap();
    }
    let exported = prefill_all(&mut p);
    let reserved: Vec<String> = d
        .step()
        .into_iter()
        .filter_map(|ev| match ev {
            StepEvent::Reserved { id, .. } => Some(id.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(reserved.len(), 6, "every request holds its pages at once");
    let mut got: HashMap<String, Seen> = HashMap::new();
    for id in &reserved {
        hand_over(&mut p, &mut d, id, exported[id].clone(), &mut got);
    }
    // Those not finished on their first token hold their KV, two of them running.
    let finished = got.values().filter(|s| s.finished.is_some()).count();
    assert!(finished >= 1, "r2 finishes on its first token");
    assert_eq!(d.reserved(), (0, 0));
    assert_eq!(
        d.load_counts(),
        (6 - finished - 2, 2),
        "the rest wait for a slot"
    );
    let mut n = 0;
    while d.has_work() {
        n += 1;
        assert!(n < 100_000, "decode made no progress");
        for ev in d.step() {
            record(&mut got, ev);
        }
        assert!(d.load_counts().1 <= 2, "never more than max_batch running");
    }
    assert_eq!(without_cached(got), without_cached(want));
    assert_eq!(available(&d), d_idle, "no page leaked");

    // A request aborted while it waits for a slot gives its pages back.
    let mut d = engine(|c| c.max_batch = 1);
    for r in &reqs[..2] {
        d.submit_part(r.clone(), Part::Decode).unwrap();
    }
    assert_eq!(d.step().len(), 2, "both reserved");
    for r in &reqs[..2] {
        d.import(&r.id, 1, None, 0, |_| Ok(())).unwrap();
    }
    assert_eq!(d.load_counts(), (1, 1));
    assert!(d.abort(&reqs[1].id), "the waiting one");
    assert!(d.abort(&reqs[0].id), "the running one");
    assert_eq!((d.load_counts(), d.has_work()), ((0, 0), false));
    assert_eq!(available(&d), d_idle);
}

#[test]
fn a_sequence_that_cannot_grow_waits_for_reserved_pages_instead_of_ending_short() {
    // Eight pages of 16 tokens. A runs alone and must grow to four pages; B's reservation
    // holds five while its KV travels. Ending A when the pool is full (finish "length"
    // short of its max_tokens) would be a silently truncated answer: A must wait for B's
    // KV, then one of them gives way and is recomputed, and both answers are the unified
    // engine's.
    let fx = fixture_prompts();
    let tokens: Vec<u32> = fx.iter().flatten().copied().collect();
    let req = |id: &str, len: usize, max: u32| GenRequest {
        id: id.into(),
        prompt: tokens.iter().cycle().take(len).copied().collect(),
        params: SamplingParams {
            ignore_eos: true,
            max_tokens: Some(max),
            ..SamplingParams::greedy(0)
        },
    };
    let (a, b) = (req("a", 20, 40), req("b", 70, 4));
    let want = unified(&[a.clone(), b.clone()]);
    let mut p = engine(|_| {});
    let mut d = engine(|c| c.kv_pages = 8);
    let d_idle = available(&d);
    for r in [&a, &b] {
        d.submit_part(r.clone(), Part::Decode).unwrap();
        p.submit_part(r.clone(), Part::Prefill).unwrap();
    }
    let exported = prefill_all(&mut p);
    let reserved = d.step();
    assert_eq!(reserved.len(), 2, "both reserved: {reserved:?}");
    let mut got: HashMap<String, Seen> = HashMap::new();
    hand_over(&mut p, &mut d, "a", exported["a"].clone(), &mut got);
    // A runs until the pool is full, then waits (B still holds its reservation).
    for _ in 0..200 {
        for ev in d.step() {
            record(&mut got, ev);
        }
    }
    assert!(
        got["a"].finished.is_none(),
        "A must not end while pages are only reserved: {:?}",
        got["a"]
    );
    assert!(
        !d.has_work(),
        "waiting for reserved pages is not work: the loop must not spin"
    );
    hand_over(&mut p, &mut d, "b", exported["b"].clone(), &mut got);
    assert!(d.has_work(), "the KV's arrival wakes it");
    while d.has_work() {
        for ev in d.step() {
            record(&mut got, ev);
        }
    }
    assert_eq!(got["a"].tokens.len(), 40);
    assert_eq!(without_cached(got), without_cached(want));
    assert!(d.preemptions() > 0, "one of them gave way");
    assert_eq!(available(&d), d_idle, "no page leaked");
}

//! The corruption oracle: a prompt's greedy tokens and every logits row are bit-identical
//! whether it runs alone or batched with 31 others, whatever the prefill chunking, and
//! after being preempted and recomputed. Also: every page returns to the pool.

mod common;

use common::{Outcome, bits, greedy, run_all, run_submitted};
use pdmesh_engine::{GenRequest, Part, SamplingParams, StepEvent};

fn prompts() -> Vec<Vec<u32>> {
    let base = common::fixture_prompts();
    // 32 prompts of varied lengths: fixture prompts, their prefixes and concatenations.
    let mut out = Vec::new();
    for i in 0..32 {
        let a = &base[i % base.len()];
        let b = &base[(i * 7 + 3) % base.len()];
        let mut p = a[..a.len().min(3 + i * 2)].to_vec();
        if i % 3 == 0 {
            p.extend_from_slice(b);
        }
        out.push(p);
    }
    out
}

fn assert_same(alone: &Outcome, other: &Outcome, what: &str) {
    assert_eq!(alone.tokens, other.tokens, "{what}: tokens differ");
    assert_eq!(
        alone.logits.len(),
        other.logits.len(),
        "{what}: logits rows"
    );
    for (i, (a, b)) in alone.logits.iter().zip(&other.logits).enumerate() {
        assert!(bits(a) == bits(b), "{what}: logits row {i} differs");
    }
}

#[test]
fn slow_batch_of_32_is_bit_identical_to_alone() {
    let ps = prompts();
    let mut e = common::engine(|c| {
        c.max_batch = 32;
        c.kv_pages = 512;
    });
    let baseline = common::available(&e);
    let alone: Vec<Outcome> = ps
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 8 == 0)
        .map(|(i, p)| {
            run_all(&mut e, vec![greedy(&format!("a{i}"), p, 12)])
                .remove(&format!("a{i}"))
                .unwrap()
        })
        .collect();
    let batch = run_all(
        &mut e,
        ps.iter()
            .enumerate()
            .map(|(i, p)| greedy(&format!("b{i}"), p, 12))
            .collect(),
    );
    for (k, a) in alone.iter().enumerate() {
        assert_same(
            a,
            &batch[&format!("b{}", k * 8)],
            &format!("prompt {} alone vs in a batch of 32", k * 8),
        );
        assert_eq!(a.tokens.len(), 12);
    }
    assert_eq!(common::available(&e), baseline, "every page returned");
}

#[test]
fn chunked_prefill_is_bit_identical() {
    let ps = prompts();
    let p = &ps[3]; // the longest kind: prefix + a full chat prompt
    assert!(p.len() > 30);
    let one = {
        let mut e = common::engine(|c| c.prefill_chunk = 4096);
        run_all(&mut e, vec![greedy("x", p, 8)])
            .remove("x")
            .unwrap()
    };
    for chunk in [1, 5, 16] {
        let mut e = common::engine(|c| c.prefill_chunk = chunk);
        let got = run_all(&mut e, vec![greedy("x", p, 8)])
            .remove("x")
            .unwrap();
        assert_same(&one, &got, &format!("prefill in chunks of {chunk}"));
    }
}

#[test]
fn preemption_under_page_pressure_changes_nothing() {
    let ps = prompts();
    let reqs = |tag: &str| {
        (0..6)
            .map(|i| greedy(&format!("{tag}{i}"), &ps[i * 5], 24))
            .collect::<Vec<_>>()
    };
    let roomy = {
        let mut e = common::engine(|c| c.kv_pages = 256);
        run_all(&mut e, reqs("r"))
    };
    // 4-token pages and barely enough of them: sequences get preempted and recomputed.
    let mut e = common::engine(|c| {
        c.page_size = 4;
        c.kv_pages = 40;
    });
    let tight = run_all(&mut e, reqs("t"));
    assert!(
        e.preemptions() > 0,
        "the tight pool must have forced preemptions"
    );
    for i in 0..6 {
        assert_same(
            &roomy[&format!("r{i}")],
            &tight[&format!("t{i}")],
            &format!("request {i} under page pressure"),
        );
    }
    assert_eq!(common::available(&e), 40);
}

#[test]
fn seeded_sampling_is_reproducible_in_any_batch() {
    let ps = prompts();
    let params = SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        top_k: 40,
        seed: Some(7),
        max_tokens: Some(10),
        ..Default::default()
    };
    let req = |id: &str, p: &[u32]| GenRequest {
        id: id.into(),
        prompt: p.to_vec(),
        params: params.clone(),
    };
    let mut e = common::engine(|_| {});
    let alone = run_all(&mut e, vec![req("s", &ps[1])]).remove("s").unwrap();
    let mixed = run_all(
        &mut e,
        vec![req("m0", &ps[2]), req("s2", &ps[1]), req("m1", &ps[4])],
    );
    assert_eq!(alone.tokens, mixed["s2"].tokens);
    let other_seed = {
        let mut p = params.clone();
        p.seed = Some(8);
        run_all(
            &mut e,
            vec![GenRequest {
                id: "o".into(),
                prompt: ps[1].clone(),
                params: p,
            }],
        )
        .remove("o")
        .unwrap()
    };
    assert_ne!(
        alone.tokens, other_seed.tokens,
        "a different seed samples differently"
    );
}

/// Logprobs are the raw logits' log-softmax (whatever the sampling settings), with the top
/// tokens in order, and carry the same bits alone, in a batch and in prefill chunks.
#[test]
fn logprobs_are_the_raw_distribution_alone_batched_and_chunked() {
    let ps = prompts();
    let asked = |id: &str, p: &[u32], params: SamplingParams| GenRequest {
        id: id.into(),
        prompt: p.to_vec(),
        params: SamplingParams {
            logprobs: true,
            top_logprobs: 5,
            ..params
        },
    };
    // Penalties, bias and temperature change what is sampled, not what is reported.
    let shaped = SamplingParams {
        temperature: 0.7,
        seed: Some(3),
        frequency_penalty: 1.0,
        logit_bias: vec![(28, 30.0)],
        ..SamplingParams::greedy(6)
    };
    let mut e = common::engine(|_| {});
    for params in [SamplingParams::greedy(6), shaped.clone()] {
        let alone = run_all(&mut e, vec![asked("a", &ps[3], params.clone())])
            .remove("a")
            .unwrap();
        assert_eq!(alone.logprobs.len(), alone.tokens.len());
        for ((row, &tok), lp) in alone.logits.iter().zip(&alone.tokens).zip(&alone.logprobs) {
            let want = pdmesh_engine::Logprob::of(row, tok, 5);
            assert_eq!(lp, &want, "the raw row's log-softmax");
            assert_eq!(lp.top.len(), 5);
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
            assert!(lp.logprob <= lp.top[0].1 && lp.logprob < 0.0);
        }
        let batch = run_all(
            &mut e,
            vec![
                asked("m0", &ps[5], params.clone()),
                asked("s", &ps[3], params.clone()),
                greedy("m1", &ps[7], 6),
            ],
        );
        assert_eq!(batch["s"].logprobs, alone.logprobs, "in a batch");
        assert!(batch["m1"].logprobs.is_empty(), "none unless asked");
        let mut chunked = common::engine(|c| c.prefill_chunk = 5);
        let got = run_all(&mut chunked, vec![asked("c", &ps[3], params.clone())]);
        assert_eq!(got["c"].logprobs, alone.logprobs, "prefill in chunks of 5");
    }
    // The bias is seen: token 28 is drawn every time, yet reported at its raw value.
    let out = run_all(&mut e, vec![asked("b", &ps[3], shaped)])
        .remove("b")
        .unwrap();
    assert!(out.tokens.iter().all(|&t| t == 28), "{:?}", out.tokens);
    assert!(out.logprobs.iter().any(|l| l.top[0].0 != 28));
}

/// min_tokens holds back EOS, stop tokens and stop strings; logit_bias forces a token;
/// bad values are refused by name.
#[test]
fn min_tokens_and_logit_bias() {
    let ps = prompts();
    let mut e = common::engine(|_| {});
    let free = common::available(&e);
    let full = run_all(&mut e, vec![greedy("g", &ps[0], 10)])
        .remove("g")
        .unwrap();
    let run = |e: &mut pdmesh_engine::Engine, params: SamplingParams| {
        run_all(
            e,
            vec![GenRequest {
                id: "x".into(),
                prompt: ps[0].clone(),
                params,
            }],
        )
        .remove("x")
        .unwrap()
    };
    // The first greedy token as a stop token: it would end the request at once.
    let stop_at_first = SamplingParams {
        stop_token_ids: vec![full.tokens[0]],
        ..SamplingParams::greedy(10)
    };
    let out = run(&mut e, stop_at_first.clone());
    assert!(out.tokens.is_empty());
    let out = run(
        &mut e,
        SamplingParams {
            min_tokens: 4,
            ..stop_at_first
        },
    );
    assert!(out.tokens.len() >= 4, "{:?}", out.tokens);
    assert!(!out.tokens[..4].contains(&full.tokens[0]));
    // A stop string the first tokens write: no match before min_tokens either.
    let letters = SamplingParams {
        stop: ["e", "a", "o", " "].map(String::from).to_vec(),
        ..SamplingParams::greedy(10)
    };
    assert!(run(&mut e, letters.clone()).tokens.len() < 3);
    let out = run(
        &mut e,
        SamplingParams {
            min_tokens: 3,
            ..letters
        },
    );
    assert!(out.tokens.len() >= 3, "{:?}", out.tokens);
    let forced = run(
        &mut e,
        SamplingParams {
            logit_bias: vec![(full.tokens[0] + 1, 100.0)],
            ..SamplingParams::greedy(5)
        },
    );
    assert_eq!(forced.tokens, vec![full.tokens[0] + 1; 5]);
    for (params, field) in [
        (
            SamplingParams {
                logit_bias: vec![(1, 100.5)],
                ..SamplingParams::greedy(4)
            },
            "logit_bias",
        ),
        (
            SamplingParams {
                logit_bias: vec![(u32::MAX, 1.0)],
                ..SamplingParams::greedy(4)
            },
            "logit_bias",
        ),
        (
            SamplingParams {
                logit_bias: vec![(1, 1.0), (1, 2.0)],
                ..SamplingParams::greedy(4)
            },
            "logit_bias",
        ),
        (
            SamplingParams {
                min_tokens: 5,
                ..SamplingParams::greedy(4)
            },
            "min_tokens",
        ),
        (
            SamplingParams {
                logprobs: true,
                top_logprobs: 21,
                ..SamplingParams::greedy(4)
            },
            "top_logprobs",
        ),
    ] {
        let err = e
            .submit(GenRequest {
                id: "bad".into(),
                prompt: ps[0].clone(),
                params,
            })
            .unwrap_err();
        assert!(
            matches!(err, pdmesh_engine::EngineError::InvalidParam { field: f, .. } if f == field),
            "{err:?}"
        );
    }
    assert_eq!(common::available(&e), free);
}

#[test]
fn stops_and_limits() {
    let ps = prompts();
    let mut e = common::engine(|_| {});
    let free = common::available(&e);
    // Greedy output of prompt 0, then stop on a string taken from inside it.
    let full = run_all(&mut e, vec![greedy("g", &ps[0], 16)])
        .remove("g")
        .unwrap();
    assert!(matches!(
        full.finished,
        Some(StepEvent::Finished {
            reason: pdmesh_engine::FinishReason::Length,
            completion_tokens: 16,
            ..
        })
    ));
    let stop_tok = full.tokens[5];
    let mut p = SamplingParams::greedy(16);
    p.ignore_eos = true;
    p.stop_token_ids = vec![stop_tok];
    let out = run_all(
        &mut e,
        vec![GenRequest {
            id: "t".into(),
            prompt: ps[0].clone(),
            params: p,
        }],
    )
    .remove("t")
    .unwrap();
    let first = full.tokens.iter().position(|&t| t == stop_tok).unwrap();
    assert_eq!(
        out.tokens,
        full.tokens[..first],
        "stop token is not emitted"
    );
    match out.finished {
        Some(StepEvent::Finished {
            reason,
            matched_token,
            completion_tokens,
            ..
        }) => {
            assert_eq!(reason, pdmesh_engine::FinishReason::Stop);
            assert_eq!(matched_token, Some(stop_tok));
            assert_eq!(completion_tokens as usize, first + 1);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(common::available(&e), free);
}

#[test]
fn bad_requests_are_refused_and_leave_the_pool_untouched() {
    let mut e = common::engine(|c| c.max_context = Some(64));
    let free = common::available(&e);
    let ok = |p: SamplingParams| GenRequest {
        id: "r".into(),
        prompt: vec![1, 2, 3],
        params: p,
    };
    let cases: Vec<(GenRequest, &str)> = vec![
        (
            GenRequest {
                id: "r".into(),
                prompt: vec![],
                params: SamplingParams::greedy(4),
            },
            "empty",
        ),
        (
            GenRequest {
                id: "r".into(),
                prompt: vec![5; 64],
                params: SamplingParams::greedy(4),
            },
            "context length is 64",
        ),
        (
            GenRequest {
                id: "r".into(),
                prompt: vec![5; 10],
                params: SamplingParams::greedy(60),
            },
            "exceeds the context length",
        ),
        (
            GenRequest {
                id: "r".into(),
                prompt: vec![49152],
                params: SamplingParams::greedy(4),
            },
            "outside the vocabulary",
        ),
        (
            ok(SamplingParams {
                temperature: -1.0,
                ..Default::default()
            }),
            "temperature",
        ),
        (
            ok(SamplingParams {
                top_p: 0.0,
                ..Default::default()
            }),
            "top_p",
        ),
        (
            ok(SamplingParams {
                top_p: 1.5,
                ..Default::default()
            }),
            "top_p",
        ),
        (
            ok(SamplingParams {
                min_p: 2.0,
                ..Default::default()
            }),
            "min_p",
        ),
        (
            ok(SamplingParams {
                max_tokens: Some(0),
                ..Default::default()
            }),
            "max_tokens",
        ),
        (
            ok(SamplingParams {
                stop: vec![String::new()],
                ..Default::default()
            }),
            "stop",
        ),
    ];
    for (req, want) in cases {
        let err = e.submit(req).unwrap_err();
        assert!(err.is_client_error());
        assert!(
            err.to_string().contains(want),
            "{err} should mention {want}"
        );
    }
    e.submit(greedy("dup", &[1, 2], 4)).unwrap();
    assert!(
        e.submit(greedy("dup", &[1, 2], 4))
            .unwrap_err()
            .to_string()
            .contains("already running")
    );
    assert!(e.abort("dup"));
    assert!(!e.abort("dup"));
    assert!(!e.has_work());
    assert_eq!(common::available(&e), free);
}

#[test]
fn abort_mid_generation_frees_pages() {
    let ps = prompts();
    let mut e = common::engine(|_| {});
    let free = common::available(&e);
    e.submit(greedy("a", &ps[3], 100)).unwrap();
    e.submit(greedy("b", &ps[4], 100)).unwrap();
    for _ in 0..3 {
        e.step();
    }
    assert!(e.free_pages() < free);
    assert!(e.abort("a"));
    let evs = e.step();
    assert!(
        evs.iter()
            .all(|ev| !matches!(ev, StepEvent::Token { id, .. } if &**id == "a")),
        "no events after abort"
    );
    assert!(e.abort("b"));
    assert_eq!(common::available(&e), free);
    assert!(!e.has_work());
}

#[test]
fn a_sequence_larger_than_the_pool_ends_with_length_instead_of_livelock() {
    // 8 pages of 4 tokens = 32 tokens of KV; no max_tokens, so it wants the whole context.
    let mut e = common::engine(|c| {
        c.page_size = 4;
        c.kv_pages = 8;
    });
    let mut p = SamplingParams::greedy(1);
    p.max_tokens = None;
    p.ignore_eos = true;
    let out = run_all(
        &mut e,
        vec![GenRequest {
            id: "big".into(),
            prompt: vec![1, 2, 3, 4, 5],
            params: p,
        }],
    );
    match &out["big"].finished {
        Some(StepEvent::Finished {
            reason,
            completion_tokens,
            ..
        }) => {
            assert_eq!(*reason, pdmesh_engine::FinishReason::Length);
            assert_eq!(
                *completion_tokens,
                32 - 5 + 1,
                "filled every slot, then one last token"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(common::available(&e), 8);
}

#[test]
fn the_newest_sequence_is_preempted_not_truncated_when_pages_run_out() {
    let ps = prompts();
    // 8 pages of 4 tokens: each request alone fits (5 + 20 tokens = 7 pages), both
    // together do not, so the newer one must wait and be recomputed, never cut short.
    let small = |c: &mut pdmesh_engine::EngineConfig| {
        c.page_size = 4;
        c.kv_pages = 8;
    };
    // The newer prompt is one token longer, so it is the first to need a new page.
    let (a, b) = (&ps[0][..5], &ps[8][..6]);
    let solo_a = run_all(&mut common::engine(small), vec![greedy("a", a, 20)])
        .remove("a")
        .unwrap();
    let solo_b = run_all(&mut common::engine(small), vec![greedy("b", b, 20)])
        .remove("b")
        .unwrap();
    let mut e = common::engine(small);
    let both = run_all(&mut e, vec![greedy("a", a, 20), greedy("b", b, 20)]);
    assert!(e.preemptions() > 0, "the pool must have run out");
    assert_same(&solo_a, &both["a"], "older request under pressure");
    assert_same(&solo_b, &both["b"], "newer request under pressure");
    for id in ["a", "b"] {
        assert!(
            matches!(
                both[id].finished,
                Some(StepEvent::Finished {
                    completion_tokens: 20,
                    ..
                })
            ),
            "{id}: {:?}",
            both[id].finished
        );
    }
    assert_eq!(common::available(&e), 8);
}

/// With a step target, a prompt that arrives while other sequences decode is computed a
/// page's worth of tokens a step (a 1 ns target leaves room for nothing more), so the
/// decoding streams keep getting a token every step; every output, the newcomer's and
/// the streams', is the bits of the run without a target.
#[test]
fn a_step_target_cuts_a_prompt_beside_decoding_streams_without_changing_output() {
    let ps = prompts();
    let long: Vec<u32> = ps.iter().flatten().copied().take(160).collect();
    assert_eq!(long.len(), 160, "enough fixture tokens for a long prompt");
    let run = |target: Option<std::time::Duration>| {
        let mut e = common::engine(|c| {
            c.page_size = 16;
            c.step_target = target;
        });
        for i in 0..2 {
            e.submit(greedy(&format!("s{i}"), &ps[i + 1], 40)).unwrap();
        }
        // Both streams prefilled and decoding before the long prompt arrives.
        let mut out: std::collections::HashMap<String, Vec<u32>> = Default::default();
        let mut record = |evs: Vec<StepEvent>| -> usize {
            let mut tokens = 0;
            for ev in evs {
                if let StepEvent::Token { id, token, .. } = ev {
                    out.entry(id.to_string()).or_default().push(token);
                    tokens += 1;
                }
            }
            tokens
        };
        while record(e.step()) < 2 {}
        e.submit(greedy("long", &long, 4)).unwrap();
        // Steps until the long prompt's first token; every one of them decodes both
        // streams (they have 40 tokens to go).
        let mut steps = 0;
        loop {
            let evs = e.step();
            steps += 1;
            let first = evs
                .iter()
                .any(|ev| matches!(ev, StepEvent::Token { id, .. } if &**id == "long"));
            let streams = record(evs) - usize::from(first);
            assert_eq!(
                streams, 2,
                "step {steps}: both streams decode while the prompt is cut"
            );
            if first {
                break;
            }
        }
        while e.has_work() {
            record(e.step());
        }
        let logits: Vec<Vec<u32>> = ["s0", "s1", "long"]
            .iter()
            .flat_map(|id| e.take_logits(id).unwrap_or_default())
            .map(|row| bits(&row))
            .collect();
        (steps, (out, logits))
    };
    let (whole, want) = run(None);
    let (cut, got) = run(Some(std::time::Duration::from_nanos(1)));
    assert_eq!(
        whole, 1,
        "without a target the prompt fits one 512-token chunk"
    );
    assert_eq!(cut, 160 / 16, "a page's worth a step");
    assert_eq!(got.0, want.0, "a step target changes no token");
    assert_eq!(got.0["long"].len(), 4);
    assert_eq!(got.1.len(), 40 + 40 + 4, "every logits row kept");
    assert!(got.1 == want.1, "a step target changes no logits bit");
}

/// Choices of one request (`n` > 1) share the prompt's computation: the prompt is computed
/// once, and each choice equals the same request run alone with its own seed, bit for bit,
/// whether the prompt ends mid-page or on a page boundary, and when the choice computing
/// the prompt is aborted before it finishes (another takes over). Every page comes back.
#[test]
fn choices_sharing_a_prompt_equal_separate_requests() {
    let base = prompts();
    let mid_page = base[3].clone();
    let mut whole_pages = base[9].clone();
    whole_pages.extend_from_slice(&base[12]);
    whole_pages.truncate(32);
    assert!(!mid_page.len().is_multiple_of(16) && whole_pages.len() == 32);
    let choice = |i: u64, p: &[u32]| GenRequest {
        id: format!("c{i}"),
        prompt: p.to_vec(),
        params: SamplingParams {
            temperature: 0.9,
            seed: Some(40 + i),
            max_tokens: Some(8),
            ignore_eos: true,
            logprobs: true,
            top_logprobs: 3,
            ..Default::default()
        },
    };
    // No prefix cache: whatever a choice did not compute, it shared.
    let mut e = common::engine(|c| c.prefix_cache = false);
    let total = e.free_pages();
    let work = |e: &pdmesh_engine::Engine| e.rank_work()[0].tokens;
    for prompt in [&mid_page, &whole_pages] {
        let alone: Vec<Outcome> = (0..3)
            .map(|i| {
                run_all(&mut e, vec![choice(i, prompt)])
                    .remove(&format!("c{i}"))
                    .unwrap()
            })
            .collect();
        assert_ne!(alone[0].tokens, alone[1].tokens, "the seeds differ");
        let before = work(&e);
        let ids: Vec<String> = (0..3).map(|i| format!("c{i}")).collect();
        for i in 0..3 {
            e.submit_shared(choice(i, prompt), Part::Whole, "g", 3)
                .unwrap();
        }
        let shared = run_submitted(&mut e, &ids);
        for i in 0..3 {
            let got = &shared[&ids[i]];
            assert_same(&alone[i], got, &format!("choice {i}"));
            assert_eq!(alone[i].logprobs, got.logprobs, "choice {i}: logprobs");
        }
        // The prompt once, then 7 decode steps per choice.
        assert_eq!(work(&e) - before, (prompt.len() + 3 * 7) as u64);
        match &shared["c2"].finished {
            Some(StepEvent::Finished {
                cached_tokens,
                prompt_tokens,
                ..
            }) => {
                assert_eq!(
                    cached_tokens, prompt_tokens,
                    "a follower computed none of it"
                )
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(e.free_pages(), total, "every page back");
    }
    // The group waits for all its choices; one aborted before the rest came counts.
    let alone: Vec<Outcome> = (0..3)
        .map(|i| {
            run_all(&mut e, vec![choice(i, &mid_page)])
                .remove(&format!("c{i}"))
                .unwrap()
        })
        .collect();
    e.submit_shared(choice(0, &mid_page), Part::Whole, "w", 3)
        .unwrap();
    e.submit_shared(choice(1, &mid_page), Part::Whole, "w", 3)
        .unwrap();
    assert!(!e.has_work(), "held until every choice is there");
    assert!(e.abort("c1"));
    assert!(!e.has_work());
    e.submit_shared(choice(2, &mid_page), Part::Whole, "w", 3)
        .unwrap();
    let before = work(&e);
    let got = run_submitted(&mut e, &["c0".to_owned(), "c2".to_owned()]);
    assert_same(&alone[0], &got["c0"], "gathered choice 0");
    assert_same(&alone[2], &got["c2"], "gathered choice 2");
    assert_eq!(work(&e) - before, (mid_page.len() + 2 * 7) as u64);
    // The leader leaves before its prompt is computed: the next choice computes it.
    let alone = &alone[1];
    for i in 0..3 {
        e.submit_shared(choice(i, &mid_page), Part::Whole, "h", 3)
            .unwrap();
    }
    assert!(e.abort("c0"));
    assert!(e.abort("c2"), "a waiting follower can be aborted");
    let got = run_submitted(&mut e, &["c1".to_owned()]);
    assert_same(alone, &got["c1"], "after the leader's abort");
    assert_eq!(e.free_pages(), total, "every page back");
}

/// A prompt's log-probabilities (`prompt_logprobs`, what `echo` with `logprobs` scores)
/// are the ones its tokens had when they were generated: a greedy answer fed back as the
/// prompt gets the very logprobs it was generated with, alone, in prefill chunks, beside
/// another request and with its prefix in the cache (which such a request does not use).
#[test]
fn prompt_logprobs_are_the_logprobs_the_tokens_were_generated_with() {
    let base = prompts();
    let start = base[3].clone();
    let mut e = common::engine(|_| {});
    let generated = run_all(
        &mut e,
        vec![GenRequest {
            id: "g".into(),
            prompt: start.clone(),
            params: SamplingParams {
                logprobs: true,
                top_logprobs: 3,
                ignore_eos: true,
                ..SamplingParams::greedy(8)
            },
        }],
    )
    .remove("g")
    .unwrap();
    assert!(generated.prompt_logprobs.is_none(), "not asked for");
    let mut scored = start.clone();
    scored.extend_from_slice(&generated.tokens[..7]);
    let score = |id: &str| GenRequest {
        id: id.into(),
        prompt: scored.clone(),
        params: SamplingParams {
            prompt_logprobs: Some(3),
            ignore_eos: true,
            ..SamplingParams::greedy(1)
        },
    };
    let free = common::available(&e);
    let check = |o: &Outcome, what: &str| {
        let lp = o.prompt_logprobs.as_ref().expect("asked for");
        assert_eq!(
            lp.len(),
            scored.len() - 1,
            "{what}: every token after the first"
        );
        assert_eq!(&lp[start.len() - 1..], &generated.logprobs[..7], "{what}");
        for (j, l) in lp.iter().enumerate() {
            assert_eq!(l.top.len(), 3, "{what}");
            assert!(l.top[0].1 >= l.logprob, "{what}: position {j}");
        }
        assert_eq!(
            o.tokens,
            [generated.tokens[7]],
            "{what}: then it generates as ever"
        );
    };
    // The answer's pages are in the prefix cache now; this request computes them anyway.
    let alone = run_all(&mut e, vec![score("a")]).remove("a").unwrap();
    check(&alone, "alone");
    let batch = run_all(&mut e, vec![greedy("o", &base[5], 6), score("b")]);
    check(&batch["b"], "beside another");
    assert_eq!(batch["b"].prompt_logprobs, alone.prompt_logprobs);
    let mut chunked = common::engine(|c| c.prefill_chunk = 5);
    let got = run_all(&mut chunked, vec![score("c")]).remove("c").unwrap();
    check(&got, "chunks of 5");
    assert_eq!(common::available(&e), free, "every page back");
    let too_many = SamplingParams {
        prompt_logprobs: Some(21),
        ..SamplingParams::greedy(1)
    };
    assert!(matches!(
        e.submit(GenRequest {
            id: "x".into(),
            prompt: scored.clone(),
            params: too_many
        }),
        Err(pdmesh_engine::EngineError::InvalidParam {
            field: "prompt_logprobs",
            ..
        })
    ));
}

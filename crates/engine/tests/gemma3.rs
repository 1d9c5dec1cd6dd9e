//! Gemma 3 270M against llama.cpp on the same GGUF (fixtures from
//! scripts/reference/gen_gemma3.py): greedy continuations of 32 tokens on eight prompts,
//! three longer than the 512-token sliding window; the window deciding those answers;
//! and batch and chunk invariance across the window's edge.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use pdmesh_engine::gemma::GemmaModel;
use pdmesh_engine::{BatchToken, Engine, EngineConfig};
use pdmesh_gguf::GgufFile;
use pdmesh_kv::PagePool;

/// Largest allowed |ours - llama.cpp| for a top-5 logit. llama.cpp quantizes activations
/// to Q8 against the Q5_0/Q4_K/Q6_K weights where pdmesh keeps them in f32, and rounds
/// GELU through an f16 table.
const LOGIT_TOL: f32 = 1.5;

fn fixtures() -> serde_json::Value {
    pdmesh_testkit::fixture("gemma3_reference.json")
}

fn engine(f: impl FnOnce(&mut EngineConfig)) -> Engine {
    let mut cfg = EngineConfig::new(pdmesh_gguf::models::require_gemma3_model());
    cfg.kv_pages = 1024;
    cfg.capture_logits = true;
    f(&mut cfg);
    Engine::load(cfg).expect("engine loads Gemma 3")
}

use common::greedy;

/// Every fixture prompt run in one batch: llama.cpp's greedy continuation exactly, and
/// each step's top-5 logits within the tolerance.
#[test]
fn greedy_continuations_match_llama_cpp() {
    let fx = fixtures();
    let n_gen = fx["n_gen"].as_u64().unwrap() as u32;
    let prompts = fx["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 8);
    assert!(
        prompts
            .iter()
            .filter(|p| p["prompt_ids"].as_array().unwrap().len() > 1400)
            .count()
            >= 3,
        "three prompts are longer than the window"
    );
    let mut e = engine(|_| {});
    let reqs = prompts
        .iter()
        .map(|p| {
            greedy(
                p["name"].as_str().unwrap(),
                &common::ids(&p["prompt_ids"]),
                n_gen,
            )
        })
        .collect();
    let out = common::run_all(&mut e, reqs);
    let mut worst = 0f32;
    let mut report = Vec::new();
    for p in prompts {
        let name = p["name"].as_str().unwrap();
        let got = &out[name];
        let want = common::ids(&p["greedy_ids"]);
        let diverge = got
            .tokens
            .iter()
            .zip(&want)
            .position(|(a, b)| a != b)
            .unwrap_or(want.len());
        let mut off = 0f32;
        for (i, step) in p["top5"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .take(diverge + 1)
        {
            for pair in step.as_array().unwrap() {
                let (id, logit) = (
                    pair[0].as_u64().unwrap() as usize,
                    pair[1].as_f64().unwrap() as f32,
                );
                off = off.max((got.logits[i][id] - logit).abs());
            }
        }
        worst = worst.max(off);
        report.push(format!(
            "{name}: {diverge}/{} identical, top-5 logits off by {off}",
            want.len()
        ));
    }
    eprintln!("{}", report.join("\n"));
    for p in prompts {
        let name = p["name"].as_str().unwrap();
        assert_eq!(
            out[name].tokens,
            common::ids(&p["greedy_ids"]),
            "{name}: greedy continuation"
        );
    }
    assert!(worst <= LOGIT_TOL, "top-5 logits off by {worst}");
}

/// The logits at the last position of `prompt`, computed by `model` on a fresh pool.
fn last_logits(model: &GemmaModel, prompt: &[u32]) -> Vec<f32> {
    let layout = Arc::new(model.cfg.kv_layout(16));
    let mut pool = PagePool::new(layout, prompt.len().div_ceil(16));
    let pages = pool.alloc(prompt.len().div_ceil(16)).unwrap();
    let tp = rayon::ThreadPoolBuilder::new().build().unwrap();
    let mut logits = Vec::new();
    for (c, chunk) in prompt.chunks(256).enumerate() {
        let batch: Vec<BatchToken> = chunk
            .iter()
            .enumerate()
            .map(|(i, &token)| BatchToken {
                seq: 0,
                pos: c * 256 + i,
                token,
                want_logits: c * 256 + i + 1 == prompt.len(),
            })
            .collect();
        logits = tp.install(|| model.forward(&tp, &mut pool, &[&pages], &batch));
    }
    logits.pop().unwrap()
}

/// For the prompts longer than the window, a model that ignores the window (every layer
/// global) answers otherwise: its logits at the prompt's end leave llama.cpp's tolerance
/// (with the window they are within it: checked above, at step 0 of each continuation).
#[test]
fn the_window_decides_the_long_prompts() {
    let fx = fixtures();
    let path = pdmesh_gguf::models::require_gemma3_model();
    let global = GemmaModel::load(Arc::new(GgufFile::open(&path).unwrap()))
        .unwrap()
        .without_window();
    let mut long = 0;
    for p in fx["prompts"].as_array().unwrap() {
        let prompt = common::ids(&p["prompt_ids"]);
        if prompt.len() <= global.cfg.window {
            continue;
        }
        long += 1;
        let name = p["name"].as_str().unwrap();
        let logits = last_logits(&global, &prompt);
        let off = p["top5"][0]
            .as_array()
            .unwrap()
            .iter()
            .map(|pair| {
                let id = pair[0].as_u64().unwrap() as usize;
                (logits[id] - pair[1].as_f64().unwrap() as f32).abs()
            })
            .fold(0f32, f32::max);
        assert!(
            off > 2.0 * LOGIT_TOL,
            "{name}: without the window the logits stay within {off} of llama.cpp's"
        );
        eprintln!("{name}: without the window, top-5 logits off by {off}");
    }
    assert!(long >= 3);
}

/// Batched with others, and prefilled in chunks whose edges fall on either side of the
/// window's (512), each sequence's logits are the bits it gets alone. The long prompts are
/// cut to 700 tokens: past the window, and cheap enough to run three ways.
#[test]
fn batch_and_chunks_across_the_window_change_nothing() {
    let fx = fixtures();
    let prompts: Vec<(String, Vec<u32>)> = fx["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| {
            ["long_counting", "long_recall", "fox", "code"].contains(&p["name"].as_str().unwrap())
        })
        .map(|p| {
            let mut ids = common::ids(&p["prompt_ids"]);
            ids.truncate(700);
            (p["name"].as_str().unwrap().to_owned(), ids)
        })
        .collect();
    assert_eq!(prompts.len(), 4);
    let n = 4;
    let mut alone: HashMap<String, common::Outcome> = HashMap::new();
    for (name, prompt) in &prompts {
        let mut e = engine(|c| c.prefill_chunk = 4096);
        alone.extend(common::run_all(&mut e, vec![greedy(name, prompt, n)]));
    }
    for chunk in [509, 64] {
        let mut e = engine(|c| c.prefill_chunk = chunk);
        let batch = prompts.iter().map(|(name, p)| greedy(name, p, n)).collect();
        let out = common::run_all(&mut e, batch);
        for (name, _) in &prompts {
            assert_eq!(
                out[name].tokens, alone[name].tokens,
                "{name}, chunk {chunk}"
            );
            assert_eq!(out[name].logits.len(), n as usize);
            for (a, b) in out[name].logits.iter().zip(&alone[name].logits) {
                assert_eq!(common::bits(a), common::bits(b), "{name}, chunk {chunk}");
            }
        }
    }
}

/// Prefill on one engine, decode on another, for prompts past the window: the tokens and
/// their log-probabilities are the bits one unified engine gives, greedy and seeded.
#[test]
fn prefill_then_decode_past_the_window_is_bit_identical_to_unified() {
    use pdmesh_engine::{GenRequest, Part, SamplingParams, StepEvent};
    let fx = fixtures();
    let mut reqs = Vec::new();
    for (i, p) in fx["prompts"].as_array().unwrap().iter().enumerate() {
        let name = p["name"].as_str().unwrap();
        if !["long_recall", "long_notes", "story"].contains(&name) {
            continue;
        }
        let mut prompt = common::ids(&p["prompt_ids"]);
        prompt.truncate(600 + 37 * i);
        let params = if i % 2 == 0 {
            SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(5)
            }
        } else {
            SamplingParams {
                temperature: 0.9,
                seed: Some(i as u64),
                max_tokens: Some(5),
                ignore_eos: true,
                logprobs: true,
                top_logprobs: 2,
                ..SamplingParams::default()
            }
        };
        reqs.push(GenRequest {
            id: name.into(),
            prompt,
            params,
        });
    }
    assert_eq!(reqs.len(), 3);
    let tokens = |evs: Vec<StepEvent>, out: &mut HashMap<String, Vec<(u32, Option<u32>)>>| {
        for ev in evs {
            if let StepEvent::Token { id, token, logprob } = ev {
                let lp = logprob.map(|l| l.logprob.to_bits());
                out.entry(id.to_string()).or_default().push((token, lp));
            }
        }
    };
    let mut want = HashMap::new();
    let mut u = engine(|_| {});
    for r in &reqs {
        u.submit(r.clone()).unwrap();
    }
    while u.has_work() {
        tokens(u.step(), &mut want);
    }

    // Decode keeps window pages for one sequence's window and chunk only: each arriving
    // prompt's pages past its window keep their global layers alone.
    let (mut p, mut d) = (
        engine(|_| {}),
        engine(|c| {
            c.kv_pages = 160;
            c.kv_window_pages = Some(c.window_pages_per_sequence(512));
        }),
    );
    for r in &reqs {
        d.submit_part(r.clone(), Part::Decode).unwrap();
        p.submit_part(r.clone(), Part::Prefill).unwrap();
    }
    let exported = common::prefill_all(&mut p);
    let mut got = HashMap::new();
    let mut steps = 0;
    while d.has_work() {
        steps += 1;
        assert!(steps < 10_000, "decode made no progress");
        for ev in d.step() {
            match ev {
                StepEvent::Reserved { id, held, .. } => {
                    let (token, logprob) = exported[&*id].clone();
                    let kv: Vec<Vec<u8>> = p
                        .export(&id, |src| src.iter().map(|b| b.to_vec()).collect())
                        .unwrap();
                    let evs = d
                        .import(&id, token, logprob, 0, |dst| {
                            for (d, s) in dst.iter_mut().zip(&kv[held..]) {
                                d.copy_from_slice(s);
                            }
                            Ok(())
                        })
                        .unwrap();
                    tokens(evs, &mut got);
                }
                ev => tokens(vec![ev], &mut got),
            }
        }
    }
    assert_eq!(got.len(), 3);
    assert_eq!(got, want);
}

fn prompt(name: &str) -> Vec<u32> {
    let fx = fixtures();
    let p = fx["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no prompt {name}"));
    common::ids(&p["prompt_ids"])
}

fn assert_same(got: &common::Outcome, want: &common::Outcome, what: &str) {
    assert_eq!(got.tokens, want.tokens, "{what}");
    assert_eq!(got.logits.len(), want.logits.len(), "{what}");
    for (a, b) in got.logits.iter().zip(&want.logits) {
        assert_eq!(common::bits(a), common::bits(b), "{what}");
    }
}

/// Pages the window has passed give their local layers' KV back as decoding goes on. With
/// only the window pages one sequence needs (49 for a window of 512 and chunks of 256),
/// a 1,600-token prompt and a short one run beside each other bit for bit as with a window
/// page for every page; the long context then holds well under half a dense model's KV.
#[test]
fn window_pages_are_freed_as_the_window_slides_and_change_nothing() {
    let mut long = prompt("long_notes");
    long.truncate(1600);
    let reqs = vec![greedy("long", &long, 24), greedy("fox", &prompt("fox"), 24)];
    let roomy = |c: &mut EngineConfig| {
        c.prefix_cache = false;
        c.max_batch = 2;
        c.prefill_chunk = 256;
    };
    let want = common::run_all(&mut engine(roomy), reqs.clone());
    let mut tight = engine(|c| {
        roomy(c);
        c.kv_window_pages = Some(c.window_pages_per_sequence(512));
    });
    assert_eq!(tight.pool().total_window_pages(), 49);
    assert!(tight.pool().pages_for_tokens(long.len()) > 2 * 49);
    // A prefill hands its prompt over whole, window layers included: this one cannot fit
    // in 49 window pages, and is refused naming them (nothing admitted, nothing held).
    let err = tight
        .submit_part(greedy("too-long", &long, 1), pdmesh_engine::Part::Prefill)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "the request needs 101 window KV pages (a prefill keeps its prompt's; see \
         --kv-window-pages) but the pool only has 49"
    );
    assert!(!tight.has_work());
    let got = common::run_all(&mut tight, reqs);
    for id in ["long", "fox"] {
        assert_same(&got[id], &want[id], id);
    }

    // Alone, once its prompt is computed: every page's global layers, the window's pages
    // of the local ones.
    let mut e = engine(|c| {
        roomy(c);
        c.kv_window_pages = Some(49);
    });
    e.submit(greedy("long", &long, 4)).unwrap();
    while !e
        .step()
        .iter()
        .any(|ev| matches!(ev, pdmesh_engine::StepEvent::Token { .. }))
    {}
    e.step();
    let pool = e.pool();
    let layout = pool.layout().clone();
    let dense = pool.used_pages() * layout.bytes_per_page();
    let held = pool.held_bytes();
    let segments = pool.total_window_pages() - pool.free_window_pages();
    assert!(segments <= 512 / 16 + 2, "{segments} window pages held");
    // Group 0 is the 3 global layers, group 1 the 15 local ones.
    assert_eq!(
        held,
        pool.used_pages() * layout.group_bytes_per_page(0)
            + segments * layout.group_bytes_per_page(1)
    );
    eprintln!(
        "{} tokens: {held} bytes held, {dense} dense ({:.2}x); the layout's hand-over figure {:.2}x",
        long.len() + 2,
        held as f64 / dense as f64,
        layout.handover_bytes(long.len() + 2) as f64 / dense as f64
    );
    assert!(held * 2 < dense, "{held} of {dense}");
}

/// A cached prefix serves a hit only where the window before its end is still held: a
/// prompt sharing the first pages of a finished long one (whose windows slid past them)
/// finds no hit, a follow-up sharing all of it finds every page, and both answer with the
/// bits of an engine without a cache. The KV events say which pages cannot end a hit.
#[test]
fn a_hybrid_prefix_hit_needs_the_window_at_its_end() {
    let mut long = prompt("long_recall");
    long.truncate(1200);
    let mut e = engine(|_| {});
    e.record_cache_events();
    let first = common::run_all(&mut e, vec![greedy("first", &long, 8)]);
    // Its prompt and the 7 answer tokens whose KV was computed are cached, page by page.
    let computed = [&long[..], &first["first"].tokens[..7]].concat();
    let pages = computed.len() / 16;
    let hashes = pdmesh_kv::page_hashes(e.pool().layout().fingerprint(), &computed, 16);
    let stored: Vec<(Vec<u64>, Vec<u64>)> = e
        .take_cache_events()
        .into_iter()
        .filter_map(|ev| match ev {
            pdmesh_kv::CacheEvent::Stored {
                hashes, unservable, ..
            } => Some((hashes, unservable)),
            _ => None,
        })
        .collect();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].0, hashes[..pages]);
    // The last step's window began at position 695 (page 43): the pages before it gave
    // their local layers back, and only a hit of all 75 pages has its window whole.
    assert_eq!(
        stored[0].1,
        hashes[..pages - 1],
        "only the last page ends a servable prefix"
    );

    let mut cold = engine(|c| c.prefix_cache = false);
    let mut shared = long[..160].to_vec();
    shared.extend(&prompt("story"));
    let follow = [&long[..], &first["first"].tokens[..], &prompt("weekdays")].concat();
    for (id, p, cached) in [("shared", &shared, 0), ("follow", &follow, pages * 16)] {
        let got = common::run_all(&mut e, vec![greedy(id, p, 6)]);
        let want = common::run_all(&mut cold, vec![greedy(id, p, 6)]);
        assert_same(&got[id], &want[id], id);
        assert_eq!(common::cached_tokens(&got[id]) as usize, cached, "{id}");
    }
}

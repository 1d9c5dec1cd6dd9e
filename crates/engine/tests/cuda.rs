//! The CUDA backend end to end, on a GPU machine only (the file is empty without the
//! `cuda` feature): `cargo nextest run --release -p pdmesh-engine --features cuda --test cuda`.
//! `PDMESH_TEST_GPU` picks the device (default 0).
//!
//! - SmolLM2's greedy output on the GPU equals the CPU backend's for five prompts.
//! - DeepSeek V3.2 (the tiny checkpoint, every latent and index-K cache form): greedy
//!   output equal to the CPU backend's, and bit-identical logits alone or batched.
//! - The GPU's own oracle: a token's logits are bit-identical whatever it was batched with
//!   and however its prompt was chunked (batch-invariant matrix products).
//! - Load-back: pages imported into a GPU engine (a prefill/decode hand-over, written into
//!   the pinned host pool and copied up layer by layer) give the same bits as the GPU
//!   computing them itself, for SmolLM2 and for DeepSeek in every cache form.
//! - Device memory per token of KV, as the driver counts it, is `KvLayout`'s figure (both
//!   models, every DeepSeek cache form); the figures are printed.

#![cfg(feature = "cuda")]

mod common;

use std::collections::HashMap;

use common::{Outcome, bits, engine, fixture_prompts, greedy, prefill_all, run_all, step_all};
use pdmesh_engine::{Engine, GpuConfig, Part, StepEvent};
use pdmesh_kv::{IndexKDtype, MlaCacheDtype};

fn gpu() -> GpuConfig {
    let ordinal = std::env::var("PDMESH_TEST_GPU").ok().map_or(0, |v| {
        v.parse().expect("PDMESH_TEST_GPU is a device ordinal")
    });
    GpuConfig {
        devices: vec![ordinal],
        ..GpuConfig::default()
    }
}

fn prompts() -> Vec<Vec<u32>> {
    let fx = fixture_prompts();
    assert!(fx.len() >= 5, "the fixtures hold at least five prompts");
    fx.into_iter().take(5).collect()
}

const NEW: u32 = 24;

fn outcomes(e: &mut Engine) -> HashMap<String, Outcome> {
    let reqs = prompts()
        .iter()
        .enumerate()
        .map(|(i, p)| greedy(&format!("p{i}"), p, NEW))
        .collect();
    run_all(e, reqs)
}

#[test]
fn smollm2_greedy_output_equals_the_cpu_backend() {
    let cpu = outcomes(&mut engine(|_| {}));
    let on_gpu = outcomes(&mut engine(|c| c.gpu = Some(gpu())));
    let mut worst = 0f32;
    for (id, want) in &cpu {
        let got = &on_gpu[id];
        assert_eq!(
            got.tokens, want.tokens,
            "{id}: GPU tokens differ from the CPU's"
        );
        assert_eq!(got.tokens.len(), NEW as usize);
        for (a, b) in got.logits.iter().zip(&want.logits) {
            for (x, y) in a.iter().zip(b) {
                worst = worst.max((x - y).abs());
            }
        }
    }
    // The CPU quantizes activations to 8 bits for its integer products; the GPU multiplies
    // f32 by dequantized f32 weights. Report how far apart their logits are.
    println!("largest |GPU - CPU| logit difference: {worst}");
    assert!(worst.is_finite());
}

#[test]
fn gpu_logits_do_not_depend_on_batch_or_chunking() {
    let mut together = engine(|c| c.gpu = Some(gpu()));
    let all = outcomes(&mut together);
    let mut alone = engine(|c| {
        c.gpu = Some(gpu());
        c.prefill_chunk = 7;
        c.max_batch = 1;
    });
    for (i, p) in prompts().iter().enumerate() {
        let id = format!("p{i}");
        let one = run_all(&mut alone, vec![greedy(&id, p, NEW)]);
        let (a, b) = (&one[&id], &all[&id]);
        assert_eq!(a.tokens, b.tokens, "{id}");
        assert_eq!(a.logits.len(), b.logits.len(), "{id}");
        for (x, y) in a.logits.iter().zip(&b.logits) {
            assert_eq!(
                bits(x),
                bits(y),
                "{id}: logits changed with batch and chunking"
            );
        }
    }
}

/// A prefill engine's exported pages imported into a decode engine (both on the GPU, as
/// in a PD hand-over) give the decode the unified GPU engine's tokens and logits, bit for
/// bit: a page of the wrong size or layout anywhere on the way shows here.
fn handover_gives_the_gpus_own_bits(make: impl Fn() -> Engine, prompts: &[Vec<u32>], new: u32) {
    let reqs = |ps: &[Vec<u32>]| -> Vec<_> {
        ps.iter()
            .enumerate()
            .map(|(i, p)| greedy(&format!("p{i}"), p, new))
            .collect()
    };
    let unified = run_all(&mut make(), reqs(prompts));
    let (mut p, mut d) = (make(), make());
    let mut got: HashMap<String, Vec<u32>> = HashMap::new();
    let mut logits: HashMap<String, Vec<Vec<f32>>> = HashMap::new();
    for r in reqs(prompts) {
        p.submit_part(r.clone(), Part::Prefill).unwrap();
        d.submit_part(r, Part::Decode).unwrap();
    }
    let firsts = prefill_all(&mut p);
    assert_eq!(
        firsts.len(),
        prompts.len(),
        "every prompt was prefilled and exported"
    );
    // The decode engine reserves its pages first.
    let reserved = d
        .step()
        .into_iter()
        .filter(|ev| matches!(ev, StepEvent::Reserved { .. }))
        .count();
    assert_eq!(reserved, prompts.len());
    for (id, (token, logprob)) in &firsts {
        let kv: Vec<Vec<u8>> = p
            .export(id, |src| src.iter().map(|b| b.to_vec()).collect())
            .unwrap();
        for ev in d
            .import(id, *token, logprob.clone(), 0, |dst| {
                for (dd, s) in dst.iter_mut().zip(&kv) {
                    dd.copy_from_slice(s);
                }
                Ok(())
            })
            .unwrap()
        {
            if let StepEvent::Token { id, token, .. } = ev {
                got.entry(id.to_string()).or_default().push(token);
            }
        }
    }
    for ev in step_all(&mut d) {
        if let StepEvent::Token { id, token, .. } = ev {
            got.entry(id.to_string()).or_default().push(token);
        }
    }
    for id in firsts.keys() {
        logits.insert(id.clone(), d.take_logits(id).unwrap_or_default());
    }
    for (id, want) in &unified {
        assert_eq!(got[id], want.tokens, "{id}: decode after hand-over");
        // Decode's logits are the unified run's after its first token.
        assert_eq!(
            logits[id].len(),
            new as usize - 1,
            "{id}: decode captured its logits"
        );
        let tail = &want.logits[want.logits.len() - logits[id].len()..];
        for (x, y) in logits[id].iter().zip(tail) {
            assert_eq!(bits(x), bits(y), "{id}: loaded pages changed the logits");
        }
    }
}

#[test]
fn pages_handed_over_into_a_gpu_engine_give_the_gpus_own_bits() {
    handover_gives_the_gpus_own_bits(|| engine(|c| c.gpu = Some(gpu())), &prompts(), NEW);
}

// ---- DeepSeek V3.2 (the tiny synthetic checkpoint) ----

const DS_FORMS: [(MlaCacheDtype, IndexKDtype); 4] = [
    (MlaCacheDtype::Bf16, IndexKDtype::Fp8),
    (MlaCacheDtype::Bf16, IndexKDtype::Bf16),
    (MlaCacheDtype::Fp8, IndexKDtype::Fp8),
    (MlaCacheDtype::Fp8, IndexKDtype::Bf16),
];

const DS_NEW: u32 = 16;

/// Five fixture prompts, repeated to 40, 60, ..., 120 tokens: the tiny model's indexer
/// keeps 64 positions, so some prompts attend densely at first and sparsely later, the
/// others sparsely from their prefill on.
fn ds_prompts() -> Vec<Vec<u32>> {
    prompts()
        .into_iter()
        .enumerate()
        .map(|(i, p)| p.iter().copied().cycle().take(40 + 20 * i).collect())
        .collect()
}

fn ds_outcomes(e: &mut Engine) -> HashMap<String, Outcome> {
    let reqs = ds_prompts()
        .iter()
        .enumerate()
        .map(|(i, p)| greedy(&format!("p{i}"), p, DS_NEW))
        .collect();
    run_all(e, reqs)
}

#[test]
fn dsa_tiny_greedy_output_equals_the_cpu_backend() {
    for (mla, ik) in DS_FORMS {
        let form = |c: &mut pdmesh_engine::EngineConfig| {
            c.kv_cache_dtype = mla;
            c.index_k_dtype = ik;
        };
        let cpu = ds_outcomes(&mut common::tiny_engine(form));
        let on_gpu = ds_outcomes(&mut common::tiny_engine(|c| {
            form(c);
            c.gpu = Some(gpu());
        }));
        let mut worst = 0f32;
        for (id, want) in &cpu {
            let got = &on_gpu[id];
            assert_eq!(
                got.tokens, want.tokens,
                "{id} ({mla:?}, {ik:?}): GPU tokens differ from the CPU's"
            );
            assert_eq!(got.tokens.len(), DS_NEW as usize);
            for (a, b) in got.logits.iter().zip(&want.logits) {
                for (x, y) in a.iter().zip(b) {
                    worst = worst.max((x - y).abs());
                }
            }
        }
        println!("{mla:?}/{ik:?}: largest |GPU - CPU| logit difference: {worst}");
        assert!(worst.is_finite());
    }
}

#[test]
fn dsa_tiny_gpu_logits_do_not_depend_on_batch_or_chunking() {
    for (mla, ik) in DS_FORMS {
        let form = |c: &mut pdmesh_engine::EngineConfig| {
            c.kv_cache_dtype = mla;
            c.index_k_dtype = ik;
            c.gpu = Some(gpu());
        };
        let all = ds_outcomes(&mut common::tiny_engine(form));
        let mut alone = common::tiny_engine(|c| {
            form(c);
            c.prefill_chunk = 7;
            c.max_batch = 1;
        });
        for (i, p) in ds_prompts().iter().enumerate() {
            let id = format!("p{i}");
            let one = run_all(&mut alone, vec![greedy(&id, p, DS_NEW)]);
            let (a, b) = (&one[&id], &all[&id]);
            assert_eq!(a.tokens, b.tokens, "{id} ({mla:?}, {ik:?})");
            assert_eq!(a.logits.len(), b.logits.len(), "{id}");
            for (x, y) in a.logits.iter().zip(&b.logits) {
                assert_eq!(
                    bits(x),
                    bits(y),
                    "{id} ({mla:?}, {ik:?}): logits changed with batch and chunking"
                );
            }
        }
    }
}

/// The seed's bug class on the GPU: DeepSeek's pages (latent, rope, index-K and their
/// scales, in every cache form) handed over into a GPU engine give its own bits.
#[test]
fn dsa_tiny_pages_handed_over_into_a_gpu_engine_give_the_gpus_own_bits() {
    for (mla, ik) in DS_FORMS {
        let make = || {
            common::tiny_engine(|c| {
                c.kv_cache_dtype = mla;
                c.index_k_dtype = ik;
                c.gpu = Some(gpu());
            })
        };
        handover_gives_the_gpus_own_bits(make, &ds_prompts(), DS_NEW);
    }
}

// ---- Device memory per token of KV ----

/// Device memory used per page of KV (as the driver counts it) and the layout's own bytes
/// per page: two engines that differ only in their page count, the difference in memory
/// in use divided by the pages added. Weights, kernels and the context cancel out.
fn device_bytes_per_page(make: impl Fn(usize) -> Engine, few: usize, many: usize) -> (f64, usize) {
    let probe = pdmesh_engine::cuda::MemProbe::open(gpu().devices[0]).expect("the GPU opens");
    let with = |pages: usize| {
        let e = make(pages);
        assert_eq!(
            e.pool().total_pages(),
            pages,
            "the engine has the pages asked for"
        );
        let used = probe.used().expect("device memory in use");
        let layout = e.pool().layout().bytes_per_page();
        drop(e);
        (used, layout)
    };
    let (small, layout) = with(few);
    let (large, layout_again) = with(many);
    assert_eq!(layout, layout_again);
    assert!(large > small, "more pages took no more device memory");
    ((large - small) as f64 / (many - few) as f64, layout)
}

/// The figure and the layout's must agree within the allocator's rounding of one
/// allocation: well under 1% of what the extra pages take here.
fn assert_agrees(what: &str, measured: f64, layout: usize, page_size: usize) {
    let ratio = measured / layout as f64;
    println!(
        "{what}: device {:.1} B per token of KV, KvLayout {:.1} B (ratio {ratio:.4})",
        measured / page_size as f64,
        layout as f64 / page_size as f64
    );
    assert!(
        (ratio - 1.0).abs() < 0.01,
        "{what}: the device holds {measured:.0} B per page, the layout says {layout}"
    );
}

#[test]
fn device_memory_per_token_of_kv_is_the_layouts_figure() {
    // SmolLM2: 4096 extra pages of 16 tokens are about 1.5 GB.
    let (measured, layout) = device_bytes_per_page(
        |pages| {
            engine(|c| {
                c.gpu = Some(gpu());
                c.kv_pages = pages;
            })
        },
        64,
        64 + 4096,
    );
    assert_agrees("SmolLM2", measured, layout, 16);
    for (mla, ik) in DS_FORMS {
        // The tiny model's pages are small: 16384 extra pages are 400 MB or more.
        let (measured, layout) = device_bytes_per_page(
            |pages| {
                common::tiny_engine(|c| {
                    c.kv_cache_dtype = mla;
                    c.index_k_dtype = ik;
                    c.gpu = Some(gpu());
                    c.kv_pages = pages;
                })
            },
            64,
            64 + 16384,
        );
        assert_agrees(&format!("dsa-tiny {mla:?}/{ik:?}"), measured, layout, 16);
    }
}

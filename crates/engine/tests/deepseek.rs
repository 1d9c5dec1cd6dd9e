//! The DeepSeek V3.2 model on the synthesized tiny checkpoint (real safetensors files,
//! fp8 block-scaled weights, loaded by the real loader): a token's logits do not depend on
//! its batch or on how its prompt was chunked, in each of the four cache forms; sparse
//! attention equals dense while the context fits the indexer's top-k and departs from it
//! after; the indexer's pieces agree with plain reference loops written here.

use std::sync::{Arc, OnceLock};

use pdmesh_engine::BatchToken;
use pdmesh_engine::deepseek::{DeepSeekModel, DsConfig};
use pdmesh_engine::deepseek_synth;
use pdmesh_kv::{IndexKDtype, MlaCacheDtype, PageId, PagePool};

const PAGE: usize = 16;

fn model() -> &'static DeepSeekModel {
    static M: OnceLock<(tempfile::TempDir, DeepSeekModel)> = OnceLock::new();
    &M.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        deepseek_synth::write(dir.path(), &deepseek_synth::tiny_config(), 7, None).unwrap();
        let m = DeepSeekModel::load(dir.path()).unwrap();
        (dir, m)
    })
    .1
}

fn tp() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap()
}

fn pool(cfg: &DsConfig, mla: MlaCacheDtype, ik: IndexKDtype, pages: usize) -> PagePool {
    PagePool::new(Arc::new(cfg.kv_layout(mla, ik, PAGE).unwrap()), pages)
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 7919 + seed * 104_729) % 49_000 + 3)
        .collect()
}

/// Runs the prompts, `chunk` tokens of each per forward call, all prompts in every call;
/// returns each prompt's last-token logits.
fn run(
    m: &DeepSeekModel,
    pool: &mut PagePool,
    prompts: &[Vec<u32>],
    chunk: usize,
) -> Vec<Vec<f32>> {
    let tp = tp();
    let pages: Vec<Vec<PageId>> = prompts
        .iter()
        .map(|p| pool.alloc(p.len().div_ceil(PAGE)).unwrap())
        .collect();
    let refs: Vec<&[PageId]> = pages.iter().map(|p| &p[..]).collect();
    let mut last = vec![Vec::new(); prompts.len()];
    let longest = prompts.iter().map(Vec::len).max().unwrap();
    for start in (0..longest).step_by(chunk) {
        let mut batch = Vec::new();
        let mut owners = Vec::new();
        for (s, p) in prompts.iter().enumerate() {
            for pos in start..(start + chunk).min(p.len()) {
                let want = pos + 1 == p.len();
                batch.push(BatchToken {
                    seq: s,
                    pos,
                    token: p[pos],
                    want_logits: want,
                });
                if want {
                    owners.push(s);
                }
            }
        }
        for (s, l) in owners.into_iter().zip(m.forward(&tp, pool, &refs, &batch)) {
            last[s] = l;
        }
    }
    for p in pages {
        pool.release_all(&p).unwrap();
    }
    last
}

const FORMS: [(MlaCacheDtype, IndexKDtype); 4] = [
    (MlaCacheDtype::Bf16, IndexKDtype::Fp8),
    (MlaCacheDtype::Bf16, IndexKDtype::Bf16),
    (MlaCacheDtype::Fp8, IndexKDtype::Fp8),
    (MlaCacheDtype::Fp8, IndexKDtype::Bf16),
];

#[test]
fn logits_do_not_depend_on_batch_or_chunking_in_any_cache_form() {
    let m = model();
    // Past the top-k of 64, so the indexer chooses.
    let a = prompt(1, 150);
    let b = prompt(2, 90);
    for (mla, ik) in FORMS {
        let mut p = pool(&m.cfg, mla, ik, 64);
        let alone = run(m, &mut p, std::slice::from_ref(&a), a.len());
        let chunked = run(m, &mut p, std::slice::from_ref(&a), 17);
        let token_by_token = run(m, &mut p, std::slice::from_ref(&a), 1);
        let batched = run(m, &mut p, &[b.clone(), a.clone()], 33);
        assert!(alone[0].iter().all(|v| v.is_finite()), "{mla:?} {ik:?}");
        assert_eq!(alone[0], chunked[0], "{mla:?} {ik:?}: chunked prefill");
        assert_eq!(
            alone[0], token_by_token[0],
            "{mla:?} {ik:?}: one token per step"
        );
        assert_eq!(
            alone[0], batched[1],
            "{mla:?} {ik:?}: batched with another prompt"
        );
    }
}

#[test]
fn the_cache_forms_are_close_but_not_equal() {
    let m = model();
    let a = prompt(3, 100);
    let out: Vec<Vec<f32>> = FORMS
        .iter()
        .map(|&(mla, ik)| {
            run(
                m,
                &mut pool(&m.cfg, mla, ik, 16),
                std::slice::from_ref(&a),
                100,
            )
            .remove(0)
        })
        .collect();
    let argmax = |v: &[f32]| (0..v.len()).max_by(|&i, &j| v[i].total_cmp(&v[j])).unwrap();
    for o in &out[1..] {
        assert_ne!(o, &out[0], "each form stores other bytes");
        let (x, y) = (argmax(o), argmax(&out[0]));
        // Rounding moves logits a little, not the model's meaning: the winner of one is
        // near the top of the other.
        assert!(out[0][x] > out[0][y] - 1.0, "top tokens {x} vs {y}");
    }
}

#[test]
fn sparse_equals_dense_within_the_top_k_and_departs_after() {
    let dir = tempfile::tempdir().unwrap();
    deepseek_synth::write(dir.path(), &deepseek_synth::tiny_config(), 7, None).unwrap();
    let mut dense = DeepSeekModel::load(dir.path()).unwrap();
    dense.dense = true;
    let sparse = model();
    let (mla, ik) = (MlaCacheDtype::Bf16, IndexKDtype::Fp8);
    let short = prompt(4, 64); // exactly the top-k
    let long = prompt(4, 200);
    let go = |m: &DeepSeekModel, p: &Vec<u32>| {
        run(
            m,
            &mut pool(&m.cfg, mla, ik, 16),
            std::slice::from_ref(p),
            64,
        )
        .remove(0)
    };
    assert_eq!(go(sparse, &short), go(&dense, &short));
    assert_ne!(go(sparse, &long), go(&dense, &long));
}

// ---- The indexer's pieces against plain reference loops ----

/// Sylvester's Hadamard matrix of order n, entries ±1.
fn sylvester(n: usize) -> Vec<Vec<f32>> {
    let mut h = vec![vec![1f32]];
    while h.len() < n {
        let m = h.len();
        let mut next = vec![vec![0f32; 2 * m]; 2 * m];
        for i in 0..m {
            for j in 0..m {
                next[i][j] = h[i][j];
                next[i][j + m] = h[i][j];
                next[i + m][j] = h[i][j];
                next[i + m][j + m] = -h[i][j];
            }
        }
        h = next;
    }
    h
}

/// Every finite e4m3 value, from the format's definition (not pdmesh's decoder).
fn e4m3_values() -> Vec<(u8, f64)> {
    (0u8..0x7F)
        .map(|b| {
            let (e, m) = ((b >> 3) as i32, (b & 7) as f64);
            let v = if e == 0 {
                m / 8.0 * 2f64.powi(-6)
            } else {
                (1.0 + m / 8.0) * 2f64.powi(e - 7)
            };
            (b, v)
        })
        .collect()
}

#[test]
fn hadamard_rope_and_layer_norm_match_reference_loops() {
    use pdmesh_engine::deepseek::{hadamard, layer_norm, rope_half, rope_interleaved};
    let x: Vec<f32> = (0..128)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
        .collect();
    let h = sylvester(128);
    let want: Vec<f32> = (0..128)
        .map(|j| (0..128).map(|i| x[i] as f64 * h[i][j] as f64).sum::<f64>() as f32 / 128f32.sqrt())
        .collect();
    let mut got = x.clone();
    hadamard(&mut got);
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
    // Orthonormal: norms are kept.
    let n2 = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
    assert!((n2(&got) - n2(&x)).abs() < 1e-3);

    // Rope: pair i is (i, i + 16) for the indexer, (2i, 2i + 1) for MLA, each rotated by
    // angle p · f_i as a complex multiplication.
    let f: Vec<f64> = (0..16).map(|i| 10000f64.powf(-(i as f64) / 16.0)).collect();
    let p = 37.0;
    let (cos, sin): (Vec<f32>, Vec<f32>) = f
        .iter()
        .map(|fi| ((p * fi).cos() as f32, (p * fi).sin() as f32))
        .unzip();
    let v: Vec<f32> = (0..32).map(|i| i as f32 * 0.25 - 3.0).collect();
    let rot = |a: f32, b: f32, i: usize| {
        let (c, s) = ((p * f[i]).cos(), (p * f[i]).sin());
        (
            (a as f64 * c - b as f64 * s) as f32,
            (a as f64 * s + b as f64 * c) as f32,
        )
    };
    let mut half = v.clone();
    rope_half(&mut half, &cos, &sin);
    let mut inter = v.clone();
    rope_interleaved(&mut inter, &cos, &sin);
    for i in 0..16 {
        let (a, b) = rot(v[i], v[i + 16], i);
        assert!((half[i] - a).abs() < 1e-4 && (half[i + 16] - b).abs() < 1e-4);
        let (a, b) = rot(v[2 * i], v[2 * i + 1], i);
        assert!((inter[2 * i] - a).abs() < 1e-4 && (inter[2 * i + 1] - b).abs() < 1e-4);
    }

    // LayerNorm with bias.
    let w: Vec<f32> = (0..128).map(|i| 1.0 + i as f32 / 256.0).collect();
    let bias: Vec<f32> = (0..128).map(|i| i as f32 / 1000.0).collect();
    let mean = x.iter().map(|&a| a as f64).sum::<f64>() / 128.0;
    let var = x.iter().map(|&a| (a as f64 - mean).powi(2)).sum::<f64>() / 128.0;
    let mut ln = x.clone();
    layer_norm(&mut ln, &w, &bias, 1e-6);
    for i in 0..128 {
        let want = ((x[i] as f64 - mean) / (var + 1e-6).sqrt()) as f32 * w[i] + bias[i];
        assert!((ln[i] - want).abs() < 1e-5);
    }
}

#[test]
fn index_scores_through_fp8_match_a_reference_quantizer() {
    use pdmesh_engine::deepseek::index_score;
    use pdmesh_kv::fp8::{ScaleRule, dequantize_block, quantize_block};
    let codes = e4m3_values();
    // Reference: the ue8m0 scale from the definition, then the nearest code by search.
    let reference = |x: &[f32]| -> Vec<f32> {
        let amax = x.iter().fold(1e-4f64, |m, v| m.max(v.abs() as f64));
        let s = 2f64.powi((amax / 448.0).log2().ceil() as i32);
        x.iter()
            .map(|&v| {
                let t = (v as f64 / s).abs();
                let (_, best) = codes
                    .iter()
                    .map(|&(b, c)| ((c - t).abs(), c, b))
                    .min_by(|a, b| a.0.total_cmp(&b.0).then(a.2.cmp(&b.2)))
                    .map(|(d, c, _)| (d, c))
                    .unwrap();
                (best * s).copysign(v as f64) as f32
            })
            .collect()
    };
    let heads = 4;
    let q: Vec<f32> = (0..heads * 128)
        .map(|i| ((i * 53 % 97) as f32 - 48.0) / 13.0)
        .collect();
    let k: Vec<f32> = (0..128)
        .map(|i| ((i * 31 % 41) as f32 - 20.0) / 3.0)
        .collect();
    let w = [0.3f32, -0.2, 0.7, 0.05];
    let through = |x: &[f32]| {
        let mut b = vec![0u8; x.len()];
        let mut out = vec![0f32; x.len()];
        for ((xc, bc), oc) in x
            .chunks(128)
            .zip(b.chunks_mut(128))
            .zip(out.chunks_mut(128))
        {
            let s = quantize_block(xc, bc, ScaleRule::Ue8m0);
            dequantize_block(bc, s, oc);
        }
        out
    };
    let (qf, kf) = (through(&q), through(&k));
    let (qr, kr): (Vec<f32>, Vec<f32>) =
        (q.chunks(128).flat_map(&reference).collect(), reference(&k));
    for (a, b) in qf.iter().chain(&kf).zip(qr.iter().chain(&kr)) {
        // Ties may round either way between two codes; nothing else may differ.
        assert!((a - b).abs() <= (a.abs() + b.abs()) / 15.0, "{a} vs {b}");
    }
    // The index score by its definition, in f64: each head's weight times its ReLU'd dot.
    let score = |q: &[f32], k: &[f32]| -> f64 {
        (0..heads)
            .map(|h| {
                let d: f64 = (0..128).map(|i| q[h * 128 + i] as f64 * k[i] as f64).sum();
                w[h] as f64 * d.max(0.0)
            })
            .sum()
    };
    let want = score(&qr, &kr);
    let got = index_score(&qf, &w, &kf) as f64;
    assert!(
        (got - want).abs() <= 1e-3 * want.abs().max(1.0),
        "{got} vs {want}"
    );
    // ReLU: a head whose dot is negative adds nothing.
    let neg: Vec<f32> = kf.iter().map(|v| -v).collect();
    let only_pos = score(&qf, &neg);
    assert!((index_score(&qf, &w, &neg) as f64 - only_pos).abs() < 1e-3 * only_pos.abs().max(1.0));
}

#[test]
fn routing_uses_the_bias_to_choose_and_the_plain_scores_to_weigh() {
    use pdmesh_engine::deepseek::route;
    let c = deepseek_synth::tiny_config(); // 8 experts in 4 groups, top 2 groups, 2 experts
    // Sigmoid scores rise with the logit; expert 7 is best by score, but the bias lifts
    // group 0 (experts 0, 1) and group 1 (experts 2, 3).
    let logits = [0.0f32, 0.1, 0.2, 0.3, -1.0, -1.0, 1.0, 2.0];
    let bias = [0.5f32, 0.5, 0.4, 0.4, 0.0, 0.0, 0.0, 0.0];
    let r = route(&c, &logits, &bias);
    let ids: Vec<usize> = r.iter().map(|x| x.0).collect();
    assert_eq!(
        ids,
        [1, 0],
        "the best two of the two best groups, by biased score"
    );
    let s = |l: f32| 1.0 / (1.0 + (-l).exp());
    let (s1, s0) = (s(0.1), s(0.0));
    let total = s1 + s0;
    assert!((r[0].1 - 2.5 * s1 / total).abs() < 1e-6 && (r[1].1 - 2.5 * s0 / total).abs() < 1e-6);
    // Without the bias, groups 3 (experts 6, 7) and 1 win.
    let r = route(&c, &logits, &[0.0; 8]);
    assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), [7, 6]);
}

// ---- Through the engine's scheduler ----

mod common;

use common::{tiny_dir, tiny_engine};

#[test]
fn the_engine_serves_the_tiny_model_identically_alone_batched_chunked_and_cached() {
    let prompts: Vec<Vec<u32>> = (0..6)
        .map(|s| prompt(10 + s, 40 + 23 * s as usize))
        .collect();
    for (mla, ik) in FORMS {
        let set = |c: &mut pdmesh_engine::EngineConfig| {
            c.kv_cache_dtype = mla;
            c.index_k_dtype = ik;
        };
        let mut alone = tiny_engine(|c| {
            set(c);
            c.prefix_cache = false;
            c.max_batch = 1;
        });
        let info = alone.info();
        assert_eq!(
            info.model_id,
            tiny_dir()
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .split('.')
                .next()
                .unwrap()
        );
        assert!(
            info.kv_layout.contains("deepseek-v32-mla"),
            "{}",
            info.kv_layout
        );
        assert!(info.eos_token_ids.contains(&2));
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let id = format!("r{i}");
                common::run_all(&mut alone, vec![common::greedy(&id, p, 12)])
                    .remove(&id)
                    .unwrap()
                    .tokens
            })
            .collect();
        assert!(want.iter().all(|t| t.len() == 12));
        // All at once, small prefill chunks, prefix cache on, run twice (the second time
        // the prompts' pages come from the cache).
        let mut shared = tiny_engine(|c| {
            set(c);
            c.prefill_chunk = 29;
        });
        for round in 0..2 {
            let reqs = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| common::greedy(&format!("r{i}"), p, 12))
                .collect();
            let got = common::run_all(&mut shared, reqs);
            for (i, w) in want.iter().enumerate() {
                assert_eq!(
                    &got[&format!("r{i}")].tokens,
                    w,
                    "{mla:?} {ik:?} round {round} prompt {i}"
                );
            }
        }
        assert!(
            shared.cache_stats().hit_tokens > 0,
            "the second round hit the cache"
        );
        assert_eq!(common::available(&shared), 128, "every page back");
    }
}

#[test]
fn a_malformed_checkpoint_is_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    deepseek_synth::write(dir.path(), &deepseek_synth::tiny_config(), 7, None).unwrap();
    let cfg_path = dir.path().join("config.json");
    let good = std::fs::read_to_string(&cfg_path).unwrap();
    let with = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
        edit(&mut v);
        std::fs::write(&cfg_path, v.to_string()).unwrap();
        match DeepSeekModel::load(dir.path()) {
            Ok(_) => panic!("loaded a malformed checkpoint"),
            Err(e) => e.to_string(),
        }
    };
    assert!(with(&|v| v["hidden_size"] = 0.into()).contains("hidden_size is 0"));
    assert!(with(&|v| v["model_type"] = "llama".into()).contains("deepseek_v32"));
    assert!(with(&|v| v["n_group"] = 3.into()).contains("groups"));
    // Sizes that disagree with the tensors: the tensor is named with both shapes.
    let e = with(&|v| v["q_lora_rank"] = 64.into());
    assert!(
        e.contains("q_a_proj") && e.contains("[128, 256]") && e.contains("[64, 256]"),
        "{e}"
    );
    assert!(
        with(&|v| {
            v.as_object_mut().unwrap().remove("kv_lora_rank");
        })
        .contains("kv_lora_rank")
    );
    // Not a checkpoint's bytes.
    std::fs::write(&cfg_path, &good).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), b"not safetensors").unwrap();
    assert!(DeepSeekModel::load(dir.path()).is_err());
}

//! Decode time per token of `deepseek-v32-tiny` as the context grows, with DSA sparse
//! attention (the indexer keeps the top 64 positions) beside dense attention over the same
//! cache.
//!
//! `cargo run --release -p pdmesh-engine --example bench_dsa -- [CONTEXTS] [STEPS]`
//! (default `1024,4096,16384 8`).
//!
//! Computing a 16k-token prompt would take far longer than the decode being measured, so
//! the cache is filled with seeded values in its own format (bf16 latents, fp8 index keys
//! with unit scales) through the layout's offsets; each timed step then decodes one token
//! at the next position, reading all of it. Sparse and dense read the same bytes.

use std::sync::Arc;
use std::time::Instant;

use half::bf16;
use pdmesh_engine::BatchToken;
use pdmesh_engine::deepseek::DeepSeekModel;
use pdmesh_engine::deepseek_synth;
use pdmesh_kv::{IndexKDtype, MlaCacheDtype, PageId, PagePool};
use rand::{Rng, SeedableRng};

const PAGE: usize = 64;

fn fill(pool: &mut PagePool, pages: &[PageId], len: usize, seed: u64) {
    let layout = pool.layout().clone();
    let latent = layout
        .component_index("mla_latent")
        .expect("bf16 latent form");
    let ik = layout.component_index("index_k").expect("index_k");
    let dims = (
        layout.components()[latent].elems_per_token,
        layout.components()[ik].elems_per_token,
    );
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for pos in 0..len {
        let page = pool.page_mut(pages[pos / PAGE]).expect("allocated");
        let slot = pos % PAGE;
        for layer in 0..layout.layers() {
            let at = layout.value_offset(layer, latent, slot);
            for j in 0..dims.0 {
                let v = bf16::from_f32(rng.random::<f32>() * 2.0 - 1.0);
                page[at + 2 * j..at + 2 * j + 2].copy_from_slice(&v.to_le_bytes());
            }
            let at = layout.value_offset(layer, ik, slot);
            for j in 0..dims.1 {
                // Any finite e4m3 code (0x7F and 0xFF are NaN).
                page[at + j] = rng.random_range(0..0x7Fu8) | (rng.random::<u8>() & 0x80);
            }
            let s = layout.scale_offset(layer, ik, slot).expect("fp8 scales");
            page[s..s + 4].copy_from_slice(&1f32.to_le_bytes());
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let contexts: Vec<usize> = args
        .first()
        .map_or("1024,4096,16384", String::as_str)
        .split(',')
        .map(|v| v.parse().expect("a context length"))
        .collect();
    let steps: usize = args.get(1).map_or(8, |v| v.parse().expect("steps"));
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg = deepseek_synth::tiny_config();
    deepseek_synth::write(dir.path(), &cfg, 7, None).expect("synth");
    let mut model = DeepSeekModel::load(dir.path()).expect("load");
    let tp = rayon::ThreadPoolBuilder::new().build().expect("pool");
    let layout = Arc::new(
        cfg.kv_layout(MlaCacheDtype::Bf16, IndexKDtype::Fp8, PAGE)
            .expect("layout"),
    );
    println!(
        "deepseek-v32-tiny, {} threads, index top-k {}, median of {steps} decode steps",
        tp.current_num_threads(),
        cfg.index_topk
    );
    println!(
        "{:>8} {:>12} {:>12} {:>8}",
        "context", "sparse ms", "dense ms", "dense/sparse"
    );
    for &n in &contexts {
        let mut pool = PagePool::new(layout.clone(), (n + 1).div_ceil(PAGE));
        let pages = pool.alloc((n + 1).div_ceil(PAGE)).expect("pages");
        fill(&mut pool, &pages, n, n as u64);
        let mut time = |dense: bool| {
            model.dense = dense;
            let mut ms: Vec<f64> = (0..steps)
                .map(|i| {
                    let tok = BatchToken {
                        seq: 0,
                        pos: n,
                        token: 100 + i as u32,
                        want_logits: true,
                    };
                    let t0 = Instant::now();
                    let out = model.forward(&tp, &mut pool, &[&pages], &[tok]);
                    assert!(out[0].iter().all(|v| v.is_finite()));
                    t0.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            ms.sort_by(f64::total_cmp);
            ms[ms.len() / 2]
        };
        let (sparse, dense) = (time(false), time(true));
        println!(
            "{n:>8} {sparse:>12.2} {dense:>12.2} {:>8.2}x",
            dense / sparse
        );
    }
}

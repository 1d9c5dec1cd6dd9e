//! attention.cu: paged f16 attention against `attend`, over scattered pages and for a
//! tensor-parallel rank.

use std::sync::Arc;

use cudarc::driver::PushKernelArg;
use half::f16;
use pdmesh_engine::cuda::device::grid;
use pdmesh_kv::{DType, KvLayout, PageId, PagePool};
use rand::Rng;
use rand::seq::SliceRandom;

use crate::support::{down, gpu, rng, uniform, up};

// ---- paged_attention_f16 ----------------------------------------------------------------

struct AttCase {
    layers: usize,
    layer: usize,
    kv_heads: usize,
    hd: usize,
    rep: usize,
    page_size: usize,
    /// The launch's KV heads: `kv_head0 .. kv_head0 + local_kv`.
    kv_head0: usize,
    local_kv: usize,
    seq_lens: Vec<usize>,
    seed: u64,
}

/// One launch over several sequences whose pages are scattered through a real pool,
/// against `pdmesh_kernels::attend` per (token, KV group).
///
/// The kernel does the CPU's operations in the CPU's order except `expf` (vs Rust's exp)
/// and the order of the f64 sum of exponentials, so the outputs are bit-identical unless
/// an exponential one ulp apart flips the f16 rounding of a probability. Tolerance: 1e-5
/// absolute (values and outputs are O(1)); outputs beyond it must be few (≤ 1%) and within
/// what such flips can do: every probability moves by at most one f16 ulp (≤ p·2^-10), so
/// an output moves by at most 2^-10 · max|v| = 2^-10.
fn check_paged_attention(c: &AttCase) {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(c.seed);
    let (hd, ps, rep) = (c.hd, c.page_size, c.rep);
    let layout = Arc::new(KvLayout::llama(c.layers, c.kv_heads, hd, DType::F16, ps));
    let need: Vec<usize> = c.seq_lens.iter().map(|&n| n.div_ceil(ps)).collect();
    let total = need.iter().sum::<usize>() + 5;
    let mut pool = PagePool::new(layout.clone(), total);
    let mut pages = pool.alloc(total).unwrap();
    // Random K and V in every page (the spare ones too: reading them would show).
    for &p in &pages {
        for l in 0..c.layers {
            for comp in 0..2 {
                for v in pool.values_mut::<f16>(p, l, comp) {
                    *v = f16::from_f32(r.random_range(-1.0..1.0));
                }
            }
        }
    }
    // Non-contiguous, out-of-order pages per sequence.
    pages.shuffle(&mut r);
    let mut pages = pages.into_iter();
    let (mut page_table, mut pts, mut seq_pages) = (Vec::new(), Vec::new(), Vec::new());
    for &n in &need {
        pts.push(page_table.len() as i32);
        let sp: Vec<PageId> = pages.by_ref().take(n).collect();
        page_table.extend(sp.iter().map(|&p| p as i32));
        seq_pages.push(sp);
    }
    // Queries: each sequence's first and last position, one a page back, one in the middle;
    // the tokens of all sequences interleaved.
    let mut toks: Vec<(i32, i32)> = Vec::new();
    for (si, &n) in c.seq_lens.iter().enumerate() {
        let mut at = vec![0, n - 1, n / 2, (n - 1).saturating_sub(ps)];
        at.sort_unstable();
        at.dedup();
        toks.extend(at.into_iter().map(|p| (si as i32, p as i32)));
    }
    toks.shuffle(&mut r);
    let seq_of: Vec<i32> = toks.iter().map(|t| t.0).collect();
    let pos: Vec<i32> = toks.iter().map(|t| t.1).collect();
    let t = toks.len();
    let lq = c.local_kv * rep;
    let (q_stride, out_stride) = (lq * hd + 8, lq * hd + 16);
    let q = uniform(&mut r, t * q_stride, -2.0, 2.0);
    let max_len = pos.iter().map(|&p| p as usize + 1).max().unwrap();
    let scratch_stride = max_len;
    let scale = 1.0f32 / (hd as f32).sqrt();
    const SENTINEL: f32 = 12345.0;

    let (dq, dpool) = (up(s, &q), up(s, pool.arena()));
    let mut dout = up(s, &vec![SENTINEL; t * out_stride]);
    let mut dscratch = s.alloc_zeros::<f32>(t * lq * scratch_stride).unwrap();
    let (dseq, dpos, dpt, dpts) = (up(s, &seq_of), up(s, &pos), up(s, &page_table), up(s, &pts));
    let (qs, os, ss) = (q_stride as i32, out_stride as i32, scratch_stride as i32);
    let bpp = layout.bytes_per_page() as i64;
    let (k_off, v_off) = (
        layout.value_offset(c.layer, 0, 0) as i64,
        layout.value_offset(c.layer, 1, 0) as i64,
    );
    let kv_row = c.kv_heads * hd;
    let (kre, hdi, repi, kv0, psz) = (
        kv_row as i32,
        hd as i32,
        rep as i32,
        c.kv_head0 as i32,
        ps as i32,
    );
    let mut b = s.launch_builder(g.kernel("paged_attention_f16"));
    b.arg(&dq)
        .arg(&qs)
        .arg(&mut dout)
        .arg(&os)
        .arg(&mut dscratch)
        .arg(&ss)
        .arg(&dpool)
        .arg(&dseq)
        .arg(&dpos)
        .arg(&dpt)
        .arg(&dpts)
        .arg(&bpp)
        .arg(&k_off)
        .arg(&v_off)
        .arg(&kre)
        .arg(&hdi)
        .arg(&repi)
        .arg(&kv0)
        .arg(&psz)
        .arg(&scale);
    // SAFETY: paged_attention_f16's signature (const float*, int, float*, int, float*, int,
    // const unsigned char*, const int* ×4, long long ×3, int ×5, float); q is t rows of
    // q_stride ≥ lq·hd, out t rows of out_stride, scratch t·lq·max_len floats, the page
    // table covers every attended position, and all pages lie in the pool.
    unsafe { b.launch(grid((t as u32, lq as u32, 1), 128)) }.unwrap();
    let got = down(s, &dout);

    let (mut beyond, mut compared, mut worst) = (0usize, 0usize, 0f32);
    let bound = 1e-5 + 2f32.powi(-10);
    for ti in 0..t {
        let row = &got[ti * out_stride..(ti + 1) * out_stride];
        // Exact: the padding past the launch's heads is not written.
        assert!(
            row[lq * hd..].iter().all(|&v| v == SENTINEL),
            "paged attention wrote past its heads in token {ti}'s output row"
        );
        let sp = &seq_pages[seq_of[ti] as usize];
        let n = pos[ti] as usize + 1;
        for gl in 0..c.local_kv {
            let kvh = c.kv_head0 + gl;
            let rows = |comp: usize| -> Vec<&[f16]> {
                (0..n)
                    .map(|j| {
                        let vals = pool.values::<f16>(sp[j / ps], c.layer, comp);
                        let at = (j % ps) * kv_row + kvh * hd;
                        &vals[at..at + hd]
                    })
                    .collect()
            };
            let (keys, values) = (rows(0), rows(1));
            let qg = &q[ti * q_stride + gl * rep * hd..ti * q_stride + (gl + 1) * rep * hd];
            let mut want = vec![0f32; rep * hd];
            pdmesh_kernels::attend(qg, hd, &keys, &values, scale, &mut want);
            let gg = &row[gl * rep * hd..(gl + 1) * rep * hd];
            for (d, (&a, &w)) in gg.iter().zip(&want).enumerate() {
                let e = (a - w).abs();
                compared += 1;
                worst = worst.max(e);
                if e > 1e-5 {
                    beyond += 1;
                }
                // Tolerance: 1e-5 absolute, up to 2^-10 for a flipped f16 probability.
                assert!(
                    e <= bound,
                    "paged attention (kv_head0 {}) token {ti} (seq {}, pos {}) KV head {kvh} element {d}: GPU {a}, CPU {w} (tolerance 1e-5 absolute, 2^-10 at most for a flipped f16 probability)",
                    c.kv_head0,
                    seq_of[ti],
                    pos[ti]
                );
            }
        }
    }
    assert!(
        beyond * 100 <= compared,
        "paged attention: {beyond} of {compared} outputs beyond 1e-5 (worst {worst}); more than 1% cannot be f16 rounding flips"
    );
}

/// All KV heads (kv_head0 = 0), GQA 3, a sequence longer than the block of 128 threads,
/// sequences ending mid-page and on a page boundary, layer 1 of 2 (nonzero K/V offsets).
#[test]
fn paged_attention_matches_attend_over_scattered_pages() {
    check_paged_attention(&AttCase {
        layers: 2,
        layer: 1,
        kv_heads: 4,
        hd: 64,
        rep: 3,
        page_size: 16,
        kv_head0: 0,
        local_kv: 4,
        seq_lens: vec![37, 5, 300, 16, 1],
        seed: 5,
    });
}

/// A tensor-parallel rank's launch: KV heads 2..4 of 4 (kv_head0 = 2), its own query
/// heads only, head_dim 128, pages of 32.
#[test]
fn paged_attention_of_a_tensor_parallel_rank() {
    check_paged_attention(&AttCase {
        layers: 3,
        layer: 2,
        kv_heads: 4,
        hd: 128,
        rep: 2,
        page_size: 32,
        kv_head0: 2,
        local_kv: 2,
        seq_lens: vec![70, 129, 3],
        seed: 6,
    });
}

#![cfg(feature = "cuda")]
//! Every kernel of `kernels/cuda` against the CPU code it mirrors, on seeded random inputs,
//! on a GPU machine only (the file is empty without the `cuda` feature):
//! `cargo nextest run --release -p pdmesh-engine --features cuda --test cuda_kernels`.
//! `PDMESH_TEST_GPU` picks the device (default 0).
//!
//! Each test states its tolerance next to its assertion; "exact" means the same bits.
//! Launch geometry and argument types follow the contract in each kernel's comment
//! (`int` = i32, `long long` = i64, `unsigned int` = u32, `unsigned long long` = u64).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, PushKernelArg};
use half::f16;
use pdmesh_engine::cuda::device::{Gpu, KernelBuild, grid};
use pdmesh_engine::cuda::llama::{MatmulKernel, matmul};
use pdmesh_engine::deepseek::index_score;
use pdmesh_kv::fp8::{ScaleRule, dequantize_block, quantize_block};
use pdmesh_kv::{DType, KvLayout, PageId, PagePool};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

// ---- helpers ----------------------------------------------------------------------------

/// Device 0, or `PDMESH_TEST_GPU`, with every kernel compiled.
fn gpu() -> Gpu {
    let ordinal = match std::env::var("PDMESH_TEST_GPU") {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("PDMESH_TEST_GPU={v:?} is not a device ordinal")),
        _ => 0,
    };
    Gpu::open(ordinal, &KernelBuild::default())
        .unwrap_or_else(|e| panic!("opening GPU {ordinal}: {e}"))
}

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

fn up<T: DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> CudaSlice<T> {
    s.clone_htod(v).expect("host to device copy")
}

/// The buffer's contents; also where a failed launch surfaces.
fn down<T: DeviceRepr>(s: &Arc<CudaStream>, b: &CudaSlice<T>) -> Vec<T> {
    s.clone_dtoh(b)
        .expect("device to host copy (or an earlier launch failed)")
}

fn uniform(r: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(lo..hi)).collect()
}

/// Exact equality of two f32 slices, bit for bit; names the first difference.
fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: not bit-exact at {i}: GPU {} ({:#010x}), CPU {} ({:#010x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

fn assert_bytes_eq(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: bytes differ at {i}: GPU {:#04x}, expected {:#04x}",
            got[i], want[i]
        );
    }
}

/// A 1-D launch: grid ceil(n / 256), block 256.
fn grid_1d(n: usize) -> cudarc::driver::LaunchConfig {
    grid((n.div_ceil(256) as u32, 1, 1), 256)
}

// ---- embed_gather -----------------------------------------------------------------------

/// Rows of the table by token id, exact; repeated ids and both ends of the vocabulary.
#[test]
fn embed_gather_copies_the_token_rows_exactly() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(1);
    let (vocab, dim, n) = (1000usize, 300usize, 37usize);
    let table = uniform(&mut r, vocab * dim, -1.0, 1.0);
    let mut tokens: Vec<u32> = (0..n).map(|_| r.random_range(0..vocab as u32)).collect();
    tokens[0] = 0;
    tokens[1] = vocab as u32 - 1;
    tokens[2] = tokens[9];
    let (dt, dtok) = (up(s, &table), up(s, &tokens));
    let mut out = s.alloc_zeros::<f32>(n * dim).unwrap();
    let (di, ni) = (dim as i32, n as i32);
    let mut b = s.launch_builder(g.kernel("embed_gather"));
    b.arg(&dt).arg(&dtok).arg(&mut out).arg(&di).arg(&ni);
    // SAFETY: embed_gather(const float*, const unsigned int*, float*, int, int); table is
    // vocab × dim, out n × dim, every token < vocab.
    unsafe { b.launch(grid((n as u32, 1, 1), 256)) }.unwrap();
    let want: Vec<f32> = tokens
        .iter()
        .flat_map(|&t| {
            table[t as usize * dim..(t as usize + 1) * dim]
                .iter()
                .copied()
        })
        .collect();
    // Tolerance: exact (a copy).
    assert_bits_eq(&down(s, &out), &want, "embed_gather (exact)");
}

// ---- rms_norm ---------------------------------------------------------------------------

/// `rms_norm` of crates/engine/src/model.rs (private there), line for line.
fn rms_norm_cpu(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (xr, orow) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let sum: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
        let mean = (sum / n as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((o, &v), &wi) in orow.iter_mut().zip(xr).zip(w) {
            *o = v * scale * wi;
        }
    }
}

/// Dims below, at and above the block of 256 and model sizes. The only difference from the
/// CPU is the order of the f64 sum of squares (a tree), which almost never changes the f32
/// mean: tolerance 1e-6 relative.
#[test]
fn rms_norm_matches_the_cpu() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(2);
    let eps = 1e-5f32;
    for dim in [1usize, 7, 255, 256, 257, 1000, 4096, 5120] {
        let rows = 7usize;
        let mut x = uniform(&mut r, rows * dim, -3.0, 3.0);
        // A row of zeros (mean 0: scale 1/sqrt(eps)) and a row of tiny values.
        x[..dim].fill(0.0);
        for v in &mut x[dim..2 * dim] {
            *v *= 1e-20;
        }
        let w = uniform(&mut r, dim, -2.0, 2.0);
        let mut want = vec![0f32; rows * dim];
        rms_norm_cpu(&x, &w, eps, &mut want);
        let (dx, dw) = (up(s, &x), up(s, &w));
        let mut out = s.alloc_zeros::<f32>(rows * dim).unwrap();
        let di = dim as i32;
        let mut b = s.launch_builder(g.kernel("rms_norm"));
        b.arg(&dx).arg(&dw).arg(&mut out).arg(&di).arg(&eps);
        // SAFETY: rms_norm(const float*, const float*, float*, int, float); x and out are
        // rows × dim, w is dim.
        unsafe { b.launch(grid((rows as u32, 1, 1), 256)) }.unwrap();
        let got = down(s, &out);
        for (i, (&a, &c)) in got.iter().zip(&want).enumerate() {
            // Tolerance: 1e-6 relative.
            assert!(
                (a - c).abs() <= 1e-6 * c.abs() + f32::MIN_POSITIVE,
                "rms_norm dim {dim} at {i}: GPU {a}, CPU {c} (tolerance 1e-6 relative)"
            );
        }
    }
}

// ---- rope_pairs -------------------------------------------------------------------------

/// `rope_table` + `apply_rope` of crates/engine/src/model.rs (private there), line for line.
fn rope_cpu(x: &mut [f32], pos: usize, hd: usize, base: f32) {
    let theta_scale = base.powf(-2.0 / hd as f32);
    let mut theta = pos as f32;
    for i in 0..hd / 2 {
        let (c, s) = (theta.cos(), theta.sin());
        let (x0, x1) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = x0 * c - x1 * s;
        x[2 * i + 1] = x0 * s + x1 * c;
        theta *= theta_scale;
    }
}

/// Positions up to 8000, two head sizes and bases, a row stride wider than the rotated
/// heads (the extra columns must stay untouched). The host computes theta_scale with the
/// CPU's powf, as the forward pass does; differences from the CPU: cosf/sinf against
/// Rust's; tolerance 1e-5 absolute on values in [-1, 1].
#[test]
fn rope_pairs_matches_the_cpu() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(3);
    for (heads, hd, base, extra) in [(4usize, 128usize, 10000f32, 1usize), (8, 64, 500000.0, 0)] {
        let t = 16usize;
        let stride = (heads + extra) * hd;
        let mut pos: Vec<i32> = (0..t).map(|_| r.random_range(0..=8000)).collect();
        pos[0] = 0;
        pos[1] = 1;
        pos[2] = 8000;
        pos[3] = 7999;
        let x = uniform(&mut r, t * stride, -1.0, 1.0);
        let mut want = x.clone();
        for (ti, &p) in pos.iter().enumerate() {
            for h in 0..heads {
                let at = ti * stride + h * hd;
                rope_cpu(&mut want[at..at + hd], p as usize, hd, base);
            }
        }
        let mut dx = up(s, &x);
        let dpos = up(s, &pos);
        let (hi, hdi, si) = (heads as i32, hd as i32, stride as i32);
        let theta_scale = base.powf(-2.0 / hd as f32);
        let mut b = s.launch_builder(g.kernel("rope_pairs"));
        b.arg(&mut dx)
            .arg(&dpos)
            .arg(&hi)
            .arg(&hdi)
            .arg(&si)
            .arg(&theta_scale);
        // SAFETY: rope_pairs(float*, const int*, int, int, int, float); x is t rows of
        // stride ≥ heads × hd, pos has t entries.
        unsafe { b.launch(grid((t as u32, heads as u32, 1), 32)) }.unwrap();
        let got = down(s, &dx);
        for (ti, &p) in pos.iter().enumerate() {
            for c in 0..stride {
                let i = ti * stride + c;
                if c >= heads * hd {
                    // Exact: columns past the heads are not touched.
                    assert_eq!(
                        got[i].to_bits(),
                        x[i].to_bits(),
                        "rope wrote past the heads at token {ti} column {c}"
                    );
                    continue;
                }
                // Tolerance: 1e-5 absolute.
                assert!(
                    (got[i] - want[i]).abs() <= 1e-5,
                    "rope hd {hd} base {base} token {ti} (pos {p}) column {c}: GPU {}, CPU {} (tolerance 1e-5 absolute)",
                    got[i],
                    want[i]
                );
            }
        }
    }
}

// ---- kv_write_f16 -----------------------------------------------------------------------

/// Values whose f16 rounding is a corner case: ties (to even), overflow to infinity, the
/// subnormal range and its ties, signed zeros, infinities and NaNs with payloads.
fn f16_corner_values() -> Vec<f32> {
    let p = |e: i32| 2f32.powi(e);
    vec![
        0.0,
        -0.0,
        1.0 + p(-11),       // tie, to even: 1.0
        1.0 + 3.0 * p(-11), // tie, to even: 1 + 2^-9
        -(1.0 + 3.0 * p(-11)),
        65504.0, // largest f16
        65519.0, // rounds down to 65504
        65520.0, // tie between 65504 and 2^16: to infinity
        1e6,
        -1e6,
        p(-14),       // smallest normal f16
        p(-24),       // smallest subnormal f16
        p(-25),       // tie: to 0
        3.0 * p(-25), // tie: to 2^-23
        p(-26),
        -p(-24) * 1.5, // tie, to even: -2^-23
        1e-7,
        f32::MIN_POSITIVE,
        f32::from_bits(1), // f32 subnormal
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling NaN, low payload
        f32::from_bits(0x7fa0_0000), // NaN with a high payload
        f32::from_bits(0xffc0_2000),
        0.1,
        -3.25,
    ]
}

/// Through a real llama layout and pool, as the forward writes K and V: token offsets
/// from `KvLayout::slot_offset`, the component offset of a layer, a rank's column range.
/// Exact: every pool byte equals what `f16::from_f32` written at the layout's offsets
/// gives, and no other byte changed.
#[test]
fn kv_write_f16_matches_half_exactly_and_touches_nothing_else() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(4);
    let (layers, kv_heads, hd, ps, pages) = (2usize, 4usize, 64usize, 16usize, 6usize);
    let layout = Arc::new(KvLayout::llama(layers, kv_heads, hd, DType::F16, ps));
    let mut pool = PagePool::new(layout.clone(), pages);
    let ids = pool.alloc(pages).unwrap();
    for &p in &ids {
        r.fill(pool.page_mut(p).unwrap());
    }
    // 20 tokens in distinct (page, slot) places.
    let mut places: Vec<(PageId, usize)> = ids
        .iter()
        .flat_map(|&p| (0..ps).map(move |sl| (p, sl)))
        .collect();
    places.shuffle(&mut r);
    places.truncate(20);
    let n = places.len();
    // The rank owning KV heads 1..3: columns 64..192 of each row.
    let (col0, cols) = (hd, 2 * hd);
    let src_stride = cols + 3;
    let tok_off: Vec<i64> = places
        .iter()
        .map(|&(p, sl)| layout.slot_offset(p as usize, sl).unwrap() as i64)
        .collect();
    let corners = f16_corner_values();
    let mut dpool = up(s, pool.arena());
    let dtok = up(s, &tok_off);
    let layer = 1usize;
    for comp in 0..2 {
        let mut src = uniform(&mut r, n * src_stride, -70000.0, 70000.0);
        for (i, v) in src.iter_mut().enumerate() {
            match i % 5 {
                0 => *v *= 1e-4,
                1 => *v *= 1e-9,
                _ => {}
            }
        }
        for (i, &c) in corners.iter().enumerate() {
            src[(i % n) * src_stride + (i * 7 + comp) % cols] = c;
        }
        let comp_off = layout.value_offset(layer, comp, 0) as i64;
        let dsrc = up(s, &src);
        let (ss, c0, ci, ni) = (src_stride as i32, col0 as i32, cols as i32, n as i32);
        let mut b = s.launch_builder(g.kernel("kv_write_f16"));
        b.arg(&dsrc)
            .arg(&ss)
            .arg(&mut dpool)
            .arg(&dtok)
            .arg(&comp_off)
            .arg(&c0)
            .arg(&ci)
            .arg(&ni);
        // SAFETY: kv_write_f16(const float*, int, unsigned char*, const long long*, long
        // long, int, int, int); src is n rows of src_stride ≥ cols; every slot's row lies
        // inside the pool.
        unsafe { b.launch(grid((n as u32, 1, 1), 128)) }.unwrap();
        // Where the layout puts each slot's values of the rank's columns.
        let within = layout.value_bytes(comp, col0..col0 + cols);
        for (i, &(p, sl)) in places.iter().enumerate() {
            let at = layout.value_offset(layer, comp, sl);
            let row = &mut pool.page_mut(p).unwrap()[at + within.start..at + within.end];
            for (c, out) in row.chunks_exact_mut(size_of::<f16>()).enumerate() {
                out.copy_from_slice(&f16::from_f32(src[i * src_stride + c]).to_le_bytes());
            }
        }
    }
    // Tolerance: exact, the whole pool.
    assert_bytes_eq(&down(s, &dpool), pool.arena(), "kv_write_f16 pool (exact)");
}

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

// ---- matmul_rows ------------------------------------------------------------------------

/// A product through the engine's own launch (`cuda::llama::matmul`), with `kernel`.
#[allow(clippy::too_many_arguments)]
fn launch_mm(
    g: &Gpu,
    kernel: MatmulKernel,
    w: &CudaSlice<f32>,
    x: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    rows: usize,
    cols: usize,
    tokens: usize,
    out_stride: usize,
    out_col0: usize,
) {
    let s = g.compute.clone();
    matmul(
        g, &s, kernel, w, rows, cols, x, tokens, out, out_stride, out_col0,
    )
    .unwrap();
}

/// Against an f64 reference (tolerance 1e-5 relative to Σ|w·x|); batch invariance (each
/// token's outputs alone and in a batch of 13 are bit-identical); out_stride/out_col0
/// place the outputs at their columns (bit-identical to the plain launch) and leave every
/// other column untouched. Shapes: rows not a multiple of 8, cols not of 32, and a tiny one.
#[test]
fn matmul_rows_is_accurate_batch_invariant_and_placed() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(7);
    for (rows, cols) in [(1000usize, 1537usize), (5, 7), (64, 4096)] {
        let t = 13usize;
        let w = uniform(&mut r, rows * cols, -1.0, 1.0);
        let x = uniform(&mut r, t * cols, -1.0, 1.0);
        let (dw, dx) = (up(s, &w), up(s, &x));
        let mut out = s.alloc_zeros::<f32>(t * rows).unwrap();
        launch_mm(
            &g,
            MatmulKernel::Rows,
            &dw,
            &dx,
            &mut out,
            rows,
            cols,
            t,
            rows,
            0,
        );
        let batch = down(s, &out);
        for ti in 0..t {
            for ri in 0..rows {
                let (wr, xt) = (
                    &w[ri * cols..(ri + 1) * cols],
                    &x[ti * cols..(ti + 1) * cols],
                );
                let exact: f64 = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                let mag: f64 = wr
                    .iter()
                    .zip(xt)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                let got = batch[ti * rows + ri] as f64;
                // Tolerance: 1e-5 relative to Σ|w·x|.
                assert!(
                    (got - exact).abs() <= 1e-5 * mag + 1e-30,
                    "matmul {rows}x{cols} token {ti} row {ri}: GPU {got}, f64 {exact} (tolerance 1e-5 · Σ|w·x| = {})",
                    1e-5 * mag
                );
            }
        }
        // Each token alone.
        for ti in 0..t {
            let dxi = up(s, &x[ti * cols..(ti + 1) * cols]);
            let mut alone = s.alloc_zeros::<f32>(rows).unwrap();
            launch_mm(
                &g,
                MatmulKernel::Rows,
                &dw,
                &dxi,
                &mut alone,
                rows,
                cols,
                1,
                rows,
                0,
            );
            // Tolerance: exact (batch invariance).
            assert_bits_eq(
                &down(s, &alone),
                &batch[ti * rows..(ti + 1) * rows],
                &format!("matmul {rows}x{cols}: token {ti} alone vs in a batch of {t} (exact)"),
            );
        }
        // Placed at columns col0.. of wider rows; the rest keeps its sentinel.
        let (stride, col0) = (rows + 50, 20usize);
        const SENTINEL: f32 = -777.0;
        let mut placed = up(s, &vec![SENTINEL; t * stride]);
        launch_mm(
            &g,
            MatmulKernel::Rows,
            &dw,
            &dx,
            &mut placed,
            rows,
            cols,
            t,
            stride,
            col0,
        );
        let placed = down(s, &placed);
        for ti in 0..t {
            let row = &placed[ti * stride..(ti + 1) * stride];
            // Tolerance: exact.
            assert_bits_eq(
                &row[col0..col0 + rows],
                &batch[ti * rows..(ti + 1) * rows],
                &format!(
                    "matmul {rows}x{cols}: token {ti} placed at column {col0} of stride {stride} (exact)"
                ),
            );
            assert!(
                row[..col0]
                    .iter()
                    .chain(&row[col0 + rows..])
                    .all(|&v| v == SENTINEL),
                "matmul {rows}x{cols}: token {ti} wrote outside columns {col0}..{}",
                col0 + rows
            );
        }
    }
}

// ---- matmul_tiles ----------------------------------------------------------------------

/// matmul_tiles gives matmul_rows's bits (exact) for every token and row: SmolLM2's
/// shapes, DeepSeek-like ones, rows not a multiple of 8 or 32, cols not of 32, token
/// counts that leave partial tiles; placed at out_col0 of a wider stride with the other
/// columns untouched (exact). The engine picks between the two by the number of tokens,
/// so this is what keeps its invariant path batch-invariant.
#[test]
fn matmul_tiles_gives_matmul_rows_bits() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(17);
    let shapes = [
        (576usize, 576usize),
        (1536, 576),
        (576, 1536),
        (49152, 576),
        (37, 300),
        (5, 7),
    ];
    for (rows, cols) in shapes {
        let w = uniform(&mut r, rows * cols, -1.0, 1.0);
        let dw = up(s, &w);
        for t in [1usize, 7, 16, 33, 200] {
            let x = uniform(&mut r, t * cols, -1.0, 1.0);
            let dx = up(s, &x);
            let mut by_rows = s.alloc_zeros::<f32>(t * rows).unwrap();
            launch_mm(
                &g,
                MatmulKernel::Rows,
                &dw,
                &dx,
                &mut by_rows,
                rows,
                cols,
                t,
                rows,
                0,
            );
            let (stride, col0) = (rows + 9, 4usize);
            const SENTINEL: f32 = -555.0;
            let mut by_tiles = up(s, &vec![SENTINEL; t * stride]);
            launch_mm(
                &g,
                MatmulKernel::Tiles,
                &dw,
                &dx,
                &mut by_tiles,
                rows,
                cols,
                t,
                stride,
                col0,
            );
            // The engine's own choice for t tokens (rows below 16, tiles from there).
            let mut by_choice = s.alloc_zeros::<f32>(t * rows).unwrap();
            launch_mm(
                &g,
                MatmulKernel::Invariant,
                &dw,
                &dx,
                &mut by_choice,
                rows,
                cols,
                t,
                rows,
                0,
            );
            let (want, got) = (down(s, &by_rows), down(s, &by_tiles));
            // Tolerance: exact.
            assert_bits_eq(
                &down(s, &by_choice),
                &want,
                &format!("invariant {rows}x{cols}, {t} tokens"),
            );
            for ti in 0..t {
                let row = &got[ti * stride..(ti + 1) * stride];
                // Tolerance: exact.
                assert_bits_eq(
                    &row[col0..col0 + rows],
                    &want[ti * rows..(ti + 1) * rows],
                    &format!("matmul_tiles {rows}x{cols}, {t} tokens: token {ti}"),
                );
                assert!(
                    row[..col0]
                        .iter()
                        .chain(&row[col0 + rows..])
                        .all(|&v| v == SENTINEL),
                    "matmul_tiles {rows}x{cols}, {t} tokens: token {ti} wrote outside its columns"
                );
            }
        }
    }
}

// ---- swiglu, add_in_place ---------------------------------------------------------------

/// swiglu against `g / (1 + exp(-g)) * u` (model.rs, deepseek.rs): expf may differ from
/// Rust's exp by an ulp, tolerance 1e-6 relative. add_in_place is one IEEE add, exact.
/// n not a multiple of 256; the elements past n are not touched (exact).
#[test]
fn swiglu_and_add_in_place_match_the_cpu() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(8);
    let n = 100_003usize;
    let tail = 100usize;
    const SENTINEL: f32 = 4242.0;
    let mut gate = uniform(&mut r, n + tail, -20.0, 20.0);
    gate[..4].copy_from_slice(&[0.0, -0.0, -100.0, 100.0]);
    gate[n..].fill(SENTINEL);
    let upv = uniform(&mut r, n + tail, -3.0, 3.0);
    let want: Vec<f32> = (0..n)
        .map(|i| gate[i] / (1.0 + (-gate[i]).exp()) * upv[i])
        .collect();
    let mut dg = up(s, &gate);
    let du = up(s, &upv);
    let ni = n as i32;
    let mut b = s.launch_builder(g.kernel("swiglu"));
    b.arg(&mut dg).arg(&du).arg(&ni);
    // SAFETY: swiglu(float*, const float*, int); both hold ≥ n values.
    unsafe { b.launch(grid_1d(n)) }.unwrap();
    let got = down(s, &dg);
    for i in 0..n {
        // Tolerance: 1e-6 relative.
        assert!(
            (got[i] - want[i]).abs() <= 1e-6 * want[i].abs() + f32::MIN_POSITIVE,
            "swiglu at {i} (g {}, u {}): GPU {}, CPU {} (tolerance 1e-6 relative)",
            gate[i],
            upv[i],
            got[i],
            want[i]
        );
    }
    assert!(
        got[n..].iter().all(|&v| v == SENTINEL),
        "swiglu wrote past n"
    );

    let mut x = uniform(&mut r, n + tail, -1e3, 1e3);
    x[n..].fill(SENTINEL);
    let y = uniform(&mut r, n + tail, -1e3, 1e3);
    let mut want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    want[n..].fill(SENTINEL);
    let mut dx = up(s, &x);
    let dy = up(s, &y);
    let mut b = s.launch_builder(g.kernel("add_in_place"));
    b.arg(&mut dx).arg(&dy).arg(&ni);
    // SAFETY: add_in_place(float*, const float*, int); both hold ≥ n values.
    unsafe { b.launch(grid_1d(n)) }.unwrap();
    // Tolerance: exact (one add, nothing past n).
    assert_bits_eq(&down(s, &dx), &want, "add_in_place (exact)");
}

// ---- argmax_rows, log_softmax_rows ------------------------------------------------------

/// `argmax` of crates/engine/src/sampler.rs (private there): the first maximum.
fn argmax_cpu(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn launch_argmax(g: &Gpu, logits: &[f32], vocab: usize) -> Vec<u32> {
    let s = &g.compute;
    let rows = logits.len() / vocab;
    let dl = up(s, logits);
    let mut out = up(s, &vec![u32::MAX; rows]);
    let vi = vocab as i32;
    let mut b = s.launch_builder(g.kernel("argmax_rows"));
    b.arg(&dl).arg(&vi).arg(&mut out);
    // SAFETY: argmax_rows(const float*, int, unsigned int*); rows × vocab logits, rows outs.
    unsafe { b.launch(grid((rows as u32, 1, 1), 256)) }.unwrap();
    down(s, &out)
}

/// Exact, including ties (the lowest index wins, also between threads and within one
/// thread's stride), maxima at either end, ±inf, NaNs (ignored, as `v > best` ignores
/// them; a row of NaNs gives 0) and vocabularies smaller than the block.
#[test]
fn argmax_rows_matches_the_cpu_exactly() {
    let g = gpu();
    let mut r = rng(9);
    let vocab = 32007usize;
    let mut rows: Vec<Vec<f32>> = Vec::new();
    rows.push(uniform(&mut r, vocab, -10.0, 10.0));
    let mut tie = uniform(&mut r, vocab, -10.0, 10.0);
    for i in [5000, 17, 31000, 17 + 256, 18] {
        tie[i] = 11.0;
    }
    rows.push(tie);
    rows.push(vec![0.5; vocab]);
    let mut last = uniform(&mut r, vocab, -10.0, 10.0);
    last[vocab - 1] = 10.5;
    rows.push(last);
    let mut first = uniform(&mut r, vocab, -10.0, 10.0);
    first[0] = 10.5;
    rows.push(first);
    let mut nan = uniform(&mut r, vocab, -10.0, 10.0);
    for i in (3..vocab).step_by(97) {
        nan[i] = f32::NAN;
    }
    nan[vocab - 2] = -f32::NAN;
    rows.push(nan);
    rows.push(vec![f32::NAN; vocab]);
    rows.push(vec![f32::NEG_INFINITY; vocab]);
    let mut inf = uniform(&mut r, vocab, -10.0, 10.0);
    inf[9000] = f32::INFINITY;
    inf[700] = f32::INFINITY;
    rows.push(inf);
    // Many ties from a few levels.
    rows.push((0..vocab).map(|_| r.random_range(0..4) as f32).collect());
    let flat: Vec<f32> = rows.concat();
    let got = launch_argmax(&g, &flat, vocab);
    for (i, row) in rows.iter().enumerate() {
        // Tolerance: exact.
        assert_eq!(got[i], argmax_cpu(row), "argmax row {i} (exact)");
    }
    for (vocab, rows) in [
        (1usize, vec![vec![-3.0f32]]),
        (
            5,
            vec![vec![1.0, 3.0, 3.0, 2.0, 0.0], vec![0.0, 0.0, 0.0, 0.0, 0.0]],
        ),
    ] {
        let got = launch_argmax(&g, &rows.concat(), vocab);
        for (i, row) in rows.iter().enumerate() {
            assert_eq!(
                got[i],
                argmax_cpu(row),
                "argmax vocab {vocab} row {i} (exact)"
            );
        }
    }
}

/// `log_softmax_at` of crates/engine/src/sampler.rs (private there) for every token.
fn log_softmax_cpu(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let sum: f64 = logits.iter().map(|&l| (l - max).exp() as f64).sum();
    logits
        .iter()
        .map(|&l| (l - max) - sum.ln() as f32)
        .collect()
}

/// Every token of each row; expf and the order of the f64 sum differ from the CPU.
/// Tolerance 1e-5 · max(1, |value|); -inf logits give -inf exactly.
#[test]
fn log_softmax_rows_matches_the_cpu() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(10);
    for vocab in [32007usize, 3, 256] {
        let mut rows: Vec<Vec<f32>> = vec![uniform(&mut r, vocab, -20.0, 20.0)];
        let mut neg = uniform(&mut r, vocab, -5.0, 5.0);
        for v in neg.iter_mut().step_by(3) {
            *v = f32::NEG_INFINITY;
        }
        rows.push(neg);
        let mut peak = uniform(&mut r, vocab, -1.0, 1.0);
        peak[vocab / 2] = 1000.0;
        rows.push(peak);
        rows.push(vec![0.25; vocab]);
        let flat = rows.concat();
        let n = rows.len();
        let dl = up(s, &flat);
        let mut out = s.alloc_zeros::<f32>(n * vocab).unwrap();
        let vi = vocab as i32;
        let mut b = s.launch_builder(g.kernel("log_softmax_rows"));
        b.arg(&dl).arg(&mut out).arg(&vi);
        // SAFETY: log_softmax_rows(const float*, float*, int); both rows × vocab.
        unsafe { b.launch(grid((n as u32, 1, 1), 256)) }.unwrap();
        let got = down(s, &out);
        for (ri, row) in rows.iter().enumerate() {
            let want = log_softmax_cpu(row);
            for (j, &w) in want.iter().enumerate() {
                let a = got[ri * vocab + j];
                // Tolerance: 1e-5 · max(1, |value|); infinities exactly.
                let ok = if w.is_infinite() {
                    a == w
                } else {
                    (a - w).abs() <= 1e-5 * w.abs().max(1.0)
                };
                assert!(
                    ok,
                    "log_softmax vocab {vocab} row {ri} token {j}: GPU {a}, CPU {w} (tolerance 1e-5 · max(1, |value|))"
                );
            }
        }
    }
}

// ---- gather_rows, scatter_rows ----------------------------------------------------------

/// Exact copies for row sizes that take each path (16-byte words, 4-byte words, bytes):
/// odd sizes, offsets aligned to 16 and unaligned ones. Scatter leaves every byte outside
/// the rows as it was.
#[test]
fn gather_and_scatter_rows_copy_exactly() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(11);
    let n = 23usize;
    for row_bytes in [1usize, 3, 4, 12, 16, 33, 64, 257, 1024, 4096] {
        for aligned in [true, false] {
            // Distinct, non-overlapping places in a region (for scatter), in random order.
            let stride = if aligned {
                row_bytes.next_multiple_of(16) + 16
            } else {
                row_bytes + 3
            };
            let mut slots: Vec<usize> = (0..n + 4).collect();
            slots.shuffle(&mut r);
            let offs: Vec<i64> = slots[..n]
                .iter()
                .map(|&k| (k * stride + if aligned { 0 } else { r.random_range(0..=3) }) as i64)
                .collect();
            let region = (n + 4) * stride + 8;
            let mut pool = vec![0u8; region];
            r.fill(&mut pool[..]);
            let what = format!(
                "row_bytes {row_bytes}, {} offsets",
                if aligned { "16-aligned" } else { "unaligned" }
            );

            // gather: pool rows → packed.
            let (dpool, doff) = (up(s, &pool), up(s, &offs));
            let mut packed = s.alloc_zeros::<u8>(n * row_bytes).unwrap();
            let (rb, ni) = (row_bytes as i32, n as i32);
            let mut b = s.launch_builder(g.kernel("gather_rows"));
            b.arg(&dpool).arg(&doff).arg(&mut packed).arg(&rb).arg(&ni);
            // SAFETY: gather_rows(const unsigned char*, const long long*, unsigned char*,
            // int, int); every src_off + row_bytes ≤ region, dst is n × row_bytes.
            unsafe { b.launch(grid((n as u32, 1, 1), 256)) }.unwrap();
            let want: Vec<u8> = offs
                .iter()
                .flat_map(|&o| pool[o as usize..o as usize + row_bytes].iter().copied())
                .collect();
            // Tolerance: exact.
            assert_bytes_eq(
                &down(s, &packed),
                &want,
                &format!("gather_rows {what} (exact)"),
            );

            // scatter: packed → pool rows, over a pool of other bytes.
            let mut src = vec![0u8; n * row_bytes];
            r.fill(&mut src[..]);
            let dsrc = up(s, &src);
            let mut dst = up(s, &pool);
            let mut b = s.launch_builder(g.kernel("scatter_rows"));
            b.arg(&dsrc).arg(&mut dst).arg(&doff).arg(&rb).arg(&ni);
            // SAFETY: scatter_rows(const unsigned char*, unsigned char*, const long long*,
            // int, int); src is n × row_bytes, every dst_off + row_bytes ≤ region.
            unsafe { b.launch(grid((n as u32, 1, 1), 256)) }.unwrap();
            let mut want = pool.clone();
            for (i, &o) in offs.iter().enumerate() {
                want[o as usize..o as usize + row_bytes]
                    .copy_from_slice(&src[i * row_bytes..(i + 1) * row_bytes]);
            }
            // Tolerance: exact, the whole destination.
            assert_bytes_eq(
                &down(s, &dst),
                &want,
                &format!("scatter_rows {what} (exact)"),
            );
        }
    }
}

// ---- fp8_quantize_blocks, fp8_dequantize_blocks -----------------------------------------

/// Blocks of `block` values of many kinds: ordinary, all zero (the amax floor), signed
/// zeros, huge (up to f32::MAX), below the floor, f32 subnormals, exact E4M3 ties and
/// E4M3-subnormal codes at scale 1, amax at the ue8m0 boundaries (448, 449, 224), positive
/// NaNs (ignored by amax, coded 0x7F), a block of NaNs, and values over many octaves.
///
/// Left out on purpose: negative NaNs and infinities. The CPU keeps a NaN's sign through
/// `v * inv` and turns `inf * 0` into x86's negative default NaN (code 0xFF); the GPU's
/// multiply returns the canonical positive NaN (0x7F).
fn fp8_test_blocks(r: &mut ChaCha8Rng, block: usize) -> Vec<f32> {
    let p = |e: i32| 2f32.powi(e);
    let kinds = 24usize;
    let mut x = Vec::with_capacity(kinds * block);
    for kind in 0..kinds {
        let mut b = uniform(r, block, -1.0, 1.0);
        match kind {
            0 => {}
            1 => b.iter_mut().for_each(|v| *v *= 1000.0),
            2 => b.fill(0.0),
            3 => b
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = if i % 2 == 0 { -0.0 } else { 0.0 }),
            4 => {
                b.iter_mut().for_each(|v| *v *= 1e30);
                b[0] = f32::MAX;
                b[block - 1] = -f32::MAX;
            }
            5 => b.iter_mut().for_each(|v| *v *= 1e-6),
            6 => {
                b.iter_mut().for_each(|v| *v *= 1e-39);
                b[0] = f32::from_bits(1);
                b[1] = -f32::from_bits(3);
            }
            7 => {
                // Scale 1 (Exact and ue8m0): the values are coded as they are.
                b.iter_mut().for_each(|v| *v *= p(-6)); // E4M3 subnormal range
                let ties = [
                    448.0,
                    1.0625,
                    1.1875,
                    1.5 * p(-9),
                    0.5 * p(-9),
                    2.5 * p(-9),
                    1.96875,
                    p(-6),
                    p(-9),
                    7.0 * p(-9),
                    7.5 * p(-9),
                    240.0,
                    0.1,
                    -1.0625,
                    -0.0,
                    232.0, // tie between 224 and 240: to even, 224
                    p(-10),
                    p(-11),
                ];
                for (i, &t) in ties.iter().enumerate() {
                    b[(i * 5) % block] = t;
                }
            }
            8 => b[block / 3] = 449.0,
            9 => b[block / 2] = -224.0,
            10 => {
                b.iter_mut().for_each(|v| *v *= 300.0);
                b[1] = f32::NAN;
                b[block / 2] = f32::NAN;
            }
            11 => b.fill(f32::NAN),
            12 => {
                for v in b.iter_mut() {
                    let e = r.random_range(-20..=10);
                    *v = v.signum() * p(e) * r.random_range(1.0..2.0);
                }
            }
            13 => {
                // amax exactly the floor.
                b.iter_mut().for_each(|v| *v *= 1e-4);
                b[0] = 1e-4;
            }
            14 => b.iter_mut().for_each(|v| *v *= 448.0),
            _ => {
                let m = p(r.random_range(-30..=30));
                b.iter_mut().for_each(|v| *v *= m);
            }
        }
        x.extend_from_slice(&b);
    }
    x
}

/// Bit-exact with `pdmesh_kv::fp8::quantize_block` for both scale rules (codes and scale
/// bits), for blocks of 128 (DeepSeek's), 64 (fewer values than threads) and 300 (threads
/// loop); then `fp8_dequantize_blocks` of those codes is bit-exact with `dequantize_block`.
#[test]
fn fp8_quantize_blocks_is_bit_exact_with_the_cpu() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(12);
    for block in [128usize, 64, 300] {
        let x = fp8_test_blocks(&mut r, block);
        let nb = x.len() / block;
        for (rule, ue8m0) in [(ScaleRule::Exact, 0i32), (ScaleRule::Ue8m0, 1)] {
            let mut want_q = vec![0u8; x.len()];
            let want_s: Vec<f32> = x
                .chunks_exact(block)
                .zip(want_q.chunks_exact_mut(block))
                .map(|(xb, qb)| quantize_block(xb, qb, rule))
                .collect();
            let dx = up(s, &x);
            let mut dq = s.alloc_zeros::<u8>(x.len()).unwrap();
            let mut ds = s.alloc_zeros::<f32>(nb).unwrap();
            let (nbi, bi) = (nb as i32, block as i32);
            let mut b = s.launch_builder(g.kernel("fp8_quantize_blocks"));
            b.arg(&dx)
                .arg(&mut dq)
                .arg(&mut ds)
                .arg(&nbi)
                .arg(&bi)
                .arg(&ue8m0);
            // SAFETY: fp8_quantize_blocks(const float*, unsigned char*, float*, int, int,
            // int); x and q hold nb × block, scales nb.
            unsafe { b.launch(grid((nb as u32, 1, 1), 128)) }.unwrap();
            let (got_q, got_s) = (down(s, &dq), down(s, &ds));
            for bl in 0..nb {
                // Tolerance: exact (scale bits and every code).
                assert_eq!(
                    got_s[bl].to_bits(),
                    want_s[bl].to_bits(),
                    "fp8 {rule:?} block size {block}, block {bl}: scale GPU {}, CPU {} (exact)",
                    got_s[bl],
                    want_s[bl]
                );
                let range = bl * block..(bl + 1) * block;
                if let Some(j) = range.clone().find(|&j| got_q[j] != want_q[j]) {
                    panic!(
                        "fp8 {rule:?} block size {block}, block {bl}, value {} ({:#010x}): GPU code {:#04x}, CPU {:#04x} (exact)",
                        x[j],
                        x[j].to_bits(),
                        got_q[j],
                        want_q[j]
                    );
                }
            }
            check_fp8_dequantize(
                &g,
                &want_q,
                &want_s,
                block,
                &format!("{rule:?} round trip, block {block}"),
            );
        }
    }
    // Every code under a range of scales, including a tiny one whose products are f32
    // subnormals (not flushed to zero).
    let codes: Vec<u8> = (0..8).flat_map(|_| 0..=255u8).collect();
    let scales = [
        1.0f32,
        2f32.powi(-22),
        1e-4 / 448.0,
        0.3,
        2f32.powi(20),
        7.5e-37,
        1e30,
        3.0e-3,
    ];
    check_fp8_dequantize(&g, &codes, &scales, 256, "every code");
}

/// `fp8_dequantize_blocks` against `dequantize_block`: exact, except that a NaN code
/// (0x7F, 0xFF) only has to give a NaN (its payload after the multiply is the device's).
fn check_fp8_dequantize(g: &Gpu, q: &[u8], scales: &[f32], block: usize, what: &str) {
    let s = &g.compute;
    let nb = scales.len();
    assert_eq!(q.len(), nb * block);
    let (dq, ds) = (up(s, q), up(s, scales));
    let mut out = s.alloc_zeros::<f32>(q.len()).unwrap();
    let (nbi, bi) = (nb as i32, block as i32);
    let mut b = s.launch_builder(g.kernel("fp8_dequantize_blocks"));
    b.arg(&dq).arg(&ds).arg(&mut out).arg(&nbi).arg(&bi);
    // SAFETY: fp8_dequantize_blocks(const unsigned char*, const float*, float*, int, int);
    // q and out hold nb × block, scales nb.
    unsafe { b.launch(grid((nb as u32, 1, 1), 128)) }.unwrap();
    let got = down(s, &out);
    let mut want = vec![0f32; q.len()];
    for ((qb, ob), &sc) in q
        .chunks_exact(block)
        .zip(want.chunks_exact_mut(block))
        .zip(scales)
    {
        dequantize_block(qb, sc, ob);
    }
    for (i, (&a, &w)) in got.iter().zip(&want).enumerate() {
        // Tolerance: exact; NaN for NaN.
        let ok = if w.is_nan() {
            a.is_nan()
        } else {
            a.to_bits() == w.to_bits()
        };
        assert!(
            ok,
            "fp8_dequantize {what}: block {}, code {:#04x}, scale {}: GPU {a}, CPU {w} (exact)",
            i / block,
            q[i],
            scales[i / block]
        );
    }
}

// ---- dsa_index_scores -------------------------------------------------------------------

/// Against `pdmesh_engine::deepseek::index_score` for every (token, key), with key counts
/// not a multiple of 128, a query row stride wider than heads × dim, and dims with and
/// without a tail past the eight lanes. Tolerance: 1e-5 relative to Σ_h |w_h|·Σ_d |q·k|
/// (the kernel documents the CPU's exact order, so it should in fact be bit-identical).
#[test]
fn dsa_index_scores_match_index_score() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(13);
    for (heads, dim, n_keys) in [(8usize, 128usize, 300usize), (4, 100, 129), (64, 128, 128)] {
        let t = 5usize;
        let q_stride = heads * dim + 4;
        let q = uniform(&mut r, t * q_stride, -1.0, 1.0);
        let w = uniform(&mut r, t * heads, -1.0, 1.0);
        let keys = uniform(&mut r, n_keys * dim, -1.0, 1.0);
        let (dq, dw, dk) = (up(s, &q), up(s, &w), up(s, &keys));
        let mut out = s.alloc_zeros::<f32>(t * n_keys).unwrap();
        let (hi, di, ki, qs) = (heads as i32, dim as i32, n_keys as i32, q_stride as i32);
        let mut b = s.launch_builder(g.kernel("dsa_index_scores"));
        b.arg(&dq)
            .arg(&dw)
            .arg(&dk)
            .arg(&mut out)
            .arg(&hi)
            .arg(&di)
            .arg(&ki)
            .arg(&qs);
        // SAFETY: dsa_index_scores(const float*, const float*, const float*, float*, int,
        // int, int, int); q is t rows of q_stride ≥ heads × dim, w t × heads, keys
        // n_keys × dim, out t × n_keys.
        unsafe { b.launch(grid((t as u32, n_keys.div_ceil(128) as u32, 1), 128)) }.unwrap();
        let got = down(s, &out);
        for ti in 0..t {
            let qt = &q[ti * q_stride..ti * q_stride + heads * dim];
            let wt = &w[ti * heads..(ti + 1) * heads];
            for j in 0..n_keys {
                let k = &keys[j * dim..(j + 1) * dim];
                let want = index_score(qt, wt, k);
                let mag: f32 = qt
                    .chunks_exact(dim)
                    .zip(wt)
                    .map(|(qh, wh)| {
                        wh.abs() * qh.iter().zip(k).map(|(a, b)| (a * b).abs()).sum::<f32>()
                    })
                    .sum();
                let a = got[ti * n_keys + j];
                // Tolerance: 1e-5 relative to Σ_h |w_h|·Σ_d |q·k|.
                assert!(
                    (a - want).abs() <= 1e-5 * mag + f32::MIN_POSITIVE,
                    "dsa_index_scores heads {heads} dim {dim}: token {ti} key {j}: GPU {a}, CPU {want} (tolerance 1e-5 · {mag})"
                );
            }
        }
    }
}

// ---- topk_indices -----------------------------------------------------------------------

/// The indexer's choice in crates/engine/src/deepseek.rs: every position when n ≤ k,
/// else the top k by `b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))` through
/// `select_nth_unstable_by`, sorted ascending; padded with -1 to k (the kernel's contract).
fn topk_cpu(scores: &[f32], k: usize) -> Vec<i32> {
    let n = scores.len();
    let mut out: Vec<i32> = if n <= k {
        (0..n as i32).collect()
    } else {
        let mut scored: Vec<(f32, usize)> = scores.iter().copied().zip(0..).collect();
        let by = |a: &(f32, usize), b: &(f32, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        scored.select_nth_unstable_by(k - 1, by);
        let mut keep: Vec<usize> = scored[..k].iter().map(|s| s.1).collect();
        keep.sort_unstable();
        keep.into_iter().map(|i| i as i32).collect()
    };
    out.resize(k, -1);
    out
}

/// Exact against the CPU's selection, with heavy ties (the lower index wins), ±0, ±inf,
/// NaNs of both signs (total order: +NaN above +inf, -NaN below -inf), k of DeepSeek V3.2
/// (2048), k = 1, n ≤ k (every index, then -1) and n around the 256-thread chunking.
#[test]
fn topk_indices_matches_the_indexer() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(14);
    for (n, k) in [
        (1000usize, 64usize),
        (5000, 2048),
        (300, 300),
        (100, 128),
        (257, 1),
        (773, 256),
        (256, 255),
        (70000, 2048),
    ] {
        let mut rows: Vec<Vec<f32>> = vec![uniform(&mut r, n, -10.0, 10.0)];
        rows.push((0..n).map(|_| r.random_range(0..8) as f32).collect());
        let mut special: Vec<f32> = (0..n).map(|_| r.random_range(-3..=3) as f32).collect();
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            f32::from_bits(0x7fc0_0001),
            f32::MAX,
            f32::MIN,
            f32::from_bits(1),
        ];
        for v in special.iter_mut() {
            if r.random_range(0..4) == 0 {
                *v = specials[r.random_range(0..specials.len())];
            }
        }
        rows.push(special);
        rows.push(vec![1.5; n]);
        let flat = rows.concat();
        let nr = rows.len();
        let dsc = up(s, &flat);
        let mut out = up(s, &vec![-7i32; nr * k]);
        let (ni, ki) = (n as i32, k as i32);
        let mut b = s.launch_builder(g.kernel("topk_indices"));
        b.arg(&dsc).arg(&ni).arg(&ki).arg(&mut out);
        // SAFETY: topk_indices(const float*, int, int, int*); scores rows × n, out rows × k.
        unsafe { b.launch(grid((nr as u32, 1, 1), 256)) }.unwrap();
        let got = down(s, &out);
        for (ri, row) in rows.iter().enumerate() {
            let want = topk_cpu(row, k);
            let gr = &got[ri * k..(ri + 1) * k];
            if let Some(i) = (0..k).find(|&i| gr[i] != want[i]) {
                panic!(
                    "topk n {n} k {k} row {ri}: first difference at output {i}: GPU {}, CPU {} (exact)",
                    gr[i], want[i]
                );
            }
        }
    }
}

/// topk_indices_rows: chosen rows of a wider score matrix, each over its own length (one
/// at most k: every position), at their rows of `out` (stride past k); rows not chosen and
/// the slots past k keep their sentinel. Each row is the CPU's selection (exact).
#[test]
fn topk_indices_rows_selects_each_row_over_its_own_length() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(19);
    let (stride, k, out_stride, total) = (5000usize, 2048usize, 2050usize, 7usize);
    let flat: Vec<f32> = (0..total * stride)
        .map(|_| r.random_range(-40..40) as f32 * 0.125)
        .collect();
    let rows = [6i32, 0, 3, 2, 5];
    let ns = [5000i32, 2049, 2048, 3000, 4097];
    let dsc = up(s, &flat);
    let (drows, dns) = (up(s, &rows[..]), up(s, &ns[..]));
    let mut out = up(s, &vec![-7i32; total * out_stride]);
    let (si, ki, oi) = (stride as i32, k as i32, out_stride as i32);
    let mut b = s.launch_builder(g.kernel("topk_indices_rows"));
    b.arg(&dsc)
        .arg(&si)
        .arg(&drows)
        .arg(&dns)
        .arg(&ki)
        .arg(&mut out)
        .arg(&oi);
    // SAFETY: topk_indices_rows(const float*, int, const int*, const int*, int, int*, int);
    // each chosen row holds its n ≤ stride scores, out holds total rows of out_stride ≥ k.
    unsafe { b.launch(grid((rows.len() as u32, 1, 1), 256)) }.unwrap();
    let got = down(s, &out);
    for row in 0..total {
        let gr = &got[row * out_stride..(row + 1) * out_stride];
        match rows.iter().position(|&x| x as usize == row) {
            Some(bi) => {
                let n = ns[bi] as usize;
                let want = topk_cpu(&flat[row * stride..row * stride + n], k);
                // Tolerance: exact.
                assert_eq!(&gr[..k], &want[..], "topk_indices_rows row {row} (n {n})");
                assert!(gr[k..].iter().all(|&v| v == -7), "row {row}: wrote past k");
            }
            None => assert!(gr.iter().all(|&v| v == -7), "row {row} was not chosen"),
        }
    }
}

// ---- page_checksum_xxh3 -----------------------------------------------------------------

/// Bit-exact with `pdmesh_kv::page_checksum` for every XXH3 length class (0, 1–3, 4–8,
/// 9–16, 17–128, 129–240, > 240 with one and several 1024-byte blocks, exactly a block,
/// one past) and page sizes of real layouts, each from several offsets, unaligned included.
#[test]
fn page_checksum_xxh3_is_bit_exact_with_the_cpu() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(15);
    let llama_page = KvLayout::llama(2, 8, 128, DType::F16, 16).bytes_per_page();
    let mut lengths: Vec<usize> = (0..=256).collect();
    lengths.extend([
        1023,
        1024,
        1025,
        1087,
        1088,
        2047,
        2048,
        2049,
        4096,
        65536 + 7,
        llama_page,
        llama_page - 1,
        KvLayout::llama(1, 2, 64, DType::F16, 16).bytes_per_page(),
    ]);
    let max_len = *lengths.iter().max().unwrap();
    let mut data = vec![0u8; max_len + 4096];
    r.fill(&mut data[..]);
    let secret = pdmesh_kv::checksum_secret();
    let dsecret = up(s, secret);
    let sl = secret.len() as i32;
    let ddata = up(s, &data);
    for &len in &lengths {
        let room = data.len() - len;
        let offs: Vec<i64> = vec![
            0,
            1,
            3,
            8,
            4096.min(room) as i64,
            r.random_range(0..=room) as i64,
        ];
        let n = offs.len();
        let doff = up(s, &offs);
        let mut out = s.alloc_zeros::<u64>(n).unwrap();
        let (pb, ni) = (len as i64, n as i32);
        let mut b = s.launch_builder(g.kernel("page_checksum_xxh3"));
        b.arg(&ddata)
            .arg(&pb)
            .arg(&doff)
            .arg(&dsecret)
            .arg(&sl)
            .arg(&mut out)
            .arg(&ni);
        // SAFETY: page_checksum_xxh3(const unsigned char*, long long, const long long*,
        // const unsigned char*, int, unsigned long long*, int); every offset + len lies in
        // data, out holds n.
        unsafe { b.launch(grid((n as u32, 1, 1), 1)) }.unwrap();
        let got = down(s, &out);
        for (i, &o) in offs.iter().enumerate() {
            let want = pdmesh_kv::page_checksum(&data[o as usize..o as usize + len]);
            // Tolerance: exact.
            assert_eq!(
                got[i], want,
                "page_checksum_xxh3 length {len} at offset {o}: GPU {:#018x}, CPU {want:#018x} (exact)",
                got[i]
            );
        }
    }
}

//! norm.cu: the embedding gather, RMSNorm and rope on pairs, against the CPU.

use cudarc::driver::PushKernelArg;
use pdmesh_engine::cuda::device::grid;
use rand::Rng;

use crate::refs::{check_rope_rows, rope_rows_cpu};
use crate::support::{assert_bits_eq, down, gpu, rng, uniform, up};

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
        pdmesh_engine::rms_norm(&x, &w, eps, &mut want);
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
        let theta_scale = base.powf(-2.0 / hd as f32);
        let dims = (heads, hd, stride);
        let want = rope_rows_cpu(&x, &pos, dims, theta_scale);
        let mut dx = up(s, &x);
        let dpos = up(s, &pos);
        let (hi, hdi, si) = (heads as i32, hd as i32, stride as i32);
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
        // Tolerance: 1e-5 absolute.
        let what = format!("GPU, base {base}");
        check_rope_rows((&got, &want, &x), &pos, dims, 1e-5, &what);
    }
}

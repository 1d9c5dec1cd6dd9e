//! norm.cu: RMSNorm, the embedding gather and rope on pairs, against the CPU's.

use crate::emu::{assert_bits_eq, c, emu, m, randv, rng, ulps};
use crate::refs::{check_rope_rows, rope_rows_cpu};

type RmsFn = unsafe extern "C" fn(*const f32, *const f32, *mut f32, i32, f32);
type EmbedFn = unsafe extern "C" fn(*const f32, *const u32, *mut f32, i32, i32);
type RopePairsFn = unsafe extern "C" fn(*mut f32, *const i32, i32, i32, i32, f32);

/// The rms scale of row `xr` two ways: (the 256-thread kernels' documented order:
/// thread-strided f64 sums, then a fixed tree; model.rs's rms_norm: a sequential f64 sum).
pub(crate) fn rms_scales(xr: &[f32], eps: f32) -> (f32, f32) {
    let dim = xr.len();
    let mut buf = [0f64; 256];
    for (j, v) in xr.iter().enumerate() {
        buf[j % 256] += (v * v) as f64;
    }
    let mut s = 128;
    while s > 0 {
        for t in 0..s {
            buf[t] += buf[t + s];
        }
        s /= 2;
    }
    let tree = 1.0 / ((buf[0] / dim as f64) as f32 + eps).sqrt();
    let seq: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
    (tree, 1.0 / ((seq / dim as f64) as f32 + eps).sqrt())
}

#[test]
fn rms_norm_matches_cpu() {
    let e = emu();
    let kern: RmsFn = e.kernel("rms_norm");
    let mut r = rng(6);
    let (rows, dim, eps) = (4usize, 700usize, 1e-6f32);
    let x = randv(&mut r, rows * dim, 3.0);
    let w = randv(&mut r, dim, 1.5);
    let mut out = vec![0f32; rows * dim];
    let (px, pw, po) = (c(&x), c(&w), m(&mut out));
    // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
    e.launch((rows as u32, 1), 256, || unsafe {
        kern(px.p(), pw.p(), po.p(), dim as i32, eps)
    });
    for row in 0..rows {
        let xr = &x[row * dim..(row + 1) * dim];
        // The kernel's documented order; model.rs's rms_norm (sequential f64 sum): the
        // same up to the sum's rounding.
        let (scale, cpu_scale) = rms_scales(xr, eps);
        for j in 0..dim {
            let got = out[row * dim + j];
            let exact = xr[j] * scale * w[j];
            assert_eq!(got.to_bits(), exact.to_bits(), "row {row} [{j}]");
            let cpu = xr[j] * cpu_scale * w[j];
            assert!(ulps(got, cpu) <= 2, "row {row} [{j}]: {got} vs CPU {cpu}");
        }
    }

    // embed_gather: exact copies of the table rows.
    let embed: EmbedFn = e.kernel("embed_gather");
    let table = randv(&mut r, 10 * 300, 1.0);
    let toks = [3u32, 0, 9, 3, 7];
    let mut emb = vec![0f32; toks.len() * 300];
    let (pt, pk, pe) = (c(&table), c(&toks), m(&mut emb));
    // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
    e.launch((toks.len() as u32, 1), 256, || unsafe {
        embed(pt.p(), pk.p(), pe.p(), 300, toks.len() as i32)
    });
    for (i, &t) in toks.iter().enumerate() {
        let t = t as usize;
        assert_bits_eq(
            "embed_gather",
            &emb[i * 300..(i + 1) * 300],
            &table[t * 300..(t + 1) * 300],
        );
    }
}

#[test]
fn rope_pairs_matches_cpu() {
    let e = emu();
    let kern: RopePairsFn = e.kernel("rope_pairs");
    let mut r = rng(12);
    // hd 128: 64 pairs over 32 threads; a row stride wider than the heads (the extra
    // columns must stay as they were).
    for (heads, hd, base, extra) in [(2usize, 128usize, 10000f32, 5usize), (3, 16, 500000.0, 0)] {
        let t = 5usize;
        let stride = heads * hd + extra;
        let pos = [0i32, 1, 8000, 7999, 37];
        let x = randv(&mut r, t * stride, 1.0);
        // The host's theta_scale (crates/engine/src/cuda/llama.rs): the CPU's powf.
        let theta_scale = base.powf(-2.0 / hd as f32);
        let dims = (heads, hd, stride);
        let want = rope_rows_cpu(&x, &pos, dims, theta_scale);
        let mut got = x.clone();
        let (pg, pp) = (m(&mut got), c(&pos));
        // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
        e.launch((t as u32, heads as u32), 32, || unsafe {
            kern(
                pg.p(),
                pp.p(),
                heads as i32,
                hd as i32,
                stride as i32,
                theta_scale,
            )
        });
        // cosf / sinf: the host libm here (CUDA's on a GPU); 1e-6 absolute on values of
        // magnitude <= sqrt(2).
        let what = format!("base {base}");
        check_rope_rows((&got, &want, &x), &pos, dims, 1e-6, &what);
    }
}

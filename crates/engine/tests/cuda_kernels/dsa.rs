//! dsa.cu: the DSA indexer's scores against `index_score`, and its top-k selection.

use cudarc::driver::PushKernelArg;
use pdmesh_engine::cuda::device::grid;
use pdmesh_engine::deepseek::index_score;
use rand::Rng;

use crate::support::{down, gpu, rng, uniform, up};

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

/// The indexer's choice in crates/engine/src/deepseek/mod.rs: every position when n ≤ k,
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

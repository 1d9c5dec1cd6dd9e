//! dsa.cu: the DSA indexer's scores and its top-k selection, against the CPU's.

use rand::Rng;

use crate::emu::{assert_bits_eq, c, emu, m, randv, rng};

type TopkFn = unsafe extern "C" fn(*const f32, i32, i32, *mut i32);
type TopkRowsFn = unsafe extern "C" fn(*const f32, i32, *const i32, *const i32, i32, *mut i32, i32);
type DsaScoresFn =
    unsafe extern "C" fn(*const f32, *const f32, *const f32, *mut f32, i32, i32, i32, i32);

/// The CPU's selection in crates/engine/src/deepseek/mod.rs: highest score first (total
/// order), earlier position on ties, the kept positions sorted ascending; every position
/// when n <= k.
fn cpu_topk(scores: &[f32], k: usize) -> Vec<i32> {
    let n = scores.len();
    if n <= k {
        return (0..n as i32)
            .chain(std::iter::repeat_n(-1, k - n))
            .collect();
    }
    let mut scored: Vec<(f32, usize)> = scores.iter().copied().zip(0..).collect();
    let by = |a: &(f32, usize), b: &(f32, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    scored.select_nth_unstable_by(k - 1, by);
    let mut keep: Vec<i32> = scored[..k].iter().map(|s| s.1 as i32).collect();
    keep.sort_unstable();
    keep
}

/// topk_indices_rows: chosen rows of a wider matrix, each with its own length (some at
/// most k, so every position), written at their rows of `out`; rows not chosen keep
/// their sentinel. Each row equals the CPU's selection over its own scores.
#[test]
fn topk_indices_rows_selects_each_row_over_its_own_length() {
    let e = emu();
    let kern: TopkRowsFn = e.kernel("topk_indices_rows");
    let mut r = rng(13);
    let (stride, k, out_stride) = (700usize, 64usize, 70usize);
    let total = 6usize;
    let s: Vec<f32> = (0..total * stride)
        .map(|_| r.random_range(-3i32..3) as f32 * 0.25)
        .collect();
    let rows = [5i32, 0, 3, 2];
    let ns = [700i32, 65, 64, 300];
    let mut out = vec![-7i32; total * out_stride];
    let (ps, pr, pn, po) = (c(&s), c(&rows), c(&ns), m(&mut out));
    let (si, ki, oi) = (stride as i32, k as i32, out_stride as i32);
    // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
    e.launch((rows.len() as u32, 1), 256, || unsafe {
        kern(ps.p(), si, pr.p(), pn.p(), ki, po.p(), oi)
    });
    for row in 0..total {
        let got = &out[row * out_stride..(row + 1) * out_stride];
        match rows.iter().position(|&x| x as usize == row) {
            Some(b) => {
                let n = ns[b] as usize;
                let want = cpu_topk(&s[row * stride..row * stride + n], k);
                assert_eq!(&got[..k], &want[..], "row {row} (n {n})");
                assert!(got[k..].iter().all(|&v| v == -7), "row {row}: past k");
            }
            None => assert!(got.iter().all(|&v| v == -7), "row {row} was not chosen"),
        }
    }
}

#[test]
fn topk_indices_exact() {
    let e = emu();
    let kern: TopkFn = e.kernel("topk_indices");
    let mut r = rng(3);
    for (n, k, ties) in [
        (3000usize, 64usize, false),
        (2500, 100, true),
        (40, 64, false),
        (777, 1, true),
        (513, 512, true),
    ] {
        let rows = 3;
        let mut s: Vec<f32> = (0..rows * n)
            .map(|_| {
                if ties {
                    r.random_range(-4i32..4) as f32 * 0.5
                } else {
                    r.random_range(-10.0f32..10.0)
                }
            })
            .collect();
        // Specials: both zeros, infinities and NaNs of either sign.
        for (i, v) in [
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
        ]
        .into_iter()
        .enumerate()
        {
            if 5 * i + 2 < n {
                s[5 * i + 2] = v;
            }
        }
        let mut out = vec![12345i32; rows * k];
        let (ps, po) = (c(&s), m(&mut out));
        let (ni, ki) = (n as i32, k as i32);
        // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
        e.launch((rows as u32, 1), 256, || unsafe {
            kern(ps.p(), ni, ki, po.p())
        });
        for row in 0..rows {
            let want = cpu_topk(&s[row * n..(row + 1) * n], k);
            assert_eq!(
                &out[row * k..(row + 1) * k],
                &want[..],
                "n {n} k {k} row {row}"
            );
        }
    }
}

#[test]
fn dsa_index_scores_bit_exact() {
    let e = emu();
    let kern: DsaScoresFn = e.kernel("dsa_index_scores");
    let mut r = rng(4);
    let (t, heads, dim, nk) = (3usize, 4usize, 68usize, 300usize);
    let q_stride = heads * dim + 5;
    let q = randv(&mut r, t * q_stride, 1.0);
    let w = randv(&mut r, t * heads, 1.0);
    let keys = randv(&mut r, nk * dim, 1.0);
    let mut out = vec![f32::NAN; t * nk];
    let (pq, pw, pk, po) = (c(&q), c(&w), c(&keys), m(&mut out));
    let grid = (t as u32, nk.div_ceil(128) as u32);
    // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
    e.launch(grid, 128, || unsafe {
        kern(
            pq.p(),
            pw.p(),
            pk.p(),
            po.p(),
            heads as i32,
            dim as i32,
            nk as i32,
            q_stride as i32,
        )
    });
    let mut want = vec![0f32; t * nk];
    for ti in 0..t {
        let qt = &q[ti * q_stride..ti * q_stride + heads * dim];
        for j in 0..nk {
            want[ti * nk + j] = pdmesh_engine::deepseek::index_score(
                qt,
                &w[ti * heads..(ti + 1) * heads],
                &keys[j * dim..(j + 1) * dim],
            );
        }
    }
    assert_bits_eq("dsa_index_scores", &out, &want);
}

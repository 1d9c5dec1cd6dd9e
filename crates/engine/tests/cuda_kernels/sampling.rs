//! sampling.cu: greedy argmax and log-softmax rows, against the CPU.

use cudarc::driver::PushKernelArg;
use pdmesh_engine::cuda::device::{Gpu, grid};
use rand::Rng;

use crate::support::{down, gpu, rng, uniform, up};

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

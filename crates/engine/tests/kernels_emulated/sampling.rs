//! sampling.cu: greedy argmax and log-softmax rows, against the CPU's.

use rand::Rng;

use crate::emu::{c, emu, m, randv, rng};

type ArgmaxFn = unsafe extern "C" fn(*const f32, i32, *mut u32);

#[test]
fn argmax_rows_exact() {
    let e = emu();
    let kern: ArgmaxFn = e.kernel("argmax_rows");
    let mut r = rng(7);
    let (rows, vocab) = (5usize, 1500usize);
    let mut l: Vec<f32> = (0..rows * vocab)
        .map(|_| r.random_range(-20i32..20) as f32 * 0.25)
        .collect();
    // Row 1: a tie at the top (lowest index wins); row 2: NaNs (never chosen);
    // row 3: all equal; row 4: the maximum in the last slot.
    l[vocab + 100] = 50.0;
    l[vocab + 900] = 50.0;
    l[2 * vocab + 7] = f32::NAN;
    l[2 * vocab + 800] = -f32::NAN;
    l[3 * vocab..4 * vocab].fill(-1.5);
    l[5 * vocab - 1] = 1e30;
    let mut out = vec![u32::MAX; rows];
    let (pl, po) = (c(&l), m(&mut out));
    // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
    e.launch((rows as u32, 1), 256, || unsafe {
        kern(pl.p(), vocab as i32, po.p())
    });
    for row in 0..rows {
        // crates/engine/src/sampler.rs's argmax.
        let lr = &l[row * vocab..(row + 1) * vocab];
        let mut best = 0;
        for (i, &v) in lr.iter().enumerate() {
            if v > lr[best] {
                best = i;
            }
        }
        assert_eq!(out[row], best as u32, "row {row}");
    }
}

type LogSoftmaxFn = unsafe extern "C" fn(*const f32, *mut f32, i32);

#[test]
fn log_softmax_rows_matches_cpu() {
    let e = emu();
    let kern: LogSoftmaxFn = e.kernel("log_softmax_rows");
    let mut r = rng(13);
    // Fewer logits than threads, exactly one per thread, several per thread.
    for vocab in [3usize, 256, 1000] {
        let mut rows: Vec<Vec<f32>> = vec![randv(&mut r, vocab, 20.0)];
        let mut neg = randv(&mut r, vocab, 5.0);
        for v in neg.iter_mut().step_by(3) {
            *v = f32::NEG_INFINITY;
        }
        rows.push(neg);
        let mut peak = randv(&mut r, vocab, 1.0);
        peak[vocab / 2] = 1000.0;
        rows.push(peak);
        rows.push(vec![0.25; vocab]);
        let mut nan = randv(&mut r, vocab, 1.0);
        nan[vocab - 1] = f32::NAN;
        rows.push(nan);
        let flat = rows.concat();
        let mut out = vec![0f32; flat.len()];
        let (pl, po) = (c(&flat), m(&mut out));
        // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
        e.launch((rows.len() as u32, 1), 256, || unsafe {
            kern(pl.p(), po.p(), vocab as i32)
        });
        for (ri, row) in rows.iter().enumerate() {
            // sampler.rs's log_softmax_at (private there) for every token.
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let sum: f64 = row.iter().map(|&l| (l - max).exp() as f64).sum();
            for (j, &l) in row.iter().enumerate() {
                let want = (l - max) - sum.ln() as f32;
                let got = out[ri * vocab + j];
                // expf (the host libm here, CUDA's on a GPU) and the f64 sum's order
                // (strided, then a tree, against sequential): 1e-5 · max(1, |value|);
                // infinities exactly, NaN where the CPU gives NaN.
                let ok = if want.is_nan() {
                    got.is_nan()
                } else if want.is_infinite() {
                    got == want
                } else {
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0)
                };
                assert!(
                    ok,
                    "vocab {vocab} row {ri} [{j}]: kernel {got} vs CPU {want}"
                );
            }
        }
    }
}

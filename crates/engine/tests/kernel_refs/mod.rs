//! CPU references shared by the kernel tests on a GPU (`cuda_kernels`) and emulated on
//! the CPU (`kernels_emulated`): what a kernel must compute, written once.

#![allow(dead_code)]

/// model.rs's rope_table + apply_rope (private there), line for line: theta from `pos`,
/// times `theta_scale` per adjacent pair, iteratively in f32.
pub fn rope_pairs_cpu(x: &mut [f32], pos: usize, theta_scale: f32) {
    let mut theta = pos as f32;
    for i in 0..x.len() / 2 {
        let (c, s) = (theta.cos(), theta.sin());
        let (x0, x1) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = x0 * c - x1 * s;
        x[2 * i + 1] = x0 * s + x1 * c;
        theta *= theta_scale;
    }
}

/// The rows `x` (`pos.len()` rows of `stride` values) with the first `heads` heads of
/// `hd` values of each row rotated by [`rope_pairs_cpu`].
pub fn rope_rows_cpu(
    x: &[f32],
    pos: &[i32],
    (heads, hd, stride): (usize, usize, usize),
    theta_scale: f32,
) -> Vec<f32> {
    let mut want = x.to_vec();
    for (ti, &p) in pos.iter().enumerate() {
        for h in 0..heads {
            let at = ti * stride + h * hd;
            rope_pairs_cpu(&mut want[at..at + hd], p as usize, theta_scale);
        }
    }
    want
}

/// A rope kernel's rows `got` against [`rope_rows_cpu`]'s `want`: the heads within `tol`
/// (absolute), and the columns past them untouched (the same bits as in `x`).
pub fn check_rope_rows(
    (got, want, x): (&[f32], &[f32], &[f32]),
    pos: &[i32],
    (heads, hd, stride): (usize, usize, usize),
    tol: f32,
    what: &str,
) {
    for (ti, &p) in pos.iter().enumerate() {
        for c in 0..stride {
            let i = ti * stride + c;
            if c >= heads * hd {
                assert_eq!(
                    got[i].to_bits(),
                    x[i].to_bits(),
                    "{what}: rope wrote past the heads at token {ti} column {c}"
                );
                continue;
            }
            assert!(
                (got[i] - want[i]).abs() <= tol,
                "{what}: rope hd {hd} token {ti} (pos {p}) column {c}: kernel {}, CPU {} (tolerance {tol} absolute)",
                got[i],
                want[i]
            );
        }
    }
}

//! matmul.cu: `matmul_rows` (accuracy, batch invariance, placement), `matmul_tiles`
//! (the same bits), SwiGLU and `add_in_place`.

use cudarc::driver::{CudaSlice, PushKernelArg};
use pdmesh_engine::cuda::device::Gpu;
use pdmesh_engine::cuda::llama::{MatmulKernel, matmul};

use crate::support::{assert_bits_eq, down, gpu, grid_1d, rng, uniform, up};

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

/// swiglu against `g / (1 + exp(-g)) * u` (model.rs, deepseek/weights.rs): expf may differ from
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

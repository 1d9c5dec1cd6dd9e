//! Quantized matrix × batch-of-tokens products, parallel over weight rows. A row is always
//! computed by one thread, in one fixed order, for every token: results are identical
//! whatever the batch size or thread count.

use pdmesh_ggml::GgmlType;
use rayon::prelude::*;

use crate::dot;
use crate::format::WeightFormat;
use crate::gemm::{IntKind, Packed};
use crate::quant::{QActs, quantize_q8_0, quantize_q8_1};

/// A weight matrix borrowed in its block format (GGML's as in the GGUF, or one the
/// kernels rewrote it into: [`WeightFormat::rewrite`]): `rows` rows of `cols` values.
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    pub format: WeightFormat,
    pub data: &'a [u8],
    pub rows: usize,
    pub cols: usize,
}

impl<'a> QMatrix<'a> {
    pub fn new(format: impl Into<WeightFormat>, data: &'a [u8], rows: usize, cols: usize) -> Self {
        let format = format.into();
        assert_eq!(
            data.len(),
            format.row_bytes(cols) * rows,
            "matrix data size for {rows}x{cols} {format:?}"
        );
        Self {
            format,
            data,
            rows,
            cols,
        }
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.format.row_bytes(self.cols);
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Dequantize one row (e.g. an embedding lookup); a rewritten matrix gives the
    /// original's values.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        self.format.dequantize(self.row(r), out);
    }
}

/// The weight formats with an integer kernel.
fn int_kind(format: WeightFormat) -> Option<IntKind> {
    match format {
        WeightFormat::Ggml(GgmlType::Q4_1) => Some(IntKind::Q4_1),
        WeightFormat::Ggml(GgmlType::Q8_0) => Some(IntKind::Q8_0),
        WeightFormat::Ggml(GgmlType::Q4_0) => Some(IntKind::Q4_0),
        WeightFormat::Q4K32 => Some(IntKind::Q4K32),
        WeightFormat::Q6K32 => Some(IntKind::Q6K32),
        WeightFormat::Ggml(_) => None,
    }
}

/// Every token's activations quantized (in parallel over tokens when called inside the
/// pool; each token's result is its own, so the order cannot matter).
fn quantize_all(x: &[f32], cols: usize, f: fn(&[f32], &mut QActs)) -> Vec<QActs> {
    x.par_chunks_exact(cols)
        .with_min_len(4)
        .map(|xt| {
            let mut q = QActs::default();
            f(xt, &mut q);
            q
        })
        .collect()
}

/// `out[t][r] = Σ_c w[r][c] · x[t][c]` for `t` tokens; `x` is `t × cols`, `out` is `t × rows`.
pub fn matmul(pool: &rayon::ThreadPool, w: &QMatrix<'_>, x: &[f32], t: usize, out: &mut [f32]) {
    matmul_many(pool, &[w], x, t, &mut [out]);
}

/// A parallel task: rows `r0..r0 + n` of matrix `m`, with each token's slice of the
/// output for exactly those rows.
struct Task<'o> {
    m: usize,
    r0: usize,
    n: usize,
    outs: Vec<&'o mut [f32]>,
}

/// A batch's activations, quantized and laid out once for every matrix of a call: Q8_1
/// for Q4_1 weights, Q8_0 for the others.
struct Acts {
    q8_1: Option<Packed>,
    q8_0: Option<Packed>,
}

impl Acts {
    fn new(ws: &[&QMatrix<'_>], x: &[f32], cols: usize) -> Self {
        let kinds: Vec<IntKind> = ws.iter().filter_map(|w| int_kind(w.format)).collect();
        let nb = cols / 32;
        let pack = |q8_1: bool| {
            let wanted: Vec<IntKind> = kinds
                .iter()
                .copied()
                .filter(|&k| k.takes_q8_1() == q8_1)
                .collect();
            (!wanted.is_empty()).then(|| {
                let f = if q8_1 { quantize_q8_1 } else { quantize_q8_0 };
                Packed::new(&quantize_all(x, cols, f), nb, &wanted)
            })
        };
        Self {
            q8_1: pack(true),
            q8_0: pack(false),
        }
    }

    fn for_format(&self, format: WeightFormat) -> Option<&Packed> {
        match int_kind(format) {
            Some(k) if k.takes_q8_1() => self.q8_1.as_ref(),
            Some(_) => self.q8_0.as_ref(),
            None => None,
        }
    }
}

/// Checks the shapes of a call and splits every matrix's rows into tasks of about a
/// quarter of a thread's share, each with its rows of every token's output (disjoint
/// slices, so tasks write in place).
fn tasks<'o>(
    pool: &rayon::ThreadPool,
    ws: &[&QMatrix<'_>],
    x: &[f32],
    t: usize,
    outs: &'o mut [&mut [f32]],
) -> Vec<Task<'o>> {
    assert_eq!(ws.len(), outs.len());
    let cols = ws[0].cols;
    assert_eq!(x.len(), t * cols, "input is not {t} x {cols}");
    for (w, o) in ws.iter().zip(outs.iter()) {
        assert_eq!(w.cols, cols, "matrices of one call share their input width");
        assert_eq!(o.len(), t * w.rows, "output is not {t} x {}", w.rows);
    }
    let total_rows: usize = ws.iter().map(|w| w.rows).sum();
    let threads = pool.current_num_threads().max(1);
    let per_task = total_rows.div_ceil(threads * 4).max(8);
    let mut tasks: Vec<Task<'o>> = Vec::new();
    if t == 0 {
        return tasks;
    }
    for (m, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
        let first = tasks.len();
        for r0 in (0..w.rows).step_by(per_task) {
            tasks.push(Task {
                m,
                r0,
                n: per_task.min(w.rows - r0),
                outs: Vec::with_capacity(t),
            });
        }
        for tok in out.chunks_exact_mut(w.rows) {
            for (k, piece) in tok.chunks_mut(per_task).enumerate() {
                tasks[first + k].outs.push(piece);
            }
        }
    }
    tasks
}

/// Several matrices applied to the same input in one parallel region (Q, K and V; gate and
/// up). `outs[i]` is `t × ws[i].rows`. Each row is still computed by one thread in the
/// same order as [`matmul`] computes it, so results are identical.
pub fn matmul_many(
    pool: &rayon::ThreadPool,
    ws: &[&QMatrix<'_>],
    x: &[f32],
    t: usize,
    outs: &mut [&mut [f32]],
) {
    let tasks = tasks(pool, ws, x, t, outs);
    if tasks.is_empty() {
        return;
    }
    pool.install(|| {
        let acts = Acts::new(ws, x, ws[0].cols);
        tasks.into_par_iter().for_each(|mut task| {
            let w = ws[task.m];
            rows_times_tokens(
                w,
                task.r0,
                task.n,
                x,
                acts.for_format(w.format),
                &mut task.outs,
            );
        });
    });
}

/// The gated activation a fused gate/up product applies: `act(g) · u`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glu {
    /// SwiGLU (llama): `silu(g) · u`.
    Silu,
    /// GeGLU with GELU's tanh approximation (Gemma).
    GeluTanh,
}

impl Glu {
    #[inline]
    pub fn apply(self, g: f32, u: f32) -> f32 {
        match self {
            Glu::Silu => silu_times(g, u),
            Glu::GeluTanh => gelu_tanh_times(g, u),
        }
    }
}

/// SwiGLU's first half in one parallel region: `out[t][r] = silu(g) · u` with
/// `g = gate[r] · x[t]` and `u = up[r] · x[t]`, each a [`matmul`] row product, so the
/// result is the same bits as the two products followed by the elementwise step, without
/// a serial pass over the whole batch.
pub fn matmul_swiglu(
    pool: &rayon::ThreadPool,
    gate: &QMatrix<'_>,
    up: &QMatrix<'_>,
    x: &[f32],
    t: usize,
    out: &mut [f32],
) {
    matmul_glu(pool, Glu::Silu, gate, up, x, t, out)
}

/// [`matmul_swiglu`] with any [`Glu`]: `out[t][r] = glu(gate[r] · x[t], up[r] · x[t])`.
pub fn matmul_glu(
    pool: &rayon::ThreadPool,
    glu: Glu,
    gate: &QMatrix<'_>,
    up: &QMatrix<'_>,
    x: &[f32],
    t: usize,
    out: &mut [f32],
) {
    assert_eq!(
        (gate.rows, gate.cols, gate.format),
        (up.rows, up.cols, up.format),
        "gate and up of one shape and format"
    );
    let mut outs = [out];
    let tasks = tasks(pool, &[gate], x, t, &mut outs);
    if tasks.is_empty() {
        return;
    }
    pool.install(|| {
        let acts = Acts::new(&[gate], x, gate.cols);
        tasks.into_par_iter().for_each(|mut task| {
            let acts = acts.for_format(gate.format);
            rows_times_tokens(gate, task.r0, task.n, x, acts, &mut task.outs);
            let mut u = vec![0f32; task.n * t];
            let mut us: Vec<&mut [f32]> = u.chunks_exact_mut(task.n).collect();
            rows_times_tokens(up, task.r0, task.n, x, acts, &mut us);
            for (g, u) in task.outs.iter_mut().zip(us) {
                for (gi, ui) in g.iter_mut().zip(u.iter()) {
                    *gi = glu.apply(*gi, *ui);
                }
            }
        });
    });
}

/// `silu(g) · u`, the one expression every SwiGLU uses.
#[inline]
pub fn silu_times(g: f32, u: f32) -> f32 {
    g / (1.0 + (-g).exp()) * u
}

/// `gelu(g) · u` with GELU's tanh approximation,
/// `0.5 · g · (1 + tanh(√(2/π) · (g + 0.044715 · g³)))`, the one expression every GeGLU
/// uses.
#[inline]
pub fn gelu_tanh_times(g: f32, u: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * g * (1.0 + (SQRT_2_OVER_PI * g * (1.0 + 0.044_715 * g * g)).tanh()) * u
}

/// Rows `r0..r0 + n` of `w` times every token into `out[token][row - r0]`.
fn rows_times_tokens(
    w: &QMatrix<'_>,
    r0: usize,
    n: usize,
    x: &[f32],
    acts: Option<&Packed>,
    out: &mut [&mut [f32]],
) {
    let rb = w.format.row_bytes(w.cols);
    let data = &w.data[r0 * rb..(r0 + n) * rb];
    match (int_kind(w.format), acts) {
        (Some(kind), Some(p)) => {
            debug_assert_eq!(p.tokens(), out.len());
            crate::gemm::rows(kind, data, rb, p, out)
        }
        _ => {
            let mut scratch = vec![0f32; w.cols];
            for (ri, row) in data.chunks_exact(rb).enumerate() {
                w.format.dequantize(row, &mut scratch);
                for (tt, o) in out.iter_mut().enumerate() {
                    o[ri] = dot::f32_dot(&scratch, &x[tt * w.cols..(tt + 1) * w.cols]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    fn q4_1_matrix(rows: usize, cols: usize) -> Vec<u8> {
        let mut d = Vec::new();
        let mut s = 1u32;
        for r in 0..rows {
            for b in 0..cols / 32 {
                d.extend(f16::from_f32(0.01 + (r + b) as f32 * 1e-3).to_le_bytes());
                d.extend(f16::from_f32(-0.07).to_le_bytes());
                for _ in 0..16 {
                    s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                    d.push((s >> 24) as u8);
                }
            }
        }
        d
    }

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    #[test]
    fn results_do_not_depend_on_batch_or_threads() {
        let (rows, cols) = (100, 128);
        let data = q4_1_matrix(rows, cols);
        let w = QMatrix::new(GgmlType::Q4_1, &data, rows, cols);
        let t = 15; // a tile of eight, one of four, one of two and one alone
        let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.13).cos()).collect();
        let (p1, p2) = (pool(1), pool(2));
        let mut all = vec![0f32; t * rows];
        matmul(&p2, &w, &x, t, &mut all);
        for tt in 0..t {
            let mut one = vec![0f32; rows];
            matmul(&p1, &w, &x[tt * cols..(tt + 1) * cols], 1, &mut one);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&one),
                bits(&all[tt * rows..(tt + 1) * rows]),
                "token {tt}"
            );
        }
        // and close to the f32 reference
        let mut wr = vec![0f32; cols];
        w.dequantize_row(3, &mut wr);
        let exact: f32 = wr.iter().zip(&x[..cols]).map(|(a, b)| a * b).sum();
        assert!(
            (all[3] - exact).abs() < 0.03 * exact.abs().max(1.0),
            "{} vs {exact}",
            all[3]
        );
    }

    /// Q8_0 weights with the extreme values ±127 and 0, times activations whose blocks
    /// hit ±127 too: the tiles (tokens 0..8, 8..12, 12..14, 14) must give each token
    /// exactly what it gets alone.
    #[test]
    fn q8_0_grouped_tokens_equal_tokens_alone() {
        let (rows, cols) = (37, 96);
        let mut data = Vec::new();
        for r in 0..rows {
            for b in 0..cols / 32 {
                data.extend(f16::from_f32(0.003 * (1 + (r + b) % 5) as f32).to_le_bytes());
                data.extend((0..32).map(|j| match (r + j + b) % 7 {
                    0 => 127u8,
                    1 => (-127i8) as u8,
                    2 => 0,
                    k => ((k as i32 * 37 - 90) as i8) as u8,
                }));
            }
        }
        let w = QMatrix::new(GgmlType::Q8_0, &data, rows, cols);
        let t = 15; // a tile of eight, one of four, one of two and one alone
        let x: Vec<f32> = (0..t * cols)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.21)
            .collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let mut all = vec![0f32; t * rows];
        matmul(&pool, &w, &x, t, &mut all);
        let mut wr = vec![0f32; cols];
        for tt in 0..t {
            let mut one = vec![0f32; rows];
            matmul(&pool, &w, &x[tt * cols..(tt + 1) * cols], 1, &mut one);
            for r in 0..rows {
                assert_eq!(
                    one[r].to_bits(),
                    all[tt * rows + r].to_bits(),
                    "token {tt} row {r}"
                );
                w.dequantize_row(r, &mut wr);
                let xt = &x[tt * cols..(tt + 1) * cols];
                let exact: f32 = wr.iter().zip(xt).map(|(a, b)| a * b).sum();
                // Activation rounding moves each product by at most half a step.
                let bound: f32 = wr.iter().zip(xt).map(|(a, b)| (a * b).abs()).sum::<f32>() * 0.01;
                assert!((one[r] - exact).abs() <= bound, "{} vs {exact}", one[r]);
            }
        }
    }

    /// Q4_K and Q6_K matrices rewritten as at load: in batches of 15 (tiles of 8, 4, 2
    /// and 1), 32 and 33 tokens each token gets exactly what it gets alone, on one
    /// thread or two, alone or in one call with another format; and near the f32 product
    /// of the original rows.
    #[test]
    fn rewritten_k_quants_give_each_token_what_it_gets_alone() {
        let (rows, cols) = (37, 512);
        let (p1, p2) = (pool(1), pool(2));
        let q8: Vec<u8> = (0..rows * cols / 32)
            .flat_map(|b| {
                let mut blk = f16::from_f32(0.001 * (b % 7) as f32).to_le_bytes().to_vec();
                blk.extend((0..32).map(|j| (b * 31 + j * 7) as u8));
                blk
            })
            .collect();
        let wq8 = QMatrix::new(GgmlType::Q8_0, &q8, rows, cols);
        for ty in [GgmlType::Q4K, GgmlType::Q6K] {
            let src = crate::testdata::k_blocks(ty, rows * cols / 256, 5);
            let orig = QMatrix::new(ty, &src, rows, cols);
            let (format, data) = WeightFormat::rewrite(ty, &src).unwrap();
            let w = QMatrix::new(format, &data, rows, cols);
            for t in [15, 32, 33] {
                let x: Vec<f32> = (0..t * cols)
                    .map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.07)
                    .collect();
                let mut all = vec![0f32; t * rows];
                matmul(&p2, &w, &x, t, &mut all);
                let (mut fused, mut other) = (vec![0f32; t * rows], vec![0f32; t * rows]);
                matmul_many(&p2, &[&wq8, &w], &x, t, &mut [&mut other, &mut fused]);
                assert_eq!(bits(&fused), bits(&all), "{ty:?} {t} tokens beside Q8_0");
                let (mut wr, mut wo) = (vec![0f32; cols], vec![0f32; cols]);
                for tt in 0..t {
                    let xt = &x[tt * cols..(tt + 1) * cols];
                    let mut one = vec![0f32; rows];
                    matmul(&p1, &w, xt, 1, &mut one);
                    assert_eq!(
                        bits(&one),
                        bits(&all[tt * rows..(tt + 1) * rows]),
                        "{ty:?} {t} tokens: token {tt}"
                    );
                    for (r, got) in one.iter().enumerate() {
                        w.dequantize_row(r, &mut wr);
                        orig.dequantize_row(r, &mut wo);
                        assert_eq!(bits(&wr), bits(&wo), "{ty:?} row {r}");
                        let exact: f32 = wo.iter().zip(xt).map(|(a, b)| a * b).sum();
                        // Activation rounding moves each value by at most 0.57 of its
                        // block's step (half a step, and the scale's f16 rounding); the
                        // step is at most 0.98 / 127 here.
                        let bound: f32 = wo.iter().map(|a| a.abs()).sum::<f32>() * 0.0045;
                        assert!(
                            (got - exact).abs() <= bound + 1e-4 * exact.abs(),
                            "{ty:?} row {r}: {got} vs {exact}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn fused_matrices_equal_separate_calls() {
        let cols = 64;
        let (a, b) = (q4_1_matrix(20, cols), q4_1_matrix(9, cols));
        let (wa, wb) = (
            QMatrix::new(GgmlType::Q4_1, &a, 20, cols),
            QMatrix::new(GgmlType::Q4_1, &b, 9, cols),
        );
        let t = 5;
        let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.31).sin()).collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let (mut oa, mut ob) = (vec![0f32; t * 20], vec![0f32; t * 9]);
        matmul_many(&pool, &[&wa, &wb], &x, t, &mut [&mut oa, &mut ob]);
        let (mut sa, mut sb) = (vec![0f32; t * 20], vec![0f32; t * 9]);
        matmul(&pool, &wa, &x, t, &mut sa);
        matmul(&pool, &wb, &x, t, &mut sb);
        assert_eq!(oa, sa);
        assert_eq!(ob, sb);
    }

    #[test]
    fn swiglu_equals_the_two_products_and_the_elementwise_step() {
        let (rows, cols) = (70, 64);
        let (a, b) = (q4_1_matrix(rows, cols), q4_1_matrix(rows + 1, cols));
        let (wg, wu) = (
            QMatrix::new(GgmlType::Q4_1, &a, rows, cols),
            QMatrix::new(GgmlType::Q4_1, &b[..a.len()], rows, cols),
        );
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for t in [1, 6, 33] {
            let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.17).sin()).collect();
            let mut fused = vec![0f32; t * rows];
            matmul_swiglu(&pool, &wg, &wu, &x, t, &mut fused);
            let (mut g, mut u) = (vec![0f32; t * rows], vec![0f32; t * rows]);
            matmul_many(&pool, &[&wg, &wu], &x, t, &mut [&mut g, &mut u]);
            let want: Vec<u32> = g
                .iter()
                .zip(&u)
                .map(|(&g, &u)| silu_times(g, u).to_bits())
                .collect();
            let got: Vec<u32> = fused.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{t} tokens");
            assert!(fused.iter().any(|v| *v != 0.0));
        }
    }

    #[test]
    fn fallback_types_use_the_reference_dequantizer() {
        let (rows, cols) = (3, 32);
        let vals: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.25 - 5.0).collect();
        let data: Vec<u8> = vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect();
        let w = QMatrix::new(GgmlType::F16, &data, rows, cols);
        let x = vec![1.0f32; cols];
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let mut out = vec![0f32; rows];
        matmul(&pool, &w, &x, 1, &mut out);
        for r in 0..rows {
            let exact: f32 = vals[r * cols..(r + 1) * cols].iter().sum();
            assert!((out[r] - exact).abs() < 1e-3, "{} vs {exact}", out[r]);
        }
    }
}

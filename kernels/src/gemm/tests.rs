//! Tests of the integer GEMM: every path equals the definition for every batch size and
//! tile remainder, and the definition is the dot product of the dequantized values.

use half::f16;
use pdmesh_ggml::{GgmlType, q4k_sub_blocks, q6k_groups};

use super::scalar::scalar_one;
use super::*;
use crate::WeightFormat;
use crate::testdata::{Lcg, k_blocks};
use crate::{QActs, quantize_q8_0, quantize_q8_1};

/// `rows` rows of `nb` blocks of `kind`, with extreme values (nibbles 0 and 15, bytes
/// −128 and 127) mixed in, and scales of both signs. The rewritten K-quants are real
/// rewrites of random GGML blocks (extreme scales, mins and values among them), each
/// row cut to `nb` blocks.
fn weights(kind: IntKind, rows: usize, nb: usize, seed: u64) -> Vec<u8> {
    let k_quant = match kind {
        IntKind::Q4K32 => Some(GgmlType::Q4K),
        IntKind::Q6K32 => Some(GgmlType::Q6K),
        _ => None,
    };
    if let Some(ty) = k_quant {
        let supers = nb.div_ceil(8);
        let (_, all) = WeightFormat::rewrite(ty, &k_blocks(ty, rows * supers, seed)).unwrap();
        let full = supers * 8 * kind.block_bytes();
        return all
            .chunks_exact(full)
            .flat_map(|row| &row[..nb * kind.block_bytes()])
            .copied()
            .collect();
    }
    let mut r = Lcg(seed);
    let mut d = Vec::new();
    for _ in 0..rows * nb {
        let scale = (r.next() % 200) as f32 * 1e-4 - 0.005;
        d.extend(f16::from_f32(scale).to_le_bytes());
        if kind == IntKind::Q4_1 {
            d.extend(f16::from_f32((r.next() % 100) as f32 * -1e-3).to_le_bytes());
        }
        let n = if kind == IntKind::Q8_0 { 32 } else { 16 };
        for _ in 0..n {
            d.push(match r.next() % 6 {
                0 => 0x00,
                1 => 0xFF,
                2 => 0x80,
                3 => 0x7F,
                _ => r.next() as u8,
            });
        }
    }
    d
}

/// `t` tokens' activations of `nb` blocks: values in −1..1 with zeros mixed in.
fn floats(t: usize, nb: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut r = Lcg(seed);
    (0..t)
        .map(|_| {
            (0..nb * 32)
                .map(|_| match r.next() % 9 {
                    0 => 0.0,
                    _ => (r.next() % 2001) as f32 * 1e-3 - 1.0,
                })
                .collect()
        })
        .collect()
}

fn acts(kind: IntKind, t: usize, nb: usize, seed: u64) -> Vec<QActs> {
    floats(t, nb, seed)
        .iter()
        .map(|x| {
            let mut q = QActs::default();
            if kind.takes_q8_1() {
                quantize_q8_1(x, &mut q);
            } else {
                quantize_q8_0(x, &mut q);
            }
            q
        })
        .collect()
}

const KINDS: [IntKind; 5] = [
    IntKind::Q4_1,
    IntKind::Q8_0,
    IntKind::Q4_0,
    IntKind::Q4K32,
    IntKind::Q6K32,
];

/// Packed as a matrix product packs: Q8_1 activations for Q4_1, and Q8_0 ones for
/// every other format at once.
fn pack(kind: IntKind, a: &[QActs], nb: usize) -> Packed {
    let kinds: &[IntKind] = if kind.takes_q8_1() {
        &[IntKind::Q4_1]
    } else {
        &[IntKind::Q8_0, IntKind::Q4_0, IntKind::Q4K32, IntKind::Q6K32]
    };
    Packed::new(a, nb, kinds)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// A path's rows × tokens.
type RowsFn = fn(IntKind, &[u8], usize, &Packed, &mut [&mut [f32]]);

/// `f`'s results as one rows × tokens block, row-major.
fn run(f: RowsFn, kind: IntKind, w: &[u8], rb: usize, p: &Packed) -> Vec<f32> {
    let nrows = w.len() / rb;
    let mut per_token = vec![vec![0f32; nrows]; p.tokens()];
    let mut slices: Vec<&mut [f32]> = per_token.iter_mut().map(|v| &mut v[..]).collect();
    f(kind, w, rb, p, &mut slices);
    (0..nrows * p.tokens())
        .map(|i| per_token[i % p.tokens()][i / p.tokens()])
        .collect()
}

/// The paths this machine can run.
fn paths() -> Vec<(&'static str, RowsFn)> {
    let mut p: Vec<(&'static str, RowsFn)> = vec![("scalar", scalar_rows), ("dispatched", rows)];
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has avx2, fma and f16c.
        p.push(("avx2", |k, d, rb, pk, o| unsafe {
            avx2::rows(k.tag(), d, rb, pk, o)
        }));
    }
    p
}

#[test]
fn every_path_equals_the_definition_for_every_batch_size_and_tile_remainder() {
    if !has_avx2() {
        eprintln!("no SIMD path on this machine: the scalar path alone is checked");
    }
    for kind in KINDS {
        // One block, an odd count, and SmolLM2's width.
        for nb in [1, 3, 18] {
            // Every row remainder too (rows two and one at a time for few tokens).
            let nrows = 5;
            let w = weights(kind, nrows, nb, 11 + nb as u64);
            let rb = nb * kind.block_bytes();
            let all = acts(kind, 130, nb, 7);
            // Every tile remainder on one row and on two (two rows from
            // TWO_ROWS_FROM tokens; 79 = 64 + 8 + 4 + 2 + 1), and batches of several
            // widest tiles.
            for t in (1..=64).chain([65, 79, 97, 130]) {
                let p = pack(kind, &all[..t], nb);
                let want: Vec<f32> = (0..nrows * t)
                    .map(|i| scalar_one(kind, &w[i / t * rb..(i / t + 1) * rb], &p, i % t))
                    .collect();
                for (name, f) in paths() {
                    let got = run(f, kind, &w, rb, &p);
                    assert_eq!(bits(&got), bits(&want), "{kind:?} nb {nb} t {t}: {name}");
                }
                // A token's result alone equals its result in the batch.
                let last = pack(kind, &all[t - 1..t], nb);
                let one = run(rows, kind, &w, rb, &last);
                for r in 0..nrows {
                    assert_eq!(one[r].to_bits(), want[r * t + t - 1].to_bits());
                }
            }
        }
    }
}

/// The definition against a float product of the dequantized weights and
/// activations: only the activations' rounding separates them.
#[test]
fn the_definition_is_the_dot_product_of_the_dequantized_values() {
    for kind in KINDS {
        let nb = 5;
        let w = weights(kind, 3, nb, 3);
        let rb = nb * kind.block_bytes();
        let a = acts(kind, 4, nb, 5);
        let p = pack(kind, &a, nb);
        let format = match kind {
            IntKind::Q4_1 => WeightFormat::Ggml(GgmlType::Q4_1),
            IntKind::Q8_0 => WeightFormat::Ggml(GgmlType::Q8_0),
            IntKind::Q4_0 => WeightFormat::Ggml(GgmlType::Q4_0),
            IntKind::Q4K32 => WeightFormat::Q4K32,
            IntKind::Q6K32 => WeightFormat::Q6K32,
        };
        let mut wf = vec![0f32; nb * 32];
        for r in 0..3 {
            format.dequantize(&w[r * rb..(r + 1) * rb], &mut wf);
            for (tt, q) in a.iter().enumerate() {
                let xf: Vec<f32> = (0..nb * 32).map(|i| q.qs[i] as f32 * q.d[i / 32]).collect();
                let exact: f64 = wf
                    .iter()
                    .zip(&xf)
                    .map(|(a, b)| (*a as f64) * (*b as f64))
                    .sum();
                let mag: f64 = wf
                    .iter()
                    .zip(&xf)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                let got = scalar_one(kind, &w[r * rb..(r + 1) * rb], &p, tt) as f64;
                // Q8_1's sums are rounded through f16: a relative 2^-11 of the min term.
                assert!(
                    (got - exact).abs() <= mag * 2e-3 + 1e-4,
                    "{kind:?} row {r} token {tt}: {got} vs {exact}"
                );
            }
        }
    }
}

/// A K-quant row's product through its rewrite against the reference: the f32 dot of
/// the ORIGINAL blocks' dequantized values with the token's activations. Against the
/// activations as quantized, only f32 rounding separates them (a few units of 2^-24 per
/// block, relative to the products' and the mins' magnitudes: a Q4_K value is the
/// difference of two); against the float activations, also their rounding (at most
/// 0.57 of the block's step per value: half a step, and the scale's f16 rounding).
#[test]
fn k_quant_products_are_the_original_blocks_times_the_activations() {
    for (ty, kind) in [
        (GgmlType::Q4K, IntKind::Q4K32),
        (GgmlType::Q6K, IntKind::Q6K32),
    ] {
        let (supers, nrows, t) = (3, 16, 6);
        let nb = 8 * supers;
        let src = k_blocks(ty, nrows * supers, 21);
        let (format, w) = WeightFormat::rewrite(ty, &src).unwrap();
        let rb = format.row_bytes(nb * 32);
        let x = floats(t, nb, 9);
        let a: Vec<QActs> = x
            .iter()
            .map(|x| {
                let mut q = QActs::default();
                quantize_q8_0(x, &mut q);
                q
            })
            .collect();
        let p = pack(kind, &a, nb);
        let mut wf = vec![0f32; nb * 32];
        for r in 0..nrows {
            let orig = &src[r * supers * ty.block_bytes()..(r + 1) * supers * ty.block_bytes()];
            pdmesh_ggml::dequantize(ty, orig, &mut wf);
            // Per value the magnitudes the sum is formed from: |scale · q| and |min|.
            let parts: Vec<(f32, f32)> = orig
                .chunks_exact(ty.block_bytes())
                .flat_map(|blk| -> Vec<(f32, f32)> {
                    if ty == GgmlType::Q4K {
                        q4k_sub_blocks(blk)
                            .iter()
                            .flat_map(|(s, m, q)| q.map(|q| ((s * q as f32).abs(), m.abs())))
                            .collect()
                    } else {
                        let (scales, q) = q6k_groups(blk);
                        (0..256)
                            .map(|i| ((scales[i / 16] * q[i] as f32).abs(), 0.0))
                            .collect()
                    }
                })
                .collect();
            for (tt, q) in a.iter().enumerate() {
                let got = scalar_one(kind, &w[r * rb..(r + 1) * rb], &p, tt) as f64;
                let xq: Vec<f64> = (0..nb * 32)
                    .map(|i| q.qs[i] as f64 * q.d[i / 32] as f64)
                    .collect();
                let exact: f64 = wf.iter().zip(&xq).map(|(w, x)| *w as f64 * x).sum();
                let mag: f64 = parts
                    .iter()
                    .zip(&xq)
                    .map(|((sq, m), x)| (*sq as f64 + *m as f64) * x.abs())
                    .sum();
                let bound = mag * (nb + 8) as f64 * 2f64.powi(-23);
                assert!(
                    (got - exact).abs() <= bound,
                    "{ty:?} row {r} token {tt}: {got} vs {exact} (bound {bound})"
                );
                let float: f64 = wf
                    .iter()
                    .zip(&x[tt])
                    .map(|(w, x)| *w as f64 * *x as f64)
                    .sum();
                let step: f64 = wf
                    .iter()
                    .enumerate()
                    .map(|(i, w)| (*w as f64).abs() * q.d[i / 32] as f64 * 0.57)
                    .sum();
                assert!(
                    (got - float).abs() <= bound + step,
                    "{ty:?} row {r} token {tt}: {got} vs the float product {float}"
                );
            }
        }
    }
}

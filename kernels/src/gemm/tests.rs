//! Tests of the integer GEMM: every path equals the definition for every batch size and
//! tile remainder, and the definition is the dot product of the dequantized values.

use half::f16;
use pdmesh_ggml::{GgmlType, dequantize};

use super::scalar::scalar_one;
use super::*;
use crate::{QActs, quantize_q8_0, quantize_q8_1};

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
}

/// `rows` rows of `nb` blocks of `kind`, with extreme values (nibbles 0 and 15, bytes
/// −128 and 127) mixed in, and scales of both signs.
fn weights(kind: IntKind, rows: usize, nb: usize, seed: u64) -> Vec<u8> {
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

fn acts(kind: IntKind, t: usize, nb: usize, seed: u64) -> Vec<QActs> {
    let mut r = Lcg(seed);
    (0..t)
        .map(|_| {
            let x: Vec<f32> = (0..nb * 32)
                .map(|_| match r.next() % 9 {
                    0 => 0.0,
                    _ => (r.next() % 2001) as f32 * 1e-3 - 1.0,
                })
                .collect();
            let mut q = QActs::default();
            if kind == IntKind::Q4_1 {
                quantize_q8_1(&x, &mut q);
            } else {
                quantize_q8_0(&x, &mut q);
            }
            q
        })
        .collect()
}

const KINDS: [IntKind; 3] = [IntKind::Q4_1, IntKind::Q8_0, IntKind::Q4_0];

/// Packed as a matrix product packs: Q8_1 activations for Q4_1, and Q8_0 ones for
/// both other formats at once.
fn pack(kind: IntKind, a: &[QActs], nb: usize) -> Packed {
    let kinds: &[IntKind] = if kind == IntKind::Q4_1 {
        &[IntKind::Q4_1]
    } else {
        &[IntKind::Q8_0, IntKind::Q4_0]
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
        let ty = match kind {
            IntKind::Q4_1 => GgmlType::Q4_1,
            IntKind::Q8_0 => GgmlType::Q8_0,
            IntKind::Q4_0 => GgmlType::Q4_0,
        };
        let mut wf = vec![0f32; nb * 32];
        for r in 0..3 {
            dequantize(ty, &w[r * rb..(r + 1) * rb], &mut wf);
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

//! Activation quantization into 32-value blocks (llama.cpp's Q8_0 / Q8_1 schemes), the
//! form the integer dot products consume.

use half::f16;

/// Quantized activations of one token: per 32-value block a scale `d` (and for Q8_1 the
/// scaled sum `s`), plus the i8 values. Scales are rounded through f16 as llama.cpp does.
#[derive(Clone, Debug, Default)]
pub struct QActs {
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub qs: Vec<i8>,
}

impl QActs {
    pub fn blocks(&self) -> usize {
        self.d.len()
    }
}

fn quantize_block(x: &[f32], qs: &mut [i8]) -> (f32, i32) {
    // Max of |x| in eight lanes (max is exact and order-free, so this equals a plain fold;
    // the lanes let it vectorize).
    let mut lanes = [0f32; 8];
    for c in x.chunks_exact(8) {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = l.max(v.abs());
        }
    }
    let amax = x
        .chunks_exact(8)
        .remainder()
        .iter()
        .fold(lanes.iter().fold(0f32, |m, &v| m.max(v)), |m, v| {
            m.max(v.abs())
        });
    // As llama.cpp's x86 path: id = 127 / amax, round half to even.
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    // 1.5 * 2^23: adding it rounds half to even in the default FP mode, and for |v| < 2^22
    // the sum's bits minus the constant's bits are exactly the rounded integer (one unit
    // per ulp in that binade) — no libm call, no float-to-int conversion, vectorizable.
    // |v * id| <= 127 here.
    const MAGIC: f32 = 12_582_912.0;
    for (q, &v) in qs.iter_mut().zip(x) {
        let r = (v * id + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32;
        *q = r as i8;
        sum += r;
    }
    (d, sum)
}

/// Quantize `x` (a multiple of 32 values) to Q8_0 into `out`.
pub fn quantize_q8_0(x: &[f32], out: &mut QActs) {
    let nb = x.len() / 32;
    out.d.resize(nb, 0.0);
    out.s.clear();
    out.qs.resize(x.len(), 0);
    for b in 0..nb {
        let (d, _) = quantize_block(&x[32 * b..32 * b + 32], &mut out.qs[32 * b..32 * b + 32]);
        out.d[b] = f16::from_f32(d).to_f32();
    }
}

/// Quantize `x` (a multiple of 32 values) to Q8_1 (scale and scaled sum) into `out`.
pub fn quantize_q8_1(x: &[f32], out: &mut QActs) {
    let nb = x.len() / 32;
    out.d.resize(nb, 0.0);
    out.s.resize(nb, 0.0);
    out.qs.resize(x.len(), 0);
    for b in 0..nb {
        let (d, sum) = quantize_block(&x[32 * b..32 * b + 32], &mut out.qs[32 * b..32 * b + 32]);
        out.d[b] = f16::from_f32(d).to_f32();
        out.s[b] = f16::from_f32(d * sum as f32).to_f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_half_to_even() {
        let mut x = vec![0f32; 32];
        x[0] = 127.0; // amax 127 -> id 1: values map to themselves
        x[1] = 2.5;
        x[2] = 3.5;
        x[3] = -2.5;
        x[4] = 0.4999;
        let mut q = QActs::default();
        quantize_q8_0(&x, &mut q);
        assert_eq!(&q.qs[..5], &[127, 2, 4, -2, 0]);
    }

    #[test]
    fn q8_blocks_round_trip_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37)
            .collect();
        let mut q = QActs::default();
        quantize_q8_1(&x, &mut q);
        assert_eq!(q.blocks(), 2);
        for b in 0..2 {
            let mut sum = 0i32;
            for j in 0..32 {
                let back = q.qs[32 * b + j] as f32 * q.d[b];
                assert!(
                    (back - x[32 * b + j]).abs() <= q.d[b] * 0.51 + 1e-3,
                    "{back} vs {}",
                    x[32 * b + j]
                );
                sum += q.qs[32 * b + j] as i32;
            }
            assert!((q.s[b] - q.d[b] * sum as f32).abs() <= q.s[b].abs() * 1e-3 + 1e-3);
        }
        let zeros = vec![0f32; 32];
        quantize_q8_0(&zeros, &mut q);
        assert_eq!(q.d, vec![0.0]);
        assert!(q.qs.iter().all(|&v| v == 0));
    }
}

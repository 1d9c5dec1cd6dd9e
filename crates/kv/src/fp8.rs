//! FP8 E4M3 (the `e4m3fn` variant: no infinities, one NaN pattern per sign, largest
//! finite value 448) and the block quantization DeepSeek's KV caches use: one f32 scale per
//! 128 values, either `amax / 448` or its power-of-two form rounded up ("ue8m0", a scale
//! that is exactly `2^e`, storable as the byte `e + 127`).
//!
//! Encoding rounds to nearest, ties to even, and saturates: a finite value beyond ±448
//! (which a scale computed from the block's own amax never produces) becomes ±448, not NaN.

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// The floor DeepSeek puts under a block's amax, so an all-zero block gets a usable scale.
pub const AMAX_FLOOR: f32 = 1e-4;

/// The E4M3 byte nearest to `x` (ties to even; saturating; NaN stays NaN).
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7F;
    }
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    // Below the smallest normal (2^-6) the step is 2^-9, and the code is the step count:
    // 8 steps is 2^-6, which is also code 0x08, so rounding up into the normals is exact.
    if a < 2f32.powi(-6) {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // a = 2^e * (1 + f), 1 <= a / 2^e < 2, both exact in f32.
    let mut e = ((a.to_bits() >> 23) & 0xFF) as i32 - 127;
    let mut q = ((a / 2f32.powi(e) - 1.0) * 8.0).round_ties_even() as u32;
    if q == 8 {
        e += 1;
        q = 0;
    }
    let code = (((e + 7) as u32) << 3 | q).min(0x7E);
    sign | code as u8
}

/// The value of an E4M3 byte (from a table of all 256).
#[inline]
pub fn e4m3_to_f32(b: u8) -> f32 {
    table()[b as usize]
}

/// Every E4M3 byte's value.
fn table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|i| e4m3_value(i as u8)))
}

fn e4m3_value(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0x0F) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0F && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    if e == 0 {
        return sign * m * 2f32.powi(-9);
    }
    sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
}

/// How a block's scale is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleRule {
    /// `amax / 448`.
    Exact,
    /// `2^ceil(log2(amax / 448))`: the block never saturates and the scale is a power of two.
    Ue8m0,
}

/// The scale of a block whose largest magnitude is `amax` (floored at [`AMAX_FLOOR`]).
pub fn block_scale(amax: f32, rule: ScaleRule) -> f32 {
    let s = amax.max(AMAX_FLOOR) / E4M3_MAX;
    match rule {
        ScaleRule::Exact => s,
        ScaleRule::Ue8m0 => 2f32.powi(ue8m0_exponent(s)),
    }
}

/// `ceil(log2(s))` for a positive normal `s`, exactly (from its bits, not a logarithm).
pub fn ue8m0_exponent(s: f32) -> i32 {
    debug_assert!(s.is_normal() && s > 0.0, "scale {s}");
    let bits = s.to_bits();
    let e = ((bits >> 23) & 0xFF) as i32 - 127;
    if bits & 0x7F_FFFF == 0 { e } else { e + 1 }
}

/// Quantizes `x` (one block) into `out`; returns the block's scale.
pub fn quantize_block(x: &[f32], out: &mut [u8], rule: ScaleRule) -> f32 {
    assert_eq!(x.len(), out.len(), "one byte per value");
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = block_scale(amax, rule);
    let inv = 1.0 / scale;
    for (o, v) in out.iter_mut().zip(x) {
        *o = f32_to_e4m3(v * inv);
    }
    scale
}

/// The values a quantized block stands for.
pub fn dequantize_block(q: &[u8], scale: f32, out: &mut [f32]) {
    assert_eq!(q.len(), out.len(), "one value per byte");
    let t = table();
    for (o, b) in out.iter_mut().zip(q) {
        *o = t[*b as usize] * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_e4m3_codes() {
        for (x, code) in [
            (0.0f32, 0x00u8),
            (-0.0, 0x80),
            (1.0, 0x38),
            (-1.0, 0xB8),
            (0.5, 0x30),
            (1.125, 0x39),
            (448.0, 0x7E),
            (-448.0, 0xFE),
            (2f32.powi(-6), 0x08), // smallest normal
            (2f32.powi(-9), 0x01), // smallest subnormal
            (7.0 * 2f32.powi(-9), 0x07),
            (240.0, 0x77),
            (0.1, 0x1D), // 0.1015625, the nearest
        ] {
            assert_eq!(f32_to_e4m3(x), code, "{x}");
        }
        // Ties go to the even mantissa.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3A);
        assert_eq!(f32_to_e4m3(1.5 * 2f32.powi(-9)), 0x02);
        assert_eq!(f32_to_e4m3(0.5 * 2f32.powi(-9)), 0x00);
        // Rounding up carries into the exponent.
        assert_eq!(f32_to_e4m3(1.96875), 0x40); // nearer 2.0 than 1.875
        // Saturation and NaN.
        assert_eq!(f32_to_e4m3(1e6), 0x7E);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xFE);
        assert_eq!(f32_to_e4m3(f32::NAN) & 0x7F, 0x7F);
        assert!(e4m3_to_f32(0x7F).is_nan());
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    }

    #[test]
    fn every_code_round_trips_and_values_are_monotone() {
        let mut last = -1.0f32;
        for b in 0u8..=0x7E {
            let v = e4m3_to_f32(b);
            assert_eq!(f32_to_e4m3(v), b, "code {b:#04x} = {v}");
            assert_eq!(f32_to_e4m3(-v), b | 0x80);
            assert!(v > last || b == 0, "{b:#04x}");
            last = v;
        }
    }

    #[test]
    fn encoding_picks_the_nearest_code() {
        // Against a brute-force search over every finite code.
        let codes: Vec<(u8, f32)> = (0u8..=0x7E).map(|b| (b, e4m3_to_f32(b))).collect();
        let mut x = 0.0001f32;
        while x < 460.0 {
            let got = e4m3_to_f32(f32_to_e4m3(x));
            let best = codes
                .iter()
                .map(|&(_, v)| (v - x).abs())
                .fold(f32::INFINITY, f32::min);
            assert!(
                (got - x).abs() <= best,
                "{x}: got {got}, nearest is {best} away"
            );
            x *= 1.0173;
        }
    }

    #[test]
    fn scales_exact_and_ue8m0() {
        assert_eq!(block_scale(448.0, ScaleRule::Exact), 1.0);
        assert_eq!(block_scale(448.0, ScaleRule::Ue8m0), 1.0);
        assert_eq!(block_scale(449.0, ScaleRule::Ue8m0), 2.0);
        assert_eq!(block_scale(224.0, ScaleRule::Ue8m0), 0.5);
        assert_eq!(block_scale(300.0, ScaleRule::Ue8m0), 1.0);
        assert_eq!(block_scale(0.0, ScaleRule::Exact), AMAX_FLOOR / 448.0);
        // 1e-4 / 448 = 2.23e-7: log2 = -22.1, rounded up to -22.
        assert_eq!(block_scale(0.0, ScaleRule::Ue8m0), 2f32.powi(-22));
        assert_eq!(ue8m0_exponent(1.0), 0);
        assert_eq!(ue8m0_exponent(1.0000001), 1);
        assert_eq!(ue8m0_exponent(0.75), 0);
    }

    #[test]
    fn a_block_round_trips_within_half_a_step_and_never_saturates_with_ue8m0() {
        let x: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.731)
            .collect();
        for rule in [ScaleRule::Exact, ScaleRule::Ue8m0] {
            let mut q = vec![0u8; 128];
            let s = quantize_block(&x, &mut q, rule);
            let mut back = vec![0f32; 128];
            dequantize_block(&q, s, &mut back);
            for (a, b) in x.iter().zip(&back) {
                // E4M3 keeps 3 mantissa bits: relative error at most 2^-4 (normals).
                assert!(
                    (a - b).abs() <= a.abs() / 16.0 + s * 2f32.powi(-9),
                    "{rule:?} {a} {b}"
                );
            }
            if rule == ScaleRule::Ue8m0 {
                assert!(q.iter().all(|&b| b & 0x7F <= 0x7E));
                assert_eq!(s.log2().fract(), 0.0, "a power of two");
            }
        }
    }
}

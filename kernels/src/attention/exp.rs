//! `exp` as every attention path computes it: one definition in f64 that the SIMD paths
//! perform lane by lane, so their probabilities carry the same bits.

/// `e^x` as every path computes it, correctly rounded but for about one input in 10^7:
/// `x` clamped to `[−87, 88]` (NaN to −87), then in f64: `n` the nearest integer to
/// `x · log2 e` (ties to even), `r = x − n · ln 2` in two fused steps, the Taylor
/// polynomial of degree 11 by fused Horner steps, times `2^n`, rounded to f32. The SIMD
/// paths do these operations lane by lane.
pub fn exp_f32(x: f32) -> f32 {
    // Not clamp: clamp keeps NaN, and NaN must become EXP_LO as in the SIMD paths.
    #[allow(clippy::manual_clamp)]
    let x = f64::from(x.max(EXP_LO).min(EXP_HI));
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut y = EXP_TAYLOR[0];
    for c in &EXP_TAYLOR[1..] {
        y = y.mul_add(r, *c);
    }
    (y * f64::from_bits(((n as i64 + 1023) as u64) << 52)) as f32
}

pub(super) const EXP_LO: f32 = -87.0;
pub(super) const EXP_HI: f32 = 88.0;
pub(super) const LOG2E: f64 = std::f64::consts::LOG2_E;
pub(super) const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
pub(super) const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
/// 1/11!, 1/10!, …, 1/1!, 1/0!.
pub(super) const EXP_TAYLOR: [f64; 12] = [
    1.0 / 39_916_800.0,
    1.0 / 3_628_800.0,
    1.0 / 362_880.0,
    1.0 / 40_320.0,
    1.0 / 5_040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

//! Attention of query tokens over one KV group's cached f16 rows: scores, softmax and the
//! weighted sum of values, converting K and V from f16 as they are read.
//!
//! One order of operations defines every result (the scalar path performs it literally):
//! per query head, the query rounded through f16; per key, eight lanes each adding
//! `q[c + l] · k[c + l]` over the chunks `c` in order (a multiply, then an add), reduced by
//! the tree `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))` and multiplied by the scale;
//! the max; `e = exp(s − max)` with [`exp_f32`]; their sum in f64, keys in order;
//! `p = f16(e · (1 / sum))`; and per output lane `o += p · v`, keys in order from zero.
//! The SIMD paths perform exactly these operations, so every path gives the same bits,
//! and a token's result never depends on its batch or on the other tokens of its tile.
//! Both products are of two f16 values (the query and the probabilities are rounded
//! through f16), so each is exact in f32 and a fused multiply-add rounds exactly as the
//! multiply then the add; the AVX-512 path fuses them.
//!
//! The SIMD paths compute a tile of query tokens of one sequence at once (every head of
//! the group, every token of the tile): each block of keys and values (16 on AVX-512, 8
//! on AVX2) is converted from f16 once for all of them, and the lane sums of a block's
//! keys are reduced by the tree across registers (AVX-512: two keys' eight lanes per
//! register; AVX2: one key per register). On AVX-512 exp, the probabilities and the
//! weighted sums are 16 lanes wide; on AVX2 exp is four f64 lanes and the rest eight.

use half::f16;

use crate::dot::{has_avx2, has_avx512};

/// For each of the `q.len() / hd` heads sharing this KV group:
/// `out[r] = softmax(scale · q_r · Kᵀ) · V`, where `keys[j]` and `values[j]` are position
/// j's rows. Queries and probabilities are rounded through f16, as llama.cpp does with an
/// f16 cache.
pub fn attend(
    q: &[f32],
    hd: usize,
    keys: &[&[f16]],
    values: &[&[f16]],
    scale: f32,
    out: &mut [f32],
) {
    attend_causal(&[q], hd, &[keys.len()], keys, values, scale, &mut [out]);
}

/// [`attend`] for several query tokens of one sequence at once: token `i` (its heads of
/// this group, `qs[i]`) attends over the first `counts[i]` keys and values, into
/// `outs[i]`; each result is the same bits as that token's [`attend`] alone.
pub fn attend_causal(
    qs: &[&[f32]],
    hd: usize,
    counts: &[usize],
    keys: &[&[f16]],
    values: &[&[f16]],
    scale: f32,
    outs: &mut [&mut [f32]],
) {
    attend_causal_on(Path::detect(hd), qs, hd, counts, keys, values, scale, outs);
}

/// The implementations, which give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Scalar,
    Avx2,
    Avx512,
}

impl Path {
    fn detect(hd: usize) -> Path {
        if cfg!(target_arch = "x86_64") && has_avx512() && hd.is_multiple_of(16) {
            Path::Avx512
        } else if cfg!(target_arch = "x86_64") && has_avx2() {
            Path::Avx2
        } else {
            Path::Scalar
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn attend_causal_on(
    path: Path,
    qs: &[&[f32]],
    hd: usize,
    counts: &[usize],
    keys: &[&[f16]],
    values: &[&[f16]],
    scale: f32,
    outs: &mut [&mut [f32]],
) {
    let t = qs.len();
    assert!(t > 0 && counts.len() == t && outs.len() == t && hd.is_multiple_of(8));
    let rep = qs[0].len() / hd;
    assert!(rep > 0 && qs.iter().all(|q| q.len() == rep * hd));
    assert!(outs.iter().all(|o| o.len() == rep * hd));
    let n = counts.iter().copied().max().unwrap_or(0);
    assert!(counts.iter().all(|&c| c > 0) && keys.len() >= n && values.len() >= n);
    assert!(keys[..n].iter().chain(&values[..n]).all(|r| r.len() == hd));
    #[cfg(target_arch = "x86_64")]
    if path == Path::Avx512 {
        assert!(hd.is_multiple_of(16));
        // SAFETY: Path::Avx512 is only chosen (or forced by tests) on a CPU with avx512f,
        // avx2, fma and f16c; every shape the function indexes by was asserted above.
        unsafe { avx512::attend_causal(qs, hd, counts, keys, values, scale, outs) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if path == Path::Avx2 {
        // SAFETY: Path::Avx2 is only chosen (or forced by tests) on a CPU with avx2, fma
        // and f16c; every shape the function indexes by was asserted above.
        unsafe { avx2::attend_causal(qs, hd, counts, keys, values, scale, outs) };
        return;
    }
    for ((q, &c), o) in qs.iter().zip(counts).zip(outs.iter_mut()) {
        attend_one(q, hd, &keys[..c], &values[..c], scale, o);
    }
}

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

const EXP_LO: f32 = -87.0;
const EXP_HI: f32 = 88.0;
const LOG2E: f64 = std::f64::consts::LOG2_E;
const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
/// 1/11!, 1/10!, …, 1/1!, 1/0!.
const EXP_TAYLOR: [f64; 12] = [
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

/// One query token (its `q.len() / hd` heads) over all of `keys`, one head at a time:
/// the definition the SIMD paths give the bits of.
fn attend_one(
    q: &[f32],
    hd: usize,
    keys: &[&[f16]],
    values: &[&[f16]],
    scale: f32,
    out: &mut [f32],
) {
    let rep = q.len() / hd;
    let n = keys.len();
    let qh: Vec<f32> = q.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
    let mut scores = vec![0f32; n];
    for r in 0..rep {
        let qh = &qh[r * hd..(r + 1) * hd];
        for (s, k) in scores.iter_mut().zip(keys) {
            *s = tree(scalar_dot_lanes(qh, k), scale);
        }
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        scalar_softmax(&mut scores, max);
        scalar_weighted_sum(&scores, values, &mut out[r * hd..(r + 1) * hd]);
    }
}

/// A key's eight lane sums reduced by the module's tree, times the scale.
#[inline(always)]
fn tree(lanes: [f32; 8], scale: f32) -> f32 {
    (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])))
        * scale
}

/// Scores to probabilities: `e = exp(s − max)`, their sum in f64 in key order, then
/// `f16(e · (1 / sum))`.
fn scalar_softmax(scores: &mut [f32], max: f32) {
    let mut sum = 0f64;
    for s in scores.iter_mut() {
        *s = exp_f32(*s - max);
        sum += *s as f64;
    }
    let inv = (1.0 / sum) as f32;
    for s in scores.iter_mut() {
        *s = f16::from_f32(*s * inv).to_f32();
    }
}

/// Eight lane sums of q·k: lane l adds q[c+l]·k[c+l] over the chunks c in order.
fn scalar_dot_lanes(q: &[f32], k: &[f16]) -> [f32; 8] {
    let mut lanes = [0f32; 8];
    for (cq, ck) in q.chunks_exact(8).zip(k.chunks_exact(8)) {
        for l in 0..8 {
            lanes[l] += cq[l] * ck[l].to_f32();
        }
    }
    lanes
}

fn scalar_weighted_sum(p: &[f32], values: &[&[f16]], o: &mut [f32]) {
    o.fill(0.0);
    for (&pj, v) in p.iter().zip(values) {
        for (od, vd) in o.iter_mut().zip(v.iter()) {
            *od += pj * vd.to_f32();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::{EXP_HI, EXP_LO, EXP_TAYLOR, LN2_HI, LN2_LO, LOG2E, exp_f32};

    /// [`exp_f32`] in four lanes, in f64 lanes as it computes: the same operations, fused
    /// where it fuses, so the same bits.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn exp4(x: __m128) -> __m128 {
        // max_ps returns its second operand when the first is NaN: NaN → EXP_LO, as
        // f32::max does.
        let x = _mm_min_ps(_mm_max_ps(x, _mm_set1_ps(EXP_LO)), _mm_set1_ps(EXP_HI));
        let x = _mm256_cvtps_pd(x);
        let n = _mm256_round_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_pd(x, _mm256_set1_pd(LOG2E)),
        );
        let r = _mm256_fmadd_pd(n, _mm256_set1_pd(-LN2_HI), x);
        let r = _mm256_fmadd_pd(n, _mm256_set1_pd(-LN2_LO), r);
        let mut y = _mm256_set1_pd(EXP_TAYLOR[0]);
        for c in &EXP_TAYLOR[1..] {
            y = _mm256_fmadd_pd(y, r, _mm256_set1_pd(*c));
        }
        // 2^n built from its exponent bits (n is a whole number in [-126, 128], exact
        // as i32), then one exact multiply, as the scalar path does.
        let bits = _mm256_slli_epi64::<52>(_mm256_add_epi64(
            _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n)),
            _mm256_set1_epi64x(1023),
        ));
        _mm256_cvtpd_ps(_mm256_mul_pd(y, _mm256_castsi256_pd(bits)))
    }

    /// [`super::scalar_softmax`]'s operations, exp four lanes at a time and the f16
    /// rounding eight, the sum still one f64 add per key in key order.
    #[cfg(test)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn softmax(scores: &mut [f32], max: f32) {
        exps(scores, max);
        let sum = scores.iter().fold(0f64, |sum, &e| sum + e as f64);
        normalize(scores, sum);
    }

    /// The f64 sums in key order of the first `c` values of `K` rows `stride` apart, side by
    /// side (each its own chain); the rest of the four are zero.
    #[inline(always)]
    fn sums<const K: usize>(rows: &[f32], stride: usize, c: usize) -> [f64; 4] {
        let rows: [&[f32]; K] = std::array::from_fn(|h| &rows[h * stride..][..c]);
        let mut sums = [0f64; K];
        #[allow(clippy::needless_range_loop)] // a key at a time, every row's chain in turn
        for j in 0..c {
            for h in 0..K {
                sums[h] += rows[h][j] as f64;
            }
        }
        std::array::from_fn(|h| if h < K { sums[h] } else { 0.0 })
    }

    /// `e = exp(s − max)` for every score, four lanes at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn exps(scores: &mut [f32], max: f32) {
        let m = _mm_set1_ps(max);
        let mut quads = scores.chunks_exact_mut(4);
        for q in &mut quads {
            // SAFETY: q holds four floats.
            unsafe {
                _mm_storeu_ps(
                    q.as_mut_ptr(),
                    exp4(_mm_sub_ps(_mm_loadu_ps(q.as_ptr()), m)),
                )
            };
        }
        for s in quads.into_remainder() {
            *s = exp_f32(*s - max);
        }
    }

    /// `p = f16(e · (1 / sum))`, eight lanes at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn normalize(scores: &mut [f32], sum: f64) {
        let inv = (1.0 / sum) as f32;
        let iv = _mm256_set1_ps(inv);
        let mut eights = scores.chunks_exact_mut(8);
        for e in &mut eights {
            // SAFETY: e holds eight floats.
            unsafe {
                let p = _mm256_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(_mm256_mul_ps(
                    _mm256_loadu_ps(e.as_ptr()),
                    iv,
                ));
                _mm256_storeu_ps(e.as_mut_ptr(), _mm256_cvtph_ps(p));
            }
        }
        for s in eights.into_remainder() {
            *s = f16::from_f32(*s * inv).to_f32();
        }
    }

    /// Keys converted from f16 at a time for the scores.
    const BLOCK: usize = 8;
    /// Query heads whose weighted sums share one load of each value chunk.
    const GROUP: usize = 8;

    /// Eight registers of one key's eight lanes each (key p in register p) to the eight
    /// keys' tree sums in key order: two levels of adjacent-lane sums within the 128-bit
    /// halves (`(l0 + l1) + (l2 + l3)` in the low half, `(l4 + l5) + (l6 + l7)` in the
    /// high), then the halves added, so each key's sum is its scalar tree.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn tree8(a: [__m256; BLOCK]) -> __m256 {
        let lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        let hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
        // Lanes 0..4 of `lo` hold keys 0..4's first halves, lanes 4..8 their second ones;
        // likewise `hi` for keys 4..8.
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(lo, hi),
            _mm256_permute2f128_ps::<0x31>(lo, hi),
        )
    }

    /// The weighted sums of query heads `q0 .. q0 + G` (probabilities at `p`, key counts
    /// `cnt`) in output lanes `c .. c + 8`: each value chunk converted once for all of them
    /// over the keys they all reach, then each head alone over the rest of its own. Every
    /// lane adds its keys in order, from zero.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn sums_group<const G: usize>(
        outs: &mut [&mut [f32]],
        rep: usize,
        hd: usize,
        c: usize,
        q0: usize,
        p: &[*const f32],
        cnt: &[usize],
        values: &[&[f16]],
    ) {
        let p: [*const f32; G] = std::array::from_fn(|k| p[q0 + k]);
        let cnt: [usize; G] = std::array::from_fn(|k| cnt[q0 + k]);
        let common = cnt.iter().copied().min().unwrap_or(0);
        let v = |j: usize| {
            // SAFETY: value rows below every count hold hd values, c + 8 <= hd (the
            // caller's checks).
            unsafe {
                _mm256_cvtph_ps(_mm_loadu_si128(
                    values.get_unchecked(j).as_ptr().add(c) as *const __m128i
                ))
            }
        };
        let mut acc = [_mm256_setzero_ps(); G];
        for j in 0..common {
            let vj = v(j);
            for (a, p) in acc.iter_mut().zip(p) {
                // SAFETY: every head's probabilities hold its count (> j) floats.
                *a = _mm256_fmadd_ps(_mm256_broadcast_ss(unsafe { &*p.add(j) }), vj, *a);
            }
        }
        for (k, mut a) in acc.into_iter().enumerate() {
            for j in common..cnt[k] {
                // SAFETY: as above.
                a = _mm256_fmadd_ps(_mm256_broadcast_ss(unsafe { &*p[k].add(j) }), v(j), a);
            }
            let qi = q0 + k;
            // SAFETY: token qi / rep's output holds rep · hd floats; (qi % rep) · hd + c + 8
            // is within it.
            unsafe { _mm256_storeu_ps(outs[qi / rep].as_mut_ptr().add((qi % rep) * hd + c), a) };
        }
    }

    /// The tiled form of [`super::attend_causal`], whose checks it relies on: every head
    /// of every token of the tile together, each block of eight keys converted
    /// from f16 once for all of them. Scores are one key per register, eight at a time
    /// reduced by [`tree8`]; the weighted sums share each value chunk among up to
    /// [`GROUP`] heads (see [`sums_group`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attend_causal(
        qs: &[&[f32]],
        hd: usize,
        counts: &[usize],
        keys: &[&[f16]],
        values: &[&[f16]],
        scale: f32,
        outs: &mut [&mut [f32]],
    ) {
        let rep = qs[0].len() / hd;
        let nq = qs.len() * rep;
        let n = counts.iter().copied().max().unwrap_or(0);
        let stride = n.next_multiple_of(BLOCK);
        let cnt: Vec<usize> = (0..nq).map(|qi| counts[qi / rep]).collect();
        // Query head qi (token qi / rep, head qi % rep) rounded through f16 at qd[qi · hd].
        let qd: Vec<f32> = qs
            .iter()
            .flat_map(|q| q.iter().map(|&x| f16::from_f32(x).to_f32()))
            .collect();

        // Scores, a block of eight keys at a time for every query head that reaches it
        // (the block's keys past a head's count are computed and never read).
        let mut scores = vec![0f32; nq * stride];
        let mut kb = vec![0f32; BLOCK * hd];
        let vscale = _mm256_set1_ps(scale);
        for b0 in (0..n).step_by(BLOCK) {
            let b1 = (b0 + BLOCK).min(n);
            for (jb, row) in kb.chunks_exact_mut(hd).enumerate() {
                for c in (0..hd).step_by(8) {
                    let h = match keys.get(b0 + jb).filter(|_| b0 + jb < b1) {
                        // SAFETY: key rows below n hold hd values (checked by the caller).
                        Some(k) => unsafe { _mm_loadu_si128(k.as_ptr().add(c) as *const __m128i) },
                        None => _mm_setzero_si128(),
                    };
                    // SAFETY: c + 8 <= hd = row.len().
                    unsafe { _mm256_storeu_ps(row.as_mut_ptr().add(c), _mm256_cvtph_ps(h)) };
                }
            }
            for qi in (0..nq).filter(|&qi| cnt[qi] > b0) {
                let mut acc = [_mm256_setzero_ps(); BLOCK];
                // SAFETY: qd holds hd floats per query head, kb BLOCK rows of hd, scores
                // stride per head (b0 + 8 <= stride).
                unsafe {
                    let q = qd.as_ptr().add(qi * hd);
                    for c in (0..hd).step_by(8) {
                        let qc = _mm256_loadu_ps(q.add(c));
                        for (p, a) in acc.iter_mut().enumerate() {
                            let k = _mm256_loadu_ps(kb.as_ptr().add(p * hd + c));
                            *a = _mm256_fmadd_ps(qc, k, *a);
                        }
                    }
                    let s = _mm256_mul_ps(tree8(acc), vscale);
                    _mm256_storeu_ps(scores.as_mut_ptr().add(qi * stride + b0), s);
                }
            }
        }

        // Softmax per query head over its own keys: the max and exp per head, then the
        // f64 sums in key order of a token's heads side by side (each its own chain, so
        // their adds overlap), then the probabilities via f16.
        for (i, &c) in counts.iter().enumerate() {
            let rows = &mut scores[i * rep * stride..][..rep * stride];
            for row in rows.chunks_exact_mut(stride) {
                let row = &mut row[..c];
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                exps(row, max);
            }
            for rows in rows.chunks_mut(4 * stride) {
                let sums = match rows.len() / stride {
                    4 => sums::<4>(rows, stride, c),
                    3 => sums::<3>(rows, stride, c),
                    2 => sums::<2>(rows, stride, c),
                    _ => sums::<1>(rows, stride, c),
                };
                for (row, &sum) in rows.chunks_exact_mut(stride).zip(&sums) {
                    normalize(&mut row[..c], sum);
                }
            }
        }

        // Weighted sums, eight output lanes at a time for up to GROUP heads.
        let p: Vec<*const f32> = (0..nq).map(|qi| scores[qi * stride..].as_ptr()).collect();
        let mut q0 = 0;
        while q0 < nq {
            let g = (nq - q0).min(GROUP);
            for c in (0..hd).step_by(8) {
                let (o, v) = (&mut *outs, values);
                // SAFETY: every head's probabilities hold its count of floats, value rows
                // below n hold hd values, each token's output rep · hd (the caller's checks).
                unsafe {
                    match g {
                        8 => sums_group::<8>(o, rep, hd, c, q0, &p, &cnt, v),
                        7 => sums_group::<7>(o, rep, hd, c, q0, &p, &cnt, v),
                        6 => sums_group::<6>(o, rep, hd, c, q0, &p, &cnt, v),
                        5 => sums_group::<5>(o, rep, hd, c, q0, &p, &cnt, v),
                        4 => sums_group::<4>(o, rep, hd, c, q0, &p, &cnt, v),
                        3 => sums_group::<3>(o, rep, hd, c, q0, &p, &cnt, v),
                        2 => sums_group::<2>(o, rep, hd, c, q0, &p, &cnt, v),
                        _ => sums_group::<1>(o, rep, hd, c, q0, &p, &cnt, v),
                    }
                }
            }
            q0 += g;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::{EXP_HI, EXP_LO, EXP_TAYLOR, LN2_HI, LN2_LO, LOG2E, exp_f32};

    /// Keys and values converted from f16 at a time.
    const BLOCK: usize = 16;
    /// Query heads whose weighted sums share one load of each value chunk.
    const GROUP: usize = 8;

    /// [`exp_f32`] in 16 lanes (two halves of eight f64 lanes).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn exp16(x: __m512) -> __m512 {
        // max_ps returns its second operand when the first is NaN: NaN → EXP_LO, as
        // f32::max does.
        let x = _mm512_min_ps(
            _mm512_max_ps(x, _mm512_set1_ps(EXP_LO)),
            _mm512_set1_ps(EXP_HI),
        );
        let half = |x: __m256| {
            let x = _mm512_cvtps_pd(x);
            let n = _mm512_roundscale_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_pd(x, _mm512_set1_pd(LOG2E)),
            );
            let r = _mm512_fmadd_pd(n, _mm512_set1_pd(-LN2_HI), x);
            let r = _mm512_fmadd_pd(n, _mm512_set1_pd(-LN2_LO), r);
            let mut y = _mm512_set1_pd(EXP_TAYLOR[0]);
            for c in &EXP_TAYLOR[1..] {
                y = _mm512_fmadd_pd(y, r, _mm512_set1_pd(*c));
            }
            // scalef is exact here: n is an integer and the result a normal number.
            _mm512_cvtpd_ps(_mm512_scalef_pd(y, n))
        };
        let lo = half(_mm512_castps512_ps256(x));
        let hi = half(_mm256_castpd_ps(_mm512_extractf64x4_pd(
            _mm512_castps_pd(x),
            1,
        )));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
            _mm256_castps_pd(hi),
        ))
    }

    #[cfg(test)]
    pub(super) unsafe fn exp16_for_tests(x: __m512) -> __m512 {
        // SAFETY: the tests call this only where avx512f is present.
        unsafe { exp16(x) }
    }

    /// Eight registers of two keys' eight lanes each (keys 2p and 2p + 1 in register p)
    /// to the 16 keys' tree sums in key order: the tree's three levels are adjacent-lane
    /// sums across registers, left operand first, so each key's sum is its scalar tree.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tree16(a: [__m512; 8]) -> __m512 {
        let h = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_ps::<0x88>(x, y),
                _mm512_shuffle_ps::<0xDD>(x, y),
            )
        };
        let t = h(h(a[0], a[1]), h(a[2], a[3]));
        let u = h(h(a[4], a[5]), h(a[6], a[7]));
        let s = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(t, u),
            _mm512_shuffle_f32x4::<0xDD>(t, u),
        );
        // Lane L now holds key [0,2,4,6,1,3,5,7,8,10,12,14,9,11,13,15][L].
        _mm512_permutexvar_ps(
            _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15),
            s,
        )
    }

    /// `acc[g] += p[g][j] · v[j]` over `js`, for the 16 output lanes at `v` (value rows
    /// `hd` apart in the converted block, starting at key `j0`).
    #[inline(always)]
    unsafe fn weigh<const G: usize>(
        acc: &mut [__m512; G],
        p: [*const f32; G],
        v: *const f32,
        hd: usize,
        j0: usize,
        js: std::ops::Range<usize>,
    ) {
        // SAFETY: the caller guarantees rows js of the block and of every p.
        unsafe {
            for j in js {
                let vj = _mm512_loadu_ps(v.add((j - j0) * hd));
                for (a, p) in acc.iter_mut().zip(p) {
                    *a = _mm512_fmadd_ps(_mm512_set1_ps(*p.add(j)), vj, *a);
                }
            }
        }
    }

    /// The tiled form of [`super::attend_causal`], whose checks it relies on (and `hd` a
    /// multiple of 16).
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn attend_causal(
        qs: &[&[f32]],
        hd: usize,
        counts: &[usize],
        keys: &[&[f16]],
        values: &[&[f16]],
        scale: f32,
        outs: &mut [&mut [f32]],
    ) {
        let rep = qs[0].len() / hd;
        let nq = qs.len() * rep;
        let chunks = hd / 8;
        let n = counts.iter().copied().max().unwrap_or(0);
        let stride = n.next_multiple_of(BLOCK);
        let count = |qi: usize| counts[qi / rep];
        // Every query head rounded through f16, each chunk of eight in both halves of a
        // register: `qd[(qi · chunks + c) · 16 ..][..16]`.
        let mut qd = vec![0f32; nq * chunks * 16];
        for (i, q) in qs.iter().enumerate() {
            for (hq, &x) in q.iter().enumerate() {
                let (qi, d) = (i * rep + hq / hd, hq % hd);
                let at = (qi * chunks + d / 8) * 16 + d % 8;
                qd[at] = f16::from_f32(x).to_f32();
                qd[at + 8] = qd[at];
            }
        }

        // Scores, a block of 16 keys at a time for every query head that reaches it.
        let mut scores = vec![0f32; nq * stride];
        let mut kb = vec![0f32; BLOCK * hd];
        let vscale = _mm512_set1_ps(scale);
        for b0 in (0..n).step_by(BLOCK) {
            for p in 0..BLOCK / 2 {
                for c in 0..chunks {
                    let half = |j: usize| {
                        if j < n {
                            // SAFETY: key rows below n hold hd values (checked by the caller).
                            unsafe {
                                _mm_loadu_si128(keys[j].as_ptr().add(8 * c) as *const __m128i)
                            }
                        } else {
                            _mm_setzero_si128()
                        }
                    };
                    let both = _mm256_inserti128_si256::<1>(
                        _mm256_castsi128_si256(half(b0 + 2 * p)),
                        half(b0 + 2 * p + 1),
                    );
                    // SAFETY: (p · chunks + c) · 16 + 16 <= BLOCK · hd.
                    unsafe {
                        _mm512_storeu_ps(
                            kb.as_mut_ptr().add((p * chunks + c) * 16),
                            _mm512_cvtph_ps(both),
                        )
                    };
                }
            }
            for qi in (0..nq).filter(|&qi| count(qi) > b0) {
                let mut acc = [_mm512_setzero_ps(); BLOCK / 2];
                // SAFETY: qd holds chunks · 16 floats per query head, kb BLOCK / 2 pairs of
                // chunks · 16, scores stride per head (b0 + 16 <= stride).
                unsafe {
                    let q = qd.as_ptr().add(qi * chunks * 16);
                    for c in 0..chunks {
                        let qc = _mm512_loadu_ps(q.add(c * 16));
                        for (p, a) in acc.iter_mut().enumerate() {
                            let k = _mm512_loadu_ps(kb.as_ptr().add((p * chunks + c) * 16));
                            *a = _mm512_fmadd_ps(qc, k, *a);
                        }
                    }
                    let s = _mm512_mul_ps(tree16(acc), vscale);
                    _mm512_storeu_ps(scores.as_mut_ptr().add(qi * stride + b0), s);
                }
            }
        }

        // Softmax per query head over its own keys: the max, exp, the f64 sum in key order
        // (a token's heads side by side, each its own chain), the probabilities via f16.
        for i in 0..qs.len() {
            let c = counts[i];
            let full = c / 16 * 16;
            let mut sums = vec![0f64; rep];
            for r in 0..rep {
                let row = &mut scores[(i * rep + r) * stride..][..c];
                let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
                for j in (0..full).step_by(16) {
                    // SAFETY: j + 16 <= c = row.len(). max_ps keeps its second operand
                    // when the first is NaN, as f32::max does.
                    m = _mm512_max_ps(unsafe { _mm512_loadu_ps(row.as_ptr().add(j)) }, m);
                }
                let mut lanes = [0f32; 16];
                // SAFETY: lanes holds 16 floats.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), m) };
                let max = lanes
                    .iter()
                    .chain(&row[full..])
                    .fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                let vmax = _mm512_set1_ps(max);
                for j in (0..full).step_by(16) {
                    // SAFETY: as above.
                    unsafe {
                        let at = row.as_mut_ptr().add(j);
                        _mm512_storeu_ps(at, exp16(_mm512_sub_ps(_mm512_loadu_ps(at), vmax)));
                    }
                }
                for s in &mut row[full..] {
                    *s = exp_f32(*s - max);
                }
            }
            let heads = &scores[i * rep * stride..];
            for (r0, sums) in (0..rep).step_by(4).zip(sums.chunks_mut(4)) {
                for j in 0..c {
                    for (k, s) in sums.iter_mut().enumerate() {
                        *s += heads[(r0 + k) * stride + j] as f64;
                    }
                }
            }
            for (r, sum) in sums.into_iter().enumerate() {
                let inv = (1.0 / sum) as f32;
                let row = &mut scores[(i * rep + r) * stride..][..c];
                let vinv = _mm512_set1_ps(inv);
                for j in (0..full).step_by(16) {
                    // SAFETY: as above.
                    unsafe {
                        let at = row.as_mut_ptr().add(j);
                        let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                            _mm512_mul_ps(_mm512_loadu_ps(at), vinv),
                        );
                        _mm512_storeu_ps(at, _mm512_cvtph_ps(h));
                    }
                }
                for s in &mut row[full..] {
                    *s = f16::from_f32(*s * inv).to_f32();
                }
            }
        }

        // Weighted sums: per 16 output lanes, GROUP query heads at a time share each value
        // load over the keys they all reach; each head's remaining keys alone. Keys in
        // order for every lane.
        for o in outs.iter_mut() {
            o.fill(0.0);
        }
        let out_at = |qi: usize| (qi / rep, (qi % rep) * hd);
        let mut vb = vec![0f32; BLOCK * hd];
        for b0 in (0..n).step_by(BLOCK) {
            let b1 = (b0 + BLOCK).min(n);
            for (jb, v) in values[b0..b1].iter().enumerate() {
                for c in (0..hd).step_by(16) {
                    // SAFETY: value rows below n hold hd values; vb holds BLOCK rows of hd.
                    unsafe {
                        let h = _mm256_loadu_si256(v.as_ptr().add(c) as *const __m256i);
                        _mm512_storeu_ps(vb.as_mut_ptr().add(jb * hd + c), _mm512_cvtph_ps(h));
                    }
                }
            }
            let mut q0 = 0;
            while q0 < nq {
                let g = if nq - q0 >= GROUP { GROUP } else { 1 };
                let group = q0..q0 + g;
                q0 += g;
                let common = group.clone().map(count).min().unwrap_or(0).clamp(b0, b1);
                let p: Vec<*const f32> = group
                    .clone()
                    .map(|qi| scores[qi * stride..].as_ptr())
                    .collect();
                for c in (0..hd).step_by(16) {
                    let v = vb[c..].as_ptr();
                    // SAFETY: every head of the group reaches keys b0..common (rows of vb
                    // below b1 - b0 and of its probabilities below its count); each head's
                    // output holds rep · hd floats, c + 16 <= hd.
                    unsafe {
                        if g == GROUP {
                            let mut acc = [_mm512_setzero_ps(); GROUP];
                            for (a, qi) in acc.iter_mut().zip(group.clone()) {
                                let (t, h) = out_at(qi);
                                *a = _mm512_loadu_ps(outs[t].as_ptr().add(h + c));
                            }
                            let pp: [*const f32; GROUP] = std::array::from_fn(|k| p[k]);
                            weigh(&mut acc, pp, v, hd, b0, b0..common);
                            for (a, qi) in acc.iter().zip(group.clone()) {
                                let (t, h) = out_at(qi);
                                _mm512_storeu_ps(outs[t].as_mut_ptr().add(h + c), *a);
                            }
                        }
                        let tails = if g == GROUP { common } else { b0 };
                        for (k, qi) in group.clone().enumerate() {
                            let end = count(qi).clamp(b0, b1);
                            if end <= tails {
                                continue;
                            }
                            let (t, h) = out_at(qi);
                            let mut acc = [_mm512_loadu_ps(outs[t].as_ptr().add(h + c))];
                            weigh(&mut acc, [p[k]], v, hd, b0, tails..end);
                            _mm512_storeu_ps(outs[t].as_mut_ptr().add(h + c), acc[0]);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case() -> (Vec<f32>, Vec<Vec<f16>>, Vec<Vec<f16>>) {
        let (hd, n, rep) = (64, 37, 3);
        let q: Vec<f32> = (0..rep * hd)
            .map(|i| (i as f32 * 0.37).sin() * 2.0)
            .collect();
        let k = (0..n)
            .map(|j| {
                (0..hd)
                    .map(|d| f16::from_f32(((j * hd + d) as f32 * 0.11).cos()))
                    .collect()
            })
            .collect();
        let v = (0..n)
            .map(|j| {
                (0..hd)
                    .map(|d| f16::from_f32(((j + 2 * d) as f32 * 0.1).sin()))
                    .collect()
            })
            .collect();
        (q, k, v)
    }

    #[test]
    fn attends_like_the_textbook_formula() {
        let (q, k, v) = case();
        let hd = 64;
        let kr: Vec<&[f16]> = k.iter().map(Vec::as_slice).collect();
        let vr: Vec<&[f16]> = v.iter().map(Vec::as_slice).collect();
        let mut out = vec![0f32; q.len()];
        attend(&q, hd, &kr, &vr, 0.125, &mut out);
        for r in 0..q.len() / hd {
            let s: Vec<f64> = k
                .iter()
                .map(|kj| {
                    (0..hd)
                        .map(|d| q[r * hd + d] as f64 * kj[d].to_f64())
                        .sum::<f64>()
                        * 0.125
                })
                .collect();
            let m = s.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                let want: f64 = (0..k.len()).map(|j| e[j] / z * v[j][d].to_f64()).sum();
                assert!(
                    (out[r * hd + d] as f64 - want).abs() < 1e-2,
                    "head {r} dim {d}: {} vs {want}",
                    out[r * hd + d]
                );
            }
        }
    }

    /// The whole of `attend` on both paths, for head widths of one, eight and sixteen
    /// chunks, key counts around the pairs and head counts around the groups of four.
    #[test]
    fn attend_gives_the_same_bits_on_both_paths() {
        for hd in [8, 64, 128] {
            for (n, rep) in [1, 2, 3, 4, 5, 8, 37]
                .into_iter()
                .zip([3, 1, 5, 3, 4, 9, 3])
            {
                let q: Vec<f32> = (0..rep * hd)
                    .map(|i| (i as f32 * 0.29).sin() * 3.0)
                    .collect();
                let row = |j: usize, f: f32| -> Vec<f16> {
                    (0..hd)
                        .map(|d| f16::from_f32(((j * hd + d) as f32 * f).cos()))
                        .collect()
                };
                let k: Vec<Vec<f16>> = (0..n).map(|j| row(j, 0.07)).collect();
                let v: Vec<Vec<f16>> = (0..n).map(|j| row(j, 0.13)).collect();
                let kr: Vec<&[f16]> = k.iter().map(Vec::as_slice).collect();
                let vr: Vec<&[f16]> = v.iter().map(Vec::as_slice).collect();
                let mut got = vec![0f32; rep * hd];
                attend(&q, hd, &kr, &vr, 0.125, &mut got);
                let mut want = vec![0f32; rep * hd];
                attend_one(&q, hd, &kr, &vr, 0.125, &mut want);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "hd {hd} n {n}");
            }
        }
    }

    /// Every path available here, the scalar one first.
    fn paths(hd: usize) -> Vec<Path> {
        let mut p = vec![Path::Scalar];
        if cfg!(target_arch = "x86_64") && has_avx2() {
            p.push(Path::Avx2);
        }
        if cfg!(target_arch = "x86_64") && has_avx512() && hd.is_multiple_of(16) {
            p.push(Path::Avx512);
        }
        p
    }

    /// Tiles of query tokens at consecutive positions (each head of the group, its own
    /// key count) against each token alone on the scalar path: head widths of one to
    /// sixteen 16-lane chunks, key counts around the 8- and 16-key blocks, head counts
    /// around the 8-head groups of the weighted sum, extreme scores among them.
    #[test]
    fn a_tile_of_tokens_gives_each_token_the_bits_it_has_alone() {
        let row = |j: usize, hd: usize, f: f32, big: f32| -> Vec<f16> {
            (0..hd)
                .map(|d| f16::from_f32(((j * hd + d) as f32 * f).cos() * big))
                .collect()
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for hd in [8, 16, 24, 64, 128, 256] {
            for rep in [1, 3, 8, 9] {
                for (first, t) in [
                    (1, 1),
                    (1, 5),
                    (7, 2),
                    (8, 1),
                    (9, 9),
                    (15, 3),
                    (16, 1),
                    (17, 12),
                    (31, 20),
                    (60, 7),
                ] {
                    let n = first + t - 1;
                    // Large values in some keys give scores whose exp underflows.
                    let k: Vec<Vec<f16>> = (0..n)
                        .map(|j| row(j, hd, 0.07, if j % 7 == 3 { 60.0 } else { 1.0 }))
                        .collect();
                    let v: Vec<Vec<f16>> = (0..n).map(|j| row(j, hd, 0.13, 1.0)).collect();
                    let kr: Vec<&[f16]> = k.iter().map(Vec::as_slice).collect();
                    let vr: Vec<&[f16]> = v.iter().map(Vec::as_slice).collect();
                    let qs: Vec<Vec<f32>> = (0..t)
                        .map(|i| {
                            (0..rep * hd)
                                .map(|x| ((x + 31 * i) as f32 * 0.29).sin() * 3.0)
                                .collect()
                        })
                        .collect();
                    let counts: Vec<usize> = (0..t).map(|i| first + i).collect();
                    let want: Vec<Vec<f32>> = (0..t)
                        .map(|i| {
                            let mut o = vec![0f32; rep * hd];
                            let c = counts[i];
                            attend_one(&qs[i], hd, &kr[..c], &vr[..c], 0.125, &mut o);
                            o
                        })
                        .collect();
                    for path in paths(hd) {
                        let mut got = vec![vec![7f32; rep * hd]; t];
                        let qr: Vec<&[f32]> = qs.iter().map(Vec::as_slice).collect();
                        let mut outs: Vec<&mut [f32]> =
                            got.iter_mut().map(Vec::as_mut_slice).collect();
                        attend_causal_on(path, &qr, hd, &counts, &kr, &vr, 0.125, &mut outs);
                        for i in 0..t {
                            assert_eq!(
                                bits(&got[i]),
                                bits(&want[i]),
                                "{path:?} hd {hd} rep {rep} first {first} token {i}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn exp_is_within_one_ulp_and_the_same_bits_in_sixteen_lanes() {
        let mut xs: Vec<f32> = (0..200_000).map(|i| -90.0 + i as f32 * 0.00046).collect();
        xs.extend([
            0.0, -0.0, -1e-30, -87.0, -87.000_01, -86.999_99, 88.0, 100.0,
        ]);
        xs.extend([
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
        ]);
        for &x in &xs {
            let e = exp_f32(x);
            let c = (x as f64).clamp(EXP_LO as f64, EXP_HI as f64);
            let c = if x.is_nan() { EXP_LO as f64 } else { c };
            let want = c.exp() as f32;
            let ulps = (e.to_bits() as i64 - want.to_bits() as i64).abs();
            assert!(ulps <= 1, "exp({x}) = {e}, want {want} ({ulps} ulps)");
        }
        #[cfg(target_arch = "x86_64")]
        if has_avx512() {
            for c in xs.chunks(16) {
                let mut lanes = [0f32; 16];
                lanes[..c.len()].copy_from_slice(c);
                let mut got = [0f32; 16];
                // SAFETY: the CPU has avx512f (checked above), which implies the rest.
                unsafe {
                    use std::arch::x86_64::*;
                    let v = avx512::exp16_for_tests(_mm512_loadu_ps(lanes.as_ptr()));
                    _mm512_storeu_ps(got.as_mut_ptr(), v);
                }
                for (x, g) in lanes.iter().zip(got) {
                    assert_eq!(g.to_bits(), exp_f32(*x).to_bits(), "exp({x})");
                }
            }
        }
    }

    /// The AVX2 exp against the definition on the inputs above, and the AVX2 softmax
    /// against the scalar one for lengths around its groups of four and eight.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx2_exp_and_softmax_give_the_definitions_bits() {
        if !has_avx2() {
            return;
        }
        let mut xs: Vec<f32> = (0..200_000).map(|i| -90.0 + i as f32 * 0.00046).collect();
        xs.extend([
            0.0, -0.0, -1e-30, -87.0, -87.000_01, -86.999_99, 88.0, 100.0,
        ]);
        xs.extend([
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
        ]);
        for c in xs.chunks(4) {
            let mut lanes = [0f32; 4];
            lanes[..c.len()].copy_from_slice(c);
            let mut got = [0f32; 4];
            // SAFETY: the CPU has avx2, fma and f16c (has_avx2 checks all three).
            unsafe {
                use std::arch::x86_64::*;
                _mm_storeu_ps(got.as_mut_ptr(), avx2::exp4(_mm_loadu_ps(lanes.as_ptr())));
            }
            for (x, g) in lanes.iter().zip(got) {
                assert_eq!(g.to_bits(), exp_f32(*x).to_bits(), "exp({x})");
            }
        }
        let mut r = 7u64;
        for n in (1..=40).chain([127, 128, 129, 1000]) {
            let scores: Vec<f32> = (0..n)
                .map(|_| {
                    r = r.wrapping_mul(6364136223846793005).wrapping_add(1);
                    ((r >> 40) as f32 / (1u64 << 24) as f32) * 40.0 - 30.0
                })
                .collect();
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            let (mut a, mut b) = (scores.clone(), scores);
            // SAFETY: as above.
            unsafe { avx2::softmax(&mut a, max) };
            scalar_softmax(&mut b, max);
            assert_eq!(
                a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                b.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "softmax of {n} scores"
            );
        }
    }
}

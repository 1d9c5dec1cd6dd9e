//! The AVX2 path: a tile of query tokens at once, eight keys per block, exp four f64
//! lanes at a time.

use std::arch::x86_64::*;

use half::f16;

use super::Tile;

use super::exp::{EXP_HI, EXP_LO, EXP_TAYLOR, LN2_HI, LN2_LO, LOG2E, exp_f32};

/// [`exp_f32`] in four lanes, in f64 lanes as it computes: the same operations, fused
/// where it fuses, so the same bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn exp4(x: __m128) -> __m128 {
    // max_ps returns its second operand when the first is NaN: NaN → EXP_LO, as
    // f32::max does.
    let x = _mm_min_ps(_mm_max_ps(x, _mm_set1_ps(EXP_LO)), _mm_set1_ps(EXP_HI));
    let x = _mm256_cvtps_pd(x);
    let n = _mm256_round_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_pd(
        x,
        _mm256_set1_pd(LOG2E),
    ));
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

/// [`super::scalar::scalar_softmax`]'s operations, exp four lanes at a time and the f16
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
pub(super) unsafe fn attend_causal(tile: &Tile<'_>, outs: &mut [&mut [f32]]) {
    let (qs, hd, scale) = (tile.qs, tile.hd, tile.scale);
    let (starts, counts, keys, values) = (tile.starts, tile.counts, tile.keys, tile.values);
    let rep = qs[0].len() / hd;
    let nq = qs.len() * rep;
    let n = counts.iter().copied().max().unwrap_or(0);
    let stride = n.next_multiple_of(BLOCK);
    let cnt: Vec<usize> = (0..nq).map(|qi| counts[qi / rep]).collect();
    let first: Vec<usize> = (0..nq).map(|qi| starts[qi / rep]).collect();
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
        // A block wholly before a head's first key is not scored (it is masked below).
        for qi in (0..nq).filter(|&qi| cnt[qi] > b0 && first[qi] < b0 + BLOCK) {
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
        let s0 = starts[i];
        let rows = &mut scores[i * rep * stride..][..rep * stride];
        for row in rows.chunks_exact_mut(stride) {
            let row = &mut row[..c];
            // Keys before the token's first: no part in the max, probability zero.
            let max = row[s0..].iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            exps(row, max);
            row[..s0].fill(0.0);
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

//! The AVX-512 VNNI path: a weight block unpacked once and used for up to 32 tokens, two
//! tokens' eight lanes per 512-bit register.

use std::arch::x86_64::*;

use super::packed::{Packed, Q4_0, Q4_1, Q4K32, Q6K32, Q8_0, has_min, signed_bytes};
use super::simd::{PREFETCH_BYTES, TWO_ROWS_FROM, hsum, scales, simd_rows, unpack_block};

#[inline(always)]
unsafe fn unpack<const K: u8>(blk: *const u8) -> (__m256i, __m256i) {
    // SAFETY: forwarded from the caller.
    unsafe { unpack_block::<K>(blk) }
}

/// A token's eight lane sums with one `vpdpbusd` (u8 × i8 in groups of four, exact).
#[inline(always)]
unsafe fn dot<const K: u8>(qx: __m256i, wstart: __m256i, p: &Packed, at: usize) -> __m256i {
    // SAFETY: the caller guarantees block `at` exists in the packed arrays and enables
    // avx512vnni and avx512vl.
    unsafe {
        if signed_bytes(K) {
            _mm256_dpbusd_epi32(
                wstart,
                _mm256_loadu_si256(p.shifted.as_ptr().add(32 * at) as *const __m256i),
                qx,
            )
        } else if K == Q4_0 {
            _mm256_dpbusd_epi32(
                _mm256_loadu_si256(p.starts.as_ptr().add(8 * at) as *const __m256i),
                qx,
                _mm256_loadu_si256(p.qs.as_ptr().add(32 * at) as *const __m256i),
            )
        } else {
            _mm256_dpbusd_epi32(
                _mm256_setzero_si256(),
                qx,
                _mm256_loadu_si256(p.qs.as_ptr().add(32 * at) as *const __m256i),
            )
        }
    }
}

/// Tokens `j0 .. j0 + 2·P` of `R` rows, two tokens per 512-bit register: lanes 0..8
/// are the first token's eight lanes, 8..16 the second's, and every lane goes through
/// exactly the operations of the 256-bit tile (the weight block and its scales
/// broadcast to both halves, the two tokens' activations adjacent in `p`), so the
/// results are the same bits at half the instructions. The rows share each load of
/// the activations and their scales.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn pairs<const K: u8, const R: usize, const P: usize>(
    rows: [&[u8]; R],
    p: &Packed,
    j0: usize,
    o: &mut [&mut [f32]; R],
) {
    let bs = rows[0].len() / p.nb;
    let n = 2 * P;
    let sum_vectors = n.div_ceil(16);
    assert!(j0 + n <= p.t && sum_vectors <= 2);
    assert!(o.iter().all(|o| o.len() >= j0 + n) && rows.iter().all(|r| r.len() == bs * p.nb));
    assert!(!has_min(K) || j0 + 16 * sum_vectors <= p.tpad);
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    let mut ms = [[_mm512_setzero_ps(); 2]; R];
    for b in 0..p.nb {
        // SAFETY: block b lies in every row; the packed arrays hold nb blocks for every
        // token below p.t (tokens j0 + 2i and j0 + 2i + 1 side by side), and the sums
        // 16 · sum_vectors past j0 (asserted above).
        unsafe {
            let w: [_; R] = std::array::from_fn(|r| {
                let blk = rows[r].as_ptr().add(bs * b);
                let (dw, mw) = scales::<K>(blk);
                let (qx, wstart) = unpack::<K>(blk);
                (
                    if K == Q6K32 {
                        // Two scales: the 256-bit register in both halves.
                        _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(dw)))
                    } else {
                        _mm512_broadcastss_ps(_mm256_castps256_ps128(dw))
                    },
                    _mm512_broadcastss_ps(_mm256_castps256_ps128(mw)),
                    _mm512_broadcast_i64x4(qx),
                    _mm512_broadcast_i64x4(wstart),
                )
            });
            let first = b * p.t + j0;
            for i in 0..P {
                let at = first + 2 * i;
                let load = |v: *const i8| _mm512_loadu_si512(v.add(32 * at) as *const _);
                let a = if signed_bytes(K) {
                    load(p.shifted.as_ptr() as *const i8)
                } else {
                    load(p.qs.as_ptr())
                };
                let start = if K == Q4_0 {
                    _mm512_loadu_si512(p.starts.as_ptr().add(8 * at) as *const _)
                } else {
                    _mm512_setzero_si512()
                };
                let ds = _mm512_loadu_ps(p.ds.as_ptr().add(8 * at));
                for (acc, &(dw, _, qx, wstart)) in acc.iter_mut().zip(&w) {
                    let dot = if signed_bytes(K) {
                        _mm512_dpbusd_epi32(wstart, a, qx)
                    } else if K == Q4_0 {
                        _mm512_dpbusd_epi32(start, qx, a)
                    } else {
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), qx, a)
                    };
                    let d = _mm512_mul_ps(dw, ds);
                    acc[i] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(dot), acc[i]);
                }
            }
            if has_min(K) {
                for h in 0..sum_vectors {
                    let s = _mm512_loadu_ps(p.sums.as_ptr().add(b * p.tpad + j0 + 16 * h));
                    for (ms, &(_, mw, _, _)) in ms.iter_mut().zip(&w) {
                        ms[h] = _mm512_add_ps(ms[h], _mm512_mul_ps(mw, s));
                    }
                }
            }
        }
    }
    for ((acc, ms), o) in acc.iter().zip(&ms).zip(o.iter_mut()) {
        let mut mins = [0f32; 32];
        if has_min(K) {
            // SAFETY: `mins` holds 32 floats.
            unsafe {
                _mm512_storeu_ps(mins.as_mut_ptr(), ms[0]);
                _mm512_storeu_ps(mins.as_mut_ptr().add(16), ms[1]);
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            let halves = [
                _mm512_castps512_ps256(*acc),
                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(*acc), 1)),
            ];
            for (h, half) in halves.into_iter().enumerate() {
                let j = 2 * i + h;
                // SAFETY: this function enables avx2.
                let r = unsafe { hsum(half) };
                o[j0 + j] = if has_min(K) { r + mins[j] } else { r };
            }
        }
    }
}

/// Every pair of the rows' tokens through [`pairs`], widest first (32 tokens a call
/// for one row, 16 for two); returns how many tokens that covered (all but an odd
/// last one).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn wide<const K: u8, const R: usize>(
    rows: [&[u8]; R],
    p: &Packed,
    mut o: [&mut [f32]; R],
) -> usize {
    let t = p.t;
    let mut j = 0;
    // SAFETY: (every call) this function enables the features, and j + 2P <= t.
    unsafe {
        if R == 1 {
            while t - j >= 32 {
                pairs::<K, R, 16>(rows, p, j, &mut o);
                j += 32;
            }
        }
        while t - j >= 16 {
            pairs::<K, R, 8>(rows, p, j, &mut o);
            j += 16;
        }
        if t - j >= 8 {
            pairs::<K, R, 4>(rows, p, j, &mut o);
            j += 8;
        }
        if t - j >= 4 {
            pairs::<K, R, 2>(rows, p, j, &mut o);
            j += 4;
        }
        if t - j >= 2 {
            pairs::<K, R, 1>(rows, p, j, &mut o);
            j += 2;
        }
    }
    j
}

/// Every call goes through the tiles.
#[inline(always)]
unsafe fn few<const K: u8>(_: &[u8], _: usize, _: &Packed, _: &mut [&mut [f32]]) -> bool {
    false
}

/// One row times tokens `j0 .. j0 + RN` into `o[..RN]`; the min sums (Q4_1, Q4K32)
/// ride along, the tile's tokens side by side in two vectors.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn tile<const K: u8, const RN: usize>(row: &[u8], p: &Packed, j0: usize, o: &mut [f32]) {
    let bs = row.len() / p.nb;
    assert!(j0 + RN <= p.t && o.len() >= RN);
    assert!(!has_min(K) || j0 + 16 <= p.tpad);
    let mut acc = [_mm256_setzero_ps(); RN];
    let mut ms = [_mm256_setzero_ps(); 2];
    for b in 0..p.nb {
        // SAFETY: block b lies in `row`; the packed arrays hold nb blocks for every
        // token below p.t, and the sums 16 past j0 (asserted above).
        unsafe {
            let blk = row.as_ptr().add(bs * b);
            let (dw, mw) = scales::<K>(blk);
            let (qx, wstart) = unpack::<K>(blk);
            let first = b * p.t + j0;
            for (j, acc) in acc.iter_mut().enumerate() {
                let at = first + j;
                let dot = dot::<K>(qx, wstart, p, at);
                let d = _mm256_mul_ps(dw, _mm256_loadu_ps(p.ds.as_ptr().add(8 * at)));
                *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot), *acc);
            }
            if has_min(K) {
                for (h, ms) in ms.iter_mut().enumerate().take(RN.div_ceil(8)) {
                    let s = _mm256_loadu_ps(p.sums.as_ptr().add(b * p.tpad + j0 + 8 * h));
                    *ms = _mm256_add_ps(*ms, _mm256_mul_ps(mw, s));
                }
            }
        }
    }
    let mut mins = [0f32; 16];
    if has_min(K) {
        // SAFETY: `mins` holds 16 floats.
        unsafe {
            _mm256_storeu_ps(mins.as_mut_ptr(), ms[0]);
            _mm256_storeu_ps(mins.as_mut_ptr().add(8), ms[1]);
        }
    }
    for (j, acc) in acc.iter().enumerate() {
        // SAFETY: this function enables avx2.
        let r = unsafe { hsum(*acc) };
        o[j] = if has_min(K) { r + mins[j] } else { r };
    }
}

simd_rows!(
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    16,
    0,
    wide,
    few
);

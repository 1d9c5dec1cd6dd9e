//! The AVX2 path: 128-bit halves, tiles of four tokens, and two rows of one token per
//! pass below [`FEW_TOKENS`] tokens.

use std::arch::x86_64::*;

use super::packed::{
    Packed, Q4_0, Q4_1, Q4K32, Q6K32, Q8_0, f32_scales, has_min, signed_bytes, values_at,
};
use super::simd::{PREFETCH_BYTES, TWO_ROWS_FROM, simd_rows};

/// A weight block at `blk` as two 128-bit halves, values 0..16 and 16..32: unsigned
/// nibbles for Q4_0, Q4_1 and Q4K32, signed bytes for Q8_0 and Q6K32.
#[inline(always)]
unsafe fn halves<const K: u8>(blk: *const u8) -> (__m128i, __m128i) {
    // SAFETY: the caller guarantees one whole block at blk and enables avx2.
    unsafe {
        let at = blk.add(values_at(K));
        if signed_bytes(K) {
            (
                _mm_loadu_si128(at as *const __m128i),
                _mm_loadu_si128(at.add(16) as *const __m128i),
            )
        } else {
            let nib = _mm_loadu_si128(at as *const __m128i);
            let low = _mm_set1_epi8(0x0F);
            (
                _mm_and_si128(nib, low),
                _mm_and_si128(_mm_srli_epi16(nib, 4), low),
            )
        }
    }
}

/// A block's scales in lanes 0 and 1 (f16 → f32 is exact): the scale and the min with
/// f16 scales (Q4_1; lane 1 is unused for Q4_0 and Q8_0), the scale and the min for
/// Q4K32, the scales of values 0..16 and 16..32 for Q6K32.
#[inline(always)]
unsafe fn scale_pair<const K: u8>(blk: *const u8) -> __m128 {
    // SAFETY: the caller guarantees one whole block at blk (its scales are its first 8
    // bytes with f32 scales, 4 with f16 ones) and enables avx2 and f16c.
    unsafe {
        if f32_scales(K) {
            _mm_castpd_ps(_mm_load_sd(blk as *const f64))
        } else {
            let raw = (blk as *const u32).read_unaligned();
            _mm_cvtph_ps(_mm_cvtsi32_si128(raw as i32))
        }
    }
}

/// A token's eight exact lane sums, four per half (lanes 0..4 and 4..8), through
/// `maddubs` (no saturation: each pair of |u8 · i8| products stays below 2^15; signed
/// weights multiply |w| by the activation with w's sign), for weight halves `w` and block
/// `at` of the packed activations.
#[inline(always)]
unsafe fn dot_halves<const K: u8>(
    w: (__m128i, __m128i),
    p: &Packed,
    at: usize,
) -> (__m128i, __m128i) {
    // SAFETY: the caller guarantees block `at` exists in the packed arrays (with its
    // Q4_0 offsets when K is Q4_0) and enables avx2.
    unsafe {
        let ones = _mm_set1_epi16(1);
        let qa = p.qs.as_ptr().add(32 * at);
        let one = |w: __m128i, qa: *const i8| {
            let qa = _mm_loadu_si128(qa as *const __m128i);
            if signed_bytes(K) {
                _mm_madd_epi16(
                    _mm_maddubs_epi16(_mm_sign_epi8(w, w), _mm_sign_epi8(qa, w)),
                    ones,
                )
            } else {
                _mm_madd_epi16(_mm_maddubs_epi16(w, qa), ones)
            }
        };
        let (s0, s1) = (one(w.0, qa), one(w.1, qa.add(16)));
        if K == Q4_0 {
            let st = p.starts.as_ptr().add(8 * at);
            (
                _mm_add_epi32(s0, _mm_loadu_si128(st as *const __m128i)),
                _mm_add_epi32(s1, _mm_loadu_si128(st.add(4) as *const __m128i)),
            )
        } else {
            (s0, s1)
        }
    }
}

/// The module's tree over lanes `lo` (0..4) and `hi` (4..8): lanes i + 4 and i, then
/// (0 + 2) + (1 + 3), as `simd::hsum` does on one 256-bit register.
#[inline(always)]
unsafe fn tree(lo: __m128, hi: __m128) -> f32 {
    // SAFETY: only called from functions enabling avx2.
    unsafe {
        let x = _mm_add_ps(hi, lo);
        let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
    }
}

/// One row times tokens `j0 .. j0 + RN` into `o[..RN]`, on 128-bit halves (cores
/// that split 256-bit operations in two do no cross-half shuffles), with the tile's
/// scale products `dw · da` formed once for all its tokens in one register (two for
/// Q6K32, one per half; each rounded once, as the definition's per-lane product) and
/// handed to each token by a shuffle, not a multiply. The min sums (Q4_1, Q4K32) ride
/// along, the tile's tokens side by side.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const K: u8, const RN: usize>(row: &[u8], p: &Packed, j0: usize, o: &mut [f32]) {
    let bs = row.len() / p.nb;
    assert!(RN <= 4 && j0 + RN <= p.t && o.len() >= RN);
    assert!(!has_min(K) || j0 + 8 <= p.tpad);
    assert!(
        p.d1.len() >= p.nb * p.t + 4,
        "packed with its compact scales"
    );
    let mut lo = [_mm_setzero_ps(); RN];
    let mut hi = [_mm_setzero_ps(); RN];
    let mut ms = _mm256_setzero_ps();
    for b in 0..p.nb {
        // SAFETY: block b lies in `row`; the packed arrays hold nb blocks for every
        // token below p.t, the compact scales 4 past the last (asserted above), and
        // the sums 8 past j0.
        unsafe {
            let blk = row.as_ptr().add(bs * b);
            let dm = scale_pair::<K>(blk);
            let first = b * p.t + j0;
            let da = _mm_loadu_ps(p.d1.as_ptr().add(first));
            let dp = _mm_mul_ps(_mm_broadcastss_ps(dm), da);
            // The second half's products: Q6K32's second scale, the same elsewhere.
            let dp_hi = if K == Q6K32 {
                _mm_mul_ps(_mm_broadcastss_ps(_mm_movehdup_ps(dm)), da)
            } else {
                dp
            };
            let w = halves::<K>(blk);
            for k in 0..RN {
                let (s0, s1) = dot_halves::<K>(w, p, first + k);
                let token = |dp: __m128| match k {
                    0 => _mm_shuffle_ps::<0x00>(dp, dp),
                    1 => _mm_shuffle_ps::<0x55>(dp, dp),
                    2 => _mm_shuffle_ps::<0xAA>(dp, dp),
                    _ => _mm_shuffle_ps::<0xFF>(dp, dp),
                };
                lo[k] = _mm_fmadd_ps(token(dp), _mm_cvtepi32_ps(s0), lo[k]);
                hi[k] = _mm_fmadd_ps(token(dp_hi), _mm_cvtepi32_ps(s1), hi[k]);
            }
            if has_min(K) {
                let mw = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
                let s = _mm256_loadu_ps(p.sums.as_ptr().add(b * p.tpad + j0));
                ms = _mm256_add_ps(ms, _mm256_mul_ps(mw, s));
            }
        }
    }
    let mut mins = [0f32; 8];
    if has_min(K) {
        // SAFETY: `mins` holds 8 floats.
        unsafe { _mm256_storeu_ps(mins.as_mut_ptr(), ms) };
    }
    for k in 0..RN {
        // SAFETY: this function enables avx2.
        let r = unsafe { tree(lo[k], hi[k]) };
        o[k] = if has_min(K) { r + mins[k] } else { r };
    }
}

/// No wider registers here: every token goes through `tile`.
#[inline(always)]
unsafe fn wide<const K: u8, const R: usize>(
    _rows: [&[u8]; R],
    _p: &Packed,
    _o: [&mut [f32]; R],
) -> usize {
    0
}

/// `R` rows times token `j`: one accumulator chain per row, so the rows' blocks
/// overlap in the pipeline instead of each waiting on the previous block's fma (a
/// single token's row is otherwise one dependency chain, latency-bound). Each row's
/// operations are those of `tile::<K, 1>`, so its bits are too.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_one<const K: u8, const R: usize>(
    rows: [&[u8]; R],
    p: &Packed,
    j: usize,
) -> [f32; R] {
    let bs = rows[0].len() / p.nb;
    assert!(j < p.t && rows.iter().all(|r| r.len() == bs * p.nb));
    assert!(!has_min(K) || j < p.tpad);
    let mut lo = [_mm_setzero_ps(); R];
    let mut hi = [_mm_setzero_ps(); R];
    // The min sum (Q4_1, Q4K32), in lane 0.
    let mut ms = [_mm_setzero_ps(); R];
    for b in 0..p.nb {
        let at = b * p.t + j;
        // SAFETY: block b lies in every row; the packed arrays hold nb blocks for
        // every token below p.t, and the sums past j (asserted above).
        unsafe {
            // The scales as scalars: the product `dw · da` is rounded once whether
            // it is formed in one lane or in eight.
            let da = _mm_load_ss(p.d1.as_ptr().add(at));
            let s = if has_min(K) {
                _mm_load_ss(p.sums.as_ptr().add(b * p.tpad + j))
            } else {
                _mm_setzero_ps()
            };
            for r in 0..R {
                let blk = rows[r].as_ptr().add(bs * b);
                let dm = scale_pair::<K>(blk);
                let d = _mm_broadcastss_ps(_mm_mul_ss(dm, da));
                let d_hi = if K == Q6K32 {
                    _mm_broadcastss_ps(_mm_mul_ss(_mm_movehdup_ps(dm), da))
                } else {
                    d
                };
                let (s0, s1) = dot_halves::<K>(halves::<K>(blk), p, at);
                lo[r] = _mm_fmadd_ps(d, _mm_cvtepi32_ps(s0), lo[r]);
                hi[r] = _mm_fmadd_ps(d_hi, _mm_cvtepi32_ps(s1), hi[r]);
                if has_min(K) {
                    ms[r] = _mm_add_ss(ms[r], _mm_mul_ss(_mm_movehdup_ps(dm), s));
                }
            }
        }
    }
    std::array::from_fn(|r| {
        // SAFETY: this function enables avx2.
        let v = unsafe { tree(lo[r], hi[r]) };
        if has_min(K) {
            v + _mm_cvtss_f32(ms[r])
        } else {
            v
        }
    })
}

/// Fewer tokens than a tile: rows two at a time (two rows' four chains hide the
/// fma latency; more would spill the accumulators), each token through
/// [`rows_one`], the rows' bytes prefetched ahead as in `rows_k`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn few<const K: u8>(data: &[u8], rb: usize, p: &Packed, out: &mut [&mut [f32]]) -> bool {
    if p.t >= FEW_TOKENS {
        return false;
    }
    let nrows = data.len() / rb;
    let ahead = PREFETCH_BYTES.div_ceil(rb) * rb;
    let row = |r: usize| &data[r * rb..(r + 1) * rb];
    let mut r0 = 0;
    while r0 < nrows {
        let n = (nrows - r0).min(2);
        let next = r0 * rb + ahead;
        if next + n * rb <= data.len() {
            for off in (0..n * rb).step_by(64) {
                // SAFETY: in bounds of `data` (checked above); a prefetch only hints.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(data.as_ptr().add(next + off) as *const i8) };
            }
        }
        for (j, o) in out.iter_mut().enumerate() {
            // SAFETY: this function enables the features, and j < p.t.
            unsafe {
                if n == 2 {
                    let v = rows_one::<K, 2>([row(r0), row(r0 + 1)], p, j);
                    o[r0..r0 + 2].copy_from_slice(&v);
                } else {
                    o[r0] = rows_one::<K, 1>([row(r0)], p, j)[0];
                }
            }
        }
        r0 += n;
    }
    true
}

simd_rows!("avx2,fma,f16c", 4, TOKEN_GROUP, wide, few);

/// Tokens the AVX2 kernel takes through all of a task's rows before the next ones: 64
/// tokens of a 1536-wide input are 196 KiB of packed activations, which stay in a core's
/// L2 beside the task's weight rows.
const TOKEN_GROUP: usize = 64;

/// Below this many tokens the AVX2 kernel computes two rows of one token at a time
/// rather than tiles of tokens (a tile would be one dependency chain per row).
const FEW_TOKENS: usize = 4;

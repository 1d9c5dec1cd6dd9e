//! What both SIMD paths share: the row loop they are built from ([`simd_rows!`]) with
//! its tuning, and the VNNI path's 256-bit register helpers (AVX2 works on 128-bit halves
//! instead).

use std::arch::x86_64::*;

use super::packed::{Q4_1, Q6K32, f32_scales, signed_bytes, values_at};

/// The tree of the module docs over one vector's eight lanes.
#[inline(always)]
pub(super) unsafe fn hsum(x: __m256) -> f32 {
    // SAFETY: only called from functions enabling avx2.
    unsafe {
        let hi = _mm256_extractf128_ps(x, 1);
        let mut r = _mm_add_ps(hi, _mm256_castps256_ps128(x));
        r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        r = _mm_add_ss(r, _mm_movehdup_ps(r));
        _mm_cvtss_f32(r)
    }
}

/// A block's scale (for Q6K32 the first half's in lanes 0..4, the second's in 4..8), and
/// its min where it has one (Q4_1, Q4K32), each in all eight lanes (f16 → f32 is exact).
#[inline(always)]
pub(super) unsafe fn scales<const K: u8>(blk: *const u8) -> (__m256, __m256) {
    // SAFETY: the caller guarantees a whole block at blk (its scales are its first 8
    // bytes with f32 scales, 4 with f16 ones) and enables avx2 and f16c.
    unsafe {
        if f32_scales(K) {
            let f = blk as *const f32;
            let (first, second) = (f.read_unaligned(), f.add(1).read_unaligned());
            return if K == Q6K32 {
                let lo = _mm256_castps128_ps256(_mm_set1_ps(first));
                (
                    _mm256_insertf128_ps(lo, _mm_set1_ps(second), 1),
                    _mm256_setzero_ps(),
                )
            } else {
                (_mm256_set1_ps(first), _mm256_set1_ps(second))
            };
        }
        let raw = (blk as *const u32).read_unaligned();
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(raw as i32));
        let d = _mm256_broadcastss_ps(dm);
        let m = if K == Q4_1 {
            _mm256_broadcastss_ps(_mm_movehdup_ps(dm))
        } else {
            _mm256_setzero_ps()
        };
        (d, m)
    }
}

/// One weight block at `blk` in a register: unsigned nibbles in value order for Q4_0,
/// Q4_1 and Q4K32, signed bytes for Q8_0 and Q6K32; and for the signed bytes the lane
/// sums' start `−128 · Σ w` (their activations come shifted by 128; zero elsewhere).
#[inline(always)]
pub(super) unsafe fn unpack_block<const K: u8>(blk: *const u8) -> (__m256i, __m256i) {
    // SAFETY: the caller guarantees one whole block at blk and enables avx2,
    // avx512vnni and avx512vl.
    unsafe {
        if signed_bytes(K) {
            let qx = _mm256_loadu_si256(blk.add(values_at(K)) as *const __m256i);
            let w128 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(-128), qx);
            (qx, _mm256_sub_epi32(_mm256_setzero_si256(), w128))
        } else {
            let nib = _mm_loadu_si128(blk.add(values_at(K)) as *const __m128i);
            let both =
                _mm256_insertf128_si256(_mm256_castsi128_si256(nib), _mm_srli_epi16(nib, 4), 1);
            (
                _mm256_and_si256(both, _mm256_set1_epi8(0x0F)),
                _mm256_setzero_si256(),
            )
        }
    }
}

/// The fewest tokens for which rows are computed two at a time.
pub(super) const TWO_ROWS_FROM: usize = 16;

/// How far ahead of the row being computed its successors' bytes are prefetched.
pub(super) const PREFETCH_BYTES: usize = 2048;

/// One kernel body for both SIMD paths: the module's `tile::<K, RN>(row, p, j0, o)`
/// computes one row times `RN` tokens, `$tile` is the widest tile, `$group` how many
/// tokens go through every row before the next tokens do (0: all of them),
/// `$wide(row, p, o)` computes the row's first tokens some wider way and says how many
/// it did (the rest go through `tile`; only where the tokens are not grouped), and
/// `$few(data, rb, p, out)` may take a whole call of few tokens some other way (it says
/// whether it did).
macro_rules! simd_rows {
    ($features:literal, $tile_max:literal, $group:expr, $wide:ident, $few:ident) => {
        #[target_feature(enable = $features)]
        unsafe fn rows_k<const K: u8>(data: &[u8], rb: usize, p: &Packed, out: &mut [&mut [f32]]) {
            let t = p.t;
            // SAFETY: this function enables the features `$few` needs.
            if t == 0 || unsafe { $few::<K>(data, rb, p, out) } {
                return;
            }
            // Two rows' results for every token (one where a single row is left), then
            // stored into each token's slice.
            let mut o = vec![0f32; 2 * t];
            let ahead = PREFETCH_BYTES.div_ceil(rb) * rb;
            let nrows = data.len() / rb;
            // Token groups small enough that their activations stay in the core's cache
            // while every row of the task passes over them (a long prompt's activations
            // are megabytes). A token's result does not depend on its tile, so neither
            // on its group.
            let group = if $group == 0 { t } else { t.min($group) };
            for g0 in (0..t).step_by(group) {
                let g1 = t.min(g0 + group);
                let mut r0 = 0;
                while r0 < nrows {
                    // Two rows share each activation load where the batch is long enough
                    // that the activations, not the weights, are what is read most.
                    let n = if nrows - r0 >= 2 && t >= TWO_ROWS_FROM {
                        2
                    } else {
                        1
                    };
                    // Ask for the rows `ahead` bytes on before they are needed: the weights
                    // stream from memory once per product, and the hardware prefetcher stops
                    // at every page boundary.
                    let next = r0 * rb + ahead;
                    if next + n * rb <= data.len() {
                        for off in (0..n * rb).step_by(64) {
                            // SAFETY: in bounds of `data` (checked above); a prefetch only hints.
                            unsafe {
                                _mm_prefetch::<_MM_HINT_T0>(
                                    data.as_ptr().add(next + off) as *const i8
                                )
                            };
                        }
                    }
                    let row = |k: usize| &data[(r0 + k) * rb..(r0 + k + 1) * rb];
                    let (o0, o1) = o.split_at_mut(t);
                    let done = if group < t {
                        0
                    } else {
                        // SAFETY: (every call) this function enables the kernels' features,
                        // and j + RN <= t.
                        unsafe {
                            if n == 2 {
                                $wide::<K, 2>([row(0), row(1)], p, [o0, &mut o1[..]])
                            } else {
                                $wide::<K, 1>([row(0)], p, [o0])
                            }
                        }
                    };
                    for (k, o) in o.chunks_exact_mut(t).take(n).enumerate() {
                        let row = row(k);
                        let mut j = g0 + done;
                        // SAFETY: as above (j + RN <= g1 <= t).
                        unsafe {
                            while g1 - j >= $tile_max {
                                tile::<K, $tile_max>(row, p, j, &mut o[j..]);
                                j += $tile_max;
                            }
                            if $tile_max > 8 && g1 - j >= 8 {
                                tile::<K, 8>(row, p, j, &mut o[j..]);
                                j += 8;
                            }
                            if $tile_max > 4 && g1 - j >= 4 {
                                tile::<K, 4>(row, p, j, &mut o[j..]);
                                j += 4;
                            }
                            if g1 - j >= 2 {
                                tile::<K, 2>(row, p, j, &mut o[j..]);
                                j += 2;
                            }
                            if g1 - j >= 1 {
                                tile::<K, 1>(row, p, j, &mut o[j..]);
                            }
                        }
                        for (dst, v) in out[g0..g1].iter_mut().zip(&o[g0..g1]) {
                            dst[r0 + k] = *v;
                        }
                    }
                    r0 += n;
                }
            }
        }

        #[target_feature(enable = $features)]
        pub(super) unsafe fn rows(
            k: u8,
            data: &[u8],
            rb: usize,
            p: &Packed,
            out: &mut [&mut [f32]],
        ) {
            // SAFETY: the same features.
            unsafe {
                match k {
                    Q4_1 => rows_k::<Q4_1>(data, rb, p, out),
                    Q8_0 => rows_k::<Q8_0>(data, rb, p, out),
                    Q4K32 => rows_k::<Q4K32>(data, rb, p, out),
                    Q6K32 => rows_k::<Q6K32>(data, rb, p, out),
                    _ => rows_k::<Q4_0>(data, rb, p, out),
                }
            }
        }
    };
}

pub(super) use simd_rows;

//! Quantized weight rows × a batch of tokens' quantized activations: the integer GEMM
//! behind every Q4_0 / Q4_1 / Q8_0 matrix product.
//!
//! One order of operations defines every result, and all three paths (AVX-512 VNNI,
//! AVX2, scalar) perform exactly it, so they agree bit for bit, and a token's result
//! depends only on its row and its activations, never on the batch or the tile it landed
//! in. It is llama.cpp's x86 order for these formats (`ggml_vec_dot_q4_1_q8_1` and
//! friends), so results stay as close to llama.cpp's as a different attention allows. For
//! a row and a token:
//!
//! - 8 float lanes: lane `l` of block `b` covers the block's values `4l .. 4l + 4`;
//! - per block and lane: the exact integer sum of the lane's four weight × activation
//!   products (weights as signed values: Q4_0 nibble − 8, Q8_0 bytes; Q4_1 nibbles, whose
//!   min is added apart), then `acc[l] = fma(dw_b · da_b, sum, acc[l])`, the scale
//!   product rounded once in f32, blocks in order;
//! - the 8 lanes reduced by one fixed tree: `s[i + 4] + s[i]`, then `r[0] + r[2]` and
//!   `r[1] + r[3]`, then their sum;
//! - Q4_1 only: plus `Σ_b m_b · s_b` (weight min times the activations' scaled sum),
//!   each product rounded, then added block by block, starting from zero.
//!
//! The SIMD paths are register-blocked: a weight block is unpacked once into registers
//! and used for up to 32 tokens (AVX-512 VNNI: two tokens' eight lanes per 512-bit
//! register, 16 registers of accumulators; an odd last token in a 256-bit one) or 4
//! (AVX2), and the activations are laid out once per product so each token's block is
//! one load (two adjacent tokens' blocks, one 512-bit load). From [`TWO_ROWS_FROM`]
//! tokens on, VNNI computes two rows per pass, each activation load serving both.
//!
//! AVX2 works on 128-bit halves (lanes 0..4 and 4..8; cores that split 256-bit
//! operations in two then do no cross-half shuffles), forms a tile's scale products once
//! in one register, and below [`FEW_TOKENS`] tokens computes two rows of one token per
//! pass instead of tiles: a single token's row is one chain of dependent fmas, and two
//! rows' chains overlap.

use crate::QActs;
use crate::dot::{has_avx2, has_vnni};

/// Weight formats with an integer dot product against quantized activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IntKind {
    /// Q4_1 weights (20-byte blocks: d, m, 16 nibble bytes), Q8_1 activations.
    Q4_1,
    /// Q8_0 weights (34-byte blocks: d, 32 i8), Q8_0 activations.
    Q8_0,
    /// Q4_0 weights (18-byte blocks: d, 16 nibble bytes, offset 8), Q8_0 activations.
    Q4_0,
}

impl IntKind {
    fn block_bytes(self) -> usize {
        match self {
            IntKind::Q4_1 => 20,
            IntKind::Q8_0 => 34,
            IntKind::Q4_0 => 18,
        }
    }

    /// Const-generic tag of the SIMD kernels.
    fn tag(self) -> u8 {
        match self {
            IntKind::Q4_1 => Q4_1,
            IntKind::Q8_0 => Q8_0,
            IntKind::Q4_0 => Q4_0,
        }
    }
}

const Q4_1: u8 = 0;
const Q8_0: u8 = 1;
const Q4_0: u8 = 2;

/// The widest tile's tokens: the Q4_1 min sums are read this many at a time.
const SUM_LANES: usize = 16;

/// The fewest tokens for which rows are computed two at a time.
const TWO_ROWS_FROM: usize = 16;

/// Tokens the AVX2 kernel takes through all of a task's rows before the next ones: 64
/// tokens of a 1536-wide input are 196 KiB of packed activations, which stay in a core's
/// L2 beside the task's weight rows.
const TOKEN_GROUP: usize = 64;

/// Below this many tokens the AVX2 kernel computes two rows of one token at a time
/// rather than tiles of tokens (a tile would be one dependency chain per row).
const FEW_TOKENS: usize = 4;

/// How far ahead of the row being computed its successors' bytes are prefetched.
const PREFETCH_BYTES: usize = 2048;

/// A batch's activations laid out for the kernels once per matrix product, block-major
/// (`[block][token]`, so a tile's tokens sit side by side): per block and token the 32
/// values and the scale repeated in 8 lanes; for Q8_0 weights on the VNNI path the values
/// shifted to unsigned (`q + 128`, the operand `vpdpbusd` takes); for Q4_0 weights per lane
/// `−8 ·` the sum of its four values (the nibble offset); for Q4_1 weights the scaled sums
/// with tokens side by side, `sums[b · tpad + t]`.
pub(crate) struct Packed {
    t: usize,
    nb: usize,
    qs: Vec<i8>,
    ds: Vec<f32>,
    /// The scales once each, `d1[b · t + token]`, and four zeros past the last (the
    /// AVX2 tile reads four tokens' scales at a time).
    d1: Vec<f32>,
    shifted: Vec<u8>,
    starts: Vec<i32>,
    sums: Vec<f32>,
    tpad: usize,
}

impl Packed {
    /// `acts`: one token each, all of `nb` blocks. `kinds`: the weight formats this batch
    /// will meet (Q4_1 needs Q8_1 activations, the others Q8_0).
    pub(crate) fn new(acts: &[QActs], nb: usize, kinds: &[IntKind]) -> Self {
        let t = acts.len();
        // Room for a tile's full vectors past its last token.
        let tpad = t.div_ceil(SUM_LANES) * SUM_LANES + SUM_LANES;
        let mut p = Packed {
            t,
            nb,
            qs: vec![0; t * nb * 32],
            ds: vec![0.0; t * nb * 8],
            d1: vec![0.0; t * nb + 4],
            shifted: Vec::new(),
            starts: Vec::new(),
            sums: Vec::new(),
            tpad,
        };
        for (tt, a) in acts.iter().enumerate() {
            assert!(
                a.qs.len() >= nb * 32 && a.d.len() >= nb,
                "activations of {nb} blocks"
            );
            for b in 0..nb {
                let at = b * t + tt;
                p.qs[at * 32..at * 32 + 32].copy_from_slice(&a.qs[b * 32..b * 32 + 32]);
                p.ds[at * 8..at * 8 + 8].fill(a.d[b]);
                p.d1[at] = a.d[b];
            }
        }
        if kinds.contains(&IntKind::Q8_0) && has_vnni() {
            p.shifted = p.qs.iter().map(|&q| q as u8 ^ 0x80).collect();
        }
        if kinds.contains(&IntKind::Q4_0) {
            p.starts =
                p.qs.chunks_exact(4)
                    .map(|q| -8 * q.iter().map(|&v| i32::from(v)).sum::<i32>())
                    .collect();
        }
        if kinds.contains(&IntKind::Q4_1) {
            p.sums = vec![0.0; nb * tpad];
            for (tt, a) in acts.iter().enumerate() {
                assert!(a.s.len() >= nb, "Q4_1 needs Q8_1 activations");
                for b in 0..nb {
                    p.sums[b * tpad + tt] = a.s[b];
                }
            }
        }
        p
    }

    pub(crate) fn tokens(&self) -> usize {
        self.t
    }
}

/// Rows of `data` (`rb` bytes each) times every token of `p`: `out[token][row]`, one
/// slice per token, each as long as the rows (so a task writes its rows of every token's
/// output in place, with no transposing copy).
pub(crate) fn rows(kind: IntKind, data: &[u8], rb: usize, p: &Packed, out: &mut [&mut [f32]]) {
    let t = p.t;
    assert_eq!(rb, p.nb * kind.block_bytes(), "row width");
    assert_eq!(data.len() % rb, 0);
    assert_eq!(out.len(), t, "one output slice per token");
    for o in out.iter() {
        assert_eq!(o.len(), data.len() / rb, "an output slice holds every row");
    }
    match kind {
        IntKind::Q4_1 => assert_eq!(p.sums.len(), p.nb * p.tpad, "packed without sums"),
        IntKind::Q4_0 => assert_eq!(p.starts.len(), t * p.nb * 8, "packed without offsets"),
        IntKind::Q8_0 => {}
    }
    #[cfg(target_arch = "x86_64")]
    if has_vnni() {
        if kind == IntKind::Q8_0 {
            assert_eq!(p.shifted.len(), p.qs.len(), "packed for another path");
        }
        // SAFETY: the CPU has every feature these functions enable; every length they
        // index by was asserted above.
        unsafe { avx512::rows(kind.tag(), data, rb, p, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as above.
        unsafe { avx2::rows(kind.tag(), data, rb, p, out) };
        return;
    }
    scalar_rows(kind, data, rb, p, out);
}

#[inline]
fn f16le(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The 8-lane tree every path ends with.
fn tree8(acc: &[f32; 8]) -> f32 {
    let r: [f32; 4] = std::array::from_fn(|i| acc[i + 4] + acc[i]);
    (r[0] + r[2]) + (r[1] + r[3])
}

/// Weight value `j` of block `blk` as a signed integer (Q4_1 without its min).
fn weight(kind: IntKind, blk: &[u8], j: usize) -> i32 {
    let nib = |off: usize| {
        let byte = blk[off + j % 16];
        i32::from(if j < 16 { byte & 0xF } else { byte >> 4 })
    };
    match kind {
        IntKind::Q4_1 => nib(4),
        IntKind::Q4_0 => nib(2) - 8,
        IntKind::Q8_0 => i32::from(blk[2 + j] as i8),
    }
}

/// The definition, one (row, token) at a time.
pub(crate) fn scalar_one(kind: IntKind, row: &[u8], p: &Packed, tt: usize) -> f32 {
    let bs = kind.block_bytes();
    let mut acc = [0f32; 8];
    for b in 0..p.nb {
        let blk = &row[b * bs..(b + 1) * bs];
        let at = b * p.t + tt;
        let d = f16le(blk, 0) * p.ds[at * 8];
        for (l, a) in acc.iter_mut().enumerate() {
            let isum: i32 = (4 * l..4 * l + 4)
                .map(|j| weight(kind, blk, j) * i32::from(p.qs[at * 32 + j]))
                .sum();
            *a = d.mul_add(isum as f32, *a);
        }
    }
    let mut r = tree8(&acc);
    if kind == IntKind::Q4_1 {
        let mut ms = 0f32;
        for b in 0..p.nb {
            ms += f16le(&row[b * bs..], 2) * p.sums[b * p.tpad + tt];
        }
        r += ms;
    }
    r
}

fn scalar_rows(kind: IntKind, data: &[u8], rb: usize, p: &Packed, out: &mut [&mut [f32]]) {
    for (ri, row) in data.chunks_exact(rb).enumerate() {
        for (tt, o) in out.iter_mut().enumerate() {
            o[ri] = scalar_one(kind, row, p, tt);
        }
    }
}

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
                    // SAFETY (every call): this function enables the kernels' features, and
                    // j + RN <= t.
                    let done = if group < t {
                        0
                    } else {
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
                    _ => rows_k::<Q4_0>(data, rb, p, out),
                }
            }
        }
    };
}

/// The VNNI path's 256-bit register helpers (AVX2 works on 128-bit halves instead).
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{Q4_1, Q8_0};

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

    /// A block's scale, and for Q4_1 its min, each in all eight lanes (f16 → f32 is exact).
    #[inline(always)]
    pub(super) unsafe fn scales<const K: u8>(blk: *const u8) -> (__m256, __m256) {
        // SAFETY: the caller guarantees a whole block at blk (at least 18 bytes) and
        // enables avx2 and f16c.
        unsafe {
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

    /// One weight block at `blk` in a register: unsigned nibbles in value order for Q4_0
    /// and Q4_1, signed bytes for Q8_0; and for Q8_0 the lane sums' start `−128 · Σ w`
    /// (its activations come shifted by 128; zero elsewhere).
    #[inline(always)]
    pub(super) unsafe fn unpack_block<const K: u8>(blk: *const u8) -> (__m256i, __m256i) {
        // SAFETY: the caller guarantees one whole block at blk and enables avx2,
        // avx512vnni and avx512vl.
        unsafe {
            if K == Q8_0 {
                let qx = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                let w128 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(-128), qx);
                (qx, _mm256_sub_epi32(_mm256_setzero_si256(), w128))
            } else {
                let off = if K == Q4_1 { 4 } else { 2 };
                let nib = _mm_loadu_si128(blk.add(off) as *const __m128i);
                let both =
                    _mm256_insertf128_si256(_mm256_castsi128_si256(nib), _mm_srli_epi16(nib, 4), 1);
                (
                    _mm256_and_si256(both, _mm256_set1_epi8(0x0F)),
                    _mm256_setzero_si256(),
                )
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::simd::{hsum, scales, unpack_block};
    use super::{PREFETCH_BYTES, Packed, Q4_0, Q4_1, Q8_0, TWO_ROWS_FROM};

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
            match K {
                Q4_1 => _mm256_dpbusd_epi32(
                    _mm256_setzero_si256(),
                    qx,
                    _mm256_loadu_si256(p.qs.as_ptr().add(32 * at) as *const __m256i),
                ),
                Q8_0 => _mm256_dpbusd_epi32(
                    wstart,
                    _mm256_loadu_si256(p.shifted.as_ptr().add(32 * at) as *const __m256i),
                    qx,
                ),
                _ => _mm256_dpbusd_epi32(
                    _mm256_loadu_si256(p.starts.as_ptr().add(8 * at) as *const __m256i),
                    qx,
                    _mm256_loadu_si256(p.qs.as_ptr().add(32 * at) as *const __m256i),
                ),
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
        assert!(K != Q4_1 || j0 + 16 * sum_vectors <= p.tpad);
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
                        _mm512_broadcastss_ps(_mm256_castps256_ps128(dw)),
                        _mm512_broadcastss_ps(_mm256_castps256_ps128(mw)),
                        _mm512_broadcast_i64x4(qx),
                        _mm512_broadcast_i64x4(wstart),
                    )
                });
                let first = b * p.t + j0;
                for i in 0..P {
                    let at = first + 2 * i;
                    let load = |v: *const i8| _mm512_loadu_si512(v.add(32 * at) as *const _);
                    let a = match K {
                        Q8_0 => load(p.shifted.as_ptr() as *const i8),
                        _ => load(p.qs.as_ptr()),
                    };
                    let start = if K == Q4_0 {
                        _mm512_loadu_si512(p.starts.as_ptr().add(8 * at) as *const _)
                    } else {
                        _mm512_setzero_si512()
                    };
                    let ds = _mm512_loadu_ps(p.ds.as_ptr().add(8 * at));
                    for (acc, &(dw, _, qx, wstart)) in acc.iter_mut().zip(&w) {
                        let dot = match K {
                            Q4_1 => _mm512_dpbusd_epi32(_mm512_setzero_si512(), qx, a),
                            Q8_0 => _mm512_dpbusd_epi32(wstart, a, qx),
                            _ => _mm512_dpbusd_epi32(start, qx, a),
                        };
                        let d = _mm512_mul_ps(dw, ds);
                        acc[i] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(dot), acc[i]);
                    }
                }
                if K == Q4_1 {
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
            if K == Q4_1 {
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
                    o[j0 + j] = if K == Q4_1 { r + mins[j] } else { r };
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
        // SAFETY (every call): this function enables the features, and j + 2P <= t.
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

    /// One row times tokens `j0 .. j0 + RN` into `o[..RN]`; Q4_1's min sums ride
    /// along, the tile's tokens side by side in two vectors.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn tile<const K: u8, const RN: usize>(row: &[u8], p: &Packed, j0: usize, o: &mut [f32]) {
        let bs = row.len() / p.nb;
        assert!(j0 + RN <= p.t && o.len() >= RN);
        assert!(K != Q4_1 || j0 + 16 <= p.tpad);
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
                if K == Q4_1 {
                    for (h, ms) in ms.iter_mut().enumerate().take(RN.div_ceil(8)) {
                        let s = _mm256_loadu_ps(p.sums.as_ptr().add(b * p.tpad + j0 + 8 * h));
                        *ms = _mm256_add_ps(*ms, _mm256_mul_ps(mw, s));
                    }
                }
            }
        }
        let mut mins = [0f32; 16];
        if K == Q4_1 {
            // SAFETY: `mins` holds 16 floats.
            unsafe {
                _mm256_storeu_ps(mins.as_mut_ptr(), ms[0]);
                _mm256_storeu_ps(mins.as_mut_ptr().add(8), ms[1]);
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            // SAFETY: this function enables avx2.
            let r = unsafe { hsum(*acc) };
            o[j] = if K == Q4_1 { r + mins[j] } else { r };
        }
    }

    simd_rows!(
        "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
        16,
        0,
        wide,
        few
    );
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{FEW_TOKENS, PREFETCH_BYTES, Packed, Q4_0, Q4_1, Q8_0, TOKEN_GROUP, TWO_ROWS_FROM};

    /// A weight block at `blk` as two 128-bit halves, values 0..16 and 16..32: unsigned
    /// nibbles for Q4_0 and Q4_1, signed bytes for Q8_0.
    #[inline(always)]
    unsafe fn halves<const K: u8>(blk: *const u8) -> (__m128i, __m128i) {
        // SAFETY: the caller guarantees one whole block at blk and enables avx2.
        unsafe {
            if K == Q8_0 {
                (
                    _mm_loadu_si128(blk.add(2) as *const __m128i),
                    _mm_loadu_si128(blk.add(18) as *const __m128i),
                )
            } else {
                let off = if K == Q4_1 { 4 } else { 2 };
                let nib = _mm_loadu_si128(blk.add(off) as *const __m128i);
                let low = _mm_set1_epi8(0x0F);
                (
                    _mm_and_si128(nib, low),
                    _mm_and_si128(_mm_srli_epi16(nib, 4), low),
                )
            }
        }
    }

    /// A token's eight exact lane sums, four per half (lanes 0..4 and 4..8), through
    /// `maddubs` (no saturation: each pair of |u8 · i8| products stays below 2^15; Q8_0
    /// multiplies |w| by the activation with w's sign), for weight halves `w` and block
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
                if K == Q8_0 {
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
    /// scale products `dw · da` formed once for all its tokens in one register (each
    /// rounded once, as the definition's per-lane product) and handed to each token by a
    /// shuffle, not a multiply. Q4_1's min sums ride along, the tile's tokens side by
    /// side.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const K: u8, const RN: usize>(row: &[u8], p: &Packed, j0: usize, o: &mut [f32]) {
        let bs = row.len() / p.nb;
        assert!(RN <= 4 && j0 + RN <= p.t && o.len() >= RN);
        assert!(K != Q4_1 || j0 + 8 <= p.tpad);
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
                let raw = (blk as *const u32).read_unaligned();
                // d (and Q4_1's m) in lanes 0 (and 1), f16 → f32 exact.
                let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(raw as i32));
                let first = b * p.t + j0;
                let dp = _mm_mul_ps(
                    _mm_broadcastss_ps(dm),
                    _mm_loadu_ps(p.d1.as_ptr().add(first)),
                );
                let w = halves::<K>(blk);
                for k in 0..RN {
                    let (s0, s1) = dot_halves::<K>(w, p, first + k);
                    let d = match k {
                        0 => _mm_shuffle_ps::<0x00>(dp, dp),
                        1 => _mm_shuffle_ps::<0x55>(dp, dp),
                        2 => _mm_shuffle_ps::<0xAA>(dp, dp),
                        _ => _mm_shuffle_ps::<0xFF>(dp, dp),
                    };
                    lo[k] = _mm_fmadd_ps(d, _mm_cvtepi32_ps(s0), lo[k]);
                    hi[k] = _mm_fmadd_ps(d, _mm_cvtepi32_ps(s1), hi[k]);
                }
                if K == Q4_1 {
                    let mw = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
                    let s = _mm256_loadu_ps(p.sums.as_ptr().add(b * p.tpad + j0));
                    ms = _mm256_add_ps(ms, _mm256_mul_ps(mw, s));
                }
            }
        }
        let mut mins = [0f32; 8];
        if K == Q4_1 {
            // SAFETY: `mins` holds 8 floats.
            unsafe { _mm256_storeu_ps(mins.as_mut_ptr(), ms) };
        }
        for k in 0..RN {
            // SAFETY: this function enables avx2.
            let r = unsafe { tree(lo[k], hi[k]) };
            o[k] = if K == Q4_1 { r + mins[k] } else { r };
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
        assert!(K != Q4_1 || j < p.tpad);
        let mut lo = [_mm_setzero_ps(); R];
        let mut hi = [_mm_setzero_ps(); R];
        // Q4_1's min sum, in lane 0.
        let mut ms = [_mm_setzero_ps(); R];
        for b in 0..p.nb {
            let at = b * p.t + j;
            // SAFETY: block b lies in every row; the packed arrays hold nb blocks for
            // every token below p.t, and the sums past j (asserted above).
            unsafe {
                // The scales as scalars: the product `dw · da` is rounded once whether
                // it is formed in one lane or in eight.
                let da = _mm_load_ss(p.d1.as_ptr().add(at));
                let s = if K == Q4_1 {
                    _mm_load_ss(p.sums.as_ptr().add(b * p.tpad + j))
                } else {
                    _mm_setzero_ps()
                };
                for r in 0..R {
                    let blk = rows[r].as_ptr().add(bs * b);
                    // d (and Q4_1's m) in lanes 0 (and 1), f16 → f32 exact.
                    let raw = (blk as *const u32).read_unaligned();
                    let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(raw as i32));
                    let d = _mm_broadcastss_ps(_mm_mul_ss(dm, da));
                    let (s0, s1) = dot_halves::<K>(halves::<K>(blk), p, at);
                    lo[r] = _mm_fmadd_ps(d, _mm_cvtepi32_ps(s0), lo[r]);
                    hi[r] = _mm_fmadd_ps(d, _mm_cvtepi32_ps(s1), hi[r]);
                    if K == Q4_1 {
                        ms[r] = _mm_add_ss(ms[r], _mm_mul_ss(_mm_movehdup_ps(dm), s));
                    }
                }
            }
        }
        std::array::from_fn(|r| {
            // SAFETY: this function enables avx2.
            let v = unsafe { tree(lo[r], hi[r]) };
            if K == Q4_1 {
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
                    unsafe {
                        _mm_prefetch::<_MM_HINT_T0>(data.as_ptr().add(next + off) as *const i8)
                    };
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
}

#[cfg(test)]
mod tests {
    use half::f16;
    use pdmesh_ggml::{GgmlType, dequantize};

    use super::*;
    use crate::{quantize_q8_0, quantize_q8_1};

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
        let mut p: Vec<(&'static str, RowsFn)> =
            vec![("scalar", scalar_rows), ("dispatched", rows)];
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
}

//! Block dot products of one quantized weight row with N tokens' quantized activations.
//! Each token's accumulation runs the same instruction sequence whatever N is, so a
//! token's result never depends on what it was batched with.

use std::sync::OnceLock;

use half::f16;

use crate::QActs;

/// AVX-512 VNNI (with VL) for the integer dot products. Integer sums are exact on both
/// paths, so this changes speed, never results.
pub(crate) fn has_vnni() -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    *VNNI.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            has_avx2()
                && std::env::var("PDMESH_KERNELS").as_deref() != Ok("avx2")
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512vnni")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

pub(crate) fn has_avx2() -> bool {
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::env::var("PDMESH_KERNELS").as_deref() != Ok("scalar")
                && std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

#[inline]
fn f16le(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Q4_1 weights (20-byte blocks: d, m, 16 nibble bytes) · Q8_1 activations.
pub(crate) fn q4_1_q8_1<const N: usize>(row: &[u8], acts: [&QActs; N]) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    if has_vnni() {
        // SAFETY: the CPU supports every feature the function enables (checked above);
        // slice lengths are asserted inside.
        return unsafe { avx2::q4_1_q8_1_vnni(row, acts) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports avx2, fma and f16c (checked above); slice lengths are
        // asserted inside.
        return unsafe { avx2::q4_1_q8_1(row, acts) };
    }
    let mut out = [0f32; N];
    for (t, a) in acts.iter().enumerate() {
        let mut sum = 0f32;
        for (b, blk) in row.chunks_exact(20).enumerate() {
            let (d, m) = (f16le(blk, 0), f16le(blk, 2));
            let q = &a.qs[32 * b..32 * b + 32];
            let mut isum = 0i32;
            for j in 0..16 {
                isum += (blk[4 + j] & 0xF) as i32 * q[j] as i32
                    + (blk[4 + j] >> 4) as i32 * q[j + 16] as i32;
            }
            sum += d * a.d[b] * isum as f32 + m * a.s[b];
        }
        out[t] = sum;
    }
    out
}

/// Q8_0 weights (34-byte blocks: d, 32 i8) · Q8_0 activations.
pub(crate) fn q8_0_q8_0<const N: usize>(row: &[u8], acts: [&QActs; N]) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    if has_vnni() {
        // SAFETY: as above.
        return unsafe { avx2::q8_0_q8_0_vnni(row, acts) };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as above.
        return unsafe { avx2::q8_0_q8_0(row, acts) };
    }
    let mut out = [0f32; N];
    for (t, a) in acts.iter().enumerate() {
        let mut sum = 0f32;
        for (b, blk) in row.chunks_exact(34).enumerate() {
            let d = f16le(blk, 0);
            let q = &a.qs[32 * b..32 * b + 32];
            let isum: i32 = (0..32).map(|j| blk[2 + j] as i8 as i32 * q[j] as i32).sum();
            sum += d * a.d[b] * isum as f32;
        }
        out[t] = sum;
    }
    out
}

/// Q4_0 weights (18-byte blocks: d, 16 nibble bytes, offset 8) · Q8_0 activations.
pub(crate) fn q4_0_q8_0<const N: usize>(row: &[u8], acts: [&QActs; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for (t, a) in acts.iter().enumerate() {
        let mut sum = 0f32;
        for (b, blk) in row.chunks_exact(18).enumerate() {
            let d = f16le(blk, 0);
            let q = &a.qs[32 * b..32 * b + 32];
            let mut isum = 0i32;
            for j in 0..16 {
                isum += ((blk[2 + j] & 0xF) as i32 - 8) * q[j] as i32
                    + ((blk[2 + j] >> 4) as i32 - 8) * q[j + 16] as i32;
            }
            sum += d * a.d[b] * isum as f32;
        }
        out[t] = sum;
    }
    out
}

/// Weight formats with an integer dot product against quantized activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IntKind {
    /// Q4_1 weights, Q8_1 activations.
    Q4_1,
    /// Q8_0 weights, Q8_0 activations.
    Q8_0,
    /// Q4_0 weights, Q8_0 activations.
    Q4_0,
}

/// A row times N tokens.
type RowFn<const N: usize> = fn(&[u8], [&QActs; N]) -> [f32; N];

/// Rows of `data` (`rb` bytes each) times every token's activations; `out` is
/// rows × tokens, row-major. Each (row, token) result equals the per-row functions'.
pub(crate) fn rows(kind: IntKind, data: &[u8], rb: usize, acts: &[QActs], out: &mut [f32]) {
    assert_eq!(out.len(), data.len() / rb * acts.len());
    #[cfg(target_arch = "x86_64")]
    if has_vnni() && kind != IntKind::Q4_0 {
        // SAFETY: the CPU has every feature these functions enable; lengths asserted inside.
        unsafe { avx2::rows_vnni(kind, data, rb, acts, out) }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && kind != IntKind::Q4_0 {
        // SAFETY: as above.
        unsafe {
            match kind {
                IntKind::Q4_1 => avx2::q4_1_rows(data, rb, acts, out),
                _ => avx2::q8_0_rows(data, rb, acts, out),
            }
        }
        return;
    }
    let t = acts.len();
    let n4 = t / 4 * 4;
    for (row, o) in data.chunks_exact(rb).zip(out.chunks_exact_mut(t)) {
        let (four, one): (RowFn<4>, RowFn<1>) = match kind {
            IntKind::Q4_1 => (q4_1_q8_1::<4>, q4_1_q8_1::<1>),
            IntKind::Q8_0 => (q8_0_q8_0::<4>, q8_0_q8_0::<1>),
            IntKind::Q4_0 => (q4_0_q8_0::<4>, q4_0_q8_0::<1>),
        };
        for g in (0..n4).step_by(4) {
            o[g..g + 4].copy_from_slice(&four(
                row,
                [&acts[g], &acts[g + 1], &acts[g + 2], &acts[g + 3]],
            ));
        }
        for tt in n4..t {
            o[tt] = one(row, [&acts[tt]])[0];
        }
    }
}

/// Plain f32 dot product in a fixed (sequential) order.
pub(crate) fn f32_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let n8 = a.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        for l in 0..8 {
            lanes[l] += a[i + l] * b[i + l];
        }
    }
    let mut s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for i in n8..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::IntKind;
    use crate::QActs;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(x: __m256) -> f32 {
        let hi = _mm256_extractf128_ps(x, 1);
        let mut r = _mm_add_ps(hi, _mm256_castps256_ps128(x));
        r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        r = _mm_add_ss(r, _mm_movehdup_ps(r));
        _mm_cvtss_f32(r)
    }

    /// Two consecutive f16 values at `p` as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16x2(p: *const u8) -> (f32, f32) {
        // SAFETY: the caller guarantees 4 readable bytes at p.
        let raw = unsafe { (p as *const u32).read_unaligned() };
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(raw as i32));
        let mut o = [0f32; 4];
        // SAFETY: o has room for 4 floats.
        unsafe { _mm_storeu_ps(o.as_mut_ptr(), v) };
        (o[0], o[1])
    }

    /// Q4_1 · Q8_1 for N tokens: each weight block is unpacked once and dotted with every
    /// token's block; per token the float work is one scale, one FMA and the min term.
    macro_rules! q4_1_kernel {
        ($name:ident, $features:literal, $dot:ident) => {
            #[inline]
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name<const N: usize>(row: &[u8], acts: [&QActs; N]) -> [f32; N] {
                let nb = row.len() / 20;
                for a in &acts {
                    assert!(a.qs.len() >= nb * 32 && a.d.len() >= nb && a.s.len() >= nb);
                }
                let lowmask = _mm256_set1_epi8(0x0F);
                let mut acc = [_mm256_setzero_ps(); N];
                let mut summs = [0f32; N];
                for b in 0..nb {
                    // SAFETY: block b lies within `row`; activations checked above.
                    unsafe {
                        let blk = row.as_ptr().add(20 * b);
                        let (dw, mw) = f16x2(blk);
                        let tmp = _mm_loadu_si128(blk.add(4) as *const __m128i);
                        let bytes = _mm256_insertf128_si256(
                            _mm256_castsi128_si256(tmp),
                            _mm_srli_epi16(tmp, 4),
                            1,
                        );
                        let qx = _mm256_and_si256(lowmask, bytes);
                        for t in 0..N {
                            let a = acts[t];
                            let qy =
                                _mm256_loadu_si256(a.qs.as_ptr().add(32 * b) as *const __m256i);
                            let xy = _mm256_cvtepi32_ps($dot(qx, qy));
                            let d = _mm256_set1_ps(dw * *a.d.get_unchecked(b));
                            acc[t] = _mm256_fmadd_ps(d, xy, acc[t]);
                            summs[t] += mw * *a.s.get_unchecked(b);
                        }
                    }
                }
                let mut out = [0f32; N];
                for t in 0..N {
                    out[t] = hsum(acc[t]) + summs[t];
                }
                out
            }
        };
    }

    /// Q8_0 · Q8_0 for N tokens, in the same shape as the Q4_1 kernel.
    macro_rules! q8_0_kernel {
        ($name:ident, $features:literal, $dot:ident) => {
            #[inline]
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name<const N: usize>(row: &[u8], acts: [&QActs; N]) -> [f32; N] {
                let nb = row.len() / 34;
                for a in &acts {
                    assert!(a.qs.len() >= nb * 32 && a.d.len() >= nb);
                }
                let mut acc = [_mm256_setzero_ps(); N];
                for b in 0..nb {
                    // SAFETY: block b lies within `row`; activations checked above.
                    unsafe {
                        let blk = row.as_ptr().add(34 * b);
                        let dw = half::f16::from_le_bytes([*blk, *blk.add(1)]).to_f32();
                        let qx = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                        let ax = _mm256_sign_epi8(qx, qx);
                        for t in 0..N {
                            let a = acts[t];
                            let qy =
                                _mm256_loadu_si256(a.qs.as_ptr().add(32 * b) as *const __m256i);
                            let sy = _mm256_sign_epi8(qy, qx);
                            let xy = _mm256_cvtepi32_ps($dot(ax, sy));
                            let d = _mm256_set1_ps(dw * *a.d.get_unchecked(b));
                            acc[t] = _mm256_fmadd_ps(d, xy, acc[t]);
                        }
                    }
                }
                let mut out = [0f32; N];
                for t in 0..N {
                    out[t] = hsum(acc[t]);
                }
                out
            }
        };
    }

    /// u8 × i8 products of 32 lanes summed in groups of four into eight i32 (exact).
    #[inline(always)]
    unsafe fn dot_avx2(x: __m256i, y: __m256i) -> __m256i {
        // SAFETY: only called from functions that enable avx2.
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1)) }
    }

    /// The same sums with one VNNI instruction.
    #[inline(always)]
    unsafe fn dot_vnni(x: __m256i, y: __m256i) -> __m256i {
        // SAFETY: only called from functions that enable avx512vnni and avx512vl.
        unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), x, y) }
    }

    /// Every row of `data` (`rb` bytes each) times every token: tokens in groups of four
    /// share one pass over a row, the rest go one at a time. Dispatch happens once per
    /// call, not per row.
    macro_rules! rows_fn {
        ($rows:ident, $kernel:ident, $features:literal) => {
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $rows(data: &[u8], rb: usize, acts: &[QActs], out: &mut [f32]) {
                let t = acts.len();
                let n4 = t / 4 * 4;
                for (row, o) in data.chunks_exact(rb).zip(out.chunks_exact_mut(t)) {
                    for g in (0..n4).step_by(4) {
                        // SAFETY: the kernel enables the same features as this function.
                        let r = unsafe {
                            $kernel::<4>(row, [&acts[g], &acts[g + 1], &acts[g + 2], &acts[g + 3]])
                        };
                        o[g..g + 4].copy_from_slice(&r);
                    }
                    for tt in n4..t {
                        // SAFETY: as above.
                        o[tt] = unsafe { $kernel::<1>(row, [&acts[tt]]) }[0];
                    }
                }
            }
        };
    }

    /// Scale slots per block in a [`Group`]: the widest group's size.
    const SLOTS: usize = 8;

    /// A group of 4 or 8 tokens' activations rearranged for the grouped VNNI kernels: per
    /// block the tokens' scales (and Q8_1 sums) side by side in `SLOTS` slots,
    /// `ds[SLOTS·b + k]`, so one vector multiply gives all their scale products; for Q8_0
    /// weights each token's values are also kept shifted to unsigned (`q + 128`), the
    /// operand VNNI multiplies directly. Unused slots stay zero.
    struct Group<'a> {
        qs: Vec<&'a [i8]>,
        shifted: Vec<Vec<u8>>,
        ds: Vec<f32>,
        ss: Vec<f32>,
    }

    impl<'a> Group<'a> {
        fn new(g: &'a [QActs], nb: usize, kind: IntKind) -> Self {
            assert!(g.len() <= SLOTS);
            let sums = kind == IntKind::Q4_1;
            let mut ds = vec![0f32; nb * SLOTS];
            let mut ss = vec![0f32; if sums { nb * SLOTS } else { 0 }];
            for (k, a) in g.iter().enumerate() {
                assert!(a.qs.len() >= nb * 32 && a.d.len() >= nb && (!sums || a.s.len() >= nb));
                for b in 0..nb {
                    ds[SLOTS * b + k] = a.d[b];
                    if sums {
                        ss[SLOTS * b + k] = a.s[b];
                    }
                }
            }
            Self {
                qs: g.iter().map(|a| &a.qs[..nb * 32]).collect(),
                shifted: if kind == IntKind::Q8_0 {
                    g.iter()
                        .map(|a| a.qs[..nb * 32].iter().map(|&q| q as u8 ^ 0x80).collect())
                        .collect()
                } else {
                    Vec::new()
                },
                ds,
                ss,
            }
        }
    }

    /// Q4_1 rows · a group of `G` tokens. Every token's lanes see exactly the operations of
    /// [`q4_1_q8_1_vnni`] (the same scale product rounded once, the same FMA chain, the same
    /// min term and final sum), so results are identical to one token at a time; the
    /// group's scale products take one vector multiply, its min terms one multiply and one
    /// add.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn q4_1_group_vnni<const G: usize>(row: &[u8], g: &Group<'_>) -> [f32; G] {
        let nb = row.len() / 20;
        assert!(G <= SLOTS && g.qs.len() == G);
        assert!(g.ds.len() >= nb * SLOTS && g.ss.len() >= nb * SLOTS);
        assert!(g.qs.iter().all(|q| q.len() >= nb * 32));
        let lowmask = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); G];
        let mut summs = _mm256_setzero_ps();
        for b in 0..nb {
            // SAFETY: block b lies within `row`; activation lengths checked above.
            unsafe {
                let blk = row.as_ptr().add(20 * b);
                let raw = (blk as *const u32).read_unaligned();
                let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(raw as i32));
                let dw = _mm256_broadcastss_ps(dm);
                let mw = _mm256_broadcastss_ps(_mm_permute_ps(dm, 0b0101_0101));
                let dv = _mm256_mul_ps(dw, _mm256_loadu_ps(g.ds.as_ptr().add(SLOTS * b)));
                let mins = _mm256_mul_ps(mw, _mm256_loadu_ps(g.ss.as_ptr().add(SLOTS * b)));
                summs = _mm256_add_ps(summs, mins);
                let tmp = _mm_loadu_si128(blk.add(4) as *const __m128i);
                let bytes =
                    _mm256_insertf128_si256(_mm256_castsi128_si256(tmp), _mm_srli_epi16(tmp, 4), 1);
                let qx = _mm256_and_si256(lowmask, bytes);
                for (t, acc) in acc.iter_mut().enumerate() {
                    let qy = _mm256_loadu_si256(g.qs[t].as_ptr().add(32 * b) as *const __m256i);
                    let xy = _mm256_cvtepi32_ps(dot_vnni(qx, qy));
                    let d = _mm256_permutevar8x32_ps(dv, _mm256_set1_epi32(t as i32));
                    *acc = _mm256_fmadd_ps(d, xy, *acc);
                }
            }
        }
        let mut mins = [0f32; SLOTS];
        // SAFETY: `mins` has room for SLOTS = 8 floats.
        unsafe { _mm256_storeu_ps(mins.as_mut_ptr(), summs) };
        std::array::from_fn(|t| hsum(acc[t]) + mins[t])
    }

    /// Q8_0 rows · a group of `G` tokens, identical per token to [`q8_0_q8_0_vnni`]: the
    /// integer sums are exact either way. Here the token side is unsigned (`q + 128`) and
    /// each lane starts from `-128 · Σ w` of its four weights, so no sign fix-ups are
    /// needed per token.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn q8_0_group_vnni<const G: usize>(row: &[u8], g: &Group<'_>) -> [f32; G] {
        let nb = row.len() / 34;
        assert!(G <= SLOTS && g.shifted.len() == G);
        assert!(g.ds.len() >= nb * SLOTS);
        assert!(g.shifted.iter().all(|q| q.len() >= nb * 32));
        let bias = _mm256_set1_epi8(-128);
        let mut acc = [_mm256_setzero_ps(); G];
        for b in 0..nb {
            // SAFETY: block b lies within `row`; activation lengths checked above.
            unsafe {
                let blk = row.as_ptr().add(34 * b);
                let raw = (blk as *const u16).read_unaligned();
                let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(raw as i32));
                let dv = _mm256_mul_ps(
                    _mm256_broadcastss_ps(dm),
                    _mm256_loadu_ps(g.ds.as_ptr().add(SLOTS * b)),
                );
                let qx = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                let start = _mm256_sub_epi32(_mm256_setzero_si256(), dot_vnni(bias, qx));
                for (t, acc) in acc.iter_mut().enumerate() {
                    let qy =
                        _mm256_loadu_si256(g.shifted[t].as_ptr().add(32 * b) as *const __m256i);
                    let xy = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(start, qy, qx));
                    let d = _mm256_permutevar8x32_ps(dv, _mm256_set1_epi32(t as i32));
                    *acc = _mm256_fmadd_ps(d, xy, *acc);
                }
            }
        }
        std::array::from_fn(|t| hsum(acc[t]))
    }

    /// Every row times every token on the VNNI path: tokens in groups of eight, then four,
    /// through the group kernels, the rest one at a time through the per-token kernels.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    pub(super) unsafe fn rows_vnni(
        kind: IntKind,
        data: &[u8],
        rb: usize,
        acts: &[QActs],
        out: &mut [f32],
    ) {
        let t = acts.len();
        let nb = match kind {
            IntKind::Q4_1 => rb / 20,
            IntKind::Q8_0 => rb / 34,
            IntKind::Q4_0 => unreachable!("Q4_0 has no VNNI kernel"),
        };
        // Eights, then a four, then the rest one at a time.
        let (n8, n4) = (t / 8 * 8, t / 8 * 8 + (t % 8) / 4 * 4);
        let groups: Vec<Group<'_>> = acts[..n8]
            .chunks_exact(8)
            .chain(acts[n8..n4].chunks_exact(4))
            .map(|g| Group::new(g, nb, kind))
            .collect();
        let ng = n4;
        for (row, o) in data.chunks_exact(rb).zip(out.chunks_exact_mut(t)) {
            let mut at = 0;
            for g in &groups {
                // SAFETY: this function enables every feature the kernels enable.
                unsafe {
                    match (kind, g.qs.len()) {
                        (IntKind::Q4_1, 8) => {
                            o[at..at + 8].copy_from_slice(&q4_1_group_vnni::<8>(row, g))
                        }
                        (IntKind::Q4_1, _) => {
                            o[at..at + 4].copy_from_slice(&q4_1_group_vnni::<4>(row, g))
                        }
                        (_, 8) => o[at..at + 8].copy_from_slice(&q8_0_group_vnni::<8>(row, g)),
                        _ => o[at..at + 4].copy_from_slice(&q8_0_group_vnni::<4>(row, g)),
                    }
                }
                at += g.qs.len();
            }
            for tt in ng..t {
                // SAFETY: as above.
                o[tt] = unsafe {
                    match kind {
                        IntKind::Q4_1 => q4_1_q8_1_vnni::<1>(row, [&acts[tt]]),
                        _ => q8_0_q8_0_vnni::<1>(row, [&acts[tt]]),
                    }
                }[0];
            }
        }
    }

    q4_1_kernel!(q4_1_q8_1, "avx2,fma,f16c", dot_avx2);
    q4_1_kernel!(
        q4_1_q8_1_vnni,
        "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
        dot_vnni
    );
    q8_0_kernel!(q8_0_q8_0, "avx2,fma,f16c", dot_avx2);
    q8_0_kernel!(
        q8_0_q8_0_vnni,
        "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
        dot_vnni
    );
    rows_fn!(q4_1_rows, q4_1_q8_1, "avx2,fma,f16c");
    rows_fn!(q8_0_rows, q8_0_q8_0, "avx2,fma,f16c");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{quantize_q8_0, quantize_q8_1};
    use pdmesh_gguf::{GgmlType, dequantize};

    fn row_q4_1(n: usize, seed: u32) -> Vec<u8> {
        let mut r = Vec::new();
        let mut s = seed;
        for b in 0..n / 32 {
            r.extend(f16::from_f32(0.01 + b as f32 * 0.003).to_le_bytes());
            r.extend(f16::from_f32(-0.05).to_le_bytes());
            for _ in 0..16 {
                s = s.wrapping_mul(1103515245).wrapping_add(12345);
                r.push((s >> 16) as u8);
            }
        }
        r
    }

    fn acts(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 * 0.7 + seed).sin()) * 2.0)
            .collect()
    }

    #[test]
    fn q4_1_matches_dequantized_reference_and_is_batch_invariant() {
        let n = 576;
        let row = row_q4_1(n, 7);
        let mut w = vec![0f32; n];
        dequantize(GgmlType::Q4_1, &row, &mut w);
        let xs: Vec<Vec<f32>> = (0..4).map(|t| acts(n, t as f32)).collect();
        let qs: Vec<QActs> = xs
            .iter()
            .map(|x| {
                let mut q = QActs::default();
                quantize_q8_1(x, &mut q);
                q
            })
            .collect();
        let four = q4_1_q8_1(&row, [&qs[0], &qs[1], &qs[2], &qs[3]]);
        for t in 0..4 {
            let one = q4_1_q8_1(&row, [&qs[t]]);
            assert_eq!(
                one[0].to_bits(),
                four[t].to_bits(),
                "token {t} differs between N=1 and N=4"
            );
            let exact = f32_dot(&w, &xs[t]);
            assert!(
                (one[0] - exact).abs() < 0.02 * exact.abs().max(1.0),
                "{} vs {exact}",
                one[0]
            );
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn vnni_and_avx2_paths_agree_bit_for_bit() {
        if !has_vnni() {
            eprintln!("no AVX-512 VNNI here: nothing to compare");
            return;
        }
        let n = 2560; // more than one 64-block segment
        let row = row_q4_1(n, 3);
        let xs: Vec<QActs> = (0..4)
            .map(|t| {
                let mut q = QActs::default();
                quantize_q8_1(&acts(n, t as f32), &mut q);
                q
            })
            .collect();
        let g = [&xs[0], &xs[1], &xs[2], &xs[3]];
        // SAFETY: has_vnni() implies every feature both functions enable.
        let (a, b) = unsafe { (avx2::q4_1_q8_1(&row, g), avx2::q4_1_q8_1_vnni(&row, g)) };
        assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits));
        let mut row8 = Vec::new();
        for b in 0..n / 32 {
            row8.extend(f16::from_f32(0.01 * (b % 7 + 1) as f32).to_le_bytes());
            row8.extend((0..32).map(|j| ((j * 13 + b * 5) % 255) as u8 ^ 0x80));
        }
        let xs8: Vec<QActs> = (0..4)
            .map(|t| {
                let mut q = QActs::default();
                quantize_q8_0(&acts(n, t as f32 + 0.5), &mut q);
                q
            })
            .collect();
        let g = [&xs8[0], &xs8[1], &xs8[2], &xs8[3]];
        // SAFETY: as above.
        let (a, b) = unsafe { (avx2::q8_0_q8_0(&row8, g), avx2::q8_0_q8_0_vnni(&row8, g)) };
        assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits));
    }

    #[test]
    fn q8_0_and_q4_0_match_dequantized_reference() {
        let n = 64;
        let mut row = Vec::new();
        for b in 0..2 {
            row.extend(f16::from_f32(0.02 * (b + 1) as f32).to_le_bytes());
            row.extend((0..32).map(|j| ((j * 11 + b * 3) % 255 - 127) as i8 as u8));
        }
        let mut w = vec![0f32; n];
        dequantize(GgmlType::Q8_0, &row, &mut w);
        let x = acts(n, 0.3);
        let mut q = QActs::default();
        quantize_q8_0(&x, &mut q);
        let got = q8_0_q8_0(&row, [&q, &q]);
        assert_eq!(got[0].to_bits(), got[1].to_bits());
        let exact = f32_dot(&w, &x);
        assert!(
            (got[0] - exact).abs() < 0.02 * exact.abs().max(1.0),
            "{} vs {exact}",
            got[0]
        );

        let mut row = Vec::new();
        for b in 0..2u8 {
            row.extend(f16::from_f32(0.1).to_le_bytes());
            row.extend((0..16u8).map(|j| j.wrapping_mul(7).wrapping_add(b)));
        }
        dequantize(GgmlType::Q4_0, &row, &mut w);
        let got = q4_0_q8_0(&row, [&q]);
        let exact = f32_dot(&w, &x);
        assert!(
            (got[0] - exact).abs() < 0.02 * exact.abs().max(1.0),
            "{} vs {exact}",
            got[0]
        );
    }
}

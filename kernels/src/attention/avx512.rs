//! The AVX-512 path: a tile of query tokens at once, sixteen keys per block, exp and the
//! weighted sums sixteen lanes wide.

use std::arch::x86_64::*;

use half::f16;

use super::Tile;

use super::exp::{EXP_HI, EXP_LO, EXP_TAYLOR, LN2_HI, LN2_LO, LOG2E, exp_f32};

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
pub(super) unsafe fn attend_causal(tile: &Tile<'_>, outs: &mut [&mut [f32]]) {
    let (qs, hd, scale) = (tile.qs, tile.hd, tile.scale);
    let (starts, counts, keys, values) = (tile.starts, tile.counts, tile.keys, tile.values);
    let rep = qs[0].len() / hd;
    let nq = qs.len() * rep;
    let chunks = hd / 8;
    let n = counts.iter().copied().max().unwrap_or(0);
    let stride = n.next_multiple_of(BLOCK);
    let count = |qi: usize| counts[qi / rep];
    let start = |qi: usize| starts[qi / rep];
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
                        unsafe { _mm_loadu_si128(keys[j].as_ptr().add(8 * c) as *const __m128i) }
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
        // A block wholly before a head's first key is not scored (it is masked below).
        for qi in (0..nq).filter(|&qi| count(qi) > b0 && start(qi) < b0 + BLOCK) {
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
        let (s0, c) = (starts[i], counts[i]);
        let full = c / 16 * 16;
        let mut sums = vec![0f64; rep];
        for r in 0..rep {
            let row = &mut scores[(i * rep + r) * stride..][..c];
            // Keys before the token's first: no part in the max, probability zero.
            row[..s0].fill(f32::NEG_INFINITY);
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
            row[..s0].fill(0.0);
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

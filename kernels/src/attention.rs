//! Attention of one query token over one KV group's cached f16 rows: scores, softmax and
//! the weighted sum of values, converting K and V from f16 as they are read. The SIMD path
//! performs exactly the scalar path's operations (a multiply then an add per lane, eight
//! lanes per row reduced by one fixed tree, positions in order), so both give the same
//! bits, and a token's result never depends on its batch.

use half::f16;

use crate::dot::has_avx2;

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
    let simd = cfg!(target_arch = "x86_64") && has_avx2();
    attend_on(simd, q, hd, keys, values, scale, out);
}

/// [`attend`] on the SIMD path or the scalar one, which give the same bits.
fn attend_on(
    simd: bool,
    q: &[f32],
    hd: usize,
    keys: &[&[f16]],
    values: &[&[f16]],
    scale: f32,
    out: &mut [f32],
) {
    let rep = q.len() / hd;
    let n = keys.len();
    assert!(
        hd.is_multiple_of(8)
            && q.len() == rep * hd
            && out.len() == q.len()
            && values.len() == n
            && n > 0
    );
    assert!(keys.iter().chain(values).all(|r| r.len() == hd));
    let mut scores = vec![0f32; n];
    let mut qh = vec![0f32; hd];
    for r in 0..rep {
        for (d, &x) in qh.iter_mut().zip(&q[r * hd..(r + 1) * hd]) {
            *d = f16::from_f32(x).to_f32();
        }
        let tree = |lanes: [f32; 8]| {
            (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
                + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])))
                * scale
        };
        if simd {
            // Four keys at a time: four independent chains, each key's lanes in order.
            let (quads, rest) = keys.split_at(n - n % 4);
            for (s, k) in scores.chunks_exact_mut(4).zip(quads.chunks_exact(4)) {
                let lanes = simd_dot_lanes4(&qh, [k[0], k[1], k[2], k[3]]);
                for (s, l) in s.iter_mut().zip(lanes) {
                    *s = tree(l);
                }
            }
            for (s, k) in scores[n - n % 4..].iter_mut().zip(rest) {
                *s = tree(simd_dot_lanes(&qh, k));
            }
        } else {
            for (s, k) in scores.iter_mut().zip(keys) {
                *s = tree(scalar_dot_lanes(&qh, k));
            }
        }
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let mut sum = 0f64;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s as f64;
        }
        let inv = (1.0 / sum) as f32;
        for s in scores.iter_mut() {
            *s = f16::from_f32(*s * inv).to_f32();
        }
        let o = &mut out[r * hd..(r + 1) * hd];
        if simd {
            simd_weighted_sum(&scores, values, o);
        } else {
            scalar_weighted_sum(&scores, values, o);
        }
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

fn simd_dot_lanes(q: &[f32], k: &[f16]) -> [f32; 8] {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: only called when has_avx2() (which includes f16c) holds; lengths equal.
        unsafe { avx2::dot_lanes(q, k) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    scalar_dot_lanes(q, k)
}

fn simd_dot_lanes4(q: &[f32], k: [&[f16]; 4]) -> [[f32; 8]; 4] {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: only called when has_avx2() (which includes f16c) holds; lengths equal.
        unsafe { avx2::dot_lanes4(q, k) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    k.map(|k| scalar_dot_lanes(q, k))
}

fn simd_weighted_sum(p: &[f32], values: &[&[f16]], o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: as above; every value row has o.len() elements.
        unsafe { avx2::weighted_sum(p, values, o) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    scalar_weighted_sum(p, values, o)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use half::f16;

    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn dot_lanes(q: &[f32], k: &[f16]) -> [f32; 8] {
        let mut acc = _mm256_setzero_ps();
        for c in (0..q.len()).step_by(8) {
            // SAFETY: c + 8 <= q.len() == k.len().
            unsafe {
                let kf = _mm256_cvtph_ps(_mm_loadu_si128(k.as_ptr().add(c) as *const __m128i));
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q.as_ptr().add(c)), kf));
            }
        }
        let mut lanes = [0f32; 8];
        // SAFETY: lanes has room for 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        lanes
    }

    /// [`dot_lanes`] of four keys at once, each key's chunks in the same order.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn dot_lanes4(q: &[f32], k: [&[f16]; 4]) -> [[f32; 8]; 4] {
        assert!(k.iter().all(|k| k.len() == q.len()));
        let mut acc = [_mm256_setzero_ps(); 4];
        for c in (0..q.len()).step_by(8) {
            // SAFETY: c + 8 <= q.len() == every k's length (asserted).
            unsafe {
                let qc = _mm256_loadu_ps(q.as_ptr().add(c));
                for (a, k) in acc.iter_mut().zip(k) {
                    let kf = _mm256_cvtph_ps(_mm_loadu_si128(k.as_ptr().add(c) as *const __m128i));
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(qc, kf));
                }
            }
        }
        let mut lanes = [[0f32; 8]; 4];
        for (l, a) in lanes.iter_mut().zip(acc) {
            // SAFETY: l has room for 8 floats.
            unsafe { _mm256_storeu_ps(l.as_mut_ptr(), a) };
        }
        lanes
    }

    /// Up to eight 8-wide output chunks at a time, each its own chain over the values in
    /// order (the scalar path's order per output lane).
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn weighted_sum(p: &[f32], values: &[&[f16]], o: &mut [f32]) {
        assert!(values.iter().all(|v| v.len() == o.len()) && o.len().is_multiple_of(8));
        for c0 in (0..o.len()).step_by(64) {
            let chunks = ((o.len() - c0) / 8).min(8);
            let mut acc = [_mm256_setzero_ps(); 8];
            for (&pj, v) in p.iter().zip(values) {
                let pv = _mm256_set1_ps(pj);
                for (i, a) in acc.iter_mut().enumerate().take(chunks) {
                    // SAFETY: c0 + 8 * i + 8 <= o.len() == v.len().
                    unsafe {
                        let at = v.as_ptr().add(c0 + 8 * i) as *const __m128i;
                        *a = _mm256_add_ps(
                            *a,
                            _mm256_mul_ps(pv, _mm256_cvtph_ps(_mm_loadu_si128(at))),
                        );
                    }
                }
            }
            for (i, a) in acc.iter().enumerate().take(chunks) {
                // SAFETY: c0 + 8 * i + 8 <= o.len().
                unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(c0 + 8 * i), *a) };
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
    /// chunks and key counts around the four-key groups.
    #[test]
    fn attend_gives_the_same_bits_on_both_paths() {
        for hd in [8, 64, 128] {
            for n in [1, 3, 4, 5, 8, 37] {
                let rep = 3;
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
                attend_on(false, &q, hd, &kr, &vr, 0.125, &mut want);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "hd {hd} n {n}");
            }
        }
    }

    #[test]
    fn simd_and_scalar_paths_give_the_same_bits() {
        let (q, k, v) = case();
        for (a, b) in q.chunks_exact(64).zip(&k) {
            assert_eq!(
                simd_dot_lanes(a, b).map(f32::to_bits),
                scalar_dot_lanes(a, b).map(f32::to_bits)
            );
        }
        let p: Vec<f32> = (0..v.len())
            .map(|j| f16::from_f32(1.0 / (j + 1) as f32).to_f32())
            .collect();
        let vr: Vec<&[f16]> = v.iter().map(Vec::as_slice).collect();
        let (mut a, mut b) = (vec![0f32; 64], vec![0f32; 64]);
        simd_weighted_sum(&p, &vr, &mut a);
        scalar_weighted_sum(&p, &vr, &mut b);
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
}

//! Tests of attention: the textbook formula, every path and every tile against the scalar
//! definition bit for bit, and exp within one ulp in every lane width.

use super::exp::{EXP_HI, EXP_LO};
use super::scalar::scalar_softmax;
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

/// A tile of `t` query tokens at consecutive positions from `pos0`, each over the keys
/// from its own first visible position (`window` keys at most) to itself, on every path,
/// against each token alone on the scalar path, bit for bit. The tile's keys start at
/// its first token's first visible position; some keys are large, so that their scores'
/// exp underflows.
fn tile_gives_each_token_its_bits_alone(
    hd: usize,
    rep: usize,
    (pos0, t): (usize, usize),
    window: usize,
) {
    let row = |j: usize, f: f32, big: f32| -> Vec<f16> {
        (0..hd)
            .map(|d| f16::from_f32(((j * hd + d) as f32 * f).cos() * big))
            .collect()
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let n = pos0 + t;
    let k: Vec<Vec<f16>> = (0..n)
        .map(|j| row(j, 0.07, if j % 7 == 3 { 60.0 } else { 1.0 }))
        .collect();
    let v: Vec<Vec<f16>> = (0..n).map(|j| row(j, 0.13, 1.0)).collect();
    let first = (pos0 + 1).saturating_sub(window);
    let kr: Vec<&[f16]> = k[first..].iter().map(Vec::as_slice).collect();
    let vr: Vec<&[f16]> = v[first..].iter().map(Vec::as_slice).collect();
    let qs: Vec<Vec<f32>> = (0..t)
        .map(|i| {
            (0..rep * hd)
                .map(|x| ((x + 31 * i) as f32 * 0.29).sin() * 3.0)
                .collect()
        })
        .collect();
    let counts: Vec<usize> = (0..t).map(|i| pos0 + i + 1 - first).collect();
    let starts: Vec<usize> = (0..t)
        .map(|i| (pos0 + i + 1).saturating_sub(window) - first)
        .collect();
    let want: Vec<Vec<f32>> = (0..t)
        .map(|i| {
            let mut o = vec![0f32; rep * hd];
            let (s, c) = (starts[i], counts[i]);
            attend_one(&qs[i], hd, &kr[s..c], &vr[s..c], 0.125, &mut o);
            o
        })
        .collect();
    let qr: Vec<&[f32]> = qs.iter().map(Vec::as_slice).collect();
    let tile = Tile {
        qs: &qr,
        hd,
        starts: &starts,
        counts: &counts,
        keys: &kr,
        values: &vr,
        scale: 0.125,
    };
    for path in paths(hd) {
        let mut got = vec![vec![7f32; rep * hd]; t];
        let mut outs: Vec<&mut [f32]> = got.iter_mut().map(Vec::as_mut_slice).collect();
        attend_causal_on(path, &tile, &mut outs);
        for i in 0..t {
            assert_eq!(
                bits(&got[i]),
                bits(&want[i]),
                "{path:?} hd {hd} rep {rep} window {window} position {}",
                pos0 + i
            );
        }
    }
}

/// Tiles of query tokens at consecutive positions (each head of the group, its own
/// key count) against each token alone: head widths of one to sixteen 16-lane chunks,
/// key counts around the 8- and 16-key blocks, head counts around the 8-head groups of
/// the weighted sum.
#[test]
fn a_tile_of_tokens_gives_each_token_the_bits_it_has_alone() {
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
                tile_gives_each_token_its_bits_alone(hd, rep, (first - 1, t), usize::MAX);
            }
        }
    }
}

/// A tile of tokens of a sliding window, each over its own last `window` keys (its first
/// key differs from the tile's), with windows shorter than, equal to and longer than the
/// blocks, and tiles that start inside, at and past the window.
#[test]
fn a_tile_of_window_tokens_gives_each_token_the_bits_of_its_own_window_alone() {
    for hd in [16, 64, 256] {
        for rep in [1, 4, 9] {
            for window in [1, 5, 8, 16, 17, 40] {
                for tokens in [(0, 8), (3, 5), (window, 8), (50, 8), (61, 3)] {
                    tile_gives_each_token_its_bits_alone(hd, rep, tokens, window);
                }
            }
        }
    }
}

/// Inputs for exp: a fine sweep over [-90, 2], the ends of its clamp and values beside
/// them, and the special values.
fn exp_inputs() -> Vec<f32> {
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
    xs
}

#[test]
fn exp_is_within_one_ulp_and_the_same_bits_in_sixteen_lanes() {
    let xs = exp_inputs();
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
    let xs = exp_inputs();
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

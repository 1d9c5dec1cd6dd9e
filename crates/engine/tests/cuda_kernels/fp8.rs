//! fp8.cu: block quantization and dequantization, bit-exact with pdmesh-kv's.

use cudarc::driver::PushKernelArg;
use pdmesh_engine::cuda::device::{Gpu, grid};
use pdmesh_kv::fp8::{ScaleRule, dequantize_block, quantize_block};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::support::{down, gpu, rng, uniform, up};

// ---- fp8_quantize_blocks, fp8_dequantize_blocks -----------------------------------------

/// Blocks of `block` values of many kinds: ordinary, all zero (the amax floor), signed
/// zeros, huge (up to f32::MAX), below the floor, f32 subnormals, exact E4M3 ties and
/// E4M3-subnormal codes at scale 1, amax at the ue8m0 boundaries (448, 449, 224), positive
/// NaNs (ignored by amax, coded 0x7F), a block of NaNs, and values over many octaves.
///
/// Left out on purpose: negative NaNs and infinities. The CPU keeps a NaN's sign through
/// `v * inv` and turns `inf * 0` into x86's negative default NaN (code 0xFF); the GPU's
/// multiply returns the canonical positive NaN (0x7F).
fn fp8_test_blocks(r: &mut ChaCha8Rng, block: usize) -> Vec<f32> {
    let p = |e: i32| 2f32.powi(e);
    let kinds = 24usize;
    let mut x = Vec::with_capacity(kinds * block);
    for kind in 0..kinds {
        let mut b = uniform(r, block, -1.0, 1.0);
        match kind {
            0 => {}
            1 => b.iter_mut().for_each(|v| *v *= 1000.0),
            2 => b.fill(0.0),
            3 => b
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = if i % 2 == 0 { -0.0 } else { 0.0 }),
            4 => {
                b.iter_mut().for_each(|v| *v *= 1e30);
                b[0] = f32::MAX;
                b[block - 1] = -f32::MAX;
            }
            5 => b.iter_mut().for_each(|v| *v *= 1e-6),
            6 => {
                b.iter_mut().for_each(|v| *v *= 1e-39);
                b[0] = f32::from_bits(1);
                b[1] = -f32::from_bits(3);
            }
            7 => {
                // Scale 1 (Exact and ue8m0): the values are coded as they are.
                b.iter_mut().for_each(|v| *v *= p(-6)); // E4M3 subnormal range
                let ties = [
                    448.0,
                    1.0625,
                    1.1875,
                    1.5 * p(-9),
                    0.5 * p(-9),
                    2.5 * p(-9),
                    1.96875,
                    p(-6),
                    p(-9),
                    7.0 * p(-9),
                    7.5 * p(-9),
                    240.0,
                    0.1,
                    -1.0625,
                    -0.0,
                    232.0, // tie between 224 and 240: to even, 224
                    p(-10),
                    p(-11),
                ];
                for (i, &t) in ties.iter().enumerate() {
                    b[(i * 5) % block] = t;
                }
            }
            8 => b[block / 3] = 449.0,
            9 => b[block / 2] = -224.0,
            10 => {
                b.iter_mut().for_each(|v| *v *= 300.0);
                b[1] = f32::NAN;
                b[block / 2] = f32::NAN;
            }
            11 => b.fill(f32::NAN),
            12 => {
                for v in b.iter_mut() {
                    let e = r.random_range(-20..=10);
                    *v = v.signum() * p(e) * r.random_range(1.0..2.0);
                }
            }
            13 => {
                // amax exactly the floor.
                b.iter_mut().for_each(|v| *v *= 1e-4);
                b[0] = 1e-4;
            }
            14 => b.iter_mut().for_each(|v| *v *= 448.0),
            _ => {
                let m = p(r.random_range(-30..=30));
                b.iter_mut().for_each(|v| *v *= m);
            }
        }
        x.extend_from_slice(&b);
    }
    x
}

/// Bit-exact with `pdmesh_kv::fp8::quantize_block` for both scale rules (codes and scale
/// bits), for blocks of 128 (DeepSeek's), 64 (fewer values than threads) and 300 (threads
/// loop); then `fp8_dequantize_blocks` of those codes is bit-exact with `dequantize_block`.
#[test]
fn fp8_quantize_blocks_is_bit_exact_with_the_cpu() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(12);
    for block in [128usize, 64, 300] {
        let x = fp8_test_blocks(&mut r, block);
        let nb = x.len() / block;
        for (rule, ue8m0) in [(ScaleRule::Exact, 0i32), (ScaleRule::Ue8m0, 1)] {
            let mut want_q = vec![0u8; x.len()];
            let want_s: Vec<f32> = x
                .chunks_exact(block)
                .zip(want_q.chunks_exact_mut(block))
                .map(|(xb, qb)| quantize_block(xb, qb, rule))
                .collect();
            let dx = up(s, &x);
            let mut dq = s.alloc_zeros::<u8>(x.len()).unwrap();
            let mut ds = s.alloc_zeros::<f32>(nb).unwrap();
            let (nbi, bi) = (nb as i32, block as i32);
            let mut b = s.launch_builder(g.kernel("fp8_quantize_blocks"));
            b.arg(&dx)
                .arg(&mut dq)
                .arg(&mut ds)
                .arg(&nbi)
                .arg(&bi)
                .arg(&ue8m0);
            // SAFETY: fp8_quantize_blocks(const float*, unsigned char*, float*, int, int,
            // int); x and q hold nb × block, scales nb.
            unsafe { b.launch(grid((nb as u32, 1, 1), 128)) }.unwrap();
            let (got_q, got_s) = (down(s, &dq), down(s, &ds));
            for bl in 0..nb {
                // Tolerance: exact (scale bits and every code).
                assert_eq!(
                    got_s[bl].to_bits(),
                    want_s[bl].to_bits(),
                    "fp8 {rule:?} block size {block}, block {bl}: scale GPU {}, CPU {} (exact)",
                    got_s[bl],
                    want_s[bl]
                );
                let range = bl * block..(bl + 1) * block;
                if let Some(j) = range.clone().find(|&j| got_q[j] != want_q[j]) {
                    panic!(
                        "fp8 {rule:?} block size {block}, block {bl}, value {} ({:#010x}): GPU code {:#04x}, CPU {:#04x} (exact)",
                        x[j],
                        x[j].to_bits(),
                        got_q[j],
                        want_q[j]
                    );
                }
            }
            check_fp8_dequantize(
                &g,
                &want_q,
                &want_s,
                block,
                &format!("{rule:?} round trip, block {block}"),
            );
        }
    }
    // Every code under a range of scales, including a tiny one whose products are f32
    // subnormals (not flushed to zero).
    let codes: Vec<u8> = (0..8).flat_map(|_| 0..=255u8).collect();
    let scales = [
        1.0f32,
        2f32.powi(-22),
        1e-4 / 448.0,
        0.3,
        2f32.powi(20),
        7.5e-37,
        1e30,
        3.0e-3,
    ];
    check_fp8_dequantize(&g, &codes, &scales, 256, "every code");
}

/// `fp8_dequantize_blocks` against `dequantize_block`: exact, except that a NaN code
/// (0x7F, 0xFF) only has to give a NaN (its payload after the multiply is the device's).
fn check_fp8_dequantize(g: &Gpu, q: &[u8], scales: &[f32], block: usize, what: &str) {
    let s = &g.compute;
    let nb = scales.len();
    assert_eq!(q.len(), nb * block);
    let (dq, ds) = (up(s, q), up(s, scales));
    let mut out = s.alloc_zeros::<f32>(q.len()).unwrap();
    let (nbi, bi) = (nb as i32, block as i32);
    let mut b = s.launch_builder(g.kernel("fp8_dequantize_blocks"));
    b.arg(&dq).arg(&ds).arg(&mut out).arg(&nbi).arg(&bi);
    // SAFETY: fp8_dequantize_blocks(const unsigned char*, const float*, float*, int, int);
    // q and out hold nb × block, scales nb.
    unsafe { b.launch(grid((nb as u32, 1, 1), 128)) }.unwrap();
    let got = down(s, &out);
    let mut want = vec![0f32; q.len()];
    for ((qb, ob), &sc) in q
        .chunks_exact(block)
        .zip(want.chunks_exact_mut(block))
        .zip(scales)
    {
        dequantize_block(qb, sc, ob);
    }
    for (i, (&a, &w)) in got.iter().zip(&want).enumerate() {
        // Tolerance: exact; NaN for NaN.
        let ok = if w.is_nan() {
            a.is_nan()
        } else {
            a.to_bits() == w.to_bits()
        };
        assert!(
            ok,
            "fp8_dequantize {what}: block {}, code {:#04x}, scale {}: GPU {a}, CPU {w} (exact)",
            i / block,
            q[i],
            scales[i / block]
        );
    }
}

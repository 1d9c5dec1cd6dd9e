//! fp8.cu: block quantization and dequantization, bit-exact with pdmesh-kv's.

use pdmesh_kv::fp8::{self, ScaleRule};

use crate::emu::{assert_bits_eq, c, emu, m, randv, rng};

type QuantFn = unsafe extern "C" fn(*const f32, *mut u8, *mut f32, i32, i32, i32);
type DequantFn = unsafe extern "C" fn(*const u8, *const f32, *mut f32, i32, i32);

#[test]
fn fp8_quantize_and_dequantize_bit_exact() {
    let e = emu();
    let quant: QuantFn = e.kernel("fp8_quantize_blocks");
    let dequant: DequantFn = e.kernel("fp8_dequantize_blocks");
    let mut r = rng(1);
    for (block, ue8m0) in [(128usize, 0), (128, 1), (64, 1), (200, 0)] {
        let nb = 6;
        let mut x = Vec::with_capacity(nb * block);
        for b in 0..nb {
            // Magnitudes from tiny (subnormal e4m3, the amax floor) to saturating.
            let scale = [1e-6f32, 3e-3, 0.7, 1.0, 300.0, 2e4][b];
            x.extend(randv(&mut r, block, scale));
        }
        x[3] = 0.0;
        x[5] = -0.0;
        if ue8m0 == 0 {
            // A block of zeros (the amax floor) and exact halfway values.
            x[block..2 * block].fill(0.0);
        }
        let mut q = vec![0u8; x.len()];
        let mut s = vec![0f32; nb];
        let mut back = vec![0f32; x.len()];
        let (px, pq, ps, pb) = (c(&x), m(&mut q), m(&mut s), m(&mut back));
        let (nbi, bi) = (nb as i32, block as i32);
        // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
        e.launch((nb as u32, 1), 128, || unsafe {
            quant(px.p(), pq.p(), ps.p(), nbi, bi, ue8m0)
        });
        // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
        e.launch((nb as u32, 1), 128, || unsafe {
            dequant(pq.p(), ps.p(), pb.p(), nbi, bi)
        });
        let rule = if ue8m0 == 1 {
            ScaleRule::Ue8m0
        } else {
            ScaleRule::Exact
        };
        for b in 0..nb {
            let xs = &x[b * block..(b + 1) * block];
            let mut wq = vec![0u8; block];
            let ws = fp8::quantize_block(xs, &mut wq, rule);
            let mut wb = vec![0f32; block];
            fp8::dequantize_block(&wq, ws, &mut wb);
            let what = format!("block {block} ue8m0 {ue8m0} #{b}");
            assert_eq!(s[b].to_bits(), ws.to_bits(), "{what}: scale");
            assert_eq!(&q[b * block..(b + 1) * block], &wq[..], "{what}: codes");
            assert_bits_eq(&what, &back[b * block..(b + 1) * block], &wb);
        }
    }
}

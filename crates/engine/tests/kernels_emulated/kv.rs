//! kv.cu: writing K and V rows as f16 into the page pool, and gathering and scattering
//! rows, exactly.

use half::f16;

use crate::emu::{c, emu, m, randv, rng};

type KvWriteFn = unsafe extern "C" fn(*const f32, i32, *mut u8, *const i64, i64, i32, i32, i32);
type GatherFn = unsafe extern "C" fn(*const u8, *const i64, *mut u8, i32, i32);
type ScatterFn = unsafe extern "C" fn(*const u8, *mut u8, *const i64, i32, i32);

#[test]
fn kv_write_f16_exact() {
    let e = emu();
    let kern: KvWriteFn = e.kernel("kv_write_f16");
    let mut r = rng(8);
    let (n, stride, cols, col0, comp_off) = (5usize, 80usize, 70usize, 3usize, 6usize);
    let mut src = randv(&mut r, n * stride, 100.0);
    src[0] = 65520.0; // rounds to inf
    src[1] = 1e-8; // subnormal half
    src[2] = f32::NAN;
    src[3] = -0.0;
    let row = stride * 2 + 64;
    let mut pool = vec![0xABu8; n * row];
    let offs: Vec<i64> = (0..n).map(|i| ((n - 1 - i) * row) as i64).collect();
    let (ps, pp, po) = (c(&src), m(&mut pool), c(&offs));
    // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
    e.launch((n as u32, 1), 128, || unsafe {
        kern(
            ps.p(),
            stride as i32,
            pp.p(),
            po.p(),
            comp_off as i64,
            col0 as i32,
            cols as i32,
            n as i32,
        )
    });
    let mut want = vec![0xABu8; n * row];
    for i in 0..n {
        for cc in 0..cols {
            let at = offs[i] as usize + comp_off + 2 * (col0 + cc);
            let h = f16::from_f32(src[i * stride + cc]).to_bits().to_le_bytes();
            want[at..at + 2].copy_from_slice(&h);
        }
    }
    assert_eq!(pool, want);
}

#[test]
fn gather_and_scatter_rows_exact() {
    let e = emu();
    let gather: GatherFn = e.kernel("gather_rows");
    let scatter: ScatterFn = e.kernel("scatter_rows");
    let src: Vec<u8> = (0..1usize << 16).map(|i| (i * 131 + 7) as u8).collect();
    // Row lengths and offsets that take each copy path: 16-byte words, 4-byte words, bytes.
    for rb in [64usize, 100, 37, 4096] {
        for shift in [0usize, 4, 1] {
            let n = 6;
            let offs: Vec<i64> = (0..n)
                .map(|i| ((n - 1 - i) * (rb + 16) + shift) as i64)
                .collect();
            let mut stage = vec![0u8; n * rb];
            let mut dst = vec![0u8; src.len()];
            let (psrc, po, pst, pd) = (c(&src), c(&offs), m(&mut stage), m(&mut dst));
            let (rbi, ni) = (rb as i32, n as i32);
            // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
            e.launch((n as u32, 1), 256, || unsafe {
                gather(psrc.p(), po.p(), pst.p(), rbi, ni)
            });
            // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
            e.launch((n as u32, 1), 256, || unsafe {
                scatter(pst.p(), pd.p(), po.p(), rbi, ni)
            });
            let mut want_dst = vec![0u8; src.len()];
            for (i, &o) in offs.iter().enumerate() {
                let o = o as usize;
                assert_eq!(
                    &stage[i * rb..(i + 1) * rb],
                    &src[o..o + rb],
                    "gather rb {rb} shift {shift} row {i}"
                );
                want_dst[o..o + rb].copy_from_slice(&src[o..o + rb]);
            }
            assert!(dst == want_dst, "scatter rb {rb} shift {shift}");
        }
    }
}

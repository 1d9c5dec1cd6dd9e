//! kv.cu: f16 K and V rows written into the pool, and rows gathered and scattered,
//! exactly.

use std::sync::Arc;

use cudarc::driver::PushKernelArg;
use half::f16;
use pdmesh_engine::cuda::device::grid;
use pdmesh_kv::{DType, KvLayout, PageId, PagePool};
use rand::Rng;
use rand::seq::SliceRandom;

use crate::support::{assert_bytes_eq, down, gpu, rng, uniform, up};

// ---- kv_write_f16 -----------------------------------------------------------------------

/// Values whose f16 rounding is a corner case: ties (to even), overflow to infinity, the
/// subnormal range and its ties, signed zeros, infinities and NaNs with payloads.
fn f16_corner_values() -> Vec<f32> {
    let p = |e: i32| 2f32.powi(e);
    vec![
        0.0,
        -0.0,
        1.0 + p(-11),       // tie, to even: 1.0
        1.0 + 3.0 * p(-11), // tie, to even: 1 + 2^-9
        -(1.0 + 3.0 * p(-11)),
        65504.0, // largest f16
        65519.0, // rounds down to 65504
        65520.0, // tie between 65504 and 2^16: to infinity
        1e6,
        -1e6,
        p(-14),       // smallest normal f16
        p(-24),       // smallest subnormal f16
        p(-25),       // tie: to 0
        3.0 * p(-25), // tie: to 2^-23
        p(-26),
        -p(-24) * 1.5, // tie, to even: -2^-23
        1e-7,
        f32::MIN_POSITIVE,
        f32::from_bits(1), // f32 subnormal
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling NaN, low payload
        f32::from_bits(0x7fa0_0000), // NaN with a high payload
        f32::from_bits(0xffc0_2000),
        0.1,
        -3.25,
    ]
}

/// Through a real llama layout and pool, as the forward writes K and V: token offsets
/// from `KvLayout::slot_offset`, the component offset of a layer, a rank's column range.
/// Exact: every pool byte equals what `f16::from_f32` written at the layout's offsets
/// gives, and no other byte changed.
#[test]
fn kv_write_f16_matches_half_exactly_and_touches_nothing_else() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(4);
    let (layers, kv_heads, hd, ps, pages) = (2usize, 4usize, 64usize, 16usize, 6usize);
    let layout = Arc::new(KvLayout::llama(layers, kv_heads, hd, DType::F16, ps));
    let mut pool = PagePool::new(layout.clone(), pages);
    let ids = pool.alloc(pages).unwrap();
    for &p in &ids {
        r.fill(pool.page_mut(p).unwrap());
    }
    // 20 tokens in distinct (page, slot) places.
    let mut places: Vec<(PageId, usize)> = ids
        .iter()
        .flat_map(|&p| (0..ps).map(move |sl| (p, sl)))
        .collect();
    places.shuffle(&mut r);
    places.truncate(20);
    let n = places.len();
    // The rank owning KV heads 1..3: columns 64..192 of each row.
    let (col0, cols) = (hd, 2 * hd);
    let src_stride = cols + 3;
    let tok_off: Vec<i64> = places
        .iter()
        .map(|&(p, sl)| layout.slot_offset(p as usize, sl).unwrap() as i64)
        .collect();
    let corners = f16_corner_values();
    let mut dpool = up(s, pool.arena());
    let dtok = up(s, &tok_off);
    let layer = 1usize;
    for comp in 0..2 {
        let mut src = uniform(&mut r, n * src_stride, -70000.0, 70000.0);
        for (i, v) in src.iter_mut().enumerate() {
            match i % 5 {
                0 => *v *= 1e-4,
                1 => *v *= 1e-9,
                _ => {}
            }
        }
        for (i, &c) in corners.iter().enumerate() {
            src[(i % n) * src_stride + (i * 7 + comp) % cols] = c;
        }
        let comp_off = layout.value_offset(layer, comp, 0) as i64;
        let dsrc = up(s, &src);
        let (ss, c0, ci, ni) = (src_stride as i32, col0 as i32, cols as i32, n as i32);
        let mut b = s.launch_builder(g.kernel("kv_write_f16"));
        b.arg(&dsrc)
            .arg(&ss)
            .arg(&mut dpool)
            .arg(&dtok)
            .arg(&comp_off)
            .arg(&c0)
            .arg(&ci)
            .arg(&ni);
        // SAFETY: kv_write_f16(const float*, int, unsigned char*, const long long*, long
        // long, int, int, int); src is n rows of src_stride ≥ cols; every slot's row lies
        // inside the pool.
        unsafe { b.launch(grid((n as u32, 1, 1), 128)) }.unwrap();
        // Where the layout puts each slot's values of the rank's columns.
        let within = layout.value_bytes(comp, col0..col0 + cols);
        for (i, &(p, sl)) in places.iter().enumerate() {
            let at = layout.value_offset(layer, comp, sl);
            let row = &mut pool.page_mut(p).unwrap()[at + within.start..at + within.end];
            for (c, out) in row.chunks_exact_mut(size_of::<f16>()).enumerate() {
                out.copy_from_slice(&f16::from_f32(src[i * src_stride + c]).to_le_bytes());
            }
        }
    }
    // Tolerance: exact, the whole pool.
    assert_bytes_eq(&down(s, &dpool), pool.arena(), "kv_write_f16 pool (exact)");
}

// ---- gather_rows, scatter_rows ----------------------------------------------------------

/// Exact copies for row sizes that take each path (16-byte words, 4-byte words, bytes):
/// odd sizes, offsets aligned to 16 and unaligned ones. Scatter leaves every byte outside
/// the rows as it was.
#[test]
fn gather_and_scatter_rows_copy_exactly() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(11);
    let n = 23usize;
    for row_bytes in [1usize, 3, 4, 12, 16, 33, 64, 257, 1024, 4096] {
        for aligned in [true, false] {
            // Distinct, non-overlapping places in a region (for scatter), in random order.
            let stride = if aligned {
                row_bytes.next_multiple_of(16) + 16
            } else {
                row_bytes + 3
            };
            let mut slots: Vec<usize> = (0..n + 4).collect();
            slots.shuffle(&mut r);
            let offs: Vec<i64> = slots[..n]
                .iter()
                .map(|&k| (k * stride + if aligned { 0 } else { r.random_range(0..=3) }) as i64)
                .collect();
            let region = (n + 4) * stride + 8;
            let mut pool = vec![0u8; region];
            r.fill(&mut pool[..]);
            let what = format!(
                "row_bytes {row_bytes}, {} offsets",
                if aligned { "16-aligned" } else { "unaligned" }
            );

            // gather: pool rows → packed.
            let (dpool, doff) = (up(s, &pool), up(s, &offs));
            let mut packed = s.alloc_zeros::<u8>(n * row_bytes).unwrap();
            let (rb, ni) = (row_bytes as i32, n as i32);
            let mut b = s.launch_builder(g.kernel("gather_rows"));
            b.arg(&dpool).arg(&doff).arg(&mut packed).arg(&rb).arg(&ni);
            // SAFETY: gather_rows(const unsigned char*, const long long*, unsigned char*,
            // int, int); every src_off + row_bytes ≤ region, dst is n × row_bytes.
            unsafe { b.launch(grid((n as u32, 1, 1), 256)) }.unwrap();
            let want: Vec<u8> = offs
                .iter()
                .flat_map(|&o| pool[o as usize..o as usize + row_bytes].iter().copied())
                .collect();
            // Tolerance: exact.
            assert_bytes_eq(
                &down(s, &packed),
                &want,
                &format!("gather_rows {what} (exact)"),
            );

            // scatter: packed → pool rows, over a pool of other bytes.
            let mut src = vec![0u8; n * row_bytes];
            r.fill(&mut src[..]);
            let dsrc = up(s, &src);
            let mut dst = up(s, &pool);
            let mut b = s.launch_builder(g.kernel("scatter_rows"));
            b.arg(&dsrc).arg(&mut dst).arg(&doff).arg(&rb).arg(&ni);
            // SAFETY: scatter_rows(const unsigned char*, unsigned char*, const long long*,
            // int, int); src is n × row_bytes, every dst_off + row_bytes ≤ region.
            unsafe { b.launch(grid((n as u32, 1, 1), 256)) }.unwrap();
            let mut want = pool.clone();
            for (i, &o) in offs.iter().enumerate() {
                want[o as usize..o as usize + row_bytes]
                    .copy_from_slice(&src[i * row_bytes..(i + 1) * row_bytes]);
            }
            // Tolerance: exact, the whole destination.
            assert_bytes_eq(
                &down(s, &dst),
                &want,
                &format!("scatter_rows {what} (exact)"),
            );
        }
    }
}

//! The scalar path: the module's order of operations performed literally, one (row,
//! token) at a time. It is the definition the SIMD paths give the bits of.

use super::packed::{IntKind, Packed};

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
pub(super) fn scalar_one(kind: IntKind, row: &[u8], p: &Packed, tt: usize) -> f32 {
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

pub(super) fn scalar_rows(
    kind: IntKind,
    data: &[u8],
    rb: usize,
    p: &Packed,
    out: &mut [&mut [f32]],
) {
    for (ri, row) in data.chunks_exact(rb).enumerate() {
        for (tt, o) in out.iter_mut().enumerate() {
            o[ri] = scalar_one(kind, row, p, tt);
        }
    }
}

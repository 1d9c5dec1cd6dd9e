//! The scalar path: the module's order of operations performed literally, one (row,
//! token) at a time. It is the definition the SIMD paths give the bits of.

use super::packed::{IntKind, Packed, values_at};

#[inline]
fn f16le(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

#[inline]
fn f32le(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// The 8-lane tree every path ends with.
fn tree8(acc: &[f32; 8]) -> f32 {
    let r: [f32; 4] = std::array::from_fn(|i| acc[i + 4] + acc[i]);
    (r[0] + r[2]) + (r[1] + r[3])
}

/// A block's scales for lanes 0..4 and 4..8 (the same but for Q6K32) and its min (zero
/// without one).
fn scales(kind: IntKind, blk: &[u8]) -> ([f32; 2], f32) {
    match kind {
        IntKind::Q4_1 => ([f16le(blk, 0); 2], f16le(blk, 2)),
        IntKind::Q8_0 | IntKind::Q4_0 => ([f16le(blk, 0); 2], 0.0),
        IntKind::Q4K32 => ([f32le(blk, 0); 2], f32le(blk, 4)),
        IntKind::Q6K32 => ([f32le(blk, 0), f32le(blk, 4)], 0.0),
    }
}

/// Weight value `j` of block `blk` as a signed integer (without its min).
fn weight(kind: IntKind, blk: &[u8], j: usize) -> i32 {
    let at = values_at(kind.tag());
    if kind.signed_bytes() {
        return i32::from(blk[at + j] as i8);
    }
    let byte = blk[at + j % 16];
    let nib = i32::from(if j < 16 { byte & 0xF } else { byte >> 4 });
    if kind == IntKind::Q4_0 { nib - 8 } else { nib }
}

/// The definition, one (row, token) at a time.
pub(super) fn scalar_one(kind: IntKind, row: &[u8], p: &Packed, tt: usize) -> f32 {
    let bs = kind.block_bytes();
    let mut acc = [0f32; 8];
    for b in 0..p.nb {
        let blk = &row[b * bs..(b + 1) * bs];
        let at = b * p.t + tt;
        let (dw, _) = scales(kind, blk);
        let d = [dw[0] * p.ds[at * 8], dw[1] * p.ds[at * 8]];
        for (l, a) in acc.iter_mut().enumerate() {
            let isum: i32 = (4 * l..4 * l + 4)
                .map(|j| weight(kind, blk, j) * i32::from(p.qs[at * 32 + j]))
                .sum();
            *a = d[l / 4].mul_add(isum as f32, *a);
        }
    }
    let mut r = tree8(&acc);
    if kind.has_min() {
        let mut ms = 0f32;
        for b in 0..p.nb {
            let (_, m) = scales(kind, &row[b * bs..(b + 1) * bs]);
            ms += m * p.sums[b * p.tpad + tt];
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

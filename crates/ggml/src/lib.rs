//! pdmesh-ggml: GGML's tensor types and reference (scalar) dequantization for each
//! supported block format, apart from any file: the GGUF reader names its tensors' types
//! with them, and pdmesh-kernels computes on the blocks. The fast paths live in
//! pdmesh-kernels; these are the ground truth they are tested against.

#![forbid(unsafe_code)]

use half::{bf16, f16};

/// GGML tensor element types pdmesh understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4K,
    Q6K,
    Bf16,
}

impl GgmlType {
    /// From the GGUF type id; `None` for types pdmesh does not read.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            14 => Self::Q6K,
            30 => Self::Bf16,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q8_0 => 8,
            Self::Q4K => 12,
            Self::Q6K => 14,
            Self::Bf16 => 30,
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::Bf16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q6K => 210,
        }
    }

    /// Bytes of a row of `n` elements (n must be a multiple of the block size).
    pub fn row_bytes(self, n: usize) -> usize {
        n / self.block_elems() * self.block_bytes()
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantize `n` elements of type `t` from `src` into `dst` (scalar reference).
pub fn dequantize(t: GgmlType, src: &[u8], dst: &mut [f32]) {
    let n = dst.len();
    assert_eq!(
        n % t.block_elems(),
        0,
        "{n} elements is not a whole number of {t:?} blocks"
    );
    assert!(
        src.len() >= t.row_bytes(n),
        "source too short for {n} {t:?} elements"
    );
    let bb = t.block_bytes();
    match t {
        GgmlType::F32 => {
            for (i, d) in dst.iter_mut().enumerate() {
                *d = f32::from_le_bytes(src[4 * i..4 * i + 4].try_into().unwrap());
            }
        }
        GgmlType::F16 => {
            for (i, d) in dst.iter_mut().enumerate() {
                *d = f16_at(src, 2 * i);
            }
        }
        GgmlType::Bf16 => {
            for (i, d) in dst.iter_mut().enumerate() {
                *d = bf16::from_le_bytes([src[2 * i], src[2 * i + 1]]).to_f32();
            }
        }
        GgmlType::Q4_0 => {
            for (blk, out) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(32)) {
                let d = f16_at(blk, 0);
                for j in 0..16 {
                    let q = blk[2 + j];
                    out[j] = ((q & 0xF) as i32 - 8) as f32 * d;
                    out[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (blk, out) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(32)) {
                let d = f16_at(blk, 0);
                let m = f16_at(blk, 2);
                for j in 0..16 {
                    let q = blk[4 + j];
                    out[j] = (q & 0xF) as f32 * d + m;
                    out[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q5_0 => {
            for (blk, out) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(32)) {
                let d = f16_at(blk, 0);
                let qh = u32::from_le_bytes(blk[2..6].try_into().unwrap());
                for j in 0..16 {
                    let q = blk[6 + j];
                    let h0 = ((qh >> j) & 1) << 4;
                    let h1 = ((qh >> (j + 16)) & 1) << 4;
                    out[j] = (((q & 0xF) as u32 | h0) as i32 - 16) as f32 * d;
                    out[j + 16] = (((q >> 4) as u32 | h1) as i32 - 16) as f32 * d;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (blk, out) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(32)) {
                let d = f16_at(blk, 0);
                for j in 0..32 {
                    out[j] = blk[2 + j] as i8 as f32 * d;
                }
            }
        }
        GgmlType::Q4K => {
            for (blk, out) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(256)) {
                let d = f16_at(blk, 0);
                let dmin = f16_at(blk, 2);
                let scales = &blk[4..16];
                let qs = &blk[16..144];
                for j in 0..4 {
                    // 64 values per iteration, two sub-blocks of 32.
                    let (sc1, m1) = scale_min_k4(2 * j, scales);
                    let (sc2, m2) = scale_min_k4(2 * j + 1, scales);
                    let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
                    let (d2, mm2) = (d * sc2 as f32, dmin * m2 as f32);
                    let q = &qs[32 * j..32 * j + 32];
                    for l in 0..32 {
                        out[64 * j + l] = d1 * (q[l] & 0xF) as f32 - mm1;
                        out[64 * j + 32 + l] = d2 * (q[l] >> 4) as f32 - mm2;
                    }
                }
            }
        }
        GgmlType::Q6K => {
            for (blk, out) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(256)) {
                let ql = &blk[0..128];
                let qh = &blk[128..192];
                let sc = &blk[192..208];
                let d = f16_at(blk, 208);
                for half_ in 0..2 {
                    let ql = &ql[64 * half_..];
                    let qh = &qh[32 * half_..];
                    let sc = &sc[8 * half_..];
                    let out = &mut out[128 * half_..];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        out[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        out[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        out[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        out[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
        }
    }
}

/// Q5_0 blocks rewritten as Q8_0 blocks of the same values: the scale is kept, and each
/// 5-bit value (−16..15) becomes an i8, so every value dequantizes to the same f32 and a
/// Q8_0 product computes on the same weights (at 34 bytes per block instead of 22).
pub fn q5_0_as_q8_0(src: &[u8]) -> Vec<u8> {
    let (from, to) = (GgmlType::Q5_0.block_bytes(), GgmlType::Q8_0.block_bytes());
    assert_eq!(src.len() % from, 0, "not whole Q5_0 blocks");
    let mut out = Vec::with_capacity(src.len() / from * to);
    for blk in src.chunks_exact(from) {
        out.extend_from_slice(&blk[0..2]);
        let qh = u32::from_le_bytes(blk[2..6].try_into().unwrap());
        let value = |j: usize| {
            let nib = if j < 16 {
                blk[6 + j] & 0xF
            } else {
                blk[6 + j - 16] >> 4
            };
            let high = ((qh >> j) & 1) as u8;
            ((nib | (high << 4)) as i8 - 16) as u8
        };
        out.extend((0..32).map(value));
    }
    out
}

/// One Q4_K block (256 values) as its eight sub-blocks of 32: per sub-block the scale
/// `d · sc` and the min `dmin · m`, both formed in f32 exactly as [`dequantize`] forms
/// them (value `i` is `scale · q[i] − min`), and the 32 values `q` (0..15) in order.
/// pdmesh-kernels lays these out for its integer products.
pub fn q4k_sub_blocks(blk: &[u8]) -> [(f32, f32, [u8; 32]); 8] {
    assert!(
        blk.len() >= GgmlType::Q4K.block_bytes(),
        "a whole Q4_K block"
    );
    let d = f16_at(blk, 0);
    let dmin = f16_at(blk, 2);
    let scales = &blk[4..16];
    let qs = &blk[16..144];
    std::array::from_fn(|j| {
        let (sc, m) = scale_min_k4(j, scales);
        // Sub-blocks 2i and 2i + 1 are the low and high nibbles of the same 32 bytes.
        let bytes = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        let shift = 4 * (j % 2);
        (
            d * sc as f32,
            dmin * m as f32,
            std::array::from_fn(|l| (bytes[l] >> shift) & 0xF),
        )
    })
}

/// One Q6_K block (256 values) as its sixteen groups of 16: per group the scale
/// `d · sc`, formed in f32 exactly as [`dequantize`] forms it (value `i` is
/// `scale[i / 16] · q[i]`), and the 256 values `q` (−32..31) in order.
pub fn q6k_groups(blk: &[u8]) -> ([f32; 16], [i8; 256]) {
    assert!(
        blk.len() >= GgmlType::Q6K.block_bytes(),
        "a whole Q6_K block"
    );
    let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
    let d = f16_at(blk, 208);
    let scales = std::array::from_fn(|g| d * (sc[g] as i8) as f32);
    // Value 128h + 32k + l (l < 32): the low nibble (k < 2) or the high one (k ≥ 2) of
    // ql[64h + 32(k mod 2) + l], below bits 2k and 2k + 1 of qh[32h + l].
    let values = std::array::from_fn(|i| {
        let (h, k, l) = (i / 128, i % 128 / 32, i % 32);
        let low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0xF;
        let high = (qh[32 * h + l] >> (2 * k)) & 3;
        (low | (high << 4)) as i8 - 32
    });
    (scales, values)
}

/// The 6-bit scale and min of sub-block `j` of a Q4_K block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn q5_0_rewritten_as_q8_0_dequantizes_to_the_same_values() {
        let mut src = Vec::new();
        let mut s = 7u32;
        for b in 0..6 {
            src.extend(h(0.01
                * (b as f32 + 1.0)
                * if b % 2 == 0 { 1.0 } else { -1.0 }));
            for _ in 0..20 {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                src.push((s >> 24) as u8);
            }
        }
        // Block 0: every value at an extreme (all bits set: 15; none: -16).
        src[2..22].fill(0xFF);
        src[24..44].fill(0);
        let q8 = q5_0_as_q8_0(&src);
        assert_eq!(q8.len(), 6 * 34);
        let (mut a, mut b) = (vec![0f32; 192], vec![0f32; 192]);
        dequantize(GgmlType::Q5_0, &src, &mut a);
        dequantize(GgmlType::Q8_0, &q8, &mut b);
        assert_eq!(a, b);
        assert_eq!(q8[2..34], [15u8; 32]);
        assert_eq!(q8[36..68], [(-16i8) as u8; 32]);
    }

    #[test]
    fn q4_0_q4_1_q8_0_blocks() {
        let mut b = h(0.5).to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_0, &b, &mut out);
        assert_eq!(out[0], -4.0);
        assert_eq!(out[15], 3.5);
        assert_eq!(out[16], 3.5);
        assert_eq!(out[31], -4.0);

        let mut b = h(2.0).to_vec();
        b.extend(h(-1.0));
        b.extend((0..16u8).map(|j| j | (1 << 4)));
        dequantize(GgmlType::Q4_1, &b, &mut out);
        assert_eq!(out[3], 5.0);
        assert_eq!(out[20], 1.0);

        let mut b = h(0.25).to_vec();
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        dequantize(GgmlType::Q8_0, &b, &mut out);
        assert_eq!(out[0], -4.0);
        assert_eq!(out[31], 3.75);
    }

    #[test]
    fn q5_0_uses_the_high_bits() {
        let mut b = h(1.0).to_vec();
        b.extend(0xFFFF_0001u32.to_le_bytes()); // high bit for element 0 and 16..31
        b.extend([0u8; 16]);
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q5_0, &b, &mut out);
        assert_eq!(out[0], 0.0); // 16 - 16
        assert_eq!(out[1], -16.0);
        assert_eq!(out[16], 0.0);
    }

    /// Random bytes with the extremes (0x00, 0xFF) mixed in, and the f16 scales at
    /// `at` set to `scales`.
    fn k_blocks(ty: GgmlType, n: usize, at: &[usize], scales: &[f32]) -> Vec<u8> {
        let mut s = 11u32;
        let mut src = Vec::new();
        for b in 0..n {
            let mut blk: Vec<u8> = (0..ty.block_bytes())
                .map(|_| {
                    s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                    match (s >> 8) % 5 {
                        0 => 0x00,
                        1 => 0xFF,
                        _ => (s >> 24) as u8,
                    }
                })
                .collect();
            for (i, &off) in at.iter().enumerate() {
                let v = scales[(b + i) % scales.len()];
                blk[off..off + 2].copy_from_slice(&h(v));
            }
            src.extend(blk);
        }
        src
    }

    const SCALES: [f32; 6] = [0.0123, -0.5, 1.0e-7, 6.0e4, 0.0, 3.0];

    #[test]
    fn q4k_sub_blocks_give_the_dequantized_values() {
        let n = 24;
        let src = k_blocks(GgmlType::Q4K, n, &[0, 2], &SCALES);
        let mut want = vec![0f32; 256 * n];
        dequantize(GgmlType::Q4K, &src, &mut want);
        for (b, blk) in src.chunks_exact(144).enumerate() {
            for (j, (scale, min, q)) in q4k_sub_blocks(blk).into_iter().enumerate() {
                for (l, &q) in q.iter().enumerate() {
                    let v = scale * q as f32 - min;
                    assert_eq!(v.to_bits(), want[256 * b + 32 * j + l].to_bits());
                }
            }
        }
    }

    #[test]
    fn q6k_groups_give_the_dequantized_values() {
        let n = 24;
        let src = k_blocks(GgmlType::Q6K, n, &[208], &SCALES);
        let mut want = vec![0f32; 256 * n];
        dequantize(GgmlType::Q6K, &src, &mut want);
        let mut extremes = (false, false);
        for (b, blk) in src.chunks_exact(210).enumerate() {
            let (scales, q) = q6k_groups(blk);
            for (i, &q) in q.iter().enumerate() {
                let v = scales[i / 16] * q as f32;
                assert_eq!(
                    v.to_bits(),
                    want[256 * b + i].to_bits(),
                    "block {b} value {i}"
                );
                extremes.0 |= q == -32;
                extremes.1 |= q == 31;
            }
        }
        assert_eq!(extremes, (true, true), "both ends of the range were met");
    }

    #[test]
    fn q4k_and_q6k_constant_blocks() {
        // Q4_K: d=1, dmin=0, every sub-block scale 1 (6-bit), every nibble 3 -> 3.0
        let mut b = h(1.0).to_vec();
        b.extend(h(0.0));
        let mut sc = [0u8; 12];
        sc[..4].fill(1);
        sc[8..12].fill(1); // sub-blocks 4..7: low nibble scale 1, min 0
        b.extend(sc);
        b.extend([0x33u8; 128]);
        let mut out = [0f32; 256];
        dequantize(GgmlType::Q4K, &b, &mut out);
        assert!(out.iter().all(|&x| x == 3.0), "{:?}", &out[..8]);
        // Q6_K: all q = 33 (-> +1), scales 2, d = 0.5 -> 1.0
        let mut b = vec![0x11u8; 128]; // low nibbles 1
        b.extend([0xAAu8; 64]); // high 2-bit fields = 2 -> +32
        b.extend([2u8; 16]);
        b.extend(h(0.5));
        dequantize(GgmlType::Q6K, &b, &mut out);
        assert!(out.iter().all(|&x| x == 1.0), "{:?}", &out[..8]);
    }
}

//! Test inputs shared by the kernels' tests: random GGML K-quant blocks with their
//! extremes mixed in.

use half::f16;
use pdmesh_ggml::GgmlType;

/// A small deterministic generator.
pub(crate) struct Lcg(pub(crate) u64);

impl Lcg {
    pub(crate) fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
}

/// f16 super-block scales: ordinary ones of both signs, zero, a subnormal, the largest
/// power of two below f16's maximum and a value near it.
const SCALES: [f32; 8] = [
    0.0123,
    0.002,
    -0.031,
    0.0,
    6.0e-8,
    1.0 / 1024.0,
    32768.0,
    0.75,
];

/// `n` Q4_K or Q6_K blocks: their scales from [`SCALES`] (large ones rarely), their
/// value bytes random with 0x00 and 0xFF mixed in, and every eighth block's values all
/// at the low end, every eighth (shifted by four) all at the high end.
pub(crate) fn k_blocks(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
    let mut r = Lcg(seed);
    let mut out = Vec::with_capacity(n * ty.block_bytes());
    for b in 0..n {
        let byte = |r: &mut Lcg| match r.next() % 6 {
            0 => 0x00,
            1 => 0xFF,
            _ => r.next() as u8,
        };
        let scale = |r: &mut Lcg| {
            let i = r.next() as usize % SCALES.len();
            // The large scales once in a while: a whole row of them would make its sum
            // dwarf every other row's.
            let i = if SCALES[i] > 1.0 && !r.next().is_multiple_of(4) {
                0
            } else {
                i
            };
            f16::from_f32(SCALES[i]).to_le_bytes()
        };
        let fill = match b % 8 {
            0 => Some(0x00),
            4 => Some(0xFF),
            _ => None,
        };
        let mut blk: Vec<u8> = (0..ty.block_bytes()).map(|_| byte(&mut r)).collect();
        match ty {
            GgmlType::Q4K => {
                blk[0..2].copy_from_slice(&scale(&mut r));
                blk[2..4].copy_from_slice(&scale(&mut r));
                if let Some(v) = fill {
                    blk[16..144].fill(v);
                }
            }
            GgmlType::Q6K => {
                if let Some(v) = fill {
                    blk[0..192].fill(v);
                }
                blk[208..210].copy_from_slice(&scale(&mut r));
            }
            _ => panic!("{ty:?} is not a K-quant"),
        }
        out.extend(blk);
    }
    out
}

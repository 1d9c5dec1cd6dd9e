//! How a weight matrix's bytes are laid out ([`WeightFormat`]): GGML's blocks as the GGUF
//! stores them, or one of the kernels' own 32-value layouts that a K-quant is rewritten
//! into once at load, so the integer GEMM computes on it. A rewrite keeps every value:
//! each dequantizes to the same f32 as in the original block.

use pdmesh_ggml::{GgmlType, dequantize, q4k_sub_blocks, q5_0_as_q8_0, q6k_groups};

/// The layout of a weight matrix's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// GGML's blocks of this type, as in the GGUF.
    Ggml(GgmlType),
    /// Q4_K in blocks of 32 values (one Q4_K sub-block each), 24 bytes: the f32 scale
    /// `d · sc`, the f32 offset `−(dmin · m)`, and 16 bytes of 4-bit values `q` in Q4_1's
    /// order (value `j < 16` in the low nibble of byte `j`, value `j + 16` in its high
    /// one); value = `scale · q + offset`.
    Q4K32,
    /// Q6_K in blocks of 32 values, 40 bytes: two f32 scales `d · sc` (one for values
    /// 0..16, one for 16..32) and the 32 values `q` (−32..31) as i8; value =
    /// `scale · q`.
    Q6K32,
}

impl From<GgmlType> for WeightFormat {
    fn from(ty: GgmlType) -> Self {
        Self::Ggml(ty)
    }
}

impl WeightFormat {
    /// Values per block.
    pub fn block_elems(self) -> usize {
        match self {
            Self::Ggml(ty) => ty.block_elems(),
            Self::Q4K32 | Self::Q6K32 => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Ggml(ty) => ty.block_bytes(),
            Self::Q4K32 => 24,
            Self::Q6K32 => 40,
        }
    }

    /// Bytes of a row of `n` values (a multiple of the block size).
    pub fn row_bytes(self, n: usize) -> usize {
        n / self.block_elems() * self.block_bytes()
    }

    /// Dequantize `dst.len()` values from `src`: GGML's reference dequantizer, or for a
    /// rewritten K-quant the same values the original blocks give it.
    pub fn dequantize(self, src: &[u8], dst: &mut [f32]) {
        let ty = match self {
            Self::Ggml(ty) => return dequantize(ty, src, dst),
            Self::Q4K32 => GgmlType::Q4K,
            Self::Q6K32 => GgmlType::Q6K,
        };
        let n = dst.len();
        assert_eq!(
            n % 32,
            0,
            "{n} values is not a whole number of {self:?} blocks"
        );
        assert!(
            src.len() >= self.row_bytes(n),
            "source too short for {n} {ty:?} values"
        );
        let f32_at = |b: &[u8], i: usize| f32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        for (blk, out) in src
            .chunks_exact(self.block_bytes())
            .zip(dst.chunks_exact_mut(32))
        {
            match self {
                Self::Q4K32 => {
                    let (scale, offset) = (f32_at(blk, 0), f32_at(blk, 4));
                    for (j, o) in out.iter_mut().enumerate() {
                        let byte = blk[8 + j % 16];
                        let q = if j < 16 { byte & 0xF } else { byte >> 4 };
                        // The original's `scale · q − min`, bit for bit: x − m = x + (−m).
                        *o = scale * q as f32 + offset;
                    }
                }
                _ => {
                    let scales = [f32_at(blk, 0), f32_at(blk, 4)];
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = scales[j / 16] * (blk[8 + j] as i8) as f32;
                    }
                }
            }
        }
    }

    /// GGML blocks `src` of type `ty` rewritten into the layout the integer kernels take
    /// for them, with the same values: Q5_0 as Q8_0, Q4_K as [`Q4K32`](Self::Q4K32),
    /// Q6_K as [`Q6K32`](Self::Q6K32). `None` for the other types (computed on as they
    /// are).
    pub fn rewrite(ty: GgmlType, src: &[u8]) -> Option<(WeightFormat, Vec<u8>)> {
        let to = match ty {
            GgmlType::Q5_0 => return Some((Self::Ggml(GgmlType::Q8_0), q5_0_as_q8_0(src))),
            GgmlType::Q4K => Self::Q4K32,
            GgmlType::Q6K => Self::Q6K32,
            _ => return None,
        };
        let from = ty.block_bytes();
        assert_eq!(src.len() % from, 0, "not whole {ty:?} blocks");
        let mut out = Vec::with_capacity(src.len() / from * 8 * to.block_bytes());
        for blk in src.chunks_exact(from) {
            if ty == GgmlType::Q4K {
                for (scale, min, q) in q4k_sub_blocks(blk) {
                    out.extend(scale.to_le_bytes());
                    out.extend((-min).to_le_bytes());
                    out.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
                }
            } else {
                let (scales, q) = q6k_groups(blk);
                for b in 0..8 {
                    out.extend(scales[2 * b].to_le_bytes());
                    out.extend(scales[2 * b + 1].to_le_bytes());
                    out.extend(q[32 * b..32 * b + 32].iter().map(|&v| v as u8));
                }
            }
        }
        Some((to, out))
    }
}

#[cfg(test)]
mod tests;

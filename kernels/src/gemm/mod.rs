//! Quantized weight rows × a batch of tokens' quantized activations: the integer GEMM
//! behind every Q4_0 / Q4_1 / Q8_0 matrix product, and Q4_K / Q6_K ones rewritten at load
//! into 32-value blocks (`WeightFormat::Q4K32`, `Q6K32`; Q5_0 becomes Q8_0).
//!
//! One order of operations defines every result, and all three paths (AVX-512 VNNI,
//! AVX2, scalar) perform exactly it, so they agree bit for bit, and a token's result
//! depends only on its row and its activations, never on the batch or the tile it landed
//! in. For the GGML formats it is llama.cpp's x86 order (`ggml_vec_dot_q4_1_q8_1` and
//! friends), so results stay as close to llama.cpp's as a different attention allows; the
//! rewritten K-quants take the same order per 32 values (llama.cpp's K-quant products
//! work per 256-value super-block on Q8_K activations, which this does not reproduce).
//! For a row and a token:
//!
//! - 8 float lanes: lane `l` of block `b` covers the block's values `4l .. 4l + 4`;
//! - per block and lane: the exact integer sum of the lane's four weight × activation
//!   products (weights as signed values: Q4_0 nibble − 8, Q8_0 and Q6K32 bytes; Q4_1 and
//!   Q4K32 nibbles, whose min is added apart), then `acc[l] = fma(dw · da_b, sum,
//!   acc[l])`, the scale product rounded once in f32, blocks in order; `dw` is the
//!   block's scale (f16 → f32 for the GGML formats, f32 for the rewritten ones), for
//!   Q6K32 the scale of the lane's half block: lanes 0..4 the first, 4..8 the second;
//! - the 8 lanes reduced by one fixed tree: `s[i + 4] + s[i]`, then `r[0] + r[2]` and
//!   `r[1] + r[3]`, then their sum;
//! - Q4_1 and Q4K32 only: plus `Σ_b m_b · s_b` (weight min times the activations' scaled
//!   sum), each product rounded, then added block by block, starting from zero. Q4_1
//!   takes Q8_1 activations, whose `s_b` is rounded through f16 as llama.cpp's; Q4K32
//!   takes Q8_0 ones with `s_b = da_b · Σ q`, exact in f32, so its products are those of
//!   the Q4_K weights' exact values (llama.cpp's Q4_K product sums its mins in integers
//!   too) and only the activations' rounding separates them from a float product.
//!
//! The SIMD paths are register-blocked: a weight block is unpacked once into registers
//! and used for up to 32 tokens (AVX-512 VNNI: two tokens' eight lanes per 512-bit
//! register, 16 registers of accumulators; an odd last token in a 256-bit one) or 4
//! (AVX2), and the activations are laid out once per product so each token's block is
//! one load (two adjacent tokens' blocks, one 512-bit load). From `TWO_ROWS_FROM`
//! tokens on, VNNI computes two rows per pass, each activation load serving both.
//!
//! AVX2 works on 128-bit halves (lanes 0..4 and 4..8; cores that split 256-bit
//! operations in two then do no cross-half shuffles), forms a tile's scale products once
//! in one register (Q6K32: one per half), and below `FEW_TOKENS` tokens computes two rows of one token per
//! pass instead of tiles: a single token's row is one chain of dependent fmas, and two
//! rows' chains overlap.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod packed;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod simd;
#[cfg(test)]
mod tests;

use self::scalar::scalar_rows;
use crate::dot::{has_avx2, has_vnni};

pub(crate) use self::packed::{IntKind, Packed};

/// Rows of `data` (`rb` bytes each) times every token of `p`: `out[token][row]`, one
/// slice per token, each as long as the rows (so a task writes its rows of every token's
/// output in place, with no transposing copy).
pub(crate) fn rows(kind: IntKind, data: &[u8], rb: usize, p: &Packed, out: &mut [&mut [f32]]) {
    let t = p.t;
    assert_eq!(rb, p.nb * kind.block_bytes(), "row width");
    assert_eq!(data.len() % rb, 0);
    assert_eq!(out.len(), t, "one output slice per token");
    for o in out.iter() {
        assert_eq!(o.len(), data.len() / rb, "an output slice holds every row");
    }
    match kind {
        IntKind::Q4_1 | IntKind::Q4K32 => {
            assert_eq!(p.sums.len(), p.nb * p.tpad, "packed without sums")
        }
        IntKind::Q4_0 => assert_eq!(p.starts.len(), t * p.nb * 8, "packed without offsets"),
        IntKind::Q8_0 | IntKind::Q6K32 => {}
    }
    #[cfg(target_arch = "x86_64")]
    if has_vnni() {
        if kind.signed_bytes() {
            assert_eq!(p.shifted.len(), p.qs.len(), "packed for another path");
        }
        // SAFETY: the CPU has every feature these functions enable; every length they
        // index by was asserted above.
        unsafe { avx512::rows(kind.tag(), data, rb, p, out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as above.
        unsafe { avx2::rows(kind.tag(), data, rb, p, out) };
        return;
    }
    scalar_rows(kind, data, rb, p, out);
}

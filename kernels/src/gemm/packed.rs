//! The weight formats the integer GEMM takes, and a batch's activations laid out for it
//! once per matrix product ([`Packed`]).

use crate::QActs;
use crate::dot::has_vnni;

/// Weight formats with an integer dot product against quantized activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IntKind {
    /// Q4_1 weights (20-byte blocks: f16 d, f16 m, 16 nibble bytes), Q8_1 activations.
    Q4_1,
    /// Q8_0 weights (34-byte blocks: f16 d, 32 i8), Q8_0 activations.
    Q8_0,
    /// Q4_0 weights (18-byte blocks: f16 d, 16 nibble bytes, offset 8), Q8_0 activations.
    Q4_0,
    /// Q4_K rewritten (`WeightFormat::Q4K32`; 24-byte blocks: f32 d, f32 m, 16 nibble
    /// bytes in Q4_1's order): Q4_1 with f32 scales, Q8_0 activations with exact sums.
    Q4K32,
    /// Q6_K rewritten (`WeightFormat::Q6K32`; 40-byte blocks: f32 d for values 0..16,
    /// f32 d for 16..32, 32 i8): Q8_0 with a scale per half block, Q8_0 activations.
    Q6K32,
}

impl IntKind {
    pub(super) fn block_bytes(self) -> usize {
        match self {
            IntKind::Q4_1 => 20,
            IntKind::Q8_0 => 34,
            IntKind::Q4_0 => 18,
            IntKind::Q4K32 => 24,
            IntKind::Q6K32 => 40,
        }
    }

    /// Const-generic tag of the SIMD kernels.
    pub(super) fn tag(self) -> u8 {
        match self {
            IntKind::Q4_1 => Q4_1,
            IntKind::Q8_0 => Q8_0,
            IntKind::Q4_0 => Q4_0,
            IntKind::Q4K32 => Q4K32,
            IntKind::Q6K32 => Q6K32,
        }
    }

    /// Whether a block has a min (an offset added apart, times the activations' sum).
    pub(super) fn has_min(self) -> bool {
        has_min(self.tag())
    }

    /// Whether the weights are signed bytes (the VNNI path takes its activations
    /// shifted to unsigned).
    pub(super) fn signed_bytes(self) -> bool {
        signed_bytes(self.tag())
    }

    /// Whether the activations come as Q8_1 (Q4_1 alone: its min uses their f16-rounded
    /// scaled sums, as llama.cpp's does).
    pub(crate) fn takes_q8_1(self) -> bool {
        self == IntKind::Q4_1
    }
}

pub(super) const Q4_1: u8 = 0;
pub(super) const Q8_0: u8 = 1;
pub(super) const Q4_0: u8 = 2;
pub(super) const Q4K32: u8 = 3;
pub(super) const Q6K32: u8 = 4;

/// Formats with a min: Q4_1 and Q4K32.
pub(super) const fn has_min(k: u8) -> bool {
    k == Q4_1 || k == Q4K32
}

/// Formats whose values are signed bytes: Q8_0 and Q6K32.
pub(super) const fn signed_bytes(k: u8) -> bool {
    k == Q8_0 || k == Q6K32
}

/// Formats whose scales are f32 (the others' are f16): Q4K32 and Q6K32.
pub(super) const fn f32_scales(k: u8) -> bool {
    k == Q4K32 || k == Q6K32
}

/// Where a block's values start: after its scales.
pub(super) const fn values_at(k: u8) -> usize {
    match k {
        Q4_1 => 4,
        Q8_0 | Q4_0 => 2,
        _ => 8,
    }
}

/// The widest tile's tokens: the min sums (Q4_1, Q4K32) are read this many at a time.
const SUM_LANES: usize = 16;

/// A batch's activations laid out for the kernels once per matrix product, block-major
/// (`[block][token]`, so a tile's tokens sit side by side): per block and token the 32
/// values and the scale repeated in 8 lanes; for Q8_0 and Q6K32 weights on the VNNI path
/// the values shifted to unsigned (`q + 128`, the operand `vpdpbusd` takes); for Q4_0
/// weights per lane `−8 ·` the sum of its four values (the nibble offset); for the
/// formats with a min the scaled sums with tokens side by side, `sums[b · tpad + t]`
/// (Q4_1: Q8_1's, rounded through f16; Q4K32: `d · Σ q`, exact in f32).
pub(crate) struct Packed {
    pub(super) t: usize,
    pub(super) nb: usize,
    pub(super) qs: Vec<i8>,
    pub(super) ds: Vec<f32>,
    /// The scales once each, `d1[b · t + token]`, and four zeros past the last (the
    /// AVX2 tile reads four tokens' scales at a time).
    pub(super) d1: Vec<f32>,
    pub(super) shifted: Vec<u8>,
    pub(super) starts: Vec<i32>,
    pub(super) sums: Vec<f32>,
    pub(super) tpad: usize,
}

impl Packed {
    /// `acts`: one token each, all of `nb` blocks. `kinds`: the weight formats this batch
    /// will meet (Q4_1 needs Q8_1 activations, the others Q8_0; not both kinds at once).
    pub(crate) fn new(acts: &[QActs], nb: usize, kinds: &[IntKind]) -> Self {
        let t = acts.len();
        // Room for a tile's full vectors past its last token.
        let tpad = t.div_ceil(SUM_LANES) * SUM_LANES + SUM_LANES;
        let mut p = Packed {
            t,
            nb,
            qs: vec![0; t * nb * 32],
            ds: vec![0.0; t * nb * 8],
            d1: vec![0.0; t * nb + 4],
            shifted: Vec::new(),
            starts: Vec::new(),
            sums: Vec::new(),
            tpad,
        };
        for (tt, a) in acts.iter().enumerate() {
            assert!(
                a.qs.len() >= nb * 32 && a.d.len() >= nb,
                "activations of {nb} blocks"
            );
            for b in 0..nb {
                let at = b * t + tt;
                p.qs[at * 32..at * 32 + 32].copy_from_slice(&a.qs[b * 32..b * 32 + 32]);
                p.ds[at * 8..at * 8 + 8].fill(a.d[b]);
                p.d1[at] = a.d[b];
            }
        }
        if kinds.iter().any(|k| k.signed_bytes()) && has_vnni() {
            p.shifted = p.qs.iter().map(|&q| q as u8 ^ 0x80).collect();
        }
        if kinds.contains(&IntKind::Q4_0) {
            p.starts =
                p.qs.chunks_exact(4)
                    .map(|q| -8 * q.iter().map(|&v| i32::from(v)).sum::<i32>())
                    .collect();
        }
        let q8_1 = kinds.iter().any(|k| k.takes_q8_1());
        assert!(
            !q8_1 || kinds.iter().all(|k| k.takes_q8_1()),
            "Q8_1 and Q8_0 activations packed apart"
        );
        if kinds.iter().any(|k| k.has_min()) {
            p.sums = vec![0.0; nb * tpad];
            for (tt, a) in acts.iter().enumerate() {
                assert!(!q8_1 || a.s.len() >= nb, "Q4_1 needs Q8_1 activations");
                for b in 0..nb {
                    p.sums[b * tpad + tt] = if q8_1 {
                        a.s[b]
                    } else {
                        // |Σ q| <= 32 · 127 < 2^12 and d is an f16 value (11 significant
                        // bits): the product is exact in f32.
                        let sum: i32 = a.qs[b * 32..b * 32 + 32]
                            .iter()
                            .map(|&q| i32::from(q))
                            .sum();
                        a.d[b] * sum as f32
                    };
                }
            }
        }
        p
    }

    pub(crate) fn tokens(&self) -> usize {
        self.t
    }
}

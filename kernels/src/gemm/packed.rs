//! The weight formats the integer GEMM takes, and a batch's activations laid out for it
//! once per matrix product ([`Packed`]).

use crate::QActs;
use crate::dot::has_vnni;

/// Weight formats with an integer dot product against quantized activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IntKind {
    /// Q4_1 weights (20-byte blocks: d, m, 16 nibble bytes), Q8_1 activations.
    Q4_1,
    /// Q8_0 weights (34-byte blocks: d, 32 i8), Q8_0 activations.
    Q8_0,
    /// Q4_0 weights (18-byte blocks: d, 16 nibble bytes, offset 8), Q8_0 activations.
    Q4_0,
}

impl IntKind {
    pub(super) fn block_bytes(self) -> usize {
        match self {
            IntKind::Q4_1 => 20,
            IntKind::Q8_0 => 34,
            IntKind::Q4_0 => 18,
        }
    }

    /// Const-generic tag of the SIMD kernels.
    pub(super) fn tag(self) -> u8 {
        match self {
            IntKind::Q4_1 => Q4_1,
            IntKind::Q8_0 => Q8_0,
            IntKind::Q4_0 => Q4_0,
        }
    }
}

pub(super) const Q4_1: u8 = 0;
pub(super) const Q8_0: u8 = 1;
pub(super) const Q4_0: u8 = 2;

/// The widest tile's tokens: the Q4_1 min sums are read this many at a time.
const SUM_LANES: usize = 16;

/// A batch's activations laid out for the kernels once per matrix product, block-major
/// (`[block][token]`, so a tile's tokens sit side by side): per block and token the 32
/// values and the scale repeated in 8 lanes; for Q8_0 weights on the VNNI path the values
/// shifted to unsigned (`q + 128`, the operand `vpdpbusd` takes); for Q4_0 weights per lane
/// `−8 ·` the sum of its four values (the nibble offset); for Q4_1 weights the scaled sums
/// with tokens side by side, `sums[b · tpad + t]`.
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
    /// will meet (Q4_1 needs Q8_1 activations, the others Q8_0).
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
        if kinds.contains(&IntKind::Q8_0) && has_vnni() {
            p.shifted = p.qs.iter().map(|&q| q as u8 ^ 0x80).collect();
        }
        if kinds.contains(&IntKind::Q4_0) {
            p.starts =
                p.qs.chunks_exact(4)
                    .map(|q| -8 * q.iter().map(|&v| i32::from(v)).sum::<i32>())
                    .collect();
        }
        if kinds.contains(&IntKind::Q4_1) {
            p.sums = vec![0.0; nb * tpad];
            for (tt, a) in acts.iter().enumerate() {
                assert!(a.s.len() >= nb, "Q4_1 needs Q8_1 activations");
                for b in 0..nb {
                    p.sums[b * tpad + tt] = a.s[b];
                }
            }
        }
        p
    }

    pub(crate) fn tokens(&self) -> usize {
        self.t
    }
}

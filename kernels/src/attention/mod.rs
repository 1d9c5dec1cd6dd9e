//! Attention of query tokens over one KV group's cached f16 rows: scores, softmax and the
//! weighted sum of values, converting K and V from f16 as they are read.
//!
//! One order of operations defines every result (the scalar path performs it literally):
//! per query head, the query rounded through f16; per key, eight lanes each adding
//! `q[c + l] · k[c + l]` over the chunks `c` in order (a multiply, then an add), reduced by
//! the tree `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))` and multiplied by the scale;
//! the max; `e = exp(s − max)` with [`exp_f32`]; their sum in f64, keys in order;
//! `p = f16(e · (1 / sum))`; and per output lane `o += p · v`, keys in order from zero.
//! The SIMD paths perform exactly these operations, so every path gives the same bits,
//! and a token's result never depends on its batch or on the other tokens of its tile.
//! Both products are of two f16 values (the query and the probabilities are rounded
//! through f16), so each is exact in f32 and a fused multiply-add rounds exactly as the
//! multiply then the add; the AVX-512 path fuses them.
//!
//! The SIMD paths compute a tile of query tokens of one sequence at once (every head of
//! the group, every token of the tile): each block of keys and values (16 on AVX-512, 8
//! on AVX2) is converted from f16 once for all of them, and the lane sums of a block's
//! keys are reduced by the tree across registers (AVX-512: two keys' eight lanes per
//! register; AVX2: one key per register). On AVX-512 exp, the probabilities and the
//! weighted sums are 16 lanes wide; on AVX2 exp is four f64 lanes and the rest eight.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod exp;
mod scalar;
#[cfg(test)]
mod tests;

use half::f16;

use self::scalar::attend_one;
use crate::dot::{has_avx2, has_avx512};

pub use self::exp::exp_f32;

/// For each of the `q.len() / hd` heads sharing this KV group:
/// `out[r] = softmax(scale · q_r · Kᵀ) · V`, where `keys[j]` and `values[j]` are position
/// j's rows. Queries and probabilities are rounded through f16, as llama.cpp does with an
/// f16 cache.
pub fn attend(
    q: &[f32],
    hd: usize,
    keys: &[&[f16]],
    values: &[&[f16]],
    scale: f32,
    out: &mut [f32],
) {
    attend_causal(&[q], hd, &[keys.len()], keys, values, scale, &mut [out]);
}

/// [`attend`] for several query tokens of one sequence at once: token `i` (its heads of
/// this group, `qs[i]`) attends over the first `counts[i]` keys and values, into
/// `outs[i]`; each result is the same bits as that token's [`attend`] alone.
pub fn attend_causal(
    qs: &[&[f32]],
    hd: usize,
    counts: &[usize],
    keys: &[&[f16]],
    values: &[&[f16]],
    scale: f32,
    outs: &mut [&mut [f32]],
) {
    let starts = vec![0; qs.len()];
    let tile = Tile {
        qs,
        hd,
        starts: &starts,
        counts,
        keys,
        values,
        scale,
    };
    attend_window(&tile, outs);
}

/// A tile of query tokens of one sequence over one KV group's cached rows: token `i`
/// (its heads of the group, `qs[i]`, each `hd` wide) attends over keys and values
/// `starts[i]..counts[i]`.
#[derive(Clone, Copy, Debug)]
pub struct Tile<'a> {
    pub qs: &'a [&'a [f32]],
    pub hd: usize,
    pub starts: &'a [usize],
    pub counts: &'a [usize],
    pub keys: &'a [&'a [f16]],
    pub values: &'a [&'a [f16]],
    pub scale: f32,
}

/// [`attend_causal`] for tokens of a sliding window: each token of `tile` attends over
/// its own keys, into `outs[i]`, the same bits as its [`attend`] over those keys alone.
/// A tile's tokens need not share a first key: the keys before a token's own are given
/// probability zero after the exp, and adding an exact zero (to the f64 sum, and as
/// `0 · v` to an output lane that starts at +0) changes no bit.
pub fn attend_window(tile: &Tile<'_>, outs: &mut [&mut [f32]]) {
    attend_causal_on(Path::detect(tile.hd), tile, outs);
}

/// The implementations, which give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Scalar,
    Avx2,
    Avx512,
}

impl Path {
    fn detect(hd: usize) -> Path {
        if cfg!(target_arch = "x86_64") && has_avx512() && hd.is_multiple_of(16) {
            Path::Avx512
        } else if cfg!(target_arch = "x86_64") && has_avx2() {
            Path::Avx2
        } else {
            Path::Scalar
        }
    }
}

fn attend_causal_on(path: Path, tile: &Tile<'_>, outs: &mut [&mut [f32]]) {
    let (qs, hd, scale) = (tile.qs, tile.hd, tile.scale);
    let (starts, counts, keys, values) = (tile.starts, tile.counts, tile.keys, tile.values);
    let t = qs.len();
    assert!(t > 0 && counts.len() == t && outs.len() == t && hd.is_multiple_of(8));
    assert!(starts.len() == t && starts.iter().zip(counts).all(|(s, c)| s < c));
    let rep = qs[0].len() / hd;
    assert!(rep > 0 && qs.iter().all(|q| q.len() == rep * hd));
    assert!(outs.iter().all(|o| o.len() == rep * hd));
    let n = counts.iter().copied().max().unwrap_or(0);
    assert!(counts.iter().all(|&c| c > 0) && keys.len() >= n && values.len() >= n);
    assert!(keys[..n].iter().chain(&values[..n]).all(|r| r.len() == hd));
    #[cfg(target_arch = "x86_64")]
    if path == Path::Avx512 {
        assert!(hd.is_multiple_of(16));
        // SAFETY: Path::Avx512 is only chosen (or forced by tests) on a CPU with avx512f,
        // avx2, fma and f16c; every shape the function indexes by was asserted above.
        unsafe { avx512::attend_causal(tile, outs) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if path == Path::Avx2 {
        // SAFETY: Path::Avx2 is only chosen (or forced by tests) on a CPU with avx2, fma
        // and f16c; every shape the function indexes by was asserted above.
        unsafe { avx2::attend_causal(tile, outs) };
        return;
    }
    for (((q, &s), &c), o) in qs.iter().zip(starts).zip(counts).zip(outs.iter_mut()) {
        attend_one(q, hd, &keys[s..c], &values[s..c], scale, o);
    }
}

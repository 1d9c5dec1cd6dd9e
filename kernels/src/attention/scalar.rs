//! The scalar path: one query token at a time, performing the module's order of
//! operations literally. It is the definition the SIMD paths give the bits of.

use half::f16;

use super::exp::exp_f32;

/// One query token (its `q.len() / hd` heads) over all of `keys`, one head at a time:
/// the definition the SIMD paths give the bits of.
pub(super) fn attend_one(
    q: &[f32],
    hd: usize,
    keys: &[&[f16]],
    values: &[&[f16]],
    scale: f32,
    out: &mut [f32],
) {
    let rep = q.len() / hd;
    let n = keys.len();
    let qh: Vec<f32> = q.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
    let mut scores = vec![0f32; n];
    for r in 0..rep {
        let qh = &qh[r * hd..(r + 1) * hd];
        for (s, k) in scores.iter_mut().zip(keys) {
            *s = tree(scalar_dot_lanes(qh, k), scale);
        }
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        scalar_softmax(&mut scores, max);
        scalar_weighted_sum(&scores, values, &mut out[r * hd..(r + 1) * hd]);
    }
}

/// A key's eight lane sums reduced by the module's tree, times the scale.
#[inline(always)]
fn tree(lanes: [f32; 8], scale: f32) -> f32 {
    (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])))
        * scale
}

/// Scores to probabilities: `e = exp(s − max)`, their sum in f64 in key order, then
/// `f16(e · (1 / sum))`.
pub(super) fn scalar_softmax(scores: &mut [f32], max: f32) {
    let mut sum = 0f64;
    for s in scores.iter_mut() {
        *s = exp_f32(*s - max);
        sum += *s as f64;
    }
    let inv = (1.0 / sum) as f32;
    for s in scores.iter_mut() {
        *s = f16::from_f32(*s * inv).to_f32();
    }
}

/// Eight lane sums of q·k: lane l adds q[c+l]·k[c+l] over the chunks c in order.
fn scalar_dot_lanes(q: &[f32], k: &[f16]) -> [f32; 8] {
    let mut lanes = [0f32; 8];
    for (cq, ck) in q.chunks_exact(8).zip(k.chunks_exact(8)) {
        for l in 0..8 {
            lanes[l] += cq[l] * ck[l].to_f32();
        }
    }
    lanes
}

fn scalar_weighted_sum(p: &[f32], values: &[&[f16]], o: &mut [f32]) {
    o.fill(0.0);
    for (&pj, v) in p.iter().zip(values) {
        for (od, vd) in o.iter_mut().zip(v.iter()) {
            *od += pj * vd.to_f32();
        }
    }
}

//! The per-token operations of the forward that the CUDA ranks and the tests check
//! against: the router, the indexer's score, rope, LayerNorm, the Hadamard rotation.

use super::config::DsConfig;

/// cos and sin of `pos × freq` for each rotated pair (the GPU backend's tables too).
pub(crate) fn rope_at(freqs: &[f32], pos: usize) -> (Vec<f32>, Vec<f32>) {
    freqs
        .iter()
        .map(|&f| {
            let a = pos as f32 * f;
            (a.cos(), a.sin())
        })
        .unzip()
}

/// DeepSeek's router for one token: sigmoid scores; the correction bias only for choosing;
/// the best `topk_group` groups by the sum of their two best; the top experts of those;
/// weights from the plain scores, normalized and scaled. In selection order (best first,
/// lower id on ties).
pub fn route(c: &DsConfig, logits: &[f32], bias: &[f32]) -> Vec<(usize, f32)> {
    let e = logits.len();
    let s: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
    let mut sel: Vec<f32> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
    let per = e / c.n_group;
    let mut groups: Vec<(f32, usize)> = (0..c.n_group)
        .map(|g| {
            let mut v: Vec<f32> = sel[g * per..(g + 1) * per].to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            (v.iter().take(2).sum(), g)
        })
        .collect();
    groups.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, g) in &groups[c.topk_group..] {
        sel[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
    }
    let mut order: Vec<usize> = (0..e).collect();
    order.sort_by(|&a, &b| sel[b].total_cmp(&sel[a]).then(a.cmp(&b)));
    let ids = &order[..c.num_experts_per_tok];
    let mut w: Vec<f32> = ids.iter().map(|&i| s[i]).collect();
    if c.norm_topk_prob {
        let sum: f32 = w.iter().sum::<f32>() + 1e-20;
        w.iter_mut().for_each(|v| *v /= sum);
    }
    w.iter_mut().for_each(|v| *v *= c.routed_scaling_factor);
    ids.iter().copied().zip(w).collect()
}

/// The indexer's score of one cached key: Σ_h w[h] · ReLU(q_h · k).
pub fn index_score(q: &[f32], w: &[f32], k: &[f32]) -> f32 {
    q.chunks_exact(k.len())
        .zip(w)
        .map(|(qh, &wh)| wh * dot(qh, k).max(0.0))
        .sum()
}

/// f32 dot product in a fixed order: eight running lanes (so the compiler vectorizes it),
/// summed pairwise, then the tail.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n8 = a.len() / 8 * 8;
    let mut lanes = [0f32; 8];
    for (ca, cb) in a[..n8].chunks_exact(8).zip(b[..n8].chunks_exact(8)) {
        for l in 0..8 {
            lanes[l] += ca[l] * cb[l];
        }
    }
    let mut s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (x, y) in a[n8..].iter().zip(&b[n8..]) {
        s += x * y;
    }
    s
}

/// LayerNorm with weight and bias, in place.
pub fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps as f64).sqrt();
    for ((v, &wi), &bi) in x.iter_mut().zip(w).zip(b) {
        *v = ((*v as f64 - mean) * inv) as f32 * wi + bi;
    }
}

/// Rope on adjacent pairs (2i, 2i+1): MLA's form.
pub fn rope_interleaved(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    for (i, (&c, &s)) in cos.iter().zip(sin).enumerate() {
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

/// Rope on pairs (i, i + d/2): the indexer's form.
pub fn rope_half(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    for (i, (&c, &s)) in cos.iter().zip(sin).enumerate() {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = a * s + b * c;
    }
}

/// The orthonormal Sylvester-Hadamard rotation (butterflies, then 1/sqrt(n)), in place.
pub fn hadamard(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for blk in (0..n).step_by(2 * h) {
            for j in blk..blk + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= s);
}

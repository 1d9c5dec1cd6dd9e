//! The DeepSeek V3.2 forward pass (architecture `deepseek_v32`): multi-head latent
//! attention (MLA) in its absorbed form over a cache of per-token latents, the DSA
//! "lightning indexer" choosing which cached tokens each query attends to, and
//! mixture-of-experts feed-forward layers after the first dense ones.
//!
//! Weights come from safetensors files and an HF-style `config.json` under the public
//! checkpoint's tensor names; fp8 block-scaled weights (`weight_scale_inv`, 128 × 128
//! blocks) are dequantized at load. Compute is f32. The cache holds, per token and layer,
//! the normalized latent and the rotated rope key (bf16, or fp8 with per-128 scales) and
//! the indexer's key (fp8 with its scale at the page tail, or bf16), as
//! [`KvLayout::deepseek_v32`] lays them out.
//!
//! Every token runs the same per-token code against what the cache holds — its own key is
//! written before anyone reads — so a token's logits do not depend on its batch, on how
//! its prompt was chunked, or on which tier or worker its prefix's pages came from.

mod cache;
mod config;
mod ops;
mod weights;

use std::collections::HashMap;
use std::path::Path;

use pdmesh_kernels::{matmul, matmul_many};
use pdmesh_kv::{PageId, PagePool};
use rayon::prelude::*;

use self::cache::{CacheComps, read_index_k, read_latent, round_like_index_k, write_entry};
use self::ops::dot;
use self::weights::{Indexer, Tensors, swiglu};
use crate::EngineError;
use crate::model::{BatchToken, add_in_place, output_logits, rms_norm};

pub use self::config::{DsConfig, RopeScaling, TokenIds};
pub(crate) use self::ops::rope_at;
pub use self::ops::{hadamard, index_score, layer_norm, rope_half, rope_interleaved, route};
pub(crate) use self::weights::{Ffn, Layer, Lin, Mlp};

/// The model, weights dequantized to f32.
pub struct DeepSeekModel {
    pub cfg: DsConfig,
    pub(crate) embed: Vec<f32>,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Vec<f32>,
    pub(crate) lm_head: Lin,
    freqs: Vec<f32>,
    pub(crate) scale: f32,
    /// Attend to every cached token, ignoring the indexer's choice (for benchmarks and
    /// tests comparing sparse with dense attention over the same cache).
    pub dense: bool,
}

impl DeepSeekModel {
    /// Loads `dir/config.json` and every `dir/*.safetensors`.
    pub fn load(dir: &Path) -> Result<Self, EngineError> {
        let cfg = DsConfig::read(dir)?;
        let t = Tensors::open(dir)?;
        let c = &cfg;
        let d = c.hidden_size;
        let h = c.num_attention_heads;
        let qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
        let mlp = |p: &str, inter: usize| -> Result<Mlp, EngineError> {
            Ok(Mlp {
                gate: t.lin(&format!("{p}.gate_proj.weight"), inter, d)?,
                up: t.lin(&format!("{p}.up_proj.weight"), inter, d)?,
                down: t.lin(&format!("{p}.down_proj.weight"), d, inter)?,
            })
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let a = format!("{p}.self_attn");
            let ffn = if c.is_moe(l) {
                let e = c.n_routed_experts;
                Ffn::Moe {
                    gate: t.lin(&format!("{p}.mlp.gate.weight"), e, d)?,
                    bias: t.f32(&format!("{p}.mlp.gate.e_score_correction_bias"), &[e])?,
                    experts: (0..e)
                        .map(|j| mlp(&format!("{p}.mlp.experts.{j}"), c.moe_intermediate_size))
                        .collect::<Result<_, _>>()?,
                    shared: (c.n_shared_experts > 0)
                        .then(|| {
                            mlp(
                                &format!("{p}.mlp.shared_experts"),
                                c.moe_intermediate_size * c.n_shared_experts,
                            )
                        })
                        .transpose()?,
                }
            } else {
                Ffn::Dense(mlp(&format!("{p}.mlp"), c.intermediate_size)?)
            };
            layers.push(Layer {
                in_norm: t.f32(&format!("{p}.input_layernorm.weight"), &[d])?,
                post_norm: t.f32(&format!("{p}.post_attention_layernorm.weight"), &[d])?,
                q_a: t.lin(&format!("{a}.q_a_proj.weight"), c.q_lora_rank, d)?,
                q_a_norm: t.f32(&format!("{a}.q_a_layernorm.weight"), &[c.q_lora_rank])?,
                q_b: t.lin(&format!("{a}.q_b_proj.weight"), h * qk, c.q_lora_rank)?,
                kv_a: t.lin(
                    &format!("{a}.kv_a_proj_with_mqa.weight"),
                    c.kv_lora_rank + c.qk_rope_head_dim,
                    d,
                )?,
                kv_a_norm: t.f32(&format!("{a}.kv_a_layernorm.weight"), &[c.kv_lora_rank])?,
                kv_b: t.lin(
                    &format!("{a}.kv_b_proj.weight"),
                    h * (c.qk_nope_head_dim + c.v_head_dim),
                    c.kv_lora_rank,
                )?,
                o: t.lin(&format!("{a}.o_proj.weight"), d, h * c.v_head_dim)?,
                idx: Indexer {
                    wq_b: t.lin(
                        &format!("{a}.indexer.wq_b.weight"),
                        c.index_n_heads * c.index_head_dim,
                        c.q_lora_rank,
                    )?,
                    wk: t.lin(&format!("{a}.indexer.wk.weight"), c.index_head_dim, d)?,
                    k_norm_w: t.f32(&format!("{a}.indexer.k_norm.weight"), &[c.index_head_dim])?,
                    k_norm_b: t.f32(&format!("{a}.indexer.k_norm.bias"), &[c.index_head_dim])?,
                    weights_proj: t.lin(
                        &format!("{a}.indexer.weights_proj.weight"),
                        c.index_n_heads,
                        d,
                    )?,
                },
                ffn,
            });
        }
        let embed = t.f32("model.embed_tokens.weight", &[c.vocab_size, d])?;
        let lm_head = if t.has("lm_head.weight") {
            t.lin("lm_head.weight", c.vocab_size, d)?
        } else if c.tie_word_embeddings {
            Lin {
                w: embed.clone(),
                rows: c.vocab_size,
                cols: d,
            }
        } else {
            return Err(EngineError::Unsupported(
                "tensor lm_head.weight is missing".into(),
            ));
        };
        let norm = t.f32("model.norm.weight", &[d])?;
        Ok(Self {
            freqs: cfg.rope_freqs(),
            scale: cfg.softmax_scale(),
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            dense: false,
        })
    }

    /// Runs `tokens` through the model: writes each token's latent and index key into
    /// `pool` at its position, lets the indexer choose which cached positions `0..=pos`
    /// each token attends to, and returns the logits of the tokens with `want_logits`.
    pub fn forward(
        &self,
        tp: &rayon::ThreadPool,
        pool: &mut PagePool,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
    ) -> Vec<Vec<f32>> {
        let c = &self.cfg;
        let t = tokens.len();
        let d = c.hidden_size;
        let comps = CacheComps::of(pool.layout());
        let mut x = vec![0f32; t * d];
        for (i, tk) in tokens.iter().enumerate() {
            let r = tk.token as usize * d;
            x[i * d..(i + 1) * d].copy_from_slice(&self.embed[r..r + d]);
        }
        let mut hbuf = vec![0f32; t * d];
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&x, &layer.in_norm, c.rms_norm_eps, &mut hbuf);
            let att = self.attention(tp, pool, seq_pages, tokens, li, layer, &hbuf, comps);
            let mut o = vec![0f32; t * d];
            matmul(tp, &layer.o.m(), &att, t, &mut o);
            add_in_place(&mut x, &o);
            rms_norm(&x, &layer.post_norm, c.rms_norm_eps, &mut hbuf);
            let f = self.ffn(tp, &layer.ffn, &hbuf, t);
            add_in_place(&mut x, &f);
        }
        output_logits(
            tp,
            &x,
            tokens,
            (&self.norm[..], c.rms_norm_eps, &self.lm_head.m()),
        )
    }

    /// MLA with the indexer's selection, for every token of the batch; returns the
    /// heads' outputs (t × heads·v_head_dim) before o_proj.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        tp: &rayon::ThreadPool,
        pool: &mut PagePool,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
        li: usize,
        layer: &Layer,
        x: &[f32],
        comps: CacheComps,
    ) -> Vec<f32> {
        let c = &self.cfg;
        let t = tokens.len();
        let (h, dn, dr, dv, r) = (
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        let (hi, di) = (c.index_n_heads, c.index_head_dim);
        // Projections of the whole batch.
        let (mut q_lat, mut kv) = (vec![0f32; t * c.q_lora_rank], vec![0f32; t * (r + dr)]);
        let (mut ki, mut wts) = (vec![0f32; t * di], vec![0f32; t * hi]);
        matmul_many(
            tp,
            &[
                &layer.q_a.m(),
                &layer.kv_a.m(),
                &layer.idx.wk.m(),
                &layer.idx.weights_proj.m(),
            ],
            x,
            t,
            &mut [&mut q_lat, &mut kv, &mut ki, &mut wts],
        );
        let q_lat_n = {
            let mut o = vec![0f32; q_lat.len()];
            rms_norm(&q_lat, &layer.q_a_norm, c.rms_norm_eps, &mut o);
            o
        };
        let (mut q, mut qi) = (vec![0f32; t * h * (dn + dr)], vec![0f32; t * hi * di]);
        matmul_many(
            tp,
            &[&layer.q_b.m(), &layer.idx.wq_b.m()],
            &q_lat_n,
            t,
            &mut [&mut q, &mut qi],
        );
        let iscale = 1.0 / ((hi as f32).sqrt() * (di as f32).sqrt());
        for (i, tk) in tokens.iter().enumerate() {
            let (cos, sin) = self.rope_at(tk.pos);
            // MLA query rope (interleaved pairs) on each head's last dr values.
            for head in q[i * h * (dn + dr)..(i + 1) * h * (dn + dr)].chunks_exact_mut(dn + dr) {
                rope_interleaved(&mut head[dn..], &cos, &sin);
            }
            // The latent: normalized compressed KV, then the rope key.
            let row = &mut kv[i * (r + dr)..(i + 1) * (r + dr)];
            let mut lat = vec![0f32; r];
            rms_norm(&row[..r], &layer.kv_a_norm, c.rms_norm_eps, &mut lat);
            row[..r].copy_from_slice(&lat);
            rope_interleaved(&mut row[r..], &cos, &sin);
            // The index key: LayerNorm, rope (half-split pairs) on its first dr values,
            // Hadamard; the index queries likewise.
            let k = &mut ki[i * di..(i + 1) * di];
            layer_norm(k, &layer.idx.k_norm_w, &layer.idx.k_norm_b, c.rms_norm_eps);
            rope_half(&mut k[..dr], &cos, &sin);
            hadamard(k);
            for qh in qi[i * hi * di..(i + 1) * hi * di].chunks_exact_mut(di) {
                rope_half(&mut qh[..dr], &cos, &sin);
                hadamard(qh);
                round_like_index_k(qh, comps.index_dtype);
            }
            for w in &mut wts[i * hi..(i + 1) * hi] {
                *w *= iscale;
            }
        }
        // Every token's cache entries first: a token attends to itself and to the tokens
        // before it in this batch through the cache, exactly as a later step would.
        for (i, tk) in tokens.iter().enumerate() {
            let ps = pool.layout().page_size();
            let page = seq_pages[tk.seq][tk.pos / ps];
            write_entry(
                pool,
                comps,
                page,
                li,
                tk.pos % ps,
                &kv[i * (r + dr)..(i + 1) * (r + dr)],
                r,
                &ki[i * di..(i + 1) * di],
            );
        }
        let pool: &PagePool = pool;
        let mut out = vec![0f32; t * h * dv];
        let (topk, dense, scale) = (c.index_topk, self.dense, self.scale);
        tp.install(|| {
            out.par_chunks_mut(h * dv).enumerate().for_each(|(i, o)| {
                let tk = tokens[i];
                let n = tk.pos + 1;
                let ps = pool.layout().page_size();
                let pages = seq_pages[tk.seq];
                // The indexer: score every cached position, keep the top k.
                let chosen: Vec<usize> = if dense || n <= topk {
                    (0..n).collect()
                } else {
                    let qs = &qi[i * hi * di..(i + 1) * hi * di];
                    let w = &wts[i * hi..(i + 1) * hi];
                    // Positions in parallel: each score is computed alone, the same way
                    // on any thread.
                    let mut scored: Vec<(f32, usize)> = (0..n)
                        .into_par_iter()
                        .with_min_len(256)
                        .map_init(
                            || vec![0f32; di],
                            |kbuf, p| {
                                read_index_k(pool, comps, pages[p / ps], li, p % ps, kbuf);
                                (index_score(qs, w, kbuf), p)
                            },
                        )
                        .collect();
                    // Highest score first, earlier position on ties: a total order.
                    let by = |a: &(f32, usize), b: &(f32, usize)| {
                        b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
                    };
                    scored.select_nth_unstable_by(topk - 1, by);
                    let mut keep: Vec<usize> = scored[..topk].iter().map(|s| s.1).collect();
                    keep.sort_unstable();
                    keep
                };
                // The chosen positions' latents and rope keys.
                let mut lat = vec![0f32; chosen.len() * (r + dr)];
                lat.par_chunks_mut(r + dr)
                    .with_min_len(256)
                    .zip(chosen.par_iter())
                    .for_each(|(e, &p)| read_latent(pool, comps, pages[p / ps], li, p % ps, r, e));
                let qrow = &q[i * h * (dn + dr)..(i + 1) * h * (dn + dr)];
                // Heads in parallel, each over the chosen positions in order.
                o.par_chunks_mut(dv).enumerate().for_each(|(head, oh)| {
                    let qh = &qrow[head * (dn + dr)..(head + 1) * (dn + dr)];
                    // Absorb the key up-projection into the query: q_abs = W_uk^T q_nope.
                    let mut q_abs = vec![0f32; r];
                    for (dd, &qv) in qh[..dn].iter().enumerate() {
                        let wrow = layer.kv_b.row(head * (dn + dv) + dd);
                        for (a, &wv) in q_abs.iter_mut().zip(wrow) {
                            *a += qv * wv;
                        }
                    }
                    let mut scores = vec![0f32; chosen.len()];
                    let mut max = f32::NEG_INFINITY;
                    for (j, s) in scores.iter_mut().enumerate() {
                        let e = &lat[j * (r + dr)..(j + 1) * (r + dr)];
                        *s = scale * (dot(&q_abs, &e[..r]) + dot(&qh[dn..], &e[r..]));
                        max = max.max(*s);
                    }
                    let mut sum = 0f32;
                    for s in &mut scores {
                        *s = (*s - max).exp();
                        sum += *s;
                    }
                    let mut o_lat = vec![0f32; r];
                    for (j, &s) in scores.iter().enumerate() {
                        let p = s / sum;
                        for (a, &e) in o_lat.iter_mut().zip(&lat[j * (r + dr)..j * (r + dr) + r]) {
                            *a += p * e;
                        }
                    }
                    // The value up-projection.
                    for (dd, ov) in oh.iter_mut().enumerate() {
                        *ov = dot(&o_lat, layer.kv_b.row(head * (dn + dv) + dn + dd));
                    }
                });
            });
        });
        out
    }

    fn ffn(&self, tp: &rayon::ThreadPool, ffn: &Ffn, x: &[f32], t: usize) -> Vec<f32> {
        let c = &self.cfg;
        let d = c.hidden_size;
        match ffn {
            Ffn::Dense(m) => swiglu(tp, m, x, t),
            Ffn::Moe {
                gate,
                bias,
                experts,
                shared,
            } => {
                let e = c.n_routed_experts;
                let mut logits = vec![0f32; t * e];
                matmul(tp, &gate.m(), x, t, &mut logits);
                // Each token's experts and weights.
                let routes: Vec<Vec<(usize, f32)>> =
                    logits.chunks_exact(e).map(|l| route(c, l, bias)).collect();
                // Tokens per expert, in batch order; each expert runs once over its tokens.
                let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); e];
                for (i, r) in routes.iter().enumerate() {
                    for &(ex, _) in r {
                        by_expert[ex].push(i);
                    }
                }
                let mut results: HashMap<(usize, usize), Vec<f32>> = HashMap::new();
                for (ex, toks) in by_expert.iter().enumerate() {
                    if toks.is_empty() {
                        continue;
                    }
                    let mut xs = Vec::with_capacity(toks.len() * d);
                    for &i in toks {
                        xs.extend_from_slice(&x[i * d..(i + 1) * d]);
                    }
                    let ys = swiglu(tp, &experts[ex], &xs, toks.len());
                    for (k, &i) in toks.iter().enumerate() {
                        results.insert((i, ex), ys[k * d..(k + 1) * d].to_vec());
                    }
                }
                let mut out = match shared {
                    Some(m) => swiglu(tp, m, x, t),
                    None => vec![0f32; t * d],
                };
                // Each token sums its experts in its own routing order.
                for (i, r) in routes.iter().enumerate() {
                    let mut acc = vec![0f32; d];
                    for &(ex, w) in r {
                        for (a, &y) in acc.iter_mut().zip(&results[&(i, ex)]) {
                            *a += w * y;
                        }
                    }
                    add_in_place(&mut out[i * d..(i + 1) * d], &acc);
                }
                out
            }
        }
    }

    fn rope_at(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        rope_at(&self.freqs, pos)
    }

    /// The rope frequency of each rotated pair, as the forward pass uses them.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn freqs(&self) -> &[f32] {
        &self.freqs
    }
}

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

use std::collections::HashMap;
use std::path::Path;

use half::bf16;
use pdmesh_gguf::GgmlType;
use pdmesh_kernels::{QMatrix, matmul, matmul_many, matmul_swiglu};
use pdmesh_kv::fp8::{self, ScaleRule};
use pdmesh_kv::{IndexKDtype, KvLayout, MlaCacheDtype, MlaDims, PageId, PagePool};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::EngineError;
use crate::model::{BatchToken, add_in_place, output_logits, rms_norm};

/// YaRN rope scaling as `config.json` writes it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "rope_type", rename = "type")]
    pub kind: String,
    pub factor: f32,
    pub original_max_position_embeddings: usize,
    #[serde(default = "beta_fast")]
    pub beta_fast: f32,
    #[serde(default = "one_f32")]
    pub beta_slow: f32,
    #[serde(default = "one_f32")]
    pub mscale: f32,
    #[serde(default = "one_f32")]
    pub mscale_all_dim: f32,
}

fn beta_fast() -> f32 {
    32.0
}
fn one_f32() -> f32 {
    1.0
}
fn one() -> usize {
    1
}

/// One id or several (`eos_token_id` is either).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(i) => vec![*i],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

/// The `config.json` keys the model reads (HF names).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DsConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub first_k_dense_replace: usize,
    #[serde(default = "one")]
    pub moe_layer_freq: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f32,
    pub norm_topk_prob: bool,
    pub scoring_func: String,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    pub eos_token_id: TokenIds,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// The checkpoint's weight quantization (fp8 blocks are detected per tensor; kept so a
    /// written config says what its tensors hold).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization_config: Option<serde_json::Value>,
}

impl DsConfig {
    pub fn read(dir: &Path) -> Result<Self, EngineError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| EngineError::Unsupported(format!("{}: {e}", path.display())))?;
        let cfg: Self = serde_json::from_str(&text)
            .map_err(|e| EngineError::Unsupported(format!("{}: {e}", path.display())))?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::Unsupported(m));
        if self.model_type != "deepseek_v32" {
            return bad(format!(
                "model_type {:?} (this loader runs deepseek_v32)",
                self.model_type
            ));
        }
        if self.scoring_func != "sigmoid" {
            return bad(format!("scoring_func {:?}", self.scoring_func));
        }
        if self.n_group == 0
            || !self.n_routed_experts.is_multiple_of(self.n_group)
            || self.topk_group > self.n_group
            || self.num_experts_per_tok > self.n_routed_experts
        {
            return bad(format!(
                "expert routing {} experts in {} groups, top {} groups, {} per token",
                self.n_routed_experts, self.n_group, self.topk_group, self.num_experts_per_tok
            ));
        }
        if !self.index_head_dim.is_power_of_two()
            || !self.qk_rope_head_dim.is_multiple_of(2)
            || self.qk_rope_head_dim > self.index_head_dim
        {
            return bad(format!(
                "index head dim {} with rope dim {}",
                self.index_head_dim, self.qk_rope_head_dim
            ));
        }
        let dims = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("q_lora_rank", self.q_lora_rank),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("intermediate_size", self.intermediate_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("moe_layer_freq", self.moe_layer_freq),
            ("index_n_heads", self.index_n_heads),
            ("index_topk", self.index_topk),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = dims.iter().find(|(_, v)| *v == 0) {
            return bad(format!("{name} is 0"));
        }
        Ok(())
    }

    /// The cache this model needs in the chosen forms.
    pub fn kv_layout(
        &self,
        mla: MlaCacheDtype,
        index_k: IndexKDtype,
        page_size: usize,
    ) -> Result<KvLayout, EngineError> {
        KvLayout::deepseek_v32(
            self.num_hidden_layers,
            MlaDims {
                kv_lora_rank: self.kv_lora_rank,
                rope_dim: self.qk_rope_head_dim,
                index_head_dim: self.index_head_dim,
            },
            mla,
            index_k,
            page_size,
        )
        .map_err(|e| EngineError::Unsupported(format!("KV layout: {e}")))
    }

    fn is_moe(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace && layer.is_multiple_of(self.moe_layer_freq)
    }

    /// The attention softmax scale: (nope + rope)^-1/2, times YaRN's mscale squared.
    pub fn softmax_scale(&self) -> f32 {
        let base = 1.0 / ((self.qk_nope_head_dim + self.qk_rope_head_dim) as f32).sqrt();
        match &self.rope_scaling {
            Some(r) if r.factor > 1.0 => {
                let m = 0.1 * r.mscale_all_dim * r.factor.ln() + 1.0;
                base * m * m
            }
            _ => base,
        }
    }

    /// The rope frequency of each rotated pair (YaRN-corrected when configured).
    pub fn rope_freqs(&self) -> Vec<f32> {
        let d = self.qk_rope_head_dim;
        let base: Vec<f32> = (0..d / 2)
            .map(|i| self.rope_theta.powf(-2.0 * i as f32 / d as f32))
            .collect();
        let Some(r) = self.rope_scaling.as_ref().filter(|r| r.factor > 1.0) else {
            return base;
        };
        let corr = |rot: f32| {
            d as f32
                * (r.original_max_position_embeddings as f32 / (2.0 * std::f32::consts::PI * rot))
                    .ln()
                / (2.0 * self.rope_theta.ln())
        };
        let low = corr(r.beta_fast).floor().max(0.0);
        let mut high = corr(r.beta_slow).ceil().min(d as f32 - 1.0);
        if low == high {
            high += 0.001;
        }
        base.iter()
            .enumerate()
            .map(|(i, &f)| {
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                f / r.factor * ramp + f * (1.0 - ramp)
            })
            .collect()
    }
}

/// A weight matrix dequantized to f32, used through the matmul kernels.
pub(crate) struct Lin {
    pub(crate) w: Vec<f32>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl Lin {
    fn m(&self) -> QMatrix<'_> {
        QMatrix::new(
            GgmlType::F32,
            bytemuck::cast_slice(&self.w),
            self.rows,
            self.cols,
        )
    }
    fn row(&self, r: usize) -> &[f32] {
        &self.w[r * self.cols..(r + 1) * self.cols]
    }
}

pub(crate) struct Mlp {
    pub(crate) gate: Lin,
    pub(crate) up: Lin,
    pub(crate) down: Lin,
}

pub(crate) enum Ffn {
    Dense(Mlp),
    Moe {
        /// Router: experts × hidden.
        gate: Lin,
        bias: Vec<f32>,
        experts: Vec<Mlp>,
        shared: Option<Mlp>,
    },
}

pub(crate) struct Indexer {
    pub(crate) wq_b: Lin,
    pub(crate) wk: Lin,
    pub(crate) k_norm_w: Vec<f32>,
    pub(crate) k_norm_b: Vec<f32>,
    pub(crate) weights_proj: Lin,
}

pub(crate) struct Layer {
    pub(crate) in_norm: Vec<f32>,
    pub(crate) post_norm: Vec<f32>,
    pub(crate) q_a: Lin,
    pub(crate) q_a_norm: Vec<f32>,
    pub(crate) q_b: Lin,
    pub(crate) kv_a: Lin,
    pub(crate) kv_a_norm: Vec<f32>,
    /// kv_b_proj: heads × (nope + v) rows of kv_lora_rank.
    pub(crate) kv_b: Lin,
    pub(crate) o: Lin,
    pub(crate) idx: Indexer,
    pub(crate) ffn: Ffn,
}

/// The tensors of a checkpoint: every safetensors file of the directory, read whole.
struct Tensors {
    files: Vec<Vec<u8>>,
    /// name → (file, dtype, shape, byte range)
    index: HashMap<
        String,
        (
            usize,
            safetensors::Dtype,
            Vec<usize>,
            std::ops::Range<usize>,
        ),
    >,
}

impl Tensors {
    fn open(dir: &Path) -> Result<Self, EngineError> {
        let err = |p: &Path, e: &dyn std::fmt::Display| {
            EngineError::Unsupported(format!("{}: {e}", p.display()))
        };
        let mut names: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| err(dir, &e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        names.sort();
        if names.is_empty() {
            return Err(EngineError::Unsupported(format!(
                "{}: no .safetensors files",
                dir.display()
            )));
        }
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for (fi, p) in names.iter().enumerate() {
            let bytes = std::fs::read(p).map_err(|e| err(p, &e))?;
            {
                let (n, meta) =
                    safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| err(p, &e))?;
                let start = 8 + n;
                for (name, info) in meta.tensors() {
                    let (a, b) = info.data_offsets;
                    index.insert(
                        name.clone(),
                        (fi, info.dtype, info.shape.clone(), start + a..start + b),
                    );
                }
            }
            files.push(bytes);
        }
        Ok(Self { files, index })
    }

    fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// A tensor as f32 values (bf16, f16, f32 or fp8 e4m3 with its block scales).
    fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, EngineError> {
        let (fi, dtype, got, range) = self
            .index
            .get(name)
            .ok_or_else(|| EngineError::Unsupported(format!("tensor {name} is missing")))?;
        if got.as_slice() != shape {
            return Err(EngineError::Unsupported(format!(
                "tensor {name} is {got:?}, expected {shape:?}"
            )));
        }
        let b = &self.files[*fi][range.clone()];
        use safetensors::Dtype as D;
        Ok(match dtype {
            D::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
            D::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            D::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            D::F8_E4M3 => {
                let (rows, cols) = match shape {
                    [r, c] => (*r, *c),
                    _ => {
                        return Err(EngineError::Unsupported(format!(
                            "fp8 tensor {name} is not a matrix"
                        )));
                    }
                };
                let grid = [rows.div_ceil(128), cols.div_ceil(128)];
                let scales = self.f32(&format!("{name}_scale_inv"), &grid)?;
                b.iter()
                    .enumerate()
                    .map(|(i, &q)| {
                        let (r, c) = (i / cols, i % cols);
                        fp8::e4m3_to_f32(q) * scales[(r / 128) * grid[1] + c / 128]
                    })
                    .collect()
            }
            other => {
                return Err(EngineError::Unsupported(format!(
                    "tensor {name} has dtype {other:?}"
                )));
            }
        })
    }

    fn lin(&self, name: &str, rows: usize, cols: usize) -> Result<Lin, EngineError> {
        Ok(Lin {
            w: self.f32(name, &[rows, cols])?,
            rows,
            cols,
        })
    }
}

/// Cache components of one layout, by role.
#[derive(Clone, Copy, Debug)]
struct CacheComps {
    mla: MlaCacheDtype,
    /// `mla_latent` (bf16) or `mla_nope` (fp8).
    latent: usize,
    /// `mla_rope` (fp8 form only).
    rope: Option<usize>,
    index_k: usize,
    index_dtype: IndexKDtype,
}

impl CacheComps {
    fn of(layout: &KvLayout) -> Self {
        let c = |n: &str| layout.component_index(n);
        let (mla, latent, rope) = match c("mla_latent") {
            Some(i) => (MlaCacheDtype::Bf16, i, None),
            None => (
                MlaCacheDtype::Fp8,
                c("mla_nope").expect("a DeepSeek layout has mla_nope or mla_latent"),
                c("mla_rope"),
            ),
        };
        let index_k = c("index_k").expect("a DeepSeek layout has index_k");
        let index_dtype = match layout.components()[index_k].dtype {
            pdmesh_kv::DType::Bf16 => IndexKDtype::Bf16,
            _ => IndexKDtype::Fp8,
        };
        Self {
            mla,
            latent,
            rope,
            index_k,
            index_dtype,
        }
    }
}

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

fn swiglu(tp: &rayon::ThreadPool, m: &Mlp, x: &[f32], t: usize) -> Vec<f32> {
    let inter = m.gate.rows;
    let mut g = vec![0f32; t * inter];
    matmul_swiglu(tp, &m.gate.m(), &m.up.m(), x, t, &mut g);
    let mut out = vec![0f32; t * m.down.rows];
    matmul(tp, &m.down.m(), &g, t, &mut out);
    out
}

/// The indexer's score of one cached key: Σ_h w[h] · ReLU(q_h · k).
pub fn index_score(q: &[f32], w: &[f32], k: &[f32]) -> f32 {
    q.chunks_exact(k.len())
        .zip(w)
        .map(|(qh, &wh)| wh * dot(qh, k).max(0.0))
        .sum()
}

/// Rounds an index query as the keys are stored: through fp8 (one ue8m0 scale per 128
/// values) or bf16.
fn round_like_index_k(v: &mut [f32], dtype: IndexKDtype) {
    match dtype {
        IndexKDtype::Bf16 => v.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32()),
        IndexKDtype::Fp8 => {
            let mut q = vec![0u8; v.len()];
            for (blk, qb) in v.chunks_mut(128).zip(q.chunks_mut(128)) {
                let s = fp8::quantize_block(blk, qb, ScaleRule::Ue8m0);
                fp8::dequantize_block(qb, s, blk);
            }
        }
    }
}

/// Writes one token's latent (`r` values then the rope key) and index key at `slot`.
#[allow(clippy::too_many_arguments)]
fn write_entry(
    pool: &mut PagePool,
    comps: CacheComps,
    page: PageId,
    layer: usize,
    slot: usize,
    latent: &[f32],
    r: usize,
    index_k: &[f32],
) {
    let layout = pool.layout().clone();
    let bytes = pool.page_mut(page).expect("the sequence holds its pages");
    let put_bf16 = |bytes: &mut [u8], at: usize, v: &[f32]| {
        for (j, x) in v.iter().enumerate() {
            bytes[at + 2 * j..at + 2 * j + 2].copy_from_slice(&bf16::from_f32(*x).to_le_bytes());
        }
    };
    let put_fp8 = |bytes: &mut [u8], comp: usize, v: &[f32]| {
        let at = layout.value_offset(layer, comp, slot);
        let sat = layout
            .scale_offset(layer, comp, slot)
            .expect("fp8 has scales");
        for (b, blk) in v.chunks(128).enumerate() {
            let s = fp8::quantize_block(
                blk,
                &mut bytes[at + b * 128..at + b * 128 + blk.len()],
                ScaleRule::Ue8m0,
            );
            bytes[sat + 4 * b..sat + 4 * b + 4].copy_from_slice(&s.to_le_bytes());
        }
    };
    match comps.mla {
        MlaCacheDtype::Bf16 => put_bf16(
            bytes,
            layout.value_offset(layer, comps.latent, slot),
            latent,
        ),
        MlaCacheDtype::Fp8 => {
            put_fp8(bytes, comps.latent, &latent[..r]);
            let rope = comps.rope.expect("the fp8 form has mla_rope");
            put_bf16(bytes, layout.value_offset(layer, rope, slot), &latent[r..]);
        }
    }
    match comps.index_dtype {
        IndexKDtype::Bf16 => put_bf16(
            bytes,
            layout.value_offset(layer, comps.index_k, slot),
            index_k,
        ),
        IndexKDtype::Fp8 => put_fp8(bytes, comps.index_k, index_k),
    }
}

fn get_bf16(bytes: &[u8], at: usize, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = bf16::from_le_bytes([bytes[at + 2 * j], bytes[at + 2 * j + 1]]).to_f32();
    }
}

fn get_fp8(
    bytes: &[u8],
    layout: &KvLayout,
    layer: usize,
    comp: usize,
    slot: usize,
    out: &mut [f32],
) {
    let at = layout.value_offset(layer, comp, slot);
    let sat = layout
        .scale_offset(layer, comp, slot)
        .expect("fp8 has scales");
    for (b, blk) in out.chunks_mut(128).enumerate() {
        let s = f32::from_le_bytes(
            bytes[sat + 4 * b..sat + 4 * b + 4]
                .try_into()
                .expect("4 bytes"),
        );
        fp8::dequantize_block(&bytes[at + b * 128..at + b * 128 + blk.len()], s, blk);
    }
}

fn read_latent(
    pool: &PagePool,
    comps: CacheComps,
    page: PageId,
    layer: usize,
    slot: usize,
    r: usize,
    out: &mut [f32],
) {
    let layout = pool.layout();
    let bytes = pool.page(page).expect("the sequence holds its pages");
    match comps.mla {
        MlaCacheDtype::Bf16 => get_bf16(bytes, layout.value_offset(layer, comps.latent, slot), out),
        MlaCacheDtype::Fp8 => {
            get_fp8(bytes, layout, layer, comps.latent, slot, &mut out[..r]);
            let rope = comps.rope.expect("the fp8 form has mla_rope");
            get_bf16(bytes, layout.value_offset(layer, rope, slot), &mut out[r..]);
        }
    }
}

fn read_index_k(
    pool: &PagePool,
    comps: CacheComps,
    page: PageId,
    layer: usize,
    slot: usize,
    out: &mut [f32],
) {
    let layout = pool.layout();
    let bytes = pool.page(page).expect("the sequence holds its pages");
    match comps.index_dtype {
        IndexKDtype::Bf16 => get_bf16(bytes, layout.value_offset(layer, comps.index_k, slot), out),
        IndexKDtype::Fp8 => get_fp8(bytes, layout, layer, comps.index_k, slot, out),
    }
}

/// f32 dot product in a fixed order: eight running lanes (so the compiler vectorizes it),
/// summed pairwise, then the tail.
fn dot(a: &[f32], b: &[f32]) -> f32 {
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

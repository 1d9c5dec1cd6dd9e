//! The model's `config.json`, as the public checkpoint writes it: read, checked, and
//! what the forward and the cache layout derive from it (softmax scale, rope frequencies).

use std::path::Path;

use pdmesh_kv::{IndexKDtype, KvLayout, MlaCacheDtype, MlaDims};
use serde::{Deserialize, Serialize};

use crate::EngineError;

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

    pub(super) fn is_moe(&self, layer: usize) -> bool {
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

//! The llama-family model's shape, read from GGUF metadata: what its forward, its
//! tensor-parallel plan and its KV layout are all sized by.

use pdmesh_gguf::GgufFile;
use pdmesh_kv::{DType, KvLayout};

use crate::EngineError;

/// Hyper-parameters read from GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub layers: usize,
    pub dim: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub context_length: usize,
    pub vocab: usize,
}

impl LlamaConfig {
    pub fn from_gguf(g: &GgufFile) -> Result<Self, EngineError> {
        let arch = g.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(EngineError::Unsupported(format!(
                "architecture {arch:?} (this engine runs llama)"
            )));
        }
        let k = |s: &str| format!("llama.{s}");
        let dim = g.get_u64(&k("embedding_length"))? as usize;
        let heads = g.get_u64(&k("attention.head_count"))? as usize;
        let kv_heads = g
            .get(&k("attention.head_count_kv"))
            .and_then(|v| v.as_u64())
            .unwrap_or(heads as u64) as usize;
        let head_dim = dim / heads;
        let vocab = g
            .get_str_array("tokenizer.ggml.tokens")
            .map(|t| t.len())
            .or_else(|_| g.get_u64(&k("vocab_size")).map(|v| v as usize))?;
        let cfg = Self {
            layers: g.get_u64(&k("block_count"))? as usize,
            dim,
            ffn: g.get_u64(&k("feed_forward_length"))? as usize,
            heads,
            kv_heads,
            head_dim,
            rope_base: g
                .get(&k("rope.freq_base"))
                .and_then(|v| v.as_f64())
                .unwrap_or(10000.0) as f32,
            rms_eps: g.get_f64(&k("attention.layer_norm_rms_epsilon"))? as f32,
            context_length: g.get_u64(&k("context_length"))? as usize,
            vocab,
        };
        if heads == 0
            || kv_heads == 0
            || !heads.is_multiple_of(kv_heads)
            || !dim.is_multiple_of(heads)
            || !head_dim.is_multiple_of(2)
        {
            return Err(EngineError::Unsupported(format!(
                "head layout {heads}/{kv_heads} for dim {dim}"
            )));
        }
        Ok(cfg)
    }

    /// The KV layout this model needs: f16 K and V per layer.
    pub fn kv_layout(&self, page_size: usize) -> KvLayout {
        KvLayout::llama(
            self.layers,
            self.kv_heads,
            self.head_dim,
            DType::F16,
            page_size,
        )
    }
}

//! `deepseek-v32-tiny`: a small DeepSeek V3.2 configuration with deterministic seeded
//! weights, written as a real checkpoint (HF `config.json` + `model.safetensors` under the
//! public tensor names, linear weights in fp8 e4m3 with 128 × 128 `weight_scale_inv`
//! blocks as the public checkpoint has them) and loaded through the same loader. Tests and
//! benchmarks use it: it exercises MLA, the indexer (top-k 64, so prompts past 64 tokens
//! attend sparsely) and routing over 8 experts, on a CPU, in seconds.

use std::path::Path;

use half::bf16;
use pdmesh_kv::fp8::{self, ScaleRule};
use rand::{Rng, SeedableRng};
use safetensors::{Dtype, tensor::TensorView};

use crate::EngineError;
use crate::deepseek::{DsConfig, RopeScaling, TokenIds};

/// The tiny configuration. Its vocabulary is SmolLM2's (49152 ids, `<|im_end|>` = 2 ends
/// generation), so the default model's tokenizer serves it.
pub fn tiny_config() -> DsConfig {
    DsConfig {
        architectures: vec!["DeepseekV32ForCausalLM".into()],
        model_type: "deepseek_v32".into(),
        vocab_size: 49152,
        hidden_size: 256,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        q_lora_rank: 128,
        kv_lora_rank: 128,
        qk_nope_head_dim: 32,
        qk_rope_head_dim: 32,
        v_head_dim: 32,
        intermediate_size: 512,
        moe_intermediate_size: 128,
        n_routed_experts: 8,
        n_shared_experts: 1,
        num_experts_per_tok: 2,
        first_k_dense_replace: 1,
        moe_layer_freq: 1,
        n_group: 4,
        topk_group: 2,
        routed_scaling_factor: 2.5,
        norm_topk_prob: true,
        scoring_func: "sigmoid".into(),
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: Some(RopeScaling {
            kind: "yarn".into(),
            factor: 4.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        }),
        max_position_embeddings: 32768,
        index_n_heads: 4,
        index_head_dim: 128,
        index_topk: 64,
        bos_token_id: Some(1),
        eos_token_id: TokenIds::One(2),
        tie_word_embeddings: false,
        quantization_config: Some(serde_json::json!({
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        })),
    }
}

/// One tensor to write: its name, dtype and little-endian bytes.
struct Out {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

struct Gen {
    rng: rand_chacha::ChaCha8Rng,
    out: Vec<Out>,
}

impl Gen {
    fn values(&mut self, n: usize, amp: f32, center: f32) -> Vec<f32> {
        (0..n)
            .map(|_| center + amp * (self.rng.random::<f32>() * 2.0 - 1.0))
            .collect()
    }

    fn bf16(&mut self, name: &str, shape: &[usize], amp: f32, center: f32) {
        let v = self.values(shape.iter().product(), amp, center);
        self.out.push(Out {
            name: name.into(),
            dtype: Dtype::BF16,
            shape: shape.to_vec(),
            bytes: v
                .iter()
                .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
                .collect(),
        });
    }

    fn f32(&mut self, name: &str, shape: &[usize], amp: f32, center: f32) {
        let v = self.values(shape.iter().product(), amp, center);
        self.out.push(Out {
            name: name.into(),
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        });
    }

    /// A linear weight `rows × cols` (fan-in scaled) in fp8 with its 128 × 128 block scales.
    fn fp8(&mut self, name: &str, rows: usize, cols: usize) {
        let amp = 1.7 / (cols as f32).sqrt();
        let v = self.values(rows * cols, amp, 0.0);
        let grid = [rows.div_ceil(128), cols.div_ceil(128)];
        let mut scales = vec![0f32; grid[0] * grid[1]];
        let mut q = vec![0u8; rows * cols];
        for br in 0..grid[0] {
            for bc in 0..grid[1] {
                let (r0, c0) = (br * 128, bc * 128);
                let (r1, c1) = ((r0 + 128).min(rows), (c0 + 128).min(cols));
                let amax = (r0..r1)
                    .flat_map(|r| v[r * cols + c0..r * cols + c1].iter())
                    .fold(0f32, |m, x| m.max(x.abs()));
                let s = fp8::block_scale(amax, ScaleRule::Ue8m0);
                scales[br * grid[1] + bc] = s;
                for r in r0..r1 {
                    for c in c0..c1 {
                        q[r * cols + c] = fp8::f32_to_e4m3(v[r * cols + c] / s);
                    }
                }
            }
        }
        self.out.push(Out {
            name: name.into(),
            dtype: Dtype::F8_E4M3,
            shape: vec![rows, cols],
            bytes: q,
        });
        self.out.push(Out {
            name: format!("{name}_scale_inv"),
            dtype: Dtype::F32,
            shape: grid.to_vec(),
            bytes: scales.iter().flat_map(|x| x.to_le_bytes()).collect(),
        });
    }

    fn mlp(&mut self, p: &str, d: usize, inter: usize) {
        self.fp8(&format!("{p}.gate_proj.weight"), inter, d);
        self.fp8(&format!("{p}.up_proj.weight"), inter, d);
        self.fp8(&format!("{p}.down_proj.weight"), d, inter);
    }
}

/// The files of an HF tokenizer directory that [`write`] copies beside the checkpoint.
pub const TOKENIZER_FILES: [&str; 2] = ["tokenizer.json", "tokenizer_config.json"];

/// Writes `config.json` and `model.safetensors` for `cfg` with weights drawn from `seed`,
/// and, given `tokenizer` (a directory holding an HF tokenizer's [`TOKENIZER_FILES`]),
/// copies those files in: a directory the engine and the tokenizer service both load.
/// The tokenizer's config should carry no chat template (DeepSeek V3.2 ships none: its
/// prompts follow the model's rules).
pub fn write(
    dir: &Path,
    cfg: &DsConfig,
    seed: u64,
    tokenizer: Option<&Path>,
) -> Result<(), EngineError> {
    let io =
        |e: &dyn std::fmt::Display| EngineError::Unsupported(format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(|e| io(&e))?;
    let c = cfg;
    let d = c.hidden_size;
    let qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    let mut g = Gen {
        rng: rand_chacha::ChaCha8Rng::seed_from_u64(seed),
        out: Vec::new(),
    };
    g.bf16("model.embed_tokens.weight", &[c.vocab_size, d], 1.0, 0.0);
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let a = format!("{p}.self_attn");
        g.bf16(&format!("{p}.input_layernorm.weight"), &[d], 0.1, 1.0);
        g.bf16(
            &format!("{p}.post_attention_layernorm.weight"),
            &[d],
            0.1,
            1.0,
        );
        g.fp8(&format!("{a}.q_a_proj.weight"), c.q_lora_rank, d);
        g.bf16(
            &format!("{a}.q_a_layernorm.weight"),
            &[c.q_lora_rank],
            0.1,
            1.0,
        );
        g.fp8(
            &format!("{a}.q_b_proj.weight"),
            c.num_attention_heads * qk,
            c.q_lora_rank,
        );
        g.fp8(
            &format!("{a}.kv_a_proj_with_mqa.weight"),
            c.kv_lora_rank + c.qk_rope_head_dim,
            d,
        );
        g.bf16(
            &format!("{a}.kv_a_layernorm.weight"),
            &[c.kv_lora_rank],
            0.1,
            1.0,
        );
        g.fp8(
            &format!("{a}.kv_b_proj.weight"),
            c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim),
            c.kv_lora_rank,
        );
        g.fp8(
            &format!("{a}.o_proj.weight"),
            d,
            c.num_attention_heads * c.v_head_dim,
        );
        g.fp8(
            &format!("{a}.indexer.wq_b.weight"),
            c.index_n_heads * c.index_head_dim,
            c.q_lora_rank,
        );
        g.fp8(&format!("{a}.indexer.wk.weight"), c.index_head_dim, d);
        g.f32(
            &format!("{a}.indexer.k_norm.weight"),
            &[c.index_head_dim],
            0.1,
            1.0,
        );
        g.f32(
            &format!("{a}.indexer.k_norm.bias"),
            &[c.index_head_dim],
            0.05,
            0.0,
        );
        g.bf16(
            &format!("{a}.indexer.weights_proj.weight"),
            &[c.index_n_heads, d],
            1.0 / (d as f32).sqrt(),
            0.0,
        );
        if l >= c.first_k_dense_replace && l % c.moe_layer_freq == 0 {
            let e = c.n_routed_experts;
            g.bf16(
                &format!("{p}.mlp.gate.weight"),
                &[e, d],
                1.0 / (d as f32).sqrt(),
                0.0,
            );
            g.f32(
                &format!("{p}.mlp.gate.e_score_correction_bias"),
                &[e],
                0.05,
                0.0,
            );
            for j in 0..e {
                g.mlp(&format!("{p}.mlp.experts.{j}"), d, c.moe_intermediate_size);
            }
            if c.n_shared_experts > 0 {
                g.mlp(
                    &format!("{p}.mlp.shared_experts"),
                    d,
                    c.moe_intermediate_size * c.n_shared_experts,
                );
            }
        } else {
            g.mlp(&format!("{p}.mlp"), d, c.intermediate_size);
        }
    }
    g.bf16("model.norm.weight", &[d], 0.1, 1.0);
    g.bf16(
        "lm_head.weight",
        &[c.vocab_size, d],
        1.0 / (d as f32).sqrt(),
        0.0,
    );
    let views = g
        .out
        .iter()
        .map(|o| {
            TensorView::new(o.dtype, o.shape.clone(), &o.bytes)
                .map(|v| (o.name.clone(), v))
                .map_err(|e| io(&e))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = std::collections::HashMap::from([("format".to_owned(), "pt".to_owned())]);
    safetensors::tensor::serialize_to_file(views, Some(meta), &dir.join("model.safetensors"))
        .map_err(|e| io(&e))?;
    let json = serde_json::to_string_pretty(cfg).map_err(|e| io(&e))?;
    std::fs::write(dir.join("config.json"), json).map_err(|e| io(&e))?;
    if let Some(src) = tokenizer {
        for name in TOKENIZER_FILES {
            std::fs::copy(src.join(name), dir.join(name))
                .map_err(|e| io(&format!("copying {}: {e}", src.join(name).display())))?;
        }
    }
    Ok(())
}

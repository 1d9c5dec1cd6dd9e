//! The model families behind one trait ([`Model`]), and loading one from a GGUF file or
//! a checkpoint directory onto the CPU or GPUs, with what the engine needs beside it
//! (KV layout, context length, token bytes, end-of-generation ids).

use std::sync::Arc;

use pdmesh_gguf::GgufFile;
use pdmesh_kv::{KvLayout, PageId, PagePool};

use super::EngineConfig;
use crate::deepseek::DeepSeekModel;
use crate::gemma::GemmaModel;
use crate::model::{BatchToken, LlamaModel, TpLlama};
use crate::tp::RankWork;
use crate::vocab::{eog_tokens, hf_vocab, token_bytes_table};
use crate::{CudaError, EngineError};

/// What the engine needs of a model: its vocabulary and one forward pass over a batch.
/// Every model family implements it; the engine holds one as `Box<dyn Model>` and
/// dispatches once per step.
pub(crate) trait Model: Send {
    fn vocab(&self) -> usize;
    /// One forward pass: each of `tokens` is written into the KV of its sequence's pages
    /// (`seq_pages`); returns a logits row per token that wants one, in order. `tp`: the
    /// compute threads. Only a GPU fails, and then leaves the pool as it was.
    fn forward(
        &self,
        tp: &rayon::ThreadPool,
        pool: &mut PagePool,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
    ) -> Result<Vec<Vec<f32>>, CudaError>;
    /// What each tensor-parallel rank has computed so far, in rank order; empty for the
    /// models that do not count it.
    fn rank_work(&self) -> Vec<RankWork> {
        Vec::new()
    }
}

/// An unsharded model runs whole on the compute pool, so its parallel loops do not hand
/// work across threads and back for every matrix.
impl Model for LlamaModel {
    fn vocab(&self) -> usize {
        self.cfg.vocab
    }
    fn forward(
        &self,
        tp: &rayon::ThreadPool,
        pool: &mut PagePool,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
    ) -> Result<Vec<Vec<f32>>, CudaError> {
        Ok(tp.install(|| LlamaModel::forward(self, tp, pool, seq_pages, tokens)))
    }
    fn rank_work(&self) -> Vec<RankWork> {
        vec![self.work()]
    }
}

/// The ranks of a sharded model run on their own threads and each hands its kernels to
/// the pool (a rank waiting for the others must not hold a compute thread).
impl Model for TpLlama {
    fn vocab(&self) -> usize {
        self.model.cfg.vocab
    }
    fn forward(
        &self,
        tp: &rayon::ThreadPool,
        pool: &mut PagePool,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
    ) -> Result<Vec<Vec<f32>>, CudaError> {
        Ok(TpLlama::forward(self, tp, pool, seq_pages, tokens))
    }
    fn rank_work(&self) -> Vec<RankWork> {
        self.work()
    }
}

impl Model for DeepSeekModel {
    fn vocab(&self) -> usize {
        self.cfg.vocab_size
    }
    fn forward(
        &self,
        tp: &rayon::ThreadPool,
        pool: &mut PagePool,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
    ) -> Result<Vec<Vec<f32>>, CudaError> {
        Ok(tp.install(|| DeepSeekModel::forward(self, tp, pool, seq_pages, tokens)))
    }
}

impl Model for GemmaModel {
    fn vocab(&self) -> usize {
        self.cfg.vocab
    }
    fn forward(
        &self,
        tp: &rayon::ThreadPool,
        pool: &mut PagePool,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
    ) -> Result<Vec<Vec<f32>>, CudaError> {
        Ok(tp.install(|| GemmaModel::forward(self, tp, pool, seq_pages, tokens)))
    }
}

/// A llama-family model on GPUs, or DeepSeek on one.
#[cfg(feature = "cuda")]
impl Model for crate::cuda::CudaModel {
    fn vocab(&self) -> usize {
        self.vocab
    }
    fn forward(
        &self,
        _tp: &rayon::ThreadPool,
        pool: &mut PagePool,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
    ) -> Result<Vec<Vec<f32>>, CudaError> {
        crate::cuda::CudaModel::forward(self, pool, seq_pages, tokens)
    }
}

/// A model with what the engine needs beside it.
pub(crate) struct Loaded {
    pub model: Box<dyn Model>,
    pub layout: KvLayout,
    pub context_length: usize,
    pub token_bytes: Vec<Vec<u8>>,
    pub eog: Vec<u32>,
}

impl Loaded {
    /// A GGUF file is a llama-family model or Gemma 3; a directory is an HF checkpoint
    /// (DeepSeek V3.2: `config.json`, safetensors, `tokenizer.json`).
    pub(crate) fn load(cfg: &EngineConfig) -> Result<Loaded, EngineError> {
        if !cfg.model_path.is_dir() {
            let gguf = Arc::new(GgufFile::open(&cfg.model_path)?);
            if gguf.get_str("general.architecture")? == "gemma3" {
                return Self::gemma3(cfg, gguf);
            }
            let model = LlamaModel::load(gguf.clone())?;
            let (layout, context_length) =
                (model.cfg.kv_layout(cfg.page_size), model.cfg.context_length);
            let model = match (&cfg.gpu, cfg.tp) {
                (Some(g), _) => gpu_model(cfg, g, &gguf, model, &layout)?,
                (None, 1) => Box::new(model) as Box<dyn Model>,
                (None, n) => Box::new(TpLlama::new(model, n)?),
            };
            return Ok(Loaded {
                layout,
                context_length,
                token_bytes: token_bytes_table(&gguf)?,
                eog: eog_tokens(&gguf)?,
                model,
            });
        }
        if cfg.tp != 1 {
            return Err(EngineError::Unsupported(format!(
                "tensor parallelism supports llama-family models; {} is a DeepSeek \
                 checkpoint (run it with tp 1)",
                cfg.model_path.display()
            )));
        }
        if let Some(g) = &cfg.gpu {
            check_gpu_world(cfg, g)?;
            if g.devices.len() != 1 {
                return Err(EngineError::Unsupported(format!(
                    "tensor parallelism supports llama-family models; {} is a DeepSeek \
                     checkpoint (run it on one GPU)",
                    cfg.model_path.display()
                )));
            }
            if !cfg!(feature = "cuda") {
                return Err(EngineError::Unsupported(NO_CUDA.into()));
            }
        }
        let model = DeepSeekModel::load(&cfg.model_path)?;
        let (mut token_bytes, eos) = hf_vocab(&cfg.model_path)?;
        token_bytes.resize(model.cfg.vocab_size.max(token_bytes.len()), Vec::new());
        let mut eog = model.cfg.eos_token_id.to_vec();
        eog.extend(eos);
        eog.sort_unstable();
        eog.dedup();
        let layout = model
            .cfg
            .kv_layout(cfg.kv_cache_dtype, cfg.index_k_dtype, cfg.page_size)?;
        let context_length = model.cfg.max_position_embeddings;
        let model = match &cfg.gpu {
            Some(g) => deepseek_gpu_model(cfg, g, model, &layout)?,
            None => Box::new(model),
        };
        Ok(Loaded {
            layout,
            context_length,
            token_bytes,
            eog,
            model,
        })
    }
}

impl Loaded {
    /// Gemma 3 runs on the CPU, unsharded.
    fn gemma3(cfg: &EngineConfig, gguf: Arc<GgufFile>) -> Result<Loaded, EngineError> {
        if cfg.tp != 1 || cfg.gpu.is_some() {
            return Err(EngineError::Unsupported(format!(
                "{} is Gemma 3, which runs on the CPU unsharded (tp 1, no GPU)",
                cfg.model_path.display()
            )));
        }
        let model = GemmaModel::load(gguf.clone())?;
        Ok(Loaded {
            layout: model.cfg.kv_layout(cfg.page_size),
            context_length: model.cfg.context_length,
            token_bytes: token_bytes_table(&gguf)?,
            eog: eog_tokens(&gguf)?,
            model: Box::new(model),
        })
    }
}

/// The llama model on the GPUs `g` names (one tensor-parallel rank each).
#[cfg(feature = "cuda")]
fn gpu_model(
    cfg: &EngineConfig,
    g: &crate::GpuConfig,
    gguf: &Arc<GgufFile>,
    model: LlamaModel,
    layout: &KvLayout,
) -> Result<Box<dyn Model>, EngineError> {
    check_gpu_world(cfg, g)?;
    let opts = cuda_options(g);
    let m = crate::cuda::CudaModel::load(
        gguf.clone(),
        model.cfg.clone(),
        Arc::new(layout.clone()),
        cfg.kv_pages,
        &opts,
    )
    .map_err(EngineError::Cuda)?;
    Ok(Box::new(m))
}

#[cfg(feature = "cuda")]
fn cuda_options(g: &crate::GpuConfig) -> crate::cuda::CudaOptions {
    crate::cuda::CudaOptions {
        devices: g.devices.clone(),
        invariant: g.invariant,
        build: crate::cuda::KernelBuild {
            arch: g.arch.clone(),
            cache_dir: g.kernel_cache.clone(),
        },
    }
}

/// DeepSeek on the one GPU `g` names.
#[cfg(feature = "cuda")]
fn deepseek_gpu_model(
    cfg: &EngineConfig,
    g: &crate::GpuConfig,
    model: DeepSeekModel,
    layout: &KvLayout,
) -> Result<Box<dyn Model>, EngineError> {
    let opts = cuda_options(g);
    let m =
        crate::cuda::CudaModel::load_deepseek(model, Arc::new(layout.clone()), cfg.kv_pages, &opts)
            .map_err(EngineError::Cuda)?;
    Ok(Box::new(m))
}

#[cfg(not(feature = "cuda"))]
fn deepseek_gpu_model(
    _: &EngineConfig,
    _: &crate::GpuConfig,
    _: DeepSeekModel,
    _: &KvLayout,
) -> Result<Box<dyn Model>, EngineError> {
    Err(EngineError::Unsupported(NO_CUDA.into()))
}

const NO_CUDA: &str = "this build has no CUDA backend: build pdmesh with `--features cuda`";

#[cfg(not(feature = "cuda"))]
fn gpu_model(
    cfg: &EngineConfig,
    g: &crate::GpuConfig,
    _: &Arc<GgufFile>,
    _: LlamaModel,
    _: &KvLayout,
) -> Result<Box<dyn Model>, EngineError> {
    check_gpu_world(cfg, g)?;
    Err(EngineError::Unsupported(NO_CUDA.into()))
}

fn check_gpu_world(cfg: &EngineConfig, g: &crate::GpuConfig) -> Result<(), EngineError> {
    if g.devices.is_empty() {
        return Err(EngineError::InvalidParam {
            field: "gpu devices",
            msg: "name at least one GPU".into(),
        });
    }
    if cfg.tp != 1 && cfg.tp != g.devices.len() {
        return Err(EngineError::InvalidParam {
            field: "tp",
            msg: format!(
                "on GPUs each tensor-parallel rank is one device: tp {} with {} devices",
                cfg.tp,
                g.devices.len()
            ),
        });
    }
    Ok(())
}

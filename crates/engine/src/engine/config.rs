//! How an engine is built ([`EngineConfig`]), when it writes to the host tier
//! ([`WritePolicy`]), and what the host tier has done ([`HostStats`]).

use std::path::PathBuf;
use std::time::Duration;

use pdmesh_kv::{IndexKDtype, MlaCacheDtype};

/// How to build an engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub model_path: PathBuf,
    /// Sequences decoded together at most.
    pub max_batch: usize,
    /// Tokens per KV page.
    pub page_size: usize,
    /// KV pages in the pool.
    pub kv_pages: usize,
    /// Hybrid models (Gemma 3): pages' worth of KV for each sliding-window group, handed
    /// to pages while a window reads them (at most `kv_pages`). `None`: enough for every
    /// batch slot's window and one prefill chunk ([`Self::window_pages`]). Ignored by
    /// dense models.
    pub kv_window_pages: Option<usize>,
    /// Prompt tokens processed per step, summed over all prefilling sequences.
    pub prefill_chunk: usize,
    /// Keep steps that decode near this long by computing fewer prompt tokens in them
    /// (never fewer than a page's worth); `None`: always up to `prefill_chunk`. See
    /// `budget.rs`.
    pub step_target: Option<Duration>,
    /// Compute threads (0 = all cores).
    pub threads: usize,
    /// Cap on the model's context length.
    pub max_context: Option<usize>,
    /// Keep every logits row computed for each request (tests and reference checks).
    pub capture_logits: bool,
    /// Reuse the KV pages of cached prompt prefixes (the device tier of the KV cache).
    pub prefix_cache: bool,
    /// A host-tier hit shorter than this many pages is recomputed instead of loaded; a
    /// longer one is loaded whole (all or nothing).
    pub host_min_pages: usize,
    /// DeepSeek models: how the MLA latent is cached (`--kv-cache-dtype`).
    pub kv_cache_dtype: MlaCacheDtype,
    /// DeepSeek models: how the indexer's key is cached (`--index-k-dtype`).
    pub index_k_dtype: IndexKDtype,
    /// Tensor-parallel ranks (llama-family models): 1 runs the model unsharded; N >= 2
    /// splits heads and matrix rows over N ranks that all-gather their results, with
    /// outputs bit-identical to 1 (see `tp.rs`). At most the model's KV heads.
    pub tp: usize,
    /// Run the model on GPUs (the CUDA backend, cargo feature `cuda`); `None`: the CPU.
    /// The GPUs are the tensor-parallel ranks, so `tp` must be 1 or their number.
    pub gpu: Option<crate::GpuConfig>,
    /// Most requests waiting for admission; one more is refused with
    /// [`crate::EngineError::QueueFull`] (the gateway's 429) instead of growing the queue
    /// without bound. `None`: no limit.
    pub max_queued: Option<usize>,
}

impl EngineConfig {
    /// Window pages one sequence can need at once: its window's pages before the token
    /// it computes, and a prefill chunk's pages after it.
    pub fn window_pages_per_sequence(&self, window: usize) -> usize {
        window.saturating_sub(1).div_ceil(self.page_size)
            + self.prefill_chunk.div_ceil(self.page_size)
            + 1
    }

    /// Segments per sliding-window group for a hybrid model whose widest window is
    /// `window`: [`Self::kv_window_pages`], or by default each batch slot's window pages
    /// plus one prefill chunk's, never more than `kv_pages`.
    pub fn window_pages(&self, window: usize) -> usize {
        let each = window.saturating_sub(1).div_ceil(self.page_size) + 1;
        self.kv_window_pages
            .unwrap_or(self.max_batch * each + self.prefill_chunk.div_ceil(self.page_size))
            .min(self.kv_pages)
    }
}

/// The default of [`EngineConfig::max_queued`] (and the worker's `--max-queued-requests`).
pub const DEFAULT_MAX_QUEUED: usize = 1024;

impl EngineConfig {
    pub fn new(model_path: impl Into<PathBuf>) -> Self {
        Self {
            model_path: model_path.into(),
            max_batch: 32,
            page_size: 16,
            kv_pages: 1024,
            kv_window_pages: None,
            prefill_chunk: 512,
            step_target: None,
            threads: 0,
            max_context: None,
            capture_logits: false,
            prefix_cache: true,
            host_min_pages: 1,
            kv_cache_dtype: MlaCacheDtype::Bf16,
            index_k_dtype: IndexKDtype::Fp8,
            tp: 1,
            gpu: None,
            max_queued: Some(DEFAULT_MAX_QUEUED),
        }
    }
}

/// When pages of the device prefix cache are written to the host tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WritePolicy {
    /// As soon as a sequence hands its pages to the device cache.
    WriteThrough,
    /// Once a page has been reused this many times.
    WriteThroughSelective { hits: u32 },
    /// When the device cache evicts a page.
    WriteBack,
}

/// Host-tier counters since the tier was attached.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostStats {
    /// Prompt tokens loaded from the host tier instead of computed.
    pub hit_tokens: u64,
    pub load_bytes: u64,
    pub load_seconds: f64,
    pub written_pages: u64,
    pub written_bytes: u64,
    /// Time spent writing pages to the host tier (copies, checksums and the calls), off
    /// the engine's thread.
    pub written_seconds: f64,
    /// Pages offered to the host tier while its store queue was full, never written.
    pub dropped_pages: u64,
    /// Pages in the host tier's store queue now.
    pub queued_pages: u64,
    /// Host pages whose bytes did not match their checksum (dropped and recomputed).
    pub checksum_failures: u64,
}

//! The worker's configuration: one struct of flags (each with its `PDMESH_…` variable), the
//! defaults [`Config::new`] gives tests, and the checks that turn it into the engine's
//! configuration before anything starts.

use std::path::PathBuf;

use pdmesh_cache_client::Watchdog;
use pdmesh_cache_client::client::DataPlane;
use pdmesh_engine::EngineConfig;

use crate::error::Error;
use crate::faults::FaultArgs;
use crate::pd::Role;

#[cfg(test)]
mod tests;

/// Configuration of the worker service.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct Config {
    /// Model to serve: a GGUF file (llama family), or a directory with an HF DeepSeek V3.2
    /// checkpoint (`config.json`, safetensors, `tokenizer.json`).
    #[arg(long = "model", env = "PDMESH_MODEL", default_value_os_t = pdmesh_gguf::models::default_model_path())]
    pub model: PathBuf,
    /// Sequences decoded together at most.
    #[arg(long, env = "PDMESH_MAX_BATCH", default_value_t = 32)]
    pub max_batch: usize,
    /// KV pages in the engine's pool.
    #[arg(long, env = "PDMESH_KV_PAGES", default_value_t = 2048)]
    pub kv_pages: usize,
    /// Hybrid models (Gemma 3): pages' worth of KV for the sliding-window layers, held
    /// only by pages some window still reads. Default: every batch slot's window and one
    /// prefill chunk (at most --kv-pages).
    #[arg(long, env = "PDMESH_KV_WINDOW_PAGES")]
    pub kv_window_pages: Option<usize>,
    /// Tokens per KV page.
    #[arg(long, env = "PDMESH_PAGE_SIZE", default_value_t = 16)]
    pub page_size: usize,
    /// Prompt tokens processed per engine step, summed over prefilling sequences.
    #[arg(long, env = "PDMESH_PREFILL_CHUNK", default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Keeps the inter-token gap of decoding streams near this many milliseconds while
    /// prompts are computed: a step that decodes takes only the prompt tokens that fit
    /// (measured as it runs, at least a page's worth); 0 always takes --prefill-chunk.
    /// Output does not depend on it, only how prompts are cut into chunks.
    #[arg(long, env = "PDMESH_STEP_TARGET_MS", default_value_t = 200)]
    pub step_target_ms: u64,
    /// Compute threads; 0 uses every core.
    #[arg(long, env = "PDMESH_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Tensor-parallel ranks (llama-family models only): each rank computes its share of
    /// the attention heads and matrix rows and the ranks all-gather their results, so
    /// outputs are bit-identical to --tp 1 (unsharded). At most the model's KV heads.
    #[arg(long, env = "PDMESH_TP", default_value_t = 1)]
    pub tp: usize,
    /// Where the model runs: `cpu`, or `cuda` (in a build with the `cuda` feature; one GPU
    /// per tensor-parallel rank; DeepSeek checkpoints on one GPU).
    #[arg(long, env = "PDMESH_DEVICE", value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// With --device cuda: the GPUs, one per tensor-parallel rank (default: 0 to tp-1).
    #[arg(long, env = "PDMESH_GPUS", value_delimiter = ',')]
    pub gpus: Vec<usize>,
    /// With --device cuda: the architecture NVRTC compiles the kernels for (`sm_90`,
    /// `sm_120`, ...); default: each GPU's own.
    #[arg(long, env = "PDMESH_GPU_ARCH")]
    pub gpu_arch: Option<String>,
    /// With --device cuda: cuBLAS matrix products, faster for large batches but not
    /// batch-invariant (a token's logits then depend on what it was batched with).
    #[arg(long, env = "PDMESH_GPU_FAST")]
    pub gpu_fast: bool,
    /// Cap on the model's context length, in tokens.
    #[arg(long, env = "PDMESH_MAX_CONTEXT")]
    pub max_context: Option<usize>,
    /// Recompute every prompt instead of reusing cached prefix pages (the device tier of
    /// the KV cache), e.g. as the reference for differential tests.
    #[arg(long, env = "PDMESH_DISABLE_PREFIX_CACHE")]
    pub disable_prefix_cache: bool,
    /// The cache service holding the host tier of the KV cache (e.g.
    /// `http://127.0.0.1:50063`); without it the worker uses its device tier only.
    #[arg(long, env = "PDMESH_CACHE_URL")]
    pub cache_url: Option<String>,
    /// The same cache service as other hosts reach it (default: --cache-url), reported in
    /// ModelInfo: the gateway names it to prefill workers on other hosts as the home of
    /// this decode worker's rooms, and routes by it.
    #[arg(long, env = "PDMESH_CACHE_ADVERTISE_URL")]
    pub cache_advertise_url: Option<String>,
    /// How KV pages travel to and from the host mirror.
    #[arg(long, env = "PDMESH_CACHE_DATA_PLANE", value_enum, default_value_t = DataPlane::Shm)]
    pub cache_data_plane: DataPlane,
    /// When device pages are written to the host mirror.
    #[arg(long, env = "PDMESH_CACHE_WRITE_POLICY", value_enum, default_value_t = WritePolicyArg::WriteThrough)]
    pub cache_write_policy: WritePolicyArg,
    /// Reuses before a page is written (write-through-selective).
    #[arg(long, env = "PDMESH_CACHE_WRITE_HITS", default_value_t = 2)]
    pub cache_write_hits: u32,
    /// A host-mirror hit shorter than this many pages is recomputed rather than loaded.
    #[arg(long, env = "PDMESH_HOST_LOAD_MIN_PAGES", default_value_t = 1)]
    pub host_load_min_pages: usize,
    /// Use the cache service only for prefill/decode hand-overs: never look up or store
    /// prompt pages in its host mirror (the host tier of the KV cache is off).
    #[arg(long, env = "PDMESH_NO_HOST_TIER")]
    pub no_host_tier: bool,
    /// What this worker runs: `unified` (prompt and generation), or one side of
    /// prefill/decode disaggregation (`prefill`, `decode`; they need --cache-url).
    #[arg(long, env = "PDMESH_ROLE", value_enum, default_value_t = Role::Unified)]
    pub role: Role,
    /// Decode: how long a request may wait for pages before it is refused
    /// (RESOURCE_EXHAUSTED) instead of queueing further.
    #[arg(long, env = "PDMESH_ADMISSION_TIMEOUT_MS", default_value_t = 30_000)]
    pub admission_timeout_ms: u64,
    /// Most requests waiting in the engine's queue; one more is refused with
    /// RESOURCE_EXHAUSTED (the gateway's 429) instead of waiting without bound.
    #[arg(long, env = "PDMESH_MAX_QUEUED_REQUESTS", default_value_t = pdmesh_engine::DEFAULT_MAX_QUEUED)]
    pub max_queued_requests: usize,
    /// Prefill and decode: the longest one request's KV hand-over may take on this side
    /// (DEADLINE_EXCEEDED past it). Prefill's runs from its first token to the commit;
    /// decode's from when prefill starts writing. While prefill computes, the room's
    /// deadline at the cache service bounds decode's wait, and this one each answer.
    #[arg(long, env = "PDMESH_TRANSFER_TIMEOUT_MS", default_value_t = 60_000)]
    pub transfer_timeout_ms: u64,
    /// The watchdog counts a stall (and logs it) when the engine loop has work but has
    /// not finished a step for this long.
    #[arg(long, env = "PDMESH_WATCHDOG_STALL_MS", default_value_t = 10_000)]
    pub watchdog_stall_ms: u64,
    /// What the watchdog does at a stall: `soft` logs and counts it; `hard` also ends every
    /// request in flight with UNAVAILABLE (aborting their rooms, so the host slots are
    /// freed and the peer told at once) and refuses new ones until the loop moves again.
    #[arg(long, env = "PDMESH_WATCHDOG", value_enum, default_value_t = Watchdog::Soft)]
    pub watchdog: Watchdog,
    /// Where incident reports (an engine-loop stall, a page failing its checksum on load
    /// or in a hand-over) are written.
    #[command(flatten)]
    pub incidents: pdmesh_incident::IncidentArgs,
    /// At SIGTERM the worker drains: it refuses new requests (UNAVAILABLE, and Health
    /// says not ok, so gateways send them elsewhere) and lets the running ones finish
    /// for up to this long, then aborts what is left (their rooms end cleanly) and
    /// exits. Keep it under the pod's terminationGracePeriodSeconds.
    #[arg(long, env = "PDMESH_DRAIN_TIMEOUT_MS", default_value_t = 20_000)]
    pub drain_timeout_ms: u64,
    /// A second, plaintext port serving only grpc.health.v1 (`readiness`, `liveness`), for
    /// probes that cannot speak the mesh's mutual TLS, such as Kubernetes' gRPC probes.
    /// It answers nothing but SERVING or NOT_SERVING; the worker's own port serves health
    /// as well.
    #[arg(long, env = "PDMESH_HEALTH_LISTEN")]
    pub health_listen: Option<std::net::SocketAddr>,
    /// The mesh's OpenAI endpoint (`http://host:port/v1`) for the reports' replay
    /// command (`pdmesh up` passes its gateway's).
    #[arg(long, env = "PDMESH_INCIDENT_REPLAY_URL")]
    pub incident_replay_url: Option<String>,
    /// Keep the request's prompt token ids in incident reports (by default a report
    /// holds only ids, lengths, timings, layouts and error classes, never the prompt).
    #[arg(long, env = "PDMESH_INCIDENT_INCLUDE_PROMPTS")]
    pub incident_include_prompts: bool,
    /// DeepSeek models: the MLA latent's cache form, bf16 (1152 B per token per layer) or
    /// fp8 (656 B: fp8 values with per-128 f32 scales, bf16 rope part).
    #[arg(long, env = "PDMESH_KV_CACHE_DTYPE", value_enum, default_value_t = KvCacheDtype::Bf16)]
    pub kv_cache_dtype: KvCacheDtype,
    /// DeepSeek models: the indexer key's cache form, fp8 (132 B, scales at the page tail)
    /// or bf16 (256 B).
    #[arg(long, env = "PDMESH_INDEX_K_DTYPE", value_enum, default_value_t = IndexKDtypeArg::Fp8)]
    pub index_k_dtype: IndexKDtypeArg,
    /// Test-only fault injection (`--fault-*`, hidden; no environment variables).
    #[command(flatten)]
    pub faults: FaultArgs,
    /// The mesh credential (mutual TLS or the mesh token) for this worker's gRPC server
    /// and its calls to the cache service.
    #[command(flatten)]
    pub tls: pdmesh_tls::TlsArgs,
}

/// `--device` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    Cpu,
    Cuda,
}

/// `--kv-cache-dtype` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KvCacheDtype {
    Bf16,
    Fp8,
}

/// `--index-k-dtype` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum IndexKDtypeArg {
    Fp8,
    Bf16,
}

/// `--cache-write-policy` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WritePolicyArg {
    /// As soon as a request's pages enter the device cache.
    WriteThrough,
    /// Once a page was reused `--cache-write-hits` times.
    WriteThroughSelective,
    /// When the device cache evicts a page.
    WriteBack,
}

impl Config {
    /// The defaults the command line has, serving the model at `model`.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        Self {
            model: model.into(),
            max_batch: 32,
            kv_pages: 2048,
            kv_window_pages: None,
            page_size: 16,
            prefill_chunk: 512,
            step_target_ms: 200,
            threads: 0,
            tp: 1,
            device: Device::Cpu,
            gpus: Vec::new(),
            gpu_arch: None,
            gpu_fast: false,
            max_context: None,
            disable_prefix_cache: false,
            cache_url: None,
            cache_advertise_url: None,
            cache_data_plane: DataPlane::Shm,
            cache_write_policy: WritePolicyArg::WriteThrough,
            cache_write_hits: 2,
            host_load_min_pages: 1,
            no_host_tier: false,
            role: Role::Unified,
            admission_timeout_ms: 30_000,
            max_queued_requests: pdmesh_engine::DEFAULT_MAX_QUEUED,
            transfer_timeout_ms: 60_000,
            watchdog_stall_ms: 10_000,
            watchdog: Watchdog::Soft,
            incidents: pdmesh_incident::IncidentArgs::default(),
            incident_replay_url: None,
            incident_include_prompts: false,
            drain_timeout_ms: 20_000,
            health_listen: None,
            kv_cache_dtype: KvCacheDtype::Bf16,
            index_k_dtype: IndexKDtypeArg::Fp8,
            faults: FaultArgs::default(),
            tls: pdmesh_tls::TlsArgs::default(),
        }
    }

    /// The GPUs the engine runs on (`--device cuda`), checked.
    fn gpu_config(&self) -> Result<Option<pdmesh_engine::GpuConfig>, Error> {
        if self.device == Device::Cpu {
            if !self.gpus.is_empty() || self.gpu_arch.is_some() || self.gpu_fast {
                return Err(Error::Config(
                    "--gpus, --gpu-arch and --gpu-fast need --device cuda".into(),
                ));
            }
            return Ok(None);
        }
        if !pdmesh_engine::CUDA_BUILT {
            return Err(Error::Config(
                "--device cuda: this pdmesh was built without the CUDA backend (build it with `--features cuda`)".into(),
            ));
        }
        let devices = if self.gpus.is_empty() {
            (0..self.tp).collect()
        } else {
            self.gpus.clone()
        };
        if self.tp != 1 && self.tp != devices.len() {
            return Err(Error::Config(format!(
                "--tp {} with --gpus naming {} devices: each tensor-parallel rank is one GPU",
                self.tp,
                devices.len()
            )));
        }
        let mut seen = devices.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != devices.len() {
            return Err(Error::Config(format!(
                "--gpus names a GPU twice: {devices:?}"
            )));
        }
        if let Some(a) = &self.gpu_arch {
            let digits = a.strip_prefix("sm_").unwrap_or("");
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(Error::Config(format!(
                    "--gpu-arch {a:?} is not an architecture like sm_90 or sm_120"
                )));
            }
        }
        Ok(Some(pdmesh_engine::GpuConfig {
            devices,
            invariant: !self.gpu_fast,
            arch: self.gpu_arch.clone(),
            kernel_cache: None,
        }))
    }

    /// What an incident report shows of this worker's configuration.
    pub(crate) fn report_config(
        &self,
        layout: &pdmesh_kv::KvLayout,
    ) -> std::collections::BTreeMap<String, String> {
        let faults = self.faults.active();
        [
            ("role", self.role.name().to_owned()),
            ("kv layout", layout.describe()),
            ("kv layout fingerprint", layout.fingerprint_hex()),
            ("cache url", self.cache_url.clone().unwrap_or_default()),
            ("host tier", (!self.no_host_tier).to_string()),
            (
                "cache write policy",
                format!("{:?}", self.cache_write_policy),
            ),
            ("transfer timeout ms", self.transfer_timeout_ms.to_string()),
            (
                "watchdog",
                format!("{:?} after {} ms", self.watchdog, self.watchdog_stall_ms),
            ),
            (
                "faults (TEST ONLY)",
                if faults.is_empty() {
                    "none".into()
                } else {
                    faults.join(", ")
                },
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Checks the values and converts them to the engine's configuration.
    pub fn engine_config(&self) -> Result<EngineConfig, Error> {
        for (name, value) in [
            ("max-batch", self.max_batch),
            ("kv-pages", self.kv_pages),
            ("page-size", self.page_size),
            ("prefill-chunk", self.prefill_chunk),
            ("tp", self.tp),
            ("max-queued-requests", self.max_queued_requests),
        ] {
            if value == 0 {
                return Err(Error::Config(format!("--{name} must be at least 1")));
            }
        }
        if self.max_context == Some(0) {
            return Err(Error::Config("--max-context must be at least 1".into()));
        }
        for (name, value) in [
            ("admission-timeout-ms", self.admission_timeout_ms),
            ("transfer-timeout-ms", self.transfer_timeout_ms),
            ("watchdog-stall-ms", self.watchdog_stall_ms),
        ] {
            if value == 0 {
                return Err(Error::Config(format!("--{name} must be at least 1")));
            }
        }
        if self.role != Role::Unified {
            if self.cache_url.is_none() {
                return Err(Error::Config(format!(
                    "a {} worker needs --cache-url: its KV travels through the cache service",
                    self.role.name()
                )));
            }
            if self.cache_data_plane != DataPlane::Shm {
                return Err(Error::Config(format!(
                    "a {} worker needs --cache-data-plane shm",
                    self.role.name()
                )));
            }
        }
        if self.no_host_tier && self.cache_url.is_none() {
            return Err(Error::Config(
                "--no-host-tier turns off the cache service's host tier: it needs --cache-url"
                    .into(),
            ));
        }
        if self.cache_url.is_some() && self.disable_prefix_cache {
            return Err(Error::Config(
                "--cache-url needs the prefix cache: drop --disable-prefix-cache".into(),
            ));
        }
        if let Some(url) = &self.cache_url {
            // A typo must stop the worker here, not turn into retries forever.
            let ok = tonic::transport::Endpoint::from_shared(url.clone())
                .is_ok_and(|e| matches!(e.uri().scheme_str(), Some("http" | "https")));
            if !ok {
                return Err(Error::Config(format!(
                    "--cache-url {url:?} is not an http:// or https:// URL"
                )));
            }
        }
        Ok(EngineConfig {
            model_path: self.model.clone(),
            max_batch: self.max_batch,
            page_size: self.page_size,
            kv_pages: self.kv_pages,
            kv_window_pages: self.kv_window_pages,
            prefill_chunk: self.prefill_chunk,
            step_target: (self.step_target_ms > 0)
                .then(|| std::time::Duration::from_millis(self.step_target_ms)),
            threads: self.threads,
            tp: self.tp,
            gpu: self.gpu_config()?,
            max_context: self.max_context,
            capture_logits: false,
            prefix_cache: !self.disable_prefix_cache,
            host_min_pages: self.host_load_min_pages,
            kv_cache_dtype: match self.kv_cache_dtype {
                KvCacheDtype::Bf16 => pdmesh_kv::MlaCacheDtype::Bf16,
                KvCacheDtype::Fp8 => pdmesh_kv::MlaCacheDtype::Fp8,
            },
            index_k_dtype: match self.index_k_dtype {
                IndexKDtypeArg::Fp8 => pdmesh_kv::IndexKDtype::Fp8,
                IndexKDtypeArg::Bf16 => pdmesh_kv::IndexKDtype::Bf16,
            },
            max_queued: Some(self.max_queued_requests),
        })
    }
}

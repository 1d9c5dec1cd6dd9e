//! Where the forward pass runs. The CPU backend is always built; the CUDA backend only
//! with the cargo feature `cuda`. This configuration exists in every build, so a worker
//! asked for a GPU by a build without CUDA says so instead of ignoring the flag.

use std::path::PathBuf;

/// Run the model on GPUs (the CUDA backend).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuConfig {
    /// Device ordinals, one per tensor-parallel rank: rank `i` runs on `devices[i]`.
    pub devices: Vec<usize>,
    /// Batch-invariant matrix products (default): every output is computed by one warp in
    /// a fixed order, so a token's logits never depend on its batch. Off: cuBLAS SGEMM,
    /// faster for large batches, whose results depend on the batch shape.
    pub invariant: bool,
    /// NVRTC target (`sm_90`, `sm_120`, ...); `None` takes each device's own.
    pub arch: Option<String>,
    /// Where compiled kernels are cached; `None`: `$PDMESH_KERNEL_CACHE`, else the user
    /// cache directory.
    pub kernel_cache: Option<PathBuf>,
}

impl Default for GpuConfig {
    fn default() -> Self {
        Self {
            devices: vec![0],
            invariant: true,
            arch: None,
            kernel_cache: None,
        }
    }
}

/// Whether this build has the CUDA backend.
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// Which kind of GPU failure: what callers and metrics classify by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaErrorKind {
    /// The device has no memory left for what was asked (weights, KV, workspace).
    OutOfMemory,
    /// The driver, a kernel or a copy failed: the device may be unusable until restart.
    Device,
    /// A library or the kernels could not be set up (NVRTC, cuBLAS, NCCL, a module).
    Setup,
    /// The checkpoint or the options do not fit this backend.
    Unsupported,
}

/// A GPU failure: its kind, and what was being done.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("CUDA: {what}")]
pub struct CudaError {
    pub kind: CudaErrorKind,
    pub what: String,
}

impl CudaError {
    pub fn new(kind: CudaErrorKind, what: impl Into<String>) -> Self {
        Self {
            kind,
            what: what.into(),
        }
    }

    pub fn device(what: impl Into<String>) -> Self {
        Self::new(CudaErrorKind::Device, what)
    }

    pub fn setup(what: impl Into<String>) -> Self {
        Self::new(CudaErrorKind::Setup, what)
    }

    pub fn unsupported(what: impl Into<String>) -> Self {
        Self::new(CudaErrorKind::Unsupported, what)
    }

    /// The same failure, saying where (`GPU 1`, `rank 0`).
    pub fn at(self, place: impl std::fmt::Display) -> Self {
        Self {
            kind: self.kind,
            what: format!("{place}: {}", self.what),
        }
    }
}

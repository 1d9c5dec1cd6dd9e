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

//! One GPU as the engine uses it: its context, three streams (compute, load-back from the
//! host, write-back to the host), the kernels of `kernels/cuda` compiled for its
//! architecture, and cuBLAS for the fast (not batch-invariant) matrix products.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig};
use cudarc::nvrtc::Ptx;

use super::{CudaError, cuda_err};

/// How kernels are built for a device.
#[derive(Clone, Debug, Default)]
pub struct KernelBuild {
    /// `sm_90`, `sm_120`, ...; `None` takes the device's own compute capability.
    pub arch: Option<String>,
    /// Where compiled PTX is cached by source hash; `None` takes the default cache.
    pub cache_dir: Option<PathBuf>,
}

/// A device with everything the forward pass launches on it.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    /// Kernels and matrix products.
    pub compute: Arc<CudaStream>,
    /// Host → device copies of pages (load-back), overlapping compute.
    pub load: Arc<CudaStream>,
    pub blas: CudaBlas,
    pub arch: String,
    kernels: HashMap<String, CudaFunction>,
}

/// The architecture name NVRTC wants for a compute capability.
pub fn arch_for(major: i32, minor: i32) -> String {
    format!("sm_{major}{minor}")
}

impl Gpu {
    /// Create and bind device `ordinal`'s context on the calling thread, compile (or read
    /// from the cache) and load every kernel.
    pub fn open(ordinal: usize, build: &KernelBuild) -> Result<Self, CudaError> {
        let ctx = catch_missing_library(|| CudaContext::new(ordinal))?.map_err(cuda_err)?;
        ctx.bind_to_thread().map_err(cuda_err)?;
        // SAFETY: streams are ordered by hand (before any allocation): every buffer is
        // allocated, used and freed on the compute stream, except the pool, which the load
        // stream also writes — whole layers of stale pages, each followed by an event that
        // compute waits on before it touches that layer, and the forward ends with a
        // synchronous copy on compute, after every wait. Without this, cudarc's per-buffer
        // events would make compute wait for the whole upload before layer 0.
        unsafe { ctx.disable_event_tracking() };
        let arch = match &build.arch {
            Some(a) => a.clone(),
            None => {
                let (maj, min) = ctx.compute_capability().map_err(cuda_err)?;
                arch_for(maj, min)
            }
        };
        let mut kernels = HashMap::new();
        for (name, image, names) in kernel_images(&arch, build)? {
            let module = ctx
                .load_module(image)
                .map_err(|e| CudaError::setup(format!("loading module {name}: {e}")))?;
            for &k in names {
                let f = module
                    .load_function(k)
                    .map_err(|e| CudaError::setup(format!("kernel {k}: {e}")))?;
                kernels.insert(k.to_owned(), f);
            }
        }
        let compute = ctx.new_stream().map_err(cuda_err)?;
        let load = ctx.new_stream().map_err(cuda_err)?;
        let blas = catch_library("cuBLAS (libcublas)", || CudaBlas::new(compute.clone()))?
            .map_err(CudaError::from)?;
        tracing::info!(ordinal, %arch, kernels = kernels.len(), name = ?ctx.name().ok(), "GPU ready");
        Ok(Self {
            ctx,
            compute,
            load,
            blas,
            arch,
            kernels,
        })
    }

    /// A loaded kernel by name (the names `pdmesh_kernels::cuda_src` lists).
    pub fn kernel(&self, name: &str) -> &CudaFunction {
        self.kernels
            .get(name)
            .unwrap_or_else(|| panic!("kernel {name} is not in kernels/cuda"))
    }
}

/// The kernels as images the driver loads: PTX from the disk cache, or, when the driver is
/// older than NVRTC (it could not JIT the newer PTX), CUBINs for `arch` itself.
#[allow(clippy::type_complexity)]
fn kernel_images(
    arch: &str,
    build: &KernelBuild,
) -> Result<Vec<(&'static str, Ptx, &'static [&'static str])>, CudaError> {
    use pdmesh_kernels::nvrtc;
    let what =
        |e: nvrtc::NvrtcError| CudaError::setup(format!("compiling kernels for {arch}: {e}"));
    let (major, minor) = nvrtc::nvrtc_version().map_err(what)?;
    let mut driver = 0i32;
    // SAFETY: one valid out-pointer; the driver is loaded (a context exists).
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }
        .result()
        .map_err(cuda_err)?;
    if driver < major * 1000 + minor * 10 {
        tracing::info!(driver, nvrtc = ?(major, minor), %arch, "driver older than NVRTC: loading CUBINs");
        return Ok(nvrtc::compile_cubins(arch)
            .map_err(what)?
            .into_iter()
            .map(|(src, cubin)| (src.name, Ptx::from_binary(cubin), src.kernels))
            .collect());
    }
    Ok(nvrtc::compile_ptx_cached(arch, build.cache_dir.as_deref())
        .map_err(what)?
        .into_iter()
        .map(|m| (m.name, Ptx::from_src(m.ptx), m.kernels))
        .collect())
}

/// A launch of `grid` blocks of `block` threads, no dynamic shared memory.
pub fn grid(grid: (u32, u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// cudarc panics when a CUDA library cannot be loaded; turn that into an error naming the
/// library, so a machine without a driver gets a clear message instead of a crash.
pub fn catch_missing_library<T>(f: impl FnOnce() -> T) -> Result<T, CudaError> {
    catch_library("the CUDA driver", f).map_err(|e| {
        CudaError::setup(format!(
            "{}; is this a GPU machine with the NVIDIA driver (libcuda.so.1) installed?",
            e.what
        ))
    })
}

/// [`catch_missing_library`] for any library, named by `what`.
pub fn catch_library<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, CudaError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        CudaError::setup(format!("{what} could not be used ({msg})"))
    })
}

//! What every rank does with the engine's host pool: pin it once, and copy its stale pages
//! up layer by layer. Shared by `LlamaRank` and `DsRank`.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtrMut, sys};
use pdmesh_kv::KvLayout;

use super::job::{HostArena, Job};
use super::{CudaError, cuda_err};

/// The host arena registered as pinned memory (portable: every context's copies from it
/// are DMA), unregistered on drop — which runs on the rank's thread before the engine
/// frees the pool (`CudaModel` releases its ranks first).
pub(crate) struct PinnedHost {
    ctx: Arc<CudaContext>,
    arena: Option<HostArena>,
    /// Registration was tried (and logged if it failed): not tried again each forward.
    tried: bool,
}

impl PinnedHost {
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Self {
        Self {
            ctx,
            arena: None,
            tried: false,
        }
    }

    /// Pin `host`, once. Failing to is only slower (pageable copies), so it is logged,
    /// once.
    pub(crate) fn register(&mut self, host: HostArena) {
        if self.tried {
            return;
        }
        self.tried = true;
        // SAFETY: the arena is alive until this is dropped (see the type's docs).
        let r = unsafe {
            sys::cuMemHostRegister_v2(
                host.ptr as *mut _,
                host.len,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?r, "could not pin the KV pool's host memory");
            return;
        }
        self.arena = Some(host);
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if let Some(h) = self.arena.take() {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: registered by `register` with this pointer.
            let _ = unsafe { sys::cuMemHostUnregister(h.ptr as *mut _) };
        }
    }
}

/// Copy `job`'s stale pages from the host arena into the device `pool` on the `load`
/// stream, layer by layer, recording an event after each layer (none when nothing is
/// stale). Compute waits on layer `l`'s event before it writes or reads layer `l`.
pub(crate) fn upload_layers(
    load: &Arc<CudaStream>,
    pool: &mut CudaSlice<u8>,
    layout: &KvLayout,
    job: &Job,
) -> Result<Vec<CudaEvent>, CudaError> {
    if job.uploads.is_empty() {
        return Ok(Vec::new());
    }
    let (base, _sync) = pool.device_ptr_mut(load);
    let mut events = Vec::with_capacity(layout.layers());
    for layer in 0..layout.layers() {
        let within = layout.layer_range(layer);
        for &p in &job.uploads {
            let off = layout.page_offset(p as usize);
            let (start, end) = (off + within.start, off + within.end);
            // SAFETY: the engine thread keeps the arena alive and unchanged until this
            // forward returns; the range is inside the page.
            let src = unsafe { job.host.bytes(start..end) };
            // SAFETY: `base + start .. + len` lies inside the device pool (same layout
            // and page count as the host pool).
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    base + start as u64,
                    src,
                    load.cu_stream(),
                )
            }
            .map_err(cuda_err)?;
        }
        events.push(load.record_event(None).map_err(cuda_err)?);
    }
    Ok(events)
}

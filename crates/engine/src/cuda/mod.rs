//! The CUDA backend (cargo feature `cuda`): llama-family models on one or more GPUs,
//! DeepSeek V3.2 on one.
//!
//! Each GPU is driven by one actix actor on its own OS thread (a `SyncArbiter` of one),
//! which creates and binds the device's context in `started()` and owns everything on
//! that device: kernels, weights, the device copy of the KV pool, the NCCL communicator.
//! The actor is a thin shell over a [`Rank`]: [`llama::LlamaRank`] or
//! [`deepseek::DsRank`], plain structs.
//!
//! [`CudaModel`] is what the engine holds: for each forward it works out which pages the
//! devices lack, sends every rank the same [`llama::Job`], waits for all of them, writes
//! the KV bytes they computed back into the host pool and returns rank 0's logits.

pub mod deepseek;
pub mod device;
mod host;
pub mod job;
pub mod llama;

use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use actix::{Actor, Addr, Handler, Message, SyncArbiter, SyncContext};
use pdmesh_gguf::GgufFile;
use pdmesh_kv::{KvLayout, PageId, PagePool};

pub use device::KernelBuild;
use job::{HostArena, Job, RankOut};
use llama::{LlamaRank, RankSpec};

use crate::deepseek::DeepSeekModel;
use crate::llama_config::LlamaConfig;
use crate::model::BatchToken;
use crate::tp::ShardPlan;

pub use crate::gpu::{CudaError, CudaErrorKind};

/// A driver failure as a [`CudaError`]: out of memory is told apart from the rest.
pub(crate) fn cuda_err(e: impl Into<CudaError>) -> CudaError {
    e.into()
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        use cudarc::driver::sys::CUresult;
        let kind = if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            CudaErrorKind::OutOfMemory
        } else {
            CudaErrorKind::Device
        };
        Self::new(kind, e.to_string())
    }
}

impl From<cudarc::cublas::result::CublasError> for CudaError {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        use cudarc::cublas::sys::cublasStatus_t;
        let kind = if e.0 == cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED {
            CudaErrorKind::OutOfMemory
        } else {
            CudaErrorKind::Device
        };
        Self::new(kind, format!("cuBLAS: {e:?}"))
    }
}

/// Which GPUs and how.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// Device ordinals, one per tensor-parallel rank (rank `i` on `devices[i]`).
    pub devices: Vec<usize>,
    /// Batch-invariant matrix products (the default). Off: cuBLAS SGEMM, faster at large
    /// batches, but a token's logits then depend on what it was batched with.
    pub invariant: bool,
    pub build: KernelBuild,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            devices: vec![0],
            invariant: true,
            build: KernelBuild::default(),
        }
    }
}

/// What a device actor drives: one rank of either model family.
pub enum Rank {
    Llama(Box<LlamaRank>),
    DeepSeek(Box<deepseek::DsRank>),
}

impl Rank {
    fn forward(&mut self, job: &Job) -> Result<RankOut, CudaError> {
        let out = match self {
            Rank::Llama(r) => r.forward(job),
            Rank::DeepSeek(r) => r.forward(job),
        };
        if out.is_err() {
            // Copies from the pinned host pool and kernels may still be queued: let them
            // finish before the error lets anyone free the pool or unpin it.
            let gpu = match self {
                Rank::Llama(r) => &r.gpu,
                Rank::DeepSeek(r) => &r.gpu,
            };
            let _ = gpu.load.synchronize();
            let _ = gpu.compute.synchronize();
        }
        out
    }
}

type Init = Box<dyn FnOnce() -> Result<Rank, CudaError> + Send>;
type Ready = mpsc::Sender<(usize, Result<(), CudaError>)>;
/// A rank's start-up work, taken once by its actor's factory.
type InitSlot = Arc<Mutex<Option<(Init, Ready)>>>;

/// The device actor: one per GPU.
struct DeviceActor {
    init: Option<Init>,
    ready: Option<Ready>,
    index: usize,
    rank: Option<Rank>,
}

impl Actor for DeviceActor {
    type Context = SyncContext<Self>;

    /// Runs on the actor's own thread: creates and binds the context, loads the weights.
    fn started(&mut self, _: &mut Self::Context) {
        let Some(init) = self.init.take() else { return };
        let res = init().map(|r| self.rank = Some(r));
        if let Some(tx) = self.ready.take() {
            let _ = tx.send((self.index, res));
        }
    }
}

struct Forward {
    job: Arc<Job>,
    reply: mpsc::Sender<(usize, Result<RankOut, CudaError>)>,
}

impl Message for Forward {
    type Result = ();
}

impl Handler<Forward> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: Forward, _: &mut Self::Context) {
        let out = match self.rank.as_mut() {
            Some(r) => r.forward(&msg.job),
            None => Err(CudaError::device("the device failed to start")),
        };
        let _ = msg.reply.send((self.index, out));
    }
}

/// Drop the rank (its device memory, and rank 0's registration of the host pool) now, on
/// the actor's thread, and say when done: the engine frees the host pool right after.
struct Release(mpsc::Sender<()>);

impl Message for Release {
    type Result = ();
}

impl Handler<Release> for DeviceActor {
    type Result = ();
    fn handle(&mut self, msg: Release, _: &mut Self::Context) {
        self.rank = None;
        let _ = msg.0.send(());
    }
}

/// A model on GPUs, as the engine holds it.
pub struct CudaModel {
    pub vocab: usize,
    layout: Arc<KvLayout>,
    ranks: Vec<Addr<DeviceActor>>,
    system: actix::System,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Per page, the host pool version the devices hold.
    mirror: Mutex<Vec<u64>>,
}

impl std::fmt::Debug for CudaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaModel")
            .field("ranks", &self.ranks.len())
            .finish()
    }
}

impl CudaModel {
    /// A llama-family model: start one device actor per entry of `opts.devices` and load
    /// every rank.
    pub fn load(
        gguf: Arc<GgufFile>,
        cfg: LlamaConfig,
        layout: Arc<KvLayout>,
        pages: usize,
        opts: &CudaOptions,
    ) -> Result<Self, CudaError> {
        let world = opts.devices.len();
        if world == 0 {
            return Err(CudaError::unsupported("no devices given"));
        }
        let plan = Arc::new(
            ShardPlan::new(&cfg, world).map_err(|e| CudaError::unsupported(e.to_string()))?,
        );
        let nccl = if world > 1 {
            Some(
                device::catch_library(
                    "NCCL (libnccl.so on LD_LIBRARY_PATH)",
                    cudarc::nccl::Id::new,
                )?
                .map_err(|e| {
                    CudaError::setup(format!(
                        "NCCL unique id: {e:?} (is libnccl.so on LD_LIBRARY_PATH?)"
                    ))
                })?,
            )
        } else {
            None
        };
        let mut inits: Vec<Init> = Vec::new();
        for (rank, &ordinal) in opts.devices.iter().enumerate() {
            let spec = RankSpec {
                ordinal,
                rank,
                plan: plan.clone(),
                invariant: opts.invariant,
                build: opts.build.clone(),
            };
            let (g, c, l) = (gguf.clone(), cfg.clone(), layout.clone());
            let init: Init = Box::new(move || {
                LlamaRank::load(spec, &g, &c, l, pages, nccl).map(|r| Rank::Llama(Box::new(r)))
            });
            inits.push(init);
        }
        Self::start(inits, cfg.vocab, layout, pages, opts, "llama")
    }

    /// DeepSeek V3.2 on one GPU (`opts.devices` holds exactly one): the rank uploads the
    /// CPU model's weights and `model` is dropped once it has.
    pub fn load_deepseek(
        model: DeepSeekModel,
        layout: Arc<KvLayout>,
        pages: usize,
        opts: &CudaOptions,
    ) -> Result<Self, CudaError> {
        let &[ordinal] = opts.devices.as_slice() else {
            return Err(CudaError::unsupported(format!(
                "DeepSeek runs on one GPU; {} devices given",
                opts.devices.len()
            )));
        };
        let vocab = model.cfg.vocab_size;
        let (build, invariant, l) = (opts.build.clone(), opts.invariant, layout.clone());
        let model = Arc::new(model);
        let init: Init = Box::new(move || {
            deepseek::DsRank::load(ordinal, &build, invariant, model, l, pages)
                .map(|r| Rank::DeepSeek(Box::new(r)))
        });
        Self::start(vec![init], vocab, layout, pages, opts, "DeepSeek")
    }

    /// Start one device actor per init (rank `i` on `opts.devices[i]`) and wait until
    /// every rank has loaded.
    fn start(
        inits: Vec<Init>,
        vocab: usize,
        layout: Arc<KvLayout>,
        pages: usize,
        opts: &CudaOptions,
        family: &str,
    ) -> Result<Self, CudaError> {
        let world = inits.len();
        let (ready_tx, ready_rx) = mpsc::channel();
        let inits: Vec<InitSlot> = inits
            .into_iter()
            .map(|i| Arc::new(Mutex::new(Some((i, ready_tx.clone())))))
            .collect();
        drop(ready_tx);
        let (addr_tx, addr_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("pdmesh-gpu-system".into())
            .spawn(move || {
                let runner = actix::System::new();
                let addrs: Vec<Addr<DeviceActor>> = runner.block_on(async move {
                    inits
                        .into_iter()
                        .enumerate()
                        .map(|(index, slot)| {
                            // SyncArbiter wants a factory it could call again; the rank
                            // exists once, so a restarted actor has no device.
                            SyncArbiter::start(1, move || {
                                let taken = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
                                let (init, ready) = match taken {
                                    Some((i, r)) => (Some(i), Some(r)),
                                    None => (None, None),
                                };
                                DeviceActor {
                                    init,
                                    ready,
                                    index,
                                    rank: None,
                                }
                            })
                        })
                        .collect()
                });
                if addr_tx.send((addrs, actix::System::current())).is_err() {
                    return;
                }
                if let Err(e) = runner.run() {
                    tracing::error!(error = %e, "GPU actor system failed");
                }
            })
            .map_err(|e| CudaError::device(format!("starting the GPU actor thread: {e}")))?;
        let (ranks, system) = addr_rx
            .recv()
            .map_err(|_| CudaError::device("the GPU actor system did not start"))?;
        let mut me = Self {
            vocab,
            layout: layout.clone(),
            ranks,
            system,
            thread: Some(thread),
            mirror: Mutex::new(vec![0; pages]),
        };
        let mut first_err = None;
        for _ in 0..world {
            match ready_rx.recv() {
                Ok((_, Ok(()))) => {}
                Ok((i, Err(e))) => {
                    first_err.get_or_insert(e.at(format_args!("GPU {}", opts.devices[i])));
                }
                Err(_) => {
                    first_err
                        .get_or_insert(CudaError::device("a device actor stopped while loading"));
                    break;
                }
            }
        }
        if let Some(e) = first_err {
            me.stop();
            return Err(e);
        }
        tracing::info!(devices = ?opts.devices, invariant = opts.invariant, family, "model on GPU");
        Ok(me)
    }

    fn stop(&mut self) {
        let (tx, rx) = mpsc::channel();
        for addr in &self.ranks {
            addr.do_send(Release(tx.clone()));
        }
        drop(tx);
        // Every rank answers, or its actor is gone (then so is what it held).
        while rx.recv().is_ok() {}
        self.ranks.clear();
        self.system.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// The forward pass: the same contract as `LlamaModel::forward`. A device failure is
    /// the error of every request in the batch (the pool is left as it was: no rank's
    /// KV is copied back unless every rank finished).
    pub fn forward(
        &self,
        pool: &mut PagePool,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
    ) -> Result<Vec<Vec<f32>>, CudaError> {
        let layout = &self.layout;
        let ps = layout.page_size();
        let mut mirror = self.mirror.lock().unwrap_or_else(|e| e.into_inner());
        let mut page_table = Vec::new();
        let mut page_table_start = Vec::with_capacity(seq_pages.len());
        let mut uploads = Vec::new();
        for pages in seq_pages {
            page_table_start.push(page_table.len() as i32);
            for &p in *pages {
                page_table.push(p as i32);
                let v = pool.version(p);
                if mirror[p as usize] != v {
                    mirror[p as usize] = v;
                    uploads.push(p);
                }
            }
        }
        uploads.sort_unstable();
        uploads.dedup();
        let page_of = |tk: &BatchToken| seq_pages[tk.seq][tk.pos / ps] as usize;
        // None for every token when the layout's components differ in token stride
        // (DeepSeek's): then the list stays empty and the rank places each component.
        let tok_off: Vec<i64> = tokens
            .iter()
            .map_while(|tk| layout.slot_offset(page_of(tk), tk.pos % ps))
            .map(|at| at as i64)
            .collect();
        let arena = pool.arena();
        let job = Arc::new(Job {
            tokens: tokens.iter().map(|t| t.token).collect(),
            pos: tokens.iter().map(|t| t.pos as i32).collect(),
            seq: tokens.iter().map(|t| t.seq as i32).collect(),
            page_table,
            page_table_start,
            tok_off,
            want: (0..tokens.len() as u32)
                .filter(|&i| tokens[i as usize].want_logits)
                .collect(),
            max_len: tokens.iter().map(|t| t.pos + 1).max().unwrap_or(1),
            uploads,
            host: HostArena {
                ptr: arena.as_ptr(),
                len: arena.len(),
            },
        });
        let (tx, rx) = mpsc::channel();
        for addr in &self.ranks {
            addr.do_send(Forward {
                job: job.clone(),
                reply: tx.clone(),
            });
        }
        drop(tx);
        // Wait for every rank before touching the pool again: they read its arena.
        let mut outs: Vec<Option<RankOut>> = (0..self.ranks.len()).map(|_| None).collect();
        let mut failure = None;
        for _ in 0..self.ranks.len() {
            match rx.recv() {
                Ok((i, Ok(out))) => outs[i] = Some(out),
                Ok((i, Err(e))) => failure = Some(e.at(format_args!("rank {i}"))),
                Err(_) => {
                    failure.get_or_insert(CudaError::device(
                        "a device actor stopped during a forward",
                    ));
                    break;
                }
            }
        }
        if let Some(f) = failure {
            // What the devices hold is unknown now (an upload or a kernel may have stopped
            // half-way): every page is copied again before a later batch reads it.
            mirror.fill(u64::MAX);
            return Err(f);
        }
        let mut logits = Vec::new();
        for (r, out) in outs.into_iter().enumerate() {
            let out = out.expect("every rank answered");
            if r == 0 {
                logits = out.logits;
            }
            // Each span's bytes into its page (spans never cross a page).
            let mut at = 0;
            for sp in &out.spans {
                let (page, off) = layout.locate(sp.at);
                let page = page as PageId;
                let src = &out.kv[at..at + sp.len];
                at += sp.len;
                pool.page_mut(page).expect("a page of the batch")[off..off + sp.len]
                    .copy_from_slice(src);
                // The device wrote these bytes itself: its copy of the page is current.
                mirror[page as usize] = pool.version(page);
            }
            assert_eq!(at, out.kv.len(), "the KV bytes match their spans");
        }
        let vocab = self.vocab;
        Ok(logits.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
    }
}

impl Drop for CudaModel {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Host → device load-back bandwidth, measured the way the forward pass copies pages (one
/// async copy per page and layer, from the pinned host pool, on the load stream), one copy
/// per whole page, and one `cuMemcpyHtoD` of the same bytes, pinned and pageable.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct LoadBack {
    pub bytes: usize,
    /// The engine's copies: per page and layer, pinned source.
    pub per_layer_gb_s: f64,
    /// One copy per page (all its layers), pinned source.
    pub per_page_gb_s: f64,
    /// One copy of all bytes, pinned source.
    pub bulk_pinned_gb_s: f64,
    /// One copy of all bytes, pageable source.
    pub bulk_pageable_gb_s: f64,
}

/// Host memory registered as pinned while this lives (declared after the memory it pins,
/// so it drops first).
struct Registered(*mut std::ffi::c_void);

impl Registered {
    fn new(bytes: &[u8]) -> Result<Self, CudaError> {
        use cudarc::driver::sys;
        let ptr = bytes.as_ptr() as *mut std::ffi::c_void;
        // SAFETY: the caller keeps `bytes` alive and in place while the guard lives.
        let r = unsafe {
            sys::cuMemHostRegister_v2(ptr, bytes.len(), sys::CU_MEMHOSTREGISTER_PORTABLE)
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(CudaError::device(format!("cuMemHostRegister: {r:?}")));
        }
        Ok(Self(ptr))
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        // SAFETY: registered by `new` with this pointer.
        let r = unsafe { cudarc::driver::sys::cuMemHostUnregister(self.0) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?r, "cuMemHostUnregister");
        }
    }
}

/// Measure [`LoadBack`] on device `ordinal` for `pages` pages of `layout`, best of `reps`.
pub fn measure_load_back(
    ordinal: usize,
    layout: &KvLayout,
    pages: usize,
    reps: usize,
) -> Result<LoadBack, CudaError> {
    use cudarc::driver::DevicePtrMut;
    let ctx = device::catch_missing_library(|| cudarc::driver::CudaContext::new(ordinal))?
        .map_err(cuda_err)?;
    ctx.bind_to_thread().map_err(cuda_err)?;
    let load = ctx.new_stream().map_err(cuda_err)?;
    let bytes = layout.bytes_per_pool(pages);
    let host = vec![7u8; bytes];
    let mut dev = load.alloc_zeros::<u8>(bytes).map_err(cuda_err)?;
    let time = |f: &mut dyn FnMut() -> Result<(), CudaError>| -> Result<f64, CudaError> {
        let mut best = f64::INFINITY;
        for _ in 0..reps.max(1) {
            load.synchronize().map_err(cuda_err)?;
            let t = std::time::Instant::now();
            f()?;
            load.synchronize().map_err(cuda_err)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(bytes as f64 / best / 1e9)
    };
    let (base, _sync) = dev.device_ptr_mut(&load);
    // One async copy of host[range] to the same offsets of the device buffer.
    let copy = |r: std::ops::Range<usize>| -> Result<(), CudaError> {
        // SAFETY: `r` lies in both buffers, which hold `bytes` bytes each.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                base + r.start as u64,
                &host[r],
                load.cu_stream(),
            )
        }
        .map_err(cuda_err)
    };
    let bulk_pageable_gb_s = time(&mut || copy(0..bytes))?;
    // Pinned from here; the guard unregisters before `host` drops, on every return.
    let _pinned = Registered::new(&host)?;
    let bulk_pinned_gb_s = time(&mut || copy(0..bytes))?;
    let per_layer_gb_s = time(&mut || {
        for layer in 0..layout.layers() {
            let within = layout.layer_range(layer);
            for p in 0..pages {
                let off = layout.page_offset(p);
                copy(off + within.start..off + within.end)?;
            }
            load.record_event(None).map_err(cuda_err)?;
        }
        Ok(())
    })?;
    let per_page_gb_s = time(&mut || {
        (0..pages).try_for_each(|p| copy(layout.page_offset(p)..layout.page_offset(p + 1)))
    })?;
    Ok(LoadBack {
        bytes,
        per_layer_gb_s,
        per_page_gb_s,
        bulk_pinned_gb_s,
        bulk_pageable_gb_s,
    })
}

/// Device memory this process's stream-ordered allocations on one GPU hold (every buffer
/// an engine allocates), as the driver counts it: the device's memory pool's bytes in use
/// by allocations (not what the pool keeps reserved around them, which grows in chunks).
/// Other processes on the GPU do not count, so tests can run beside it. The probe holds
/// the device's primary context.
pub struct MemProbe {
    ctx: Arc<cudarc::driver::CudaContext>,
}

impl MemProbe {
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        let ctx = device::catch_missing_library(|| cudarc::driver::CudaContext::new(ordinal))?
            .map_err(cuda_err)?;
        if !ctx.has_async_alloc() {
            return Err(CudaError::unsupported(
                "this device has no stream-ordered allocator (cuMemAllocAsync)",
            ));
        }
        Ok(Self { ctx })
    }

    /// Bytes in use now, after the device's pending work (frees included).
    pub fn used(&self) -> Result<usize, CudaError> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread().map_err(cuda_err)?;
        self.ctx.synchronize().map_err(cuda_err)?;
        let mut pool = std::ptr::null_mut();
        let mut used: u64 = 0;
        // SAFETY: a valid device of a bound context; the attribute is a u64.
        unsafe {
            sys::cuDeviceGetMemPool(&mut pool, self.ctx.cu_device())
                .result()
                .map_err(cuda_err)?;
            sys::cuMemPoolGetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                &mut used as *mut u64 as *mut std::ffi::c_void,
            )
            .result()
            .map_err(cuda_err)?;
        }
        Ok(used as usize)
    }
}

/// One matrix product's time: `rows × cols` weights by `tokens` activations.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct MatmulTime {
    pub kernel: llama::MatmulKernel,
    pub rows: usize,
    pub cols: usize,
    pub tokens: usize,
    /// Mean time of one product over the timed launches, microseconds.
    pub us: f64,
    pub gflop_s: f64,
}

/// Time each matrix-product kernel on device `ordinal` for each `(rows, cols, tokens)`:
/// a warm-up launch, then launches back to back on the compute stream (about 2 GFLOP of
/// them, 3 to 200).
pub fn measure_matmul(
    ordinal: usize,
    shapes: &[(usize, usize, usize)],
) -> Result<Vec<MatmulTime>, CudaError> {
    use llama::MatmulKernel;
    let gpu = device::Gpu::open(ordinal, &KernelBuild::default())?;
    let s = gpu.compute.clone();
    // Not zeros: a product of zeros can run faster than one of data.
    let fill = |n: usize| -> Vec<f32> { (0..n).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect() };
    let mut times = Vec::new();
    for &(rows, cols, tokens) in shapes {
        let w = s.clone_htod(&fill(rows * cols)).map_err(cuda_err)?;
        let x = s.clone_htod(&fill(tokens * cols)).map_err(cuda_err)?;
        let mut out = s.alloc_zeros::<f32>(tokens * rows).map_err(cuda_err)?;
        let flop = 2.0 * rows as f64 * cols as f64 * tokens as f64;
        let reps = (2e9 / flop).clamp(3.0, 200.0) as usize;
        for kernel in [
            MatmulKernel::Rows,
            MatmulKernel::Tiles,
            MatmulKernel::Cublas,
        ] {
            let mut once = || {
                llama::matmul(
                    &gpu, &s, kernel, &w, rows, cols, &x, tokens, &mut out, rows, 0,
                )
            };
            once()?;
            s.synchronize().map_err(cuda_err)?;
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                once()?;
            }
            s.synchronize().map_err(cuda_err)?;
            let us = t0.elapsed().as_secs_f64() * 1e6 / reps as f64;
            times.push(MatmulTime {
                kernel,
                rows,
                cols,
                tokens,
                us,
                gflop_s: flop / us / 1e3,
            });
        }
    }
    Ok(times)
}

//! The llama-family forward pass on one GPU, for one tensor-parallel rank: the same
//! all-gather sharding as the CPU's `tp` (a rank owns a range of KV heads and the query
//! heads of those groups, and output-row ranges of `wo`, the MLP and nothing else), so
//! every dot product is computed whole and a token's result does not depend on the
//! number of ranks.
//!
//! Weights are dequantized from the GGUF to f32 on the host at load and kept on the
//! device; the matrix products are `matmul_rows` (one warp per output, a fixed order:
//! batch-invariant) for a few tokens, `matmul_tiles` (the same order and bits, 8 tokens ×
//! 8 rows per warp) for more, or, in the fast mode, cuBLAS SGEMM (its algorithm depends on
//! the batch, so it is not).
//!
//! The device holds a full copy of the engine's page pool. Before a forward, pages whose
//! host version moved (imported from prefill, loaded from the host tier) are copied up on
//! the load stream layer by layer, each layer's copy followed by an event that the compute
//! stream waits on before it writes or reads that layer's KV. After the forward the rows of
//! KV it wrote are gathered into one buffer and handed back, so the host pool stays the
//! authoritative copy that exports and the host tier read.

use std::ops::Range;
use std::sync::Arc;

use cudarc::cublas::{Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg, sys};
use cudarc::nccl::{Comm, Id};
use pdmesh_gguf::GgufFile;
use pdmesh_kernels::QMatrix;
use pdmesh_kv::{DType, KvLayout};

use super::device::{Gpu, KernelBuild, grid};
use super::host::{PinnedHost, upload_layers};
use super::job::{Job, KvSpan, RankOut};
use super::{CudaError, cuda_err};
use crate::llama_config::LlamaConfig;
use crate::tp::{RankShard, ShardPlan};

/// What one rank owns, and what every rank owns (for the gathers).
#[derive(Clone, Debug)]
pub struct RankSpec {
    pub ordinal: usize,
    pub rank: usize,
    /// The CPU's plan (`tp::ShardPlan`): the same split on every backend.
    pub plan: Arc<ShardPlan>,
    /// Batch-invariant matrix products (`matmul_rows` / `matmul_tiles`) instead of cuBLAS.
    pub invariant: bool,
    pub build: KernelBuild,
}

impl RankSpec {
    fn world(&self) -> usize {
        self.plan.world
    }
    fn mine(&self) -> &RankShard {
        &self.plan.ranks[self.rank]
    }
    fn kv(&self, r: usize) -> Range<usize> {
        self.plan.ranks[r].kv_heads.clone()
    }
    /// Columns of the attention output rank `r` produces (its query heads × head_dim).
    fn att_cols(&self, r: usize) -> Range<usize> {
        let (q, hd) = (&self.plan.ranks[r].q_heads, self.plan.head_dim);
        q.start * hd..q.end * hd
    }
    fn dim_rows(&self, r: usize) -> Range<usize> {
        self.plan.ranks[r].dim.clone()
    }
    fn ffn_rows(&self, r: usize) -> Range<usize> {
        self.plan.ranks[r].ffn.clone()
    }
}

struct RankLayer {
    attn_norm: CudaSlice<f32>,
    ffn_norm: CudaSlice<f32>,
    wq: CudaSlice<f32>,
    wk: CudaSlice<f32>,
    wv: CudaSlice<f32>,
    wo: CudaSlice<f32>,
    wg: CudaSlice<f32>,
    wu: CudaSlice<f32>,
    wd: CudaSlice<f32>,
}

/// One rank: its device, its shard of the weights, its copy of the pool.
pub struct LlamaRank {
    pub(super) gpu: Gpu,
    cfg: LlamaConfig,
    spec: RankSpec,
    layout: Arc<KvLayout>,
    layers: Vec<RankLayer>,
    embed: CudaSlice<f32>,
    out_norm: CudaSlice<f32>,
    /// The output matrix on rank 0 (`None` when tied to the embeddings).
    output: Option<CudaSlice<f32>>,
    pool: CudaSlice<u8>,
    comm: Option<Comm>,
    /// The host arena pinned (rank 0 pins it; portable, so every rank's copies are DMA).
    pinned: PinnedHost,
}

fn dense(
    g: &GgufFile,
    name: &str,
    shape: (usize, usize),
    rows: Range<usize>,
) -> Result<Vec<f32>, CudaError> {
    let (all_rows, cols) = shape;
    let t = g
        .tensor(name)
        .map_err(|e| CudaError::unsupported(e.to_string()))?;
    if t.row_len() != cols || t.rows() != all_rows {
        return Err(CudaError::unsupported(format!(
            "tensor {name} is {:?}, expected {cols}x{all_rows}",
            t.dims
        )));
    }
    let range = g
        .tensor_range(name)
        .map_err(|e| CudaError::unsupported(e.to_string()))?;
    let m = QMatrix::new(t.ty, &g.bytes()[range], all_rows, cols);
    let mut out = vec![0f32; rows.len() * cols];
    for (i, r) in rows.enumerate() {
        m.dequantize_row(r, &mut out[i * cols..(i + 1) * cols]);
    }
    Ok(out)
}

impl LlamaRank {
    /// Open the device, upload this rank's weights and allocate its pool copy. With
    /// `world > 1`, joins the NCCL communicator `nccl` (blocks until every rank has).
    pub fn load(
        spec: RankSpec,
        gguf: &GgufFile,
        cfg: &LlamaConfig,
        layout: Arc<KvLayout>,
        pages: usize,
        nccl: Option<Id>,
    ) -> Result<Self, CudaError> {
        // The kernels read and write f16 K and V rows of `kv_heads × head_dim` values:
        // only the llama layout of this model places them where the kernels look.
        let want = KvLayout::llama(
            cfg.layers,
            cfg.kv_heads,
            cfg.head_dim,
            DType::F16,
            layout.page_size(),
        );
        if want.fingerprint() != layout.fingerprint() {
            return Err(CudaError::unsupported(format!(
                "the KV layout {layout} is not this model's, {want}"
            )));
        }
        let gpu = Gpu::open(spec.ordinal, &spec.build)?;
        let s = gpu.compute.clone();
        let up = |v: Vec<f32>| s.clone_htod(&v).map_err(cuda_err);
        let c = cfg;
        let (d, hd) = (c.dim, c.head_dim);
        let rep = c.heads / c.kv_heads;
        let kv = spec.mine().kv_heads.clone();
        let (dr, fr) = (spec.mine().dim.clone(), spec.mine().ffn.clone());
        let kvd = c.kv_heads * hd;
        let mut layers = Vec::with_capacity(c.layers);
        for l in 0..c.layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            let q_rows = kv.start * rep * hd..kv.end * rep * hd;
            let kv_rows = kv.start * hd..kv.end * hd;
            layers.push(RankLayer {
                attn_norm: up(tensor_f32(gguf, &n("attn_norm"))?)?,
                ffn_norm: up(tensor_f32(gguf, &n("ffn_norm"))?)?,
                wq: up(dense(gguf, &n("attn_q"), (d, d), q_rows)?)?,
                wk: up(dense(gguf, &n("attn_k"), (kvd, d), kv_rows.clone())?)?,
                wv: up(dense(gguf, &n("attn_v"), (kvd, d), kv_rows)?)?,
                wo: up(dense(gguf, &n("attn_output"), (d, d), dr.clone())?)?,
                wg: up(dense(gguf, &n("ffn_gate"), (c.ffn, d), fr.clone())?)?,
                wu: up(dense(gguf, &n("ffn_up"), (c.ffn, d), fr.clone())?)?,
                wd: up(dense(gguf, &n("ffn_down"), (d, c.ffn), dr.clone())?)?,
            });
        }
        let embed = up(dense(gguf, "token_embd.weight", (c.vocab, d), 0..c.vocab)?)?;
        let output = if spec.rank == 0 && gguf.tensors.contains_key("output.weight") {
            Some(up(dense(gguf, "output.weight", (c.vocab, d), 0..c.vocab)?)?)
        } else {
            None
        };
        let out_norm = up(tensor_f32(gguf, "output_norm.weight")?)?;
        let pool = s
            .alloc_zeros::<u8>(layout.bytes_per_pool(pages))
            .map_err(cuda_err)?;
        let comm = match nccl {
            Some(id) if spec.world() > 1 => Some(
                super::device::catch_library("NCCL (libnccl.so)", || {
                    Comm::from_rank(s.clone(), spec.rank, spec.world(), id)
                })?
                .map_err(|e| CudaError::setup(format!("NCCL init, rank {}: {e:?}", spec.rank)))?,
            ),
            _ => None,
        };
        s.synchronize().map_err(cuda_err)?;
        let pinned = PinnedHost::new(gpu.ctx.clone());
        Ok(Self {
            gpu,
            cfg: cfg.clone(),
            spec,
            layout,
            layers,
            embed,
            out_norm,
            output,
            pool,
            comm,
            pinned,
        })
    }

    /// Run one forward for this rank. See the module docs.
    pub fn forward(&mut self, job: &Job) -> Result<RankOut, CudaError> {
        if self.spec.rank == 0 {
            self.pinned.register(job.host);
        }
        let events = upload_layers(&self.gpu.load, &mut self.pool, &self.layout, job)?;
        let gpu = &self.gpu;
        let s = gpu.compute.clone();
        let c = self.cfg.clone();
        let spec = self.spec.clone();
        let t = job.tokens.len();
        let (d, hd) = (c.dim, c.head_dim);
        let rep = c.heads / c.kv_heads;
        let kv = spec.kv(spec.rank);
        let (qh, kvh) = (kv.len() * rep, kv.len());
        let (dr, fr) = (spec.dim_rows(spec.rank), spec.ffn_rows(spec.rank));
        let h2d_i32 = |v: &[i32]| s.clone_htod(v).map_err(cuda_err);
        let tokens = s.clone_htod(&job.tokens).map_err(cuda_err)?;
        let pos = h2d_i32(&job.pos)?;
        let seq = h2d_i32(&job.seq)?;
        let pt = h2d_i32(&job.page_table)?;
        let pts = h2d_i32(&job.page_table_start)?;
        let tok_off = s.clone_htod(&job.tok_off).map_err(cuda_err)?;
        let z = |n: usize| s.alloc_zeros::<f32>(n.max(1)).map_err(cuda_err);
        let (mut x, mut h) = (z(t * d)?, z(t * d)?);
        let (mut q, mut k, mut v) = (z(t * qh * hd)?, z(t * kvh * hd)?, z(t * kvh * hd)?);
        let (mut att_l, mut att) = (z(t * qh * hd)?, z(t * d)?);
        let (mut o_l, mut o) = (z(t * dr.len())?, z(t * d)?);
        let (mut g, mut u, mut gf) = (z(t * fr.len())?, z(t * fr.len())?, z(t * c.ffn)?);
        let mut scratch = z(t * qh * job.max_len)?;
        embed_gather(gpu, &s, &self.embed, &tokens, &mut x, (t, d))?;
        let kvd = c.kv_heads * hd;
        let bpp = self.layout.bytes_per_page() as i64;
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(gpu, &s, &x, &layer.attn_norm, &mut h, t, d, c.rms_eps)?;
            let mm = |w: &CudaSlice<f32>,
                      rows,
                      cols,
                      x: &CudaSlice<f32>,
                      out: &mut CudaSlice<f32>,
                      stride,
                      col0| {
                matmul(
                    gpu,
                    &s,
                    MatmulKernel::of(spec.invariant),
                    w,
                    rows,
                    cols,
                    x,
                    t,
                    out,
                    stride,
                    col0,
                )
            };
            mm(&layer.wq, qh * hd, d, &h, &mut q, qh * hd, 0)?;
            mm(&layer.wk, kvh * hd, d, &h, &mut k, kvh * hd, 0)?;
            mm(&layer.wv, kvh * hd, d, &h, &mut v, kvh * hd, 0)?;
            rope(gpu, &s, &mut q, &pos, t, qh, hd, c.rope_base)?;
            rope(gpu, &s, &mut k, &pos, t, kvh, hd, c.rope_base)?;
            if let Some(ev) = events.get(li) {
                s.wait(ev).map_err(cuda_err)?;
            }
            for (comp, src) in [(0usize, &k), (1, &v)] {
                let comp_off = self.layout.value_offset(li, comp, 0) as i64;
                let (stride, col0, cols, n) = (
                    (kvh * hd) as i32,
                    (kv.start * hd) as i32,
                    (kvh * hd) as i32,
                    t as i32,
                );
                let mut b = s.launch_builder(gpu.kernel("kv_write_f16"));
                b.arg(src)
                    .arg(&stride)
                    .arg(&mut self.pool)
                    .arg(&tok_off)
                    .arg(&comp_off)
                    .arg(&col0)
                    .arg(&cols)
                    .arg(&n);
                // SAFETY: matches kv_write_f16's signature; offsets lie inside the pool.
                unsafe { b.launch(grid((t as u32, 1, 1), 128)) }.map_err(cuda_err)?;
            }
            {
                let (qs, os, ss) = ((qh * hd) as i32, (qh * hd) as i32, job.max_len as i32);
                let (k_off, v_off) = (
                    self.layout.value_offset(li, 0, 0) as i64,
                    self.layout.value_offset(li, 1, 0) as i64,
                );
                let (kre, hdi, repi, kv0, psz) = (
                    kvd as i32,
                    hd as i32,
                    rep as i32,
                    kv.start as i32,
                    self.layout.page_size() as i32,
                );
                let scale = 1.0f32 / (hd as f32).sqrt();
                let mut b = s.launch_builder(gpu.kernel("paged_attention_f16"));
                b.arg(&q)
                    .arg(&qs)
                    .arg(&mut att_l)
                    .arg(&os)
                    .arg(&mut scratch)
                    .arg(&ss)
                    .arg(&self.pool)
                    .arg(&seq)
                    .arg(&pos)
                    .arg(&pt)
                    .arg(&pts)
                    .arg(&bpp)
                    .arg(&k_off)
                    .arg(&v_off)
                    .arg(&kre)
                    .arg(&hdi)
                    .arg(&repi)
                    .arg(&kv0)
                    .arg(&psz)
                    .arg(&scale);
                // SAFETY: matches paged_attention_f16's signature; scratch holds
                // t·qh·max_len floats.
                unsafe { b.launch(grid((t as u32, qh as u32, 1), 128)) }.map_err(cuda_err)?;
            }
            self.gather(&s, &att_l, &mut att, t, |r| spec.att_cols(r))?;
            mm(&layer.wo, dr.len(), d, &att, &mut o_l, dr.len(), 0)?;
            self.gather(&s, &o_l, &mut o, t, |r| spec.dim_rows(r))?;
            add_in_place(gpu, &s, &mut x, &o, t * d)?;
            rms_norm(gpu, &s, &x, &layer.ffn_norm, &mut h, t, d, c.rms_eps)?;
            mm(&layer.wg, fr.len(), d, &h, &mut g, fr.len(), 0)?;
            mm(&layer.wu, fr.len(), d, &h, &mut u, fr.len(), 0)?;
            swiglu(gpu, &s, &mut g, &u, t * fr.len())?;
            self.gather(&s, &g, &mut gf, t, |r| spec.ffn_rows(r))?;
            mm(&layer.wd, dr.len(), c.ffn, &gf, &mut o_l, dr.len(), 0)?;
            self.gather(&s, &o_l, &mut o, t, |r| spec.dim_rows(r))?;
            add_in_place(gpu, &s, &mut x, &o, t * d)?;
        }
        let logits = if spec.rank == 0 && !job.want.is_empty() {
            self.logits(&s, &x, &job.want)?
        } else {
            Vec::new()
        };
        let (spans, kv) = self.kv_rows(&s, job, &tok_off, kv.clone())?;
        Ok(RankOut { logits, kv, spans })
    }

    /// All-gather `local` (`t × cols_r` for this rank) into `full` (`t × Σ cols`, each
    /// rank's columns at their offset). One rank: a plain copy.
    fn gather(
        &self,
        s: &Arc<CudaStream>,
        local: &CudaSlice<f32>,
        full: &mut CudaSlice<f32>,
        t: usize,
        cols: impl Fn(usize) -> Range<usize>,
    ) -> Result<(), CudaError> {
        let world = self.spec.world();
        let total = cols(world - 1).end;
        let Some(comm) = &self.comm else {
            s.memcpy_dtod(&local.slice(..t * total), &mut full.slice_mut(..t * total))
                .map_err(cuda_err)?;
            return Ok(());
        };
        let width = (0..world).map(|r| cols(r).len()).max().unwrap_or(0);
        // NCCL gathers equal counts: each rank sends a padded block of t × width.
        let mut send = s.alloc_zeros::<f32>(t * width).map_err(cuda_err)?;
        let mine = cols(self.spec.rank).len();
        s.memcpy_dtod(&local.slice(..t * mine), &mut send.slice_mut(..t * mine))
            .map_err(cuda_err)?;
        let mut recv = s.alloc_zeros::<f32>(world * t * width).map_err(cuda_err)?;
        comm.all_gather(&send, &mut recv)
            .map_err(|e| CudaError::device(format!("NCCL all-gather: {e:?}")))?;
        let (src, _a) = recv.device_ptr(s);
        let (dst, _b) = full.device_ptr_mut(s);
        for r in 0..world {
            let cr = cols(r);
            // Rank r's block is t rows of cr.len() values (packed), at r·t·width.
            let copy = sys::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                srcHost: std::ptr::null(),
                srcDevice: src + (r * t * width * 4) as u64,
                srcArray: std::ptr::null_mut(),
                srcPitch: cr.len() * 4,
                dstXInBytes: cr.start * 4,
                dstY: 0,
                dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                dstHost: std::ptr::null_mut(),
                dstDevice: dst,
                dstArray: std::ptr::null_mut(),
                dstPitch: total * 4,
                WidthInBytes: cr.len() * 4,
                Height: t,
            };
            if cr.is_empty() || t == 0 {
                continue;
            }
            // SAFETY: both regions lie inside their allocations (t rows of the stated
            // pitches), on this stream.
            unsafe { sys::cuMemcpy2DAsync_v2(&copy, s.cu_stream()) }
                .result()
                .map_err(cuda_err)?;
        }
        Ok(())
    }

    /// Rank 0: the final norm and output matrix for the wanted tokens, to the host.
    fn logits(
        &self,
        s: &Arc<CudaStream>,
        x: &CudaSlice<f32>,
        want: &[u32],
    ) -> Result<Vec<f32>, CudaError> {
        let c = &self.cfg;
        let w = self.output.as_ref().unwrap_or(&self.embed);
        output_logits(
            (&self.gpu, s, MatmulKernel::of(self.spec.invariant)),
            (x, c.dim, want),
            (&self.out_norm, c.rms_eps),
            (w, c.vocab, c.dim),
        )
    }

    /// The KV rows this forward wrote (this rank's heads), gathered and copied down.
    fn kv_rows(
        &self,
        s: &Arc<CudaStream>,
        job: &Job,
        tok_off: &CudaSlice<i64>,
        kv: Range<usize>,
    ) -> Result<(Vec<KvSpan>, Vec<u8>), CudaError> {
        let _ = tok_off;
        let hd = self.cfg.head_dim;
        // This rank's heads' columns of a K and of a V row, in bytes (the same for both).
        let cols = self.layout.value_bytes(0, kv.start * hd..kv.end * hd);
        debug_assert_eq!(cols, self.layout.value_bytes(1, kv.start * hd..kv.end * hd));
        let row_bytes = cols.len();
        let layers = self.layout.layers();
        let mut offs = Vec::with_capacity(job.tok_off.len() * layers * 2);
        for &to in &job.tok_off {
            for l in 0..layers {
                for comp in 0..2 {
                    offs.push(to + (self.layout.value_offset(l, comp, 0) + cols.start) as i64);
                }
            }
        }
        let spans = offs
            .iter()
            .map(|&at| KvSpan {
                at: at as usize,
                len: row_bytes,
            })
            .collect();
        if offs.is_empty() {
            return Ok((spans, Vec::new()));
        }
        let n = offs.len();
        let offs = s.clone_htod(&offs).map_err(cuda_err)?;
        let mut staging = s.alloc_zeros::<u8>(n * row_bytes).map_err(cuda_err)?;
        let (rb, ni) = (row_bytes as i32, n as i32);
        let mut b = s.launch_builder(self.gpu.kernel("gather_rows"));
        b.arg(&self.pool)
            .arg(&offs)
            .arg(&mut staging)
            .arg(&rb)
            .arg(&ni);
        // SAFETY: matches gather_rows; every offset is a slot row inside the pool.
        unsafe { b.launch(grid((n as u32, 1, 1), 256)) }.map_err(cuda_err)?;
        let rows = s.clone_dtoh(&staging).map_err(cuda_err)?;
        Ok((spans, rows))
    }
}

/// Rows `rows` (each `d` values) of `x`, gathered into a new `rows.len() × d` buffer.
pub(crate) fn gather_f32_rows(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    x: &CudaSlice<f32>,
    d: usize,
    rows: &[usize],
) -> Result<CudaSlice<f32>, CudaError> {
    let n = rows.len();
    let mut out = s.alloc_zeros::<f32>((n * d).max(1)).map_err(cuda_err)?;
    if n == 0 {
        return Ok(out);
    }
    let offs: Vec<i64> = rows.iter().map(|&i| (i * d * 4) as i64).collect();
    let offs = s.clone_htod(&offs).map_err(cuda_err)?;
    {
        let (rb, ni) = ((d * 4) as i32, n as i32);
        // SAFETY: f32 buffers viewed as bytes for a row copy.
        let mut out_b = unsafe { out.transmute_mut::<u8>(n * d * 4) }.expect("size");
        // SAFETY: as above, the input's f32s viewed as bytes.
        let x_b = unsafe { x.transmute::<u8>(x.len() * 4) }.expect("size");
        let mut b = s.launch_builder(gpu.kernel("gather_rows"));
        b.arg(&x_b).arg(&offs).arg(&mut out_b).arg(&rb).arg(&ni);
        // SAFETY: matches gather_rows; every offset is a row of x.
        unsafe { b.launch(grid((n as u32, 1, 1), 256)) }.map_err(cuda_err)?;
    }
    Ok(out)
}

/// Row `tokens[i]` of the embedding table `embed` (each `d` wide) into row `i` of `x`,
/// for the `t` tokens.
pub(crate) fn embed_gather(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    embed: &CudaSlice<f32>,
    tokens: &CudaSlice<u32>,
    x: &mut CudaSlice<f32>,
    (t, d): (usize, usize),
) -> Result<(), CudaError> {
    let (di, ti) = (d as i32, t as i32);
    let mut b = s.launch_builder(gpu.kernel("embed_gather"));
    b.arg(embed).arg(tokens).arg(x).arg(&di).arg(&ti);
    // SAFETY: matches embed_gather; x holds t × d, and every token is a row of embed.
    unsafe { b.launch(grid((t as u32, 1, 1), 256)) }.map_err(cuda_err)?;
    Ok(())
}

/// The final norm (`norm`, `eps`) and output matrix (`w`, `rows × cols`) of rows `want`
/// of the residual stream `x` (each `d` wide): their logits, copied to the host.
pub(crate) fn output_logits(
    (gpu, s, kernel): (&Gpu, &Arc<CudaStream>, MatmulKernel),
    (x, d, want): (&CudaSlice<f32>, usize, &[u32]),
    (norm, eps): (&CudaSlice<f32>, f32),
    (w, rows, cols): (&CudaSlice<f32>, usize, usize),
) -> Result<Vec<f32>, CudaError> {
    let n = want.len();
    let wanted: Vec<usize> = want.iter().map(|&i| i as usize).collect();
    let xs = gather_f32_rows(gpu, s, x, d, &wanted)?;
    let mut hs = s.alloc_zeros::<f32>(n * d).map_err(cuda_err)?;
    rms_norm(gpu, s, &xs, norm, &mut hs, n, d, eps)?;
    let mut logits = s.alloc_zeros::<f32>(n * rows).map_err(cuda_err)?;
    matmul(gpu, s, kernel, w, rows, cols, &hs, n, &mut logits, rows, 0)?;
    s.clone_dtoh(&logits).map_err(cuda_err)
}

fn tensor_f32(g: &GgufFile, name: &str) -> Result<Vec<f32>, CudaError> {
    g.tensor_f32(name)
        .map_err(|e| CudaError::unsupported(e.to_string()))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    rows: usize,
    dim: usize,
    eps: f32,
) -> Result<(), CudaError> {
    if rows == 0 {
        return Ok(());
    }
    let di = dim as i32;
    let mut b = s.launch_builder(gpu.kernel("rms_norm"));
    b.arg(x).arg(w).arg(out).arg(&di).arg(&eps);
    // SAFETY: matches rms_norm's signature; x and out hold rows × dim.
    unsafe { b.launch(grid((rows as u32, 1, 1), 256)) }.map_err(cuda_err)?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn rope(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    x: &mut CudaSlice<f32>,
    pos: &CudaSlice<i32>,
    t: usize,
    heads: usize,
    hd: usize,
    base: f32,
) -> Result<(), CudaError> {
    if t == 0 || heads == 0 {
        return Ok(());
    }
    let (hi, hdi, stride) = (heads as i32, hd as i32, (heads * hd) as i32);
    // The CPU's powf, as rope_table computes it: the kernel takes the scale.
    let theta_scale = base.powf(-2.0 / hd as f32);
    let mut b = s.launch_builder(gpu.kernel("rope_pairs"));
    b.arg(x)
        .arg(pos)
        .arg(&hi)
        .arg(&hdi)
        .arg(&stride)
        .arg(&theta_scale);
    // SAFETY: matches rope_pairs; x holds t × heads × hd.
    unsafe { b.launch(grid((t as u32, heads as u32, 1), 32)) }.map_err(cuda_err)?;
    Ok(())
}

pub(crate) fn add_in_place(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    x: &mut CudaSlice<f32>,
    y: &CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    let ni = n as i32;
    let mut b = s.launch_builder(gpu.kernel("add_in_place"));
    b.arg(x).arg(y).arg(&ni);
    // SAFETY: matches add_in_place; both hold n values.
    unsafe { b.launch(grid((n.div_ceil(256) as u32, 1, 1), 256)) }.map_err(cuda_err)?;
    Ok(())
}

pub(crate) fn swiglu(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    g: &mut CudaSlice<f32>,
    u: &CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    let ni = n as i32;
    let mut b = s.launch_builder(gpu.kernel("swiglu"));
    b.arg(g).arg(u).arg(&ni);
    // SAFETY: matches swiglu; both hold n values.
    unsafe { b.launch(grid((n.div_ceil(256) as u32, 1, 1), 256)) }.map_err(cuda_err)?;
    Ok(())
}

/// From this many tokens the invariant product runs as `matmul_tiles`, which loads each
/// weight once per 8 tokens; below it, `matmul_rows`, which spreads a few tokens over more
/// warps. Both give the same bits, so the choice cannot change a token's result; the
/// point where one gets faster than the other is to be measured on each GPU
/// (`bench_backend --matmul`).
const TILES_FROM: usize = 16;

/// How a matrix product is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum MatmulKernel {
    /// Batch-invariant: `Rows` below [`TILES_FROM`] tokens, `Tiles` from there (the same
    /// bits either way).
    Invariant,
    /// `matmul_rows`: one warp per output.
    Rows,
    /// `matmul_tiles`: `matmul_rows`'s bits, 8 tokens × 8 rows per warp.
    Tiles,
    /// cuBLAS SGEMM, TF32 off (not batch-invariant).
    Cublas,
}

impl MatmulKernel {
    /// The engine's choice: invariant, or cuBLAS (`--gpu-fast`).
    pub fn of(invariant: bool) -> Self {
        if invariant {
            Self::Invariant
        } else {
            Self::Cublas
        }
    }
}

/// `out[t·stride + col0 + r] = w[r] · x[t]` for `rows` rows of `cols` and `t` tokens,
/// on stream `s` (cuBLAS runs on the GPU's compute stream).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    kernel: MatmulKernel,
    w: &CudaSlice<f32>,
    rows: usize,
    cols: usize,
    x: &CudaSlice<f32>,
    t: usize,
    out: &mut CudaSlice<f32>,
    out_stride: usize,
    out_col0: usize,
) -> Result<(), CudaError> {
    if t == 0 || rows == 0 {
        return Ok(());
    }
    // The kernels take int sizes and offsets: a product past them is refused, not wrapped.
    let int = |v: usize, what: &str| {
        i32::try_from(v).map_err(|_| {
            CudaError::unsupported(format!(
                "matrix product: {what} {v} is past the kernels' int"
            ))
        })
    };
    let (ri, ci) = (int(rows, "rows")?, int(cols, "cols")?);
    let (si, c0) = (int(out_stride, "out_stride")?, int(out_col0, "out_col0")?);
    let kernel = match kernel {
        MatmulKernel::Invariant if t < TILES_FROM => MatmulKernel::Rows,
        MatmulKernel::Invariant => MatmulKernel::Tiles,
        k => k,
    };
    let ti = int(t, "tokens")?;
    let (name, blocks) = match kernel {
        MatmulKernel::Rows if t > 65_535 => {
            return Err(CudaError::unsupported(format!(
                "matmul_rows: {t} tokens is past the grid's 65535"
            )));
        }
        MatmulKernel::Rows => ("matmul_rows", (rows.div_ceil(8) as u32, t as u32, 1)),
        MatmulKernel::Tiles => (
            "matmul_tiles",
            (rows.div_ceil(32) as u32, t.div_ceil(16) as u32, 1),
        ),
        _ => {
            // Column-major: out (rows × t, ld out_stride) = wᵀ (rows × cols) · x (cols × t).
            let cfg = GemmConfig {
                transa: cublasOperation_t::CUBLAS_OP_T,
                transb: cublasOperation_t::CUBLAS_OP_N,
                m: ri,
                n: ti,
                k: ci,
                alpha: 1.0f32,
                lda: ci,
                ldb: ci,
                beta: 0.0f32,
                ldc: si,
            };
            let mut c = out.slice_mut(out_col0..);
            // SAFETY: the shapes above fit the buffers (w rows × cols, x t × cols, out t
            // rows of out_stride from out_col0).
            return unsafe { gpu.blas.gemm(cfg, w, x, &mut c) }.map_err(CudaError::from);
        }
    };
    let mut b = s.launch_builder(gpu.kernel(name));
    b.arg(w).arg(x).arg(out).arg(&ri).arg(&ci);
    if kernel == MatmulKernel::Tiles {
        b.arg(&ti);
    }
    b.arg(&si).arg(&c0);
    // SAFETY: matches matmul_rows (w, x, out, rows, cols, out_stride, out_col0) and
    // matmul_tiles (the same with tokens after cols); w is rows × cols, x is t × cols, out
    // has t rows of out_stride from out_col0.
    unsafe { b.launch(grid(blocks, 256)) }
        .map(|_| ())
        .map_err(cuda_err)
}

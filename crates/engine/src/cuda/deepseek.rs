//! The DeepSeek V3.2 forward pass on one GPU (world 1), mirroring
//! `crate::deepseek::DeepSeekModel::forward`: the same weights (the CPU model's f32
//! tensors, uploaded at load), the same cache bytes (latent bf16 or fp8 + bf16 rope,
//! index-K fp8 with page-tail scales or bf16, written by `ds_write_entry` in exactly
//! `write_entry`'s format), the same per-token order of operations.
//!
//! What runs where:
//! - on the host: the rope cos/sin tables (`rope_at`, so they are the CPU's bits), the
//!   per-token page and slot of the cache, the MoE routing (`route` on the router logits
//!   copied down: bit-exact expert choice and weights);
//! - on the GPU: every matrix product (`matmul_rows`, or cuBLAS in the fast mode), the
//!   norms, both rope forms, the Hadamard rotation and the index query's rounding
//!   (`ds_index_prep`), the cache writes, the indexer's scores over the paged index-K
//!   cache and the top-k (`topk_indices`, the CPU's selection), MLA's absorbed attention
//!   over the chosen latents, the experts and their weighted sum in routing order.
//!
//! Pages are uploaded layer by layer as in `llama.rs`; after the forward every byte it
//! wrote into the device pool (each token's values and scales, per layer and component)
//! is gathered and handed back as [`KvSpan`]s, so the host pool stays authoritative.

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, PushKernelArg};
use pdmesh_kv::{IndexKDtype, KvLayout, MlaCacheDtype};

use super::device::{Gpu, KernelBuild, grid};
use super::host::{PinnedHost, upload_layers};
use super::job::{Job, KvSpan, RankOut};
use super::llama::{
    MatmulKernel, add_in_place, embed_gather, gather_f32_rows, matmul, output_logits, rms_norm,
    swiglu,
};
use super::{CudaError, cuda_err};
use crate::deepseek::{DeepSeekModel, DsConfig, Ffn, Lin, Mlp};

/// A matrix on the device.
struct DLin {
    w: CudaSlice<f32>,
    rows: usize,
    cols: usize,
}

struct DMlp {
    gate: DLin,
    up: DLin,
    down: DLin,
}

enum DFfn {
    Dense(DMlp),
    Moe {
        gate: DLin,
        /// The routing correction bias, on the host (routing runs there).
        bias: Vec<f32>,
        experts: Vec<DMlp>,
        shared: Option<DMlp>,
    },
}

struct DLayer {
    in_norm: CudaSlice<f32>,
    post_norm: CudaSlice<f32>,
    q_a: DLin,
    q_a_norm: CudaSlice<f32>,
    q_b: DLin,
    kv_a: DLin,
    kv_a_norm: CudaSlice<f32>,
    kv_b: DLin,
    o: DLin,
    wq_b: DLin,
    wk: DLin,
    k_norm_w: CudaSlice<f32>,
    k_norm_b: CudaSlice<f32>,
    weights_proj: DLin,
    ffn: DFfn,
}

/// Where one cache component of one layer sits in a page: values of slot `s` at
/// `off + s·stride`, scales (fp8) at `sc_off + s·sc_stride`. From `KvLayout`'s offsets
/// and strides.
#[derive(Clone, Copy, Debug, Default)]
struct CompAt {
    off: i64,
    stride: i64,
    sc_off: i64,
    sc_stride: i64,
}

impl CompAt {
    fn of(l: &KvLayout, layer: usize, comp: usize) -> Self {
        let (sc_off, sc_stride) = l
            .scale_offset(layer, comp, 0)
            .zip(l.scale_stride(comp))
            .map_or((0, 0), |(at, stride)| (at as i64, stride as i64));
        Self {
            off: l.value_offset(layer, comp, 0) as i64,
            stride: l.token_stride(comp) as i64,
            sc_off,
            sc_stride,
        }
    }
}

/// The cache's components by role.
#[derive(Clone, Copy, Debug)]
struct Comps {
    mla: MlaCacheDtype,
    latent: usize,
    rope: Option<usize>,
    index_k: usize,
    index_dtype: IndexKDtype,
}

impl Comps {
    fn of(layout: &KvLayout) -> Result<Self, CudaError> {
        let c = |n: &str| layout.component_index(n);
        let missing =
            || CudaError::unsupported(format!("{} is not a DeepSeek V3.2 layout", layout.name()));
        let (mla, latent, rope) = match c("mla_latent") {
            Some(i) => (MlaCacheDtype::Bf16, i, None),
            None => (
                MlaCacheDtype::Fp8,
                c("mla_nope").ok_or_else(missing)?,
                Some(c("mla_rope").ok_or_else(missing)?),
            ),
        };
        let index_k = c("index_k").ok_or_else(missing)?;
        let index_dtype = match layout.components()[index_k].dtype {
            pdmesh_kv::DType::Bf16 => IndexKDtype::Bf16,
            _ => IndexKDtype::Fp8,
        };
        Ok(Self {
            mla,
            latent,
            rope,
            index_k,
            index_dtype,
        })
    }
}

/// DeepSeek V3.2 on one device: its weights and its copy of the pool.
pub struct DsRank {
    pub(super) gpu: Gpu,
    cfg: DsConfig,
    invariant: bool,
    dense: bool,
    scale: f32,
    /// The CPU model's rope frequencies (the tables are computed from them per forward).
    freqs: Vec<f32>,
    layout: Arc<KvLayout>,
    comps: Comps,
    layers: Vec<DLayer>,
    embed: CudaSlice<f32>,
    norm: CudaSlice<f32>,
    lm_head: DLin,
    pool: CudaSlice<u8>,
    pinned: PinnedHost,
}

impl DsRank {
    /// Open device `ordinal`, upload the CPU model's weights, allocate the pool copy.
    pub fn load(
        ordinal: usize,
        build: &KernelBuild,
        invariant: bool,
        model: Arc<DeepSeekModel>,
        layout: Arc<KvLayout>,
        pages: usize,
    ) -> Result<Self, CudaError> {
        let c = &model.cfg;
        if c.index_head_dim > 256 || c.kv_lora_rank > 1024 || c.index_head_dim > 1024 {
            return Err(CudaError::unsupported(format!(
                "the GPU kernels take index_head_dim <= 256 and kv_lora_rank <= 1024 \
                 (this model: {} and {})",
                c.index_head_dim, c.kv_lora_rank
            )));
        }
        let comps = Comps::of(&layout)?;
        let gpu = Gpu::open(ordinal, build)?;
        let s = gpu.compute.clone();
        let up = |v: &[f32]| s.clone_htod(v).map_err(cuda_err);
        let lin = |l: &Lin| -> Result<DLin, CudaError> {
            Ok(DLin {
                w: up(&l.w)?,
                rows: l.rows,
                cols: l.cols,
            })
        };
        let mlp = |m: &Mlp| -> Result<DMlp, CudaError> {
            Ok(DMlp {
                gate: lin(&m.gate)?,
                up: lin(&m.up)?,
                down: lin(&m.down)?,
            })
        };
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            let ffn = match &l.ffn {
                Ffn::Dense(m) => DFfn::Dense(mlp(m)?),
                Ffn::Moe {
                    gate,
                    bias,
                    experts,
                    shared,
                } => DFfn::Moe {
                    gate: lin(gate)?,
                    bias: bias.clone(),
                    experts: experts.iter().map(&mlp).collect::<Result<_, _>>()?,
                    shared: shared.as_ref().map(&mlp).transpose()?,
                },
            };
            layers.push(DLayer {
                in_norm: up(&l.in_norm)?,
                post_norm: up(&l.post_norm)?,
                q_a: lin(&l.q_a)?,
                q_a_norm: up(&l.q_a_norm)?,
                q_b: lin(&l.q_b)?,
                kv_a: lin(&l.kv_a)?,
                kv_a_norm: up(&l.kv_a_norm)?,
                kv_b: lin(&l.kv_b)?,
                o: lin(&l.o)?,
                wq_b: lin(&l.idx.wq_b)?,
                wk: lin(&l.idx.wk)?,
                k_norm_w: up(&l.idx.k_norm_w)?,
                k_norm_b: up(&l.idx.k_norm_b)?,
                weights_proj: lin(&l.idx.weights_proj)?,
                ffn,
            });
        }
        let embed = up(&model.embed)?;
        let norm = up(&model.norm)?;
        let lm_head = lin(&model.lm_head)?;
        let pool = s
            .alloc_zeros::<u8>(layout.bytes_per_pool(pages))
            .map_err(cuda_err)?;
        s.synchronize().map_err(cuda_err)?;
        let pinned = PinnedHost::new(gpu.ctx.clone());
        Ok(Self {
            gpu,
            cfg: model.cfg.clone(),
            invariant,
            dense: model.dense,
            scale: model.scale,
            freqs: model.freqs().to_vec(),
            layout,
            comps,
            layers,
            embed,
            norm,
            lm_head,
            pool,
            pinned,
        })
    }

    /// One forward pass; see the module docs.
    pub fn forward(&mut self, job: &Job) -> Result<RankOut, CudaError> {
        self.pinned.register(job.host);
        let events = upload_layers(&self.gpu.load, &mut self.pool, &self.layout, job)?;
        let c = self.cfg.clone();
        let t = job.tokens.len();
        let layout = self.layout.clone();
        let (ps, bpp) = (layout.page_size(), layout.bytes_per_page());
        let (d, h, dn, dr, dv, r) = (
            c.hidden_size,
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        let (hi, di, ql) = (c.index_n_heads, c.index_head_dim, c.q_lora_rank);
        let pairs = dr / 2;
        // Per token: its page's byte offset, its slot, rope tables, indexer or not.
        let mut tok_base = Vec::with_capacity(t);
        let mut tok_slot = Vec::with_capacity(t);
        let (mut cos, mut sin) = (Vec::with_capacity(t * pairs), Vec::with_capacity(t * pairs));
        for i in 0..t {
            let (sq, pos) = (job.seq[i] as usize, job.pos[i] as usize);
            let page = job.page_table[job.page_table_start[sq] as usize + pos / ps] as usize;
            tok_base.push(layout.page_offset(page) as i64);
            tok_slot.push((pos % ps) as i32);
            let (co, si) = crate::deepseek::rope_at(&self.freqs, pos);
            cos.extend_from_slice(&co);
            sin.extend_from_slice(&si);
        }
        let topk = c.index_topk;
        let sparse: Vec<i32> = job
            .pos
            .iter()
            .map(|&p| i32::from(!self.dense && p as usize + 1 > topk))
            .collect();
        let any_sparse = sparse.iter().any(|&x| x != 0);
        let max_len = job.max_len.max(1);
        // The chosen positions per token: 0..n for the dense ones (as the CPU), the
        // indexer's top-k (written per layer) for the others.
        let cap = if self.dense {
            max_len
        } else {
            max_len.min(topk)
        };
        let mut sel_h = vec![-1i32; t * cap];
        let mut sel_n = Vec::with_capacity(t);
        for i in 0..t {
            let n = job.pos[i] as usize + 1;
            if sparse[i] != 0 {
                sel_n.push(topk as i32);
            } else {
                for (j, v) in sel_h[i * cap..i * cap + n].iter_mut().enumerate() {
                    *v = j as i32;
                }
                sel_n.push(n as i32);
            }
        }

        let s = self.gpu.compute.clone();
        let gpu = &self.gpu;
        let up_i32 = |v: &[i32]| s.clone_htod(v).map_err(cuda_err);
        let tokens = s.clone_htod(&job.tokens).map_err(cuda_err)?;
        let pos = up_i32(&job.pos)?;
        let seq = up_i32(&job.seq)?;
        let pt = up_i32(&job.page_table)?;
        let pts = up_i32(&job.page_table_start)?;
        let tok_base_d = s.clone_htod(&tok_base).map_err(cuda_err)?;
        let tok_slot_d = up_i32(&tok_slot)?;
        let cos_d = s.clone_htod(&cos).map_err(cuda_err)?;
        let sin_d = s.clone_htod(&sin).map_err(cuda_err)?;
        let has_d = up_i32(&sparse)?;
        // The sparse tokens and their context lengths: each layer's top-k over them is
        // one launch.
        let sparse_rows: Vec<i32> = (0..t as i32).filter(|&i| sparse[i as usize] != 0).collect();
        let sparse_ns: Vec<i32> = sparse_rows
            .iter()
            .map(|&i| job.pos[i as usize] + 1)
            .collect();
        // (A device buffer is never empty: a zero-byte allocation is an error.)
        let sparse_rows_d = up_i32(if any_sparse { &sparse_rows } else { &[0] })?;
        let sparse_ns_d = up_i32(if any_sparse { &sparse_ns } else { &[0] })?;
        let mut sel = up_i32(&sel_h)?;
        let sel_n_d = up_i32(&sel_n)?;
        let z = |n: usize| s.alloc_zeros::<f32>(n.max(1)).map_err(cuda_err);
        let (mut x, mut hb) = (z(t * d)?, z(t * d)?);
        let (mut q_lat, mut q_lat_n) = (z(t * ql)?, z(t * ql)?);
        let (mut kv, mut ki, mut wts) = (z(t * (r + dr))?, z(t * di)?, z(t * hi)?);
        let (mut q, mut qi) = (z(t * h * (dn + dr))?, z(t * hi * di)?);
        let (mut att, mut o) = (z(t * h * dv)?, z(t * d)?);
        let mut iscores = z(if any_sparse { t * max_len } else { 1 })?;
        let mut scratch = z(t * h * cap)?;
        let (ti, eps) = (t as i32, c.rms_norm_eps);
        if t > 0 {
            embed_gather(gpu, &s, &self.embed, &tokens, &mut x, (t, d))?;
        }
        let inv = MatmulKernel::of(self.invariant);
        let mm = |w: &DLin, x: &CudaSlice<f32>, rows_t: usize, out: &mut CudaSlice<f32>| {
            matmul(
                gpu, &s, inv, &w.w, w.rows, w.cols, x, rows_t, out, w.rows, 0,
            )
        };
        let iscale = 1.0 / ((hi as f32).sqrt() * (di as f32).sqrt());
        let comps = self.comps;
        let (mla_fp8, ik_fp8) = (
            i32::from(comps.mla == MlaCacheDtype::Fp8),
            i32::from(comps.index_dtype == IndexKDtype::Fp8),
        );
        let (bpp_i, psz) = (bpp as i64, ps as i32);
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(gpu, &s, &x, &layer.in_norm, &mut hb, t, d, eps)?;
            mm(&layer.q_a, &hb, t, &mut q_lat)?;
            mm(&layer.kv_a, &hb, t, &mut kv)?;
            mm(&layer.wk, &hb, t, &mut ki)?;
            mm(&layer.weights_proj, &hb, t, &mut wts)?;
            rms_norm(gpu, &s, &q_lat, &layer.q_a_norm, &mut q_lat_n, t, ql, eps)?;
            mm(&layer.q_b, &q_lat_n, t, &mut q)?;
            mm(&layer.wq_b, &q_lat_n, t, &mut qi)?;
            if t > 0 {
                // MLA query rope: each head's last dr values.
                rope_interleaved(
                    gpu,
                    &s,
                    &mut q,
                    t,
                    h,
                    h * (dn + dr),
                    dn + dr,
                    dn,
                    &cos_d,
                    &sin_d,
                    pairs,
                )?;
                // The latent: kv_a_layernorm on the first r values, rope on the rest.
                {
                    let (st, ri) = ((r + dr) as i32, r as i32);
                    let mut b = s.launch_builder(gpu.kernel("ds_rms_norm_inplace"));
                    b.arg(&mut kv)
                        .arg(&st)
                        .arg(&layer.kv_a_norm)
                        .arg(&ri)
                        .arg(&eps);
                    // SAFETY: matches ds_rms_norm_inplace; kv holds t rows of r + dr.
                    unsafe { b.launch(grid((t as u32, 1, 1), 256)) }.map_err(cuda_err)?;
                }
                rope_interleaved(gpu, &s, &mut kv, t, 1, r + dr, 0, r, &cos_d, &sin_d, pairs)?;
                // The index key (LayerNorm, rope, Hadamard) and queries (rope, Hadamard,
                // rounded like the stored keys).
                let round = match comps.index_dtype {
                    IndexKDtype::Bf16 => 1,
                    IndexKDtype::Fp8 => 2,
                };
                for (buf, vecs, has_ln, rnd) in
                    [(&mut ki, 1usize, 1i32, 0i32), (&mut qi, hi, 0, round)]
                {
                    let (stride, dim, rope) = ((vecs * di) as i32, di as i32, dr as i32);
                    let mut b = s.launch_builder(gpu.kernel("ds_index_prep"));
                    b.arg(buf)
                        .arg(&stride)
                        .arg(&dim)
                        .arg(&rope)
                        .arg(&cos_d)
                        .arg(&sin_d)
                        .arg(&has_ln)
                        .arg(&layer.k_norm_w)
                        .arg(&layer.k_norm_b)
                        .arg(&eps)
                        .arg(&rnd);
                    // SAFETY: matches ds_index_prep; buf holds t rows of vecs × di, the
                    // tables t × dr/2.
                    unsafe { b.launch(grid((t as u32, vecs as u32, 1), 128)) }.map_err(cuda_err)?;
                }
                {
                    let n = (t * hi) as i32;
                    let mut b = s.launch_builder(gpu.kernel("ds_scale"));
                    b.arg(&mut wts).arg(&n).arg(&iscale);
                    // SAFETY: matches ds_scale; wts holds t × hi.
                    unsafe { b.launch(grid(((t * hi).div_ceil(256) as u32, 1, 1), 256)) }
                        .map_err(cuda_err)?;
                }
            }
            if let Some(ev) = events.get(li) {
                s.wait(ev).map_err(cuda_err)?;
            }
            let lat = CompAt::of(&layout, li, comps.latent);
            let rope = comps
                .rope
                .map(|rc| CompAt::of(&layout, li, rc))
                .unwrap_or_default();
            let ik = CompAt::of(&layout, li, comps.index_k);
            if t > 0 {
                // Every token's entries first: a token attends to itself and to the
                // earlier tokens of the batch through the cache.
                let (ls, iks, ri, dri, dii) =
                    ((r + dr) as i32, di as i32, r as i32, dr as i32, di as i32);
                let mut b = s.launch_builder(gpu.kernel("ds_write_entry"));
                b.arg(&kv)
                    .arg(&ls)
                    .arg(&ki)
                    .arg(&iks)
                    .arg(&mut self.pool)
                    .arg(&tok_base_d)
                    .arg(&tok_slot_d)
                    .arg(&ti)
                    .arg(&ri)
                    .arg(&dri)
                    .arg(&dii)
                    .arg(&mla_fp8)
                    .arg(&lat.off)
                    .arg(&lat.stride)
                    .arg(&lat.sc_off)
                    .arg(&lat.sc_stride)
                    .arg(&rope.off)
                    .arg(&rope.stride)
                    .arg(&ik_fp8)
                    .arg(&ik.off)
                    .arg(&ik.stride)
                    .arg(&ik.sc_off)
                    .arg(&ik.sc_stride);
                // SAFETY: matches ds_write_entry; each token's slot lies in its page.
                unsafe { b.launch(grid((t as u32, 1, 1), 128)) }.map_err(cuda_err)?;
            }
            if any_sparse {
                let (qs, his, dii, ml) = ((hi * di) as i32, hi as i32, di as i32, max_len as i32);
                let mut b = s.launch_builder(gpu.kernel("ds_index_scores_paged"));
                b.arg(&qi)
                    .arg(&qs)
                    .arg(&wts)
                    .arg(&his)
                    .arg(&dii)
                    .arg(&self.pool)
                    .arg(&pt)
                    .arg(&pts)
                    .arg(&seq)
                    .arg(&pos)
                    .arg(&has_d)
                    .arg(&bpp_i)
                    .arg(&psz)
                    .arg(&ik_fp8)
                    .arg(&ik.off)
                    .arg(&ik.stride)
                    .arg(&ik.sc_off)
                    .arg(&ik.sc_stride)
                    .arg(&mut iscores)
                    .arg(&ml);
                // SAFETY: matches ds_index_scores_paged; iscores holds t × max_len and
                // every position read is below its token's pos + 1.
                unsafe { b.launch(grid((t as u32, max_len.div_ceil(128) as u32, 1), 128)) }
                    .map_err(cuda_err)?;
                let (k, cs) = (topk as i32, cap as i32);
                let mut b = s.launch_builder(gpu.kernel("topk_indices_rows"));
                b.arg(&iscores)
                    .arg(&ml)
                    .arg(&sparse_rows_d)
                    .arg(&sparse_ns_d)
                    .arg(&k)
                    .arg(&mut sel)
                    .arg(&cs);
                let blocks = (sparse_rows.len() as u32, 1, 1);
                // SAFETY: matches topk_indices_rows; each sparse token's row of iscores
                // holds its pos + 1 scores (> k), and its row of sel has cap = k slots.
                unsafe { b.launch(grid(blocks, 256)) }.map_err(cuda_err)?;
            }
            if t > 0 {
                let (cs, hs, ri, dri, dni, dvi) = (
                    cap as i32, h as i32, r as i32, dr as i32, dn as i32, dv as i32,
                );
                let mut b = s.launch_builder(gpu.kernel("ds_mla_attention"));
                b.arg(&q)
                    .arg(&layer.kv_b.w)
                    .arg(&mut att)
                    .arg(&mut scratch)
                    .arg(&sel)
                    .arg(&sel_n_d)
                    .arg(&cs)
                    .arg(&self.pool)
                    .arg(&pt)
                    .arg(&pts)
                    .arg(&seq)
                    .arg(&bpp_i)
                    .arg(&psz)
                    .arg(&hs)
                    .arg(&ri)
                    .arg(&dri)
                    .arg(&dni)
                    .arg(&dvi)
                    .arg(&self.scale)
                    .arg(&mla_fp8)
                    .arg(&lat.off)
                    .arg(&lat.stride)
                    .arg(&lat.sc_off)
                    .arg(&lat.sc_stride)
                    .arg(&rope.off)
                    .arg(&rope.stride);
                // SAFETY: matches ds_mla_attention; scratch holds t × h × cap, sel t × cap
                // with sel_n[i] <= cap valid positions of token i's sequence.
                unsafe { b.launch(grid((t as u32, h as u32, 1), 128)) }.map_err(cuda_err)?;
            }
            mm(&layer.o, &att, t, &mut o)?;
            add_in_place(gpu, &s, &mut x, &o, t * d)?;
            rms_norm(gpu, &s, &x, &layer.post_norm, &mut hb, t, d, eps)?;
            let f = ffn(gpu, &s, inv, &c, &layer.ffn, &hb, t)?;
            add_in_place(gpu, &s, &mut x, &f, t * d)?;
        }
        let logits = if job.want.is_empty() {
            Vec::new()
        } else {
            self.logits(&s, &x, &job.want)?
        };
        // Every byte this forward wrote: each token's values and scales, per layer and
        // component.
        let mut spans = Vec::new();
        for i in 0..t {
            let (base, slot) = (tok_base[i] as usize, tok_slot[i] as usize);
            for l in 0..layout.layers() {
                for (ci, comp) in layout.components().iter().enumerate() {
                    spans.push(KvSpan {
                        at: base + layout.value_offset(l, ci, slot),
                        len: comp.value_bytes_per_token(),
                    });
                    if let Some(so) = layout.scale_offset(l, ci, slot) {
                        spans.push(KvSpan {
                            at: base + so,
                            len: comp.scale_bytes_per_token(),
                        });
                    }
                }
            }
        }
        let (spans, kv) = gather_spans(&self.gpu, &s, &self.pool, spans)?;
        Ok(RankOut { logits, kv, spans })
    }

    /// The final norm and lm_head for the wanted tokens, to the host.
    fn logits(
        &self,
        s: &Arc<CudaStream>,
        x: &CudaSlice<f32>,
        want: &[u32],
    ) -> Result<Vec<f32>, CudaError> {
        let (c, w) = (&self.cfg, &self.lm_head);
        output_logits(
            (&self.gpu, s, MatmulKernel::of(self.invariant)),
            (x, c.hidden_size, want),
            (&self.norm, c.rms_norm_eps),
            (&w.w, w.rows, w.cols),
        )
    }
}

/// rope_interleaved on `heads` heads of every token (`ds_rope_interleaved`).
#[allow(clippy::too_many_arguments)]
fn rope_interleaved(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    x: &mut CudaSlice<f32>,
    t: usize,
    heads: usize,
    row_stride: usize,
    head_stride: usize,
    offset: usize,
    cos: &CudaSlice<f32>,
    sin: &CudaSlice<f32>,
    pairs: usize,
) -> Result<(), CudaError> {
    let (rs, hs, off, pi) = (
        row_stride as i32,
        head_stride as i32,
        offset as i32,
        pairs as i32,
    );
    let mut b = s.launch_builder(gpu.kernel("ds_rope_interleaved"));
    b.arg(x)
        .arg(&rs)
        .arg(&hs)
        .arg(&off)
        .arg(cos)
        .arg(sin)
        .arg(&pi);
    // SAFETY: matches ds_rope_interleaved; x holds t rows of row_stride, the tables
    // t × pairs.
    unsafe { b.launch(grid((t as u32, heads as u32, 1), 32)) }.map_err(cuda_err)?;
    Ok(())
}

/// silu(gate·x) ⊙ (up·x), then down: deepseek.rs `swiglu` for `t` tokens, into rows
/// `out_row0..` of `out`.
#[allow(clippy::too_many_arguments)]
fn mlp(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    inv: MatmulKernel,
    m: &DMlp,
    x: &CudaSlice<f32>,
    t: usize,
    out: &mut CudaSlice<f32>,
    out_row0: usize,
) -> Result<(), CudaError> {
    let inter = m.gate.rows;
    let mut g = s.alloc_zeros::<f32>((t * inter).max(1)).map_err(cuda_err)?;
    let mut u = s.alloc_zeros::<f32>((t * inter).max(1)).map_err(cuda_err)?;
    matmul(
        gpu,
        s,
        inv,
        &m.gate.w,
        inter,
        m.gate.cols,
        x,
        t,
        &mut g,
        inter,
        0,
    )?;
    matmul(
        gpu, s, inv, &m.up.w, inter, m.up.cols, x, t, &mut u, inter, 0,
    )?;
    if t * inter > 0 {
        swiglu(gpu, s, &mut g, &u, t * inter)?;
    }
    let d = m.down.rows;
    matmul(
        gpu,
        s,
        inv,
        &m.down.w,
        d,
        inter,
        &g,
        t,
        out,
        d,
        out_row0 * d,
    )
}

/// The feed-forward of one layer for `t` tokens of `x` (deepseek.rs `ffn`): the routing on
/// the host, each expert once over its tokens (batch order), the weighted sum of each
/// token's experts in its routing order added to the shared experts' output.
fn ffn(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    inv: MatmulKernel,
    c: &DsConfig,
    ffn: &DFfn,
    x: &CudaSlice<f32>,
    t: usize,
) -> Result<CudaSlice<f32>, CudaError> {
    let d = c.hidden_size;
    let mut out = s.alloc_zeros::<f32>((t * d).max(1)).map_err(cuda_err)?;
    match ffn {
        DFfn::Dense(m) => mlp(gpu, s, inv, m, x, t, &mut out, 0)?,
        DFfn::Moe {
            gate,
            bias,
            experts,
            shared,
        } => {
            if let Some(m) = shared {
                mlp(gpu, s, inv, m, x, t, &mut out, 0)?;
            }
            if t == 0 {
                return Ok(out);
            }
            let e = gate.rows;
            let mut logits = s.alloc_zeros::<f32>(t * e).map_err(cuda_err)?;
            matmul(gpu, s, inv, &gate.w, e, gate.cols, x, t, &mut logits, e, 0)?;
            let logits = s.clone_dtoh(&logits).map_err(cuda_err)?;
            let routes: Vec<Vec<(usize, f32)>> = logits
                .chunks_exact(e)
                .map(|l| crate::deepseek::route(c, l, bias))
                .collect();
            let k = c.num_experts_per_tok;
            // Tokens per expert in batch order; an expert's outputs are rows
            // first_row[ex].. of y.
            let mut by_expert: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
            for (i, rt) in routes.iter().enumerate() {
                for &(ex, _) in rt {
                    by_expert.entry(ex).or_default().push(i);
                }
            }
            let total: usize = by_expert.values().map(Vec::len).sum();
            let mut y = s.alloc_zeros::<f32>(total * d).map_err(cuda_err)?;
            let mut row_of: BTreeMap<(usize, usize), usize> = BTreeMap::new();
            let mut row0 = 0;
            for (&ex, toks) in &by_expert {
                let xs = gather_f32_rows(gpu, s, x, d, toks)?;
                mlp(gpu, s, inv, &experts[ex], &xs, toks.len(), &mut y, row0)?;
                for (j, &i) in toks.iter().enumerate() {
                    row_of.insert((i, ex), row0 + j);
                }
                row0 += toks.len();
            }
            let mut rows = Vec::with_capacity(t * k);
            let mut wts = Vec::with_capacity(t * k);
            for (i, rt) in routes.iter().enumerate() {
                if rt.len() != k {
                    return Err(CudaError::device(format!(
                        "token {i} was routed to {} experts, expected {k}",
                        rt.len()
                    )));
                }
                for &(ex, w) in rt {
                    rows.push(row_of[&(i, ex)] as i32);
                    wts.push(w);
                }
            }
            let rows = s.clone_htod(&rows).map_err(cuda_err)?;
            let wts = s.clone_htod(&wts).map_err(cuda_err)?;
            let (ki, dd) = (k as i32, d as i32);
            let mut b = s.launch_builder(gpu.kernel("ds_moe_combine"));
            b.arg(&mut out)
                .arg(&y)
                .arg(&rows)
                .arg(&wts)
                .arg(&ki)
                .arg(&dd);
            // SAFETY: matches ds_moe_combine; out is t × d, y total × d, rows/wts t × k
            // with every row below total.
            unsafe { b.launch(grid((t as u32, 1, 1), 256)) }.map_err(cuda_err)?;
        }
    }
    Ok(out)
}

/// Copy the pool bytes of `spans` to the host: one `gather_rows` per distinct length.
/// Returns the spans in the order of the returned bytes.
pub(crate) fn gather_spans(
    gpu: &Gpu,
    s: &Arc<CudaStream>,
    pool: &CudaSlice<u8>,
    spans: Vec<KvSpan>,
) -> Result<(Vec<KvSpan>, Vec<u8>), CudaError> {
    let mut by_len: BTreeMap<usize, Vec<KvSpan>> = BTreeMap::new();
    for sp in spans {
        if sp.len > 0 {
            by_len.entry(sp.len).or_default().push(sp);
        }
    }
    let mut order = Vec::new();
    let mut bytes = Vec::new();
    for (len, group) in by_len {
        let offs: Vec<i64> = group.iter().map(|sp| sp.at as i64).collect();
        let n = offs.len();
        let offs = s.clone_htod(&offs).map_err(cuda_err)?;
        let mut staging = s.alloc_zeros::<u8>(n * len).map_err(cuda_err)?;
        let (rb, ni) = (len as i32, n as i32);
        let mut b = s.launch_builder(gpu.kernel("gather_rows"));
        b.arg(pool).arg(&offs).arg(&mut staging).arg(&rb).arg(&ni);
        // SAFETY: matches gather_rows; every span lies inside the pool.
        unsafe { b.launch(grid((n as u32, 1, 1), 256)) }.map_err(cuda_err)?;
        bytes.extend(s.clone_dtoh(&staging).map_err(cuda_err)?);
        order.extend(group);
    }
    Ok((order, bytes))
}

//! The llama-family forward pass (SmolLM2): RMSNorm, RoPE, grouped-query attention over
//! the paged KV pool, SwiGLU, tied output. It works on a flat batch of tokens from any
//! mix of sequences and positions; every token goes through the same per-token code, so
//! a token's logits do not depend on its batch or on how its prompt was chunked.
//! [`TpLlama`] computes the same forward as tensor-parallel ranks on threads of this
//! process (the plan and the collective are `tp`'s).

use std::ops::Range;
use std::sync::{Arc, Mutex, RwLock};

use half::f16;
use half::slice::HalfFloatSliceExt;
use pdmesh_gguf::GgufFile;
use pdmesh_kernels::{QMatrix, attend_causal, matmul, matmul_many, matmul_swiglu};
use pdmesh_kv::{PageId, PagePool};
use rayon::prelude::*;

use crate::EngineError;
use crate::llama_config::LlamaConfig;
use crate::tp::{
    Comm, HostCollective, KvAccess, RankShard, RankWork, ShardPlan, WorkKind, lock_work,
};

/// Where a weight matrix lives in the GGUF map; resolved to a borrowed [`QMatrix`] per use.
#[derive(Clone, Debug)]
struct WRef {
    ty: pdmesh_gguf::GgmlType,
    range: std::ops::Range<usize>,
    rows: usize,
    cols: usize,
}

struct Layer {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    wq: WRef,
    wk: WRef,
    wv: WRef,
    wo: WRef,
    w_gate: WRef,
    w_up: WRef,
    w_down: WRef,
}

/// One token of a forward batch.
#[derive(Clone, Copy, Debug)]
pub struct BatchToken {
    /// Index into the `seq_pages` slice passed to [`LlamaModel::forward`].
    pub seq: usize,
    pub pos: usize,
    pub token: u32,
    pub want_logits: bool,
}

/// The model: weights borrowed from the GGUF memory map, still quantized.
pub struct LlamaModel {
    pub cfg: LlamaConfig,
    layers: Vec<Layer>,
    embed: WRef,
    output: WRef,
    out_norm: Vec<f32>,
    gguf: Arc<GgufFile>,
    /// What [`Self::forward`] computed so far (one rank owning everything).
    work: Mutex<RankWork>,
}

fn qmatrix(g: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<WRef, EngineError> {
    let t = g.tensor(name)?;
    if t.row_len() != cols || t.rows() != rows {
        return Err(EngineError::Unsupported(format!(
            "tensor {name} is {:?}, expected {cols}x{rows}",
            t.dims
        )));
    }
    Ok(WRef {
        ty: t.ty,
        range: g.tensor_range(name)?,
        rows,
        cols,
    })
}

impl LlamaModel {
    pub fn load(gguf: Arc<GgufFile>) -> Result<Self, EngineError> {
        let cfg = LlamaConfig::from_gguf(&gguf)?;
        let g: &GgufFile = &gguf;
        let (d, kvd) = (cfg.dim, cfg.kv_heads * cfg.head_dim);
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(Layer {
                attn_norm: g.tensor_f32(&n("attn_norm"))?,
                ffn_norm: g.tensor_f32(&n("ffn_norm"))?,
                wq: qmatrix(g, &n("attn_q"), d, d)?,
                wk: qmatrix(g, &n("attn_k"), kvd, d)?,
                wv: qmatrix(g, &n("attn_v"), kvd, d)?,
                wo: qmatrix(g, &n("attn_output"), d, d)?,
                w_gate: qmatrix(g, &n("ffn_gate"), cfg.ffn, d)?,
                w_up: qmatrix(g, &n("ffn_up"), cfg.ffn, d)?,
                w_down: qmatrix(g, &n("ffn_down"), d, cfg.ffn)?,
            });
        }
        let embed = qmatrix(g, "token_embd.weight", cfg.vocab, d)?;
        let output = if g.tensors.contains_key("output.weight") {
            qmatrix(g, "output.weight", cfg.vocab, d)?
        } else {
            embed.clone()
        };
        let out_norm = g.tensor_f32("output_norm.weight")?;
        Ok(Self {
            cfg,
            layers,
            embed,
            output,
            out_norm,
            gguf,
            work: Mutex::default(),
        })
    }

    /// What [`Self::forward`] computed so far, as one rank owning the whole model.
    pub fn work(&self) -> RankWork {
        lock_work(&self.work).clone()
    }

    fn m(&self, w: &WRef) -> QMatrix<'_> {
        QMatrix::new(w.ty, &self.gguf.bytes()[w.range.clone()], w.rows, w.cols)
    }

    /// Rows `rows` of `w`: rows are contiguous in GGUF block formats, so a row range is a
    /// byte sub-range of the tensor.
    fn rows(&self, w: &WRef, rows: Range<usize>) -> QMatrix<'_> {
        let rb = w.ty.row_bytes(w.cols);
        let start = w.range.start + rows.start * rb;
        QMatrix::new(
            w.ty,
            &self.gguf.bytes()[start..start + rows.len() * rb],
            rows.len(),
            w.cols,
        )
    }

    /// Run `tokens` through the model. Writes each token's K and V into `pool` at its
    /// position in its sequence's pages, attends over positions `0..=pos`, and returns the
    /// logits of the tokens with `want_logits`, in batch order.
    pub fn forward(
        &self,
        tp: &rayon::ThreadPool,
        pool: &mut PagePool,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
    ) -> Vec<Vec<f32>> {
        let whole = RankShard::whole(&self.cfg);
        let (logits, work) = self.forward_rank(tp, pool, seq_pages, tokens, &whole, None);
        lock_work(&self.work).merge(work);
        logits
    }

    /// One rank's share of [`Self::forward`] (see `tp.rs`): the q/k/v, K/V cache columns
    /// and attention of its heads, its rows of `wo`, gate/up, `w_down` and the output head,
    /// each followed by an all-gather so every rank holds the whole residual stream.
    /// Without `comm` it is the whole model and nothing is gathered. Returns the logits on
    /// rank 0 (nothing on the others), and on every rank what it computed.
    pub(crate) fn forward_rank<P: KvAccess>(
        &self,
        tp: &rayon::ThreadPool,
        mut pool: P,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
        sh: &RankShard,
        comm: Option<Comm<'_>>,
    ) -> (Vec<Vec<f32>>, RankWork) {
        let c = &self.cfg;
        let t = tokens.len();
        // What this forward hands the kernels, returned beside the logits.
        let mut work = RankWork {
            tokens: t as u64,
            ..RankWork::default()
        };
        let (d, hd, kvd) = (c.dim, c.head_dim, c.kv_heads * c.head_dim);
        let ps = pool.read(|p| p.layout().page_size());
        // This rank's widths: query and KV heads, dim rows, FFN rows.
        let (qd, kd, dr, fr) = (
            sh.q_heads.len() * hd,
            sh.kv_heads.len() * hd,
            sh.dim.len(),
            sh.ffn.len(),
        );
        let kv_cols = sh.kv_heads.start * hd..sh.kv_heads.end * hd;
        let mut x = vec![0f32; t * d];
        for (i, tok) in tokens.iter().enumerate() {
            self.m(&self.embed)
                .dequantize_row(tok.token as usize, &mut x[i * d..(i + 1) * d]);
        }
        let rope: Vec<(Vec<f32>, Vec<f32>)> = tokens
            .iter()
            .map(|tk| rope_table(tk.pos, hd, c.rope_base))
            .collect();
        let (mut h, mut q, mut k, mut v) = (
            vec![0f32; t * d],
            vec![0f32; t * qd],
            vec![0f32; t * kd],
            vec![0f32; t * kd],
        );
        let mut att = vec![0f32; t * qd];
        let mut o = vec![0f32; t * dr];
        let mut g = vec![0f32; t * fr];
        // Sharded: every rank's column counts per gathered quantity, and the gathered
        // buffers (attention output, wo / w_down output, FFN activation).
        let cols =
            |f: fn(&RankShard) -> usize| comm.as_ref().map_or(Vec::new(), |m| m.plan.cols(f));
        let (att_cols, dim_cols, ffn_cols) = (
            cols(|s| s.q_heads.len()),
            cols(|s| s.dim.len()),
            cols(|s| s.ffn.len()),
        );
        let att_cols: Vec<usize> = att_cols.iter().map(|n| n * hd).collect();
        let full = |n: usize| {
            if comm.is_some() {
                vec![0f32; t * n]
            } else {
                Vec::new()
            }
        };
        let (mut att_all, mut o_all, mut g_all) = (full(d), full(d), full(c.ffn));
        let q_rows = sh.q_heads.start * hd..sh.q_heads.end * hd;
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h);
            let (wq, wk, wv) = (
                self.rows(&layer.wq, q_rows.clone()),
                self.rows(&layer.wk, kv_cols.clone()),
                self.rows(&layer.wv, kv_cols.clone()),
            );
            matmul_many(tp, &[&wq, &wk, &wv], &h, t, &mut [&mut q, &mut k, &mut v]);
            work.add(WorkKind::Q, q_rows.clone(), t);
            work.add(WorkKind::K, kv_cols.clone(), t);
            work.add(WorkKind::V, kv_cols.clone(), t);
            for (i, (cos, sin)) in rope.iter().enumerate() {
                for head in q[i * qd..(i + 1) * qd].chunks_exact_mut(hd) {
                    apply_rope(head, cos, sin);
                }
                for head in k[i * kd..(i + 1) * kd].chunks_exact_mut(hd) {
                    apply_rope(head, cos, sin);
                }
            }
            pool.write(|pool| {
                for (i, tk) in tokens.iter().enumerate() {
                    let page = seq_pages[tk.seq][tk.pos / ps];
                    let cols = tk.pos % ps * kvd + kv_cols.start..tk.pos % ps * kvd + kv_cols.end;
                    pool.values_mut::<f16>(page, li, 0)[cols.clone()]
                        .convert_from_f32_slice(&k[i * kd..(i + 1) * kd]);
                    pool.values_mut::<f16>(page, li, 1)[cols]
                        .convert_from_f32_slice(&v[i * kd..(i + 1) * kd]);
                }
            });
            work.add(WorkKind::KvWrite, kv_cols.clone(), t);
            self.attention(tp, &pool, seq_pages, tokens, li, sh, &q, &mut att);
            work.add(WorkKind::Attention, sh.kv_heads.clone(), t);
            let att_in = gathered(&comm, &att, &mut att_all, &att_cols, t);
            matmul(tp, &self.rows(&layer.wo, sh.dim.clone()), att_in, t, &mut o);
            work.add(WorkKind::Wo, sh.dim.clone(), t);
            add_in_place(&mut x, gathered(&comm, &o, &mut o_all, &dim_cols, t));
            rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h);
            let (wg, wu) = (
                self.rows(&layer.w_gate, sh.ffn.clone()),
                self.rows(&layer.w_up, sh.ffn.clone()),
            );
            matmul_swiglu(tp, &wg, &wu, &h, t, &mut g);
            work.add(WorkKind::Gate, sh.ffn.clone(), t);
            work.add(WorkKind::Up, sh.ffn.clone(), t);
            let g_in = gathered(&comm, &g, &mut g_all, &ffn_cols, t);
            matmul(
                tp,
                &self.rows(&layer.w_down, sh.dim.clone()),
                g_in,
                t,
                &mut o,
            );
            work.add(WorkKind::Down, sh.dim.clone(), t);
            add_in_place(&mut x, gathered(&comm, &o, &mut o_all, &dim_cols, t));
        }
        let output = self.rows(&self.output, sh.vocab.clone());
        let (n, local) = head_logits(tp, &x, tokens, (&self.out_norm[..], c.rms_eps, &output));
        work.add(WorkKind::Head, sh.vocab.clone(), n);
        let logits = 'logits: {
            if n == 0 {
                break 'logits Vec::new();
            }
            let Some(m) = &comm else {
                break 'logits local.chunks_exact(c.vocab).map(<[f32]>::to_vec).collect();
            };
            let mut all = vec![0f32; n * c.vocab];
            m.coll
                .all_gather(m.rank, &local, &m.plan.cols(|s| s.vocab.len()), n, &mut all);
            if m.rank != 0 {
                break 'logits Vec::new();
            }
            all.chunks_exact(c.vocab).map(<[f32]>::to_vec).collect()
        };
        (logits, work)
    }

    /// Causal attention for every (token, KV head of `sh`) pair in parallel; `q` and `out`
    /// hold the query heads of `sh`.
    #[allow(clippy::too_many_arguments)]
    fn attention<P: KvAccess>(
        &self,
        tp: &rayon::ThreadPool,
        pool: &P,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
        layer: usize,
        sh: &RankShard,
        q: &[f32],
        out: &mut [f32],
    ) {
        let c = &self.cfg;
        let (hd, kvd) = (c.head_dim, c.kv_heads * c.head_dim);
        let rep = c.heads / c.kv_heads;
        let qd = sh.q_heads.len() * hd;
        let scale = 1.0 / (hd as f32).sqrt();
        let groups = sh.kv_heads.len();
        let ps = pool.read(|p| p.layout().page_size());
        // Tiles of up to ATTENTION_TILE tokens at consecutive positions of one sequence
        // (a prefill chunk's tokens), each attended as a whole per KV group; the kernel
        // gives every token the bits it has alone.
        let (tiles, slots) = attention_tasks(tokens, out, rep * hd, groups);
        tp.install(|| {
            slots
                .into_par_iter()
                .enumerate()
                .for_each(|(task, mut outs)| {
                    let (range, local) = (tiles[task / groups].clone(), task % groups);
                    let gidx = sh.kv_heads.start + local;
                    let tks = &tokens[range.clone()];
                    let n = tks.iter().map(|tk| tk.pos + 1).max().unwrap_or(0);
                    let counts: Vec<usize> = tks.iter().map(|tk| tk.pos + 1).collect();
                    let pages = seq_pages[tks[0].seq];
                    let qs: Vec<&[f32]> = range
                        .map(|i| &q[i * qd + local * rep * hd..i * qd + (local + 1) * rep * hd])
                        .collect();
                    pool.read(|pool| {
                        // This group's cached rows for positions 0..n, page by page.
                        let mut keys: Vec<&[f16]> = Vec::with_capacity(n);
                        let mut values: Vec<&[f16]> = Vec::with_capacity(n);
                        for (pi, &page) in pages.iter().enumerate().take(n.div_ceil(ps)) {
                            let (kp, vp) = (
                                pool.values::<f16>(page, layer, 0),
                                pool.values::<f16>(page, layer, 1),
                            );
                            for j in pi * ps..n.min((pi + 1) * ps) {
                                let off = (j % ps) * kvd + gidx * hd;
                                keys.push(&kp[off..off + hd]);
                                values.push(&vp[off..off + hd]);
                            }
                        }
                        attend_causal(&qs, hd, &counts, &keys, &values, scale, &mut outs);
                    });
                });
        });
    }
}

/// The most tokens of one sequence attended together (their scores of one KV group side
/// by side: 8 tokens of 3 heads over 4k keys is 384 KiB).
const ATTENTION_TILE: usize = 8;

/// Attention's parallel tasks: `tokens` cut into tiles of up to [`ATTENTION_TILE`]
/// consecutive positions of one sequence, and `out` (`groups` slices of `width` per token) handed out
/// as one task per (tile, KV group) holding those tokens' slices of that group.
#[allow(clippy::type_complexity)]
pub(crate) fn attention_tasks<'o>(
    tokens: &[BatchToken],
    out: &'o mut [f32],
    width: usize,
    groups: usize,
) -> (Vec<std::ops::Range<usize>>, Vec<Vec<&'o mut [f32]>>) {
    let mut tiles: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, tk) in tokens.iter().enumerate() {
        match tiles.last_mut() {
            Some(r)
                if r.len() < ATTENTION_TILE
                    && tokens[r.end - 1].seq == tk.seq
                    && tokens[r.end - 1].pos + 1 == tk.pos =>
            {
                r.end = i + 1
            }
            _ => tiles.push(i..i + 1),
        }
    }
    let mut slots: Vec<Vec<&mut [f32]>> = (0..tiles.len() * groups).map(|_| Vec::new()).collect();
    let mut tile_of = vec![0; tokens.len()];
    for (ti, r) in tiles.iter().enumerate() {
        tile_of[r.clone()].fill(ti);
    }
    for (idx, o) in out.chunks_mut(width).enumerate() {
        let (i, g) = (idx / groups, idx % groups);
        slots[tile_of[i] * groups + g].push(o);
    }
    (tiles, slots)
}

/// `local` itself unsharded; sharded, every rank's `[rows][cols[r]]` block gathered into
/// `full`.
fn gathered<'b>(
    comm: &Option<Comm<'_>>,
    local: &'b [f32],
    full: &'b mut [f32],
    cols: &[usize],
    rows: usize,
) -> &'b [f32] {
    match comm {
        None => local,
        Some(m) => {
            m.coll.all_gather(m.rank, local, cols, rows, full);
            full
        }
    }
}

/// The logits of the tokens with `want_logits`, in batch order: their rows of the final
/// hidden state `x` through the final RMSNorm (`head.0`, epsilon `head.1`) and the output
/// matrix `head.2`.
pub(crate) fn output_logits(
    tp: &rayon::ThreadPool,
    x: &[f32],
    tokens: &[BatchToken],
    head: (&[f32], f32, &QMatrix<'_>),
) -> Vec<Vec<f32>> {
    let rows = head.2.rows;
    let (_, logits) = head_logits(tp, x, tokens, head);
    logits.chunks_exact(rows).map(<[f32]>::to_vec).collect()
}

/// [`output_logits`] as one `[n][head.2.rows]` block, with `n`, the number of tokens with
/// `want_logits` (empty when there are none).
fn head_logits(
    tp: &rayon::ThreadPool,
    x: &[f32],
    tokens: &[BatchToken],
    head: (&[f32], f32, &QMatrix<'_>),
) -> (usize, Vec<f32>) {
    let (norm, eps, output) = head;
    let d = norm.len();
    let sel: Vec<usize> = (0..tokens.len())
        .filter(|&i| tokens[i].want_logits)
        .collect();
    if sel.is_empty() {
        return (0, Vec::new());
    }
    let mut xs = Vec::with_capacity(sel.len() * d);
    for &i in &sel {
        xs.extend_from_slice(&x[i * d..(i + 1) * d]);
    }
    let mut hs = vec![0f32; xs.len()];
    rms_norm(&xs, norm, eps, &mut hs);
    let mut logits = vec![0f32; sel.len() * output.rows];
    matmul(tp, output, &hs, sel.len(), &mut logits);
    (sel.len(), logits)
}

pub(crate) fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// RMSNorm per row of `w.len()` values, sum of squares accumulated in f64 (as ggml does).
/// Public as the CPU reference the GPU's `rms_norm` kernel is checked against.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (xr, orow) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let sum: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
        let mean = (sum / n as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for ((o, &v), &wi) in orow.iter_mut().zip(xr).zip(w) {
            *o = v * scale * wi;
        }
    }
}

/// cos/sin of each rotated pair at `pos` (llama.cpp's "normal" mode: adjacent pairs).
pub(crate) fn rope_table(pos: usize, hd: usize, base: f32) -> (Vec<f32>, Vec<f32>) {
    let theta_scale = base.powf(-2.0 / hd as f32);
    let mut theta = pos as f32;
    let (mut cos, mut sin) = (Vec::with_capacity(hd / 2), Vec::with_capacity(hd / 2));
    for _ in 0..hd / 2 {
        cos.push(theta.cos());
        sin.push(theta.sin());
        theta *= theta_scale;
    }
    (cos, sin)
}

fn apply_rope(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    for (i, (&c, &s)) in cos.iter().zip(sin).enumerate() {
        let (x0, x1) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = x0 * c - x1 * s;
        x[2 * i + 1] = x0 * s + x1 * c;
    }
}

/// A llama-family model run as `plan.world` ranks on threads of this process.
pub(crate) struct TpLlama {
    pub model: LlamaModel,
    plan: ShardPlan,
    coll: HostCollective,
    /// Per rank, what it computed (each rank's thread adds once per forward).
    work: Vec<Mutex<RankWork>>,
}

impl TpLlama {
    pub fn new(model: LlamaModel, world: usize) -> Result<Self, EngineError> {
        let plan = ShardPlan::new(&model.cfg, world)?;
        tracing::info!(tp = world, plan = %plan, "tensor parallelism (all-gather, bit-identical to tp=1)");
        Ok(Self {
            model,
            coll: HostCollective::new(world),
            work: (0..world).map(|_| Mutex::default()).collect(),
            plan,
        })
    }

    /// Per rank, what it computed so far.
    pub fn work(&self) -> Vec<RankWork> {
        self.work.iter().map(|w| lock_work(w).clone()).collect()
    }

    /// [`LlamaModel::forward`], computed by every rank at once: ranks 1.. on scoped threads,
    /// rank 0 on the caller's. Their kernels run on `tp`; the caller must not be one of its
    /// threads (a rank waiting at a barrier must not hold a compute thread).
    pub fn forward(
        &self,
        tp: &rayon::ThreadPool,
        pool: &mut PagePool,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
    ) -> Vec<Vec<f32>> {
        debug_assert!(
            rayon::current_thread_index().is_none(),
            "the sharded forward runs outside the compute pool"
        );
        let shared = RwLock::new(pool);
        let rank = |r: usize| {
            let _abort = self.coll.abort_on_panic();
            let comm = Comm {
                plan: &self.plan,
                rank: r,
                coll: &self.coll,
            };
            let (logits, work) = self.model.forward_rank(
                tp,
                &shared,
                seq_pages,
                tokens,
                &self.plan.ranks[r],
                Some(comm),
            );
            lock_work(&self.work[r]).merge(work);
            logits
        };
        std::thread::scope(|s| {
            let others: Vec<_> = (1..self.plan.world)
                .map(|r| {
                    std::thread::Builder::new()
                        .name(format!("pdmesh-tp-rank-{r}"))
                        .spawn_scoped(s, move || rank(r))
                        .expect("spawn a tensor-parallel rank")
                })
                .collect();
            let logits = rank(0);
            for h in others {
                h.join().expect("a tensor-parallel rank panicked");
            }
            logits
        })
    }
}

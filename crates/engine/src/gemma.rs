//! The Gemma 3 forward pass: hybrid attention, five sliding-window layers (each token
//! sees the last `window` positions, itself included) per global layer. Beside llama's
//! shape it has a scaled embedding, RMSNorm on each query and key head, per-layer rope
//! bases (local 1e4, global 1e6) in NEOX order, one norm after attention and one after
//! the MLP, and a GeGLU MLP (GELU, tanh approximation). The output head is the embedding.
//!
//! The window applies to every step, a single-token decode as much as a prefill chunk: a
//! local layer's token attends over exactly its window's positions, whatever its batch or
//! chunk, so the answer is bit-identical to the token computed alone.

use std::ops::Range;
use std::sync::Arc;

use half::f16;
use half::slice::HalfFloatSliceExt;
use pdmesh_gguf::GgufFile;
use pdmesh_kernels::{Glu, QMatrix, WeightFormat, attend_window, matmul, matmul_glu, matmul_many};
use pdmesh_kv::{DType, KvLayout, PageId, PagePool};
use rayon::prelude::*;

use crate::EngineError;
use crate::model::{
    BatchToken, add_in_place, attention_tasks, output_logits, rms_norm, rope_table,
};

/// Gemma 3's shape, read from GGUF metadata (`gemma3.*`).
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3Config {
    pub layers: usize,
    pub dim: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Rope base of the global layers.
    pub rope_global: f32,
    /// Rope base of the sliding-window layers.
    pub rope_local: f32,
    /// Positions a sliding-window layer's token sees, its own included.
    pub window: usize,
    /// Every `pattern`th layer (the last of each run) is global; the others slide.
    pub pattern: usize,
    pub rms_eps: f32,
    pub context_length: usize,
    pub vocab: usize,
}

impl Gemma3Config {
    pub fn from_gguf(g: &GgufFile) -> Result<Self, EngineError> {
        let arch = g.get_str("general.architecture")?;
        if arch != "gemma3" {
            return Err(EngineError::Unsupported(format!(
                "architecture {arch:?} is not gemma3"
            )));
        }
        let k = |s: &str| format!("gemma3.{s}");
        let opt = |s: &str| g.get(&k(s)).and_then(|v| v.as_f64());
        let dim = g.get_u64(&k("embedding_length"))? as usize;
        let heads = g.get_u64(&k("attention.head_count"))? as usize;
        let kv_heads = g
            .get(&k("attention.head_count_kv"))
            .and_then(|v| v.as_u64())
            .unwrap_or(heads as u64) as usize;
        let head_dim = g.get_u64(&k("attention.key_length"))? as usize;
        let value_dim = g
            .get(&k("attention.value_length"))
            .and_then(|v| v.as_u64())
            .unwrap_or(head_dim as u64) as usize;
        let vocab = g.get_str_array("tokenizer.ggml.tokens")?.len();
        let cfg = Self {
            layers: g.get_u64(&k("block_count"))? as usize,
            dim,
            ffn: g.get_u64(&k("feed_forward_length"))? as usize,
            heads,
            kv_heads,
            head_dim,
            rope_global: opt("rope.freq_base").unwrap_or(1_000_000.0) as f32,
            // Gemma 3's GGUFs do not carry the local base; llama.cpp fixes it at 1e4.
            rope_local: opt("rope.local.freq_base").unwrap_or(10_000.0) as f32,
            window: g.get_u64(&k("attention.sliding_window"))? as usize,
            pattern: g
                .get(&k("attention.sliding_window_pattern"))
                .and_then(|v| v.as_u64())
                .unwrap_or(6) as usize,
            rms_eps: g.get_f64(&k("attention.layer_norm_rms_epsilon"))? as f32,
            context_length: g.get_u64(&k("context_length"))? as usize,
            vocab,
        };
        if heads == 0
            || kv_heads == 0
            || !heads.is_multiple_of(kv_heads)
            || value_dim != head_dim
            || head_dim == 0
            || !head_dim.is_multiple_of(16)
            || dim == 0
            || cfg.layers == 0
            || cfg.ffn == 0
            || cfg.window == 0
            || cfg.pattern == 0
        {
            return Err(EngineError::Unsupported(format!(
                "gemma3 shape: {} layers of {dim} (FFN {}), {heads}/{kv_heads} heads of \
                 {head_dim} (values {value_dim}), window {}, pattern {}",
                cfg.layers, cfg.ffn, cfg.window, cfg.pattern
            )));
        }
        Ok(cfg)
    }

    /// Whether layer `l` attends over a sliding window (else over the whole context).
    pub fn is_local(&self, l: usize) -> bool {
        l % self.pattern < self.pattern - 1
    }

    /// The first position layer `l`'s token at `pos` attends to.
    pub fn first_visible(&self, l: usize, pos: usize) -> usize {
        if self.is_local(l) {
            (pos + 1).saturating_sub(self.window)
        } else {
            0
        }
    }

    /// The KV layout: f16 K and V per layer, the global layers one group and the
    /// sliding-window layers another.
    pub fn kv_layout(&self, page_size: usize) -> KvLayout {
        let dense = KvLayout::llama(
            self.layers,
            self.kv_heads,
            self.head_dim,
            DType::F16,
            page_size,
        );
        let global: Vec<usize> = (0..self.layers).filter(|&l| !self.is_local(l)).collect();
        dense
            .with_window(self.window, &global)
            .expect("every layer is local or global")
    }
}

/// Where a weight matrix lives: in the GGUF map, or (rewritten at load) in the model's
/// own buffer, and its layout there.
#[derive(Clone, Debug)]
struct WRef {
    format: WeightFormat,
    range: Range<usize>,
    rows: usize,
    cols: usize,
    owned: bool,
}

struct Layer {
    attn_norm: Vec<f32>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    post_attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    post_ffn_norm: Vec<f32>,
    wq: WRef,
    wk: WRef,
    wv: WRef,
    wo: WRef,
    w_gate: WRef,
    w_up: WRef,
    w_down: WRef,
}

/// Gemma 3: weights borrowed from the GGUF memory map, still quantized.
pub struct GemmaModel {
    pub cfg: Gemma3Config,
    layers: Vec<Layer>,
    embed: WRef,
    out_norm: Vec<f32>,
    gguf: Arc<GgufFile>,
    /// The Q5_0, Q4_K and Q6_K matrices rewritten at load into formats the integer
    /// kernels compute on (the same values; `WeightFormat::rewrite`).
    owned: Vec<u8>,
    /// Tests only: every layer global (what a model that ignored the window would do).
    no_window: bool,
}

/// Tensor `name` of shape `rows x cols`; one the integer kernels take in another layout
/// (Q5_0 as Q8_0, Q4_K and Q6_K in 32-value blocks: [`WeightFormat::rewrite`], the
/// same values) rewritten into `owned`.
fn wref(
    g: &GgufFile,
    owned: &mut Vec<u8>,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<WRef, EngineError> {
    let t = g.tensor(name)?;
    if t.row_len() != cols || t.rows() != rows {
        return Err(EngineError::Unsupported(format!(
            "tensor {name} is {:?}, expected {cols}x{rows}",
            t.dims
        )));
    }
    let range = g.tensor_range(name)?;
    if let Some((format, bytes)) = WeightFormat::rewrite(t.ty, &g.bytes()[range.clone()]) {
        let start = owned.len();
        owned.extend_from_slice(&bytes);
        return Ok(WRef {
            format,
            range: start..owned.len(),
            rows,
            cols,
            owned: true,
        });
    }
    Ok(WRef {
        format: WeightFormat::Ggml(t.ty),
        range,
        rows,
        cols,
        owned: false,
    })
}

impl GemmaModel {
    pub fn load(gguf: Arc<GgufFile>) -> Result<Self, EngineError> {
        let cfg = Gemma3Config::from_gguf(&gguf)?;
        let g: &GgufFile = &gguf;
        let (d, qd, kvd) = (
            cfg.dim,
            cfg.heads * cfg.head_dim,
            cfg.kv_heads * cfg.head_dim,
        );
        let norm = |name: &str, n: usize| -> Result<Vec<f32>, EngineError> {
            let v = g.tensor_f32(name)?;
            if v.len() != n {
                return Err(EngineError::Unsupported(format!(
                    "tensor {name} has {} values, expected {n}",
                    v.len()
                )));
            }
            Ok(v)
        };
        let mut owned = Vec::new();
        let mut w = |name: &str, rows, cols| wref(g, &mut owned, name, rows, cols);
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(Layer {
                attn_norm: norm(&n("attn_norm"), d)?,
                q_norm: norm(&n("attn_q_norm"), cfg.head_dim)?,
                k_norm: norm(&n("attn_k_norm"), cfg.head_dim)?,
                post_attn_norm: norm(&n("post_attention_norm"), d)?,
                ffn_norm: norm(&n("ffn_norm"), d)?,
                post_ffn_norm: norm(&n("post_ffw_norm"), d)?,
                wq: w(&n("attn_q"), qd, d)?,
                wk: w(&n("attn_k"), kvd, d)?,
                wv: w(&n("attn_v"), kvd, d)?,
                wo: w(&n("attn_output"), d, qd)?,
                w_gate: w(&n("ffn_gate"), cfg.ffn, d)?,
                w_up: w(&n("ffn_up"), cfg.ffn, d)?,
                w_down: w(&n("ffn_down"), d, cfg.ffn)?,
            });
        }
        let embed = w("token_embd.weight", cfg.vocab, d)?;
        let out_norm = norm("output_norm.weight", d)?;
        Ok(Self {
            cfg,
            layers,
            embed,
            out_norm,
            gguf,
            owned,
            no_window: false,
        })
    }

    /// Tests only: attend every layer over the whole context, as a model that dropped the
    /// sliding window would (to show the window decides an answer).
    #[doc(hidden)]
    pub fn without_window(mut self) -> Self {
        self.no_window = true;
        self
    }

    fn m(&self, w: &WRef) -> QMatrix<'_> {
        let bytes = if w.owned {
            &self.owned[..]
        } else {
            self.gguf.bytes()
        };
        QMatrix::new(w.format, &bytes[w.range.clone()], w.rows, w.cols)
    }

    fn first_visible(&self, l: usize, pos: usize) -> usize {
        if self.no_window {
            0
        } else {
            self.cfg.first_visible(l, pos)
        }
    }

    /// Run `tokens` through the model: each token's K and V are written at its position
    /// in its sequence's pages; returns the logits of the tokens with `want_logits`.
    pub fn forward(
        &self,
        tp: &rayon::ThreadPool,
        pool: &mut PagePool,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
    ) -> Vec<Vec<f32>> {
        let c = &self.cfg;
        let t = tokens.len();
        let (d, hd) = (c.dim, c.head_dim);
        let (qd, kvd) = (c.heads * hd, c.kv_heads * hd);
        let ps = pool.layout().page_size();
        let mut x = vec![0f32; t * d];
        let emb_scale = (d as f32).sqrt();
        for (i, tok) in tokens.iter().enumerate() {
            let row = &mut x[i * d..(i + 1) * d];
            self.m(&self.embed).dequantize_row(tok.token as usize, row);
            for v in row.iter_mut() {
                *v *= emb_scale;
            }
        }
        let ropes = |base: f32| -> Vec<(Vec<f32>, Vec<f32>)> {
            tokens
                .iter()
                .map(|tk| rope_table(tk.pos, hd, base))
                .collect()
        };
        let (rope_local, rope_global) = (ropes(c.rope_local), ropes(c.rope_global));
        let (mut h, mut q, mut k, mut v) = (
            vec![0f32; t * d],
            vec![0f32; t * qd],
            vec![0f32; t * kvd],
            vec![0f32; t * kvd],
        );
        let (mut qn, mut kn) = (vec![0f32; t * qd], vec![0f32; t * kvd]);
        let mut att = vec![0f32; t * qd];
        let mut o = vec![0f32; t * d];
        let mut o2 = vec![0f32; t * d];
        let mut g = vec![0f32; t * c.ffn];
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&x, &layer.attn_norm, c.rms_eps, &mut h);
            let (wq, wk, wv) = (self.m(&layer.wq), self.m(&layer.wk), self.m(&layer.wv));
            matmul_many(tp, &[&wq, &wk, &wv], &h, t, &mut [&mut q, &mut k, &mut v]);
            // Per-head RMSNorm of queries and keys (the weight is one head wide).
            rms_norm(&q, &layer.q_norm, c.rms_eps, &mut qn);
            rms_norm(&k, &layer.k_norm, c.rms_eps, &mut kn);
            let rope = if c.is_local(li) {
                &rope_local
            } else {
                &rope_global
            };
            for (i, (cos, sin)) in rope.iter().enumerate() {
                for head in qn[i * qd..(i + 1) * qd].chunks_exact_mut(hd) {
                    apply_rope_neox(head, cos, sin);
                }
                for head in kn[i * kvd..(i + 1) * kvd].chunks_exact_mut(hd) {
                    apply_rope_neox(head, cos, sin);
                }
            }
            for (i, tk) in tokens.iter().enumerate() {
                let page = seq_pages[tk.seq][tk.pos / ps];
                let cols = tk.pos % ps * kvd..(tk.pos % ps + 1) * kvd;
                pool.values_mut::<f16>(page, li, 0)[cols.clone()]
                    .convert_from_f32_slice(&kn[i * kvd..(i + 1) * kvd]);
                pool.values_mut::<f16>(page, li, 1)[cols]
                    .convert_from_f32_slice(&v[i * kvd..(i + 1) * kvd]);
            }
            self.attention(tp, pool, seq_pages, tokens, li, &qn, &mut att);
            matmul(tp, &self.m(&layer.wo), &att, t, &mut o);
            rms_norm(&o, &layer.post_attn_norm, c.rms_eps, &mut o2);
            add_in_place(&mut x, &o2);
            rms_norm(&x, &layer.ffn_norm, c.rms_eps, &mut h);
            let (wg, wu) = (self.m(&layer.w_gate), self.m(&layer.w_up));
            matmul_glu(tp, Glu::GeluTanh, &wg, &wu, &h, t, &mut g);
            matmul(tp, &self.m(&layer.w_down), &g, t, &mut o);
            rms_norm(&o, &layer.post_ffn_norm, c.rms_eps, &mut o2);
            add_in_place(&mut x, &o2);
        }
        let head = self.m(&self.embed);
        output_logits(tp, &x, tokens, (&self.out_norm[..], c.rms_eps, &head))
    }

    /// Attention of every (token, KV head) pair in parallel, a tile of consecutive tokens
    /// of one sequence at a time: the tile's keys start at its first token's first
    /// visible position, and each token of a local layer attends from its own
    /// (`attend_window`, the bits it has alone).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        tp: &rayon::ThreadPool,
        pool: &PagePool,
        seq_pages: &[&[PageId]],
        tokens: &[BatchToken],
        layer: usize,
        q: &[f32],
        out: &mut [f32],
    ) {
        let c = &self.cfg;
        let (hd, kvd) = (c.head_dim, c.kv_heads * c.head_dim);
        let rep = c.heads / c.kv_heads;
        let qd = c.heads * hd;
        // Gemma 3 (below 27B) scales queries by 1/sqrt(head_dim).
        let scale = 1.0 / (hd as f32).sqrt();
        let groups = c.kv_heads;
        let ps = pool.layout().page_size();
        let (tiles, slots) = attention_tasks(tokens, out, rep * hd, groups);
        tp.install(|| {
            slots
                .into_par_iter()
                .enumerate()
                .for_each(|(task, mut outs)| {
                    let (range, g) = (tiles[task / groups].clone(), task % groups);
                    let tks = &tokens[range.clone()];
                    let first = self.first_visible(layer, tks[0].pos);
                    let n = tks.iter().map(|tk| tk.pos + 1).max().unwrap_or(0);
                    let counts: Vec<usize> = tks.iter().map(|tk| tk.pos + 1 - first).collect();
                    let starts: Vec<usize> = tks
                        .iter()
                        .map(|tk| self.first_visible(layer, tk.pos) - first)
                        .collect();
                    let pages = seq_pages[tks[0].seq];
                    let qs: Vec<&[f32]> = range
                        .map(|i| &q[i * qd + g * rep * hd..i * qd + (g + 1) * rep * hd])
                        .collect();
                    let mut keys: Vec<&[f16]> = Vec::with_capacity(n - first);
                    let mut values: Vec<&[f16]> = Vec::with_capacity(n - first);
                    let span = first / ps..n.div_ceil(ps);
                    for (pi, &page) in pages.iter().enumerate().take(span.end).skip(span.start) {
                        let (kp, vp) = (
                            pool.values::<f16>(page, layer, 0),
                            pool.values::<f16>(page, layer, 1),
                        );
                        for j in (pi * ps).max(first)..n.min((pi + 1) * ps) {
                            let off = (j % ps) * kvd + g * hd;
                            keys.push(&kp[off..off + hd]);
                            values.push(&vp[off..off + hd]);
                        }
                    }
                    let tile = pdmesh_kernels::Tile {
                        qs: &qs,
                        hd,
                        starts: &starts,
                        counts: &counts,
                        keys: &keys,
                        values: &values,
                        scale,
                    };
                    attend_window(&tile, &mut outs);
                });
        });
    }
}

/// Rope in NEOX order: element `i` rotates with element `i + hd/2`.
fn apply_rope_neox(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    for (i, (&c, &s)) in cos.iter().zip(sin).enumerate() {
        let (x0, x1) = (x[i], x[i + half]);
        x[i] = x0 * c - x1 * s;
        x[i + half] = x0 * s + x1 * c;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Gemma3Config {
        Gemma3Config {
            layers: 18,
            dim: 640,
            ffn: 2048,
            heads: 4,
            kv_heads: 1,
            head_dim: 256,
            rope_global: 1e6,
            rope_local: 1e4,
            window: 512,
            pattern: 6,
            rms_eps: 1e-6,
            context_length: 32768,
            vocab: 262_144,
        }
    }

    /// A GGUF with Gemma 3's metadata, one key changed by `edit`.
    fn header(
        edit: impl FnOnce(&mut pdmesh_gguf::GgufWriter),
    ) -> Result<Gemma3Config, EngineError> {
        use pdmesh_gguf::{GgufWriter, MetaValue as M};
        let mut w = GgufWriter::new();
        w.meta("general.architecture", M::String("gemma3".into()))
            .meta(
                "tokenizer.ggml.tokens",
                M::Array(vec![M::String("a".into()); 4]),
            );
        for (k, v) in [
            ("embedding_length", 640),
            ("block_count", 18),
            ("feed_forward_length", 2048),
            ("attention.head_count", 4),
            ("attention.head_count_kv", 1),
            ("attention.key_length", 256),
            ("attention.value_length", 256),
            ("attention.sliding_window", 512),
            ("context_length", 32768),
        ] {
            w.meta(&format!("gemma3.{k}"), M::U32(v));
        }
        w.meta("gemma3.attention.layer_norm_rms_epsilon", M::F32(1e-6));
        edit(&mut w);
        Gemma3Config::from_gguf(&GgufFile::from_bytes(&w.to_bytes()).unwrap())
    }

    #[test]
    fn a_malformed_shape_is_refused_naming_it() {
        use pdmesh_gguf::MetaValue as M;
        let ok = header(|_| {}).unwrap();
        assert_eq!(
            (ok.layers, ok.window, ok.pattern, ok.vocab),
            (18, 512, 6, 4)
        );
        for (key, v) in [
            ("attention.key_length", 0),
            ("attention.value_length", 128),
            ("attention.head_count_kv", 3),
            ("attention.sliding_window", 0),
            ("embedding_length", 0),
            ("block_count", 0),
            ("attention.key_length", 40),
        ] {
            let err = header(|w| {
                w.meta(&format!("gemma3.{key}"), M::U32(v));
            })
            .unwrap_err();
            assert!(
                matches!(&err, EngineError::Unsupported(m) if m.starts_with("gemma3 shape")),
                "{key} = {v}: {err}"
            );
        }
        let err = header(|w| {
            w.meta("general.architecture", M::String("llama".into()));
        })
        .unwrap_err();
        assert!(err.to_string().contains("is not gemma3"), "{err}");
    }

    #[test]
    fn every_sixth_layer_is_global() {
        let c = cfg();
        let global: Vec<usize> = (0..c.layers).filter(|&l| !c.is_local(l)).collect();
        assert_eq!(global, [5, 11, 17]);
    }

    #[test]
    fn a_local_layer_sees_the_last_window_positions_itself_included() {
        let c = cfg();
        assert_eq!(c.first_visible(0, 0), 0);
        assert_eq!(c.first_visible(0, 511), 0);
        assert_eq!(c.first_visible(0, 512), 1);
        assert_eq!(c.first_visible(0, 1500), 989);
        assert_eq!(c.first_visible(5, 1500), 0);
    }

    #[test]
    fn neox_rope_rotates_the_two_halves_together() {
        let (cos, sin) = rope_table(3, 8, 10_000.0);
        let mut x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let orig = x;
        apply_rope_neox(&mut x, &cos, &sin);
        for i in 0..4 {
            let (a, b) = (orig[i], orig[i + 4]);
            assert_eq!(x[i], a * cos[i] - b * sin[i]);
            assert_eq!(x[i + 4], a * sin[i] + b * cos[i]);
            // A rotation keeps each pair's length.
            let before = a * a + b * b;
            let after = x[i] * x[i] + x[i + 4] * x[i + 4];
            assert!((before - after).abs() < 1e-4 * before);
        }
    }
}

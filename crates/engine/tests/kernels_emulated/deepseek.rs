//! deepseek.cu: the DeepSeek cache entry, index scores and MLA attention, and the small
//! kernels of its forward (norm, rope, index prep, scale, MoE combine), bit-exact.

use pdmesh_kv::KvLayout;
use pdmesh_kv::fp8::{self, ScaleRule};
use rand::Rng;

use crate::emu::{assert_bits_eq, c, emu, m, randv, rng, ulps};
use crate::norm::rms_scales;

#[allow(clippy::type_complexity)]
#[rustfmt::skip]
type DsWriteFn = unsafe extern "C" fn(
    *const f32, i32, *const f32, i32, *mut u8, *const i64, *const i32, i32, i32, i32, i32, i32,
    i64, i64, i64, i64, i64, i64, i32, i64, i64, i64, i64,
);
#[allow(clippy::type_complexity)]
#[rustfmt::skip]
type DsScoresFn = unsafe extern "C" fn(
    *const f32, i32, *const f32, i32, i32, *const u8, *const i32, *const i32, *const i32,
    *const i32, *const i32, i64, i32, i32, i64, i64, i64, i64, *mut f32, i32,
);
#[allow(clippy::type_complexity)]
#[rustfmt::skip]
type DsMlaFn = unsafe extern "C" fn(
    *const f32, *const f32, *mut f32, *mut f32, *const i32, *const i32, i32, *const u8,
    *const i32, *const i32, *const i32, i64, i32, i32, i32, i32, i32, i32, f32, i32, i64, i64,
    i64, i64, i64, i64,
);

/// deepseek/ops.rs's `dot` (and common.cuh's pd_dot8): eight lanes, summed pairwise, then
/// the tail in order.
fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let n8 = a.len() / 8 * 8;
    let mut l = [0f32; 8];
    for c in (0..n8).step_by(8) {
        for i in 0..8 {
            l[i] += a[c + i] * b[c + i];
        }
    }
    let mut s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for i in n8..a.len() {
        s += a[i] * b[i];
    }
    s
}

fn put_bf16(dst: &mut [u8], v: &[f32]) -> Vec<f32> {
    for (j, x) in v.iter().enumerate() {
        dst[2 * j..2 * j + 2].copy_from_slice(&half::bf16::from_f32(*x).to_bits().to_le_bytes());
    }
    v.iter()
        .map(|x| half::bf16::from_f32(*x).to_f32())
        .collect()
}

/// fp8 codes at `at` and per-128 ue8m0 scales at `sc_at` (bytes of `pool`); the decoded values.
fn put_fp8(pool: &mut [u8], at: usize, sc_at: usize, v: &[f32]) -> Vec<f32> {
    let mut dec = vec![0f32; v.len()];
    for (b, (blk, d)) in v.chunks(128).zip(dec.chunks_mut(128)).enumerate() {
        let mut q = vec![0u8; blk.len()];
        let s = fp8::quantize_block(blk, &mut q, ScaleRule::Ue8m0);
        pool[at + 128 * b..at + 128 * b + blk.len()].copy_from_slice(&q);
        pool[sc_at + 4 * b..sc_at + 4 * b + 4].copy_from_slice(&s.to_le_bytes());
        fp8::dequantize_block(&q, s, d);
    }
    dec
}

#[test]
fn deepseek_cache_entry_index_scores_and_mla_attention() {
    use pdmesh_kv::{IndexKDtype, MlaCacheDtype, MlaDims};
    let e = emu();
    let write: DsWriteFn = e.kernel("ds_write_entry");
    let scores: DsScoresFn = e.kernel("ds_index_scores_paged");
    let mla: DsMlaFn = e.kernel("ds_mla_attention");
    let (r, dr, di, hi, heads, dn, dv) = (
        256usize, 32usize, 128usize, 2usize, 2usize, 32usize, 32usize,
    );
    let (ps, n, layer) = (4usize, 13usize, 1usize);
    let pages_of_seq = [2i32, 0, 3, 1];
    let pts = [0i32];
    let mut rg = rng(10);
    for mla_fp8 in [false, true] {
        for ik_fp8 in [false, true] {
            let what = format!("mla fp8 {mla_fp8} index-k fp8 {ik_fp8}");
            let dims = MlaDims {
                kv_lora_rank: r,
                rope_dim: dr,
                index_head_dim: di,
            };
            let layout = KvLayout::deepseek_v32(
                2,
                dims,
                if mla_fp8 {
                    MlaCacheDtype::Fp8
                } else {
                    MlaCacheDtype::Bf16
                },
                if ik_fp8 {
                    IndexKDtype::Fp8
                } else {
                    IndexKDtype::Bf16
                },
                ps,
            )
            .unwrap();
            let bpp = layout.bytes_per_page();
            let comp = |name: &str| layout.component_index(name).unwrap();
            let val = |cn: usize, slot: usize| layout.value_offset(layer, cn, slot);
            let scl = |cn: usize, slot: usize| layout.scale_offset(layer, cn, slot).unwrap();
            let stride = |cn: usize| layout.token_stride(cn) as i64;
            let sc_stride = |cn: usize| layout.scale_stride(cn).unwrap() as i64;
            let (lat_c, ik_c) = (
                comp(if mla_fp8 { "mla_nope" } else { "mla_latent" }),
                comp("index_k"),
            );
            let rope_c = mla_fp8.then(|| comp("mla_rope"));
            let lat_off = val(lat_c, 0) as i64;
            let lat_st = stride(lat_c);
            let (lat_sc_off, lat_sc_st, rope_off, rope_st) = match rope_c {
                Some(rc) => (
                    scl(lat_c, 0) as i64,
                    sc_stride(lat_c),
                    val(rc, 0) as i64,
                    stride(rc),
                ),
                None => (0, 0, 0, 0),
            };
            let ik_off = val(ik_c, 0) as i64;
            let ik_st = stride(ik_c);
            let (ik_sc_off, ik_sc_st) = if ik_fp8 {
                (scl(ik_c, 0) as i64, sc_stride(ik_c))
            } else {
                (0, 0)
            };

            // 1. ds_write_entry: the cache bytes, exactly as the CPU's fp8 / bf16 write them.
            let lat_stride = r + dr + 3;
            let lat = randv(&mut rg, n * lat_stride, 1.0);
            let ik = randv(&mut rg, n * di, 1.0);
            let base: Vec<i64> = (0..n)
                .map(|p| layout.page_offset(pages_of_seq[p / ps] as usize) as i64)
                .collect();
            let slot: Vec<i32> = (0..n).map(|p| (p % ps) as i32).collect();
            let mut pool = vec![0u8; layout.bytes_per_pool(4)];
            let (pl, pik, pp, pb, psl) = (c(&lat), c(&ik), m(&mut pool), c(&base), c(&slot));
            // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
            e.launch((n as u32, 1), 128, || unsafe {
                write(
                    pl.p(),
                    lat_stride as i32,
                    pik.p(),
                    di as i32,
                    pp.p(),
                    pb.p(),
                    psl.p(),
                    n as i32,
                    r as i32,
                    dr as i32,
                    di as i32,
                    mla_fp8 as i32,
                    lat_off,
                    lat_st,
                    lat_sc_off,
                    lat_sc_st,
                    rope_off,
                    rope_st,
                    ik_fp8 as i32,
                    ik_off,
                    ik_st,
                    ik_sc_off,
                    ik_sc_st,
                )
            });
            let mut want = vec![0u8; pool.len()];
            let mut dlat = Vec::new(); // decoded latents: r + dr values per position
            let mut dik = Vec::new(); // decoded index keys
            for p in 0..n {
                let (pg, s) = (base[p] as usize, p % ps);
                let l = &lat[p * lat_stride..p * lat_stride + r + dr];
                let k = &ik[p * di..(p + 1) * di];
                // Where the layout itself puts slot `s`'s values and scales.
                let v_at = |cn: usize| pg + val(cn, s);
                let s_at = |cn: usize| pg + scl(cn, s);
                if let Some(rc) = rope_c {
                    let mut d = put_fp8(&mut want, v_at(lat_c), s_at(lat_c), &l[..r]);
                    d.extend(put_bf16(&mut want[v_at(rc)..], &l[r..]));
                    dlat.push(d);
                } else {
                    dlat.push(put_bf16(&mut want[v_at(lat_c)..], l));
                }
                if ik_fp8 {
                    dik.push(put_fp8(&mut want, v_at(ik_c), s_at(ik_c), k));
                } else {
                    dik.push(put_bf16(&mut want[v_at(ik_c)..], k));
                }
            }
            assert!(pool == want, "{what}: ds_write_entry cache bytes differ");

            // 2. ds_index_scores_paged: index_score over the keys read back from the cache.
            let pos = [12i32, 5];
            let seq = [0i32, 0];
            let has = [1i32, 1];
            let tt = pos.len();
            let q_stride = hi * di + 4;
            let qi = randv(&mut rg, tt * q_stride, 1.0);
            let wi = randv(&mut rg, tt * hi, 1.0);
            let out_stride = n;
            let mut sc = vec![-7f32; tt * out_stride];
            let (pq, pw, ppool, ppt, ppts) = (c(&qi), c(&wi), c(&pool), c(&pages_of_seq), c(&pts));
            let (pseq, ppos, phas, psc) = (c(&seq), c(&pos), c(&has), m(&mut sc));
            // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
            e.launch((tt as u32, 1), 128, || unsafe {
                scores(
                    pq.p(),
                    q_stride as i32,
                    pw.p(),
                    hi as i32,
                    di as i32,
                    ppool.p(),
                    ppt.p(),
                    ppts.p(),
                    pseq.p(),
                    ppos.p(),
                    phas.p(),
                    bpp as i64,
                    ps as i32,
                    ik_fp8 as i32,
                    ik_off,
                    ik_st,
                    ik_sc_off,
                    ik_sc_st,
                    psc.p(),
                    out_stride as i32,
                )
            });
            for t in 0..tt {
                for j in 0..n {
                    let got = sc[t * out_stride + j];
                    if j as i32 > pos[t] {
                        assert_eq!(got, -7.0, "{what}: score past the position written");
                        continue;
                    }
                    let want = pdmesh_engine::deepseek::index_score(
                        &qi[t * q_stride..t * q_stride + hi * di],
                        &wi[t * hi..(t + 1) * hi],
                        &dik[j],
                    );
                    assert_eq!(got.to_bits(), want.to_bits(), "{what}: score t {t} j {j}");
                }
            }

            // 3. ds_mla_attention over selected positions, against the documented absorbed
            // MLA (deepseek/mod.rs `attention`'s order), transcribed.
            let cap = 8usize;
            let mut sel = vec![-1i32; tt * cap];
            sel[..cap].copy_from_slice(&[0, 2, 3, 5, 7, 8, 11, 12]);
            sel[cap..cap + 6].copy_from_slice(&[0, 1, 2, 3, 4, 5]);
            let sel_n = [8i32, 6];
            let q = randv(&mut rg, tt * heads * (dn + dr), 1.0);
            let kvb = randv(&mut rg, heads * (dn + dv) * r, 0.2);
            let scale = 0.125f32;
            let mut out = vec![0f32; tt * heads * dv];
            let mut scratch = vec![0f32; tt * heads * cap];
            let (pq, pkvb, po, pscr) = (c(&q), c(&kvb), m(&mut out), m(&mut scratch));
            let (psel, pseln) = (c(&sel), c(&sel_n));
            // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
            e.launch((tt as u32, heads as u32), 128, || unsafe {
                mla(
                    pq.p(),
                    pkvb.p(),
                    po.p(),
                    pscr.p(),
                    psel.p(),
                    pseln.p(),
                    cap as i32,
                    ppool.p(),
                    ppt.p(),
                    ppts.p(),
                    pseq.p(),
                    bpp as i64,
                    ps as i32,
                    heads as i32,
                    r as i32,
                    dr as i32,
                    dn as i32,
                    dv as i32,
                    scale,
                    mla_fp8 as i32,
                    lat_off,
                    lat_st,
                    lat_sc_off,
                    lat_sc_st,
                    rope_off,
                    rope_st,
                )
            });
            for t in 0..tt {
                for h in 0..heads {
                    let qh = &q[(t * heads + h) * (dn + dr)..(t * heads + h + 1) * (dn + dr)];
                    let wb = &kvb[h * (dn + dv) * r..(h + 1) * (dn + dv) * r];
                    let qabs: Vec<f32> = (0..r)
                        .map(|a| (0..dn).fold(0f32, |acc, dd| acc + qh[dd] * wb[dd * r + a]))
                        .collect();
                    let picks: Vec<&Vec<f32>> = sel[t * cap..t * cap + sel_n[t] as usize]
                        .iter()
                        .map(|&p| &dlat[p as usize])
                        .collect();
                    let s: Vec<f32> = picks
                        .iter()
                        .map(|e| scale * (dot8(&qabs, &e[..r]) + dot8(&qh[dn..], &e[r..])))
                        .collect();
                    let mx = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                    let ex: Vec<f32> = s.iter().map(|v| (v - mx).exp()).collect();
                    let sum = ex.iter().fold(0f32, |a, &b| a + b);
                    let olat: Vec<f32> = (0..r)
                        .map(|a| {
                            ex.iter()
                                .zip(&picks)
                                .fold(0f32, |acc, (x, e)| acc + (x / sum) * e[a])
                        })
                        .collect();
                    for dd in 0..dv {
                        let want = dot8(&olat, &wb[(dn + dd) * r..(dn + dd + 1) * r]);
                        let got = out[(t * heads + h) * dv + dd];
                        // exp: the host libm here (CUDA's expf on a GPU); 1e-5 relative.
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{what}: mla t {t} h {h} [{dd}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

type DsRmsInplaceFn = unsafe extern "C" fn(*mut f32, i32, *const f32, i32, f32);
type DsRopeInterleavedFn =
    unsafe extern "C" fn(*mut f32, i32, i32, i32, *const f32, *const f32, i32);
#[allow(clippy::type_complexity)]
#[rustfmt::skip]
type DsIndexPrepFn = unsafe extern "C" fn(
    *mut f32, i32, i32, i32, *const f32, *const f32, i32, *const f32, *const f32, f32, i32,
);
type DsScaleFn = unsafe extern "C" fn(*mut f32, i32, f32);
type DsMoeCombineFn = unsafe extern "C" fn(*mut f32, *const f32, *const i32, *const f32, i32, i32);

/// The host's rope tables (deepseek/ops.rs `rope_at`, private there): per token, cos and sin
/// of pos × freq for each of `pairs` pairs, frequencies base^(-2i / (2 pairs)); t × pairs.
fn rope_tables(pos: &[i32], pairs: usize, base: f32) -> (Vec<f32>, Vec<f32>) {
    let freqs: Vec<f32> = (0..pairs)
        .map(|i| base.powf(-2.0 * i as f32 / (2 * pairs) as f32))
        .collect();
    pos.iter()
        .flat_map(|&p| {
            freqs.iter().map(move |&f| {
                let a = p as f32 * f;
                (a.cos(), a.sin())
            })
        })
        .unzip()
}

/// deepseek/cache.rs's round_like_index_k (private there): 1 through bf16, 2 through fp8 (one
/// ue8m0 scale per 128 values, quantized then dequantized).
fn round_like_index_k(v: &mut [f32], mode: i32) {
    match mode {
        1 => v
            .iter_mut()
            .for_each(|x| *x = half::bf16::from_f32(*x).to_f32()),
        2 => {
            for blk in v.chunks_mut(128) {
                let mut q = vec![0u8; blk.len()];
                let s = fp8::quantize_block(blk, &mut q, ScaleRule::Ue8m0);
                fp8::dequantize_block(&q, s, blk);
            }
        }
        _ => {}
    }
}

#[test]
fn deepseek_rms_norm_inplace_bit_exact() {
    let e = emu();
    let kern: DsRmsInplaceFn = e.kernel("ds_rms_norm_inplace");
    let mut r = rng(14);
    let eps = 1e-6f32;
    // The latent rows of kv (r + dr values): the norm on the first r, the rope values
    // after them (and a little more stride) untouched.
    for (dim, dr) in [(512usize, 64usize), (100, 8)] {
        let (t, stride) = (3usize, dim + dr + 3);
        let x = randv(&mut r, t * stride, 3.0);
        let w = randv(&mut r, dim, 1.5);
        let mut got = x.clone();
        let (pg, pw) = (m(&mut got), c(&w));
        // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
        e.launch((t as u32, 1), 256, || unsafe {
            kern(pg.p(), stride as i32, pw.p(), dim as i32, eps)
        });
        for ti in 0..t {
            let xr = &x[ti * stride..ti * stride + dim];
            let (scale, cpu_scale) = rms_scales(xr, eps);
            for j in 0..stride {
                let g = got[ti * stride + j];
                if j >= dim {
                    assert_eq!(g.to_bits(), x[ti * stride + j].to_bits(), "wrote past dim");
                    continue;
                }
                // The documented order bit for bit; model.rs's rms_norm within 2 ulps.
                let exact = xr[j] * scale * w[j];
                assert_eq!(g.to_bits(), exact.to_bits(), "dim {dim} row {ti} [{j}]");
                let cpu = xr[j] * cpu_scale * w[j];
                assert!(
                    ulps(g, cpu) <= 2,
                    "dim {dim} row {ti} [{j}]: {g} vs CPU {cpu}"
                );
            }
        }
    }
}

#[test]
fn deepseek_rope_interleaved_bit_exact() {
    let e = emu();
    let kern: DsRopeInterleavedFn = e.kernel("ds_rope_interleaved");
    let mut r = rng(15);
    let pos = [0i32, 5, 4000, 17];
    let t = pos.len();
    let (dn, dr, rank) = (16usize, 80usize, 40usize); // 40 pairs over 32 threads
    let pairs = dr / 2;
    let (cos, sin) = rope_tables(&pos, pairs, 10000.0);
    // The host's two uses: each query head's last dr values (heads, head stride dn + dr,
    // offset dn; here with 3 spare columns per row), and the latent's rope values (one
    // "head" at offset r).
    for (heads, row_stride, head_stride, offset) in [
        (3usize, 3 * (dn + dr) + 3, dn + dr, dn),
        (1, rank + dr, 0, rank),
    ] {
        let x = randv(&mut r, t * row_stride, 2.0);
        let mut want = x.clone();
        for ti in 0..t {
            for h in 0..heads {
                let at = ti * row_stride + h * head_stride + offset;
                pdmesh_engine::deepseek::rope_interleaved(
                    &mut want[at..at + dr],
                    &cos[ti * pairs..(ti + 1) * pairs],
                    &sin[ti * pairs..(ti + 1) * pairs],
                );
            }
        }
        let mut got = x.clone();
        let (pg, pc, ps) = (m(&mut got), c(&cos), c(&sin));
        // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
        e.launch((t as u32, heads as u32), 32, || unsafe {
            kern(
                pg.p(),
                row_stride as i32,
                head_stride as i32,
                offset as i32,
                pc.p(),
                ps.p(),
                pairs as i32,
            )
        });
        // The tables are inputs: no transcendental in the kernel, so exact.
        assert_bits_eq(&format!("ds_rope_interleaved heads {heads}"), &got, &want);
    }
}

#[test]
fn deepseek_index_prep_bit_exact() {
    let e = emu();
    let kern: DsIndexPrepFn = e.kernel("ds_index_prep");
    let mut r = rng(16);
    let pos = [3i32, 0, 2500];
    let t = pos.len();
    let eps = 1e-6f32;
    // dim: less than the block, the real 128, the largest (1024); rope_dim/2 pairs each.
    for (dim, rope_dim) in [(64usize, 16usize), (128, 64), (1024, 64)] {
        let (cos, sin) = rope_tables(&pos, rope_dim / 2, 10000.0);
        let ln_w: Vec<f32> = randv(&mut r, dim, 0.5).iter().map(|v| 1.0 + v).collect();
        let ln_b = randv(&mut r, dim, 0.1);
        // The host's two uses: the index key (one vector, LayerNorm, no rounding) and the
        // index queries (several heads, no LayerNorm, rounded like the stored keys).
        for (vecs, has_ln, round) in [(1usize, 1i32, 0i32), (3, 0, 1), (3, 0, 2)] {
            let what = format!("dim {dim} rope {rope_dim} vecs {vecs} ln {has_ln} round {round}");
            // A row stride 5 past the vectors: those values must stay as they were.
            let row_stride = vecs * dim + 5;
            let x: Vec<f32> = randv(&mut r, t * row_stride, 2.0)
                .iter()
                .map(|v| v + 0.3)
                .collect();
            let mut want = x.clone();
            for ti in 0..t {
                let (cs, sn) = (
                    &cos[ti * rope_dim / 2..(ti + 1) * rope_dim / 2],
                    &sin[ti * rope_dim / 2..(ti + 1) * rope_dim / 2],
                );
                for v in 0..vecs {
                    let at = ti * row_stride + v * dim;
                    let xv = &mut want[at..at + dim];
                    if has_ln == 1 {
                        pdmesh_engine::deepseek::layer_norm(xv, &ln_w, &ln_b, eps);
                    }
                    pdmesh_engine::deepseek::rope_half(&mut xv[..rope_dim], cs, sn);
                    pdmesh_engine::deepseek::hadamard(xv);
                    round_like_index_k(xv, round);
                }
            }
            let mut got = x.clone();
            let (pg, pc, ps, pw, pb) = (m(&mut got), c(&cos), c(&sin), c(&ln_w), c(&ln_b));
            // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
            e.launch((t as u32, vecs as u32), 128, || unsafe {
                kern(
                    pg.p(),
                    row_stride as i32,
                    dim as i32,
                    rope_dim as i32,
                    pc.p(),
                    ps.p(),
                    has_ln,
                    pw.p(),
                    pb.p(),
                    eps,
                    round,
                )
            });
            // The CPU's operation order throughout (f64 LayerNorm statistics in index
            // order, the same butterflies, the same roundings): exact.
            assert_bits_eq(&what, &got, &want);
        }
    }
}

#[test]
fn deepseek_scale_and_moe_combine_bit_exact() {
    let e = emu();
    let mut r = rng(17);

    // ds_scale: the indexer weights times iscale; nothing past n.
    let scale: DsScaleFn = e.kernel("ds_scale");
    let (n, tail, sentinel) = (1000usize, 20usize, -4242.0f32);
    let mut x = randv(&mut r, n + tail, 5.0);
    x[n..].fill(sentinel);
    let s = 1.0 / (4f32.sqrt() * 128f32.sqrt());
    let mut want: Vec<f32> = x.iter().map(|v| v * s).collect();
    want[n..].fill(sentinel);
    let px = m(&mut x);
    // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
    e.launch((n.div_ceil(256) as u32, 1), 256, || unsafe {
        scale(px.p(), n as i32, s)
    });
    assert_bits_eq("ds_scale", &x, &want);

    // ds_moe_combine: each token's k expert outputs (rows of y, in the host's expert-major
    // order, so not the token's) weighted and summed in routing order, then added to the
    // shared expert's output.
    let combine: DsMoeCombineFn = e.kernel("ds_moe_combine");
    let (t, k, d) = (4usize, 3usize, 300usize);
    let total = t * k;
    let y = randv(&mut r, total * d, 2.0);
    let mut rows: Vec<i32> = (0..total as i32).collect();
    for i in (1..total).rev() {
        rows.swap(i, r.random_range(0..=i));
    }
    let wts: Vec<f32> = (0..total).map(|_| r.random_range(0.0f32..2.5)).collect();
    let out0 = randv(&mut r, t * d, 1.0);
    // deepseek/mod.rs `ffn` (private there): acc from 0, acc += w * y per route, then
    // add_in_place(out, acc).
    let mut want = out0.clone();
    for i in 0..t {
        let mut acc = vec![0f32; d];
        for s in 0..k {
            let (w, row) = (wts[i * k + s], rows[i * k + s] as usize);
            for (a, &yv) in acc.iter_mut().zip(&y[row * d..(row + 1) * d]) {
                *a += w * yv;
            }
        }
        for (o, a) in want[i * d..(i + 1) * d].iter_mut().zip(&acc) {
            *o += a;
        }
    }
    let mut out = out0.clone();
    let (po, py, pr, pw) = (m(&mut out), c(&y), c(&rows), c(&wts));
    // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
    e.launch((t as u32, 1), 256, || unsafe {
        combine(po.p(), py.p(), pr.p(), pw.p(), k as i32, d as i32)
    });
    assert_bits_eq("ds_moe_combine", &out, &want);
}

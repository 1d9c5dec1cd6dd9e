//! attention.cu: paged f16 attention against `attend`.

use std::sync::Arc;

use half::f16;
use pdmesh_kv::{DType, KvLayout, PagePool};

use crate::emu::{c, emu, m, randv, rng};

#[allow(clippy::type_complexity)]
#[rustfmt::skip]
type AttnFn = unsafe extern "C" fn(
    *const f32, i32, *mut f32, i32, *mut f32, i32, *const u8, *const i32, *const i32,
    *const i32, *const i32, i64, i64, i64, i32, i32, i32, i32, i32, f32,
);

#[test]
fn paged_attention_f16_matches_attend() {
    let e = emu();
    let kern: AttnFn = e.kernel("paged_attention_f16");
    let mut r = rng(9);
    let (layers, layer, kv_heads, hd, ps) = (2usize, 1usize, 2usize, 32usize, 4usize);
    let group_rep = 2usize; // query heads per KV head
    let q_heads = kv_heads * group_rep;
    let layout = Arc::new(KvLayout::llama(layers, kv_heads, hd, DType::F16, ps));
    let mut pool = PagePool::new(layout.clone(), 8);
    // Two sequences: 10 and 7 positions, over pages handed out out of order.
    let seq_len = [10usize, 7];
    let all = pool.alloc(6).unwrap();
    let pages: [Vec<u32>; 2] = [vec![all[4], all[1], all[2]], vec![all[5], all[0]]];
    let row = kv_heads * hd;
    let mut kv: Vec<[Vec<f32>; 2]> = Vec::new(); // per sequence: K rows, V rows
    for (s, &len) in seq_len.iter().enumerate() {
        let k = randv(&mut r, len * row, 1.0);
        let v = randv(&mut r, len * row, 1.0);
        for p in 0..len {
            let page = pages[s][p / ps];
            for (comp, src) in [(0usize, &k), (1, &v)] {
                let vals = pool.values_mut::<f16>(page, layer, comp);
                for d in 0..row {
                    vals[(p % ps) * row + d] = f16::from_f32(src[p * row + d]);
                }
            }
        }
        kv.push([k, v]);
    }
    // Tokens: (sequence, position), several per sequence, causal.
    let toks = [(0usize, 9usize), (1, 3), (0, 0), (1, 6), (0, 4)];
    let q_stride = q_heads * hd + 8;
    let out_stride = q_heads * hd + 4;
    let q = randv(&mut r, toks.len() * q_stride, 1.0);
    let seq_of: Vec<i32> = toks.iter().map(|t| t.0 as i32).collect();
    let pos: Vec<i32> = toks.iter().map(|t| t.1 as i32).collect();
    let table: Vec<i32> = pages.iter().flatten().map(|&p| p as i32).collect();
    let table_start = [0i32, pages[0].len() as i32];
    let scratch_stride = 16usize;
    let mut out = vec![0f32; toks.len() * out_stride];
    let mut scratch = vec![0f32; toks.len() * q_heads * scratch_stride];
    let scale = 1.0 / (hd as f32).sqrt();
    let bpp = layout.bytes_per_page() as i64;
    let k_off = layout.value_offset(layer, 0, 0) as i64;
    let v_off = layout.value_offset(layer, 1, 0) as i64;
    let arena = pool.arena();
    let (pq, po, psc, pa) = (c(&q), m(&mut out), m(&mut scratch), c(arena));
    let (pso, ppos, pt, pts) = (c(&seq_of), c(&pos), c(&table), c(&table_start));
    // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
    e.launch((toks.len() as u32, q_heads as u32), 128, || unsafe {
        kern(
            pq.p(),
            q_stride as i32,
            po.p(),
            out_stride as i32,
            psc.p(),
            scratch_stride as i32,
            pa.p(),
            pso.p(),
            ppos.p(),
            pt.p(),
            pts.p(),
            bpp,
            k_off,
            v_off,
            row as i32,
            hd as i32,
            group_rep as i32,
            0,
            ps as i32,
            scale,
        )
    });
    for (ti, &(s, p)) in toks.iter().enumerate() {
        let n = p + 1;
        for g in 0..kv_heads {
            let rows16 = |src: &Vec<f32>| -> Vec<Vec<f16>> {
                (0..n)
                    .map(|j| {
                        src[j * row + g * hd..j * row + (g + 1) * hd]
                            .iter()
                            .map(|&x| f16::from_f32(x))
                            .collect()
                    })
                    .collect()
            };
            let kr = rows16(&kv[s][0]);
            let vr = rows16(&kv[s][1]);
            let keys: Vec<&[f16]> = kr.iter().map(|v| &v[..]).collect();
            let vals: Vec<&[f16]> = vr.iter().map(|v| &v[..]).collect();
            let qg =
                &q[ti * q_stride + g * group_rep * hd..ti * q_stride + (g + 1) * group_rep * hd];
            let mut want = vec![0f32; group_rep * hd];
            pdmesh_kernels::attend(qg, hd, &keys, &vals, scale, &mut want);
            let got = &out
                [ti * out_stride + g * group_rep * hd..ti * out_stride + (g + 1) * group_rep * hd];
            for (d, (a, b)) in got.iter().zip(&want).enumerate() {
                // expf (host libm here, CUDA's on a GPU) and the order of the f64 sum may
                // move a probability by an f16 ulp: 2e-3 relative to the output's scale.
                assert!(
                    (a - b).abs() <= 2e-3 * (1.0 + b.abs()),
                    "token {ti} kv head {g} [{d}]: {a} vs attend {b}"
                );
            }
        }
    }
}

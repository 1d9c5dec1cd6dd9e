//! A token's MLA cache entry in the page pool: its latent and rope key (bf16, or fp8 with
//! per-128 scales) and its index key, written once and read by every later query.

use half::bf16;
use pdmesh_kv::fp8::{self, ScaleRule};
use pdmesh_kv::{IndexKDtype, KvLayout, MlaCacheDtype, PageId, PagePool};

/// Cache components of one layout, by role.
#[derive(Clone, Copy, Debug)]
pub(super) struct CacheComps {
    mla: MlaCacheDtype,
    /// `mla_latent` (bf16) or `mla_nope` (fp8).
    latent: usize,
    /// `mla_rope` (fp8 form only).
    rope: Option<usize>,
    index_k: usize,
    pub(super) index_dtype: IndexKDtype,
}

impl CacheComps {
    pub(super) fn of(layout: &KvLayout) -> Self {
        let c = |n: &str| layout.component_index(n);
        let (mla, latent, rope) = match c("mla_latent") {
            Some(i) => (MlaCacheDtype::Bf16, i, None),
            None => (
                MlaCacheDtype::Fp8,
                c("mla_nope").expect("a DeepSeek layout has mla_nope or mla_latent"),
                c("mla_rope"),
            ),
        };
        let index_k = c("index_k").expect("a DeepSeek layout has index_k");
        let index_dtype = match layout.components()[index_k].dtype {
            pdmesh_kv::DType::Bf16 => IndexKDtype::Bf16,
            _ => IndexKDtype::Fp8,
        };
        Self {
            mla,
            latent,
            rope,
            index_k,
            index_dtype,
        }
    }
}

/// Rounds an index query as the keys are stored: through fp8 (one ue8m0 scale per 128
/// values) or bf16.
pub(super) fn round_like_index_k(v: &mut [f32], dtype: IndexKDtype) {
    match dtype {
        IndexKDtype::Bf16 => v.iter_mut().for_each(|x| *x = bf16::from_f32(*x).to_f32()),
        IndexKDtype::Fp8 => {
            let mut q = vec![0u8; v.len()];
            for (blk, qb) in v.chunks_mut(128).zip(q.chunks_mut(128)) {
                let s = fp8::quantize_block(blk, qb, ScaleRule::Ue8m0);
                fp8::dequantize_block(qb, s, blk);
            }
        }
    }
}

/// Writes one token's latent (`r` values then the rope key) and index key at `slot`.
#[allow(clippy::too_many_arguments)]
pub(super) fn write_entry(
    pool: &mut PagePool,
    comps: CacheComps,
    page: PageId,
    layer: usize,
    slot: usize,
    latent: &[f32],
    r: usize,
    index_k: &[f32],
) {
    let layout = pool.layout().clone();
    let bytes = pool.page_mut(page).expect("the sequence holds its pages");
    let put_bf16 = |bytes: &mut [u8], at: usize, v: &[f32]| {
        for (j, x) in v.iter().enumerate() {
            bytes[at + 2 * j..at + 2 * j + 2].copy_from_slice(&bf16::from_f32(*x).to_le_bytes());
        }
    };
    let put_fp8 = |bytes: &mut [u8], comp: usize, v: &[f32]| {
        let at = layout.value_offset(layer, comp, slot);
        let sat = layout
            .scale_offset(layer, comp, slot)
            .expect("fp8 has scales");
        for (b, blk) in v.chunks(128).enumerate() {
            let s = fp8::quantize_block(
                blk,
                &mut bytes[at + b * 128..at + b * 128 + blk.len()],
                ScaleRule::Ue8m0,
            );
            bytes[sat + 4 * b..sat + 4 * b + 4].copy_from_slice(&s.to_le_bytes());
        }
    };
    match comps.mla {
        MlaCacheDtype::Bf16 => put_bf16(
            bytes,
            layout.value_offset(layer, comps.latent, slot),
            latent,
        ),
        MlaCacheDtype::Fp8 => {
            put_fp8(bytes, comps.latent, &latent[..r]);
            let rope = comps.rope.expect("the fp8 form has mla_rope");
            put_bf16(bytes, layout.value_offset(layer, rope, slot), &latent[r..]);
        }
    }
    match comps.index_dtype {
        IndexKDtype::Bf16 => put_bf16(
            bytes,
            layout.value_offset(layer, comps.index_k, slot),
            index_k,
        ),
        IndexKDtype::Fp8 => put_fp8(bytes, comps.index_k, index_k),
    }
}

fn get_bf16(bytes: &[u8], at: usize, out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = bf16::from_le_bytes([bytes[at + 2 * j], bytes[at + 2 * j + 1]]).to_f32();
    }
}

fn get_fp8(
    bytes: &[u8],
    layout: &KvLayout,
    layer: usize,
    comp: usize,
    slot: usize,
    out: &mut [f32],
) {
    let at = layout.value_offset(layer, comp, slot);
    let sat = layout
        .scale_offset(layer, comp, slot)
        .expect("fp8 has scales");
    for (b, blk) in out.chunks_mut(128).enumerate() {
        let s = f32::from_le_bytes(
            bytes[sat + 4 * b..sat + 4 * b + 4]
                .try_into()
                .expect("4 bytes"),
        );
        fp8::dequantize_block(&bytes[at + b * 128..at + b * 128 + blk.len()], s, blk);
    }
}

pub(super) fn read_latent(
    pool: &PagePool,
    comps: CacheComps,
    page: PageId,
    layer: usize,
    slot: usize,
    r: usize,
    out: &mut [f32],
) {
    let layout = pool.layout();
    let bytes = pool.page(page).expect("the sequence holds its pages");
    let bytes: &[u8] = &bytes;
    match comps.mla {
        MlaCacheDtype::Bf16 => get_bf16(bytes, layout.value_offset(layer, comps.latent, slot), out),
        MlaCacheDtype::Fp8 => {
            get_fp8(bytes, layout, layer, comps.latent, slot, &mut out[..r]);
            let rope = comps.rope.expect("the fp8 form has mla_rope");
            get_bf16(bytes, layout.value_offset(layer, rope, slot), &mut out[r..]);
        }
    }
}

pub(super) fn read_index_k(
    pool: &PagePool,
    comps: CacheComps,
    page: PageId,
    layer: usize,
    slot: usize,
    out: &mut [f32],
) {
    let layout = pool.layout();
    let bytes = pool.page(page).expect("the sequence holds its pages");
    let bytes: &[u8] = &bytes;
    match comps.index_dtype {
        IndexKDtype::Bf16 => get_bf16(bytes, layout.value_offset(layer, comps.index_k, slot), out),
        IndexKDtype::Fp8 => get_fp8(bytes, layout, layer, comps.index_k, slot, out),
    }
}

//! Faults injected on purpose, for tests that prove the mesh's checksums and the
//! differential check catch the corruption they exist for. The worker calls them only
//! when started with its hidden, test-only `--fault-*` flags (its `faults` module),
//! which it announces loudly.

use crate::{Component, DType, KvLayout};

/// The layout the seed's host buffer was sized with: `layout` with its bf16 index-K
/// counted as fp8 index-K (132 B per token, values and scales, instead of 256). `None`
/// for a layout without a bf16 `index_k`.
pub fn fp8_sized_index_k(layout: &KvLayout) -> Option<KvLayout> {
    let k = layout.component_index("index_k")?;
    let comp = &layout.components()[k];
    if comp.dtype != DType::Bf16 {
        return None;
    }
    let mut components = layout.components().to_vec();
    components[k] = Component::fp8_index_k(comp.elems_per_token);
    let name = format!("{} (index-K sized as fp8)", layout.name());
    KvLayout::new(&name, layout.layers(), layout.page_size(), components).ok()
}

/// The seed's bug: a page whose bf16 index-K went through a buffer sized for the fp8
/// index-K layout ([`fp8_sized_index_k`]: 132 B per token instead of 256). Of each
/// layer's index-K region only the bytes an fp8-sized buffer holds survive; the rest is
/// lost (zeroed). Pages of a layout without a bf16 `index_k` are left alone. Returns
/// whether the page changed shape.
pub fn truncate_bf16_index_k_like_fp8(layout: &KvLayout, page: &mut [u8]) -> bool {
    let Some(sized) = fp8_sized_index_k(layout) else {
        return false;
    };
    let k = layout.component_index("index_k").expect("checked above");
    let keep = sized.component_bytes_per_page(k);
    let len = layout.component_bytes_per_page(k);
    for layer in 0..layout.layers() {
        let at = layout.region_offset(layer, k);
        page[at + keep..at + len].fill(0);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IndexKDtype, MlaCacheDtype, MlaDims};

    #[test]
    fn only_the_fp8_sized_head_of_each_bf16_index_k_region_survives() {
        let form =
            |ik| KvLayout::deepseek_v32(2, MlaDims::V32, MlaCacheDtype::Bf16, ik, 4).unwrap();
        let bf16 = form(IndexKDtype::Bf16);
        let mut page = vec![7u8; bf16.bytes_per_page()];
        assert!(truncate_bf16_index_k_like_fp8(&bf16, &mut page));
        let k = bf16.component_index("index_k").unwrap();
        for layer in 0..2 {
            let at = bf16.region_offset(layer, k);
            // 4 tokens x 256 B of bf16 keys; an fp8 buffer holds 4 x 132.
            assert!(page[at..at + 4 * 132].iter().all(|&b| b == 7));
            assert!(page[at + 4 * 132..at + 4 * 256].iter().all(|&b| b == 0));
            // The latent before it is untouched.
            assert!(
                page[bf16.region_offset(layer, 0)..at]
                    .iter()
                    .all(|&b| b == 7)
            );
        }
        // The buffer's layout is the fp8 form's, byte for byte (only the name differs).
        let sized = fp8_sized_index_k(&bf16).unwrap();
        let fp8 = form(IndexKDtype::Fp8);
        assert_eq!(sized.fingerprint(), fp8.fingerprint());
        assert_eq!(sized.components()[k].bytes_per_token(), 132);
        assert!(fp8_sized_index_k(&fp8).is_none());
        let mut page = vec![7u8; fp8.bytes_per_page()];
        assert!(!truncate_bf16_index_k_like_fp8(&fp8, &mut page));
        assert!(page.iter().all(|&b| b == 7));
    }
}

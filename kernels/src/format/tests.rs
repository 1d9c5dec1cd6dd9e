//! A rewritten matrix holds exactly the original's values.

use pdmesh_ggml::{GgmlType, dequantize};

use super::WeightFormat;
use crate::testdata::k_blocks;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn rewritten_k_quants_dequantize_to_the_original_values() {
    for (ty, to) in [
        (GgmlType::Q4K, WeightFormat::Q4K32),
        (GgmlType::Q6K, WeightFormat::Q6K32),
    ] {
        let n = 40;
        let src = k_blocks(ty, n, 3);
        let (format, bytes) = WeightFormat::rewrite(ty, &src).expect("a K-quant is rewritten");
        assert_eq!(format, to);
        assert_eq!(bytes.len(), format.row_bytes(256 * n));
        let (mut want, mut got) = (vec![0f32; 256 * n], vec![0f32; 256 * n]);
        dequantize(ty, &src, &mut want);
        format.dequantize(&bytes, &mut got);
        assert_eq!(bits(&got), bits(&want), "{ty:?}");
        // The extremes of both ends were met (the blocks of all-low and all-high values).
        let (lo, hi) = match ty {
            GgmlType::Q4K => (0u8, 15u8),
            _ => (-32i8 as u8, 31),
        };
        let values = |b: &[u8]| -> Vec<u8> {
            match format {
                WeightFormat::Q4K32 => b[8..24].iter().flat_map(|&v| [v & 0xF, v >> 4]).collect(),
                _ => b[8..40].to_vec(),
            }
        };
        let all: Vec<u8> = bytes
            .chunks_exact(format.block_bytes())
            .flat_map(values)
            .collect();
        assert!(all.contains(&lo) && all.contains(&hi), "{ty:?}");
    }
}

#[test]
fn q5_0_becomes_q8_0_and_other_types_stay() {
    let q5 = vec![0u8; 22 * 4];
    let (format, bytes) = WeightFormat::rewrite(GgmlType::Q5_0, &q5).unwrap();
    assert_eq!(format, WeightFormat::Ggml(GgmlType::Q8_0));
    assert_eq!(bytes.len(), 34 * 4);
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q4_1,
        GgmlType::Q4_0,
        GgmlType::F16,
    ] {
        assert!(WeightFormat::rewrite(ty, &[]).is_none(), "{ty:?}");
    }
}

//! Bytes of KV per token for each DeepSeek V3.2 cache form, from the layout type itself.
//!
//! `cargo run --release -p pdmesh-kv --example kv_layouts`

use pdmesh_kv::{DType, IndexKDtype, KvLayout, MlaCacheDtype, MlaDims};

fn main() {
    println!(
        "{:<50} {:>10} {:>12} {:>14} {:>12}",
        "layout (DeepSeek: 61 layers, 64-token pages)",
        "B/tok/lay",
        "B/token",
        "B/page",
        "GiB/128k tok"
    );
    for mla in [MlaCacheDtype::Bf16, MlaCacheDtype::Fp8] {
        for ik in [IndexKDtype::Fp8, IndexKDtype::Bf16] {
            let l = KvLayout::deepseek_v32(61, MlaDims::V32, mla, ik, 64).expect("valid layout");
            println!(
                "{:<50} {:>10} {:>12} {:>14} {:>12.2}",
                l.name(),
                l.bytes_per_token_per_layer(),
                l.bytes_per_token(),
                l.bytes_per_page(),
                (l.bytes_per_token() * 131_072) as f64 / (1u64 << 30) as f64
            );
        }
    }
    let smol = KvLayout::llama(30, 3, 64, DType::F16, 16);
    println!(
        "{:<50} {:>10} {:>12} {:>14} {:>12.2}",
        "smollm2-135m f16 K+V (30 layers, 16-token pages)",
        smol.bytes_per_token_per_layer(),
        smol.bytes_per_token(),
        smol.bytes_per_page(),
        (smol.bytes_per_token() * 131_072) as f64 / (1u64 << 30) as f64
    );
}

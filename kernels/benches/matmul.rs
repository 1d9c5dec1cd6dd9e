//! Throughput of the quantized matmul at the SmolLM2 FFN shape, 1 to 64 tokens and a 512-token prefill chunk.

use criterion::{Criterion, criterion_group, criterion_main};
use pdmesh_ggml::GgmlType;
use pdmesh_kernels::{QMatrix, matmul};

fn bench(c: &mut Criterion) {
    let (rows, cols) = (1536, 576);
    let data: Vec<u8> = (0..GgmlType::Q4_1.row_bytes(cols) * rows)
        .map(|i| (i * 31 % 251) as u8 & 0x3f)
        .collect();
    let w = QMatrix::new(GgmlType::Q4_1, &data, rows, cols);
    let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
    for t in [1usize, 16, 32, 64, 512] {
        let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.01).sin()).collect();
        let mut out = vec![0f32; t * rows];
        c.bench_function(&format!("q4_1 matmul 1536x576, {t} tokens"), |b| {
            b.iter(|| matmul(&pool, &w, &x, t, &mut out))
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);

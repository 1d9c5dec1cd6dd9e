//! What every kernel's tests share: the device, copies to and from it, seeded inputs and
//! exact comparisons.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use pdmesh_engine::cuda::device::{Gpu, KernelBuild, grid};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Device 0, or `PDMESH_TEST_GPU`, with every kernel compiled.
pub(crate) fn gpu() -> Gpu {
    let ordinal = match std::env::var("PDMESH_TEST_GPU") {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("PDMESH_TEST_GPU={v:?} is not a device ordinal")),
        _ => 0,
    };
    Gpu::open(ordinal, &KernelBuild::default())
        .unwrap_or_else(|e| panic!("opening GPU {ordinal}: {e}"))
}

pub(crate) fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

pub(crate) fn up<T: DeviceRepr>(s: &Arc<CudaStream>, v: &[T]) -> CudaSlice<T> {
    s.clone_htod(v).expect("host to device copy")
}

/// The buffer's contents; also where a failed launch surfaces.
pub(crate) fn down<T: DeviceRepr>(s: &Arc<CudaStream>, b: &CudaSlice<T>) -> Vec<T> {
    s.clone_dtoh(b)
        .expect("device to host copy (or an earlier launch failed)")
}

pub(crate) fn uniform(r: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(lo..hi)).collect()
}

/// Exact equality of two f32 slices, bit for bit; names the first difference.
pub(crate) fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: not bit-exact at {i}: GPU {} ({:#010x}), CPU {} ({:#010x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

pub(crate) fn assert_bytes_eq(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: bytes differ at {i}: GPU {:#04x}, expected {:#04x}",
            got[i], want[i]
        );
    }
}

/// A 1-D launch: grid ceil(n / 256), block 256.
pub(crate) fn grid_1d(n: usize) -> cudarc::driver::LaunchConfig {
    grid((n.div_ceil(256) as u32, 1, 1), 256)
}

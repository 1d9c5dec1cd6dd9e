//! pdmesh-kernels: the CPU compute kernels. Every floating-point reduction here has a
//! fixed order that depends only on the row and the token, never on how many tokens are in
//! the batch or which thread runs it: that is what makes outputs bit-identical across
//! batch sizes and prefill chunkings.
//!
//! Architecture Invariant: only this crate contains `unsafe` SIMD code; it is reached
//! through safe functions that pick the implementation once per process.
//!
//! The GPU kernels live here too, as CUDA C sources (`kernels/cuda`, listed by
//! [`cuda_src`]) under the same rule of fixed reduction orders; the `nvrtc` feature
//! compiles them to PTX at run time (the `nvrtc` module).

pub mod cuda_src;
#[cfg(feature = "nvrtc")]
pub mod nvrtc;

mod attention;
mod dot;
mod format;
mod gemm;
mod matmul;
mod quant;
#[cfg(test)]
mod testdata;

pub use attention::{Tile, attend, attend_causal, attend_window, exp_f32};
pub use format::WeightFormat;
pub use matmul::{
    Glu, QMatrix, gelu_tanh_times, matmul, matmul_glu, matmul_many, matmul_swiglu, silu_times,
};
pub use quant::{QActs, quantize_q8_0, quantize_q8_1};

/// Which kernel family runs on this machine, decided once per process from the CPU's
/// features; `PDMESH_KERNELS=avx2` or `=scalar` forces a lesser one (for comparisons).
pub fn simd_level() -> &'static str {
    if dot::has_vnni() {
        "avx512vnni"
    } else if dot::has_avx2() {
        "avx2+fma"
    } else {
        "scalar"
    }
}

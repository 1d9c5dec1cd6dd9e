//! CPU compute kernels: quantized dot products, f16 attention, SIMD behind safe APIs.

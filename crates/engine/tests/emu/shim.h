// CPU emulation of the CUDA built-ins the kernels in kernels/cuda/ use, so that the kernel
// sources compile as host C++ and run on a machine without a GPU (see
// crates/engine/tests/kernels_emulated/emu.rs, which prepends this header to each source).
//
// What this checks: the kernels' LOGIC — indexing, launch geometry, reduction orders,
// rounding, barriers placed where data is shared — against the Rust CPU code. It is not a
// model of GPU behaviour:
//   - One OS thread per CUDA thread; the blocks of a grid run one after another (so
//     `__shared__` is a function-local static, one copy, reused by each block in turn).
//   - `__syncthreads()` is a real barrier over the block's threads; a thread that returns
//     drops out of it (as exited threads do on current GPUs).
//   - Warps are not lock-step: threads run freely between barriers, so a kernel that
//     relies on implicit warp synchronity (no __syncwarp / barrier) can pass here and fail
//     on a GPU, or the reverse. `__shfl_xor_sync` is emulated with a per-warp barrier and
//     a buffer; it assumes the whole warp takes part (the mask is ignored) — a divergent
//     shuffle would deadlock here rather than give undefined values.
//   - Memory model: host memory with C++ (x86: strong) ordering; no caches, no weak
//     ordering, no bank conflicts, no coalescing, no out-of-bounds trap.
//   - Arithmetic: the `_rn` intrinsics are plain IEEE f32/f64 operations (the build uses
//     -ffp-contract=off, no -ffast-math), which is what they are on a GPU too. expf, cosf,
//     sinf etc. are the HOST libm's, which may differ from CUDA's by an ulp or so: tests
//     compare results that go through them with a tolerance.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

struct pd_emu_dim3 {
    unsigned x, y, z;
};
// Set per thread by the launcher (launch.cpp).
extern thread_local pd_emu_dim3 threadIdx, blockIdx;
extern pd_emu_dim3 blockDim, gridDim;

struct uint4 {
    unsigned x, y, z, w;
};

#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
// A function-local static: one copy shared by the threads of the running block.
#define __shared__ static

extern "C" void pd_emu_syncthreads(void);
extern "C" float pd_emu_shfl_xor_f32(float v, int lane_mask);
#define __syncthreads() pd_emu_syncthreads()
static inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    return pd_emu_shfl_xor_f32(v, lane_mask);
}

static inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}

static inline unsigned __float_as_uint(float x) {
    unsigned u;
    memcpy(&u, &x, 4);
    return u;
}
static inline float __uint_as_float(unsigned u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __dsqrt_rn(double a) { return sqrt(a); }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}

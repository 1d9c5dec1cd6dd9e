// Shared by every kernel source: src/cuda_src.rs prepends this text to each .cu file
// before NVRTC compiles it. NVRTC runs with no include path, so nothing is #included:
// half-precision and fp8 conversions are done here, on the bits.
//
// Determinism rules every kernel follows:
//   - a float reduction has one fixed order (per-thread strided loops in index order, then
//     a fixed shared-memory tree or xor-shuffle tree); no floating-point atomics;
//   - a row's or token's result depends only on that row's or token's inputs, never on
//     how many rows or tokens the launch holds (batch invariance);
//   - where a kernel mirrors a CPU function, products and sums use the _rn intrinsics
//     (never contracted into an FMA), as Rust computes them; NVRTC also gets --fmad=false.
//
// The helpers are `__device__` functions of plain C arithmetic, so the same text also
// compiles as host C++ (with __device__ etc. defined away) for checking against the Rust
// implementations on a CPU.

// The helpers below are static; a source that leaves some unused is not warned about it.
#ifdef __CUDACC_RTC__
#pragma nv_diag_suppress 177
#endif

typedef unsigned char pd_u8;
typedef unsigned short pd_u16;
typedef unsigned int pd_u32;
typedef unsigned long long pd_u64;
typedef long long pd_i64;

#define PD_DEV static __device__ __forceinline__
#define PD_WARP 32
#define PD_FULL_MASK 0xffffffffu

PD_DEV pd_u32 pd_f32_bits(float x) { return __float_as_uint(x); }
PD_DEV float pd_bits_f32(pd_u32 b) { return __uint_as_float(b); }
PD_DEV bool pd_is_nan(float x) { return (pd_f32_bits(x) & 0x7fffffffu) > 0x7f800000u; }

// 2^e for -126 <= e <= 127 exactly; +inf above (as Rust's 2f32.powi(e) overflows).
PD_DEV float pd_exp2i(int e) {
    if (e > 127) return pd_bits_f32(0x7f800000u);
    return pd_bits_f32((pd_u32)(e + 127) << 23);
}

// f32 -> IEEE binary16 bits, round to nearest, ties to even; NaN keeps its top payload
// bits and becomes quiet. Bit-exact with the `half` crate's f16::from_f32 (its software
// path, and x86 F16C, which it uses when present).
PD_DEV pd_u16 pd_f32_to_f16_bits(float value) {
    pd_u32 x = pd_f32_bits(value);
    pd_u32 sign = x & 0x80000000u;
    pd_u32 exp = x & 0x7f800000u;
    pd_u32 man = x & 0x007fffffu;
    if (exp == 0x7f800000u) {
        pd_u32 nan_bit = man == 0 ? 0u : 0x0200u;
        return (pd_u16)((sign >> 16) | 0x7c00u | nan_bit | (man >> 13));
    }
    pd_u32 half_sign = sign >> 16;
    int half_exp = (int)(exp >> 23) - 127 + 15;
    if (half_exp >= 0x1f) return (pd_u16)(half_sign | 0x7c00u);
    if (half_exp <= 0) {
        if (14 - half_exp > 24) return (pd_u16)half_sign;
        pd_u32 m = man | 0x00800000u;
        pd_u32 half_man = m >> (14 - half_exp);
        pd_u32 round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0 && (m & (3u * round_bit - 1u)) != 0) half_man += 1;
        return (pd_u16)(half_sign | half_man);
    }
    pd_u32 he = (pd_u32)half_exp << 10;
    pd_u32 half_man = man >> 13;
    pd_u32 round_bit = 0x00001000u;
    if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0)
        return (pd_u16)((half_sign | he | half_man) + 1u);
    return (pd_u16)(half_sign | he | half_man);
}

// binary16 bits -> f32, exactly (subnormals included; NaN payload kept).
PD_DEV float pd_f16_bits_to_f32(pd_u16 h) {
    pd_u32 sign = ((pd_u32)h & 0x8000u) << 16;
    pd_u32 exp = ((pd_u32)h >> 10) & 0x1fu;
    pd_u32 man = (pd_u32)h & 0x3ffu;
    if (exp == 0x1f) return pd_bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return pd_bits_f32(sign);
        // A subnormal: man * 2^-24, exact in f32.
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return pd_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

// x rounded through f16 and back, as `f16::from_f32(x).to_f32()`.
PD_DEV float pd_round_f16(float x) { return pd_f16_bits_to_f32(pd_f32_to_f16_bits(x)); }

// bf16 bits -> f32 (exact) and f32 -> bf16 bits as the `half` crate rounds (nearest,
// ties to even; NaN made quiet).
PD_DEV float pd_bf16_bits_to_f32(pd_u16 b) { return pd_bits_f32((pd_u32)b << 16); }
PD_DEV pd_u16 pd_f32_to_bf16_bits(float value) {
    pd_u32 x = pd_f32_bits(value);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (pd_u16)((x >> 16) | 0x0040u);
    pd_u32 round_bit = 0x00008000u;
    if ((x & round_bit) != 0 && (x & (3u * round_bit - 1u)) != 0) return (pd_u16)((x >> 16) + 1u);
    return (pd_u16)(x >> 16);
}

// The f32 dot product of crates/engine/src/deepseek.rs `dot`: eight running lanes over the
// whole chunks of eight (lane l takes elements c + l, a multiply then an add), the lanes
// summed pairwise, then the tail added in order.
PD_DEV float pd_dot8(const float* a, const float* b, int n) {
    float l[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int n8 = n / 8 * 8;
    for (int c = 0; c < n8; c += 8)
        for (int i = 0; i < 8; i++) l[i] = __fadd_rn(l[i], __fmul_rn(a[c + i], b[c + i]));
    float s = __fadd_rn(__fadd_rn(__fadd_rn(l[0], l[1]), __fadd_rn(l[2], l[3])),
                        __fadd_rn(__fadd_rn(l[4], l[5]), __fadd_rn(l[6], l[7])));
    for (int i = n8; i < n; i++) s = __fadd_rn(s, __fmul_rn(a[i], b[i]));
    return s;
}

// Block-wide reductions over a shared array of exactly `n` (a power of two) slots, one per
// thread, in a fixed tree: slot t takes slot t + s for s = n/2, n/4, ..., 1. Every thread
// of the block must call them (they synchronize); the result is in buf[0] on return.
PD_DEV void pd_tree_sum_f64(double* buf, int n) {
    __syncthreads();
    for (int s = n / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) buf[threadIdx.x] = buf[threadIdx.x] + buf[threadIdx.x + s];
        __syncthreads();
    }
}
// fmaxf ignores NaN (as Rust's f32::max does), and max is exact, so any fixed order works.
PD_DEV void pd_tree_max_f32(float* buf, int n) {
    __syncthreads();
    for (int s = n / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) buf[threadIdx.x] = fmaxf(buf[threadIdx.x], buf[threadIdx.x + s]);
        __syncthreads();
    }
}

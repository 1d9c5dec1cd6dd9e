// FP8 E4M3 block quantization, bit-exact with crates/kv/src/fp8.rs.

#define PD_FP8_BLOCK 128
#define PD_E4M3_MAX 448.0f
#define PD_AMAX_FLOOR 1e-4f

// f32_to_e4m3: the E4M3 (e4m3fn) byte nearest to x, ties to even, saturating at +-448,
// NaN -> 0x7F | sign.
PD_DEV pd_u8 pd_f32_to_e4m3(float x) {
    pd_u32 bits = pd_f32_bits(x);
    pd_u8 sign = (bits >> 31) ? 0x80 : 0;
    float a = pd_bits_f32(bits & 0x7fffffffu);
    if (pd_is_nan(a)) return sign | 0x7F;
    if (a >= PD_E4M3_MAX) return sign | 0x7E;
    // Below the smallest normal (2^-6) the step is 2^-9 and the code is the step count.
    if (a < 0.015625f) return sign | (pd_u8)rintf(__fmul_rn(a, 512.0f));
    int e = (int)((pd_f32_bits(a) >> 23) & 0xFF) - 127;
    pd_u32 q = (pd_u32)rintf(__fmul_rn(__fsub_rn(__fdiv_rn(a, pd_exp2i(e)), 1.0f), 8.0f));
    if (q == 8) {
        e += 1;
        q = 0;
    }
    pd_u32 code = ((pd_u32)(e + 7) << 3) | q;
    if (code > 0x7E) code = 0x7E;
    return sign | (pd_u8)code;
}

// e4m3_value: the value of an E4M3 byte (exact; 0x7F and 0xFF are NaN).
PD_DEV float pd_e4m3_to_f32(pd_u8 b) {
    float sign = (b & 0x80) ? -1.0f : 1.0f;
    int e = (b >> 3) & 0x0F;
    float m = (float)(b & 0x07);
    if (e == 0x0F && (b & 0x07) == 0x07) return pd_bits_f32(0x7fc00000u);
    if (e == 0) return __fmul_rn(__fmul_rn(sign, m), pd_exp2i(-9));
    return __fmul_rn(__fmul_rn(sign, __fadd_rn(1.0f, __fdiv_rn(m, 8.0f))), pd_exp2i(e - 7));
}

// ue8m0_exponent: ceil(log2(s)) from the bits of a positive s.
PD_DEV int pd_ue8m0_exponent(float s) {
    pd_u32 bits = pd_f32_bits(s);
    int e = (int)((bits >> 23) & 0xFF) - 127;
    return (bits & 0x7FFFFF) == 0 ? e : e + 1;
}

// block_scale: max(amax, 1e-4) / 448, or with ue8m0 that rounded up to a power of two.
PD_DEV float pd_block_scale(float amax, int ue8m0) {
    float s = __fdiv_rn(fmaxf(amax, PD_AMAX_FLOOR), PD_E4M3_MAX);
    return ue8m0 ? pd_exp2i(pd_ue8m0_exponent(s)) : s;
}

// fp8_quantize_blocks — grid.x = n_blocks, block 128 (exactly: the max tree has 128 slots).
// quantize_block for block b: the `block` values at x + b*block; amax = the largest |v|
// (NaN ignored; max is exact, so the tree order cannot change it); scale = block_scale;
// q[b*block + j] = f32_to_e4m3(v_j * (1 / scale)); scales[b] = scale. `ue8m0` nonzero
// selects ScaleRule::Ue8m0, zero ScaleRule::Exact.
extern "C" __global__ void __launch_bounds__(PD_FP8_BLOCK)
fp8_quantize_blocks(const float* x, unsigned char* q, float* scales, int n_blocks, int block,
                    int ue8m0) {
    __shared__ float buf[PD_FP8_BLOCK];
    int b = blockIdx.x;
    int tid = threadIdx.x;
    if (b >= n_blocks) return;  // uniform over the block
    const float* xb = x + (pd_i64)b * block;
    pd_u8* qb = q + (pd_i64)b * block;
    float amax = 0.0f;
    for (int j = tid; j < block; j += PD_FP8_BLOCK) amax = fmaxf(amax, fabsf(xb[j]));
    buf[tid] = amax;
    pd_tree_max_f32(buf, PD_FP8_BLOCK);
    float scale = pd_block_scale(buf[0], ue8m0);
    float inv = __fdiv_rn(1.0f, scale);
    for (int j = tid; j < block; j += PD_FP8_BLOCK) qb[j] = pd_f32_to_e4m3(__fmul_rn(xb[j], inv));
    if (tid == 0) scales[b] = scale;
}

// fp8_dequantize_blocks — grid.x = n_blocks, block 128.
// dequantize_block: out[b*block + j] = e4m3_value(q[b*block + j]) * scales[b].
extern "C" __global__ void fp8_dequantize_blocks(const unsigned char* q, const float* scales,
                                                 float* out, int n_blocks, int block) {
    int b = blockIdx.x;
    if (b >= n_blocks) return;
    float s = scales[b];
    const pd_u8* qb = q + (pd_i64)b * block;
    float* ob = out + (pd_i64)b * block;
    for (int j = threadIdx.x; j < block; j += blockDim.x) ob[j] = __fmul_rn(pd_e4m3_to_f32(qb[j]), s);
}

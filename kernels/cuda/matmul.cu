// The batch-invariant matrix product and the elementwise ops around it.

#define PD_MM_WARPS 8

// matmul_rows — grid.x = ceil(rows / 8), grid.y = tokens, block 256 (8 warps, one output
// row per warp).
// out[t*out_stride + out_col0 + r] = sum_k w[r*cols + k] * x[t*cols + k]: lane l
// accumulates k = l, l+32, ... in order with one fused multiply-add each, then the 32
// lane sums meet in a fixed xor-shuffle tree (a + b == b + a exactly, so every lane holds
// the same bits). The result for (t, r) depends only on row r and token t, never on how
// many rows or tokens the launch covers. (The CPU path, crates/engine's matmul over
// quantized weights, has its own order; this kernel is the GPU's reference order.)
extern "C" __global__ void __launch_bounds__(PD_MM_WARPS * PD_WARP)
matmul_rows(const float* w, const float* x, float* out, int rows, int cols, int out_stride,
            int out_col0) {
    int warp = threadIdx.x / PD_WARP;
    int lane = threadIdx.x % PD_WARP;
    int r = blockIdx.x * PD_MM_WARPS + warp;
    int t = blockIdx.y;
    float acc = 0.0f;
    if (r < rows) {
        const float* wr = w + (pd_i64)r * cols;
        const float* xt = x + (pd_i64)t * cols;
        for (int k = lane; k < cols; k += PD_WARP) acc = __fmaf_rn(wr[k], xt[k], acc);
    }
    // Every lane of the warp takes part in the shuffles, row or not.
    for (int off = PD_WARP / 2; off > 0; off >>= 1)
        acc = __fadd_rn(acc, __shfl_xor_sync(PD_FULL_MASK, acc, off));
    if (r < rows && lane == 0) out[(pd_i64)t * out_stride + out_col0 + r] = acc;
}

// swiglu — 1-D: grid ceil(n / 256), block 256.
// g[i] = g[i] / (1 + exp(-g[i])) * u[i], as the MLP in crates/engine/src/deepseek.rs and
// model.rs compute silu(gate) * up (same operations, same order; expf may differ from the
// CPU's exp by an ulp).
extern "C" __global__ void swiglu(float* g, const float* u, int n) {
    pd_i64 i = (pd_i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = g[i];
    g[i] = __fmul_rn(__fdiv_rn(v, __fadd_rn(1.0f, expf(-v))), u[i]);
}

// add_in_place — 1-D: grid ceil(n / 256), block 256. x[i] += y[i] (the residual adds).
extern "C" __global__ void add_in_place(float* x, const float* y, int n) {
    pd_i64 i = (pd_i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    x[i] = __fadd_rn(x[i], y[i]);
}

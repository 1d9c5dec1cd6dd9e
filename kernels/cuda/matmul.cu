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

// matmul_tiles — grid.x = ceil(rows / 32), grid.y = ceil(tokens / 16), block 256.
// The same products as matmul_rows, bit for bit, for many tokens at once: each warp
// computes a tile of 8 tokens × 8 rows, and each lane keeps one accumulator per output
// of the tile, fusing k = lane, lane+32, ... in order exactly as matmul_rows's lane does,
// then every output's 32 lane sums meet in matmul_rows's xor-shuffle tree. A loaded
// weight serves 8 tokens and a loaded activation 8 rows (matmul_rows loads both for each
// multiply-add), so large batches stop being bound by loads. Which of the two kernels a
// launch uses can then depend on the batch without changing any token's bits.
// The block's 8 warps are 2 token groups × 4 row groups, so they share loads in L1.
#define PD_MT_T 8
#define PD_MT_R 8
extern "C" __global__ void __launch_bounds__(PD_MM_WARPS * PD_WARP)
matmul_tiles(const float* w, const float* x, float* out, int rows, int cols, int tokens,
             int out_stride, int out_col0) {
    int warp = threadIdx.x / PD_WARP;
    int lane = threadIdx.x % PD_WARP;
    int t0 = (blockIdx.y * 2 + warp / 4) * PD_MT_T;
    int r0 = (blockIdx.x * 4 + warp % 4) * PD_MT_R;
    // Tokens and rows past the end read nothing and store nothing; their lanes still take
    // part in the shuffles.
    const float* xs[PD_MT_T];
    const float* ws[PD_MT_R];
    bool tok_ok[PD_MT_T], row_ok[PD_MT_R];
#pragma unroll
    for (int i = 0; i < PD_MT_T; i++) {
        tok_ok[i] = t0 + i < tokens;
        xs[i] = x + (pd_i64)(tok_ok[i] ? t0 + i : 0) * cols;
    }
#pragma unroll
    for (int j = 0; j < PD_MT_R; j++) {
        row_ok[j] = r0 + j < rows;
        ws[j] = w + (pd_i64)(row_ok[j] ? r0 + j : 0) * cols;
    }
    float acc[PD_MT_T][PD_MT_R];
#pragma unroll
    for (int i = 0; i < PD_MT_T; i++)
#pragma unroll
        for (int j = 0; j < PD_MT_R; j++) acc[i][j] = 0.0f;
    for (int k = lane; k < cols; k += PD_WARP) {
        float xv[PD_MT_T], wv[PD_MT_R];
#pragma unroll
        for (int i = 0; i < PD_MT_T; i++) xv[i] = tok_ok[i] ? xs[i][k] : 0.0f;
#pragma unroll
        for (int j = 0; j < PD_MT_R; j++) wv[j] = row_ok[j] ? ws[j][k] : 0.0f;
#pragma unroll
        for (int i = 0; i < PD_MT_T; i++)
#pragma unroll
            for (int j = 0; j < PD_MT_R; j++) acc[i][j] = __fmaf_rn(wv[j], xv[i], acc[i][j]);
    }
#pragma unroll
    for (int i = 0; i < PD_MT_T; i++)
#pragma unroll
        for (int j = 0; j < PD_MT_R; j++) {
            float a = acc[i][j];
            for (int off = PD_WARP / 2; off > 0; off >>= 1)
                a = __fadd_rn(a, __shfl_xor_sync(PD_FULL_MASK, a, off));
            // Every lane holds every sum now; the 64 stores are spread over the lanes.
            if (lane == (i * PD_MT_R + j) % PD_WARP && tok_ok[i] && row_ok[j])
                out[(pd_i64)(t0 + i) * out_stride + out_col0 + r0 + j] = a;
        }
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

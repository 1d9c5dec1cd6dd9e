// Embedding lookup, RMS norm and rotary embedding.

// embed_gather — grid.x = n (one block per token), block 256.
// out[i*dim + j] = table[tokens[i]*dim + j]: the embedding rows of the tokens.
extern "C" __global__ void embed_gather(const float* table, const unsigned int* tokens,
                                        float* out, int dim, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    const float* src = table + (pd_i64)tokens[i] * dim;
    float* dst = out + (pd_i64)i * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) dst[j] = src[j];
}

#define PD_NORM_BLOCK 256

// rms_norm — grid.x = rows, block 256 (exactly: the tree below has 256 slots).
// Mirrors rms_norm in crates/engine/src/model.rs: the sum of squares (each square an f32
// product, widened) is accumulated in double, thread t over elements t, t+256, ... in
// order, then one fixed tree; mean = (float)(sum / dim); scale = 1 / sqrt(mean + eps);
// out = x * scale * w, multiplied in that order.
extern "C" __global__ void __launch_bounds__(PD_NORM_BLOCK)
rms_norm(const float* x, const float* w, float* out, int dim, float eps) {
    __shared__ double buf[PD_NORM_BLOCK];
    const float* xr = x + (pd_i64)blockIdx.x * dim;
    float* orow = out + (pd_i64)blockIdx.x * dim;
    int t = threadIdx.x;
    double s = 0.0;
    for (int j = t; j < dim; j += PD_NORM_BLOCK) {
        float v = xr[j];
        s = s + (double)__fmul_rn(v, v);
    }
    buf[t] = s;
    pd_tree_sum_f64(buf, PD_NORM_BLOCK);
    float mean = (float)(buf[0] / (double)dim);
    float scale = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    for (int j = t; j < dim; j += PD_NORM_BLOCK) orow[j] = __fmul_rn(__fmul_rn(xr[j], scale), w[j]);
}

// rope_pairs — grid.x = tokens, grid.y = heads, block 32 (any block size works: thread
// `l` rotates pairs l, l + blockDim.x, ...).
// Rotates the adjacent pairs (x[2i], x[2i+1]) of head h of token t, at
// x + t*row_stride + h*head_dim, by the angles of rope_table in crates/engine/src/model.rs
// (llama.cpp's "normal" mode): theta starts at pos[t], theta_scale = base^(-2/head_dim)
// (computed by the host with the CPU's powf and passed in, so an ulp of difference in
// powf cannot grow with the position), pair i uses cos/sin of theta, then theta *= theta_scale, iteratively in f32 (each
// thread walks the recurrence from pair 0, so every pair sees the same theta the CPU does);
// then apply_rope: x0' = x0*c - x1*s, x1' = x0*s + x1*c.
extern "C" __global__ void rope_pairs(float* x, const int* pos, int heads, int head_dim,
                                      int row_stride, float theta_scale) {
    int t = blockIdx.x;
    int h = blockIdx.y;
    if (h >= heads) return;
    float* xh = x + (pd_i64)t * row_stride + (pd_i64)h * head_dim;
    float theta = (float)pos[t];
    int pairs = head_dim / 2;
    int l = threadIdx.x;
    for (int i = 0; i < pairs; i++) {
        if (i % (int)blockDim.x == l) {
            float c = cosf(theta);
            float s = sinf(theta);
            float x0 = xh[2 * i];
            float x1 = xh[2 * i + 1];
            xh[2 * i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
            xh[2 * i + 1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
        }
        theta = __fmul_rn(theta, theta_scale);
    }
}

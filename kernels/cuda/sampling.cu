// Greedy sampling and log-probabilities over rows of logits.

#define PD_SAMPLE_BLOCK 256

// Whether (v, i) comes before (bv, bi) for argmax: a number beats NaN, a larger value
// wins, the lower index wins ties (and among NaNs). bi < 0 means "nothing yet".
PD_DEV bool pd_argmax_better(float v, int i, float bv, int bi) {
    if (bi < 0) return true;
    bool vn = pd_is_nan(v), bn = pd_is_nan(bv);
    if (vn != bn) return bn;
    if (!vn && v != bv) return v > bv;
    return i < bi;
}

// argmax_rows — grid.x = rows, block 256 (exactly).
// argmax in crates/engine/src/sampler.rs: the index of the largest logit of row r
// (logits + r*vocab), the lowest index on ties; NaN is never chosen over a number (a row
// of NaNs gives 0). out[r] = that index.
extern "C" __global__ void __launch_bounds__(PD_SAMPLE_BLOCK)
argmax_rows(const float* logits, int vocab, unsigned int* out) {
    __shared__ float bv[PD_SAMPLE_BLOCK];
    __shared__ int bi[PD_SAMPLE_BLOCK];
    const float* row = logits + (pd_i64)blockIdx.x * vocab;
    int tid = threadIdx.x;
    float best = 0.0f;
    int besti = -1;
    for (int j = tid; j < vocab; j += PD_SAMPLE_BLOCK) {
        float v = row[j];
        if (pd_argmax_better(v, j, best, besti)) {
            best = v;
            besti = j;
        }
    }
    bv[tid] = best;
    bi[tid] = besti;
    __syncthreads();
    for (int s = PD_SAMPLE_BLOCK / 2; s > 0; s >>= 1) {
        if (tid < s && bi[tid + s] >= 0 && pd_argmax_better(bv[tid + s], bi[tid + s], bv[tid], bi[tid])) {
            bv[tid] = bv[tid + s];
            bi[tid] = bi[tid + s];
        }
        __syncthreads();
    }
    if (tid == 0) out[blockIdx.x] = bi[0] < 0 ? 0u : (unsigned int)bi[0];
}

// log_softmax_rows — grid.x = rows, block 256 (exactly).
// log_softmax_at in crates/engine/src/sampler.rs for every token of row r:
// max = the largest logit (NaN ignored; fixed tree), sum = sum_j exp(l_j - max) in double
// (thread-strided in order, then a fixed tree), out_j = (l_j - max) - (float)ln(sum).
extern "C" __global__ void __launch_bounds__(PD_SAMPLE_BLOCK)
log_softmax_rows(const float* logits, float* out, int vocab) {
    __shared__ float fbuf[PD_SAMPLE_BLOCK];
    __shared__ double dbuf[PD_SAMPLE_BLOCK];
    const float* row = logits + (pd_i64)blockIdx.x * vocab;
    float* orow = out + (pd_i64)blockIdx.x * vocab;
    int tid = threadIdx.x;
    float m = pd_bits_f32(0xff800000u);  // -inf
    for (int j = tid; j < vocab; j += PD_SAMPLE_BLOCK) m = fmaxf(m, row[j]);
    fbuf[tid] = m;
    pd_tree_max_f32(fbuf, PD_SAMPLE_BLOCK);
    float mx = fbuf[0];
    double s = 0.0;
    for (int j = tid; j < vocab; j += PD_SAMPLE_BLOCK) s = s + (double)expf(__fsub_rn(row[j], mx));
    dbuf[tid] = s;
    pd_tree_sum_f64(dbuf, PD_SAMPLE_BLOCK);
    float lse = (float)log(dbuf[0]);
    for (int j = tid; j < vocab; j += PD_SAMPLE_BLOCK) orow[j] = __fsub_rn(__fsub_rn(row[j], mx), lse);
}

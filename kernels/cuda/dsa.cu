// DeepSeek sparse attention's indexer: key scores and the top-k selection.

#define PD_DSA_KEYS 128
#define PD_TOPK_BLOCK 256

// dsa_index_scores — grid.x = tokens, grid.y = ceil(n_keys / 128), block 128 (one thread
// per key).
// index_score in crates/engine/src/deepseek.rs: for token t (queries q + t*q_stride, heads
// rows of dim values; weights w + t*heads) and key j (keys + j*dim, one key set shared by
// the launch): out[t*n_keys + j] = sum_h w[h] * max(dot(q_h, k_j), 0), heads summed in
// order from -0.0 (as Rust's f32 Sum), each dot deepseek.rs's `dot` (pd_dot8).
extern "C" __global__ void dsa_index_scores(const float* q, const float* w, const float* keys,
                                            float* out, int heads, int dim, int n_keys,
                                            int q_stride) {
    int t = blockIdx.x;
    int j = blockIdx.y * PD_DSA_KEYS + threadIdx.x;
    if (j >= n_keys) return;
    const float* qt = q + (pd_i64)t * q_stride;
    const float* wt = w + (pd_i64)t * heads;
    const float* k = keys + (pd_i64)j * dim;
    float acc = pd_bits_f32(0x80000000u);  // -0.0
    for (int h = 0; h < heads; h++) {
        float d = pd_dot8(qt + (pd_i64)h * dim, k, dim);
        float r = d > 0.0f ? d : 0.0f;  // f32::max(d, 0.0): NaN -> 0
        acc = __fadd_rn(acc, __fmul_rn(wt[h], r));
    }
    out[(pd_i64)t * n_keys + j] = acc;
}

// A score's place in f32::total_cmp's order as an unsigned key: larger key, larger score
// (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN).
PD_DEV pd_u32 pd_total_order_key(float x) {
    pd_u32 b = pd_f32_bits(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// topk_indices — grid.x = rows, block 256 (exactly: the scans below have 256 slots).
// Row r: the k indices of scores + r*n with the largest scores under the total order of
// the indexer in crates/engine/src/deepseek.rs — higher score first by f32::total_cmp
// (so a NaN with the sign bit clear ranks above +inf, one with it set below -inf), ties to
// the lower index — written to out + r*k sorted by index ascending (the CPU's
// select_nth_unstable_by then keep.sort_unstable()). When n <= k the CPU keeps every
// position: out holds 0..n-1, then -1 in the slots past n.
//
// Algorithm: a radix select (four 8-bit passes over the order keys, integer histograms)
// finds T, the k-th largest key, and `take`, how many of the keys equal to T are kept
// (the lowest-indexed ones). Each thread owns one contiguous chunk of indices; exclusive
// scans of the per-chunk counts (> T, == T) place each thread's output, so the indices
// come out in ascending order. Everything is integer; the result is unique.
//
// The selection of one row by the block, shared by both entry points below.
static __device__ void pd_topk_row(const float* row, int n, int k, int* o) {
    __shared__ int hist[256];
    __shared__ int gt_scan[PD_TOPK_BLOCK];
    __shared__ int eq_scan[PD_TOPK_BLOCK];
    __shared__ pd_u32 sel_digit;
    __shared__ int sel_remaining;
    int tid = threadIdx.x;
    if (k <= 0) return;
    if (n <= k) {
        for (int i = tid; i < k; i += PD_TOPK_BLOCK) o[i] = i < n ? i : -1;
        return;
    }
    int chunk = (n + PD_TOPK_BLOCK - 1) / PD_TOPK_BLOCK;
    int lo = tid * chunk < n ? tid * chunk : n;
    int hi = lo + chunk < n ? lo + chunk : n;

    pd_u32 prefix = 0, mask = 0;
    int remaining = k;  // how many of the keys matching `prefix` are still to be taken
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int d = tid; d < 256; d += PD_TOPK_BLOCK) hist[d] = 0;
        __syncthreads();
        for (int i = lo; i < hi; i++) {
            pd_u32 key = pd_total_order_key(row[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xFF], 1);
        }
        __syncthreads();
        if (tid == 0) {
            int above = 0;
            int d = 255;
            for (; d > 0; d--) {
                if (above + hist[d] >= remaining) break;
                above += hist[d];
            }
            sel_digit = (pd_u32)d;
            sel_remaining = remaining - above;
        }
        __syncthreads();
        prefix |= sel_digit << shift;
        mask |= 0xFFu << shift;
        remaining = sel_remaining;
        __syncthreads();
    }
    pd_u32 T = prefix;
    int take = remaining;  // 1 <= take <= the number of keys equal to T

    int gt = 0, eq = 0;
    for (int i = lo; i < hi; i++) {
        pd_u32 key = pd_total_order_key(row[i]);
        gt += key > T;
        eq += key == T;
    }
    gt_scan[tid] = gt;
    eq_scan[tid] = eq;
    __syncthreads();
    if (tid == 0) {
        int g = 0, e = 0;
        for (int i = 0; i < PD_TOPK_BLOCK; i++) {
            int a = gt_scan[i], b = eq_scan[i];
            gt_scan[i] = g;
            eq_scan[i] = e;
            g += a;
            e += b;
        }
    }
    __syncthreads();
    int eq_rank = eq_scan[tid];
    int at = gt_scan[tid] + (eq_rank < take ? eq_rank : take);
    for (int i = lo; i < hi; i++) {
        pd_u32 key = pd_total_order_key(row[i]);
        if (key > T || (key == T && eq_rank++ < take)) o[at++] = i;
    }
}

extern "C" __global__ void __launch_bounds__(PD_TOPK_BLOCK)
topk_indices(const float* scores, int n, int k, int* out) {
    pd_topk_row(scores + (pd_i64)blockIdx.x * n, n, k, out + (pd_i64)blockIdx.x * k);
}

// topk_indices_rows — grid.x = count, block 256 (exactly). Block b selects row
// r = rows[b] of a matrix of stride `row_stride`, whose first ns[b] scores are its own,
// into out + r*out_stride: topk_indices's selection for each row, with a length per row,
// so the indexer's sparse tokens of a layer (each with its own context) take one launch.
extern "C" __global__ void __launch_bounds__(PD_TOPK_BLOCK)
topk_indices_rows(const float* scores, int row_stride, const int* rows, const int* ns, int k,
                  int* out, int out_stride) {
    pd_i64 r = rows[blockIdx.x];
    pd_topk_row(scores + r * row_stride, ns[blockIdx.x], k, out + r * out_stride);
}

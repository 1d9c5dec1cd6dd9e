// Attention over the paged f16 KV pool.

#define PD_ATT_BLOCK 128
#define PD_ATT_QCACHE 512

// paged_attention_f16 — grid.x = tokens, grid.y = the query heads of this launch (local
// heads), block 128 (exactly: the trees below have 128 slots).
//
// Mirrors attend in kernels/src/attention.rs for one query head. Token t, local head h:
// the query is q + t*q_stride + h*head_dim, rounded through f16 (as the CPU does); it uses
// KV head g = kv_head0 + h / group_rep and attends positions 0..=pos[t] of sequence
// s = seq_of_token[t]. Position j lives in page page_table[page_table_start[s] + j /
// page_size], row j % page_size; its K row (f16) starts at byte
//   page * bytes_per_page + k_off + ((j % page_size) * kv_row_elems + g * head_dim) * 2
// and its V row likewise at v_off.
//   1. score_j = scale * q·k_j, one thread per position: eight lanes (lane l sums the
//      products of dims d with d % 8 == l, in order, a multiply then an add), summed
//      pairwise, as attend's dot lanes. Scores go to
//      scratch + (t*gridDim.y + h)*scratch_stride (scratch_stride >= pos[t] + 1).
//   2. max over positions (exact; fixed tree), then e_j = exp(score_j - max) and their
//      sum in double (thread-strided in order, then a fixed tree), inv = (float)(1 / sum),
//      p_j = f16-rounded e_j * inv, as the CPU rounds probabilities.
//   3. out[d] = sum_j p_j * v_j[d], one thread per output dim looping positions in order.
// Written to out + t*out_stride + h*head_dim. Differences from the CPU: expf, and the
// order of the double sum (a tree here, sequential there).
extern "C" __global__ void __launch_bounds__(PD_ATT_BLOCK)
paged_attention_f16(const float* q, int q_stride, float* out, int out_stride, float* scratch,
                    int scratch_stride, const unsigned char* pool, const int* seq_of_token,
                    const int* pos, const int* page_table, const int* page_table_start,
                    long long bytes_per_page, long long k_off, long long v_off,
                    int kv_row_elems, int head_dim, int group_rep, int kv_head0, int page_size,
                    float scale) {
    __shared__ float qs[PD_ATT_QCACHE];
    __shared__ float fbuf[PD_ATT_BLOCK];
    __shared__ double dbuf[PD_ATT_BLOCK];
    int t = blockIdx.x;
    int h = blockIdx.y;
    int tid = threadIdx.x;
    int s = seq_of_token[t];
    int npos = pos[t] + 1;
    int g = kv_head0 + h / group_rep;
    const int* pages = page_table + page_table_start[s];
    const float* qh = q + (pd_i64)t * q_stride + (pd_i64)h * head_dim;
    float* sc = scratch + ((pd_i64)t * gridDim.y + h) * scratch_stride;
    bool cached = head_dim <= PD_ATT_QCACHE;
    if (cached)
        for (int d = tid; d < head_dim; d += PD_ATT_BLOCK) qs[d] = pd_round_f16(qh[d]);
    __syncthreads();
    pd_i64 row_off = (pd_i64)g * head_dim;

    // 1. Scores.
    float lmax = pd_bits_f32(0xff800000u);  // -inf
    for (int j = tid; j < npos; j += PD_ATT_BLOCK) {
        pd_i64 page = pages[j / page_size];
        const pd_u16* k = (const pd_u16*)(pool + page * bytes_per_page + k_off +
                                          ((pd_i64)(j % page_size) * kv_row_elems + row_off) * 2);
        float l[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int c = 0; c < head_dim; c += 8) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                int d = c + i;
                if (d < head_dim) {
                    float qd = cached ? qs[d] : pd_round_f16(qh[d]);
                    l[i] = __fadd_rn(l[i], __fmul_rn(qd, pd_f16_bits_to_f32(k[d])));
                }
            }
        }
        float dot = __fadd_rn(__fadd_rn(__fadd_rn(l[0], l[1]), __fadd_rn(l[2], l[3])),
                              __fadd_rn(__fadd_rn(l[4], l[5]), __fadd_rn(l[6], l[7])));
        float sj = __fmul_rn(dot, scale);
        sc[j] = sj;
        lmax = fmaxf(lmax, sj);
    }
    fbuf[tid] = lmax;
    pd_tree_max_f32(fbuf, PD_ATT_BLOCK);
    float mx = fbuf[0];

    // 2. Softmax.
    double lsum = 0.0;
    for (int j = tid; j < npos; j += PD_ATT_BLOCK) {
        float e = expf(__fsub_rn(sc[j], mx));
        sc[j] = e;
        lsum = lsum + (double)e;
    }
    dbuf[tid] = lsum;
    pd_tree_sum_f64(dbuf, PD_ATT_BLOCK);
    float inv = (float)(1.0 / dbuf[0]);
    for (int j = tid; j < npos; j += PD_ATT_BLOCK) sc[j] = pd_round_f16(__fmul_rn(sc[j], inv));
    __syncthreads();

    // 3. The weighted sum of values.
    float* o = out + (pd_i64)t * out_stride + (pd_i64)h * head_dim;
    for (int d = tid; d < head_dim; d += PD_ATT_BLOCK) {
        float acc = 0.0f;
        for (int j = 0; j < npos; j++) {
            pd_i64 page = pages[j / page_size];
            const pd_u16* v = (const pd_u16*)(pool + page * bytes_per_page + v_off +
                                              ((pd_i64)(j % page_size) * kv_row_elems + row_off) * 2);
            acc = __fadd_rn(acc, __fmul_rn(sc[j], pd_f16_bits_to_f32(v[d])));
        }
        o[d] = acc;
    }
}

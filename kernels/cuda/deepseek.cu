// DeepSeek V3.2 (crates/engine/src/deepseek.rs) on the GPU: the norms, the two rope forms,
// the Hadamard rotation, the cache entries in their byte formats, the indexer's scores
// over the paged index-K cache, MLA's absorbed attention over the chosen positions and
// the MoE combine. cuda_src.rs compiles this file after fp8.cu (same module), whose
// e4m3 helpers it uses.
//
// Every kernel mirrors its CPU function's arithmetic order (the _rn intrinsics, fixed
// sequential or tree orders, no atomics), and a token's result depends only on that
// token's inputs: batch-invariant. expf may differ from Rust's exp by an ulp.
//
// Cache addressing: a token's entries live in its page at `tok_base` (page × bytes per
// page). For a component, its values of slot s start at `off + s * stride` and, for fp8,
// its f32 scales (one per 128 values) at `scale_off + s * scale_stride`: the host derives
// these from KvLayout::value_offset / scale_offset.

#define PD_DS_BLOCK 128
#define PD_DS_MAX_DIM 1024
#define PD_DS_MAX_KEY 256

// Stores and loads of the cache's little-endian fields, byte by byte (no alignment
// assumed).
PD_DEV void ds_store_u16(pd_u8* p, pd_u16 v) {
    p[0] = (pd_u8)(v & 0xff);
    p[1] = (pd_u8)(v >> 8);
}
PD_DEV void ds_store_f32(pd_u8* p, float v) {
    pd_u32 b = pd_f32_bits(v);
    p[0] = (pd_u8)(b & 0xff);
    p[1] = (pd_u8)((b >> 8) & 0xff);
    p[2] = (pd_u8)((b >> 16) & 0xff);
    p[3] = (pd_u8)(b >> 24);
}
PD_DEV float ds_load_bf16(const pd_u8* p) {
    return pd_bf16_bits_to_f32((pd_u16)((pd_u32)p[0] | ((pd_u32)p[1] << 8)));
}
PD_DEV float ds_load_f32(const pd_u8* p) {
    return pd_bits_f32((pd_u32)p[0] | ((pd_u32)p[1] << 8) | ((pd_u32)p[2] << 16) |
                       ((pd_u32)p[3] << 24));
}

// Value c of a cached vector: bf16 (fp8 == 0) at v, or e4m3 at v times the f32 scale of
// its block of 128 at sc (dequantize_block: value * scale).
PD_DEV float ds_cache_value(const pd_u8* v, const pd_u8* sc, int fp8, int c) {
    if (!fp8) return ds_load_bf16(v + 2 * c);
    return __fmul_rn(pd_e4m3_to_f32(v[c]), ds_load_f32(sc + 4 * (c / PD_FP8_BLOCK)));
}

// pd_dot8 (deepseek.rs `dot`) of a (f32) with a cached vector read by ds_cache_value.
PD_DEV float ds_dot8_cache(const float* a, const pd_u8* v, const pd_u8* sc, int fp8, int n) {
    float l[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int n8 = n / 8 * 8;
    for (int c = 0; c < n8; c += 8)
        for (int i = 0; i < 8; i++)
            l[i] = __fadd_rn(l[i], __fmul_rn(a[c + i], ds_cache_value(v, sc, fp8, c + i)));
    float s = __fadd_rn(__fadd_rn(__fadd_rn(l[0], l[1]), __fadd_rn(l[2], l[3])),
                        __fadd_rn(__fadd_rn(l[4], l[5]), __fadd_rn(l[6], l[7])));
    for (int i = n8; i < n; i++) s = __fadd_rn(s, __fmul_rn(a[i], ds_cache_value(v, sc, fp8, i)));
    return s;
}

// The byte offset in the pool of position p of sequence `sq`'s page `p / page_size`.
PD_DEV pd_i64 ds_page_base(const int* page_table, const int* pts, int sq, int p, int page_size,
                           pd_i64 bpp) {
    return (pd_i64)page_table[pts[sq] + p / page_size] * bpp;
}

// Quantizes v[0..len) (len <= 128) as fp8::quantize_block with ScaleRule::Ue8m0: codes
// to q[0..len), the scale returned. `buf` is 128 shared floats; every thread of the
// 128-thread block calls it.
PD_DEV float ds_quantize_block(const float* v, int len, pd_u8* q, float* buf) {
    int tid = threadIdx.x;
    buf[tid] = tid < len ? fmaxf(0.0f, fabsf(v[tid])) : 0.0f;  // fold from 0, NaN ignored
    pd_tree_max_f32(buf, PD_DS_BLOCK);
    float scale = pd_block_scale(buf[0], 1);
    float inv = __fdiv_rn(1.0f, scale);
    if (tid < len) q[tid] = pd_f32_to_e4m3(__fmul_rn(v[tid], inv));
    __syncthreads();  // buf is reused by the next call
    return scale;
}

// ds_rms_norm_inplace — grid.x = rows, block 256 (exactly).
// model.rs rms_norm (as norm.cu's rms_norm) on the first `dim` values of each row of x
// (row stride `stride`), in place: the latent's kv_a_layernorm.
extern "C" __global__ void __launch_bounds__(256)
ds_rms_norm_inplace(float* x, int stride, const float* w, int dim, float eps) {
    __shared__ double buf[256];
    float* xr = x + (pd_i64)blockIdx.x * stride;
    int t = threadIdx.x;
    double s = 0.0;
    for (int j = t; j < dim; j += 256) {
        float v = xr[j];
        s = s + (double)__fmul_rn(v, v);
    }
    buf[t] = s;
    pd_tree_sum_f64(buf, 256);
    float mean = (float)(buf[0] / (double)dim);
    float scale = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    for (int j = t; j < dim; j += 256) xr[j] = __fmul_rn(__fmul_rn(xr[j], scale), w[j]);
}

// ds_rope_interleaved — grid.x = tokens, grid.y = heads, block 32 (any size).
// rope_interleaved on x + t*row_stride + h*head_stride + offset: pair i = (2i, 2i+1)
// rotated by cos/sin[t*pairs + i] (the host's rope_at: cos and sin of pos * freq):
// a' = a*c - b*s, b' = a*s + b*c.
extern "C" __global__ void ds_rope_interleaved(float* x, int row_stride, int head_stride,
                                               int offset, const float* cos_t,
                                               const float* sin_t, int pairs) {
    int t = blockIdx.x;
    float* xh = x + (pd_i64)t * row_stride + (pd_i64)blockIdx.y * head_stride + offset;
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        float c = cos_t[(pd_i64)t * pairs + i], s = sin_t[(pd_i64)t * pairs + i];
        float a = xh[2 * i], b = xh[2 * i + 1];
        xh[2 * i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        xh[2 * i + 1] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    }
}

// ds_index_prep — grid.x = tokens, grid.y = vecs, block 128 (exactly).
// One indexer vector of `dim` (<= 1024, a power of two) values at
// x + t*row_stride + v*dim, as deepseek.rs `attention` prepares it:
//   - with has_ln: layer_norm (mean and variance summed in f64 in index order, one thread;
//     ((x - mean) * inv) as f32 * w + b);
//   - rope_half on the first rope_dim values (pairs (i, i + rope_dim/2), the token's
//     cos/sin[t*rope_dim/2 + i]);
//   - hadamard (butterflies h = 1, 2, ..., then * (1 / sqrt(dim)));
//   - round_mode: 0 none, 1 through bf16, 2 through fp8 (ue8m0 scale per 128, quantized then
//     dequantized): round_like_index_k.
extern "C" __global__ void __launch_bounds__(PD_DS_BLOCK)
ds_index_prep(float* x, int row_stride, int dim, int rope_dim, const float* cos_t,
              const float* sin_t, int has_ln, const float* ln_w, const float* ln_b, float eps,
              int round_mode) {
    __shared__ float v[PD_DS_MAX_DIM];
    __shared__ float red[PD_DS_BLOCK];
    __shared__ pd_u8 q[PD_DS_BLOCK];
    __shared__ double stats[2];
    int tid = threadIdx.x;
    int t = blockIdx.x;
    float* xv = x + (pd_i64)t * row_stride + (pd_i64)blockIdx.y * dim;
    for (int j = tid; j < dim; j += PD_DS_BLOCK) v[j] = xv[j];
    __syncthreads();
    if (has_ln) {
        if (tid == 0) {
            double n = (double)dim;
            double s = -0.0;
            for (int j = 0; j < dim; j++) s = __dadd_rn(s, (double)v[j]);
            double mean = __ddiv_rn(s, n);
            double var = -0.0;
            for (int j = 0; j < dim; j++) {
                double dv = __dsub_rn((double)v[j], mean);
                var = __dadd_rn(var, __dmul_rn(dv, dv));
            }
            var = __ddiv_rn(var, n);
            stats[0] = mean;
            stats[1] = __ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(var, (double)eps)));
        }
        __syncthreads();
        for (int j = tid; j < dim; j += PD_DS_BLOCK) {
            float y = (float)__dmul_rn(__dsub_rn((double)v[j], stats[0]), stats[1]);
            v[j] = __fadd_rn(__fmul_rn(y, ln_w[j]), ln_b[j]);
        }
        __syncthreads();
    }
    int half = rope_dim / 2;
    for (int i = tid; i < half; i += PD_DS_BLOCK) {
        float c = cos_t[(pd_i64)t * half + i], s = sin_t[(pd_i64)t * half + i];
        float a = v[i], b = v[i + half];
        v[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        v[i + half] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    }
    __syncthreads();
    for (int h = 1; h < dim; h *= 2) {
        for (int p = tid; p < dim / 2; p += PD_DS_BLOCK) {
            int j = (p / h) * 2 * h + p % h;
            float a = v[j], b = v[j + h];
            v[j] = __fadd_rn(a, b);
            v[j + h] = __fsub_rn(a, b);
        }
        __syncthreads();
    }
    float hs = __fdiv_rn(1.0f, __fsqrt_rn((float)dim));
    for (int j = tid; j < dim; j += PD_DS_BLOCK) v[j] = __fmul_rn(v[j], hs);
    __syncthreads();
    if (round_mode == 1) {
        for (int j = tid; j < dim; j += PD_DS_BLOCK)
            v[j] = pd_bf16_bits_to_f32(pd_f32_to_bf16_bits(v[j]));
    } else if (round_mode == 2) {
        for (int b0 = 0; b0 < dim; b0 += PD_FP8_BLOCK) {
            int len = dim - b0 < PD_FP8_BLOCK ? dim - b0 : PD_FP8_BLOCK;
            float scale = ds_quantize_block(v + b0, len, q, red);
            if (tid < len) v[b0 + tid] = __fmul_rn(pd_e4m3_to_f32(q[tid]), scale);
            __syncthreads();
        }
    }
    __syncthreads();
    for (int j = tid; j < dim; j += PD_DS_BLOCK) xv[j] = v[j];
}

// ds_scale — 1-D: grid ceil(n / 256), block 256. x[i] *= s.
extern "C" __global__ void ds_scale(float* x, int n, float s) {
    pd_i64 i = (pd_i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    x[i] = __fmul_rn(x[i], s);
}

// put_bf16: len values as bf16 at dst.
PD_DEV void ds_put_bf16(pd_u8* dst, const float* v, int len) {
    for (int j = threadIdx.x; j < len; j += blockDim.x)
        ds_store_u16(dst + 2 * j, pd_f32_to_bf16_bits(v[j]));
}

// put_fp8: blocks of 128 quantized (ue8m0) to dst, their scales to sc.
PD_DEV void ds_put_fp8(pd_u8* dst, pd_u8* sc, const float* v, int len, float* buf) {
    for (int b0 = 0; b0 < len; b0 += PD_FP8_BLOCK) {
        int n = len - b0 < PD_FP8_BLOCK ? len - b0 : PD_FP8_BLOCK;
        float s = ds_quantize_block(v + b0, n, dst + b0, buf);
        if (threadIdx.x == 0) ds_store_f32(sc + 4 * (b0 / PD_FP8_BLOCK), s);
    }
}

// ds_write_entry — grid.x = n (one block per token), block 128 (exactly).
// write_entry: token i's latent (r normalized values then dr rotated rope values, at
// lat + i*lat_stride) and index key (di values at ik + i*ik_stride) into its slot
// tok_slot[i] of the page at pool + tok_base[i]:
//   - mla_fp8 == 0: the latent as r + dr bf16 at lat_off;
//   - mla_fp8 != 0: the r values fp8 at lat_off (scales at lat_sc_off), the rope bf16 at
//     rope_off;
//   - ik_fp8: the key fp8 at ik_off (scales at ik_sc_off), else bf16 at ik_off.
extern "C" __global__ void __launch_bounds__(PD_DS_BLOCK)
ds_write_entry(const float* lat, int lat_stride, const float* ik, int ik_stride,
               unsigned char* pool, const long long* tok_base, const int* tok_slot, int n,
               int r, int dr, int di, int mla_fp8, long long lat_off, long long lat_st,
               long long lat_sc_off, long long lat_sc_st, long long rope_off,
               long long rope_st, int ik_fp8, long long ik_off, long long ik_st,
               long long ik_sc_off, long long ik_sc_st) {
    __shared__ float buf[PD_DS_BLOCK];
    int i = blockIdx.x;
    if (i >= n) return;  // uniform over the block
    pd_u8* page = pool + tok_base[i];
    pd_i64 s = tok_slot[i];
    const float* l = lat + (pd_i64)i * lat_stride;
    const float* k = ik + (pd_i64)i * ik_stride;
    if (!mla_fp8) {
        ds_put_bf16(page + lat_off + s * lat_st, l, r + dr);
    } else {
        ds_put_fp8(page + lat_off + s * lat_st, page + lat_sc_off + s * lat_sc_st, l, r, buf);
        ds_put_bf16(page + rope_off + s * rope_st, l + r, dr);
    }
    if (ik_fp8)
        ds_put_fp8(page + ik_off + s * ik_st, page + ik_sc_off + s * ik_sc_st, k, di, buf);
    else
        ds_put_bf16(page + ik_off + s * ik_st, k, di);
}

// ds_index_scores_paged — grid.x = tokens, grid.y = ceil(max_len / 128), block 128 (one
// thread per cached position).
// index_score for token t and each position j <= pos[t] of its sequence: the key read from
// the index-K cache (fp8 dequantized or bf16; dim <= 256), then
// out[t*out_stride + j] = sum_h w_h * max(dot(q_h, k), 0), heads summed in order from
// -0.0 (as dsa.cu's dsa_index_scores). Tokens with has[t] == 0 are skipped.
extern "C" __global__ void __launch_bounds__(PD_DS_BLOCK)
ds_index_scores_paged(const float* q, int q_stride, const float* w, int heads, int dim,
                      const unsigned char* pool, const int* page_table, const int* pts,
                      const int* seq, const int* pos, const int* has, long long bpp,
                      int page_size, int ik_fp8, long long ik_off, long long ik_st,
                      long long ik_sc_off, long long ik_sc_st, float* out, int out_stride) {
    float kb[PD_DS_MAX_KEY];
    int t = blockIdx.x;
    int j = blockIdx.y * PD_DS_BLOCK + threadIdx.x;
    if (!has[t] || j > pos[t]) return;
    const pd_u8* page = pool + ds_page_base(page_table, pts, seq[t], j, page_size, bpp);
    pd_i64 s = j % page_size;
    const pd_u8* kv = page + ik_off + s * ik_st;
    const pd_u8* ks = page + ik_sc_off + s * ik_sc_st;
    for (int c = 0; c < dim; c++) kb[c] = ds_cache_value(kv, ks, ik_fp8, c);
    const float* qt = q + (pd_i64)t * q_stride;
    const float* wt = w + (pd_i64)t * heads;
    float acc = pd_bits_f32(0x80000000u);  // -0.0
    for (int h = 0; h < heads; h++) {
        float d = pd_dot8(qt + (pd_i64)h * dim, kb, dim);
        float rl = d > 0.0f ? d : 0.0f;
        acc = __fadd_rn(acc, __fmul_rn(wt[h], rl));
    }
    out[(pd_i64)t * out_stride + j] = acc;
}

// ds_mla_attention — grid.x = tokens, grid.y = heads, block 128 (exactly).
// The absorbed MLA of deepseek.rs `attention` for token t and head h, over the positions
// sel[t*sel_stride .. + sel_n[t]] (ascending) of its sequence:
//   q_abs[a] = sum_dd q_nope[dd] * kv_b[(h*(dn+dv)+dd)*r + a] (dd in order, from 0);
//   s_j = scale * (dot(q_abs, latent_j[..r]) + dot(q_rope, rope_j)) into scratch;
//   m = max_j s_j; e_j = exp(s_j - m); sum = e_0 + e_1 + ... in order; p_j = e_j / sum;
//   o_lat[a] = sum_j p_j * latent_j[a] (j in order, from 0);
//   out[t*heads*dv + h*dv + dd] = dot(o_lat, kv_b[(h*(dn+dv)+dn+dd)*r ..]).
// Latents are read from the cache: bf16 (r + dr values at lat_off) or fp8 (r at lat_off
// with scales at lat_sc_off, dr bf16 at rope_off). r <= 1024. scratch holds
// tokens*heads*sel_stride floats.
extern "C" __global__ void __launch_bounds__(PD_DS_BLOCK)
ds_mla_attention(const float* q, const float* kv_b, float* out, float* scratch,
                 const int* sel, const int* sel_n, int sel_stride, const unsigned char* pool,
                 const int* page_table, const int* pts, const int* seq, long long bpp,
                 int page_size, int heads, int r, int dr, int dn, int dv, float scale,
                 int mla_fp8, long long lat_off, long long lat_st, long long lat_sc_off,
                 long long lat_sc_st, long long rope_off, long long rope_st) {
    __shared__ float qabs[PD_DS_MAX_DIM];
    __shared__ float olat[PD_DS_MAX_DIM];
    __shared__ float red[PD_DS_BLOCK];
    __shared__ float total;
    int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    int sq = seq[t];
    int n = sel_n[t];
    const int* st = sel + (pd_i64)t * sel_stride;
    float* sc = scratch + ((pd_i64)t * heads + h) * sel_stride;
    const float* qh = q + ((pd_i64)t * heads + h) * (dn + dr);
    const float* wb = kv_b + (pd_i64)h * (dn + dv) * r;
    for (int a = tid; a < r; a += PD_DS_BLOCK) {
        float acc = 0.0f;
        for (int dd = 0; dd < dn; dd++)
            acc = __fadd_rn(acc, __fmul_rn(qh[dd], wb[(pd_i64)dd * r + a]));
        qabs[a] = acc;
    }
    __syncthreads();
    float mx = pd_bits_f32(0xff800000u);  // -inf
    for (int jj = tid; jj < n; jj += PD_DS_BLOCK) {
        int p = st[jj];
        const pd_u8* page = pool + ds_page_base(page_table, pts, sq, p, page_size, bpp);
        pd_i64 s = p % page_size;
        float d1, d2;
        if (!mla_fp8) {
            const pd_u8* e = page + lat_off + s * lat_st;
            d1 = ds_dot8_cache(qabs, e, e, 0, r);
            d2 = ds_dot8_cache(qh + dn, e + 2 * r, e, 0, dr);
        } else {
            const pd_u8* e = page + lat_off + s * lat_st;
            d1 = ds_dot8_cache(qabs, e, page + lat_sc_off + s * lat_sc_st, 1, r);
            const pd_u8* ro = page + rope_off + s * rope_st;
            d2 = ds_dot8_cache(qh + dn, ro, ro, 0, dr);
        }
        float v = __fmul_rn(scale, __fadd_rn(d1, d2));
        sc[jj] = v;
        mx = fmaxf(mx, v);
    }
    red[tid] = mx;
    pd_tree_max_f32(red, PD_DS_BLOCK);
    mx = red[0];
    for (int jj = tid; jj < n; jj += PD_DS_BLOCK) sc[jj] = expf(__fsub_rn(sc[jj], mx));
    __syncthreads();
    if (tid == 0) {
        float sum = 0.0f;
        for (int jj = 0; jj < n; jj++) sum = __fadd_rn(sum, sc[jj]);
        total = sum;
    }
    __syncthreads();
    float sum = total;
    for (int jj = tid; jj < n; jj += PD_DS_BLOCK) sc[jj] = __fdiv_rn(sc[jj], sum);
    __syncthreads();
    for (int a = tid; a < r; a += PD_DS_BLOCK) {
        float acc = 0.0f;
        for (int jj = 0; jj < n; jj++) {
            int p = st[jj];
            const pd_u8* page = pool + ds_page_base(page_table, pts, sq, p, page_size, bpp);
            pd_i64 s = p % page_size;
            const pd_u8* e = page + lat_off + s * lat_st;
            float lv = mla_fp8 ? ds_cache_value(e, page + lat_sc_off + s * lat_sc_st, 1, a)
                               : ds_cache_value(e, e, 0, a);
            acc = __fadd_rn(acc, __fmul_rn(sc[jj], lv));
        }
        olat[a] = acc;
    }
    __syncthreads();
    float* o = out + ((pd_i64)t * heads + h) * dv;
    for (int dd = tid; dd < dv; dd += PD_DS_BLOCK)
        o[dd] = pd_dot8(olat, wb + (pd_i64)(dn + dd) * r, r);
}

// ds_moe_combine — grid.x = tokens, block 256.
// The MoE sum of deepseek.rs `ffn`: for token i, acc = sum over its k routes in routing
// order of wts[i*k + s] * y[rows[i*k + s]*d + a] (from 0), then out[i*d + a] += acc.
extern "C" __global__ void ds_moe_combine(float* out, const float* y, const int* rows,
                                          const float* wts, int k, int d) {
    int i = blockIdx.x;
    for (int a = threadIdx.x; a < d; a += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < k; s++)
            acc = __fadd_rn(acc, __fmul_rn(wts[(pd_i64)i * k + s],
                                           y[(pd_i64)rows[(pd_i64)i * k + s] * d + a]));
        out[(pd_i64)i * d + a] = __fadd_rn(out[(pd_i64)i * d + a], acc);
    }
}

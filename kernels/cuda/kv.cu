// Writing and moving KV cache rows.

// kv_write_f16 — grid.x = n (one block per token), block 128.
// Token i's `cols` values at src + i*src_stride, converted f32 -> f16 (round to nearest,
// ties to even, bit-exact with the `half` crate's f16::from_f32), are stored at
// (unsigned short*)(pool + tok_off[i] + comp_off) + col0: one component (K or V of some
// heads) of the token's row in its page.
extern "C" __global__ void kv_write_f16(const float* src, int src_stride, unsigned char* pool,
                                        const long long* tok_off, long long comp_off, int col0,
                                        int cols, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    const float* s = src + (pd_i64)i * src_stride;
    pd_u16* d = (pd_u16*)(pool + tok_off[i] + comp_off) + col0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) d[c] = pd_f32_to_f16_bits(s[c]);
}

// One row's bytes from s to d by the block's threads: 16-byte words when both addresses
// and the length allow, else 4-byte words, else bytes.
PD_DEV void pd_copy_row(const pd_u8* s, pd_u8* d, int row_bytes) {
    pd_u64 align = (pd_u64)s | (pd_u64)d | (pd_u64)row_bytes;
    if ((align & 15) == 0) {
        const uint4* s4 = (const uint4*)s;
        uint4* d4 = (uint4*)d;
        for (int k = threadIdx.x; k < row_bytes / 16; k += blockDim.x) d4[k] = s4[k];
    } else if ((align & 3) == 0) {
        const pd_u32* s1 = (const pd_u32*)s;
        pd_u32* d1 = (pd_u32*)d;
        for (int k = threadIdx.x; k < row_bytes / 4; k += blockDim.x) d1[k] = s1[k];
    } else {
        for (int k = threadIdx.x; k < row_bytes; k += blockDim.x) d[k] = s[k];
    }
}

// gather_rows — grid.x = n, block 256.
// Row i: row_bytes bytes from src + src_off[i] to dst + i*row_bytes (e.g. KV rows or
// pages from the device pool into a pinned host staging buffer).
extern "C" __global__ void gather_rows(const unsigned char* src, const long long* src_off,
                                       unsigned char* dst, int row_bytes, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    pd_copy_row(src + src_off[i], dst + (pd_i64)i * row_bytes, row_bytes);
}

// scatter_rows — grid.x = n, block 256.
// Row i: row_bytes bytes from src + i*row_bytes to dst + dst_off[i] (staging -> pool).
extern "C" __global__ void scatter_rows(const unsigned char* src, unsigned char* dst,
                                        const long long* dst_off, int row_bytes, int n) {
    int i = blockIdx.x;
    if (i >= n) return;
    pd_copy_row(src + (pd_i64)i * row_bytes, dst + dst_off[i], row_bytes);
}

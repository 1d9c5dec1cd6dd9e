// The page checksum: XXH3-64 with a custom secret (XXH3_64bits_withSecret, seed 0),
// bit-exact with crates/kv/src/checksum.rs::page_checksum
// (xxhash_rust::xxh3::xxh3_64_with_secret under pdmesh's 192-byte secret). Written from
// the XXH3 specification, every length class: 0, 1-3, 4-8, 9-16, 17-128, 129-240, >240.

#define PD_XXH_P32_1 0x9E3779B1ull
#define PD_XXH_P32_2 0x85EBCA77ull
#define PD_XXH_P32_3 0xC2B2AE3Dull
#define PD_XXH_P64_1 0x9E3779B185EBCA87ull
#define PD_XXH_P64_2 0xC2B2AE3D27D4EB4Full
#define PD_XXH_P64_3 0x165667B19E3779F9ull
#define PD_XXH_P64_4 0x85EBCA77C2B2AE63ull
#define PD_XXH_P64_5 0x27D4EB2F165667C5ull
#define PD_XXH_SECRET_MIN 136
#define PD_XXH_STRIPE 64

// Little-endian loads at any alignment (the GPU and x86 are little-endian).
PD_DEV pd_u64 pd_xxh_rd64(const pd_u8* p) {
    if (((pd_u64)p & 7) == 0) return *(const pd_u64*)p;
    pd_u64 v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
PD_DEV pd_u32 pd_xxh_rd32(const pd_u8* p) {
    if (((pd_u64)p & 3) == 0) return *(const pd_u32*)p;
    return (pd_u32)p[0] | ((pd_u32)p[1] << 8) | ((pd_u32)p[2] << 16) | ((pd_u32)p[3] << 24);
}
PD_DEV pd_u64 pd_xxh_rotl64(pd_u64 x, int r) { return (x << r) | (x >> (64 - r)); }
PD_DEV pd_u64 pd_xxh_swap64(pd_u64 x) {
    pd_u64 r = 0;
    for (int i = 0; i < 8; i++) r = (r << 8) | ((x >> (8 * i)) & 0xFF);
    return r;
}
PD_DEV pd_u64 pd_xxh_mul128_fold64(pd_u64 a, pd_u64 b) { return (a * b) ^ __umul64hi(a, b); }
PD_DEV pd_u64 pd_xxh64_avalanche(pd_u64 h) {
    h ^= h >> 33;
    h *= PD_XXH_P64_2;
    h ^= h >> 29;
    h *= PD_XXH_P64_3;
    return h ^ (h >> 32);
}
PD_DEV pd_u64 pd_xxh3_avalanche(pd_u64 h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    return h ^ (h >> 32);
}
PD_DEV pd_u64 pd_xxh3_rrmxmx(pd_u64 h, pd_u64 len) {
    h ^= pd_xxh_rotl64(h, 49) ^ pd_xxh_rotl64(h, 24);
    h *= 0x9FB21C651E98DF25ull;
    h ^= (h >> 35) + len;
    h *= 0x9FB21C651E98DF25ull;
    return h ^ (h >> 28);
}
PD_DEV pd_u64 pd_xxh3_mix16(const pd_u8* in, const pd_u8* sec) {
    return pd_xxh_mul128_fold64(pd_xxh_rd64(in) ^ pd_xxh_rd64(sec), pd_xxh_rd64(in + 8) ^ pd_xxh_rd64(sec + 8));
}
PD_DEV void pd_xxh3_accumulate_512(pd_u64* acc, const pd_u8* in, const pd_u8* sec) {
    for (int i = 0; i < 8; i++) {
        pd_u64 v = pd_xxh_rd64(in + 8 * i);
        pd_u64 key = v ^ pd_xxh_rd64(sec + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (key & 0xFFFFFFFFull) * (key >> 32);
    }
}
PD_DEV void pd_xxh3_scramble(pd_u64* acc, const pd_u8* sec) {
    for (int i = 0; i < 8; i++) {
        pd_u64 a = acc[i];
        a ^= a >> 47;
        a ^= pd_xxh_rd64(sec + 8 * i);
        acc[i] = a * PD_XXH_P32_1;
    }
}

// XXH3_64bits_withSecret(in, len, sec, sec_len), seed 0; sec_len >= 136.
static __device__ pd_u64 pd_xxh3_64_with_secret(const pd_u8* in, pd_u64 len, const pd_u8* sec,
                                                pd_u64 sec_len) {
    if (len == 0) return pd_xxh64_avalanche(pd_xxh_rd64(sec + 56) ^ pd_xxh_rd64(sec + 64));
    if (len <= 3) {
        pd_u32 c1 = in[0], c2 = in[len >> 1], c3 = in[len - 1];
        pd_u32 combo = (c1 << 16) | (c2 << 24) | c3 | ((pd_u32)len << 8);
        pd_u64 flip = (pd_u64)(pd_xxh_rd32(sec) ^ pd_xxh_rd32(sec + 4));
        return pd_xxh64_avalanche((pd_u64)combo ^ flip);
    }
    if (len <= 8) {
        pd_u32 in1 = pd_xxh_rd32(in), in2 = pd_xxh_rd32(in + len - 4);
        pd_u64 flip = pd_xxh_rd64(sec + 8) ^ pd_xxh_rd64(sec + 16);
        pd_u64 in64 = (pd_u64)in2 + ((pd_u64)in1 << 32);
        return pd_xxh3_rrmxmx(in64 ^ flip, len);
    }
    if (len <= 16) {
        pd_u64 flip1 = pd_xxh_rd64(sec + 24) ^ pd_xxh_rd64(sec + 32);
        pd_u64 flip2 = pd_xxh_rd64(sec + 40) ^ pd_xxh_rd64(sec + 48);
        pd_u64 lo = pd_xxh_rd64(in) ^ flip1;
        pd_u64 hi = pd_xxh_rd64(in + len - 8) ^ flip2;
        pd_u64 acc = len + pd_xxh_swap64(lo) + hi + pd_xxh_mul128_fold64(lo, hi);
        return pd_xxh3_avalanche(acc);
    }
    if (len <= 128) {
        pd_u64 acc = len * PD_XXH_P64_1;
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += pd_xxh3_mix16(in + 48, sec + 96);
                    acc += pd_xxh3_mix16(in + len - 64, sec + 112);
                }
                acc += pd_xxh3_mix16(in + 32, sec + 64);
                acc += pd_xxh3_mix16(in + len - 48, sec + 80);
            }
            acc += pd_xxh3_mix16(in + 16, sec + 32);
            acc += pd_xxh3_mix16(in + len - 32, sec + 48);
        }
        acc += pd_xxh3_mix16(in, sec);
        acc += pd_xxh3_mix16(in + len - 16, sec + 16);
        return pd_xxh3_avalanche(acc);
    }
    if (len <= 240) {
        pd_u64 acc = len * PD_XXH_P64_1;
        int rounds = (int)(len / 16);
        for (int i = 0; i < 8; i++) acc += pd_xxh3_mix16(in + 16 * i, sec + 16 * i);
        acc = pd_xxh3_avalanche(acc);
        for (int i = 8; i < rounds; i++) acc += pd_xxh3_mix16(in + 16 * i, sec + 16 * (i - 8) + 3);
        acc += pd_xxh3_mix16(in + len - 16, sec + PD_XXH_SECRET_MIN - 17);
        return pd_xxh3_avalanche(acc);
    }
    pd_u64 acc[8] = {PD_XXH_P32_3, PD_XXH_P64_1, PD_XXH_P64_2, PD_XXH_P64_3,
                     PD_XXH_P64_4, PD_XXH_P32_2, PD_XXH_P64_5, PD_XXH_P32_1};
    pd_u64 stripes_per_block = (sec_len - PD_XXH_STRIPE) / 8;
    pd_u64 block_len = PD_XXH_STRIPE * stripes_per_block;
    pd_u64 blocks = (len - 1) / block_len;
    for (pd_u64 b = 0; b < blocks; b++) {
        for (pd_u64 s = 0; s < stripes_per_block; s++)
            pd_xxh3_accumulate_512(acc, in + b * block_len + s * PD_XXH_STRIPE, sec + s * 8);
        pd_xxh3_scramble(acc, sec + sec_len - PD_XXH_STRIPE);
    }
    pd_u64 stripes = ((len - 1) - block_len * blocks) / PD_XXH_STRIPE;
    for (pd_u64 s = 0; s < stripes; s++)
        pd_xxh3_accumulate_512(acc, in + blocks * block_len + s * PD_XXH_STRIPE, sec + s * 8);
    pd_xxh3_accumulate_512(acc, in + len - PD_XXH_STRIPE, sec + sec_len - PD_XXH_STRIPE - 7);
    pd_u64 h = len * PD_XXH_P64_1;
    for (int i = 0; i < 4; i++)
        h += pd_xxh_mul128_fold64(acc[2 * i] ^ pd_xxh_rd64(sec + 11 + 16 * i),
                                  acc[2 * i + 1] ^ pd_xxh_rd64(sec + 11 + 16 * i + 8));
    return pd_xxh3_avalanche(h);
}

// page_checksum_xxh3 — grid.x = n (one block per page), block 1 (with a bigger block,
// thread 0 alone does the work; correctness over speed).
// out[i] = XXH3-64 with secret (secret, secret_len) of the page_bytes bytes at
// pages + page_off[i]. secret_len must be at least 136 (pdmesh's is 192); a shorter one
// gives 0.
extern "C" __global__ void page_checksum_xxh3(const unsigned char* pages, long long page_bytes,
                                              const long long* page_off,
                                              const unsigned char* secret, int secret_len,
                                              unsigned long long* out, int n) {
    int i = blockIdx.x;
    if (i >= n || threadIdx.x != 0) return;
    if (secret_len < PD_XXH_SECRET_MIN) {
        out[i] = 0;
        return;
    }
    out[i] = pd_xxh3_64_with_secret(pages + page_off[i], (pd_u64)page_bytes, secret,
                                    (pd_u64)secret_len);
}

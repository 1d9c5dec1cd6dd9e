//! The page checksum: XXH3-64 under a fixed 192-byte secret of pdmesh's own (derived below
//! with splitmix64), over a page's bytes. Producers compute it when they write a page to
//! the host tier; the cache service checks it at commit; every consumer checks it on load.
//!
//! [`copy_and_checksum`] copies a page and computes the same checksum in one pass over the
//! source, so a load reads each byte once: the hashing rides on the copy's memory traffic.
//! [`copy_to_and_checksum`] does the same for a producer writing into shared memory.

/// Bytes in the XXH3 secret.
const SECRET_LEN: usize = 192;

const fn splitmix64(state: u64) -> (u64, u64) {
    let s = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (s, z ^ (z >> 31))
}

const fn make_secret() -> [u8; SECRET_LEN] {
    let mut out = [0u8; SECRET_LEN];
    // "pdmesh page checksum v1"
    let mut state = 0x7064_6d65_7368_0001u64;
    let mut i = 0;
    while i < SECRET_LEN / 8 {
        let (s, v) = splitmix64(state);
        state = s;
        let b = v.to_le_bytes();
        let mut j = 0;
        while j < 8 {
            out[i * 8 + j] = b[j];
            j += 1;
        }
        i += 1;
    }
    out
}

static SECRET: [u8; SECRET_LEN] = make_secret();

/// The XXH3 secret page checksums use, for implementations elsewhere (the GPU's
/// `page_checksum_xxh3` kernel) that must give the same values.
pub fn checksum_secret() -> &'static [u8] {
    &SECRET
}

/// The checksum of a page's bytes.
pub fn page_checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_secret(bytes, &SECRET)
}

const STRIPE: usize = 64;
const STRIPES_PER_BLOCK: usize = (SECRET_LEN - STRIPE) / 8;
const BLOCK: usize = STRIPE * STRIPES_PER_BLOCK;
const P32_1: u64 = 0x9E37_79B1;
const P32_2: u64 = 0x85EB_CA77;
const P32_3: u64 = 0xC2B2_AE3D;
const P64_1: u64 = 0x9E37_79B1_85EB_CA87;
const P64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P64_3: u64 = 0x1656_67B1_9E37_79F9;
const P64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const P64_5: u64 = 0x27D4_EB2F_1656_67C5;

#[inline(always)]
fn secret_u64(at: usize) -> u64 {
    u64::from_le_bytes(SECRET[at..at + 8].try_into().expect("8 bytes"))
}

#[inline(always)]
fn accumulate(acc: &mut [u64; 8], data: &[u64; 8], secret_at: usize) {
    for i in 0..8 {
        let key = data[i] ^ secret_u64(secret_at + 8 * i);
        acc[i ^ 1] = acc[i ^ 1].wrapping_add(data[i]);
        acc[i] = acc[i].wrapping_add((key & 0xFFFF_FFFF).wrapping_mul(key >> 32));
    }
}

#[inline(always)]
fn scramble(acc: &mut [u64; 8]) {
    for (i, a) in acc.iter_mut().enumerate() {
        let mut v = *a;
        v ^= v >> 47;
        v ^= secret_u64(SECRET_LEN - STRIPE + 8 * i);
        *a = v.wrapping_mul(P32_1);
    }
}

fn mix2(a: u64, b: u64, secret_at: usize) -> u64 {
    let p = u128::from(a ^ secret_u64(secret_at)) * u128::from(b ^ secret_u64(secret_at + 8));
    (p as u64) ^ ((p >> 64) as u64)
}

/// One stripe of the source: copied to `dst` and returned as little-endian words.
///
/// # Safety
/// `src` must be readable and `dst` writable for `STRIPE` bytes.
#[inline(always)]
unsafe fn stripe(src: *const u8, dst: *mut u8) -> [u64; 8] {
    let mut w = [0u64; 8];
    for (i, word) in w.iter_mut().enumerate() {
        // SAFETY: the caller guarantees STRIPE readable bytes.
        *word = u64::from_le(unsafe { (src.add(8 * i) as *const u64).read_unaligned() });
    }
    for (i, word) in w.iter().enumerate() {
        // SAFETY: the caller guarantees STRIPE writable bytes.
        unsafe { (dst.add(8 * i) as *mut u64).write_unaligned(word.to_le()) };
    }
    w
}

/// # Safety
/// `src` must be readable and `dst` writable for `len` bytes, `len` > 240, and the two
/// must not overlap.
#[inline(always)]
unsafe fn copy_long(src: *const u8, dst: *mut u8, len: usize) -> u64 {
    let mut acc = [P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1];
    let blocks = (len - 1) / BLOCK;
    for n in 0..blocks {
        for s in 0..STRIPES_PER_BLOCK {
            let at = n * BLOCK + s * STRIPE;
            // SAFETY: at + STRIPE <= blocks * BLOCK < len.
            let w = unsafe { stripe(src.add(at), dst.add(at)) };
            accumulate(&mut acc, &w, s * 8);
        }
        scramble(&mut acc);
    }
    let stripes = ((len - 1) - blocks * BLOCK) / STRIPE;
    for s in 0..stripes {
        let at = blocks * BLOCK + s * STRIPE;
        // SAFETY: at + STRIPE <= len - 1.
        let w = unsafe { stripe(src.add(at), dst.add(at)) };
        accumulate(&mut acc, &w, s * 8);
    }
    // The tail not yet copied, then the last (overlapping) stripe, read back from `dst`.
    let done = blocks * BLOCK + stripes * STRIPE;
    // SAFETY: `src` is readable and `dst` writable for len bytes; they do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done) };
    let mut last = [0u64; 8];
    for (i, word) in last.iter_mut().enumerate() {
        // SAFETY: len - STRIPE + 8 * i + 8 <= len; `dst` was just written there.
        *word =
            u64::from_le(unsafe { (dst.add(len - STRIPE + 8 * i) as *const u64).read_unaligned() });
    }
    accumulate(&mut acc, &last, SECRET_LEN - STRIPE - 7);
    let mut h = (len as u64).wrapping_mul(P64_1);
    for i in 0..4 {
        h = h.wrapping_add(mix2(acc[2 * i], acc[2 * i + 1], 11 + 16 * i));
    }
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_long_avx2(src: *const u8, dst: *mut u8, len: usize) -> u64 {
    // SAFETY: forwarded from the caller.
    unsafe { copy_long(src, dst, len) }
}

/// Copies `dst.len()` bytes from `src` into `dst` and returns their [`page_checksum`],
/// reading the source once.
///
/// # Safety
/// `src` must be valid for reads of `dst.len()` bytes for the whole call, and must not
/// overlap `dst`.
pub unsafe fn copy_and_checksum(src: *const u8, dst: &mut [u8]) -> u64 {
    // SAFETY: as the caller guarantees; `dst` is a live buffer of its length.
    unsafe { copy_raw(src, dst.as_mut_ptr(), dst.len()) }
}

/// Copies `src` to `dst` and returns [`page_checksum`] of the bytes copied, reading `src`
/// once: how a producer writes a page into shared memory.
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes for the whole call, and must not
/// overlap `src`.
pub unsafe fn copy_to_and_checksum(src: &[u8], dst: *mut u8) -> u64 {
    // SAFETY: as the caller guarantees; `src` is a live buffer of its length.
    unsafe { copy_raw(src.as_ptr(), dst, src.len()) }
}

/// The checksum is of the bytes as they landed in `dst`.
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes, not overlapping.
unsafe fn copy_raw(src: *const u8, dst: *mut u8, len: usize) -> u64 {
    if len <= 240 {
        // SAFETY: as the caller guarantees.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        let mut small = [0u8; 240];
        // SAFETY: `dst` was just written for len bytes.
        unsafe { std::ptr::copy_nonoverlapping(dst, small.as_mut_ptr(), len) };
        return page_checksum(&small[..len]);
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2; the pointer contract is the caller's.
        return unsafe { copy_long_avx2(src, dst, len) };
    }
    // SAFETY: as the caller guarantees; len > 240.
    unsafe { copy_long(src, dst, len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fused_copy_gives_the_reference_checksum_and_the_same_bytes() {
        let src: Vec<u8> = (0..400_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for len in [
            0,
            17,
            240,
            241,
            1023,
            1024,
            1025,
            4096 + 17,
            368_640,
            400_000,
        ] {
            let mut dst = vec![0u8; len];
            // SAFETY: src holds at least len bytes and does not overlap dst.
            let h = unsafe { copy_and_checksum(src.as_ptr(), &mut dst) };
            assert_eq!(dst, src[..len], "len {len}");
            assert_eq!(h, page_checksum(&src[..len]), "len {len}");
            let mut out = vec![0u8; len];
            // SAFETY: out holds len bytes and does not overlap src.
            let h2 = unsafe { copy_to_and_checksum(&src[..len], out.as_mut_ptr()) };
            assert_eq!((h2, &out[..]), (h, &src[..len]), "len {len}");
        }
        // A different byte changes the checksum; the secret is not XXH3's default.
        let mut other = src[..4096].to_vec();
        other[1234] ^= 1;
        assert_ne!(page_checksum(&other), page_checksum(&src[..4096]));
        assert_ne!(
            page_checksum(&src[..4096]),
            xxhash_rust::xxh3::xxh3_64(&src[..4096])
        );
    }
}

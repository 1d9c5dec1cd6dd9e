//! checksum.cu: the page checksum (XXH3-64 under pdmesh's secret), bit-exact with
//! pdmesh-kv's for every length class.

use rand::Rng;

use crate::emu::{c, emu, m, rng};

type ChecksumFn = unsafe extern "C" fn(*const u8, i64, *const i64, *const u8, i32, *mut u64, i32);

#[test]
fn page_checksum_xxh3_bit_exact() {
    let e = emu();
    let k: ChecksumFn = e.kernel("page_checksum_xxh3");
    let secret = pdmesh_kv::checksum_secret();
    let mut r = rng(2);
    let data: Vec<u8> = (0..40_000).map(|_| r.random()).collect();
    // Every length class of XXH3: 0, 1-3, 4-8, 9-16, 17-128, 129-240, long (stripes,
    // whole blocks, a partial last stripe).
    for len in [
        0usize, 1, 3, 4, 8, 9, 16, 17, 100, 128, 129, 200, 240, 241, 1000, 1024, 4096, 4103, 9000,
    ] {
        let offs: Vec<i64> = vec![0, 7, (data.len() - len) as i64, 333];
        let mut out = vec![0u64; offs.len()];
        let (pd, po, psec, pout) = (c(&data), c(&offs), c(secret), m(&mut out));
        let n = offs.len() as i32;
        let sl = secret.len() as i32;
        // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
        e.launch((offs.len() as u32, 1), 1, || unsafe {
            k(pd.p(), len as i64, po.p(), psec.p(), sl, pout.p(), n)
        });
        for (o, got) in offs.iter().zip(&out) {
            let want = pdmesh_kv::page_checksum(&data[*o as usize..*o as usize + len]);
            assert_eq!(*got, want, "len {len} offset {o}");
        }
    }
}

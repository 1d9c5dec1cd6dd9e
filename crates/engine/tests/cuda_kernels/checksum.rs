//! checksum.cu: the page checksum, bit-exact with pdmesh-kv's.

use cudarc::driver::PushKernelArg;
use pdmesh_engine::cuda::device::grid;
use pdmesh_kv::{DType, KvLayout};
use rand::Rng;

use crate::support::{down, gpu, rng, up};

// ---- page_checksum_xxh3 -----------------------------------------------------------------

/// Bit-exact with `pdmesh_kv::page_checksum` for every XXH3 length class (0, 1–3, 4–8,
/// 9–16, 17–128, 129–240, > 240 with one and several 1024-byte blocks, exactly a block,
/// one past) and page sizes of real layouts, each from several offsets, unaligned included.
#[test]
fn page_checksum_xxh3_is_bit_exact_with_the_cpu() {
    let g = gpu();
    let s = &g.compute;
    let mut r = rng(15);
    let llama_page = KvLayout::llama(2, 8, 128, DType::F16, 16).bytes_per_page();
    let mut lengths: Vec<usize> = (0..=256).collect();
    lengths.extend([
        1023,
        1024,
        1025,
        1087,
        1088,
        2047,
        2048,
        2049,
        4096,
        65536 + 7,
        llama_page,
        llama_page - 1,
        KvLayout::llama(1, 2, 64, DType::F16, 16).bytes_per_page(),
    ]);
    let max_len = *lengths.iter().max().unwrap();
    let mut data = vec![0u8; max_len + 4096];
    r.fill(&mut data[..]);
    let secret = pdmesh_kv::checksum_secret();
    let dsecret = up(s, secret);
    let sl = secret.len() as i32;
    let ddata = up(s, &data);
    for &len in &lengths {
        let room = data.len() - len;
        let offs: Vec<i64> = vec![
            0,
            1,
            3,
            8,
            4096.min(room) as i64,
            r.random_range(0..=room) as i64,
        ];
        let n = offs.len();
        let doff = up(s, &offs);
        let mut out = s.alloc_zeros::<u64>(n).unwrap();
        let (pb, ni) = (len as i64, n as i32);
        let mut b = s.launch_builder(g.kernel("page_checksum_xxh3"));
        b.arg(&ddata)
            .arg(&pb)
            .arg(&doff)
            .arg(&dsecret)
            .arg(&sl)
            .arg(&mut out)
            .arg(&ni);
        // SAFETY: page_checksum_xxh3(const unsigned char*, long long, const long long*,
        // const unsigned char*, int, unsigned long long*, int); every offset + len lies in
        // data, out holds n.
        unsafe { b.launch(grid((n as u32, 1, 1), 1)) }.unwrap();
        let got = down(s, &out);
        for (i, &o) in offs.iter().enumerate() {
            let want = pdmesh_kv::page_checksum(&data[o as usize..o as usize + len]);
            // Tolerance: exact.
            assert_eq!(
                got[i], want,
                "page_checksum_xxh3 length {len} at offset {o}: GPU {:#018x}, CPU {want:#018x} (exact)",
                got[i]
            );
        }
    }
}

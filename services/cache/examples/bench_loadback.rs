//! Host → worker load-back bandwidth over the shm data plane, beside a plain memcpy of
//! the same bytes in the same run, and the share of the load-back spent on checksums.
//!
//! `cargo run --release -p pdmesh-cache --example bench_loadback -- [PAGES] [ROUNDS]`
//!
//! Pages have SmolLM2-135M's KV layout (30 layers, K and V of 3 × 64 f16, 16-token
//! pages: 368,640 bytes). A cache service runs in-process on loopback with its mirror in
//! /dev/shm; one worker-side client stores the pages, then each round matches and loads all
//! of them into a destination buffer (copy + xxh3-64 check per page, pins released).

use std::time::Instant;

use pdmesh_kv::page_hashes;

mod common;

use common::{median, pages_and_rounds, serve, shm_client, smol};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (pages, rounds, _) = pages_and_rounds();
    let layout = smol();
    let pb = layout.bytes_per_page();

    let server = serve((pages * pb * 2) as u64).await;
    let mut c = shm_client(&server.url(), "bench", &layout).await.unwrap();

    let tokens: Vec<u32> = (0..(pages * 16) as u32).collect();
    let hashes = page_hashes(layout.fingerprint(), &tokens, 16);
    let src: Vec<Vec<u8>> = (0..pages)
        .map(|i| (0..pb).map(|j| (i * 31 + j * 7) as u8).collect())
        .collect();
    let batch: Vec<(u64, u64, &[u8])> = hashes
        .iter()
        .enumerate()
        .map(|(i, &h)| (h, if i == 0 { 0 } else { hashes[i - 1] }, &src[i][..]))
        .collect();
    let stored = c.store(&batch).await.unwrap();
    assert_eq!(stored.written, pages);

    let mut dst = vec![vec![0u8; pb]; pages];
    let flat_src: Vec<u8> = src.concat();
    let mut flat_dst = vec![0u8; flat_src.len()];
    // A mapping of the bench's own, for the one-thread measurements.
    let mirror = {
        let m = c.mirror().expect("shm plane");
        pdmesh_cache::mirror::Mirror::open(m.path(), m.page_bytes(), m.pages()).unwrap()
    };
    let slots: Vec<u32> = {
        let refs = c.match_pages(&hashes).await.unwrap();
        let s: Vec<u32> = refs.iter().map(|r| r.slot).collect();
        c.release(&s).await.unwrap();
        s
    };
    let (mut load, mut copy, mut plain1, mut fused1) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        let refs = c.match_pages(&hashes).await.unwrap();
        let mut d: Vec<&mut [u8]> = dst.iter_mut().map(|b| &mut b[..]).collect();
        let l = c.load_into(&refs, &mut d).await.unwrap();
        load.push(t.elapsed().as_secs_f64());
        assert_eq!(l.pages, pages);

        let t = Instant::now();
        flat_dst.copy_from_slice(&flat_src);
        copy.push(t.elapsed().as_secs_f64());
        std::hint::black_box(&flat_dst);

        // One thread, mirror to buffers: copy alone, then copy with the checksum.
        let t = Instant::now();
        for (s, d) in slots.iter().zip(dst.iter_mut()) {
            mirror.read(*s, d);
        }
        plain1.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let mut acc = 0u64;
        for (s, d) in slots.iter().zip(dst.iter_mut()) {
            acc ^= mirror.read_checked(*s, d);
        }
        fused1.push(t.elapsed().as_secs_f64());
        std::hint::black_box(acc);
    }
    assert!(dst.iter().zip(&src).all(|(a, b)| a == b));
    let bytes = (pages * pb) as f64;
    let (l, m) = (median(load), median(copy));
    let (p1, f1) = (median(plain1), median(fused1));
    println!(
        "{pages} pages of {pb} B ({:.1} MiB), median of {rounds} rounds",
        bytes / (1 << 20) as f64
    );
    println!(
        "load-back over shm (match, copy with checksum check, release): {:.2} GB/s",
        bytes / l / 1e9
    );
    println!(
        "plain memcpy of the same bytes:                                {:.2} GB/s",
        bytes / m / 1e9
    );
    println!("load-back / memcpy = {:.2}x", m / l);
    println!(
        "one thread, mirror to buffers: copy {:.2} GB/s, copy + checksum {:.2} GB/s: the checksum is {:.1}% of the load-back time",
        bytes / p1 / 1e9,
        bytes / f1 / 1e9,
        100.0 * (f1 - p1).max(0.0) / f1
    );
    drop(c);
    server.stop().await.unwrap();
}

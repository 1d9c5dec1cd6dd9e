//! The tcp page transport's throughput, beside a plain TCP stream of the same bytes over
//! the same link in the same run.
//!
//! `cargo run --release -p pdmesh-cache --example bench_tcp -- [PAGES] [ROUNDS] [ADDR]`
//!
//! Pages have SmolLM2-135M's KV layout (368,640 bytes each). The receiver runs in-process
//! and listens on ADDR (default 127.0.0.1:0; give a veth address to measure a link
//! between network namespaces). Each round sends PAGES pages as one room: batches,
//! checksums checked on arrival, acknowledgements. The baseline writes the same bytes
//! down one TCP connection with no framing and no checksums, the receiver only reading
//! them, which is what iperf3 measures.

use std::net::SocketAddr;
use std::time::Instant;

use pdmesh_cache::transfer::{InPage, OutPage, TcpOptions, TcpSender, Transport, serve_connection};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

mod common;

use common::{median, pages_and_rounds, smol};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (pages, rounds, rest) = pages_and_rounds();
    let addr: SocketAddr = rest
        .first()
        .map_or("127.0.0.1:0", String::as_str)
        .parse()
        .expect("ADDR");
    let layout = smol();
    let page_bytes = layout.bytes_per_page();
    let data: Vec<Vec<u8>> = (0..pages)
        .map(|i| (0..page_bytes).map(|b| (b ^ i) as u8).collect())
        .collect();
    let out = OutPage::numbered(&data);
    let total = (pages * page_bytes) as f64;

    // The transport.
    let listener = TcpListener::bind(addr).await.unwrap();
    let at = listener.local_addr().unwrap();
    let l2 = layout.clone();
    // The mesh token, checked in the hello as in production.
    let auth = pdmesh_tls::MeshAuth::token(pdmesh_tls::MeshToken::generate());
    let theirs = auth.clone();
    tokio::spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        serve_connection(s, &theirs, &l2, TcpOptions::default(), |_: InPage<'_>| {
            Ok::<(), std::convert::Infallible>(())
        })
        .await
        .unwrap();
    });
    let mut tx = TcpSender::connect(
        at,
        &layout,
        TcpOptions::default(),
        (&auth, "127.0.0.1"),
        pdmesh_cache::Lease::random(),
    )
    .await
    .unwrap();
    let mut ours = Vec::new();
    for room in 0..rounds {
        let t = Instant::now();
        tx.send(room as u64, &out[..], None).await.unwrap();
        ours.push(total / t.elapsed().as_secs_f64() / 1e9);
    }

    // Plain TCP: the same bytes, read and dropped.
    let listener = TcpListener::bind(addr).await.unwrap();
    let at = listener.local_addr().unwrap();
    let want = pages * page_bytes;
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let mut left = want;
            while left > 0 {
                let n = s.read(&mut buf[..left.min(1 << 20)]).await.unwrap();
                if n == 0 {
                    return;
                }
                left -= n;
            }
            s.write_u8(1).await.unwrap();
        }
    });
    let mut s = TcpStream::connect(at).await.unwrap();
    s.set_nodelay(true).unwrap();
    let mut plain = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        for p in &data {
            s.write_all(p).await.unwrap();
        }
        s.read_u8().await.unwrap();
        plain.push(total / t.elapsed().as_secs_f64() / 1e9);
    }
    let (a, b) = (median(ours), median(plain));
    println!(
        "{pages} pages x {page_bytes} B, {rounds} rounds, median: tcp transport {a:.2} GB/s, plain TCP {b:.2} GB/s, ratio {:.2}",
        a / b
    );
}

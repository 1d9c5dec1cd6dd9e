//! Rooms moved between two hosts' cache services, timed end to end: a sender writes a
//! room's pages into host A's mirror and commits; A moves them to host B over the tcp page
//! transport and commits there; the receiver on B takes them. Run it on host A (the
//! mirrors are shared memory, so the sender and receiver both map theirs from here) with
//! both services already up; `scripts/bench/hosts.sh` makes the hosts (network
//! namespaces on one machine) and runs iperf3 over the same link beside it.
//!
//! `cargo run --release -p pdmesh-cache --example bench_hosts -- LAYOUT PAGES ROUNDS A_URL B_URL [ROOMS]`
//!
//! LAYOUT: `smol` (SmolLM2-135M, 16-token pages, 368,640 bytes) or `deepseek-tiny`
//! (deepseek-v32-tiny with fp8 index-K: MLA latent bf16 and index-K per token, 4 layers).
//! ROOMS (default 1): rooms committed at once per round, as under load; the figure is then
//! all their bytes over the round's time.
//! Prints one JSON line: GB/s of page bytes moved per round (median).

use std::time::{Duration, Instant};

use pdmesh_cache::client::RoomOpen;
use pdmesh_kv::{IndexKDtype, KvLayout, MlaCacheDtype, MlaDims};
use pdmesh_proto::cache::v1 as pb;

mod common;

use common::{median, shm_client, smol};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (layout, pages, rounds, a_url, b_url, rooms) = match &args[..] {
        [_, l, p, r, a, b] => (l, p, r, a, b, 1),
        [_, l, p, r, a, b, k] => (l, p, r, a, b, k.parse().expect("ROOMS is a number")),
        _ => panic!("usage: bench_hosts LAYOUT PAGES ROUNDS A_URL B_URL [ROOMS]"),
    };
    let layout = match layout.as_str() {
        "smol" => smol(),
        "deepseek-tiny" => {
            let dims = MlaDims {
                kv_lora_rank: 128,
                rope_dim: 32,
                index_head_dim: 128,
            };
            KvLayout::deepseek_v32(4, dims, MlaCacheDtype::Bf16, IndexKDtype::Fp8, 16)
                .expect("a valid layout")
        }
        other => panic!("unknown layout {other:?} (smol, deepseek-tiny)"),
    };
    let (pages, rounds): (usize, usize) = (pages.parse().unwrap(), rounds.parse().unwrap());
    let a = shm_client(a_url, "bench-sender", &layout)
        .await
        .expect("host A's cache service");
    let b = shm_client(b_url, "bench-receiver", &layout)
        .await
        .expect("host B's cache service");
    let page_bytes = layout.bytes_per_page();
    let data: Vec<Vec<u8>> = (0..pages)
        .map(|i| (0..page_bytes).map(|x| (x ^ (i * 7)) as u8).collect())
        .collect();
    let mut rates = Vec::new();
    for round in 0..rounds + 1 {
        // `rooms` rooms open, written and committed at once, as requests under load are.
        let ids: Vec<u64> = (0..rooms as u64)
            .map(|k| 1_000 + (round * rooms) as u64 + k)
            .collect();
        let mut commits = Vec::new();
        for &room in &ids {
            b.room_open(room, pb::RoomSide::Receiver, "bench", "")
                .await
                .unwrap();
            let how = RoomOpen {
                home: b_url,
                held_pages: 0,
            };
            a.room_open_with(room, pb::RoomSide::Sender, "bench", "", how)
                .await
                .unwrap();
            let slots = a.room_start(room, pages as u32).await.unwrap();
            let m = a.shared_mirror().unwrap();
            let written: Vec<pb::RoomPage> = slots
                .iter()
                .zip(&data)
                .map(|(&slot, d)| pb::RoomPage {
                    slot,
                    checksum: m.write_checked(slot, d),
                })
                .collect();
            let aux = pb::RoomAux {
                room,
                prompt_tokens: (pages * 16) as u32,
                ..Default::default()
            };
            commits.push((room, written, aux));
        }
        let t0 = Instant::now();
        let done = futures::future::join_all(
            commits
                .into_iter()
                .map(|(room, written, aux)| a.room_commit(room, written, aux)),
        )
        .await;
        let secs = t0.elapsed().as_secs_f64();
        for d in done {
            d.unwrap();
        }
        for &room in &ids {
            let st = b
                .room_wait(room, pb::RoomState::Success, Duration::from_secs(5))
                .await
                .unwrap();
            assert_eq!(st.state, pb::RoomState::Success as i32, "{st:?}");
            b.room_finish(room).await.unwrap();
        }
        if round > 0 {
            // The first round connects and warms up.
            rates.push((rooms * pages * page_bytes) as f64 / secs / 1e9);
        }
    }
    eprintln!("per round GB/s: {rates:.2?}");
    println!(
        "{{\"layout\": \"{}\", \"pages\": {pages}, \"rooms\": {rooms}, \"page_bytes\": {page_bytes}, \"rounds\": {rounds}, \"gbytes_per_s\": {:.3}}}",
        args[1],
        median(rates)
    );
}

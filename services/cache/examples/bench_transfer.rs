//! Prefill → decode KV transfer bandwidth through a room over the shm data plane, beside
//! memcpy of the same bytes in the same run.
//!
//! `cargo run --release -p pdmesh-cache --example bench_transfer -- [PAGES] [ROUNDS]`
//!
//! Pages have SmolLM2-135M's KV layout (368,640 bytes each). A cache service runs
//! in-process on loopback with its mirror in /dev/shm; a sender and a receiver client
//! (two leases, as a prefill and a decode worker have) meet in a fresh room each round:
//! the receiver opens it, the sender opens it, starts it, writes its pages into the
//! granted slots with their checksums, commits with the aux data; the receiver waits for
//! success, takes the result, copies each page out checking its checksum, and finishes
//! the room. That is every step a PD request's hand-over takes, RPCs included.
//!
//! Baselines, each over the same bytes: the same two copies through the same mirror
//! slots with plain memcpy and no protocol (what the transfer would cost with no
//! checksums and no rendezvous), and one memcpy from buffer to buffer.

use std::time::{Duration, Instant};

use pdmesh_proto::cache::v1 as pb;

mod common;

use common::{median, pages_and_rounds, serve, shm_client, smol};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (pages, rounds, _) = pages_and_rounds();
    let layout = smol();
    let pb_ = layout.bytes_per_page();

    let server = serve((pages * pb_ * 2) as u64).await;
    let url = server.url();
    let sender = shm_client(&url, "prefill", &layout).await.unwrap();
    let receiver = shm_client(&url, "decode", &layout).await.unwrap();
    let (smirror, rmirror) = (
        sender.shared_mirror().expect("shm plane"),
        receiver.shared_mirror().expect("shm plane"),
    );

    let src: Vec<Vec<u8>> = (0..pages)
        .map(|i| (0..pb_).map(|j| (i * 31 + j * 7) as u8).collect())
        .collect();
    let mut dst = vec![vec![0u8; pb_]; pages];
    let flat_src: Vec<u8> = src.concat();
    let mut flat_dst = vec![0u8; flat_src.len()];

    let (mut transfer, mut via_shm, mut copy) = (Vec::new(), Vec::new(), Vec::new());
    let mut last_slots = Vec::new();
    for round in 0..rounds as u64 {
        let room = 1000 + round;
        let t = Instant::now();
        receiver
            .room_open(room, pb::RoomSide::Receiver, "bench", "")
            .await
            .unwrap();
        sender
            .room_open(room, pb::RoomSide::Sender, "bench", "")
            .await
            .unwrap();
        let slots = sender.room_start(room, pages as u32).await.unwrap();
        assert_eq!(slots.len(), pages);
        let sums: Vec<pb::RoomPage> = src
            .iter()
            .zip(&slots)
            .map(|(page, &slot)| pb::RoomPage {
                slot,
                checksum: smirror.write_checked(slot, page),
            })
            .collect();
        let aux = pb::RoomAux {
            room,
            first_token: 1,
            first_logprob: f32::NAN,
            prompt_tokens: (pages * 16) as u32,
            ..Default::default()
        };
        sender.room_commit(room, sums, aux).await.unwrap();
        let st = receiver
            .room_wait(room, pb::RoomState::Success, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(st.state(), pb::RoomState::Success);
        let got = receiver.room_result(room).await.unwrap();
        for (p, d) in got.pages.iter().zip(dst.iter_mut()) {
            assert_eq!(rmirror.read_checked(p.slot, d), p.checksum, "page corrupt");
        }
        receiver.room_finish(room).await.unwrap();
        transfer.push(t.elapsed().as_secs_f64());
        last_slots = got.pages.iter().map(|p| p.slot).collect();

        // The same two copies through the same slots, plain.
        let t = Instant::now();
        for (s, page) in last_slots.iter().zip(&src) {
            smirror.write(*s, page);
        }
        for (s, d) in last_slots.iter().zip(dst.iter_mut()) {
            rmirror.read(*s, d);
        }
        via_shm.push(t.elapsed().as_secs_f64());

        let t = Instant::now();
        flat_dst.copy_from_slice(&flat_src);
        copy.push(t.elapsed().as_secs_f64());
        std::hint::black_box(&flat_dst);
    }
    assert_eq!(last_slots.len(), pages);
    assert!(dst.iter().zip(&src).all(|(a, b)| a == b));
    let bytes = (pages * pb_) as f64;
    let (t, s, m) = (median(transfer), median(via_shm), median(copy));
    println!(
        "{pages} pages of {pb_} B ({:.1} MiB), median of {rounds} rounds",
        bytes / (1 << 20) as f64
    );
    println!(
        "room transfer over shm (open, start, write + checksum, commit, result, read + check, finish): {:.2} GB/s ({:.2} ms)",
        bytes / t / 1e9,
        t * 1e3
    );
    println!(
        "memcpy over shm (the same two copies through the same slots, no checks):           {:.2} GB/s",
        bytes / s / 1e9
    );
    println!(
        "one memcpy, buffer to buffer:                                                       {:.2} GB/s",
        bytes / m / 1e9
    );
    println!(
        "transfer / memcpy over shm = {:.2}x; transfer / one memcpy = {:.2}x",
        s / t,
        m / t
    );
    drop((sender, receiver));
    server.stop().await.unwrap();
}

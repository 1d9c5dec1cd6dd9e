//! Rooms across hosts: two cache services (each with its own mirror, as on two machines)
//! over real gRPC and the tcp page transport on loopback. A sender on host A names the
//! receiver's host B as the room's home: A relays the room there, lends the sender its own
//! slots and moves the pages at commit. Pages arrive bit for bit; another layout is
//! refused naming both; a receiver's abort, a lost sender and a vanished host each fail
//! the room on the surviving side in bounded time with every slot given back.
//! (Across network namespaces, with real workers: tests/e2e/test_hosts.py.)

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use pdmesh_cache::client::{DataPlane, HostClient, RoomOpen};
use pdmesh_kv::{DType, KvLayout};
use pdmesh_proto::cache::v1 as pb;
use tokio::net::TcpListener;

mod common;

/// One host's cache service, with its own mirror.
use common::Server as Host;
use common::{bytes_from, dsv32, host_client, serve};

const PAGES: usize = 64;

/// Two hosts' cache services, each with the other on its `--peer` list (the mesh token
/// alone lets no room be relayed to a home the list does not name).
async fn hosts(a: &KvLayout, b: &KvLayout, lease_ttl_ms: u64, transfer_ms: u64) -> (Host, Host) {
    hosts_and(a, b, (lease_ttl_ms, transfer_ms), None).await
}

/// [`hosts`], where `a` may also relay to `also` (another way to reach `b`).
async fn hosts_and(
    a: &KvLayout,
    b: &KvLayout,
    (lease_ttl_ms, transfer_ms): (u64, u64),
    also: Option<String>,
) -> (Host, Host) {
    let (la, lb) = (
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
    );
    let url = |l: &TcpListener| format!("http://{}", l.local_addr().unwrap());
    let (ua, ub) = (url(&la), url(&lb));
    let to_b = std::iter::once(ub).chain(also).collect();
    (
        host(la, a, to_b, lease_ttl_ms, transfer_ms),
        host(lb, b, vec![ua], lease_ttl_ms, transfer_ms),
    )
}

fn host(
    listener: TcpListener,
    layout: &KvLayout,
    peers: Vec<String>,
    lease_ttl_ms: u64,
    transfer_ms: u64,
) -> Host {
    serve(
        listener,
        (2 * PAGES * layout.bytes_per_page()) as u64,
        |cfg| {
            cfg.lease_ttl_ms = lease_ttl_ms;
            cfg.room_transfer_ms = transfer_ms;
            cfg.peer_io_timeout_ms = 1_000;
            cfg.peers = peers;
            // A stopped host vanishes at once, rooms under way or not (no drain).
            cfg.drain_timeout_ms = 0;
        },
    )
}

/// SmolLM2's KV layout with 16-token pages.
fn smol() -> KvLayout {
    KvLayout::llama(30, 3, 64, DType::F16, 16)
}

async fn worker(h: &Host, name: &str, layout: &KvLayout) -> HostClient {
    host_client(&h.url(), name, layout, DataPlane::Shm)
        .await
        .unwrap()
}

/// A prefill worker of layout `la` on host `a` and a decode worker of `lb` on `b`.
async fn workers(a: &Host, la: &KvLayout, b: &Host, lb: &KvLayout) -> (HostClient, HostClient) {
    (
        worker(a, "prefill", la).await,
        worker(b, "decode", lb).await,
    )
}

/// Room `room` as `c` sees it within `within`: failed, the reason naming `why`.
async fn failed(c: &HostClient, room: u64, within: Duration, why: &str) {
    let st = c
        .room_wait(room, pb::RoomState::Success, within)
        .await
        .unwrap();
    assert_eq!(st.state, pb::RoomState::Failed as i32);
    assert!(st.reason.contains(why), "{st:?}");
}

/// Waits until both hosts hold nothing for any room, then stops them.
async fn stop_at_baseline(a: Host, b: Host) {
    eventually(Duration::from_secs(5), "both hosts at baseline", || async {
        at_baseline(&a).await && at_baseline(&b).await
    })
    .await;
    a.stop().await;
    b.stop().await;
}

fn page(i: usize, bytes: usize) -> Vec<u8> {
    bytes_from((i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15), bytes)
}

fn aux(room: u64) -> pb::RoomAux {
    pb::RoomAux {
        room,
        first_token: 7,
        first_logprob: -0.25,
        prompt_tokens: (PAGES * 16) as u32,
        ..Default::default()
    }
}

/// Sender on `a` (home `b`) and receiver on `b`, up to the sender's slots.
async fn open_pair(a: &HostClient, b: &HostClient, home: &str, room: u64) -> Vec<u32> {
    let st = b
        .room_open(room, pb::RoomSide::Receiver, "req", "trace")
        .await
        .unwrap();
    assert_eq!(st.state, pb::RoomState::Bootstrapping as i32);
    let how = RoomOpen {
        home,
        held_pages: 0,
    };
    let st = a
        .room_open_with(room, pb::RoomSide::Sender, "req", "trace", how)
        .await
        .unwrap();
    assert_eq!(st.state, pb::RoomState::WaitingForInput as i32, "{st:?}");
    let st = a
        .room_wait(room, pb::RoomState::WaitingForInput, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(st.state, pb::RoomState::WaitingForInput as i32);
    a.room_start(room, PAGES as u32).await.unwrap()
}

/// Writes the pages into the sender's slots; returns their checksums.
fn write(a: &HostClient, slots: &[u32]) -> Vec<pb::RoomPage> {
    let m = a.shared_mirror().unwrap();
    slots
        .iter()
        .enumerate()
        .map(|(i, &slot)| pb::RoomPage {
            slot,
            checksum: m.write_checked(slot, &page(i, m.page_bytes())),
        })
        .collect()
}

/// Polls `f` until it holds, for at most `limit`.
async fn eventually<F, Fut>(limit: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = Instant::now() + limit;
    while !f().await {
        assert!(Instant::now() < until, "not within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Nothing held for rooms on either host.
async fn at_baseline(h: &Host) -> bool {
    let s = h.stats().await;
    s.room_slots == 0 && s.quarantined_slots == 0 && s.used_pages == 0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_cross_to_the_receivers_host_bit_for_bit_and_every_slot_comes_back() {
    let (a, b) = hosts(&smol(), &smol(), 10_000, 30_000).await;
    let (pa, db) = workers(&a, &smol(), &b, &smol()).await;
    for room in [11, 12] {
        let slots = open_pair(&pa, &db, &b.url(), room).await;
        let pages = write(&pa, &slots);
        pa.room_commit(room, pages.clone(), aux(room))
            .await
            .unwrap();
        let st = db
            .room_wait(room, pb::RoomState::Success, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(st.state, pb::RoomState::Success as i32);
        let got = db.room_result(room).await.unwrap();
        assert_eq!(got.aux, Some(aux(room)));
        let m = db.shared_mirror().unwrap();
        for (i, p) in got.pages.iter().enumerate() {
            let mut buf = vec![0u8; m.page_bytes()];
            assert_eq!(m.read_checked(p.slot, &mut buf), pages[i].checksum);
            assert!(buf == page(i, m.page_bytes()), "page {i} differs");
        }
        db.room_finish(room).await.unwrap();
    }
    let (sa, sb) = (a.stats().await, b.stats().await);
    let bytes = (2 * PAGES * smol().bytes_per_page()) as u64;
    assert_eq!(
        (sa.peer_pages_sent, sa.peer_bytes_sent),
        (2 * PAGES as u64, bytes)
    );
    assert_eq!(
        (sb.peer_pages_received, sb.peer_bytes_received),
        (2 * PAGES as u64, bytes)
    );
    assert_eq!(sb.rooms_finished, 2);
    assert!(at_baseline(&a).await && at_baseline(&b).await);
    a.stop().await;
    b.stop().await;
}

/// A prefill host of layout `sender` opens a room whose home, a decode host, has layout
/// `home`: refused (FAILED_PRECONDITION) naming both layouts, and nothing moves.
async fn home_refuses_naming_both(sender: &KvLayout, home: &KvLayout) {
    let (a, b) = hosts(sender, home, 10_000, 30_000).await;
    let (pa, db) = workers(&a, sender, &b, home).await;
    db.room_open(5, pb::RoomSide::Receiver, "req", "trace")
        .await
        .unwrap();
    let how = RoomOpen {
        home: &b.url(),
        held_pages: 0,
    };
    let err = pa
        .room_open_with(5, pb::RoomSide::Sender, "req", "trace", how)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    let msg = err.to_string();
    for want in [sender.to_string(), home.to_string()] {
        assert!(msg.contains(&want), "{msg} should name {want}");
    }
    assert!(msg.contains("B/token"), "{msg}");
    let (sa, sb) = (a.stats().await, b.stats().await);
    assert_eq!(sb.peer_layout_refusals, 1);
    assert_eq!((sa.peer_pages_sent, sb.peer_pages_received), (0, 0));
    assert!(at_baseline(&a).await);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_with_another_layout_is_refused_naming_both_and_nothing_moves() {
    use pdmesh_kv::IndexKDtype;
    // The seed's mismatch: fp8 index-K on the receiver's host, bf16 on the sender's.
    home_refuses_naming_both(&dsv32(IndexKDtype::Bf16), &dsv32(IndexKDtype::Fp8)).await;
}

/// The hybrid seed across hosts: the decode host's worker believes every Gemma 3 layer
/// global (the window group dropped; the same bytes per page).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_whose_layout_dropped_the_window_is_refused_naming_both() {
    home_refuses_naming_both(&common::gemma3(false), &common::gemma3(true)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_room_home_off_the_peer_list_is_refused_and_never_dialled() {
    let (a, b) = hosts(&smol(), &smol(), 10_000, 30_000).await;
    let pa = worker(&a, "prefill", &smol()).await;
    // A listener a caller names as the room's home: it must see no connection.
    let stranger = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let home = format!("http://{}", stranger.local_addr().unwrap());
    let how = RoomOpen {
        home: &home,
        held_pages: 0,
    };
    let err = pa
        .room_open_with(9, pb::RoomSide::Sender, "req", "trace", how)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(err.to_string().contains("--peer"), "{err}");
    let accepted = tokio::time::timeout(Duration::ZERO, stranger.accept()).await;
    assert!(accepted.is_err(), "the unlisted home was dialled");
    assert!(at_baseline(&a).await);
    assert_eq!(a.stats().await.room_slots, 0);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receivers_abort_reaches_the_sender_and_its_late_commit_is_refused() {
    let (a, b) = hosts(&smol(), &smol(), 10_000, 30_000).await;
    let (pa, db) = workers(&a, &smol(), &b, &smol()).await;
    let slots = open_pair(&pa, &db, &b.url(), 21).await;
    db.room_abort(21, "client disconnected").await.unwrap();
    failed(&pa, 21, Duration::from_secs(5), "client disconnected").await;
    let pages = write(&pa, &slots);
    let err = pa.room_commit(21, pages, aux(21)).await.unwrap_err();
    assert!(
        matches!(err.code(), tonic::Code::Aborted | tonic::Code::NotFound),
        "{err:?}"
    );
    let sb = b.stats().await;
    assert_eq!(sb.peer_pages_received, 0, "no page lands in a failed room");
    stop_at_baseline(a, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_home_that_vanishes_mid_transfer_fails_the_commit_in_bounded_time_and_frees_its_slots() {
    let (a, b) = hosts(&smol(), &smol(), 10_000, 30_000).await;
    let (pa, db) = workers(&a, &smol(), &b, &smol()).await;
    let slots = open_pair(&pa, &db, &b.url(), 31).await;
    let pages = write(&pa, &slots);
    drop(db);
    b.stop().await;
    let t0 = Instant::now();
    let err = pa.room_commit(31, pages, aux(31)).await.unwrap_err();
    assert!(
        matches!(
            err.code(),
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
        ),
        "{err:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    let sa = a.stats().await;
    assert_eq!(sa.peer_transfer_failures, 1);
    assert!(at_baseline(&a).await);
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_host_that_vanishes_fails_its_rooms_at_the_home_by_the_peer_lease() {
    let (a, b) = hosts(&smol(), &smol(), 500, 30_000).await;
    let (pa, db) = workers(&a, &smol(), &b, &smol()).await;
    let _slots = open_pair(&pa, &db, &b.url(), 41).await;
    assert_eq!(b.stats().await.room_slots, PAGES as u32);
    drop(pa);
    a.stop().await;
    failed(&db, 41, Duration::from_secs(10), "lost").await;
    eventually(Duration::from_secs(5), "the home at baseline", || async {
        at_baseline(&b).await
    })
    .await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_that_gives_up_fails_the_room_at_its_home() {
    let (a, b) = hosts(&smol(), &smol(), 10_000, 30_000).await;
    let (pa, db) = workers(&a, &smol(), &b, &smol()).await;
    let _slots = open_pair(&pa, &db, &b.url(), 51).await;
    pa.room_abort(51, "prefill failed").await.unwrap();
    failed(&db, 51, Duration::from_secs(5), "prefill failed").await;
    stop_at_baseline(a, b).await;
}

/// A network link between the hosts that can go down and come back: while down, its
/// connections stay open and nothing crosses them, nor any it accepts meanwhile (a
/// partition, not a refusal); back up, what waited crosses [`RETRANSMIT`] later, as TCP
/// sends it again only when its backed-off timer fires.
struct Wire {
    addr: SocketAddr,
    up: tokio::sync::watch::Sender<bool>,
}

/// How long after the wire came back what waited on it crosses.
const RETRANSMIT: Duration = Duration::from_millis(500);

impl Wire {
    /// Carries what `l` accepts to `target`.
    fn serve(l: TcpListener, target: SocketAddr) -> Self {
        let addr = l.local_addr().unwrap();
        let (up, _) = tokio::sync::watch::channel(true);
        let ups = up.clone();
        tokio::spawn(async move {
            while let Ok((near, _)) = l.accept().await {
                let Ok(far) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                let ((nr, nw), (fr, fw)) = (near.into_split(), far.into_split());
                tokio::spawn(Self::pump(nr, fw, ups.subscribe()));
                tokio::spawn(Self::pump(fr, nw, ups.subscribe()));
            }
        });
        Self { addr, up }
    }

    async fn pump(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut up: tokio::sync::watch::Receiver<bool>,
    ) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n @ 1..) = from.read(&mut buf).await {
            if !*up.borrow() {
                if up.wait_for(|&up| up).await.is_err() {
                    break;
                }
                tokio::time::sleep(RETRANSMIT).await;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn set(&self, up: bool) {
        self.up.send_replace(up);
    }
}

/// One room from `a`'s sender to `b`'s receiver, home `home`, to the end: the pages
/// arrive bit for bit and the receiver takes them.
async fn cross(a: &HostClient, b: &HostClient, home: &str, room: u64) {
    let slots = open_pair(a, b, home, room).await;
    let pages = write(a, &slots);
    a.room_commit(room, pages.clone(), aux(room)).await.unwrap();
    let st = b
        .room_wait(room, pb::RoomState::Success, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(st.state, pb::RoomState::Success as i32, "{st:?}");
    let got = b.room_result(room).await.unwrap();
    let m = b.shared_mirror().unwrap();
    for (i, p) in got.pages.iter().enumerate() {
        let mut buf = vec![0u8; m.page_bytes()];
        assert_eq!(m.read_checked(p.slot, &mut buf), pages[i].checksum);
        assert!(buf == page(i, m.page_bytes()), "page {i} differs");
    }
    b.room_finish(room).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_partition_past_the_relays_lease_the_next_room_registers_again_and_crosses() {
    // The hosts' room calls cross the wire; each worker talks to its own host.
    let wire = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let via = format!("http://{}", wire.local_addr().unwrap());
    let (a, b) = hosts_and(&smol(), &smol(), (600, 30_000), Some(via)).await;
    let (pa, db) = workers(&a, &smol(), &b, &smol()).await;
    let wire = Wire::serve(wire, b.svc.addr);
    let home = wire.url();
    cross(&pa, &db, &home, 61).await;
    let expired = b.stats().await.expired_leases;
    wire.set(false);
    eventually(
        Duration::from_secs(10),
        "the home let the relay's lease go",
        || async { b.stats().await.expired_leases > expired },
    )
    .await;
    wire.set(true);
    // At once: the relay's lease is gone at the home, and the room after the partition is
    // served all the same (the relay registers again), not refused naming that lease.
    cross(&pa, &db, &home, 62).await;
    stop_at_baseline(a, b).await;
}

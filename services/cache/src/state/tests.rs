//! Tests of the state: the mirror, leases, rooms and peers' pages driven with a fake clock.

use super::index::CommitPage;
use super::*;
use crate::rooms::{Aux, RoomPage, Side};
use pdmesh_kv::DType;

const TTL: Duration = Duration::from_secs(10);

fn layout() -> KvLayout {
    KvLayout::llama(2, 1, 4, DType::F16, 4) // 2 layers × (k+v) × 4 f16 × 4 tokens = 128 B
}

fn state(pages: u64) -> (State, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let s = State::new(
        MirrorSize::Bytes(128 * pages),
        Some(crate::mirror::private_dir(dir.path()).unwrap()),
        TTL,
    );
    (s, dir)
}

fn page(seed: u8) -> Vec<u8> {
    (0..128u32).map(|i| (i as u8).wrapping_mul(seed)).collect()
}

/// Leases for the workers `names`, registered at `now` with [`layout`].
fn leases<const N: usize>(s: &mut State, names: [&str; N], now: Instant) -> [Lease; N] {
    names.map(|name| s.register(name, layout(), now).unwrap().lease)
}

fn put(s: &mut State, lease: Lease, hashes: &[u64]) -> Vec<u32> {
    let grants = s.reserve(lease, hashes).unwrap();
    let pages = grants
        .iter()
        .map(|&(hash, slot)| {
            let d = page(hash as u8);
            CommitPage {
                hash,
                slot,
                checksum: pdmesh_kv::page_checksum(&d),
                data: Some(d),
                parent: 0,
            }
        })
        .collect();
    assert!(s.commit(lease, pages).unwrap().is_empty());
    grants.iter().map(|g| g.1).collect()
}

#[test]
fn sizes_parse_in_bytes_and_tokens() {
    assert_eq!("4GiB".parse(), Ok(MirrorSize::Bytes(4 << 30)));
    assert_eq!("2 MB".parse(), Ok(MirrorSize::Bytes(2_000_000)));
    assert_eq!("1000".parse(), Ok(MirrorSize::Bytes(1000)));
    assert_eq!("5000tokens".parse(), Ok(MirrorSize::Tokens(5000)));
    assert_eq!(
        "lots".parse::<MirrorSize>(),
        Err(slots::BadMirrorSize::NotANumber("lots".into()))
    );
    assert_eq!(
        "3 parsecs".parse::<MirrorSize>(),
        Err(slots::BadMirrorSize::UnknownUnit(
            "3 parsecs".into(),
            "parsecs".into()
        ))
    );
}

#[test]
fn a_page_changed_on_the_way_from_a_peer_is_reported_with_both_checksums() {
    let (mut s, _d) = state(10);
    s.arrival_checksum_failed(crate::transfer::BadArrival {
        peer: "10.7.0.2:40000",
        room: 42,
        index: 3,
        expected: 0xaa,
        found: 0xbb,
    });
    let seen = s.take_incidents();
    assert_eq!(seen.len(), 1);
    let i = &seen[0];
    assert_eq!(i.kind, pdmesh_incident::Kind::Checksum);
    assert_eq!(
        (
            i.place.worker.as_str(),
            i.place.stage.as_str(),
            i.place.room
        ),
        ("peer 10.7.0.2:40000", "page transport arrival", Some(42))
    );
    assert_eq!(
        i.pages,
        [pdmesh_incident::PageCheck {
            page: "page 3 of room 42".into(),
            expected: format!("{:016x}", 0xaa),
            found: format!("{:016x}", 0xbb),
        }]
    );
}

#[test]
fn a_restarted_service_knows_none_of_the_leases_its_predecessor_handed_out() {
    let now = Instant::now();
    let (mut old, _d) = state(4);
    let olds: Vec<Lease> = ["decode", "prefill", "tier"]
        .map(|w| old.register(w, layout(), now).unwrap().lease)
        .into();
    drop(old);
    // The new one registers the workers in another order: a worker still heartbeating
    // its old lease must hear that it is unknown, whoever registered first.
    let (mut new, _d) = state(4);
    for w in ["tier", "prefill"] {
        let lease = new.register(w, layout(), now).unwrap().lease;
        assert!(
            !olds.contains(&lease),
            "{lease} was handed out before the restart"
        );
    }
    for lease in olds {
        assert!(matches!(
            new.heartbeat(lease, now),
            Err(CacheError::UnknownLease(l)) if l == lease
        ));
    }
}

#[test]
fn the_first_layout_sizes_the_mirror_and_another_is_refused_naming_both() {
    let (mut s, _d) = state(10);
    let now = Instant::now();
    let r = s.register("w1", layout(), now).unwrap();
    assert_eq!((r.page_bytes, r.total_pages), (128, 10));
    let other = KvLayout::llama(2, 1, 4, DType::Bf16, 4);
    let err = s
        .register("w2", other.clone(), now)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&layout().to_string()), "{err}");
    assert!(err.contains(&other.to_string()), "{err}");
    // A report with both layouts side by side, naming the refused worker.
    let seen = s.take_incidents();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].kind, pdmesh_incident::Kind::LayoutRefused);
    let pair = seen[0].layouts.as_ref().unwrap();
    assert_eq!(pair.theirs_label, "worker w2");
    assert_eq!(
        pair.differences(),
        [
            "k: 8 B/token (f16) vs 8 B/token (bf16)",
            "v: 8 B/token (f16) vs 8 B/token (bf16)"
        ]
    );
    assert!(s.take_incidents().is_empty(), "taken once");

    let (mut t, _d2) = state(0);
    assert!(matches!(
        t.register("w", layout(), now),
        Err(CacheError::TooSmall { .. })
    ));
    // A mirror of `size` in a directory of its own.
    let mirror = |size, dir: &tempfile::TempDir| {
        State::new(
            size,
            Some(crate::mirror::private_dir(dir.path()).unwrap()),
            TTL,
        )
    };
    let dir = tempfile::tempdir().unwrap();
    let mut u = mirror(MirrorSize::Tokens(40), &dir);
    assert_eq!(u.register("w", layout(), now).unwrap().total_pages, 10);
    // A mirror bigger than its filesystem's free space is refused when it is made.
    let mut huge = mirror(MirrorSize::Bytes(1 << 60), &dir);
    let err = huge.register("w", layout(), now).unwrap_err().to_string();
    assert!(err.contains("--host-mirror-size"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let mut u = mirror(MirrorSize::Tokens(40), &dir);
    assert_eq!(u.register("w", layout(), now).unwrap().total_pages, 10);
}

#[test]
fn pages_are_stored_matched_as_a_leading_run_and_pinned_against_eviction() {
    let (mut s, _d) = state(3);
    let now = Instant::now();
    let [a, b] = leases(&mut s, ["a", "b"], now);
    put(&mut s, a, &[1, 2]);
    // A page already held is not reserved again.
    assert_eq!(s.reserve(b, &[1, 2]).unwrap(), vec![]);
    let m = s.match_pages(b, &[1, 2, 3]).unwrap();
    assert_eq!(m.iter().map(|p| p.hash).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(m[0].checksum, pdmesh_kv::page_checksum(&page(1)));
    assert_eq!(
        s.match_pages(b, &[9, 1]).unwrap(),
        vec![],
        "a leading run only"
    );
    // Full but for one slot, and both resident pages pinned: one grant only.
    let g = s.reserve(a, &[3, 4]).unwrap();
    assert_eq!(g.len(), 1);
    assert_eq!(s.stats().evicted_pages, 0);
    // An abandoned reservation frees its slot.
    s.release(a, &[g[0].1]).unwrap();
    let slots: Vec<u32> = m.iter().map(|p| p.slot).collect();
    s.release(b, &slots).unwrap();
    assert!(s.release(b, &slots).is_err(), "pins are counted");
    // Unpinned now: the free slot goes first, then 1, least recently used.
    let g = s.reserve(a, &[5, 6]).unwrap();
    assert_eq!(g[1].1, slots[0]);
    assert_eq!(s.stats().evicted_pages, 1);
    let ev = s.take_events();
    assert_eq!(
        ev[0],
        Event::Stored {
            parent: 0,
            hashes: vec![1],
            tier: Tier::Host
        }
    );
    assert!(
        ev.contains(&Event::Removed {
            hashes: vec![1],
            tier: Tier::Host
        }),
        "{ev:?}"
    );
}

#[test]
fn a_page_that_does_not_match_its_checksum_is_refused_and_counted() {
    let (mut s, _d) = state(4);
    let now = Instant::now();
    let a = s.register("a", layout(), now).unwrap().lease;
    let g = s.reserve(a, &[7]).unwrap();
    let d = page(7);
    let bad = CommitPage {
        hash: 7,
        slot: g[0].1,
        checksum: pdmesh_kv::page_checksum(&d) ^ 1,
        data: Some(d),
        parent: 0,
    };
    assert_eq!(s.commit(a, vec![bad]).unwrap(), vec![g[0].1]);
    assert_eq!(s.stats().checksum_failures, 1);
    let seen = s.take_incidents();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].kind, pdmesh_incident::Kind::Checksum);
    assert_eq!(seen[0].place.worker, "a");
    let want = pdmesh_kv::page_checksum(&page(7));
    assert_eq!(
        seen[0].pages,
        [pdmesh_incident::PageCheck {
            page: format!("{:016x} (slot {})", 7, g[0].1),
            expected: format!("{:016x}", want ^ 1),
            found: format!("{want:016x}"),
        }]
    );
    assert_eq!(s.match_pages(a, &[7]).unwrap(), vec![]);
    assert_eq!(s.stats().used_pages, 0);
    // Committing a slot that is not reserved for that page is an error.
    // The same slot twice in one commit is refused whole, before anything changes.
    let g = s.reserve(a, &[10]).unwrap();
    let d = page(10);
    let twice = CommitPage {
        hash: 10,
        slot: g[0].1,
        checksum: pdmesh_kv::page_checksum(&d),
        data: Some(d),
        parent: 0,
    };
    let err = s.commit(a, vec![twice.clone(), twice.clone()]).unwrap_err();
    assert!(matches!(err, CacheError::DuplicateSlot(_)), "{err}");
    assert_eq!(
        s.commit(a, vec![twice]).unwrap(),
        Vec::<u32>::new(),
        "the reservation is intact"
    );
    assert_eq!(s.match_pages(a, &[10]).unwrap().len(), 1);
    let g = s.reserve(a, &[8]).unwrap();
    let wrong = CommitPage {
        hash: 9,
        slot: g[0].1,
        checksum: 0,
        data: None,
        parent: 0,
    };
    assert!(matches!(
        s.commit(a, vec![wrong]),
        Err(CacheError::NotHeld { .. })
    ));
}

#[test]
fn an_expired_lease_gives_up_its_pins_and_reservations() {
    let (mut s, _d) = state(2);
    let t0 = Instant::now();
    let [a, b] = leases(&mut s, ["a", "b"], t0);
    put(&mut s, a, &[1]);
    s.match_pages(b, &[1]).unwrap();
    s.reserve(b, &[2]).unwrap();
    assert_eq!(s.stats().pinned_pages, 1);
    // a keeps its lease alive, b goes silent.
    s.heartbeat(a, t0 + TTL / 2).unwrap();
    assert_eq!(s.expire(t0 + TTL), vec!["b".to_string()]);
    assert!(matches!(
        s.heartbeat(b, t0 + TTL),
        Err(CacheError::UnknownLease(_))
    ));
    let st = s.stats();
    assert_eq!(
        (st.pinned_pages, st.used_pages, st.expired_leases),
        (0, 1, 1)
    );
    // b's page is evictable now, its reservation free: a can take both slots.
    assert_eq!(s.reserve(a, &[3, 4]).unwrap().len(), 2);
}

fn aux(room: u64) -> Aux {
    Aux {
        room,
        first_token: 1,
        first_logprob: f32::NAN,
        prompt_tokens: 4,
        ..Aux::default()
    }
}

/// Opens `room` on both sides and starts a transfer of `pages` pages.
fn transferring(s: &mut State, room: u64, p: Lease, d: Lease, pages: usize) -> Vec<u32> {
    let t = Instant::now();
    s.room_open(d, room, Side::Receiver, ("r", ""), 0, t)
        .unwrap();
    s.room_open(p, room, Side::Sender, ("r", ""), 0, t).unwrap();
    s.room_start(p, room, pages, t).unwrap()
}

#[test]
fn a_failed_rooms_slots_stay_out_of_reach_until_its_late_writer_is_refused() {
    let (mut s, _dir) = state(4);
    let t = Instant::now();
    let [p, d] = leases(&mut s, ["prefill", "decode"], t);
    let first = transferring(&mut s, 1, p, d, 2);
    // Decode gives up while prefill is writing: those slots are quarantined.
    s.room_abort(d, 1, "client left", t).unwrap();
    assert_eq!(s.room_stats(t).quarantined_slots, 2);
    // Another room cannot get them: only the 2 other slots exist for it.
    let second = transferring(&mut s, 2, p, d, 2);
    assert!(
        second.iter().all(|x| !first.contains(x)),
        "{first:?} {second:?}"
    );
    assert!(matches!(
        s.room_start(p, 3, 1, t),
        Err(CacheError::MirrorFull { .. }) | Err(CacheError::Room(_))
    ));
    // The late commit is refused and, its writer being done, frees the slots.
    let pages = first
        .iter()
        .map(|&slot| RoomPage { slot, checksum: 0 })
        .collect();
    let err = s.room_commit(p, 1, pages, aux(1), t).unwrap_err();
    assert!(
        matches!(err, CacheError::Room(RoomError::Failed { .. })),
        "{err}"
    );
    let st = s.room_stats(t);
    assert_eq!((st.quarantined_slots, st.late_writes_rejected), (0, 1));
    // A commit naming slots that are not the room's is refused before anything moves.
    let wrong = vec![
        RoomPage {
            slot: first[0],
            checksum: 0
        };
        2
    ];
    assert!(matches!(
        s.room_commit(p, 2, wrong, aux(2), t),
        Err(CacheError::BadRoomCall(_))
    ));
    let pages = second
        .iter()
        .map(|&slot| RoomPage { slot, checksum: 0 })
        .collect();
    s.room_commit(p, 2, pages, aux(2), t).unwrap();
    s.room_finish(d, 2).unwrap();
    let st = s.room_stats(t);
    assert_eq!((st.room_slots, st.finished, st.transfer_pages), (0, 1, 2));
    assert_eq!(s.stats().used_pages, 0, "every slot is free again");
}

#[test]
fn hostile_room_calls_are_refused_and_change_nothing() {
    let (mut s, _dir) = state(4);
    let t = Instant::now();
    let [p, d] = leases(&mut s, ["prefill", "decode"], t);
    assert!(matches!(
        s.room_open(p, 0, Side::Sender, ("", ""), 0, t),
        Err(CacheError::BadRoomCall(_))
    ));
    assert!(matches!(
        s.room_open(
            Lease::from_test_number(999),
            5,
            Side::Sender,
            ("", ""),
            0,
            t
        ),
        Err(CacheError::UnknownLease(_))
    ));
    s.room_open(d, 5, Side::Receiver, ("", ""), 0, t).unwrap();
    s.room_open(p, 5, Side::Sender, ("", ""), 0, t).unwrap();
    for pages in [0, 5, usize::MAX] {
        assert!(matches!(
            s.room_start(p, 5, pages, t),
            Err(CacheError::BadRoomCall(_))
        ));
    }
    // The receiver cannot start the sender's transfer.
    assert!(s.room_start(d, 5, 1, t).is_err());
    let slots = s.room_start(p, 5, 1, t).unwrap();
    let pages = vec![RoomPage {
        slot: slots[0],
        checksum: 0,
    }];
    assert!(matches!(
        s.room_commit(p, 5, pages, aux(6), t),
        Err(CacheError::BadRoomCall(_))
    ));
    assert_eq!(s.room_stats(t).room_slots, 1, "the transfer is still on");
    // A lease that dies fails its rooms and frees what they held.
    s.expire(t + TTL * 2);
    assert_eq!(s.stats().used_pages, 0);
}

#[test]
fn a_peers_page_lands_only_in_a_room_transferring_from_that_peer_and_never_late() {
    let (mut s, _dir) = state(4);
    let t = Instant::now();
    assert!(matches!(
        s.register_peer("peer", &layout(), t),
        Err(CacheError::NoLayoutYet)
    ));
    let [d, local] = leases(&mut s, ["decode", "prefill"], t);
    let other = KvLayout::llama(2, 1, 4, DType::F16, 8);
    assert!(matches!(
        s.register_peer("peer", &other, t),
        Err(CacheError::PeerLayoutMismatch { .. })
    ));
    let peer = s.register_peer("peer", &layout(), t).unwrap().lease;
    // A room whose sender is a local worker takes no page from the transport.
    s.room_open(d, 1, Side::Receiver, ("", ""), 0, t).unwrap();
    s.room_open(local, 1, Side::Sender, ("", ""), 0, t).unwrap();
    s.room_start(local, 1, 1, t).unwrap();
    assert_eq!(
        s.peer_write(local, 1, 0, &page(3)),
        Err(PageRefused::NotFromAPeer(1))
    );
    assert_eq!(
        s.peer_write(peer, 1, 0, &page(3)),
        Err(PageRefused::NotFromAPeer(1))
    );
    // From the peer: a wrong index or size is refused; the right page lands.
    s.room_open(d, 2, Side::Receiver, ("", ""), 0, t).unwrap();
    s.room_open(peer, 2, Side::Sender, ("", ""), 0, t).unwrap();
    let slots = s.room_start(peer, 2, 2, t).unwrap();
    assert_eq!(
        s.peer_write(peer, 2, 2, &page(5)),
        Err(PageRefused::NoSuchPage {
            room: 2,
            pages: 2,
            index: 2
        })
    );
    assert_eq!(
        s.peer_write(peer, 2, 0, &page(5)[..64]),
        Err(PageRefused::WrongSize { want: 128, got: 64 })
    );
    // Another peer's connection may not write this peer's room.
    let intruder = s.register_peer("intruder", &layout(), t).unwrap().lease;
    assert_eq!(
        s.peer_write(intruder, 2, 0, &page(6)),
        Err(PageRefused::OtherSender(2))
    );
    s.peer_write(peer, 2, 0, &page(5)).unwrap();
    let mirror = s.mirror().unwrap();
    let mut got = vec![0u8; 128];
    mirror.read(slots[0], &mut got);
    assert_eq!(got, page(5));
    // It must send every page before it commits.
    let pages: Vec<RoomPage> = slots
        .iter()
        .map(|&slot| RoomPage { slot, checksum: 0 })
        .collect();
    assert!(matches!(
        s.room_commit(peer, 2, pages, aux(2), t),
        Err(CacheError::BadRoomCall(_))
    ));
    // The receiver gives up: its slots are free at once (the peer writes through this
    // process only), and a page that arrives now is refused and written nowhere.
    s.room_abort(d, 2, "client left", t).unwrap();
    assert_eq!(s.room_stats(t).quarantined_slots, 0);
    let before = s.stats().used_pages;
    assert!(matches!(
        s.peer_write(peer, 2, 1, &page(7)),
        Err(PageRefused::NotTransferring { room: 2, .. })
    ));
    mirror.read(slots[1], &mut got);
    assert_ne!(got, page(7), "a late page never lands");
    assert_eq!(s.stats().used_pages, before);
    assert_eq!(s.room_stats(t).late_writes_rejected, 1);
}

//! Pages through the cache service over real gRPC on loopback, on both data planes:
//! stored by one worker they load bit for bit in another, a byte flipped in the mirror is
//! caught on load, a full mirror evicts least recently used pages, and a forged commit
//! never replaces a victim's pages.

use futures::StreamExt;
use pb::cache_client::CacheClient;
use pdmesh_cache::client::{Corrupt, DataPlane, Loaded};
use pdmesh_proto::cache::v1 as pb;
use pdmesh_testkit::service::answer;

mod common;

use common::{chain, client, layout, load, page_for, start, store};

#[tokio::test]
async fn pages_stored_on_one_plane_load_bit_for_bit_on_both_and_are_announced() {
    let s = start(64, 10_000).await;
    let mut events = s.events().await;
    for (writer_plane, tag) in [(DataPlane::Shm, 100), (DataPlane::Grpc, 200)] {
        let mut w = client(&s, "writer", writer_plane).await;
        let c = chain(tag, 5);
        let st = store(&mut w, &c).await;
        assert_eq!((st.written, st.skipped, st.rejected), (5, 0, 0));
        assert_eq!(
            store(&mut w, &c).await.skipped,
            5,
            "held pages are not stored twice"
        );
        let hashes: Vec<u64> = c.iter().map(|p| p.0).collect();
        for reader_plane in [DataPlane::Shm, DataPlane::Grpc] {
            let mut r = client(&s, "reader", reader_plane).await;
            // A prompt that shares the first three pages, then differs.
            let mut asked = hashes[..3].to_vec();
            asked.push(0xdead);
            let (loaded, bufs) = load(&mut r, &asked).await;
            assert_eq!(
                loaded,
                Loaded {
                    pages: 3,
                    corrupt: None
                }
            );
            for (i, b) in bufs.iter().enumerate() {
                assert!(
                    *b == page_for(hashes[i]),
                    "{writer_plane:?} → {reader_plane:?} page {i}"
                );
            }
        }
        let ev = events.next().await.unwrap().unwrap();
        let Some(pb::kv_event::Kind::Stored(st)) = ev.kind else {
            panic!("{ev:?}")
        };
        assert_eq!((st.parent_hash, st.hashes), (0, hashes));
    }
    let st = s.stats().await;
    assert_eq!(
        (st.used_pages, st.pinned_pages),
        (10, 0),
        "loads release their pins"
    );
    assert!(st.layout.contains("page 4 tokens"), "{}", st.layout);
    s.stop().await;
}

#[tokio::test]
async fn a_byte_flipped_in_the_mirror_is_caught_on_load_on_both_planes_and_discarded() {
    let s = start(16, 10_000).await;
    let mut w = client(&s, "writer", DataPlane::Shm).await;
    let path = register(&mut s.rpc().await, "inspector", pb::DataPlane::Shm)
        .await
        .shm_path;
    // Nine pages: a load copies them on several threads; the corrupt one is in the second
    // half.
    let c = chain(7, 9);
    let hashes: Vec<u64> = c.iter().map(|p| p.0).collect();
    for plane in [DataPlane::Shm, DataPlane::Grpc] {
        // (Re)store the chain: a discarded page is written afresh.
        store(&mut w, &c).await;
        let refs = w.match_pages(&hashes).await.unwrap();
        assert_eq!(refs.len(), 9);
        w.release(&refs.iter().map(|r| r.slot).collect::<Vec<_>>())
            .await
            .unwrap();
        // Corrupt the seventh page behind the service's back.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[layout().page_offset(refs[6].slot as usize) + 1234] ^= 0x10;
        std::fs::write(&path, &bytes).unwrap();

        let mut r = client(&s, "reader", plane).await;
        let (loaded, bufs) = load(&mut r, &hashes).await;
        let found = {
            let mut page = page_for(hashes[6]);
            page[1234] ^= 0x10;
            pdmesh_kv::page_checksum(&page)
        };
        assert_eq!(
            loaded,
            Loaded {
                pages: 6,
                // Which page, the checksum it was stored with, and the one of what is there.
                corrupt: Some(Corrupt {
                    hash: hashes[6],
                    slot: refs[6].slot,
                    expected: refs[6].checksum,
                    found,
                })
            },
            "{plane:?}"
        );
        for (i, b) in bufs.iter().take(6).enumerate() {
            assert!(*b == page_for(hashes[i]), "{plane:?} page {i}");
        }
        // The corrupt page is gone: nobody is served it again.
        let again = r.match_pages(&hashes).await.unwrap();
        assert_eq!(again.len(), 6, "{plane:?}");
        r.release(&again.iter().map(|p| p.slot).collect::<Vec<_>>())
            .await
            .unwrap();
    }
    assert_eq!(s.stats().await.pinned_pages, 0);
    s.stop().await;
}

#[tokio::test]
async fn a_full_mirror_evicts_the_least_recently_used_pages_and_says_so() {
    let s = start(4, 10_000).await;
    let mut events = s.events().await;
    let mut w = client(&s, "w", DataPlane::Grpc).await;
    let (a, b) = (chain(1000, 2), chain(2000, 2));
    store(&mut w, &a).await;
    store(&mut w, &b).await;
    // Touch a: b is least recently used.
    let (l, _) = load(&mut w, &[a[0].0, a[1].0]).await;
    assert_eq!(l.pages, 2);
    let c = chain(3000, 2);
    assert_eq!(store(&mut w, &c).await.written, 2);
    let mut removed = Vec::new();
    while removed.len() < 2 {
        if let Some(pb::kv_event::Kind::Removed(r)) = events.next().await.unwrap().unwrap().kind {
            removed.extend(r.hashes);
        }
    }
    removed.sort();
    let mut want = vec![b[0].0, b[1].0];
    want.sort();
    assert_eq!(removed, want);
    let (l, _) = load(&mut w, &[a[0].0]).await;
    assert_eq!(l.pages, 1, "the recently used prefix survived");
    s.stop().await;
}

/// Registers `name` of [`layout`] on `plane` through a raw client.
async fn register(
    rpc: &mut CacheClient<pdmesh_tls::AuthChannel>,
    name: &str,
    plane: pb::DataPlane,
) -> pb::RegisterResponse {
    answer(rpc.register(pb::RegisterRequest {
        worker_id: name.into(),
        layout: Some(pdmesh_cache::wire::layout_to_pb(&layout())),
        data_plane: plane.into(),
        ..Default::default()
    }))
    .await
}

/// Registers `name` on the grpc data plane through a raw client; returns its lease.
async fn register_grpc(rpc: &mut CacheClient<pdmesh_tls::AuthChannel>, name: &str) -> Vec<u8> {
    register(rpc, name, pb::DataPlane::Grpc).await.lease
}

/// The host-tier poisoning attack: a popular prefix's page hashes are public (token ids
/// and a layout fingerprint), so a member of the mesh reserves them and commits bytes of
/// its choosing with a valid checksum. Resident pages are never granted again, a commit
/// lands only in a slot its own lease reserved for that very hash, and a guessed lease is
/// unknown: the victim's pages load bit for bit as it stored them.
#[tokio::test]
async fn a_forged_commit_for_a_popular_prefix_is_refused_and_the_victims_pages_are_unchanged() {
    let s = start(64, 10_000).await;
    let mut victim = client(&s, "victim", DataPlane::Grpc).await;
    let popular = chain(500, 3);
    let hashes: Vec<u64> = popular.iter().map(|p| p.0).collect();
    assert_eq!(store(&mut victim, &popular).await.written, 3);

    // The attacker holds the mesh token and registers as a worker of the same layout.
    let mut rpc = s.rpc().await;
    let lease = register_grpc(&mut rpc, "attacker").await;
    let forged = vec![0x5au8; layout().bytes_per_page()];
    let commit = |lease: Vec<u8>, hash: u64, slot: u32| pb::CommitRequest {
        lease,
        pages: vec![pb::CommitPage {
            hash,
            slot,
            checksum: pdmesh_kv::page_checksum(&forged),
            data: forged.clone(),
            parent_hash: 0,
        }],
    };
    // 1. The resident pages are not granted to anyone again.
    let grants = answer(rpc.reserve(pb::ReserveRequest {
        lease: lease.clone(),
        hashes: hashes.clone(),
    }))
    .await
    .grants;
    assert!(
        grants.is_empty(),
        "resident pages granted again: {grants:?}"
    );
    // 2. A slot reserved for another hash takes no commit of the popular one.
    let other = answer(rpc.reserve(pb::ReserveRequest {
        lease: lease.clone(),
        hashes: vec![0xa77ac4],
    }))
    .await
    .grants[0]
        .slot;
    let err = rpc
        .commit(commit(lease.clone(), hashes[0], other))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    // 3. A reservation of the victim's (a page it is writing) takes no commit of another
    // lease, even for the hash it was reserved for.
    let mut writer = s.rpc().await;
    let writer_lease = register_grpc(&mut writer, "victim-writer").await;
    let (next, parent) = chain(500, 4)[3];
    let slot = answer(writer.reserve(pb::ReserveRequest {
        lease: writer_lease.clone(),
        hashes: vec![next],
    }))
    .await
    .grants[0]
        .slot;
    let err = rpc
        .commit(commit(lease.clone(), next, slot))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    // 4. A guessed lease is unknown.
    let guessed = pdmesh_cache::Lease::random().to_wire();
    let err = rpc.commit(commit(guessed, next, slot)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err}");

    // The victim finishes its own page, and every page loads as the victim wrote it.
    let data = page_for(next);
    let done = answer(writer.commit(pb::CommitRequest {
        lease: writer_lease,
        pages: vec![pb::CommitPage {
            hash: next,
            slot,
            checksum: pdmesh_kv::page_checksum(&data),
            data,
            parent_hash: parent,
        }],
    }))
    .await;
    assert!(done.rejected_slots.is_empty());
    let all: Vec<u64> = chain(500, 4).iter().map(|p| p.0).collect();
    let (loaded, bufs) = load(&mut victim, &all).await;
    assert_eq!(
        loaded,
        Loaded {
            pages: 4,
            corrupt: None
        }
    );
    for (i, b) in bufs.iter().enumerate() {
        assert!(*b == page_for(all[i]), "page {i} is not the victim's");
    }
    s.stop().await;
}

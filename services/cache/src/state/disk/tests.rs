//! The mirror over a real disk tier in a private folder: evicted pages spill, a match
//! promotes them back whole, and an unsound, foreign or unwritable disk is a miss or a
//! degraded tier, never a wrong page or a failed call.

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdmesh_kv::{DType, KvLayout};

use super::super::index::CommitPage;
use super::super::slots::MirrorSize;
use super::super::{Event, State, Tier};
use crate::disk::Discard;
use crate::disk::tier::{DiskConfig, DiskTier};

const PAGE: usize = 128;

fn layout() -> KvLayout {
    KvLayout::llama(2, 1, 4, DType::F16, 4) // 128 B a page
}

fn page(seed: u64) -> Vec<u8> {
    (0..PAGE as u32)
        .map(|i| (i as u8).wrapping_mul(seed as u8).wrapping_add(7))
        .collect()
}

struct Setup {
    state: State,
    disk: Arc<DiskTier>,
    lease: pdmesh_cache_client::Lease,
    _mirror: tempfile::TempDir,
}

fn private(dir: &tempfile::TempDir) -> std::path::PathBuf {
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    dir.path().join("disk")
}

/// Polls `cond` until it holds, for at most 10 s.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn config(dir: &std::path::Path) -> DiskConfig {
    DiskConfig {
        dir: dir.to_owned(),
        capacity: 1 << 20,
        spill_queue_bytes: 1 << 20,
        readers: 2,
    }
}

/// A mirror of `pages` pages over a disk tier in `dir`, registered by a worker of `model`.
async fn setup(dir: &std::path::Path, pages: u64, model: &str) -> Setup {
    let mirror = tempfile::tempdir().unwrap();
    let disk = DiskTier::new(config(dir)).unwrap();
    let mut state = State::new(
        MirrorSize::Bytes(PAGE as u64 * pages),
        Some(crate::mirror::private_dir(mirror.path()).unwrap()),
        Duration::from_secs(10),
    )
    .with_disk(Some(disk.clone()));
    state.check_model(model).unwrap();
    let lease = state.register("w", layout(), Instant::now()).unwrap().lease;
    state.start_disk();
    until("the disk tier to open", || disk.opened()).await;
    Setup {
        state,
        disk,
        lease,
        _mirror: mirror,
    }
}

impl Setup {
    /// Stores pages `hashes` one at a time (evicting the oldest when the mirror is full).
    fn put(&mut self, hashes: impl IntoIterator<Item = u64>) {
        for h in hashes {
            let grants = self.state.reserve(self.lease, &[h]).unwrap();
            let pages = grants
                .iter()
                .map(|&(hash, slot)| CommitPage {
                    hash,
                    slot,
                    checksum: pdmesh_kv::page_checksum(&page(hash)),
                    data: Some(page(hash)),
                    parent: 0,
                })
                .collect();
            assert!(self.state.commit(self.lease, pages).unwrap().is_empty());
        }
    }

    /// A match of `hashes` as the service serves it: the resident run, then the pages
    /// promoted from disk; returns the hashes found and checks their bytes.
    async fn matched(&mut self, hashes: &[u64]) -> Vec<u64> {
        let found = self.state.match_pages(self.lease, hashes).unwrap();
        let plan = self
            .state
            .plan_promotion(&hashes[found.len()..], Instant::now());
        assert_eq!(self.state.promoting, plan.start.len());
        assert_eq!(
            self.state.still_promoting(&hashes[found.len()..]),
            plan.start.len()
        );
        for (h, slot) in plan.start {
            let got = self.disk.load(h).await;
            self.state.promoted(h, slot, got, Instant::now());
        }
        assert_eq!(
            self.state.promoting, 0,
            "every promotion ended, hit or miss"
        );
        let more = self
            .state
            .match_pages(self.lease, &hashes[found.len()..])
            .unwrap();
        let mirror = self.state.mirror().unwrap();
        let mut out = Vec::new();
        for p in found.iter().chain(&more) {
            let mut b = vec![0u8; PAGE];
            mirror.read(p.slot, &mut b);
            assert_eq!(b, page(p.hash), "page {} served whole", p.hash);
            assert_eq!(p.checksum, pdmesh_kv::page_checksum(&b));
            out.push(p.hash);
        }
        let slots: Vec<u32> = found.iter().chain(&more).map(|p| p.slot).collect();
        self.state.release(self.lease, &slots).unwrap();
        out
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_pages_spill_and_a_match_promotes_them_back_whole() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = setup(&private(&dir), 4, "m#1").await;
    s.put(1..=8);
    until("four spills", || s.disk.figures().spilled == 4).await;
    let events = s.state.take_events();
    assert!(events.contains(&Event::Removed {
        hashes: vec![1],
        tier: Tier::Host
    }));
    assert!(events.contains(&Event::Stored {
        parent: 0,
        hashes: vec![1],
        tier: Tier::Disk
    }));
    // Pages 1-3 only on disk, 4 evicted too: the whole run comes back, checked.
    assert_eq!(s.matched(&[1, 2, 3, 9]).await, vec![1, 2, 3]);
    assert_eq!(s.disk.figures().promoted, 3);
    // Promoting evicted resident pages (5-7), which spilled in turn.
    until("the promoted pages' victims spilled", || {
        let f = s.disk.figures();
        (f.spilled, f.pages) == (7, 7)
    })
    .await;
    // Now resident: a match finds them without the disk.
    assert_eq!(s.matched(&[1, 2, 3]).await, vec![1, 2, 3]);
    assert_eq!(s.disk.figures().promoted, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_finds_the_pages_and_another_model_discards_every_one() {
    let dir = tempfile::tempdir().unwrap();
    let d = private(&dir);
    {
        let mut s = setup(&d, 2, "m#1").await;
        s.put(1..=5);
        until("three spills", || s.disk.figures().spilled == 3).await;
    }
    {
        // A second service on the folder while the first holds it is refused.
        let _held = DiskTier::new(config(&d)).unwrap();
        let again = DiskTier::new(config(&d));
        assert!(
            matches!(again, Err(crate::disk::DiskError::Locked(_))),
            "a second cache service on one folder"
        );
    }
    let mut s = setup(&d, 2, "m#1").await;
    assert_eq!(s.disk.figures().pages, 3);
    assert_eq!(
        s.matched(&[1, 2]).await,
        vec![1, 2],
        "served from disk after a restart"
    );
    drop(s);
    // The same layout, another model (a fine-tune): every file is foreign.
    let mut s = setup(&d, 2, "m#2").await;
    let f = s.disk.figures();
    assert_eq!(
        (f.pages, f.discards.get(&Discard::ForeignLayout)),
        (0, Some(&3)),
        "{f:?}"
    );
    assert_eq!(s.matched(&[1, 2]).await, Vec::<u64>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spoiled_file_is_a_miss_reported_and_never_reaches_the_mirror() {
    let dir = tempfile::tempdir().unwrap();
    let d = private(&dir);
    let mut s = setup(&d, 2, "m").await;
    s.put(1..=4);
    until("two spills", || s.disk.figures().spilled == 2).await;
    // Flip a byte of page 2's bytes on disk.
    let f = d.join(format!("{:016x}.page", 2u64));
    let mut b = std::fs::read(&f).unwrap();
    *b.last_mut().unwrap() ^= 0x40;
    std::fs::write(&f, b).unwrap();
    assert_eq!(
        s.matched(&[1, 2, 3]).await,
        vec![1],
        "the run ends at the spoiled page"
    );
    let fig = s.disk.figures();
    assert_eq!(fig.discards.get(&Discard::BadChecksum), Some(&1), "{fig:?}");
    assert!(!f.exists(), "the spoiled file is gone");
    let incidents = s.state.take_incidents();
    assert!(
        incidents
            .iter()
            .any(|i| i.kind == pdmesh_incident::Kind::Checksum
                && i.place.stage == "disk load"
                && i.pages[0].page == format!("{:016x}", 2u64)),
        "{incidents:?}"
    );
    assert!(s.state.take_events().contains(&Event::Removed {
        hashes: vec![2],
        tier: Tier::Disk
    }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_degrades_the_tier_and_every_call_still_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let d = private(&dir);
    let mut s = setup(&d, 2, "m").await;
    s.put(1..=3);
    until("one spill", || s.disk.figures().spilled == 1).await;
    // The folder vanishes under the service: no write can succeed.
    std::fs::remove_dir_all(&d).unwrap();
    s.put(4..=6);
    until("the tier degraded", || s.disk.figures().degraded).await;
    let f = s.disk.figures();
    assert!(f.spill_dropped >= 1 && f.spilled == 1, "{f:?}");
    let incidents = s.state.take_incidents();
    assert_eq!(
        incidents
            .iter()
            .filter(|i| i.kind == pdmesh_incident::Kind::DiskDegraded)
            .count(),
        1,
        "one report however many writes fail: {incidents:?}"
    );
    // The page spilled before is gone with its file: a miss, never an error.
    assert_eq!(s.matched(&[1, 6]).await, Vec::<u64>::new());
    assert_eq!(s.matched(&[6]).await, vec![6]);
}

#[test]
fn a_worker_of_another_model_is_refused_naming_both_and_the_first_stays() {
    let mirror = tempfile::tempdir().unwrap();
    let mut s = State::new(
        MirrorSize::Bytes(PAGE as u64 * 4),
        Some(crate::mirror::private_dir(mirror.path()).unwrap()),
        Duration::from_secs(10),
    );
    s.check_model("smol#00ff").unwrap();
    s.check_model("smol#00ff").unwrap();
    let err = s.check_model("smol-tuned#1234").unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, super::super::CacheError::ModelMismatch { .. })
            && msg.contains("smol#00ff")
            && msg.contains("smol-tuned#1234"),
        "{msg}"
    );
    assert_eq!(
        tonic::Status::from(err).code(),
        tonic::Code::FailedPrecondition
    );
    s.check_model("smol#00ff").unwrap();
    // The disk pages' names differ by model, for the same layout.
    let fp = layout().fingerprint();
    assert_ne!(
        super::disk_identity(fp, "smol#00ff"),
        super::disk_identity(fp, "smol-tuned#1234")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_page_that_no_longer_matches_its_checksum_is_never_written_to_disk() {
    let dir = tempfile::tempdir().unwrap();
    let d = private(&dir);
    let mut s = setup(&d, 2, "m").await;
    s.put(1..=2);
    // Page 1's bytes change in the mirror behind the service's back.
    let slot = s.state.index[&1];
    s.state.mirror().unwrap().write(slot, &page(99));
    s.put([3, 4]);
    until("two spills settled", || {
        let f = s.disk.figures();
        f.spilled + f.spill_dropped == 2
    })
    .await;
    let f = s.disk.figures();
    assert_eq!((f.spilled, f.spill_dropped, f.pages), (1, 1, 1), "{f:?}");
    assert!(!d.join(format!("{:016x}.page", 1u64)).exists());
    assert_eq!(s.matched(&[1]).await, Vec::<u64>::new());
    assert_eq!(s.matched(&[2]).await, vec![2]);
}

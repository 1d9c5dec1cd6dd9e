//! The page store against the files it writes: round trips, restarts, one service per
//! folder, and every way a file can be wrong, each a miss counted by its reason.

use std::os::unix::fs::PermissionsExt;

use super::*;

const FP: u64 = 0x1234_5678_9abc_def0;

fn page(seed: u8, len: usize) -> (Vec<u8>, u64) {
    let data: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    let sum = page_checksum(&data);
    (data, sum)
}

/// A temporary folder only this user may enter, as the store requires.
fn private_tempdir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    dir
}

fn file(dir: &Path, hash: u64) -> PathBuf {
    dir.join(format!("{hash:016x}.page"))
}

#[test]
fn a_page_stored_is_loaded_whole_after_a_restart_and_the_files_are_owner_only() {
    let dir = private_tempdir();
    let d = dir.path().join("disk");
    let (a, sa) = page(1, 4096);
    {
        let (mut s, discarded) = DiskStore::open(&d, FP, 1 << 20).unwrap();
        assert!(discarded.is_empty());
        s.put(7, sa, &a).unwrap();
        assert_eq!(s.load(7).unwrap(), Load::Hit(a.clone()));
        assert_eq!(s.load(8).unwrap(), Load::Miss);
        assert_eq!(s.used(), (HEADER_BYTES + a.len()) as u64);
    }
    let (mut s, discarded) = DiskStore::open(&d, FP, 1 << 20).unwrap();
    assert!(discarded.is_empty(), "{discarded:?}");
    assert_eq!((s.pages(), s.checksum(7)), (1, Some(sa)));
    assert_eq!(s.load(7).unwrap(), Load::Hit(a));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&d), 0o700);
    assert_eq!(mode(&file(&d, 7)), 0o600);
}

#[test]
fn a_second_service_on_the_same_folder_is_refused_until_the_first_is_gone() {
    let dir = private_tempdir();
    let (first, _) = DiskStore::open(dir.path(), FP, 1 << 20).unwrap();
    let err = DiskStore::open(dir.path(), FP, 1 << 20).unwrap_err();
    assert!(matches!(err, DiskError::Locked(_)), "{err}");
    drop(first);
    DiskStore::open(dir.path(), FP, 1 << 20).unwrap();
}

#[test]
fn at_start_every_unsound_file_is_removed_and_counted_and_the_sound_ones_stay() {
    let dir = private_tempdir();
    let d = dir.path();
    {
        // Another layout's page, in the same folder.
        let (mut other, _) = DiskStore::open(d, FP ^ 1, 1 << 20).unwrap();
        let (p, s) = page(9, 512);
        other.put(100, s, &p).unwrap();
    }
    {
        let (mut s, discarded) = DiskStore::open(d, FP, 1 << 20).unwrap();
        assert_eq!(discarded, BTreeMap::from([(Discard::ForeignLayout, 1)]));
        for h in 1..=6u64 {
            let (p, sum) = page(h as u8, 512);
            s.put(h, sum, &p).unwrap();
        }
    }
    // 1 cut short, 2 a flipped byte, 3 renamed under another hash, 4 a garbled header,
    // 5 longer than its header says; 6 stays sound. And a write that never finished.
    let len = std::fs::metadata(file(d, 1)).unwrap().len();
    OpenOptions::new()
        .write(true)
        .open(file(d, 1))
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    let mut b = std::fs::read(file(d, 2)).unwrap();
    b[HEADER_BYTES + 100] ^= 0x01;
    std::fs::write(file(d, 2), b).unwrap();
    std::fs::rename(file(d, 3), file(d, 33)).unwrap();
    let mut b = std::fs::read(file(d, 4)).unwrap();
    b[20] ^= 0xff;
    std::fs::write(file(d, 4), b).unwrap();
    let mut b = std::fs::read(file(d, 5)).unwrap();
    b.extend_from_slice(&[0; 8]);
    std::fs::write(file(d, 5), b).unwrap();
    std::fs::write(d.join("0000000000000042.deadbeef.tmp"), b"half a page").unwrap();

    let (mut s, discarded) = DiskStore::open(d, FP, 1 << 20).unwrap();
    let want = BTreeMap::from([
        (Discard::Partial, 2),
        (Discard::BadChecksum, 1),
        (Discard::WrongName, 1),
        (Discard::BadHeader, 1),
        (Discard::Unfinished, 1),
    ]);
    assert_eq!(discarded, want);
    assert_eq!(s.pages(), 1);
    assert_eq!(s.load(6).unwrap(), Load::Hit(page(6, 512).0));
    for h in [1, 2, 3, 4, 5, 33] {
        assert_eq!(s.load(h).unwrap(), Load::Miss, "page {h}");
        assert!(!file(d, h).exists(), "page {h}'s file is still there");
    }
    let left: Vec<_> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}"); // page 6 and the lock
}

#[test]
fn a_page_spoiled_after_it_was_indexed_is_discarded_at_load_never_served() {
    let dir = private_tempdir();
    let (mut s, _) = DiskStore::open(dir.path(), FP, 1 << 20).unwrap();
    let (p, sum) = page(3, 1024);
    s.put(5, sum, &p).unwrap();
    let mut b = std::fs::read(file(dir.path(), 5)).unwrap();
    let last = b.len() - 1;
    b[last] ^= 0x80;
    std::fs::write(file(dir.path(), 5), b).unwrap();
    assert_eq!(s.load(5).unwrap(), Load::Discarded(Discard::BadChecksum));
    assert_eq!(s.load(5).unwrap(), Load::Miss);
    assert_eq!((s.pages(), s.used()), (0, 0));
    // Another sound page put in its place is not the page that was stored.
    let (q, qsum) = page(4, 1024);
    s.put(5, sum, &p).unwrap();
    empty(dir.path()).put(5, qsum, &q).unwrap();
    assert_eq!(s.load(5).unwrap(), Load::Discarded(Discard::BadChecksum));
}

/// A store over `dir` that does not hold its lock (to write behind another's back).
fn empty(dir: &Path) -> DiskStore {
    DiskStore {
        dir: dir.to_owned(),
        fingerprint: FP,
        capacity: 1 << 20,
        used: 0,
        tick: 0,
        index: HashMap::new(),
        lru: BTreeMap::new(),
        writing: HashMap::new(),
        _lock: DiskLock {
            dir: dir.to_owned(),
            _file: File::open(dir).unwrap(),
        },
    }
}

#[test]
fn the_least_recently_used_pages_leave_first_within_the_capacity() {
    let dir = private_tempdir();
    let one = (HEADER_BYTES + 256) as u64;
    let (mut s, _) = DiskStore::open(dir.path(), FP, 2 * one).unwrap();
    for h in 1..=2 {
        let (p, sum) = page(h as u8, 256);
        s.put(h, sum, &p).unwrap();
    }
    assert!(matches!(s.load(1).unwrap(), Load::Hit(_)));
    let (p, sum) = page(3, 256);
    s.put(3, sum, &p).unwrap();
    assert!(s.contains(1) && !s.contains(2) && s.contains(3));
    assert!(!file(dir.path(), 2).exists());
    assert_eq!(s.used(), 2 * one);
    // Opened again smaller, the older of the two goes.
    drop(s);
    let (s, _) = DiskStore::open(dir.path(), FP, one).unwrap();
    assert_eq!(s.pages(), 1);
}

#[test]
fn bytes_that_do_not_match_their_checksum_or_do_not_fit_are_never_written() {
    let dir = private_tempdir();
    let (mut s, _) = DiskStore::open(dir.path(), FP, 1024).unwrap();
    let (p, sum) = page(1, 256);
    let err = s.put(1, sum ^ 1, &p).unwrap_err();
    assert!(matches!(err, DiskError::Corrupt { hash: 1 }), "{err}");
    let (big, bsum) = page(2, 2048);
    let err = s.put(2, bsum, &big).unwrap_err();
    assert!(matches!(err, DiskError::TooLarge { .. }), "{err}");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from(LOCK)]);
    assert_eq!((s.pages(), s.used()), (0, 0));
}

#[test]
fn a_folder_other_users_may_enter_is_refused_and_a_huge_file_is_never_read() {
    let dir = private_tempdir();
    let d = dir.path().join("disk");
    std::fs::create_dir(&d).unwrap();
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    let err = DiskStore::open(&d, FP, 1 << 20).unwrap_err();
    assert!(
        matches!(err, DiskError::Exposed { mode: 0o755, .. }),
        "{err}"
    );
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
    // A sparse file far larger than the tier: discarded without being read.
    let huge = File::create(file(&d, 9)).unwrap();
    huge.set_len(1 << 40).unwrap();
    drop(huge);
    let (s, discarded) = DiskStore::open(&d, FP, 1 << 20).unwrap();
    assert_eq!(discarded, BTreeMap::from([(Discard::Partial, 1)]));
    assert_eq!(s.pages(), 0);
    assert!(!file(&d, 9).exists());
}

//! The host mirror's memory: a file in shared memory holding `pages` slots of one KV
//! layout's page size, mapped by the cache service and by every worker on the host. The
//! same type serves both sides: the service creates the file, workers open it.
//!
//! Who may touch a slot is decided by the cache service's protocol, not by this type: a
//! worker writes only slots it reserved and has not committed, and reads only slots it has
//! pinned. A peer that breaks the protocol can only spoil bytes, and every consumer
//! verifies a page's checksum before using it.
//!
//! A mirror outlives a creator that is killed outright, and shared memory is RAM until the
//! file goes, so the creator holds an exclusive `flock` on it for its whole life (the
//! kernel drops it when the process dies, however it dies) and a starting cache service
//! [`sweep`]s its directory: a mirror file nobody holds the lock of is removed. Workers
//! never lock: a worker maps the file and closes it, so the mapping of a swept file stays
//! valid until the worker registers with the new service and lets the old one go.
//!
//! A mirror holds every tenant's KV, so it is private to the service's user: it lives in
//! `<dir>/pdmesh-mirrors-<uid>` ([`private_dir`]), a directory of mode 0700 that the
//! service creates, or refuses to use when someone else owns it or others may reach it,
//! and the file is created 0600, exclusively and never through a link. Workers run as
//! the same user. Bytes in the mapping are moved only by volatile copies to and from
//! private buffers, since another process may write them at any time; a checksum is
//! computed over a private buffer, never over the mapping.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use memmap2::MmapRaw;

/// The private directory of a user's mirrors, under the configured one, is this and the
/// user's uid.
pub const DIR_PREFIX: &str = "pdmesh-mirrors-";
/// A published mirror file's name starts with this.
pub const FILE_PREFIX: &str = "pdmesh-mirror-";
/// A mirror file being created starts with this, until its creator holds the lock and
/// renames it (a creator that dies in between leaves one; [`sweep`] removes those too).
const PENDING_PREFIX: &str = "pdmesh-new-mirror-";
/// A creator whose pending file a sweep removed before it held the lock tries again under
/// a new name, this many times in all.
const CREATE_TRIES: usize = 16;

/// A mapped mirror file.
pub struct Mirror {
    path: PathBuf,
    map: MmapRaw,
    page_bytes: usize,
    pages: usize,
    /// The creator's open file, holding the lock that says the mirror is in use; the
    /// creator removes the file when dropped. `None` for a worker's mapping.
    owner: Option<File>,
}

impl std::fmt::Debug for Mirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mirror")
            .field("path", &self.path)
            .field("page_bytes", &self.page_bytes)
            .field("pages", &self.pages)
            .finish()
    }
}

impl Mirror {
    /// Creates a mirror file of `pages` slots of `page_bytes` in `dir`. The directory must
    /// have room for all of it: a shared-memory file that outgrows its filesystem would
    /// fault the processes writing to it later, so that is refused now.
    ///
    /// The file is created under a pending name, locked for the mirror's whole life, and
    /// only then renamed to its `pdmesh-mirror-*` name, so a [`sweep`] by another cache
    /// service on the same directory never finds it unlocked under that name. The lock's
    /// descriptor is close-on-exec (as every file Rust opens), so no child inherits it.
    pub fn create(dir: &Path, page_bytes: usize, pages: usize) -> std::io::Result<Self> {
        let need = (page_bytes * pages) as u64;
        let free = fs4::available_space(dir)?;
        if free < need {
            return Err(std::io::Error::other(format!(
                "{} has {free} bytes free, the host mirror needs {need}: pass a smaller \
                 --host-mirror-size or another --shm-dir",
                dir.display()
            )));
        }
        for _ in 0..CREATE_TRIES {
            let id = uuid::Uuid::new_v4().simple();
            let pending = dir.join(format!("{PENDING_PREFIX}{id}"));
            let path = dir.join(format!("{FILE_PREFIX}{id}"));
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                // O_EXCL, owner-only, never through a link planted at the name.
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&pending)?;
            match lock_and_publish(&file, &pending, &path, need) {
                Ok(true) => {}
                // A sweep took the pending file between its creation and the lock.
                Ok(false) => continue,
                Err(e) => {
                    let _ = std::fs::remove_file(&pending);
                    return Err(e);
                }
            }
            return match Self::map(path.clone(), &file, page_bytes, pages) {
                Ok(mut m) => {
                    m.owner = Some(file);
                    Ok(m)
                }
                Err(e) => {
                    let _ = std::fs::remove_file(&path);
                    Err(e)
                }
            };
        }
        Err(std::io::Error::other(format!(
            "could not create the host mirror in {}: {CREATE_TRIES} pending files were \
             removed before they could be locked",
            dir.display()
        )))
    }

    /// Maps an existing mirror file; its size must be exactly `pages` slots, and it must
    /// be a regular file (not reached through a link) that only its owner may open.
    pub fn open(path: &Path, page_bytes: usize, pages: usize) -> std::io::Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)?;
        let meta = file.metadata()?;
        if !meta.is_file() || meta.mode() & 0o077 != 0 {
            return Err(std::io::Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "mirror file {} is not a private regular file (mode {:o}): refusing to map it",
                    path.display(),
                    meta.mode() & 0o7777
                ),
            ));
        }
        let len = meta.len();
        if len != (page_bytes * pages) as u64 {
            return Err(std::io::Error::other(format!(
                "mirror file {} is {len} bytes, expected {pages} pages of {page_bytes}",
                path.display()
            )));
        }
        Self::map(path.to_owned(), &file, page_bytes, pages)
    }

    fn map(path: PathBuf, file: &File, page_bytes: usize, pages: usize) -> std::io::Result<Self> {
        let map = MmapRaw::map_raw(file)?;
        Ok(Self {
            path,
            map,
            page_bytes,
            pages,
            owner: None,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    pub fn pages(&self) -> usize {
        self.pages
    }

    fn slot_ptr(&self, slot: u32) -> *mut u8 {
        assert!(
            (slot as usize) < self.pages,
            "slot {slot} outside the mirror ({})",
            self.pages
        );
        // SAFETY: slot < pages, so the offset stays inside the mapping of pages × page_bytes.
        // layout-arithmetic: the file is an array of whole pages of the registered layout's
        // bytes_per_page; the mirror never places a byte inside a page.
        unsafe { self.map.as_mut_ptr().add(slot as usize * self.page_bytes) }
    }

    /// Copies slot `slot` into `dst` (exactly one page).
    pub fn read(&self, slot: u32, dst: &mut [u8]) {
        assert_eq!(
            dst.len(),
            self.page_bytes,
            "a page is {} bytes",
            self.page_bytes
        );
        // SAFETY: the source is one slot inside the live mapping (checked in slot_ptr) and
        // `dst` is a distinct Rust buffer of the same length.
        unsafe { copy_from_shared(self.slot_ptr(slot), dst) }
    }

    /// Copies one page from `src` into slot `slot`.
    pub fn write(&self, slot: u32, src: &[u8]) {
        assert_eq!(
            src.len(),
            self.page_bytes,
            "a page is {} bytes",
            self.page_bytes
        );
        // SAFETY: as in `read`, with the roles swapped.
        unsafe { copy_to_shared(src, self.slot_ptr(slot)) }
    }

    /// Copies slot `slot` into `dst` and returns the page checksum of `dst`: of the bytes
    /// copied, whatever another process writes into the slot meanwhile or later.
    pub fn read_checked(&self, slot: u32, dst: &mut [u8]) -> u64 {
        self.read(slot, dst);
        pdmesh_kv::page_checksum(dst)
    }

    /// Copies one page from `src` into slot `slot` and returns the page checksum of `src`
    /// (never of the slot, which another process may change).
    pub fn write_checked(&self, slot: u32, src: &[u8]) -> u64 {
        let sum = pdmesh_kv::page_checksum(src);
        self.write(slot, src);
        sum
    }

    /// The page checksum of the slot's bytes, read through a private copy.
    pub fn checksum(&self, slot: u32, scratch: &mut Vec<u8>) -> u64 {
        scratch.resize(self.page_bytes, 0);
        self.read_checked(slot, scratch)
    }
}

impl Drop for Mirror {
    fn drop(&mut self) {
        // Removed before the lock goes with `owner`: a sweep never sees it unlocked.
        if self.owner.is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Copies `dst.len()` bytes of shared memory at `src` into `dst` with volatile reads, a
/// word at a time where `src` is aligned: each byte of the mapping is read exactly once,
/// and the compiler may neither add reads nor assume the bytes stay put.
///
/// # Safety
/// `src` must be valid for reads of `dst.len()` bytes for the whole call.
unsafe fn copy_from_shared(src: *const u8, dst: &mut [u8]) {
    const W: usize = std::mem::size_of::<u64>();
    let mut i = 0;
    if src.cast::<u64>().is_aligned() {
        while i + W <= dst.len() {
            // SAFETY: src + i is aligned and i + W <= len, inside what the caller vouches for.
            let w = unsafe { std::ptr::read_volatile(src.add(i).cast::<u64>()) };
            dst[i..i + W].copy_from_slice(&w.to_ne_bytes());
            i += W;
        }
    }
    while i < dst.len() {
        // SAFETY: i < len.
        dst[i] = unsafe { std::ptr::read_volatile(src.add(i)) };
        i += 1;
    }
}

/// Copies `src` into shared memory at `dst` with volatile writes (as [`copy_from_shared`]).
///
/// # Safety
/// `dst` must be valid for writes of `src.len()` bytes for the whole call.
unsafe fn copy_to_shared(src: &[u8], dst: *mut u8) {
    const W: usize = std::mem::size_of::<u64>();
    let mut i = 0;
    if dst.cast::<u64>().is_aligned() {
        while i + W <= src.len() {
            let w = u64::from_ne_bytes(src[i..i + W].try_into().expect("a word"));
            // SAFETY: dst + i is aligned and i + W <= len, inside what the caller vouches for.
            unsafe { std::ptr::write_volatile(dst.add(i).cast::<u64>(), w) };
            i += W;
        }
    }
    while i < src.len() {
        // SAFETY: i < len.
        unsafe { std::ptr::write_volatile(dst.add(i), src[i]) };
        i += 1;
    }
}

/// The directory of this user's mirrors under `base` (`<base>/pdmesh-mirrors-<uid>`),
/// created with mode 0700 if missing. An existing one must be a directory (not a link)
/// owned by this user that neither its group nor others may reach, else this is an error
/// saying which and what to do: the service refuses to start rather than put its
/// tenants' KV where others can read it.
pub fn private_dir(base: &Path) -> std::io::Result<PathBuf> {
    let dir = base.join(format!("{DIR_PREFIX}{}", effective_uid()));
    ensure_private(&dir)?;
    Ok(dir)
}

/// Makes `dir` (mode 0700) if it is missing, e.g. removed by [`remove_empty_dirs`] since
/// the service checked it at start, and checks it is this user's alone.
pub fn ensure_private(dir: &Path) -> std::io::Result<()> {
    let uid = effective_uid();
    let mut b = std::fs::DirBuilder::new();
    std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
    match b.create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(std::io::Error::new(
                e.kind(),
                format!(
                    "cannot create the host mirror's directory {}: {e}",
                    dir.display()
                ),
            ));
        }
    }
    check_private_dir(dir, uid)
}

/// Removes this user's mirror directories (see [`dirs`]) that hold nothing, as a cache
/// service stops: a directory another service's mirror is still in stays, and so does
/// one that is not there or not this user's.
pub fn remove_empty_dirs(configured: Option<&Path>) {
    for dir in dirs(configured) {
        // rmdir removes only an empty directory; anything else is left as it is.
        match std::fs::remove_dir(&dir) {
            Ok(()) => {
                tracing::debug!(dir = %dir.display(), "removed the emptied host mirror directory")
            }
            Err(e) => {
                tracing::debug!(dir = %dir.display(), error = %e, "left the host mirror directory")
            }
        }
    }
}

/// Why `dir` may not hold mirrors of user `uid`, as an error; `Ok` when it may.
fn check_private_dir(dir: &Path, uid: u32) -> std::io::Result<()> {
    let meta = std::fs::symlink_metadata(dir)?;
    let refuse = |why: String| {
        Err(std::io::Error::new(
            ErrorKind::PermissionDenied,
            format!(
                "refusing the host mirror's directory {}: {why}; remove it (the service \
                 creates it afresh, mode 0700) or pass another --shm-dir",
                dir.display()
            ),
        ))
    };
    if !meta.file_type().is_dir() {
        return refuse("it is not a directory (a link or a file is there)".into());
    }
    if meta.uid() != uid {
        return refuse(format!(
            "it is owned by uid {}, not by this service's uid {uid}",
            meta.uid()
        ));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return refuse(format!(
            "its mode is {mode:04o}: its group or others may reach the mirror (0700 wanted)"
        ));
    }
    Ok(())
}

fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Locks `file` (just created at `pending`), sizes it to `len` and renames it to `path`.
/// False when `pending` no longer names `file` once the lock is held: a sweep found the
/// file before it was locked and removed it.
fn lock_and_publish(file: &File, pending: &Path, path: &Path, len: u64) -> std::io::Result<bool> {
    // Blocks only while a sweep holds it, which is for one unlink at most. Without the lock
    // another cache service's sweep would take the mirror for a dead one's: no mirror then.
    file.lock().map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!(
                "cannot lock {} ({e}): put --shm-dir on a filesystem with flock",
                pending.display()
            ),
        )
    })?;
    if !names(pending, &file.metadata()?)? {
        return Ok(false);
    }
    file.set_len(len)?;
    // Nobody else can take the lock now, so nothing removes the file between the check
    // and the rename; names are never reused, so the rename replaces nothing.
    std::fs::rename(pending, path)?;
    Ok(true)
}

/// Whether `path` names the file `meta` describes (not a symbolic link to it).
fn names(path: &Path, meta: &std::fs::Metadata) -> std::io::Result<bool> {
    match std::fs::symlink_metadata(path) {
        Ok(at) => Ok(at.dev() == meta.dev() && at.ino() == meta.ino()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// A mirror file [`sweep`] removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Swept {
    pub path: PathBuf,
    /// Its size (the mirror's; the memory it held is at most this).
    pub bytes: u64,
}

/// Removes every mirror file in `dir` whose creator is gone — nobody holds its lock —,
/// published or pending, and returns them. A live mirror's lock is held, so it is never
/// removed, whoever runs the sweep. Files this process may not open or remove (another
/// user's) are left alone, as is anything not a regular file.
pub fn sweep(dir: &Path) -> std::io::Result<Vec<Swept>> {
    let mut swept = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !name.starts_with(FILE_PREFIX) && !name.starts_with(PENDING_PREFIX) {
            continue;
        }
        let path = entry.path();
        match sweep_one(&path) {
            Ok(Some(bytes)) => {
                tracing::info!(path = %path.display(), bytes, "removed a host mirror file no cache service holds");
                swept.push(Swept { path, bytes });
            }
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "left a host mirror file alone");
            }
        }
    }
    Ok(swept)
}

/// Removes `path` if it is a mirror file nobody holds the lock of; its size if removed.
fn sweep_one(path: &Path) -> std::io::Result<Option<u64>> {
    let file = OpenOptions::new()
        .read(true)
        // Never through a link, and never waiting on a FIFO put there.
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Ok(None);
    }
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Ok(None),
        Err(std::fs::TryLockError::Error(e)) => return Err(e),
    }
    // Held now, so its creator is gone, or is a creator that has not locked its pending
    // file yet (it sees the file go and tries again under another name). Another sweep
    // may have removed it since it was opened; names are never reused, so if `path` still
    // names it, it stays so until removed here.
    if !names(path, &meta)? {
        return Ok(None);
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(Some(meta.len())),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The directories a mirror may be in: this user's [`private_dir`] under `configured`
/// (`--shm-dir`) if given, else under each base [`default_dir`] may pick.
pub fn dirs(configured: Option<&Path>) -> Vec<PathBuf> {
    let uid = effective_uid();
    bases(configured)
        .into_iter()
        .map(|b| b.join(format!("{DIR_PREFIX}{uid}")))
        .collect()
}

/// The directories [`dirs`] are in: `configured`, else /dev/shm (if the host has it)
/// and the temporary directory.
pub fn bases(configured: Option<&Path>) -> Vec<PathBuf> {
    match configured {
        Some(dir) => vec![dir.to_owned()],
        None => {
            let shm = Path::new("/dev/shm");
            let tmp = std::env::temp_dir();
            let mut out = Vec::from_iter(shm.is_dir().then(|| shm.to_owned()));
            if !out.contains(&tmp) {
                out.push(tmp);
            }
            out
        }
    }
}

/// [`sweep`]s the directories a mirror may be in (`configured`, the `--shm-dir`, else
/// every one [`default_dir`] may pick): what a cache service does as it starts, so a
/// mirror its killed predecessor (or any other dead cache service on the host) left is
/// not kept in memory until the host reboots. Failures are logged, never fatal.
pub fn sweep_dirs(configured: Option<&Path>) -> Vec<Swept> {
    let mut swept = Vec::new();
    for dir in dirs(configured) {
        match sweep(&dir) {
            Ok(s) => swept.extend(s),
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "could not look for host mirror files left behind");
            }
        }
    }
    swept
}

/// Where a mirror of `bytes` goes by default: this user's [`private_dir`] in /dev/shm
/// (memory) when the host has it with room enough, else in the temporary directory.
pub fn default_dir(bytes: u64) -> std::io::Result<PathBuf> {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() && fs4::available_space(shm).is_ok_and(|free| free >= bytes) {
        private_dir(shm)
    } else {
        let tmp = std::env::temp_dir();
        tracing::warn!(dir = %tmp.display(), bytes, "/dev/shm is missing or too small for the host mirror: it goes under the temporary directory");
        private_dir(&tmp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_page_written_by_one_mapping_is_read_by_another_and_the_file_goes_with_its_creator() {
        let dir = tempfile::tempdir().unwrap();
        let owner = Mirror::create(dir.path(), 64, 4).unwrap();
        let peer = Mirror::open(owner.path(), 64, 4).unwrap();
        let page: Vec<u8> = (0..64).collect();
        peer.write(2, &page);
        let mut back = vec![0; 64];
        owner.read(2, &mut back);
        assert_eq!(back, page);
        let mut scratch = Vec::new();
        assert_eq!(
            owner.checksum(2, &mut scratch),
            pdmesh_kv::page_checksum(&page)
        );
        assert!(
            Mirror::open(owner.path(), 64, 5).is_err(),
            "size must match"
        );
        let path = owner.path().to_owned();
        drop(owner);
        assert!(!path.exists());
    }

    /// Names of the mirror files (published or pending) in `dir`, sorted.
    fn mirror_files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(FILE_PREFIX) || n.starts_with(PENDING_PREFIX))
            .collect();
        names.sort();
        names
    }

    /// What a creator killed outright leaves: its file, with the lock gone (the kernel
    /// closes a dead process's descriptors, which is what dropping `owner` does here).
    /// From then on any sweep may remove the file.
    fn abandon(mut m: Mirror) -> PathBuf {
        let path = m.path.clone();
        drop(m.owner.take());
        drop(m);
        path
    }

    #[test]
    fn a_mirror_whose_creator_is_alive_is_never_swept_even_while_workers_map_it() {
        let dir = tempfile::tempdir().unwrap();
        let owner = Mirror::create(dir.path(), 64, 4).unwrap();
        let name = owner
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(name.starts_with(FILE_PREFIX), "{name}");
        let worker = Mirror::open(owner.path(), 64, 4).unwrap();
        for _ in 0..3 {
            assert_eq!(sweep(dir.path()).unwrap(), vec![]);
        }
        assert_eq!(mirror_files(dir.path()), vec![name]);
        // The worker's mapping still reaches the creator's.
        worker.write(1, &[7; 64]);
        let mut back = vec![0; 64];
        owner.read(1, &mut back);
        assert_eq!(back, vec![7; 64]);
    }

    #[test]
    fn a_mirror_whose_creator_is_gone_is_swept_and_a_worker_mapping_it_reads_on() {
        let dir = tempfile::tempdir().unwrap();
        let live = Mirror::create(dir.path(), 64, 4).unwrap();
        let dead = Mirror::create(dir.path(), 64, 8).unwrap();
        let worker = Mirror::open(dead.path(), 64, 8).unwrap();
        worker.write(3, &[9; 64]);
        let path = abandon(dead);
        assert!(path.exists(), "only the lock goes, not the file");
        assert_eq!(
            sweep(dir.path()).unwrap(),
            vec![Swept {
                path: path.clone(),
                bytes: 64 * 8
            }]
        );
        assert!(!path.exists());
        assert!(live.path().exists(), "the live one stays");
        // The worker's mapping outlives the name until the worker lets it go.
        let mut back = vec![0; 64];
        worker.read(3, &mut back);
        assert_eq!(back, vec![9; 64]);
        assert_eq!(sweep(dir.path()).unwrap(), vec![], "nothing left to sweep");
    }

    #[test]
    fn a_pending_file_its_creator_left_is_swept_and_files_of_other_names_are_not() {
        let dir = tempfile::tempdir().unwrap();
        // A creator killed between creating its pending file and renaming it.
        let pending = dir.path().join(format!("{PENDING_PREFIX}0123"));
        std::fs::write(&pending, [0; 128]).unwrap();
        let other = dir.path().join("not-a-mirror");
        std::fs::write(&other, b"x").unwrap();
        assert_eq!(
            sweep(dir.path()).unwrap(),
            vec![Swept {
                path: pending.clone(),
                bytes: 128
            }]
        );
        assert!(!pending.exists() && other.exists());
    }

    #[test]
    fn a_link_or_directory_named_like_a_mirror_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, [0; 64]).unwrap();
        let link = dir.path().join(format!("{FILE_PREFIX}link"));
        std::os::unix::fs::symlink(&target, &link).unwrap();
        std::fs::create_dir(dir.path().join(format!("{FILE_PREFIX}dir"))).unwrap();
        assert_eq!(sweep(dir.path()).unwrap(), vec![]);
        assert!(link.symlink_metadata().is_ok() && target.exists());
    }

    #[test]
    fn creating_mirrors_while_others_sweep_never_loses_a_live_one() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let stop = AtomicBool::new(false);
        let (made, swept) = std::thread::scope(|s| {
            let sweepers: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let mut swept = Vec::new();
                        while !stop.load(Ordering::Relaxed) {
                            swept.extend(sweep(dir.path()).unwrap());
                        }
                        swept
                    })
                })
                .collect();
            let creators: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let (mut live, mut dead) = (Vec::new(), Vec::new());
                        for i in 0..200 {
                            let m = Mirror::create(dir.path(), 64, 2).unwrap();
                            if i % 2 == 0 {
                                live.push(m);
                            } else {
                                dead.push(abandon(m));
                            }
                            // Every mirror created so far and still owned is there.
                            assert!(live.iter().all(|m: &Mirror| m.path().exists()));
                        }
                        (live, dead)
                    })
                })
                .collect();
            // The sweepers stop even when a creator failed, so a failure never hangs.
            let made: Vec<_> = creators.into_iter().map(|c| c.join()).collect();
            stop.store(true, Ordering::Relaxed);
            let swept: Vec<Swept> = sweepers
                .into_iter()
                .flat_map(|s| s.join().unwrap())
                .collect();
            let made: Vec<_> = made.into_iter().map(|m| m.unwrap()).collect();
            (made, swept)
        });
        // Whatever the sweepers removed had no owner; a last sweep takes the dead ones left.
        let mut swept: Vec<PathBuf> = swept.into_iter().map(|s| s.path).collect();
        swept.extend(sweep(dir.path()).unwrap().into_iter().map(|s| s.path));
        let mut owned = Vec::new();
        for (live, dead) in &made {
            for m in live {
                assert!(
                    !swept.iter().any(|p| p == m.path()),
                    "{} was swept alive",
                    m.path().display()
                );
                owned.push(m.path().file_name().unwrap().to_string_lossy().into_owned());
            }
            for p in dead {
                assert!(swept.contains(p), "{} (dead) was not swept", p.display());
            }
        }
        owned.sort();
        assert_eq!(
            mirror_files(dir.path()),
            owned,
            "exactly the live mirrors remain"
        );
    }

    #[test]
    fn the_mirror_file_is_owner_only_and_pages_of_any_length_copy_exactly() {
        let dir = tempfile::tempdir().unwrap();
        // 61 bytes: slots after the first start unaligned and end in a partial word.
        let m = Mirror::create(dir.path(), 61, 3).unwrap();
        let meta = std::fs::symlink_metadata(m.path()).unwrap();
        assert!(meta.is_file());
        assert_eq!(meta.mode() & 0o777, 0o600);
        let peer = Mirror::open(m.path(), 61, 3).unwrap();
        for slot in 0..3 {
            // layout-arithmetic: made-up test bytes, not a layout.
            let page: Vec<u8> = (0..61).map(|i| (i * 7 + slot * 3) as u8).collect();
            let sum = peer.write_checked(slot, &page);
            assert_eq!(sum, pdmesh_kv::page_checksum(&page));
            let mut back = vec![0; 61];
            assert_eq!(m.read_checked(slot, &mut back), sum);
            assert_eq!(back, page, "slot {slot}");
        }
    }

    #[test]
    fn a_mirror_file_others_may_open_or_a_link_to_one_is_not_mapped() {
        let dir = tempfile::tempdir().unwrap();
        let m = Mirror::create(dir.path(), 64, 1).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(m.path(), &link).unwrap();
        let e = Mirror::open(&link, 64, 1).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
        let loose = dir.path().join("loose");
        std::fs::write(&loose, [0; 64]).unwrap();
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = Mirror::open(&loose, 64, 1).unwrap_err();
        assert!(e.to_string().contains("not a private regular file"), "{e}");
    }

    #[test]
    fn the_private_dir_is_made_0700_and_a_loose_foreign_or_linked_one_is_refused() {
        let base = tempfile::tempdir().unwrap();
        let dir = private_dir(base.path()).unwrap();
        assert_eq!(
            dir.file_name().unwrap().to_string_lossy(),
            format!("{DIR_PREFIX}{}", effective_uid())
        );
        let meta = std::fs::symlink_metadata(&dir).unwrap();
        assert!(meta.is_dir());
        assert_eq!(meta.mode() & 0o7777, 0o700);
        assert_eq!(
            private_dir(base.path()).unwrap(),
            dir,
            "an existing private one is used"
        );

        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = private_dir(base.path()).unwrap_err();
        assert!(e.to_string().contains("mode is 0777"), "{e}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o750)).unwrap();
        let e = private_dir(base.path()).unwrap_err();
        assert!(e.to_string().contains("mode is 0750"), "{e}");

        // Someone else's (checked against another uid, so this runs as any user).
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let other = effective_uid().wrapping_add(1);
        let e = check_private_dir(&dir, other).unwrap_err();
        assert!(e.to_string().contains("not by this service's uid"), "{e}");

        // A link planted at the name, even to a private directory of ours.
        std::fs::remove_dir(&dir).unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), &dir).unwrap();
        let e = private_dir(base.path()).unwrap_err();
        assert!(e.to_string().contains("not a directory"), "{e}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_creators_lock_is_not_inherited_by_its_children() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().unwrap();
        let m = Mirror::create(dir.path(), 64, 1).unwrap();
        let fd = m.owner.as_ref().unwrap().as_raw_fd();
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap();
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .map(|f| u32::from_str_radix(f.trim(), 8).unwrap())
            .unwrap();
        assert_ne!(flags & libc::O_CLOEXEC as u32, 0, "{info}");
    }
}

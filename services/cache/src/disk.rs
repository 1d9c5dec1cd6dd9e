//! The disk tier's page store: one file per page below the host mirror, so a prompt's
//! prefix outlives host memory and restarts. Plain blocking file I/O; the service runs it
//! on blocking threads, never on the engine's path.
//!
//! A page is found only when all of it was written and it is this layout's:
//! - a file is `<hash>.page`, written under a temporary name, synced, renamed and the
//!   folder synced; only then is it in the index, so a failed or partial write is never
//!   found, and a crash leaves at most a temporary file, removed at the next start;
//! - its header names the layout's fingerprint, the page's chained hash, its length and
//!   its checksum, and carries a checksum of its own; a load checks all of them and the
//!   bytes, and a page that fails is discarded (the file removed) and said so
//!   ([`Load::Discarded`]), never served;
//! - the whole page is one file: every component of the layout (K and V, or the MLA
//!   latent and the index-K) travels together, so none is found without the others;
//! - at start the index is rebuilt from the folder, discarding, counted by reason, what
//!   another layout wrote, what is cut short, garbled or stored under another hash's name;
//! - one service per folder: a second is refused while the first holds the lock file.
//!
//! Within `capacity` bytes the least recently used pages are removed first.

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use pdmesh_kv::page_checksum;

/// The first bytes of every page file (the last one is the format's version).
const MAGIC: [u8; 8] = *b"PDMKVPG\x01";
/// magic, fingerprint, hash, length, checksum, the header's own checksum.
pub const HEADER_BYTES: usize = 48;
const SUFFIX: &str = ".page";
const TEMP_SUFFIX: &str = ".tmp";
const LOCK: &str = "lock";

/// Why a page file was discarded instead of served (a closed label set: the gateway
/// exports `mesh_kv_disk_discards_total{reason}` by it).
pub use pdmesh_telemetry::labels::DiskDiscard as Discard;

/// What a load found.
#[derive(Debug, PartialEq, Eq)]
pub enum Load {
    /// The page's bytes, checked.
    Hit(Vec<u8>),
    /// Not on disk.
    Miss,
    /// On disk but not sound: the file is gone now, and the page is a miss.
    Discarded(Discard),
}

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error(
        "{dir} may be read by other users or is not this user's (mode {mode:o}): make it this user's, mode 0700"
    )]
    Exposed { dir: PathBuf, mode: u32 },
    #[error("{0} is used by another cache service (it holds {0}/lock)")]
    Locked(PathBuf),
    #[error("{0} is not a folder")]
    NotAFolder(PathBuf),
    #[error("disk tier {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("a page of {bytes} bytes does not fit a disk tier of {capacity} bytes")]
    TooLarge { bytes: u64, capacity: u64 },
    #[error("page {hash:016x}: its bytes do not match the checksum it was stored with")]
    Corrupt { hash: u64 },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> DiskError + use<> {
    let path = path.to_owned();
    move |source| DiskError::Io { what, path, source }
}

/// One page's header, as written at the start of its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    fingerprint: u64,
    hash: u64,
    len: u64,
    checksum: u64,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[..8].copy_from_slice(&MAGIC);
        for (i, v) in [self.fingerprint, self.hash, self.len, self.checksum]
            .into_iter()
            .enumerate()
        {
            out[8 + 8 * i..16 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        let own = page_checksum(&out[..40]);
        out[40..].copy_from_slice(&own.to_le_bytes());
        out
    }

    fn decode(b: &[u8; HEADER_BYTES]) -> Option<Header> {
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if b[..8] != MAGIC || page_checksum(&b[..40]) != word(40) {
            return None;
        }
        Some(Header {
            fingerprint: word(8),
            hash: word(16),
            len: word(24),
            checksum: word(32),
        })
    }
}

struct Entry {
    tick: u64,
    bytes: u64,
    checksum: u64,
}

/// A page folder held by this service: made owner-only if missing, refused when other
/// users may enter it or another cache service holds it. Taken at start, before the
/// layout is known; the store opens on it once the first worker registers.
#[derive(Debug)]
pub struct DiskLock {
    dir: PathBuf,
    _file: File,
}

impl DiskLock {
    pub fn take(dir: &Path) -> Result<DiskLock, DiskError> {
        // A file (a typo, most likely) is a setup to fix, not a disk fault.
        if dir.exists() && !dir.is_dir() {
            return Err(DiskError::NotAFolder(dir.into()));
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io("making", dir))?;
        // Pages hold tenants' KV: a folder other users may enter is refused before
        // anything is written into it.
        let exposed = |meta: &std::fs::Metadata| {
            use std::os::unix::fs::MetadataExt;
            DiskError::Exposed {
                dir: dir.into(),
                mode: meta.mode() & 0o7777,
            }
        };
        {
            use std::os::unix::fs::MetadataExt;
            let meta = std::fs::metadata(dir).map_err(io("reading", dir))?;
            if meta.mode() & 0o077 != 0 {
                return Err(exposed(&meta));
            }
        }
        let lock_path = dir.join(LOCK);
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&lock_path)
            .map_err(io("opening", &lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Err(DiskError::Locked(dir.into())),
            Err(std::fs::TryLockError::Error(e)) => return Err(io("locking", &lock_path)(e)),
        }
        // ... and so is a folder that is not this service's own (the lock file it just
        // created is).
        {
            use std::os::unix::fs::MetadataExt;
            let dir_meta = std::fs::metadata(dir).map_err(io("reading", dir))?;
            let own = lock.metadata().map_err(io("reading", &lock_path))?.uid();
            if dir_meta.uid() != own || dir_meta.mode() & 0o077 != 0 {
                return Err(exposed(&dir_meta));
            }
        }
        Ok(DiskLock {
            dir: dir.to_owned(),
            _file: lock,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// A page file to read outside the store's lock ([`DiskStore::to_load`]).
#[derive(Debug)]
pub struct ToLoad {
    path: PathBuf,
    hash: u64,
    fingerprint: u64,
    limit: u64,
    expected: u64,
}

impl ToLoad {
    /// Reads and checks the file (blocking I/O): the page's bytes, or why it is unsound.
    pub fn read(&self) -> Result<Vec<u8>, Option<Discard>> {
        match read_page(&self.path, self.limit) {
            Ok((Some(header), data, _)) => {
                match verify(&header, &data, self.fingerprint, self.hash) {
                    Ok(()) if header.checksum == self.expected => Ok(data),
                    // Another sound page under this name than the one stored.
                    Ok(()) => Err(Some(Discard::BadChecksum)),
                    Err(reason) => Err(Some(reason)),
                }
            }
            Ok((None, _, _)) => Err(Some(Discard::BadHeader)),
            // Gone behind the store's back: a miss.
            Err(e) if e.kind() == ErrorKind::NotFound => Err(None),
            Err(_) => Err(Some(Discard::Partial)),
        }
    }

    pub fn hash(&self) -> u64 {
        self.hash
    }
}

/// A page file to write outside the store's lock ([`DiskStore::to_write`]).
#[derive(Debug)]
pub struct ToWrite {
    temp: PathBuf,
    path: PathBuf,
    dir: PathBuf,
    header: [u8; HEADER_BYTES],
    hash: u64,
    checksum: u64,
    bytes: u64,
}

impl ToWrite {
    /// Writes the file under its temporary name, syncs it, renames it and syncs the
    /// folder (blocking I/O). A failed write leaves nothing behind.
    pub fn write(&self, data: &[u8]) -> Result<(), DiskError> {
        let written = write_synced(&self.temp, &self.header, data)
            .and_then(|()| std::fs::rename(&self.temp, &self.path))
            .and_then(|()| File::open(&self.dir)?.sync_all());
        if let Err(e) = written {
            let _ = std::fs::remove_file(&self.temp);
            return Err(io("writing", &self.temp)(e));
        }
        Ok(())
    }

    pub fn hash(&self) -> u64 {
        self.hash
    }
}

/// The pages of one KV layout in one folder.
pub struct DiskStore {
    dir: PathBuf,
    fingerprint: u64,
    capacity: u64,
    used: u64,
    tick: u64,
    index: HashMap<u64, Entry>,
    lru: BTreeMap<u64, u64>,
    /// Pages being written outside the lock, with the bytes set aside for them.
    writing: HashMap<u64, u64>,
    // Held for the store's life: the folder is this service's.
    _lock: DiskLock,
}

impl std::fmt::Debug for DiskStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskStore")
            .field("dir", &self.dir)
            .field("pages", &self.index.len())
            .field("used", &self.used)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl DiskStore {
    /// Opens `dir` (made, owner-only, if missing) for pages of the layout `fingerprint`,
    /// within `capacity` bytes of files, and rebuilds the index from what is there.
    /// Returns what was discarded, by reason.
    pub fn open(
        dir: &Path,
        fingerprint: u64,
        capacity: u64,
    ) -> Result<(DiskStore, BTreeMap<Discard, u64>), DiskError> {
        DiskStore::open_locked(DiskLock::take(dir)?, fingerprint, capacity)
    }

    /// Opens the folder `lock` holds for pages of the layout `fingerprint`, as
    /// [`DiskStore::open`] does.
    pub fn open_locked(
        lock: DiskLock,
        fingerprint: u64,
        capacity: u64,
    ) -> Result<(DiskStore, BTreeMap<Discard, u64>), DiskError> {
        let mut store = DiskStore {
            dir: lock.dir.clone(),
            fingerprint,
            capacity,
            used: 0,
            tick: 0,
            index: HashMap::new(),
            lru: BTreeMap::new(),
            writing: HashMap::new(),
            _lock: lock,
        };
        let discarded = store.rebuild()?;
        // A smaller capacity than last time: the oldest go first.
        store.make_room(0)?;
        Ok((store, discarded))
    }

    fn rebuild(&mut self) -> Result<BTreeMap<Discard, u64>, DiskError> {
        let mut discarded = BTreeMap::new();
        let mut found = Vec::new();
        let entries = std::fs::read_dir(&self.dir).map_err(io("reading", &self.dir))?;
        for entry in entries {
            let entry = entry.map_err(io("reading", &self.dir))?;
            let path = entry.path();
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if name.ends_with(TEMP_SUFFIX) {
                *discarded.entry(Discard::Unfinished).or_default() += 1;
                remove(&path)?;
                continue;
            }
            let Some(hash) = name
                .strip_suffix(SUFFIX)
                .and_then(|h| u64::from_str_radix(h, 16).ok())
            else {
                continue;
            };
            match self.check(&path, hash) {
                Ok((header, bytes, modified)) => {
                    found.push((modified, hash, bytes, header.checksum));
                }
                Err(reason) => {
                    *discarded.entry(reason).or_default() += 1;
                    remove(&path)?;
                }
            }
        }
        // The least recently written first, as they were used last.
        found.sort();
        for (_, hash, bytes, checksum) in found {
            self.insert(hash, bytes, checksum);
        }
        Ok(discarded)
    }

    /// Reads and checks the file of `hash` whole: its header, length and bytes.
    fn check(
        &self,
        path: &Path,
        hash: u64,
    ) -> Result<(Header, u64, std::time::SystemTime), Discard> {
        let (header, data, modified) =
            read_page(path, self.capacity).map_err(|_| Discard::Partial)?;
        let header = header.ok_or(Discard::BadHeader)?;
        verify(&header, &data, self.fingerprint, hash)?;
        Ok((header, (HEADER_BYTES + data.len()) as u64, modified))
    }

    fn insert(&mut self, hash: u64, bytes: u64, checksum: u64) {
        self.tick += 1;
        self.used += bytes;
        self.lru.insert(self.tick, hash);
        self.index.insert(
            hash,
            Entry {
                tick: self.tick,
                bytes,
                checksum,
            },
        );
    }

    fn touch(&mut self, hash: u64) {
        self.tick += 1;
        if let Some(e) = self.index.get_mut(&hash) {
            self.lru.remove(&e.tick);
            e.tick = self.tick;
            self.lru.insert(self.tick, hash);
        }
    }

    fn forget(&mut self, hash: u64) -> Result<(), DiskError> {
        if let Some(e) = self.index.remove(&hash) {
            self.lru.remove(&e.tick);
            self.used -= e.bytes;
        }
        remove(&self.path(hash))
    }

    /// Removes the least recently used pages until `need` more bytes fit.
    fn make_room(&mut self, need: u64) -> Result<Vec<u64>, DiskError> {
        let mut gone = Vec::new();
        while self.used + self.writing.values().sum::<u64>() + need > self.capacity {
            let Some((_, &hash)) = self.lru.iter().next() else {
                break;
            };
            self.forget(hash)?;
            gone.push(hash);
        }
        Ok(gone)
    }

    fn path(&self, hash: u64) -> PathBuf {
        self.dir.join(format!("{hash:016x}{SUFFIX}"))
    }

    /// Whether page `hash` is on disk (as far as the index knows: a load still checks).
    pub fn contains(&self, hash: u64) -> bool {
        self.index.contains_key(&hash)
    }

    /// The checksum page `hash` was stored with.
    pub fn checksum(&self, hash: u64) -> Option<u64> {
        self.index.get(&hash).map(|e| e.checksum)
    }

    /// Pages on disk.
    pub fn pages(&self) -> usize {
        self.index.len()
    }

    /// Bytes of page files on disk.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Stores page `hash` (its bytes and the checksum they were committed with): once
    /// this returns, the page survives a crash and a restart. A page already on disk is
    /// only marked used. Bytes that do not match `checksum` are refused, never written.
    pub fn put(&mut self, hash: u64, checksum: u64, data: &[u8]) -> Result<(), DiskError> {
        if page_checksum(data) != checksum {
            return Err(DiskError::Corrupt { hash });
        }
        let (Some(w), _) = self.to_write(hash, checksum, data.len())? else {
            return Ok(());
        };
        let r = w.write(data);
        self.finish_write(w, r.is_ok());
        r
    }

    /// Sets room aside for page `hash` of `len` bytes (whose checksum the caller checked),
    /// evicting the least recently used pages (returned, as the second value) for it: the
    /// write to do outside the lock, then hand to [`DiskStore::finish_write`]. `None`:
    /// already on disk or being written (marked used).
    pub fn to_write(
        &mut self,
        hash: u64,
        checksum: u64,
        len: usize,
    ) -> Result<(Option<ToWrite>, Vec<u64>), DiskError> {
        if self.index.contains_key(&hash) || self.writing.contains_key(&hash) {
            self.touch(hash);
            return Ok((None, Vec::new()));
        }
        let bytes = (HEADER_BYTES + len) as u64;
        if bytes > self.capacity {
            return Err(DiskError::TooLarge {
                bytes,
                capacity: self.capacity,
            });
        }
        let gone = self.make_room(bytes)?;
        self.writing.insert(hash, bytes);
        let header = Header {
            fingerprint: self.fingerprint,
            hash,
            len: len as u64,
            checksum,
        };
        let temp = self.dir.join(format!(
            "{hash:016x}.{}{TEMP_SUFFIX}",
            uuid::Uuid::new_v4().simple()
        ));
        Ok((
            Some(ToWrite {
                temp,
                path: self.path(hash),
                dir: self.dir.clone(),
                header: header.encode(),
                hash,
                checksum,
                bytes,
            }),
            gone,
        ))
    }

    /// Ends a write [`DiskStore::to_write`] began: the page is in the index only if
    /// `written`.
    pub fn finish_write(&mut self, w: ToWrite, written: bool) {
        self.writing.remove(&w.hash);
        if written {
            self.insert(w.hash, w.bytes, w.checksum);
        }
    }

    /// Loads page `hash`, checked whole; a page that fails a check is removed and
    /// reported as [`Load::Discarded`].
    pub fn load(&mut self, hash: u64) -> Result<Load, DiskError> {
        let Some(f) = self.to_load(hash) else {
            return Ok(Load::Miss);
        };
        let r = f.read();
        self.finish_load(hash, r)
    }

    /// The file of page `hash` to read outside the lock (`None`: not on disk).
    pub fn to_load(&self, hash: u64) -> Option<ToLoad> {
        let expected = self.checksum(hash)?;
        Some(ToLoad {
            path: self.path(hash),
            hash,
            fingerprint: self.fingerprint,
            limit: self.capacity,
            expected,
        })
    }

    /// What a read of [`DiskStore::to_load`] found: a hit marks the page used; a miss or
    /// an unsound file forgets the page (and removes the file).
    pub fn finish_load(
        &mut self,
        hash: u64,
        read: Result<Vec<u8>, Option<Discard>>,
    ) -> Result<Load, DiskError> {
        match read {
            Ok(data) => {
                self.touch(hash);
                Ok(Load::Hit(data))
            }
            Err(None) => {
                self.forget(hash)?;
                Ok(Load::Miss)
            }
            Err(Some(reason)) => {
                self.forget(hash)?;
                Ok(Load::Discarded(reason))
            }
        }
    }

    /// Every page on disk, least recently used first.
    pub fn hashes(&self) -> Vec<u64> {
        self.lru.values().copied().collect()
    }
}

/// A page file's header (`None`: not a header this version wrote), the bytes after it and
/// when it was written. An error when it cannot be read, is shorter than a header or
/// longer than `limit`.
fn read_page(
    path: &Path,
    limit: u64,
) -> std::io::Result<(Option<Header>, Vec<u8>, std::time::SystemTime)> {
    let mut f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    // Larger than the whole tier: no page of it, and never read into memory.
    if meta.len() > limit {
        return Err(std::io::Error::other("larger than the disk tier"));
    }
    let mut head = [0u8; HEADER_BYTES];
    f.read_exact(&mut head)?;
    let mut data = Vec::with_capacity(meta.len().saturating_sub(HEADER_BYTES as u64) as usize);
    f.read_to_end(&mut data)?;
    Ok((Header::decode(&head), data, meta.modified()?))
}

/// Whether `header` and `data` are page `hash` of layout `fingerprint`, whole and sound.
fn verify(header: &Header, data: &[u8], fingerprint: u64, hash: u64) -> Result<(), Discard> {
    if header.fingerprint != fingerprint {
        return Err(Discard::ForeignLayout);
    }
    if header.hash != hash {
        return Err(Discard::WrongName);
    }
    if header.len != data.len() as u64 {
        return Err(Discard::Partial);
    }
    if page_checksum(data) != header.checksum {
        return Err(Discard::BadChecksum);
    }
    Ok(())
}

/// Writes a new owner-only file `path` with `head` then `data`, and syncs it.
fn write_synced(path: &Path, head: &[u8], data: &[u8]) -> std::io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    f.write_all(head)?;
    f.write_all(data)?;
    f.sync_all()
}

fn remove(path: &Path) -> Result<(), DiskError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io("removing", path)(e)),
    }
}

#[cfg(test)]
mod tests;
pub mod tier;

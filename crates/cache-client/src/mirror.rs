//! The host mirror's memory: a file in shared memory holding `pages` slots of one KV
//! layout's page size, mapped by the cache service and by every worker on the host. The
//! same type serves both sides: the service creates the file, workers open it.
//!
//! Who may touch a slot is decided by the cache service's protocol, not by this type: a
//! worker writes only slots it reserved and has not committed, and reads only slots it has
//! pinned. A peer that breaks the protocol can only spoil bytes, and every consumer
//! verifies a page's checksum before using it.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use memmap2::MmapRaw;

/// A mapped mirror file.
pub struct Mirror {
    path: PathBuf,
    map: MmapRaw,
    page_bytes: usize,
    pages: usize,
    /// The creator removes the file when dropped.
    owner: bool,
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
        let path = dir.join(format!("pdmesh-mirror-{}", uuid::Uuid::new_v4().simple()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)?;
        file.set_len((page_bytes * pages) as u64)?;
        let mut m = Self::map(path, &file, page_bytes, pages)?;
        m.owner = true;
        Ok(m)
    }

    /// Maps an existing mirror file; its size must be exactly `pages` slots.
    pub fn open(path: &Path, page_bytes: usize, pages: usize) -> std::io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = file.metadata()?.len();
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
            owner: false,
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
        // `dst` is a distinct Rust buffer of the same length. Raw copies never form a
        // reference to memory another process may write.
        unsafe { std::ptr::copy_nonoverlapping(self.slot_ptr(slot), dst.as_mut_ptr(), dst.len()) }
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
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.slot_ptr(slot), src.len()) }
    }

    /// Copies slot `slot` into `dst` and returns the page checksum of the bytes copied,
    /// reading the slot once.
    pub fn read_checked(&self, slot: u32, dst: &mut [u8]) -> u64 {
        assert_eq!(
            dst.len(),
            self.page_bytes,
            "a page is {} bytes",
            self.page_bytes
        );
        // SAFETY: the source is one slot inside the live mapping (checked in slot_ptr),
        // `dst` a distinct Rust buffer of the same length.
        unsafe { pdmesh_kv::copy_and_checksum(self.slot_ptr(slot), dst) }
    }

    /// Copies one page from `src` into slot `slot` and returns the page checksum of `src`,
    /// reading `src` once.
    pub fn write_checked(&self, slot: u32, src: &[u8]) -> u64 {
        assert_eq!(
            src.len(),
            self.page_bytes,
            "a page is {} bytes",
            self.page_bytes
        );
        // SAFETY: as in `read_checked`, with the roles swapped.
        unsafe { pdmesh_kv::copy_to_and_checksum(src, self.slot_ptr(slot)) }
    }

    /// The page checksum of the slot's bytes, read through a private copy.
    pub fn checksum(&self, slot: u32, scratch: &mut Vec<u8>) -> u64 {
        scratch.resize(self.page_bytes, 0);
        self.read_checked(slot, scratch)
    }
}

impl Drop for Mirror {
    fn drop(&mut self) {
        if self.owner {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Where a mirror of `bytes` goes by default: /dev/shm (memory) when the host has it with
/// room enough, else the temporary directory.
pub fn default_dir(bytes: u64) -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() && fs4::available_space(shm).is_ok_and(|free| free >= bytes) {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

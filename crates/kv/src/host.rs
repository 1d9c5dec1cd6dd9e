//! `HostTier`: the host mirror as an engine sees it. A synchronous interface, so the
//! engine's loop stays plain code; implementations bound every call in time, and an absent
//! or failing tier answers "nothing held" and "nothing stored" rather than blocking or
//! failing a request. Page bytes have the device pool's page format for the pool's layout.

/// A page the host tier holds, pinned for the caller until [`HostTier::load`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostPage {
    pub hash: u64,
    pub slot: u32,
    pub checksum: u64,
}

/// What a load verified.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostLoad {
    /// Leading pages copied whose checksums matched.
    pub pages: usize,
    /// Whether the load stopped at a page whose bytes did not match its checksum (that
    /// page and the ones after it must be recomputed).
    pub corrupt: bool,
}

/// See the module docs.
pub trait HostTier: Send {
    /// The leading pages of `hashes` (chained page hashes, see [`crate::page_hashes`])
    /// the tier holds, pinned until [`HostTier::load`].
    fn lookup(&mut self, hashes: &[u64]) -> Vec<HostPage>;
    /// Copies `pages` into `dsts` (one page each), checking every checksum, stopping at the
    /// first mismatch; drops every pin of `pages` and the corrupt page itself.
    fn load(&mut self, pages: &[HostPage], dsts: &mut [&mut [u8]]) -> HostLoad;
    /// Drops the pins of pages looked up but not loaded.
    fn release(&mut self, pages: &[HostPage]);
    /// Offers pages `(hash, parent hash, bytes)` in prefix order; returns how many the
    /// tier wrote (it skips pages it holds and pages it has no room for).
    fn store(&mut self, pages: &[(u64, u64, &[u8])]) -> usize;
    /// Changes whenever the tier may have lost what it was given (e.g. the cache service
    /// restarted and this worker registered again): what was marked as written before must
    /// be offered again.
    fn generation(&self) -> u64;
}

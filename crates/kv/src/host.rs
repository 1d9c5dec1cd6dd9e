//! `HostTier`: the host mirror as an engine sees it. Nothing in it waits: a lookup and
//! load is started with [`HostTier::fetch`] and its answer taken later, as a PD hand-over
//! is; stores go to a bounded queue that counts what it drops. Implementations bound every
//! fetch in time, and an absent or failing tier answers "nothing held" rather than failing
//! a request. Page bytes have the device pool's page format for the pool's layout.

use std::task::Waker;

/// A lookup and load to start: the leading pages of `hashes` (chained page hashes, see
/// [`crate::page_hashes`]) the tier holds, copied out whole and checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fetch {
    /// Names the answer ([`Fetched::ticket`]).
    pub ticket: u64,
    pub hashes: Vec<u64>,
    /// A run shorter than this many pages is answered as a miss (recomputing it is
    /// cheaper than loading it); the pages are not copied.
    pub min_pages: usize,
}

/// The answer to a [`Fetch`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fetched {
    pub ticket: u64,
    /// The leading pages found whose checksums matched, one page's bytes each, in prompt
    /// order. Empty: a miss (nothing held, too short, the tier down or too slow).
    pub pages: Vec<Vec<u8>>,
    /// Whether the load stopped at a page whose bytes did not match its checksum (that
    /// page and the ones after it must be recomputed).
    pub corrupt: bool,
    /// Seconds from the fetch's start to its answer.
    pub seconds: f64,
}

/// A page offered for writing: its hash, its parent's (0 for a prompt's first page), its
/// bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorePage {
    pub hash: u64,
    pub parent: u64,
    pub bytes: Vec<u8>,
}

/// What the tier's store queue has done since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StoreStats {
    pub written_pages: u64,
    pub written_bytes: u64,
    /// Seconds spent writing (copies, checksums and the calls), off the engine's thread.
    pub written_seconds: f64,
    /// Pages offered while the queue was full, never written.
    pub dropped_pages: u64,
    /// Pages in the queue now, not yet written (or found held already).
    pub queued_pages: u64,
}

/// See the module docs. No method waits on the tier.
pub trait HostTier: Send {
    /// Starts `fetch`; its [`Fetched`] comes back from [`HostTier::take_fetched`], and the
    /// waker set with [`HostTier::set_waker`] is woken when it is there. Every fetch is
    /// answered exactly once, within the tier's deadline.
    fn fetch(&mut self, fetch: Fetch);
    /// The answers that arrived since the last call.
    fn take_fetched(&mut self) -> Vec<Fetched>;
    /// Whether answers are waiting to be taken.
    fn has_fetched(&self) -> bool;
    /// Woken whenever an answer arrives (replaces an earlier waker).
    fn set_waker(&mut self, waker: Waker);
    /// Queues `pages` (in prefix order) for writing; the tier skips pages it holds and
    /// pages it has no room for. False: the queue was full and they were dropped
    /// (counted in [`StoreStats::dropped_pages`]).
    fn store(&mut self, pages: Vec<StorePage>) -> bool;
    /// Whether a store could be written now (the tier is reachable): when not, the engine
    /// neither copies pages out for it nor marks them written, so they are offered again.
    fn accepts_stores(&self) -> bool;
    fn store_stats(&self) -> StoreStats;
    /// Changes whenever the tier may have lost what it was given (e.g. the cache service
    /// restarted and this worker registered again): what was marked as written before must
    /// be offered again.
    fn generation(&self) -> u64;
}

//! pdmesh-kv: the single description of how KV bytes are laid out ([`KvLayout`]) and the
//! paged pool ([`PagePool`]) whose every size is derived from it.
//!
//! Architecture Invariant: no code outside this crate computes a page size, a token
//! stride or a scale offset by hand. The seed's corruption came from a host buffer sized
//! with one layout and filled with another; here every pool, transfer and wire message
//! asks its layout, and pools with different fingerprints refuse to exchange pages.

mod checksum;
pub mod faults;
pub mod fp8;
mod host;
mod layout;
mod pool;
mod radix;

pub use checksum::{checksum_secret, copy_and_checksum, copy_to_and_checksum, page_checksum};
pub use host::{Fetch, Fetched, HostTier, StorePage, StoreStats};
pub use layout::{
    Attention, Component, DType, FP8_SCALE_BLOCK, IndexKDtype, KvLayout, LayerGroup, LayoutError,
    MAX_PAGE_BYTES, MlaCacheDtype, MlaDims, ScalePlacement, ScaleSpec,
};
pub use pool::{KvError, PageId, PagePool};
pub use radix::{
    CacheEvent, EvictedPage, NodeRef, PathPage, PrefixCache, PrefixCacheStats, page_hashes,
    salted_seed,
};

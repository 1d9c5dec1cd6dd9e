//! What one forward hands every rank and what each rank hands back: the same for the
//! llama and the DeepSeek ranks, and for the host-pool upload they share.

use std::ops::Range;

/// The host arena of the engine's pool, lent to the ranks for the duration of one forward
/// (the engine thread blocks until every rank has answered).
#[derive(Clone, Copy, Debug)]
pub struct HostArena {
    pub ptr: *const u8,
    pub len: usize,
}

// SAFETY: the pointer is only read, by rank threads, while the engine thread that owns the
// pool waits for all of them to finish (see `CudaModel::forward`).
unsafe impl Send for HostArena {}
// SAFETY: as for Send: shared reads only, while the owner waits.
unsafe impl Sync for HostArena {}

impl HostArena {
    /// # Safety
    /// The arena must still be alive and unchanged (see the type's docs).
    pub(crate) unsafe fn bytes(&self, r: Range<usize>) -> &[u8] {
        assert!(r.end <= self.len);
        // SAFETY: in bounds (checked) and alive (the caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr.add(r.start), r.len()) }
    }
}

/// One forward's inputs, shared by every rank.
#[derive(Debug)]
pub struct Job {
    pub tokens: Vec<u32>,
    pub pos: Vec<i32>,
    pub seq: Vec<i32>,
    /// Every sequence's pages, concatenated; `page_table_start[s]` is where `s` begins.
    pub page_table: Vec<i32>,
    pub page_table_start: Vec<i32>,
    /// Per token, the byte offset of its slot in the pool that each component's offset in
    /// a layer adds to (`KvLayout::slot_offset`). Empty for a layout whose components
    /// differ in token stride (DeepSeek's rank places each component itself).
    pub tok_off: Vec<i64>,
    /// Batch indices of the tokens whose logits are wanted, in order.
    pub want: Vec<u32>,
    /// Positions attended at most (max pos + 1).
    pub max_len: usize,
    /// Pages whose host bytes the device lacks.
    pub uploads: Vec<u32>,
    pub host: HostArena,
}

/// A run of pool bytes a forward wrote: `len` bytes at byte `at` of the pool's arena
/// (`KvLayout::locate` gives the page and the offset in it; a span never crosses a page).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSpan {
    pub at: usize,
    pub len: usize,
}

/// What a rank hands back: rank 0 the logits (`want.len() × vocab`), every rank the KV
/// bytes it wrote: `kv` is the concatenation of `spans`' bytes, in `spans`' order (llama:
/// token, layer, K then V, each its own heads' columns; DeepSeek: each component's values
/// and scales of each token and layer).
#[derive(Debug, Default)]
pub struct RankOut {
    pub logits: Vec<f32>,
    pub kv: Vec<u8>,
    pub spans: Vec<KvSpan>,
}

//! The pool's pages: allocation that evicts cached prefixes when short, retirement into
//! the prefix cache (offering pages to the host tier as the write policy says), and
//! eviction (writing back first under write-back).

use pdmesh_kv::{KvError, PageId, StorePage};

use super::seq::Seq;
use super::{Scheduler, WritePolicy};

impl Scheduler {
    pub(super) fn release(&mut self, pages: Vec<PageId>) {
        self.pool
            .release_all(&pages)
            .expect("engine releases only pages it holds");
    }

    /// A sequence leaves the running set: the whole pages of KV it computed go to the
    /// prefix cache (which keeps its own reference), then it drops its references.
    pub(super) fn retire_pages(&mut self, s: &mut Seq) {
        let pages = std::mem::take(&mut s.pages);
        s.behind.clear();
        self.check_host_generation();
        if let Some(c) = &mut self.cache {
            let ns = c.namespace(s.params.cache_salt.as_deref());
            let path = c.insert_in(&mut self.pool, ns, &s.tokens[..s.computed], &pages);
            if let Some((host, policy)) = &mut self.host {
                // The host tier keeps whole pages: one that gave up its window layers
                // stays on the device only.
                let pool = &self.pool;
                let offer: Vec<_> = path
                    .iter()
                    .filter(|p| {
                        !p.on_host
                            && pool.is_whole(p.page)
                            && match *policy {
                                WritePolicy::WriteThrough => true,
                                WritePolicy::WriteThroughSelective { hits } => p.hits >= hits,
                                WritePolicy::WriteBack => false,
                            }
                    })
                    .collect();
                if !offer.is_empty() && host.accepts_stores() {
                    let batch: Vec<StorePage> = offer
                        .iter()
                        .map(|p| StorePage {
                            hash: p.hash,
                            parent: p.parent_hash,
                            bytes: pool
                                .page(p.page)
                                .expect("cached pages are allocated")
                                .to_vec(),
                        })
                        .collect();
                    // Queued, not written: a full queue drops them (counted), and they
                    // are offered again next time.
                    if host.store(batch) {
                        let nodes: Vec<_> = offer.iter().map(|p| p.node).collect();
                        c.mark_on_host(&nodes);
                    }
                }
            }
        }
        self.release(pages);
    }

    /// After the host tier registered anew (its mirror may have lost everything), no page
    /// counts as written there any more.
    pub(super) fn check_host_generation(&mut self) {
        if let (Some((host, _)), Some(c)) = (&self.host, &mut self.cache)
            && host.generation() != self.host_generation
        {
            c.forget_host();
            self.host_generation = host.generation();
        }
    }

    /// Allocate `n` pages, evicting cached prefixes nobody uses if the pool is short. A
    /// hybrid model's pages come without window segments: [`Self::attach`] gives them
    /// to the pages a step writes or a window reads.
    pub(super) fn alloc(&mut self, n: usize) -> Result<Vec<PageId>, KvError> {
        self.check_host_generation();
        let free = self.pool.free_pages();
        if n > free {
            self.evict_cached(n - free);
        }
        self.pool.alloc_bare(n)
    }

    /// Gives `pages` the window segments they lack, evicting cached prefixes nobody uses
    /// while segments are short; false when even that cannot make room.
    pub(super) fn attach(&mut self, pages: &[PageId]) -> bool {
        loop {
            match self.pool.attach_window(pages) {
                Ok(()) => return true,
                Err(KvError::OutOfWindowPages { wanted, free, .. }) => {
                    self.check_host_generation();
                    if self.evict_cached(wanted - free) == 0 {
                        return false;
                    }
                }
                Err(e) => panic!("attaching segments to held pages: {e}"),
            }
        }
    }

    /// The first page some window group of this model still reads for the token at
    /// position `next` (`pages` when no group slides).
    pub(super) fn window_start(&self, next: usize, pages: usize) -> usize {
        let layout = self.pool.layout();
        (0..layout.groups().len())
            .filter(|&g| layout.groups()[g].attention != pdmesh_kv::Attention::Full)
            .map(|g| layout.pages_read(g, next).start)
            .min()
            .unwrap_or(pages)
            .min(pages)
    }

    /// Hybrid models: every running sequence gives up the window segments of pages its
    /// next token's windows have passed (freed where it is their only holder). A page
    /// about to stop being whole is first offered to the host tier (unless the policy
    /// waits for hits), which keeps whole pages only: a host hit needs no window of its
    /// own. A prefill keeps its segments: its prompt is handed over whole.
    pub(super) fn drop_behind_windows(&mut self) {
        if !self.pool.layout().is_hybrid() {
            return;
        }
        let layout = self.pool.layout().clone();
        let groups = layout.groups().len();
        for i in 0..self.running.len() {
            let s = &mut self.running[i];
            if s.part == crate::Part::Prefill {
                continue;
            }
            s.behind.resize(groups, 0);
            let starts: Vec<usize> = (0..groups)
                .map(|g| match layout.groups()[g].attention {
                    pdmesh_kv::Attention::Full => 0,
                    _ => layout.pages_read(g, s.computed).start.min(s.pages.len()),
                })
                .collect();
            let offered = s.behind.iter().copied().max().unwrap_or(0);
            let upto = starts.iter().copied().max().unwrap_or(0);
            if upto > offered {
                self.store_whole(i, offered..upto);
            }
            let s = &mut self.running[i];
            for (g, &start) in starts.iter().enumerate() {
                for &p in &s.pages[s.behind[g].min(start)..start] {
                    self.pool.drop_window(p, g);
                }
                s.behind[g] = s.behind[g].max(start);
            }
        }
    }

    /// Offers pages `range` of running sequence `i`, whole and its own, to the host tier
    /// before they lose their window layers.
    fn store_whole(&mut self, i: usize, range: std::ops::Range<usize>) {
        let (Some((host, policy)), Some(c)) = (&mut self.host, &self.cache) else {
            return;
        };
        if matches!(policy, WritePolicy::WriteThroughSelective { .. }) || !host.accepts_stores() {
            return;
        }
        let s = &self.running[i];
        let ps = self.cfg.page_size;
        let ns = c.namespace(s.params.cache_salt.as_deref());
        let hashes = pdmesh_kv::page_hashes(ns, &s.tokens[..range.end * ps], ps);
        let pool = &self.pool;
        let batch: Vec<StorePage> = range
            .filter(|&j| pool.ref_count(s.pages[j]) == 1 && pool.is_whole(s.pages[j]))
            .map(|j| StorePage {
                hash: hashes[j],
                parent: if j == 0 { ns } else { hashes[j - 1] },
                bytes: pool.page(s.pages[j]).expect("a whole page").into_owned(),
            })
            .collect();
        if !batch.is_empty() {
            // Queued; a full queue drops them (counted).
            host.store(batch);
        }
    }

    /// Evicts up to `n` cached pages only the prefix cache holds, least recently used
    /// first; under write-back, pages the host tier lacks are written there before they
    /// go. Returns how many pages were freed.
    pub(super) fn evict_cached(&mut self, n: usize) -> usize {
        let Some(c) = &mut self.cache else {
            return 0;
        };
        match &mut self.host {
            Some((host, WritePolicy::WriteBack)) if host.accepts_stores() => {
                // Copy out what the host tier lacks while the pages still exist.
                let mut out: Vec<StorePage> = Vec::new();
                let freed = c.evict_with(&mut self.pool, n, |e, pool| {
                    if !e.on_host && pool.is_whole(e.page) {
                        let bytes = pool.page(e.page).expect("evicted pages are allocated");
                        out.push(StorePage {
                            hash: e.hash,
                            parent: e.parent_hash,
                            bytes: bytes.to_vec(),
                        });
                    }
                });
                // Leaves go first: put each chain back in prefix order.
                out.reverse();
                // Queued; a full queue drops them (counted): they are gone from here.
                host.store(out);
                freed
            }
            _ => c.evict(&mut self.pool, n),
        }
    }
}

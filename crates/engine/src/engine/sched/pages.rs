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
        self.check_host_generation();
        if let Some(c) = &mut self.cache {
            let ns = c.namespace(s.params.cache_salt.as_deref());
            let path = c.insert_in(&mut self.pool, ns, &s.tokens[..s.computed], &pages);
            if let Some((host, policy)) = &mut self.host {
                let offer: Vec<_> = path
                    .iter()
                    .filter(|p| {
                        !p.on_host
                            && match *policy {
                                WritePolicy::WriteThrough => true,
                                WritePolicy::WriteThroughSelective { hits } => p.hits >= hits,
                                WritePolicy::WriteBack => false,
                            }
                    })
                    .collect();
                if !offer.is_empty() && host.accepts_stores() {
                    let pool = &self.pool;
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

    /// Allocate `n` pages, evicting cached prefixes nobody uses if the pool is short.
    pub(super) fn alloc(&mut self, n: usize) -> Result<Vec<PageId>, KvError> {
        self.check_host_generation();
        let free = self.pool.free_pages();
        if n > free {
            self.evict_cached(n - free);
        }
        self.pool.alloc(n)
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
                    if !e.on_host {
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

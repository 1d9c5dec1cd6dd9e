//! `PrefixCache`: the device tier of the KV cache. A radix tree over token ids at page
//! granularity — every edge is one full page of tokens — whose nodes own one reference to
//! the pool page holding that page's KV. A new request reuses the longest cached prefix
//! without recomputing it; pages only the cache still holds are evicted least recently
//! used first, leaves before their parents.
//!
//! Reuse is exact: a page's KV depends only on the tokens up to its end (the engine is
//! batch- and chunk-invariant), so a page computed by one request is bit for bit the page
//! another request would compute.
//!
//! The tree has one root per namespace: requests with a `cache_salt` share pages only with
//! requests of the same salt, and salt-less ones only with each other ([`salted_seed`]).
//! A namespace is the seed its hash chain starts from, so its pages' names differ too, on
//! every tier and in every event.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::{PageId, PagePool};

const ROOT: usize = 0;

#[derive(Debug)]
struct Node {
    /// [`ROOT`] for a prompt's first page.
    parent: usize,
    /// The namespace (its chain's seed) this page belongs to.
    ns: u64,
    /// This node's page of token ids (empty for the root).
    key: Box<[u32]>,
    page: PageId,
    children: HashMap<Box<[u32]>, usize>,
    last_use: u64,
    /// Chained hash of every token up to this page's end ([`page_hashes`]), from `ns`.
    hash: u64,
    /// Times a request reused this page.
    hits: u32,
    /// Whether the host tier has been given this page.
    on_host: bool,
    /// Whether a hit may end at this page: every window group holds the pages its
    /// window reads for the next token (always, for a dense layout). Fixed while cached:
    /// only a page's sole holder drops its window segments, and the cache holds it.
    servable: bool,
}

/// One whole page on a sequence's path through the tree, as [`PrefixCache::insert`]
/// reports it (for write-through to the host tier).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PathPage {
    pub node: NodeRef,
    pub hash: u64,
    pub parent_hash: u64,
    pub page: PageId,
    pub hits: u32,
    pub on_host: bool,
}

/// The pages an insert adds: their parent's hash, their hashes, tokens and unservable
/// hashes (a [`CacheEvent::Stored`] in the making).
type NewChain = (u64, Vec<u64>, Vec<u32>, Vec<u64>);

/// A node of the tree, valid until the next eviction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeRef(usize);

/// A page about to leave the device tier, handed to the eviction callback while its bytes
/// are still in the pool (for write-back to the host tier).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvictedPage {
    pub hash: u64,
    pub parent_hash: u64,
    pub page: PageId,
    pub on_host: bool,
}

/// A change to the set of pages the cache holds, for routers that send a request where
/// its prefix is cached. Pages are named by their chained hash ([`page_hashes`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// A chain of pages entered the cache: `hashes[0]`'s parent is `parent_hash` (the
    /// seed for a prompt's first page), each next page's parent the one before it;
    /// `tokens` are the pages' tokens in order, a page's worth each.
    Stored {
        parent_hash: u64,
        hashes: Vec<u64>,
        tokens: Vec<u32>,
        /// Pages of `hashes` held but not servable as a prefix's end: a sliding-window
        /// group dropped pages its window reads there, so a hit stops before them.
        unservable: Vec<u64>,
    },
    /// These pages left the cache.
    Removed { hashes: Vec<u64> },
    /// Every page left the cache.
    Cleared,
}

/// Counters since the cache was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompt tokens served from cached pages.
    pub hit_tokens: u64,
    /// Pages added to the tree.
    pub inserted_pages: u64,
    /// Pages evicted to make room.
    pub evicted_pages: u64,
}

/// See the module docs. The cache does not own the pool; every call that changes page
/// references takes it, so the pool's counts always tell who holds what.
#[derive(Debug)]
pub struct PrefixCache {
    page_size: usize,
    seed: u64,
    /// Slab of nodes; `None` marks a free slot. Slot 0 is the root, a placeholder parent
    /// of every first page (its `children` stay empty: see `firsts`).
    nodes: Vec<Option<Node>>,
    /// Each namespace's first pages, by their tokens. A namespace without pages has no
    /// entry, so a client naming many salts leaves nothing behind once they are evicted.
    firsts: HashMap<u64, HashMap<Box<[u32]>, usize>>,
    free_slots: Vec<usize>,
    tick: u64,
    stats: PrefixCacheStats,
    /// Changes not yet taken, when recording ([`Self::record_events`]).
    events: Option<Vec<CacheEvent>>,
}

impl PrefixCache {
    /// A cache of `page_size`-token pages whose chained hashes start from `seed` (the KV
    /// layout's fingerprint).
    pub fn new(page_size: usize, seed: u64) -> Self {
        assert!(page_size > 0, "page size must be > 0");
        let root = Node {
            parent: ROOT,
            ns: seed,
            key: Box::new([]),
            page: PageId::MAX,
            children: HashMap::new(),
            last_use: 0,
            hash: seed,
            hits: 0,
            on_host: false,
            servable: true,
        };
        Self {
            page_size,
            seed,
            nodes: vec![Some(root)],
            firsts: HashMap::new(),
            free_slots: Vec::new(),
            tick: 0,
            stats: PrefixCacheStats::default(),
            events: None,
        }
    }

    /// From now on, remember every change for [`Self::take_events`] (whoever turns this on
    /// must take them, or they pile up).
    pub fn record_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The changes since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Every page held now, as `Stored` events parents first: what a router that starts
    /// listening now must know, before the events that follow.
    pub fn snapshot(&self) -> Vec<CacheEvent> {
        let mut out = Vec::with_capacity(self.cached_pages());
        let mut queue: std::collections::VecDeque<usize> = self
            .firsts
            .values()
            .flat_map(|m| m.values().copied())
            .collect();
        while let Some(i) = queue.pop_front() {
            let n = self.node(i);
            // Siblings share a parent but are not a chain: one event each.
            out.push(CacheEvent::Stored {
                parent_hash: self.parent_hash(i),
                hashes: vec![n.hash],
                tokens: n.key.to_vec(),
                unservable: if n.servable { Vec::new() } else { vec![n.hash] },
            });
            queue.extend(n.children.values().copied());
        }
        out
    }

    fn emit(&mut self, e: CacheEvent) {
        if let Some(ev) = &mut self.events {
            ev.push(e);
        }
    }

    pub fn stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Pages in the tree (in use by requests or not).
    pub fn cached_pages(&self) -> usize {
        self.nodes.len() - 1 - self.free_slots.len()
    }

    /// The hash node `i`'s chain continues: its parent's, or its namespace's seed.
    fn parent_hash(&self, i: usize) -> u64 {
        let n = self.node(i);
        if n.parent == ROOT {
            n.ns
        } else {
            self.node(n.parent).hash
        }
    }

    /// The child of node `at` (in namespace `ns`) whose page holds `chunk`.
    fn child(&self, ns: u64, at: usize, chunk: &[u32]) -> Option<usize> {
        if at == ROOT {
            self.firsts.get(&ns)?.get(chunk).copied()
        } else {
            self.node(at).children.get(chunk).copied()
        }
    }

    /// The namespace of requests with `salt` (none: the salt-less one). See
    /// [`salted_seed`].
    pub fn namespace(&self, salt: Option<&str>) -> u64 {
        salted_seed(self.seed, salt)
    }

    fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("live node")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node {
        self.nodes[i].as_mut().expect("live node")
    }

    /// The longest cached prefix of `tokens`, in whole pages and at most `max_tokens`
    /// tokens, in the salt-less namespace: see [`Self::match_prefix_in`].
    pub fn match_prefix(
        &mut self,
        pool: &mut PagePool,
        tokens: &[u32],
        max_tokens: usize,
    ) -> Vec<PageId> {
        self.match_prefix_in(pool, self.seed, tokens, max_tokens)
    }

    /// The longest prefix of `tokens` cached in namespace `ns` ([`Self::namespace`]), in
    /// whole pages and at most `max_tokens` tokens: returns its pages, each retained once
    /// in `pool` on the caller's behalf (the caller releases them like pages it
    /// allocated). Matched pages count as used now.
    pub fn match_prefix_in(
        &mut self,
        pool: &mut PagePool,
        ns: u64,
        tokens: &[u32],
        max_tokens: usize,
    ) -> Vec<PageId> {
        self.tick += 1;
        let ps = self.page_size;
        let mut path = Vec::new();
        let mut at = ROOT;
        for chunk in tokens[..max_tokens.min(tokens.len())].chunks_exact(ps) {
            let Some(child) = self.child(ns, at, chunk) else {
                break;
            };
            path.push(child);
            at = child;
        }
        // A hit ends where the next token's windows are all held.
        let servable = path
            .iter()
            .rposition(|&i| self.node(i).servable)
            .map_or(0, |k| k + 1);
        let mut pages = Vec::with_capacity(servable);
        for &i in &path[..servable] {
            let tick = self.tick;
            let n = self.node_mut(i);
            n.last_use = tick;
            n.hits = n.hits.saturating_add(1);
            pool.retain(n.page)
                .expect("a cached page is allocated: the cache holds a reference");
            pages.push(n.page);
        }
        self.stats.hit_tokens += (pages.len() * ps) as u64;
        pages
    }

    /// [`Self::insert_in`] the salt-less namespace.
    pub fn insert(
        &mut self,
        pool: &mut PagePool,
        tokens: &[u32],
        pages: &[PageId],
    ) -> Vec<PathPage> {
        self.insert_in(pool, self.seed, tokens, pages)
    }

    /// Record that `pages` hold the KV of `tokens`, in namespace `ns`; only whole pages
    /// are cached (`tokens.len() / page_size` of them, which `pages` must cover). A page
    /// new to the tree gains a reference held by the cache; where the tree already has
    /// these tokens under another page, the tree keeps its own and the caller's copy stays
    /// the caller's. Returns the tree's pages along the whole path.
    pub fn insert_in(
        &mut self,
        pool: &mut PagePool,
        ns: u64,
        tokens: &[u32],
        pages: &[PageId],
    ) -> Vec<PathPage> {
        self.tick += 1;
        let ps = self.page_size;
        let full = tokens.len() / ps;
        assert!(
            pages.len() >= full,
            "{full} full pages of tokens but {} pages",
            pages.len()
        );
        let mut at = ROOT;
        let mut path = Vec::with_capacity(full);
        // The new pages: once one is new, every page after it is (it has no children).
        let mut stored: Option<NewChain> = None;
        // Whether each page could end a hit, from the pages the tree will hold: its own
        // where it has a page already, the caller's where the page is new.
        let mut held: Vec<PageId> = Vec::with_capacity(full);
        for (chunk, &page) in tokens.chunks_exact(ps).zip(pages) {
            let tick = self.tick;
            let parent_hash = if at == ROOT { ns } else { self.node(at).hash };
            if let Some(child) = self.child(ns, at, chunk) {
                held.push(self.node(child).page);
                let n = self.node_mut(child);
                n.last_use = tick;
                path.push(PathPage {
                    node: NodeRef(child),
                    hash: n.hash,
                    parent_hash,
                    page: n.page,
                    hits: n.hits,
                    on_host: n.on_host,
                });
                at = child;
                continue;
            }
            pool.retain(page).expect("inserted pages are allocated");
            held.push(page);
            let servable = pool.servable_end(&held);
            let key: Box<[u32]> = chunk.into();
            let hash = chain_hash(parent_hash, chunk);
            let node = Node {
                parent: at,
                ns,
                key: key.clone(),
                page,
                children: HashMap::new(),
                last_use: tick,
                hash,
                hits: 0,
                on_host: false,
                servable,
            };
            let slot = match self.free_slots.pop() {
                Some(s) => {
                    self.nodes[s] = Some(node);
                    s
                }
                None => {
                    self.nodes.push(Some(node));
                    self.nodes.len() - 1
                }
            };
            if at == ROOT {
                self.firsts.entry(ns).or_default().insert(key, slot);
            } else {
                self.node_mut(at).children.insert(key, slot);
            }
            self.stats.inserted_pages += 1;
            let s = stored.get_or_insert_with(|| (parent_hash, Vec::new(), Vec::new(), Vec::new()));
            s.1.push(hash);
            s.2.extend_from_slice(chunk);
            if !servable {
                s.3.push(hash);
            }
            path.push(PathPage {
                node: NodeRef(slot),
                hash,
                parent_hash,
                page,
                hits: 0,
                on_host: false,
            });
            at = slot;
        }
        if let Some((parent_hash, hashes, tokens, unservable)) = stored {
            self.emit(CacheEvent::Stored {
                parent_hash,
                hashes,
                tokens,
                unservable,
            });
        }
        path
    }

    /// Note that the host tier holds these pages (from the latest [`Self::insert`]).
    pub fn mark_on_host(&mut self, nodes: &[NodeRef]) {
        for n in nodes {
            if let Some(node) = self.nodes.get_mut(n.0).and_then(Option::as_mut) {
                node.on_host = true;
            }
        }
    }

    /// Forget which pages the host tier was given (it lost them).
    pub fn forget_host(&mut self) {
        for n in self.nodes.iter_mut().flatten() {
            n.on_host = false;
        }
    }

    /// The seed of the hash chain.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether nothing but the cache holds node `i`'s page and all of its subtree's.
    fn evictable_subtree(&self, pool: &PagePool, i: usize) -> bool {
        let n = self.node(i);
        pool.ref_count(n.page) == 1
            && n.children
                .values()
                .all(|&c| self.evictable_subtree(pool, c))
    }

    /// Pages that eviction could free now: held by the cache alone, with no page below
    /// them in use.
    pub fn evictable_pages(&self, pool: &PagePool) -> usize {
        let mut count = 0;
        let mut stack: Vec<usize> = self
            .firsts
            .values()
            .flat_map(|m| m.values().copied())
            .collect();
        while let Some(i) = stack.pop() {
            if self.evictable_subtree(pool, i) {
                count += self.subtree_size(i);
            } else {
                stack.extend(self.node(i).children.values().copied());
            }
        }
        count
    }

    fn subtree_size(&self, i: usize) -> usize {
        1 + self
            .node(i)
            .children
            .values()
            .map(|&c| self.subtree_size(c))
            .sum::<usize>()
    }

    /// Evict up to `n` pages that only the cache holds, least recently used leaves first
    /// (a parent becomes a candidate once its children are gone). Returns how many pages
    /// went back to the pool.
    pub fn evict(&mut self, pool: &mut PagePool, n: usize) -> usize {
        self.evict_with(pool, n, |_, _| {})
    }

    /// [`Self::evict`], calling `before` with each page while its bytes are still in the
    /// pool (write-back to the host tier).
    pub fn evict_with(
        &mut self,
        pool: &mut PagePool,
        n: usize,
        mut before: impl FnMut(&EvictedPage, &PagePool),
    ) -> usize {
        let evictable = |this: &Self, pool: &PagePool, i: usize| {
            let node = this.node(i);
            node.children.is_empty() && pool.ref_count(node.page) == 1
        };
        let mut heap: BinaryHeap<Reverse<(u64, usize)>> = (1..self.nodes.len())
            .filter(|&i| self.nodes[i].is_some() && evictable(self, pool, i))
            .map(|i| Reverse((self.node(i).last_use, i)))
            .collect();
        let mut freed = 0;
        let mut removed = Vec::new();
        while freed < n {
            let Some(Reverse((_, i))) = heap.pop() else {
                break;
            };
            let evicted = EvictedPage {
                hash: self.node(i).hash,
                parent_hash: self.parent_hash(i),
                page: self.node(i).page,
                on_host: self.node(i).on_host,
            };
            let node = self.nodes[i].take().expect("heap holds live nodes");
            before(&evicted, pool);
            self.free_slots.push(i);
            if node.parent == ROOT {
                if let Some(m) = self.firsts.get_mut(&node.ns) {
                    m.remove(&node.key);
                    if m.is_empty() {
                        self.firsts.remove(&node.ns);
                    }
                }
            } else {
                self.node_mut(node.parent).children.remove(&node.key);
            }
            pool.release(node.page)
                .expect("the cache held a reference to this page");
            freed += 1;
            self.stats.evicted_pages += 1;
            removed.push(evicted.hash);
            if node.parent != ROOT && evictable(self, pool, node.parent) {
                heap.push(Reverse((self.node(node.parent).last_use, node.parent)));
            }
        }
        if !removed.is_empty() {
            self.emit(CacheEvent::Removed { hashes: removed });
        }
        freed
    }

    /// Drop every page the cache holds (pages still used by requests stay theirs).
    pub fn clear(&mut self, pool: &mut PagePool) {
        for slot in self.nodes.iter_mut().skip(1) {
            if let Some(n) = slot.take() {
                pool.release(n.page)
                    .expect("the cache held a reference to this page");
            }
        }
        self.nodes.truncate(1);
        self.free_slots.clear();
        self.firsts.clear();
        self.emit(CacheEvent::Cleared);
    }
}

/// The seed of the hash chain of requests with `salt` (vLLM's `cache_salt`), from the
/// layout's `seed`: `seed` itself without a salt, else a seed that depends on both. Pages
/// of different salts never share a name, so they are never shared on any tier, in any
/// event or in routing; a router that does not know the salt cannot name them either.
pub fn salted_seed(seed: u64, salt: Option<&str>) -> u64 {
    match salt {
        None => seed,
        Some(salt) => {
            let mut bytes = Vec::with_capacity(salt.len() + 11);
            bytes.extend_from_slice(b"cache_salt\0");
            bytes.extend_from_slice(salt.as_bytes());
            xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, seed)
        }
    }
}

/// Chained hashes naming the whole pages of `tokens`: page i's hash covers every token up
/// to the end of page i, and the chain starts from `seed` — the KV layout's fingerprint
/// (salted by [`salted_seed`] for a request with a `cache_salt`), so pages of different
/// layouts or salts never share a name. Equal hashes mean equal KV bytes. The host mirror
/// indexes pages by these.
pub fn page_hashes(seed: u64, tokens: &[u32], page_size: usize) -> Vec<u64> {
    let mut h = seed;
    tokens
        .chunks_exact(page_size)
        .map(|page| {
            h = chain_hash(h, page);
            h
        })
        .collect()
}

fn chain_hash(parent: u64, page: &[u32]) -> u64 {
    let bytes: Vec<u8> = page.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, parent)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{DType, KvLayout};

    fn pool(pages: usize) -> PagePool {
        PagePool::new(Arc::new(KvLayout::llama(1, 1, 2, DType::F16, 4)), pages)
    }

    /// Allocate pages for `tokens` as a request would, and cache them.
    fn run_and_cache(c: &mut PrefixCache, p: &mut PagePool, tokens: &[u32]) -> Vec<PageId> {
        let hit = c.match_prefix(p, tokens, tokens.len());
        let mut pages = hit.clone();
        pages.extend(
            p.alloc(p.pages_for_tokens(tokens.len()) - hit.len())
                .unwrap(),
        );
        c.insert(p, tokens, &pages);
        p.release_all(&pages).unwrap();
        pages
    }

    #[test]
    fn page_hashes_chain_whole_pages_under_a_seed() {
        let t: Vec<u32> = (0..10).collect();
        let h = page_hashes(7, &t, 4);
        assert_eq!(h.len(), 2, "the partial page has no name");
        assert_eq!(page_hashes(7, &t[..8], 4), h);
        // A different first page changes every later name; another seed too.
        let mut u = t.clone();
        u[0] = 99;
        let hu = page_hashes(7, &u, 4);
        assert!(hu[0] != h[0] && hu[1] != h[1]);
        assert!(page_hashes(8, &t, 4).iter().zip(&h).all(|(a, b)| a != b));
    }

    #[test]
    fn matches_whole_pages_of_the_longest_prefix_only() {
        let (mut p, mut c) = (pool(16), PrefixCache::new(4, 0));
        let a: Vec<u32> = (0..10).collect(); // 2 full pages + 2 tokens
        let pages = run_and_cache(&mut c, &mut p, &a);
        assert_eq!(c.cached_pages(), 2, "the partial last page is not cached");
        assert_eq!(p.free_pages(), 14);

        // Same first page, different second page.
        let b = [0, 1, 2, 3, 4, 5, 6, 99, 8];
        let hit = c.match_prefix(&mut p, &b, b.len());
        assert_eq!(hit, vec![pages[0]]);
        assert_eq!(
            p.ref_count(pages[0]),
            2,
            "the match holds a reference for the caller"
        );
        p.release_all(&hit).unwrap();

        // max_tokens caps the match (a request must compute at least its last token).
        let hit = c.match_prefix(&mut p, &a[..8], 7);
        assert_eq!(hit, vec![pages[0]]);
        p.release_all(&hit).unwrap();
        assert_eq!(c.stats().hit_tokens, 8);
    }

    #[test]
    fn paths_carry_chained_hashes_hits_and_eviction_sees_pages_before_they_go() {
        let (mut p, mut c) = (pool(16), PrefixCache::new(4, 42));
        let t: Vec<u32> = (0..9).collect();
        let pages = p.alloc(3).unwrap();
        let path = c.insert(&mut p, &t, &pages);
        p.release_all(&pages).unwrap();
        let h = page_hashes(42, &t, 4);
        assert_eq!(path.iter().map(|x| x.hash).collect::<Vec<_>>(), h);
        assert_eq!((path[0].parent_hash, path[1].parent_hash), (42, h[0]));
        let hit = c.match_prefix(&mut p, &t, 8);
        p.release_all(&hit).unwrap();
        let again = c.insert(&mut p, &t, &pages);
        assert_eq!(again.iter().map(|x| x.hits).collect::<Vec<_>>(), [1, 1]);
        c.mark_on_host(&[again[1].node]);
        let mut seen = Vec::new();
        assert_eq!(
            c.evict_with(&mut p, 2, |e, pool| seen.push((*e, pool.ref_count(e.page)))),
            2
        );
        assert_eq!(seen[0].0.hash, h[1]);
        assert!(seen[0].0.on_host && !seen[1].0.on_host);
        assert_eq!(
            seen[0].1, 1,
            "the page is still allocated when the callback runs"
        );
        assert_eq!(p.free_pages(), 16);
    }

    /// Requests with different salts, or a salt and none, share no page; the same salt
    /// shares, under names only that salt gives; events, snapshots and eviction name the
    /// salted chain, and an evicted namespace leaves nothing behind.
    #[test]
    fn salted_namespaces_share_nothing_with_each_other_or_the_salt_less() {
        let (mut p, mut c) = (pool(32), PrefixCache::new(4, 42));
        c.record_events();
        let t: Vec<u32> = (0..9).collect();
        let (a, b) = (c.namespace(Some("tenant-a")), c.namespace(Some("tenant-b")));
        assert_eq!(c.namespace(None), 42);
        assert!(a != b && a != 42 && b != 42);
        assert_eq!(
            a,
            salted_seed(42, Some("tenant-a")),
            "a pure function of both"
        );
        assert_ne!(
            salted_seed(43, Some("tenant-a")),
            a,
            "the layout's seed matters"
        );

        // Tenant a computes the prompt: its pages are named from its salted seed.
        let pages = p.alloc(3).unwrap();
        let path = c.insert_in(&mut p, a, &t, &pages);
        p.release_all(&pages).unwrap();
        let ha = page_hashes(a, &t, 4);
        assert_eq!(path.iter().map(|x| x.hash).collect::<Vec<_>>(), ha);
        assert_eq!(path[0].parent_hash, a);
        assert!(ha.iter().all(|h| !page_hashes(42, &t, 4).contains(h)));
        assert_eq!(
            c.take_events(),
            [CacheEvent::Stored {
                parent_hash: a,
                hashes: ha.clone(),
                tokens: t[..8].to_vec(),
                unservable: vec![],
            }]
        );

        // Tenant b and a salt-less request find nothing; tenant a finds both pages.
        assert!(c.match_prefix_in(&mut p, b, &t, 8).is_empty());
        assert!(c.match_prefix(&mut p, &t, 8).is_empty());
        let hit = c.match_prefix_in(&mut p, a, &t, 8);
        assert_eq!(hit, pages[..2]);
        p.release_all(&hit).unwrap();

        // The same tokens salt-less are a second, separately named copy.
        let own = p.alloc(2).unwrap();
        let path = c.insert(&mut p, &t[..8], &own);
        p.release_all(&own).unwrap();
        assert_eq!(path.iter().map(|x| x.page).collect::<Vec<_>>(), own);
        assert_eq!(c.cached_pages(), 4);
        let snap = c.snapshot();
        let parents: Vec<u64> = snap
            .iter()
            .filter_map(|e| match e {
                CacheEvent::Stored { parent_hash, .. } => Some(*parent_hash),
                _ => None,
            })
            .collect();
        assert!(parents.contains(&a) && parents.contains(&42), "{snap:?}");

        // Eviction names each page's own chain; an emptied namespace is forgotten.
        let mut seen = Vec::new();
        assert_eq!(c.evict_with(&mut p, 4, |e, _| seen.push(*e)), 4);
        let firsts: Vec<u64> = seen
            .iter()
            .filter(|e| e.parent_hash == a || e.parent_hash == 42)
            .map(|e| e.hash)
            .collect();
        assert!(firsts.contains(&ha[0]) && firsts.contains(&page_hashes(42, &t, 4)[0]));
        assert!(c.firsts.is_empty(), "no namespace outlives its pages");
        assert_eq!(p.free_pages(), 32);
    }

    #[test]
    fn duplicate_pages_stay_with_the_caller() {
        let (mut p, mut c) = (pool(16), PrefixCache::new(4, 0));
        let t: Vec<u32> = (0..8).collect();
        let first = run_and_cache(&mut c, &mut p, &t);
        // A request that computed the same tokens into its own pages (it ran before the
        // first finished): inserting keeps the tree's pages, the caller's go back.
        let own = p.alloc(2).unwrap();
        c.insert(&mut p, &t, &own);
        p.release_all(&own).unwrap();
        assert_eq!(p.free_pages(), 14);
        assert_eq!(c.match_prefix(&mut p, &t, 8), first);
    }

    #[test]
    fn events_replay_to_the_set_of_cached_pages_and_a_snapshot_equals_the_replay() {
        let mut p = pool(16);
        let mut c = PrefixCache::new(4, 7);
        run_and_cache(&mut c, &mut p, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert!(c.take_events().is_empty(), "not recording yet");
        c.record_events();
        let a: Vec<u32> = (1..=12).collect();
        let b: Vec<u32> = [1, 2, 3, 4, 9, 9, 9, 9].into();
        run_and_cache(&mut c, &mut p, &a);
        run_and_cache(&mut c, &mut p, &b);
        run_and_cache(&mut c, &mut p, &a); // nothing new: no event
        let ha = page_hashes(7, &a, 4);
        let hb = page_hashes(7, &b, 4);
        assert_eq!(
            c.take_events(),
            [
                CacheEvent::Stored {
                    parent_hash: ha[1],
                    hashes: vec![ha[2]],
                    tokens: a[8..12].to_vec(),
                    unservable: vec![],
                },
                CacheEvent::Stored {
                    parent_hash: ha[0],
                    hashes: vec![hb[1]],
                    tokens: b[4..8].to_vec(),
                    unservable: vec![],
                },
            ]
        );
        assert_eq!(c.evict(&mut p, 1), 1);
        let ev = c.take_events();
        let [CacheEvent::Removed { hashes }] = &ev[..] else {
            panic!("{ev:?}")
        };
        assert_eq!(hashes.len(), 1);
        assert!(hashes[0] == ha[2] || hashes[0] == hb[1]);
        // The snapshot names exactly the pages left, parents before children.
        let mut held: Vec<u64> = ha.iter().chain(&hb[1..]).copied().collect();
        held.retain(|h| *h != hashes[0]);
        let snap = c.snapshot();
        let mut seen = vec![7u64];
        for e in &snap {
            let CacheEvent::Stored {
                parent_hash,
                hashes,
                tokens,
                ..
            } = e
            else {
                panic!("{e:?}")
            };
            assert!(seen.contains(parent_hash), "parent first");
            // Each snapshot page carries its own tokens, which hash to its name.
            assert_eq!(tokens.len(), 4);
            assert_eq!(hashes[0], crate::radix::chain_hash(*parent_hash, tokens));
            seen.extend(hashes);
        }
        seen.remove(0);
        seen.sort_unstable();
        held.sort_unstable();
        assert_eq!(seen, held);
        c.clear(&mut p);
        assert_eq!(c.take_events(), [CacheEvent::Cleared]);
        assert!(c.snapshot().is_empty());
    }

    #[test]
    fn evicts_least_recently_used_leaves_and_never_pages_in_use() {
        let (mut p, mut c) = (pool(16), PrefixCache::new(4, 0));
        let a: Vec<u32> = (0..8).collect();
        let b: Vec<u32> = (100..108).collect();
        let pa = run_and_cache(&mut c, &mut p, &a);
        let pb = run_and_cache(&mut c, &mut p, &b);
        // Touch `a`: `b` is now least recently used.
        let hit = c.match_prefix(&mut p, &a, 8);
        p.release_all(&hit).unwrap();
        assert_eq!(c.evictable_pages(&p), 4);

        assert_eq!(c.evict(&mut p, 1), 1);
        assert_eq!(p.ref_count(pb[1]), 0, "b's leaf goes first");
        assert_eq!(c.evict(&mut p, 1), 1);
        assert_eq!(p.ref_count(pb[0]), 0, "then its parent, now a leaf");

        // A request holding `a`'s pages pins them.
        let held = c.match_prefix(&mut p, &a, 8);
        assert_eq!(c.evictable_pages(&p), 0);
        assert_eq!(c.evict(&mut p, 10), 0);
        assert_eq!(p.ref_count(pa[0]), 2);
        p.release_all(&held).unwrap();
        assert_eq!(c.evict(&mut p, 10), 2);
        assert_eq!(p.free_pages(), 16, "pool back to baseline");
        assert_eq!(c.cached_pages(), 0);
        assert_eq!(c.stats().evicted_pages, 4);
    }

    #[test]
    fn a_parent_in_use_below_a_free_leaf_is_not_counted_evictable() {
        let (mut p, mut c) = (pool(16), PrefixCache::new(4, 0));
        let long: Vec<u32> = (0..12).collect();
        run_and_cache(&mut c, &mut p, &long);
        // A request holds the first page only.
        let held = c.match_prefix(&mut p, &long, 4);
        assert_eq!(c.evictable_pages(&p), 2, "the two pages below the held one");
        assert_eq!(c.evict(&mut p, 10), 2);
        assert_eq!(c.cached_pages(), 1);
        p.release_all(&held).unwrap();
        c.clear(&mut p);
        assert_eq!(p.free_pages(), 16);
    }

    #[test]
    fn a_hybrid_hit_ends_where_the_windows_are_held_and_events_say_which_pages_are_not() {
        // 4-token pages, a window of 8 over layers 0 and 1, layer 2 global.
        let layout = Arc::new(
            KvLayout::llama(3, 1, 2, DType::F16, 4)
                .with_window(8, &[2])
                .unwrap(),
        );
        let mut p = PagePool::new(layout.clone(), 16);
        let mut c = PrefixCache::new(4, layout.fingerprint());
        c.record_events();
        let t: Vec<u32> = (0..24).collect();
        let pages = p.alloc(6).unwrap();
        // The sequence's window passed its first two pages.
        assert!(p.drop_window(pages[0], 1) && p.drop_window(pages[1], 1));
        c.insert(&mut p, &t, &pages);
        p.release_all(&pages).unwrap();
        let hashes = page_hashes(c.seed(), &t, 4);
        let [CacheEvent::Stored { unservable, .. }] = &c.take_events()[..] else {
            panic!("one chain stored");
        };
        assert_eq!(
            unservable,
            &hashes[..3],
            "a hit of 1-3 pages could not go on: the next token's window reads page 0 or 1"
        );
        // The whole prompt: every page matches, and the hit ends at a servable page.
        let hit = c.match_prefix(&mut p, &t, t.len());
        assert_eq!(hit.len(), 6);
        p.release_all(&hit).unwrap();
        // A prompt sharing only the first 3 pages: no hit at all, though they are held.
        let mut other = t[..12].to_vec();
        other.extend([99, 98, 97, 96, 95]);
        let hit = c.match_prefix(&mut p, &other, other.len());
        assert!(hit.is_empty(), "{hit:?}");
        // Sharing 5 pages: the hit is 5 pages (page 4's window reads pages 2 and 3).
        let mut five = t[..20].to_vec();
        five.push(7);
        let hit = c.match_prefix(&mut p, &five, five.len());
        assert_eq!(hit, pages[..5]);
        p.release_all(&hit).unwrap();
        // The snapshot says the same.
        let snap = c.snapshot();
        let claimed: Vec<u64> = snap
            .iter()
            .filter_map(|e| match e {
                CacheEvent::Stored {
                    hashes, unservable, ..
                } if unservable.is_empty() => Some(hashes[0]),
                _ => None,
            })
            .collect();
        assert_eq!(claimed, hashes[3..]);
    }
}

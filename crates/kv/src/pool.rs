//! `PagePool`: a paged KV arena with reference counts, whose every size comes from one
//! [`KvLayout`]. Pages move between pools only when both layouts have one fingerprint.

use std::sync::Arc;

use crate::KvLayout;

/// Index of a page within a pool.
pub type PageId = u32;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvError {
    #[error("out of KV pages: wanted {wanted}, {free} free of {total}")]
    OutOfPages {
        wanted: usize,
        free: usize,
        total: usize,
    },
    #[error("KV layout mismatch: ours is {ours}, theirs is {theirs}")]
    LayoutMismatch { ours: String, theirs: String },
    #[error("page {0} is not allocated")]
    NotAllocated(PageId),
    #[error("page {page} out of range (pool has {total})")]
    OutOfRange { page: PageId, total: usize },
    #[error("page payload is {got} bytes, the layout needs {want}")]
    WrongSize { got: usize, want: usize },
    #[error("out of sliding-window KV pages: wanted {wanted}, {free} free of {total}")]
    OutOfWindowPages {
        wanted: usize,
        free: usize,
        total: usize,
    },
    #[error("page {page} dropped the window layers' KV (layer {layer}): it has no whole form")]
    WindowDropped { page: PageId, layer: usize },
}

/// A pool of `total` pages, each `layout.bytes_per_page()` bytes.
///
/// A hybrid layout's pool keeps each sliding-window group's layers apart from the rest:
/// every allocated page has its full-attention layers, and a window group's layers only
/// while the page holds a *segment* of that group ([`Self::attach_window`]). A sequence
/// drops a page's segments once every later token's window has passed it
/// ([`Self::drop_window`]), so a long context holds its global layers' pages and only the
/// window's pages of the local ones.
pub struct PagePool {
    layout: Arc<KvLayout>,
    /// Backing store as u64 so that every dtype view is aligned: every page whole for a
    /// dense layout, a hybrid's full-attention layers otherwise.
    data: Vec<u64>,
    refs: Vec<u32>,
    free: Vec<PageId>,
    /// Per page, how many times its bytes were handed out writable: a copy of the pool
    /// elsewhere (a GPU's) knows a page is stale when its version moved.
    versions: Vec<u64>,
    /// Bytes per page in `data`.
    main_bytes: usize,
    /// Hybrid layouts: one arena per sliding-window group, of `segments` segments each.
    windows: Vec<WindowArena>,
    segments: usize,
    /// Hybrid layouts, per layer: the window arena holding it (`None`: `data`) and the
    /// layer's offset within that arena's page. Empty for a dense layout.
    place: Vec<(Option<usize>, usize)>,
}

/// One sliding-window group's bytes: segments handed to pages while they are in a window.
struct WindowArena {
    /// The group's index in the layout.
    group: usize,
    bytes: usize,
    data: Vec<u64>,
    /// Per page, its segment ([`NO_SEGMENT`]: none).
    segment: Vec<u32>,
    free: Vec<u32>,
}

const NO_SEGMENT: u32 = u32::MAX;

impl std::fmt::Debug for PagePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagePool")
            .field("layout", &self.layout)
            .field("total", &self.refs.len())
            .field("free", &self.free.len())
            .field("window_segments", &self.total_window_pages())
            .field("free_window_segments", &self.free_window_pages())
            .finish()
    }
}

impl PagePool {
    /// A zeroed pool of `pages` pages (a hybrid's with a segment for every page).
    pub fn new(layout: Arc<KvLayout>, pages: usize) -> Self {
        Self::with_window_pages(layout, pages, pages)
    }

    /// A zeroed pool of `pages` pages; a hybrid layout's sliding-window groups get
    /// `window_pages` segments each (at most `pages`), a dense layout ignores it.
    pub fn with_window_pages(layout: Arc<KvLayout>, pages: usize, window_pages: usize) -> Self {
        let lb = layout.layer_bytes_per_page();
        let mut place = Vec::new();
        let mut windows = Vec::new();
        let mut main_bytes = layout.bytes_per_page();
        let mut segments = 0;
        if layout.is_hybrid() {
            place = vec![(None, 0); layout.layers()];
            let mut main_layers = 0;
            segments = window_pages.min(pages);
            for (g, group) in layout.groups().iter().enumerate() {
                match group.attention {
                    crate::Attention::Full => {
                        for &l in &group.layers {
                            place[l] = (None, main_layers * lb);
                            main_layers += 1;
                        }
                    }
                    crate::Attention::SlidingWindow { .. } => {
                        for (i, &l) in group.layers.iter().enumerate() {
                            place[l] = (Some(windows.len()), i * lb);
                        }
                        let bytes = layout.group_bytes_per_page(g);
                        windows.push(WindowArena {
                            group: g,
                            bytes,
                            data: vec![0u64; (bytes * segments).div_ceil(8)],
                            segment: vec![NO_SEGMENT; pages],
                            free: (0..segments as u32).rev().collect(),
                        });
                    }
                }
            }
            main_bytes = main_layers * lb;
        }
        let data = vec![0u64; (main_bytes * pages).div_ceil(8)];
        // Hand out low page ids first: pop() takes from the end.
        let free = (0..pages as PageId).rev().collect();
        Self {
            layout,
            data,
            refs: vec![0; pages],
            free,
            versions: vec![0; pages],
            main_bytes,
            windows,
            segments,
            place,
        }
    }

    /// A pool holding as many pages as fit in `bytes`.
    pub fn with_capacity_bytes(layout: Arc<KvLayout>, bytes: usize) -> Self {
        let pages = bytes / layout.bytes_per_page();
        Self::new(layout, pages)
    }

    pub fn layout(&self) -> &Arc<KvLayout> {
        &self.layout
    }
    pub fn total_pages(&self) -> usize {
        self.refs.len()
    }
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }
    pub fn used_pages(&self) -> usize {
        self.total_pages() - self.free_pages()
    }

    /// Segments per sliding-window group (0 for a dense layout).
    pub fn total_window_pages(&self) -> usize {
        self.segments
    }

    /// Free segments of the sliding-window group shortest of them (0 for a dense layout).
    pub fn free_window_pages(&self) -> usize {
        self.windows.iter().map(|w| w.free.len()).min().unwrap_or(0)
    }

    /// Bytes of KV the allocated pages hold now: every page's full-attention layers, and
    /// a window group's layers only where the page holds that group's segment.
    pub fn held_bytes(&self) -> usize {
        self.used_pages() * self.main_bytes
            + self
                .windows
                .iter()
                .map(|w| w.bytes * (self.total_window_pages() - w.free.len()))
                .sum::<usize>()
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for_tokens(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.layout.page_size())
    }

    /// Allocate `n` whole pages (a hybrid's with every window group's segment), each with
    /// reference count 1; all or nothing.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<PageId>, KvError> {
        if !self.windows.is_empty() && self.free_window_pages() < n {
            return Err(self.out_of_segments(n));
        }
        let pages = self.alloc_bare(n)?;
        self.attach_window(&pages)?;
        Ok(pages)
    }

    /// Allocate `n` pages, each with reference count 1, all or nothing; a hybrid's hold
    /// no window segment yet ([`Self::attach_window`] before a window layer is touched).
    pub fn alloc_bare(&mut self, n: usize) -> Result<Vec<PageId>, KvError> {
        if n > self.free.len() {
            return Err(KvError::OutOfPages {
                wanted: n,
                free: self.free.len(),
                total: self.total_pages(),
            });
        }
        let at = self.free.len() - n;
        let pages: Vec<PageId> = self.free.drain(at..).rev().collect();
        for &p in &pages {
            self.refs[p as usize] = 1;
        }
        Ok(pages)
    }

    fn out_of_segments(&self, wanted: usize) -> KvError {
        KvError::OutOfWindowPages {
            wanted,
            free: self.free_window_pages(),
            total: self.total_window_pages(),
        }
    }

    /// Give every page of `pages` lacking one a segment of every window group; all or
    /// nothing. Nothing to do for a dense layout.
    pub fn attach_window(&mut self, pages: &[PageId]) -> Result<(), KvError> {
        for &p in pages {
            self.check(p)?;
        }
        for w in &self.windows {
            let lacking = pages
                .iter()
                .filter(|&&p| w.segment[p as usize] == NO_SEGMENT)
                .count();
            if lacking > w.free.len() {
                return Err(self.out_of_segments(lacking));
            }
        }
        for w in &mut self.windows {
            for &p in pages {
                if w.segment[p as usize] == NO_SEGMENT {
                    w.segment[p as usize] = w.free.pop().expect("counted above");
                    self.versions[p as usize] += 1;
                }
            }
        }
        Ok(())
    }

    /// Gives back `page`'s segment of window group `group` (the layout's index) when the
    /// caller is the page's only holder: a token that reads the page through that group
    /// will never come. Whether a segment was freed.
    pub fn drop_window(&mut self, page: PageId, group: usize) -> bool {
        if self.ref_count(page) != 1 {
            return false;
        }
        let Some(w) = self.windows.iter_mut().find(|w| w.group == group) else {
            return false;
        };
        let seg = std::mem::replace(&mut w.segment[page as usize], NO_SEGMENT);
        if seg == NO_SEGMENT {
            return false;
        }
        w.free.push(seg);
        true
    }

    /// Whether `page` holds its bytes of every layer (always, for a dense layout).
    pub fn is_whole(&self, page: PageId) -> bool {
        self.windows.iter().all(|w| {
            w.segment
                .get(page as usize)
                .is_some_and(|&s| s != NO_SEGMENT)
        })
    }

    /// Whether the token right after `pages` (a sequence's pages in order, all full)
    /// could be computed from them: every window group holds the pages its window reads
    /// for that position. Always true for a dense layout.
    pub fn servable_end(&self, pages: &[PageId]) -> bool {
        let ps = self.layout.page_size();
        self.windows.iter().all(|w| {
            let read = self.layout.pages_read(w.group, pages.len() * ps);
            pages[read]
                .iter()
                .all(|&p| w.segment[p as usize] != NO_SEGMENT)
        })
    }

    /// The longest prefix of `pages` (in pages) that [`Self::servable_end`] allows.
    pub fn servable_prefix(&self, pages: &[PageId]) -> usize {
        (0..=pages.len())
            .rev()
            .find(|&k| self.servable_end(&pages[..k]))
            .unwrap_or(0)
    }

    /// Add a reference to an allocated page (e.g. a prefix shared by two requests).
    pub fn retain(&mut self, page: PageId) -> Result<(), KvError> {
        self.check(page)?;
        self.refs[page as usize] += 1;
        Ok(())
    }

    /// Drop a reference; the page (and its segments) returns to the free lists at zero.
    pub fn release(&mut self, page: PageId) -> Result<(), KvError> {
        self.check(page)?;
        let r = &mut self.refs[page as usize];
        *r -= 1;
        if *r == 0 {
            self.free.push(page);
            for w in &mut self.windows {
                let seg = std::mem::replace(&mut w.segment[page as usize], NO_SEGMENT);
                if seg != NO_SEGMENT {
                    w.free.push(seg);
                }
            }
        }
        Ok(())
    }

    /// Release every page of a list.
    pub fn release_all(&mut self, pages: &[PageId]) -> Result<(), KvError> {
        pages.iter().try_for_each(|&p| self.release(p))
    }

    pub fn ref_count(&self, page: PageId) -> u32 {
        self.refs.get(page as usize).copied().unwrap_or(0)
    }

    fn check(&self, page: PageId) -> Result<(), KvError> {
        match self.refs.get(page as usize) {
            None => Err(KvError::OutOfRange {
                page,
                total: self.total_pages(),
            }),
            Some(0) => Err(KvError::NotAllocated(page)),
            Some(_) => Ok(()),
        }
    }

    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.data)
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.data)
    }

    fn page_range(&self, page: PageId) -> std::ops::Range<usize> {
        let pb = self.main_bytes;
        let start = page as usize * pb;
        start..start + pb
    }

    fn assert_dense(&self, what: &str) {
        assert!(
            self.windows.is_empty(),
            "{what} needs a dense layout's pool: {} keeps window layers apart",
            self.layout.name()
        );
    }

    /// The bytes of a page in the layout's page form (every layer in order). A hybrid's
    /// are gathered from its arenas; a page that dropped a window group's segment has no
    /// page form ([`KvError::WindowDropped`]).
    pub fn page(&self, page: PageId) -> Result<std::borrow::Cow<'_, [u8]>, KvError> {
        self.check(page)?;
        if self.windows.is_empty() {
            let r = self.page_range(page);
            return Ok(std::borrow::Cow::Borrowed(&self.bytes()[r]));
        }
        let lb = self.layout.layer_bytes_per_page();
        let mut out = vec![0u8; self.layout.bytes_per_page()];
        for (layer, dst) in out.chunks_exact_mut(lb).enumerate() {
            dst.copy_from_slice(self.layer_bytes(page, layer)?);
        }
        Ok(std::borrow::Cow::Owned(out))
    }

    /// Writes a page in the layout's page form: every layer the page holds now. A window
    /// group whose segment the page dropped keeps nothing of it, so the caller gives
    /// segments ([`Self::attach_window`]) to every page a later token reads through them.
    pub fn write_page(&mut self, page: PageId, bytes: &[u8]) -> Result<(), KvError> {
        self.check(page)?;
        let want = self.layout.bytes_per_page();
        if bytes.len() != want {
            return Err(KvError::WrongSize {
                got: bytes.len(),
                want,
            });
        }
        if self.windows.is_empty() {
            self.page_mut(page)?.copy_from_slice(bytes);
            return Ok(());
        }
        self.versions[page as usize] += 1;
        let lb = self.layout.layer_bytes_per_page();
        for (layer, src) in bytes.chunks_exact(lb).enumerate() {
            if let Some(dst) = self.layer_bytes_mut(page, layer) {
                dst.copy_from_slice(src);
            }
        }
        Ok(())
    }

    /// Copies page `src` of this pool onto page `dst`: every layer both hold.
    pub fn copy_page(&mut self, dst: PageId, src: PageId) -> Result<(), KvError> {
        self.check(dst)?;
        let bytes = self.page(src)?.into_owned();
        self.write_page(dst, &bytes)
    }

    /// Where layer `layer` of `page` lives: `None` when it is a window layer of a page
    /// without that group's segment.
    fn layer_at(&self, page: PageId, layer: usize) -> Option<(&[u64], usize)> {
        match self.place.get(layer) {
            None => {
                let lb = self.layout.layer_bytes_per_page();
                Some((&self.data, page as usize * self.main_bytes + layer * lb))
            }
            Some(&(None, off)) => Some((&self.data, page as usize * self.main_bytes + off)),
            Some(&(Some(w), off)) => {
                let a = &self.windows[w];
                let seg = a.segment[page as usize];
                (seg != NO_SEGMENT).then(|| (&a.data[..], seg as usize * a.bytes + off))
            }
        }
    }

    fn layer_bytes(&self, page: PageId, layer: usize) -> Result<&[u8], KvError> {
        let lb = self.layout.layer_bytes_per_page();
        let (data, start) = self
            .layer_at(page, layer)
            .ok_or(KvError::WindowDropped { page, layer })?;
        Ok(&bytemuck::cast_slice(data)[start..start + lb])
    }

    fn layer_bytes_mut(&mut self, page: PageId, layer: usize) -> Option<&mut [u8]> {
        let lb = self.layout.layer_bytes_per_page();
        let start = self.layer_at(page, layer)?.1;
        let data = match self.place.get(layer) {
            Some(&(Some(w), _)) => &mut self.windows[w].data,
            _ => &mut self.data,
        };
        Some(&mut bytemuck::cast_slice_mut(data)[start..start + lb])
    }

    /// How many times `page`'s bytes were handed out writable. Every writable accessor
    /// bumps it, so equal versions mean equal bytes.
    pub fn version(&self, page: PageId) -> u64 {
        self.versions.get(page as usize).copied().unwrap_or(0)
    }

    /// The whole arena, for registering it with a device (pinned memory) and copying
    /// pages from it. Page `p` starts at `p * layout.bytes_per_page()`. Dense layouts
    /// only.
    pub fn arena(&self) -> &[u8] {
        self.assert_dense("one arena");
        self.bytes()
    }

    /// The raw bytes of a page, writable. Dense layouts only ([`Self::write_page`] for
    /// any).
    pub fn page_mut(&mut self, page: PageId) -> Result<&mut [u8], KvError> {
        self.assert_dense("a page's bytes in one piece");
        self.check(page)?;
        self.versions[page as usize] += 1;
        let r = self.page_range(page);
        Ok(&mut self.bytes_mut()[r])
    }

    /// The raw bytes of several distinct pages at once, writable, in the order asked.
    /// Dense layouts only.
    pub fn pages_mut(&mut self, pages: &[PageId]) -> Result<Vec<&mut [u8]>, KvError> {
        self.assert_dense("pages' bytes in one piece");
        for (i, &p) in pages.iter().enumerate() {
            self.check(p)?;
            assert!(!pages[..i].contains(&p), "page {p} asked for twice");
        }
        for &p in pages {
            self.versions[p as usize] += 1;
        }
        let pb = self.layout.bytes_per_page();
        let mut slots: Vec<Option<&mut [u8]>> = pages.iter().map(|_| None).collect();
        for (id, chunk) in self.bytes_mut().chunks_exact_mut(pb).enumerate() {
            if let Some(i) = pages.iter().position(|&p| p as usize == id) {
                slots[i] = Some(chunk);
            }
        }
        Ok(slots
            .into_iter()
            .map(|s| s.expect("every checked page is inside the pool"))
            .collect())
    }

    /// The values of component `comp` of `layer` in `page`, for all slots of the page.
    /// Only meaningful for components whose scales (if any) sit at the page tail or that
    /// have none: values of consecutive slots are then contiguous. Panics on a window
    /// layer of a page without that group's segment: the scheduler attaches segments to
    /// every page a step reads or writes.
    pub fn values<T: bytemuck::Pod>(&self, page: PageId, layer: usize, comp: usize) -> &[T] {
        let (w, start, len) = self.values_range(page, layer, comp);
        let data = w.map_or(&self.data, |w| &self.windows[w].data);
        bytemuck::cast_slice(&bytemuck::cast_slice::<u64, u8>(data)[start..start + len])
    }

    /// Writable form of [`PagePool::values`].
    pub fn values_mut<T: bytemuck::Pod>(
        &mut self,
        page: PageId,
        layer: usize,
        comp: usize,
    ) -> &mut [T] {
        let (w, start, len) = self.values_range(page, layer, comp);
        self.versions[page as usize] += 1;
        let data = match w {
            Some(w) => &mut self.windows[w].data,
            None => &mut self.data,
        };
        bytemuck::cast_slice_mut(&mut bytemuck::cast_slice_mut::<u64, u8>(data)[start..start + len])
    }

    /// Which arena (`None`: the main one), and where in it, `comp` of `layer` in `page`.
    fn values_range(
        &self,
        page: PageId,
        layer: usize,
        comp: usize,
    ) -> (Option<usize>, usize, usize) {
        debug_assert!(self.refs[page as usize] > 0, "page {page} used while free");
        let l = &self.layout;
        let c = &l.components()[comp];
        let within = l.value_offset(layer, comp, 0) - l.layer_range(layer).start;
        let len = l.page_size() * c.value_bytes_per_token();
        let Some((_, start)) = self.layer_at(page, layer) else {
            panic!(
                "layer {layer} of page {page} read or written after its window segment was dropped"
            );
        };
        (self.place.get(layer).and_then(|p| p.0), start + within, len)
    }

    /// Copy a page from another pool; refused unless both layouts share a fingerprint.
    pub fn copy_page_from(
        &mut self,
        dst: PageId,
        src_pool: &PagePool,
        src: PageId,
    ) -> Result<(), KvError> {
        self.ensure_compatible(src_pool.layout())?;
        let bytes = src_pool.page(src)?;
        self.write_page(dst, &bytes)
    }

    /// Write a page received from elsewhere, tagged with its producer's layout.
    pub fn import_page(
        &mut self,
        dst: PageId,
        bytes: &[u8],
        theirs: &KvLayout,
    ) -> Result<(), KvError> {
        self.ensure_compatible(theirs)?;
        self.write_page(dst, bytes)
    }

    /// Err naming both layouts unless `theirs` places bytes exactly as ours does.
    pub fn ensure_compatible(&self, theirs: &KvLayout) -> Result<(), KvError> {
        if theirs.fingerprint() == self.layout.fingerprint() {
            Ok(())
        } else {
            Err(KvError::LayoutMismatch {
                ours: self.layout.to_string(),
                theirs: theirs.to_string(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Component, DType};

    fn smol(page: usize) -> Arc<KvLayout> {
        Arc::new(KvLayout::llama(30, 3, 64, DType::F16, page))
    }

    #[test]
    fn pool_sizes_come_from_the_layout() {
        let pool = PagePool::new(smol(16), 8);
        assert_eq!(pool.total_pages(), 8);
        assert_eq!(pool.free_pages(), 8);
        assert_eq!(pool.page_size_bytes_for_test(), 30 * 768 * 16);
        let by_bytes = PagePool::with_capacity_bytes(smol(16), 30 * 768 * 16 * 5 + 7);
        assert_eq!(by_bytes.total_pages(), 5);
        assert_eq!(pool.pages_for_tokens(0), 0);
        assert_eq!(pool.pages_for_tokens(16), 1);
        assert_eq!(pool.pages_for_tokens(17), 2);
    }

    impl PagePool {
        fn page_size_bytes_for_test(&self) -> usize {
            self.page_range(0).len()
        }
    }

    #[test]
    fn every_writable_access_moves_the_page_version() {
        let mut pool = PagePool::new(smol(16), 4);
        let a = pool.alloc(3).unwrap();
        assert!(a.iter().all(|&p| pool.version(p) == 0));
        let _ = pool.page(a[0]).unwrap();
        let _ = pool.values::<u8>(a[0], 0, 0);
        assert_eq!(pool.version(a[0]), 0, "reads leave it");
        pool.page_mut(a[0]).unwrap()[0] = 1;
        assert_eq!(pool.version(a[0]), 1);
        pool.values_mut::<u8>(a[1], 2, 1)[0] = 1;
        assert_eq!(pool.version(a[1]), 1);
        let _ = pool.pages_mut(&[a[2], a[0]]).unwrap();
        assert_eq!((pool.version(a[0]), pool.version(a[2])), (2, 1));
        let bytes = pool.page(a[1]).unwrap().to_vec();
        pool.import_page(a[2], &bytes, &smol(16)).unwrap();
        assert_eq!(pool.version(a[2]), 2);
        assert_eq!(pool.version(3), 0, "an untouched page");
        assert_eq!(pool.arena().len(), 4 * pool.layout().bytes_per_page());
    }

    #[test]
    fn alloc_free_and_refcounts() {
        let mut pool = PagePool::new(smol(16), 4);
        let a = pool.alloc(3).unwrap();
        assert_eq!(a, vec![0, 1, 2]);
        assert_eq!(pool.free_pages(), 1);
        assert_eq!(
            pool.alloc(2),
            Err(KvError::OutOfPages {
                wanted: 2,
                free: 1,
                total: 4
            }),
            "all or nothing"
        );
        assert_eq!(pool.free_pages(), 1);
        pool.retain(a[0]).unwrap();
        assert_eq!(pool.ref_count(a[0]), 2);
        pool.release_all(&a).unwrap();
        assert_eq!(pool.free_pages(), 3, "shared page still held");
        pool.release(a[0]).unwrap();
        assert_eq!(pool.free_pages(), 4);
        assert_eq!(pool.release(a[0]), Err(KvError::NotAllocated(0)));
        assert_eq!(
            pool.retain(9),
            Err(KvError::OutOfRange { page: 9, total: 4 })
        );
    }

    #[test]
    fn typed_views_address_the_right_bytes() {
        let layout = smol(4);
        let mut pool = PagePool::new(layout.clone(), 2);
        let p = pool.alloc(2).unwrap();
        let v: &mut [half::f16] = pool.values_mut(p[1], 7, 1);
        assert_eq!(v.len(), 4 * 192);
        v[5] = half::f16::from_f32(1.5);
        let raw = pool.page(p[1]).unwrap();
        let off = layout.value_offset(7, 1, 0) + 5 * 2;
        assert_eq!(&raw[off..off + 2], &half::f16::from_f32(1.5).to_le_bytes());
        assert!(
            pool.page(p[0]).unwrap().iter().all(|&b| b == 0),
            "other page untouched"
        );
    }

    #[test]
    fn pools_with_different_layouts_refuse_to_exchange_pages() {
        let fp8 = Arc::new(
            KvLayout::new("dsa-index-k-fp8", 2, 64, vec![Component::fp8_index_k(128)]).unwrap(),
        );
        let bf16 = Arc::new(
            KvLayout::new(
                "dsa-index-k-bf16",
                2,
                64,
                vec![Component::plain("index_k", DType::Bf16, 128)],
            )
            .unwrap(),
        );
        let mut host = PagePool::new(fp8.clone(), 2);
        let mut dev = PagePool::new(bf16.clone(), 2);
        let h = host.alloc(1).unwrap()[0];
        let d = dev.alloc(1).unwrap()[0];
        let err = host.copy_page_from(h, &dev, d).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("dsa-index-k-fp8") && msg.contains("dsa-index-k-bf16"),
            "{msg}"
        );
        assert!(
            msg.contains("132 B/token/layer") && msg.contains("256 B/token/layer"),
            "{msg}"
        );
        let bytes = dev.page(d).unwrap().to_vec();
        assert!(matches!(
            host.import_page(h, &bytes, &bf16),
            Err(KvError::LayoutMismatch { .. })
        ));
        // Same layout: bytes arrive intact.
        let mut host2 = PagePool::new(bf16.clone(), 1);
        dev.page_mut(d).unwrap()[100] = 42;
        let h2 = host2.alloc(1).unwrap()[0];
        host2.copy_page_from(h2, &dev, d).unwrap();
        assert_eq!(host2.page(h2).unwrap()[100], 42);
        assert_eq!(
            host2.import_page(h2, &[0u8; 3], &bf16),
            Err(KvError::WrongSize {
                got: 3,
                want: bf16.bytes_per_page()
            })
        );
    }

    /// Six layers of 4-token pages; layers 2 and 5 global, the rest a window of 8.
    fn hybrid() -> Arc<KvLayout> {
        Arc::new(
            KvLayout::llama(6, 1, 8, DType::F16, 4)
                .with_window(8, &[2, 5])
                .unwrap(),
        )
    }

    #[test]
    fn a_hybrid_pool_keeps_window_layers_only_while_a_page_holds_a_segment() {
        let layout = hybrid();
        let window = 1; // the layout's second group slides
        let mut pool = PagePool::with_window_pages(layout.clone(), 6, 3);
        assert_eq!(
            (pool.total_window_pages(), pool.free_window_pages()),
            (3, 3)
        );
        let pages = pool.alloc_bare(4).unwrap();
        assert!(pages.iter().all(|&p| !pool.is_whole(p)));
        assert_eq!(pool.held_bytes(), 4 * 2 * layout.layer_bytes_per_page());
        // Global layers are there from the start; a window layer needs a segment.
        pool.values_mut::<half::f16>(pages[0], 5, 1)[3] = half::f16::from_f32(2.0);
        let bare = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.values::<half::f16>(pages[0], 0, 0)[0]
        }));
        assert!(
            bare.is_err(),
            "a window layer without its segment is never read"
        );
        assert_eq!(
            pool.page(pages[0]),
            Err(KvError::WindowDropped {
                page: pages[0],
                layer: 0
            })
        );
        pool.attach_window(&pages[..3]).unwrap();
        assert_eq!(
            pool.attach_window(&pages[1..]),
            Err(KvError::OutOfWindowPages {
                wanted: 1,
                free: 0,
                total: 3
            }),
            "all or nothing: pages 1 and 2 hold theirs already"
        );
        assert_eq!(
            pool.held_bytes(),
            layout.bytes_per_page() * 3 + 2 * layout.layer_bytes_per_page()
        );
        // The page form puts every layer where the layout says.
        pool.values_mut::<half::f16>(pages[0], 3, 0)[1] = half::f16::from_f32(1.5);
        let form = pool.page(pages[0]).unwrap().into_owned();
        let at = |layer, comp, slot| layout.value_offset(layer, comp, slot);
        assert_eq!(
            &form[at(3, 0, 0) + 2..at(3, 0, 0) + 4],
            &half::f16::from_f32(1.5).to_le_bytes()
        );
        assert_eq!(
            &form[at(5, 1, 0) + 6..at(5, 1, 0) + 8],
            &half::f16::from_f32(2.0).to_le_bytes()
        );
        // Written back whole, onto a page with a segment: identical. Onto one without:
        // its global layers only.
        pool.write_page(pages[1], &form).unwrap();
        assert_eq!(pool.page(pages[1]).unwrap(), form);
        pool.write_page(pages[3], &form).unwrap();
        assert_eq!(
            pool.values::<half::f16>(pages[3], 5, 1)[3],
            half::f16::from_f32(2.0)
        );
        // A shared page keeps its segment; its sole holder gives it back.
        pool.retain(pages[0]).unwrap();
        assert!(!pool.drop_window(pages[0], window));
        pool.release(pages[0]).unwrap();
        assert!(pool.drop_window(pages[0], window));
        assert!(!pool.drop_window(pages[0], window), "once");
        assert!(
            !pool.drop_window(pages[1], 0),
            "the global group has no segments"
        );
        assert_eq!(pool.free_window_pages(), 1);
        assert_eq!(
            pool.values::<half::f16>(pages[0], 5, 1)[3],
            half::f16::from_f32(2.0)
        );
        // Freeing a page frees its segment.
        pool.release(pages[1]).unwrap();
        assert_eq!((pool.free_pages(), pool.free_window_pages()), (3, 2));
        // Whole pages: alloc gives segments, and refuses without them.
        assert!(pool.alloc(3).is_err());
        assert_eq!(pool.free_pages(), 3, "nothing taken");
        let whole = pool.alloc(2).unwrap();
        assert!(whole.iter().all(|&p| pool.is_whole(p)));
    }

    #[test]
    fn a_prefix_is_servable_only_while_the_window_before_its_end_is_held() {
        let mut pool = PagePool::new(hybrid(), 8);
        let pages = pool.alloc(6).unwrap();
        assert_eq!(pool.servable_prefix(&pages), 6);
        // Pages 0 and 1 give up their window layers. The token after k pages reads
        // positions from 4k - 7: pages k-2 and k-1.
        pool.drop_window(pages[0], 1);
        pool.drop_window(pages[1], 1);
        let ends: Vec<bool> = (0..=6).map(|k| pool.servable_end(&pages[..k])).collect();
        assert_eq!(ends, [true, false, false, false, true, true, true]);
        assert_eq!(pool.servable_prefix(&pages), 6);
        pool.drop_window(pages[5], 1);
        assert_eq!(pool.servable_prefix(&pages), 5);
        // A dense pool is always servable.
        let mut dense = PagePool::new(smol(4), 2);
        let d = dense.alloc(2).unwrap();
        assert!(dense.is_whole(d[0]) && dense.servable_prefix(&d) == 2);
        assert!(!dense.drop_window(d[0], 0));
    }
}

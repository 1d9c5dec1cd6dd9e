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
}

/// A pool of `total` pages, each `layout.bytes_per_page()` bytes.
pub struct PagePool {
    layout: Arc<KvLayout>,
    /// Backing store as u64 so that every dtype view is aligned.
    data: Vec<u64>,
    refs: Vec<u32>,
    free: Vec<PageId>,
    /// Per page, how many times its bytes were handed out writable: a copy of the pool
    /// elsewhere (a GPU's) knows a page is stale when its version moved.
    versions: Vec<u64>,
}

impl std::fmt::Debug for PagePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagePool")
            .field("layout", &self.layout)
            .field("total", &self.refs.len())
            .field("free", &self.free.len())
            .finish()
    }
}

impl PagePool {
    /// A zeroed pool of `pages` pages.
    pub fn new(layout: Arc<KvLayout>, pages: usize) -> Self {
        let bytes = layout.bytes_per_pool(pages);
        let data = vec![0u64; bytes.div_ceil(8)];
        // Hand out low page ids first: pop() takes from the end.
        let free = (0..pages as PageId).rev().collect();
        Self {
            layout,
            data,
            refs: vec![0; pages],
            free,
            versions: vec![0; pages],
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

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for_tokens(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.layout.page_size())
    }

    /// Allocate `n` pages, each with reference count 1; all or nothing.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<PageId>, KvError> {
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

    /// Add a reference to an allocated page (e.g. a prefix shared by two requests).
    pub fn retain(&mut self, page: PageId) -> Result<(), KvError> {
        self.check(page)?;
        self.refs[page as usize] += 1;
        Ok(())
    }

    /// Drop a reference; the page returns to the free list at zero.
    pub fn release(&mut self, page: PageId) -> Result<(), KvError> {
        self.check(page)?;
        let r = &mut self.refs[page as usize];
        *r -= 1;
        if *r == 0 {
            self.free.push(page);
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
        let pb = self.layout.bytes_per_page();
        let start = page as usize * pb;
        start..start + pb
    }

    /// The raw bytes of a page.
    pub fn page(&self, page: PageId) -> Result<&[u8], KvError> {
        self.check(page)?;
        let r = self.page_range(page);
        Ok(&self.bytes()[r])
    }

    /// How many times `page`'s bytes were handed out writable. Every writable accessor
    /// bumps it, so equal versions mean equal bytes.
    pub fn version(&self, page: PageId) -> u64 {
        self.versions.get(page as usize).copied().unwrap_or(0)
    }

    /// The whole arena, for registering it with a device (pinned memory) and copying
    /// pages from it. Page `p` starts at `p * layout.bytes_per_page()`.
    pub fn arena(&self) -> &[u8] {
        self.bytes()
    }

    /// The raw bytes of a page, writable.
    pub fn page_mut(&mut self, page: PageId) -> Result<&mut [u8], KvError> {
        self.check(page)?;
        self.versions[page as usize] += 1;
        let r = self.page_range(page);
        Ok(&mut self.bytes_mut()[r])
    }

    /// The raw bytes of several distinct pages at once, writable, in the order asked.
    pub fn pages_mut(&mut self, pages: &[PageId]) -> Result<Vec<&mut [u8]>, KvError> {
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
    /// have none: values of consecutive slots are then contiguous.
    pub fn values<T: bytemuck::Pod>(&self, page: PageId, layer: usize, comp: usize) -> &[T] {
        let (start, len) = self.values_range(page, layer, comp);
        bytemuck::cast_slice(&self.bytes()[start..start + len])
    }

    /// Writable form of [`PagePool::values`].
    pub fn values_mut<T: bytemuck::Pod>(
        &mut self,
        page: PageId,
        layer: usize,
        comp: usize,
    ) -> &mut [T] {
        let (start, len) = self.values_range(page, layer, comp);
        self.versions[page as usize] += 1;
        bytemuck::cast_slice_mut(&mut self.bytes_mut()[start..start + len])
    }

    fn values_range(&self, page: PageId, layer: usize, comp: usize) -> (usize, usize) {
        debug_assert!(self.refs[page as usize] > 0, "page {page} used while free");
        let l = &self.layout;
        let c = &l.components()[comp];
        let start = page as usize * l.bytes_per_page() + l.value_offset(layer, comp, 0);
        (start, l.page_size() * c.value_bytes_per_token())
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
        self.page_mut(dst)?.copy_from_slice(bytes);
        Ok(())
    }

    /// Write a page received from elsewhere, tagged with its producer's layout.
    pub fn import_page(
        &mut self,
        dst: PageId,
        bytes: &[u8],
        theirs: &KvLayout,
    ) -> Result<(), KvError> {
        self.ensure_compatible(theirs)?;
        let want = self.layout.bytes_per_page();
        if bytes.len() != want {
            return Err(KvError::WrongSize {
                got: bytes.len(),
                want,
            });
        }
        self.page_mut(dst)?.copy_from_slice(bytes);
        Ok(())
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
}

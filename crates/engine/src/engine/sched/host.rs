//! Host-tier fetches: admission starts one for a prompt's pages after its device hit,
//! and the answer, whenever it comes, fills the reserved pages and puts the sequence in
//! the batch. The engine never waits for it.

use pdmesh_kv::{Fetch, page_hashes};

use super::Scheduler;
use super::seq::{Loading, Seq};
use crate::StepEvent;

impl Scheduler {
    /// The fetch of the prompt's whole pages after the `device` pages the device tier
    /// matched (never the last token's: its logits are needed), when a host tier is
    /// attached and there are any.
    pub(super) fn host_fetch(&mut self, s: &Seq, device: usize) -> Option<Fetch> {
        self.host.as_ref()?;
        let ns = self
            .cache
            .as_ref()?
            .namespace(s.params.cache_salt.as_deref());
        let ps = self.cfg.page_size;
        let full = (s.tokens.len() - 1) / ps;
        if full <= device {
            return None;
        }
        let hashes = page_hashes(ns, &s.tokens[..full * ps], ps);
        self.fetches += 1;
        Some(Fetch {
            ticket: self.fetches,
            hashes: hashes[device..].to_vec(),
            min_pages: self.cfg.host_min_pages,
        })
    }

    /// Takes the host tier's answers: each fetched sequence gets the pages that arrived
    /// intact and joins the batch (an aborted one's answer is dropped).
    pub(super) fn take_fetched(&mut self) {
        let answers = match &mut self.host {
            Some((host, _)) => host.take_fetched(),
            None => return,
        };
        let bpp = self.pool.layout().bytes_per_page();
        for f in answers {
            let Some(i) = self.loading.iter().position(|l| l.ticket == f.ticket) else {
                continue;
            };
            let Loading { seq, device, .. } = self.loading.remove(i);
            // Only whole pages of this layout, and never more than were asked for.
            let room = seq.pages.len() - device;
            let mut n = f
                .pages
                .iter()
                .take(room)
                .take_while(|p| p.len() == bpp)
                .count();
            // A hybrid's pages the next token's windows read keep their window layers;
            // without segments for them the pages are recomputed instead.
            let from = self.window_start((device + n) * self.cfg.page_size, device + n);
            if !self.attach(&seq.pages[from.max(device)..device + n]) {
                n = 0;
            }
            for (&dst, src) in seq.pages[device..device + n].iter().zip(&f.pages) {
                self.pool
                    .write_page(dst, src)
                    .expect("reserved pages are allocated, fetched pages whole");
            }
            let st = &mut self.host_stats;
            st.load_seconds += f.seconds;
            st.load_bytes += (n * bpp) as u64;
            st.hit_tokens += (n * self.cfg.page_size) as u64;
            if f.corrupt {
                st.checksum_failures += 1;
                tracing::warn!(
                    id = %seq.id,
                    intact = n,
                    "a host page failed its checksum: it is recomputed"
                );
            }
            self.admitted(seq, device, n);
        }
    }

    /// `s` holds its pages, the first `device + loaded` of them with its prompt's KV: it
    /// joins the batch (or, when the batch is full, the line for it).
    pub(super) fn admitted(&mut self, mut s: Seq, device: usize, loaded: usize) {
        s.computed = (device + loaded) * self.cfg.page_size;
        if s.cached.is_none() {
            let device_cached = (device * self.cfg.page_size).min(s.prompt_len);
            self.pending.push(StepEvent::Admitted {
                id: s.id.clone(),
                device_cached,
                host_cached: s.computed.min(s.prompt_len) - device_cached,
                at: std::time::Instant::now(),
            });
        }
        s.cached.get_or_insert(s.computed.min(s.prompt_len));
        if self.running.len() < self.cfg.max_batch {
            self.running.push(s);
        } else {
            self.ready.push_back(s);
        }
    }
}

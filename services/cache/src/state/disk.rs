//! The mirror's side of the disk tier: evicted pages are spilled (their bytes copied out
//! before the slot is reused), pages a match finds only on disk get slots to be promoted
//! into, and a promoted page is resident only once its checked bytes are in.

use std::time::Instant;

use super::slots::Slot;
use super::{CacheError, Event, State, Tier};

/// Pages being promoted at once, at most; a match past it finds the rest a miss.
pub const MAX_PROMOTING: usize = 4096;

/// Pages a match waits for: those it started promoting (hash, slot) and those another
/// match already was.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Promotion {
    pub start: Vec<(u64, u32)>,
    pub wait: Vec<u64>,
}

impl Promotion {
    pub fn is_empty(&self) -> bool {
        self.start.is_empty() && self.wait.is_empty()
    }
}

impl State {
    /// Frees the least recently used unpinned page's slot for reuse (its bytes spilled to
    /// the disk tier first); its hash goes to `removed`.
    pub(super) fn evict_lru(&mut self, removed: &mut Vec<u64>) -> Option<u32> {
        let (_, s) = self.lru.pop_first()?;
        let Slot::Resident { hash, checksum, .. } = self.slots[s as usize] else {
            unreachable!("the LRU set holds resident slots only");
        };
        if let (Some(disk), Some(mirror)) = (&self.disk, &self.mirror)
            && disk.serving()
            && !disk.contains(hash)
        {
            let mut data = vec![0u8; mirror.page_bytes()];
            mirror.read(s, &mut data);
            disk.spill(hash, checksum, data);
        }
        self.index.remove(&hash);
        removed.push(hash);
        self.stats.evicted_pages += 1;
        Some(s)
    }

    /// Says the host pages `removed` are gone.
    pub(super) fn removed(&mut self, removed: Vec<u64>) {
        if !removed.is_empty() {
            self.events.push(Event::Removed {
                hashes: removed,
                tier: Tier::Host,
            });
        }
    }

    /// Fixes the model the mirror's pages are of (the first worker's), or refuses a
    /// worker serving another.
    pub fn check_model(&mut self, model: &str) -> Result<(), CacheError> {
        match &self.model {
            Some(ours) if ours != model => Err(CacheError::ModelMismatch {
                ours: ours.clone(),
                theirs: model.to_owned(),
            }),
            Some(_) => Ok(()),
            None => {
                self.model = Some(model.to_owned());
                Ok(())
            }
        }
    }

    /// Opens the disk tier once the layout and model are fixed (the first registration):
    /// its pages are named by both.
    pub fn start_disk(&mut self) {
        if let (Some(disk), Some(layout), Some(model)) = (&self.disk, &self.layout, &self.model) {
            disk.open(disk_identity(layout.fingerprint(), model));
        }
    }

    /// Slots for the leading pages of `hashes` (those after a match's resident run) that
    /// are on disk: each becomes `Promoting` (found by no match until its bytes are in),
    /// evicting least recently used pages for room. Stops at the first page neither on
    /// disk nor already being promoted, or when no slot can be had.
    pub fn plan_promotion(&mut self, hashes: &[u64], now: Instant) -> Promotion {
        let mut plan = Promotion::default();
        let Some(disk) = self
            .disk
            .clone()
            .filter(|d| !hashes.is_empty() && d.serving())
        else {
            return plan;
        };
        let mut removed = Vec::new();
        for &h in hashes {
            if let Some(&slot) = self.index.get(&h) {
                match self.slots[slot as usize] {
                    Slot::Promoting { .. } => {
                        plan.wait.push(h);
                        continue;
                    }
                    _ => break,
                }
            }
            if self.promoting >= MAX_PROMOTING || !disk.contains(h) {
                break;
            }
            let Some(slot) = self.free.pop().or_else(|| self.evict_lru(&mut removed)) else {
                break;
            };
            self.slots[slot as usize] = Slot::Promoting {
                hash: h,
                since: now,
            };
            self.index.insert(h, slot);
            plan.start.push((h, slot));
            self.promoting += 1;
        }
        self.removed(removed);
        plan
    }

    /// A promotion's end: the page's checked bytes and checksum go into its slot, which
    /// becomes resident (unpinned, most recently used); `None` frees the slot (a miss).
    pub fn promoted(&mut self, hash: u64, slot: u32, page: Option<(Vec<u8>, u64)>, now: Instant) {
        let Some(Slot::Promoting { hash: h, since }) = self.slots.get(slot as usize) else {
            return;
        };
        if *h != hash {
            return;
        }
        let since = *since;
        self.promoting -= 1;
        let (Some((data, checksum)), Some(mirror)) = (page, self.mirror.clone()) else {
            self.free_slot(slot);
            return;
        };
        if data.len() != mirror.page_bytes() {
            self.free_slot(slot);
            return;
        }
        mirror.write(slot, &data);
        self.tick += 1;
        self.slots[slot as usize] = Slot::Resident {
            hash,
            checksum,
            pins: 0,
            last_use: self.tick,
        };
        self.lru.insert((self.tick, slot));
        self.events.push(Event::Stored {
            parent: 0,
            hashes: vec![hash],
            tier: Tier::Host,
        });
        if let Some(d) = &self.disk {
            d.promoted(now.saturating_duration_since(since));
        }
    }

    /// How many of `hashes` are still being promoted.
    pub fn still_promoting(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .filter(|h| {
                self.index
                    .get(h)
                    .is_some_and(|&s| matches!(self.slots[s as usize], Slot::Promoting { .. }))
            })
            .count()
    }

    /// The disk tier, when the service has one.
    pub fn disk(&self) -> Option<&std::sync::Arc<crate::disk::tier::DiskTier>> {
        self.disk.as_ref()
    }

    /// Copies resident page `hash`'s bytes from `slot` into `out`; false if the slot
    /// holds something else now.
    pub fn read_resident(&self, hash: u64, slot: u32, out: &mut [u8]) -> bool {
        match (self.slots.get(slot as usize), &self.mirror) {
            (Some(Slot::Resident { hash: h, .. }), Some(m)) if *h == hash => {
                m.read(slot, out);
                true
            }
            _ => false,
        }
    }

    /// The resident pages (hash, slot, checksum), most recently used first: what a
    /// graceful stop writes to the disk tier.
    pub fn resident_pages(&self) -> Vec<(u64, u32, u64)> {
        let mut out: Vec<(u64, u64, u32, u64)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match *s {
                Slot::Resident {
                    hash,
                    checksum,
                    last_use,
                    ..
                } => Some((last_use, hash, i as u32, checksum)),
                _ => None,
            })
            .collect();
        out.sort_by_key(|p| std::cmp::Reverse(p.0));
        out.into_iter().map(|(_, h, s, c)| (h, s, c)).collect()
    }
}

/// The name a disk page's file header carries: the layout's fingerprint (model shape,
/// every component's dtype and bytes per token, page size, shard) and the model's name
/// and weights digest. The request's `cache_salt` is in each page's chained hash.
pub fn disk_identity(layout_fingerprint: u64, model: &str) -> u64 {
    let mut b = layout_fingerprint.to_le_bytes().to_vec();
    b.extend_from_slice(model.as_bytes());
    xxhash_rust::xxh3::xxh3_64(&b)
}

#[cfg(test)]
mod tests;

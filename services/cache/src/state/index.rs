//! The index of resident pages by chained hash and the worker calls on it: match (and
//! pin), reserve, commit (checked against each page's checksum), release and discard.

use std::collections::HashSet;

use pdmesh_cache_client::Lease;

use super::slots::Slot;
use super::{CacheError, Event, State, Tier};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRef {
    pub hash: u64,
    pub slot: u32,
    pub checksum: u64,
}

#[derive(Clone, Debug)]
pub struct CommitPage {
    pub hash: u64,
    pub slot: u32,
    pub checksum: u64,
    /// The bytes, on the grpc data plane; `None` when written through shared memory.
    pub data: Option<Vec<u8>>,
    pub parent: u64,
}

impl State {
    /// The longest run of leading `hashes` resident in the mirror, each pinned for `lease`.
    pub fn match_pages(
        &mut self,
        lease: Lease,
        hashes: &[u64],
    ) -> Result<Vec<PageRef>, CacheError> {
        self.lease_mut(lease)?;
        self.tick += 1;
        let mut out = Vec::new();
        for &h in hashes {
            let Some(&slot) = self.index.get(&h) else {
                break;
            };
            let tick = self.tick;
            let Slot::Resident {
                checksum,
                pins,
                last_use,
                ..
            } = &mut self.slots[slot as usize]
            else {
                break; // still being written
            };
            if *pins == 0 {
                self.lru.remove(&(*last_use, slot));
            }
            *pins += 1;
            *last_use = tick;
            out.push(PageRef {
                hash: h,
                slot,
                checksum: *checksum,
            });
            *self
                .leases
                .get_mut(&lease)
                .expect("checked above")
                .pins
                .entry(slot)
                .or_default() += 1;
        }
        Ok(out)
    }

    /// Slots for the pages of `hashes` the mirror does not hold, evicting least recently
    /// used unpinned pages for room; stops granting when nothing more can be evicted.
    pub fn reserve(&mut self, lease: Lease, hashes: &[u64]) -> Result<Vec<(u64, u32)>, CacheError> {
        self.lease_mut(lease)?;
        let mut grants = Vec::new();
        let mut removed = Vec::new();
        for &h in hashes {
            if self.index.contains_key(&h) {
                continue;
            }
            let Some(slot) = self.free.pop().or_else(|| self.evict_lru(&mut removed)) else {
                break;
            };
            self.slots[slot as usize] = Slot::Reserved { lease, hash: h };
            self.index.insert(h, slot);
            self.lease_mut(lease)?.reserved.insert(slot);
            grants.push((h, slot));
        }
        self.removed(removed);
        Ok(grants)
    }

    /// Publishes written pages: each must be reserved by `lease` for its hash, and its
    /// bytes (written to the slot, or carried in `data`) must match its checksum. Returns
    /// the slots refused for a checksum mismatch (freed and counted).
    pub fn commit(&mut self, lease: Lease, pages: Vec<CommitPage>) -> Result<Vec<u32>, CacheError> {
        self.lease_mut(lease)?;
        let mirror = self.mirror.clone().expect("a lease implies a mirror");
        let mut seen = HashSet::new();
        for p in &pages {
            if !seen.insert(p.slot) {
                return Err(CacheError::DuplicateSlot(p.slot));
            }
            match self.slots.get(p.slot as usize) {
                Some(Slot::Reserved { lease: l, hash }) if *l == lease && *hash == p.hash => {}
                _ => {
                    return Err(CacheError::NotHeld {
                        slot: p.slot,
                        what: "reserved for this page",
                    });
                }
            }
            if let Some(d) = &p.data
                && d.len() != mirror.page_bytes()
            {
                return Err(CacheError::WrongSize {
                    want: mirror.page_bytes(),
                    got: d.len(),
                });
            }
        }
        self.tick += 1;
        let mut scratch = Vec::new();
        let mut rejected = Vec::new();
        let mut stored: Vec<Event> = Vec::new();
        for p in pages {
            self.lease_mut(lease)?.reserved.remove(&p.slot);
            if let Some(d) = &p.data {
                mirror.write(p.slot, d);
            }
            let found = mirror.checksum(p.slot, &mut scratch);
            if found != p.checksum {
                tracing::warn!(
                    slot = p.slot,
                    hash = p.hash,
                    "committed page does not match its checksum"
                );
                self.stats.checksum_failures += 1;
                let worker = self.leases.get(&lease).map(|l| l.worker.clone());
                let mut i = pdmesh_incident::Incident::new(
                    pdmesh_incident::Kind::Checksum,
                    format!(
                        "A page written into the host mirror by {} did not match the checksum \
                         its writer computed; the page was refused (never published) and \
                         will be computed again by whoever needs it.",
                        worker.as_deref().unwrap_or("a worker")
                    ),
                    pdmesh_incident::Place {
                        worker: worker.unwrap_or_default(),
                        ..Default::default()
                    },
                );
                i.pages.push(pdmesh_incident::PageCheck {
                    page: format!("{:016x} (slot {})", p.hash, p.slot),
                    expected: format!("{:016x}", p.checksum),
                    found: format!("{found:016x}"),
                });
                self.incidents.push(i);
                self.free_slot(p.slot);
                rejected.push(p.slot);
                continue;
            }
            self.slots[p.slot as usize] = Slot::Resident {
                hash: p.hash,
                checksum: p.checksum,
                pins: 0,
                last_use: self.tick,
            };
            self.lru.insert((self.tick, p.slot));
            match stored.last_mut() {
                Some(Event::Stored { hashes, .. }) if hashes.last() == Some(&p.parent) => {
                    hashes.push(p.hash)
                }
                _ => stored.push(Event::Stored {
                    parent: p.parent,
                    hashes: vec![p.hash],
                    tier: Tier::Host,
                }),
            }
        }
        self.events.extend(stored);
        Ok(rejected)
    }

    /// Checks that `lease` pins every slot of `slots` (before their bytes are sent).
    pub fn check_pinned(&mut self, lease: Lease, slots: &[u32]) -> Result<Vec<u64>, CacheError> {
        let l = self.lease_mut(lease)?;
        if let Some(&slot) = slots.iter().find(|s| !l.pins.contains_key(s)) {
            return Err(CacheError::NotHeld {
                slot,
                what: "pinned",
            });
        }
        Ok(slots
            .iter()
            .map(|&s| match self.slots[s as usize] {
                Slot::Resident { checksum, .. } => checksum,
                _ => unreachable!("a pinned slot is resident"),
            })
            .collect())
    }

    pub(super) fn unpin(&mut self, slot: u32) {
        if let Slot::Resident { pins, last_use, .. } = &mut self.slots[slot as usize] {
            *pins -= 1;
            if *pins == 0 {
                self.lru.insert((*last_use, slot));
            }
        }
    }

    /// Drops one pin per listed slot (or the reservation, if the slot was reserved and
    /// never committed).
    pub fn release(&mut self, lease: Lease, slots: &[u32]) -> Result<(), CacheError> {
        for &slot in slots {
            let l = self.lease_mut(lease)?;
            if let Some(n) = l.pins.get_mut(&slot) {
                *n -= 1;
                if *n == 0 {
                    l.pins.remove(&slot);
                }
                self.unpin(slot);
            } else if l.reserved.remove(&slot) {
                self.free_slot(slot);
            } else {
                return Err(CacheError::NotHeld {
                    slot,
                    what: "pinned or reserved",
                });
            }
        }
        Ok(())
    }

    /// Removes resident, unpinned pages a consumer found corrupt; returns how many.
    pub fn discard(&mut self, lease: Lease, hashes: &[u64]) -> Result<usize, CacheError> {
        self.lease_mut(lease)?;
        let mut gone = Vec::new();
        for &h in hashes {
            if let Some(&slot) = self.index.get(&h)
                && let Slot::Resident {
                    pins: 0, last_use, ..
                } = self.slots[slot as usize]
            {
                self.lru.remove(&(last_use, slot));
                self.free_slot(slot);
                gone.push(h);
            }
        }
        let n = gone.len();
        if n > 0 {
            tracing::warn!(pages = n, "corrupt pages discarded from the host mirror");
            self.events.push(Event::Removed {
                hashes: gone,
                tier: Tier::Host,
            });
        }
        Ok(n)
    }
}

//! The mirror's slots: how big the mirror is, what each slot holds, and handing slots
//! out (evicting least recently used unpinned pages) and back (freed, or quarantined
//! while a failed room's sender might still write them).

use pdmesh_cache_client::Lease;

use super::{CacheError, State};
use crate::rooms::Released;

/// How big the host mirror is: bytes, or tokens of the registered layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MirrorSize {
    Bytes(u64),
    Tokens(u64),
}

/// Why a mirror size could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadMirrorSize {
    #[error("{0:?}: expected a number with an optional unit")]
    NotANumber(String),
    #[error("{0:?}: unknown unit {1:?} (B, KB, MB, GB, KiB, MiB, GiB, tokens)")]
    UnknownUnit(String, String),
    #[error("{0:?} is too large")]
    TooLarge(String),
}

impl std::str::FromStr for MirrorSize {
    type Err = BadMirrorSize;

    /// `4GiB`, `512MiB`, `1000000` (bytes), `2GB`, `100000tokens`.
    fn from_str(s: &str) -> Result<Self, BadMirrorSize> {
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let n: u64 = num
            .parse()
            .map_err(|_| BadMirrorSize::NotANumber(s.to_owned()))?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "tokens" | "token" => return Ok(Self::Tokens(n)),
            "" | "b" => 1,
            "kb" => 1000,
            "mb" => 1000 * 1000,
            "gb" => 1000 * 1000 * 1000,
            "kib" => 1 << 10,
            "mib" => 1 << 20,
            "gib" => 1 << 30,
            u => return Err(BadMirrorSize::UnknownUnit(s.to_owned(), u.to_owned())),
        };
        n.checked_mul(mult)
            .map(Self::Bytes)
            .ok_or_else(|| BadMirrorSize::TooLarge(s.to_owned()))
    }
}

#[derive(Debug)]
pub(super) enum Slot {
    Free,
    Reserved {
        lease: Lease,
        hash: u64,
    },
    Resident {
        hash: u64,
        checksum: u64,
        pins: u32,
        last_use: u64,
    },
    /// Being promoted from the disk tier: resident once its bytes are in and checked.
    Promoting {
        hash: u64,
        since: std::time::Instant,
    },
    /// Held by a room for its transfer.
    Room {
        room: u64,
    },
    /// A failed room's slot its sender might still write: not reused until that sender
    /// calls again or its lease ends.
    Quarantined {
        room: u64,
        lease: Lease,
    },
}

impl State {
    pub(super) fn free_slot(&mut self, slot: u32) {
        if let Slot::Reserved { hash, .. }
        | Slot::Resident { hash, .. }
        | Slot::Promoting { hash, .. } = self.slots[slot as usize]
        {
            self.index.remove(&hash);
        }
        self.slots[slot as usize] = Slot::Free;
        self.free.push(slot);
    }

    /// `pages` slots for `room`'s transfer, all or none, evicting least recently used
    /// unpinned pages for them.
    pub(super) fn take_slots(&mut self, room: u64, pages: usize) -> Result<Vec<u32>, CacheError> {
        let spare = self.free.len() + self.lru.len();
        if spare < pages {
            return Err(CacheError::MirrorFull {
                want: pages,
                free: spare,
            });
        }
        let mut slots = Vec::with_capacity(pages);
        let mut removed = Vec::new();
        for _ in 0..pages {
            let slot = self
                .free
                .pop()
                .or_else(|| self.evict_lru(&mut removed))
                .expect("counted above");
            self.slots[slot as usize] = Slot::Room { room };
            slots.push(slot);
        }
        self.removed(removed);
        Ok(slots)
    }

    /// Frees a room's slots, or quarantines those its sender might still write.
    pub(super) fn give_back(&mut self, rel: Released) {
        for slot in rel.free_now {
            self.free_slot(slot);
        }
        for (slot, lease) in rel.quarantined {
            if let Slot::Room { room } = self.slots[slot as usize] {
                // A peer writes through this process only (see `peer_write`).
                if self.leases.get(&lease).is_some_and(|l| !l.peer) {
                    self.slots[slot as usize] = Slot::Quarantined { room, lease };
                } else {
                    self.free_slot(slot);
                }
            }
        }
    }

    pub(super) fn free_quarantined(&mut self, pick: impl Fn(u64, Lease) -> bool) {
        let slots: Vec<u32> = (0..self.slots.len() as u32)
            .filter(|&i| {
                matches!(self.slots[i as usize], Slot::Quarantined { room, lease } if pick(room, lease))
            })
            .collect();
        for slot in slots {
            self.free_slot(slot);
        }
    }
}

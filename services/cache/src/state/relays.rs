//! Relayed rooms: rooms whose home is another host, opened by a sender here, for which
//! this mirror lends slots until the pages have crossed.

use std::sync::Arc;
use std::time::Instant;

use pdmesh_cache_client::Lease;

use super::slots::Slot;
use super::{CacheError, State};
use crate::rooms::{RoomError, RoomPage, RoomState, Side};
use pdmesh_cache_client::mirror::Mirror;

/// A room whose home is another host: this service relays its calls there and lends its
/// sender slots of this mirror to write into until the pages have crossed.
#[derive(Debug)]
pub(super) struct Relay {
    pub(super) lease: Lease,
    pub(super) home: String,
    /// This service's lease at the home, the one the room was opened there with (none
    /// until the home answered): the room lives there only as long as that lease.
    pub(super) link: Option<Lease>,
    /// This mirror's slots the sender writes (empty until it starts).
    pub(super) slots: Vec<u32>,
    /// The home host's slots for the same pages, in order.
    pub(super) remote_slots: Vec<u32>,
    /// When the relay was opened, or started transferring.
    pub(super) since: Instant,
}

/// A relayed room this service gave up on (its deadline, or its sender's lease ended):
/// the home host must hear of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DroppedRelay {
    pub room: u64,
    pub home: String,
    pub reason: String,
}

/// What a relayed room's commit needs: the pages' bytes are read from `mirror`.
#[derive(Debug)]
pub struct RelayCommit {
    pub mirror: Arc<Mirror>,
    pub slots: Vec<u32>,
    pub remote_slots: Vec<u32>,
}

impl State {
    /// `lease` (a local sender) opens `room`, whose home is the cache service at `home`.
    pub fn relay_open(
        &mut self,
        lease: Lease,
        room: u64,
        home: &str,
        now: Instant,
    ) -> Result<(), CacheError> {
        self.lease_mut(lease)?;
        if room == 0 {
            return Err(CacheError::BadRoomCall("room 0 is not a room".into()));
        }
        if self.draining {
            return Err(CacheError::Draining);
        }
        if self.rooms.state(room).is_some() {
            return Err(CacheError::BadRoomCall(format!(
                "room {room} lives on this host; it has no other home"
            )));
        }
        match self.relays.get(&room) {
            Some(r) if r.lease != lease => Err(CacheError::Room(RoomError::SideTaken {
                room,
                side: Side::Sender,
            })),
            Some(_) => Ok(()),
            None => {
                self.relays.insert(
                    room,
                    Relay {
                        lease,
                        home: home.to_owned(),
                        link: None,
                        slots: Vec::new(),
                        remote_slots: Vec::new(),
                        since: now,
                    },
                );
                self.rooms_version += 1;
                Ok(())
            }
        }
    }

    /// The local sender of relayed `room`.
    pub fn relay_owner(&self, room: u64) -> Option<Lease> {
        self.relays.get(&room).map(|r| r.lease)
    }

    /// The home of `room` if it is relayed from here.
    pub fn relay_home(&self, room: u64) -> Option<&str> {
        self.relays.get(&room).map(|r| r.home.as_str())
    }

    /// The home opened relayed `room` for this service's lease `link` there.
    pub fn relay_linked(&mut self, room: u64, link: Lease) {
        if let Some(r) = self.relays.get_mut(&room) {
            r.link = Some(link);
        }
    }

    /// The home of `room` if it is relayed from here, and the lease there it was opened
    /// with (none while its opening is under way).
    pub fn relay_link(&self, room: u64) -> Option<(&str, Option<Lease>)> {
        self.relays.get(&room).map(|r| (r.home.as_str(), r.link))
    }

    pub(super) fn relay_mut(&mut self, lease: Lease, room: u64) -> Result<&mut Relay, CacheError> {
        self.lease_mut(lease)?;
        match self.relays.get_mut(&room) {
            Some(r) if r.lease == lease => Ok(r),
            Some(_) => Err(CacheError::Room(RoomError::NotYours {
                room,
                side: Side::Sender,
            })),
            None => Err(CacheError::Room(RoomError::Unknown(room))),
        }
    }

    /// This mirror's slots for the sender of relayed `room` to write `pages` pages into.
    pub fn relay_take_slots(
        &mut self,
        lease: Lease,
        room: u64,
        pages: usize,
    ) -> Result<Vec<u32>, CacheError> {
        let r = self.relay_mut(lease, room)?;
        if !r.slots.is_empty() {
            return Err(CacheError::Room(RoomError::WrongState {
                room,
                state: RoomState::Transferring,
                need: RoomState::WaitingForInput,
            }));
        }
        if pages == 0 || pages > self.slots.len() {
            return Err(CacheError::BadRoomCall(format!(
                "a transfer of {pages} pages (the mirror has {})",
                self.slots.len()
            )));
        }
        self.take_slots(room, pages)
    }

    /// The home host granted its slots: the relayed room transfers with `slots` here.
    /// False (and the slots are freed) if the relay ended meanwhile.
    pub fn relay_started(
        &mut self,
        room: u64,
        slots: Vec<u32>,
        remote_slots: Vec<u32>,
        now: Instant,
    ) -> bool {
        match self.relays.get_mut(&room) {
            Some(r) if r.slots.is_empty() => {
                r.slots = slots;
                r.remote_slots = remote_slots;
                r.since = now;
                true
            }
            _ => {
                for s in slots {
                    self.free_slot(s);
                }
                false
            }
        }
    }

    /// Frees slots taken for a relayed room whose start the home host refused.
    pub fn relay_unstart(&mut self, slots: &[u32]) {
        for &s in slots {
            if matches!(self.slots[s as usize], Slot::Room { .. }) {
                self.free_slot(s);
            }
        }
    }

    /// What the commit of relayed `room` sends: `pages` must be exactly its slots here,
    /// in order.
    pub fn relay_commit(
        &mut self,
        lease: Lease,
        room: u64,
        pages: &[RoomPage],
    ) -> Result<RelayCommit, CacheError> {
        let r = self.relay_mut(lease, room)?;
        if r.slots.is_empty() {
            return Err(CacheError::Room(RoomError::WrongState {
                room,
                state: RoomState::WaitingForInput,
                need: RoomState::Transferring,
            }));
        }
        if !pages.iter().map(|p| p.slot).eq(r.slots.iter().copied()) {
            return Err(CacheError::BadRoomCall(
                "a commit must list exactly the room's slots, in order".into(),
            ));
        }
        let (slots, remote_slots) = (r.slots.clone(), r.remote_slots.clone());
        Ok(RelayCommit {
            mirror: self.mirror.clone().expect("a lease implies a mirror"),
            slots,
            remote_slots,
        })
    }

    /// Ends relayed `room` here: its slots are freed, or held back from reuse while its
    /// sender might still write them (`sender_done` false while it is transferring).
    /// Returns whether it was relayed.
    pub fn relay_end(&mut self, room: u64, sender_done: bool) -> bool {
        let Some(r) = self.relays.remove(&room) else {
            return false;
        };
        self.rooms_version += 1;
        let writing = !sender_done && !r.slots.is_empty() && self.leases.contains_key(&r.lease);
        for s in r.slots {
            if writing {
                self.slots[s as usize] = Slot::Quarantined {
                    room,
                    lease: r.lease,
                };
            } else {
                self.free_slot(s);
            }
        }
        true
    }

    pub(super) fn drop_relay(&mut self, room: u64, sender_done: bool, reason: String) {
        let home = self.relays.get(&room).map(|r| r.home.clone());
        if let Some(home) = home {
            tracing::warn!(room, %home, %reason, "relayed room failed on the sender's host");
            self.relay_end(room, sender_done);
            self.dropped_relays
                .push(DroppedRelay { room, home, reason });
        }
    }

    /// The sender of a relayed room that failed here came back (a late commit or its
    /// abort): it writes no more, so the slots held back for it are free.
    pub fn relay_sender_done(&mut self, lease: Lease, room: u64, late: bool) {
        if late {
            self.room_stats.late_writes_rejected += 1;
        }
        self.free_quarantined(|q, l| q == room && l == lease);
    }

    /// Relayed rooms given up on since the last call: their homes must be told.
    pub fn take_dropped_relays(&mut self) -> Vec<DroppedRelay> {
        std::mem::take(&mut self.dropped_relays)
    }
}

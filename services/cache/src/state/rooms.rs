//! The room calls as the state serves them: [`crate::rooms`] tied to leases and mirror
//! slots, and the watchdog over them.

use std::time::Instant;

use pdmesh_cache_client::Lease;
use pdmesh_telemetry::labels::RoomAbort;

use super::{CacheError, State};
use crate::rooms::{Aux, RoomError, RoomPage, RoomState, Side, Stuck};

impl State {
    pub(super) fn room_call<T>(&mut self, r: Result<T, RoomError>) -> Result<T, CacheError> {
        self.rooms_version += 1;
        Ok(r?)
    }

    /// `lease` joins `room` as `side`.
    pub fn room_open(
        &mut self,
        lease: Lease,
        room: u64,
        side: Side,
        (request_id, trace_id): (&str, &str),
        held: u32,
        now: Instant,
    ) -> Result<RoomState, CacheError> {
        self.lease_mut(lease)?;
        if room == 0 {
            return Err(CacheError::BadRoomCall("room 0 is not a room".into()));
        }
        if self.draining && self.rooms.state(room).is_none() {
            return Err(CacheError::Draining);
        }
        if held > 0 && side != Side::Receiver {
            return Err(CacheError::BadRoomCall(
                "only a receiver says which pages it holds".into(),
            ));
        }
        let r = self.rooms.open(room, side, lease, now);
        if r.is_ok() && side == Side::Receiver {
            self.rooms.set_held(room, held);
        }
        self.rooms.describe(room, request_id, trace_id);
        self.room_call(r)
    }

    /// Leading pages `room`'s receiver holds already.
    pub fn room_held(&self, room: u64) -> u32 {
        self.rooms.held(room)
    }

    /// Where `room` is, and why it failed.
    pub fn room_state(&self, room: u64) -> Option<(RoomState, Option<String>)> {
        self.rooms
            .state(room)
            .map(|(s, why)| (s, why.map(str::to_owned)))
    }

    /// Slots for the sender to write `pages` pages into, all or none; the room starts
    /// transferring.
    pub fn room_start(
        &mut self,
        lease: Lease,
        room: u64,
        pages: usize,
        now: Instant,
    ) -> Result<Vec<u32>, CacheError> {
        self.lease_mut(lease)?;
        if pages == 0 || pages > self.slots.len() {
            return Err(CacheError::BadRoomCall(format!(
                "a transfer of {pages} pages (the mirror has {})",
                self.slots.len()
            )));
        }
        // Check the room before taking anything.
        if let Some((state, _)) = self.rooms.state(room)
            && state != RoomState::WaitingForInput
        {
            let r = self.rooms.start_transfer(room, lease, Vec::new(), now);
            return self.room_call(r.map(|()| Vec::new()));
        }
        let slots = self.take_slots(room, pages)?;
        let r = self.rooms.start_transfer(room, lease, slots.clone(), now);
        if r.is_ok() {
            self.room_stats.peer.held_pages_skipped += u64::from(self.rooms.held(room));
        }
        if r.is_err() {
            for &s in &slots {
                self.free_slot(s);
            }
        }
        self.room_call(r.map(|()| slots))
    }

    /// The sender hands over its pages: exactly the room's slots, in order.
    pub fn room_commit(
        &mut self,
        lease: Lease,
        room: u64,
        pages: Vec<RoomPage>,
        aux: Aux,
        now: Instant,
    ) -> Result<(), CacheError> {
        self.lease_mut(lease)?;
        if aux.room != room {
            return Err(CacheError::BadRoomCall(format!(
                "aux data names room {}, not {room}",
                aux.room
            )));
        }
        if matches!(self.rooms.state(room), Some((RoomState::Transferring, _)))
            && self.rooms.sender(room) == Some(lease)
            && !pages
                .iter()
                .map(|p| p.slot)
                .eq(self.rooms.slots(room).iter().copied())
        {
            return Err(CacheError::BadRoomCall(
                "a commit must list exactly the room's slots, in order".into(),
            ));
        }
        let from_peer = self.leases.get(&lease).is_some_and(|l| l.peer);
        if from_peer
            && matches!(self.rooms.state(room), Some((RoomState::Transferring, _)))
            && self.peer_pages.get(&room).copied().unwrap_or(0) < pages.len()
        {
            return Err(CacheError::BadRoomCall(format!(
                "a peer committed {} pages of room {room} but sent {}",
                pages.len(),
                self.peer_pages.get(&room).copied().unwrap_or(0)
            )));
        }
        let r = self.rooms.commit(room, lease, pages, aux, now);
        self.peer_pages.remove(&room);
        if let Err(RoomError::Failed { .. } | RoomError::Unknown(_)) = &r {
            // A late write: refused. Its sender is done, so its held slots are free now.
            self.room_stats.late_writes_rejected += 1;
            self.free_quarantined(|q, l| q == room && l == lease);
            tracing::warn!(room, %lease, "late commit to a failed room refused");
        }
        self.room_call(r)
    }

    /// The receiver's pages and aux data.
    pub fn room_result(
        &mut self,
        lease: Lease,
        room: u64,
    ) -> Result<(Vec<RoomPage>, Aux), CacheError> {
        self.lease_mut(lease)?;
        Ok(self.rooms.result(room, lease)?)
    }

    /// The receiver took its pages: the slots are free.
    pub fn room_finish(&mut self, lease: Lease, room: u64) -> Result<(), CacheError> {
        self.lease_mut(lease)?;
        let pages = self.rooms.result(room, lease).map(|(p, _)| p.len());
        let rel = self.rooms.finish(room, lease);
        let rel = self.room_call(rel)?;
        let n = pages.unwrap_or(0) as u64;
        self.room_stats.finished += 1;
        self.room_stats.transfer_pages += n;
        let page_bytes = self.mirror.as_ref().map_or(0, |m| m.page_bytes()) as u64;
        self.room_stats.transfer_bytes += n * page_bytes;
        self.give_back(rel);
        Ok(())
    }

    /// Either side gives up. Not an error if the room is already over.
    pub fn room_abort(
        &mut self,
        lease: Lease,
        room: u64,
        reason: &str,
        now: Instant,
    ) -> Result<(), CacheError> {
        self.lease_mut(lease)?;
        let who = if self.rooms.sender(room) == Some(lease) {
            RoomAbort::Sender
        } else {
            RoomAbort::Receiver
        };
        if let Some(rel) = self.rooms.abort(room, lease, reason, now) {
            *self.room_stats.aborts.entry(who).or_default() += 1;
            tracing::info!(room, by = who.name(), reason, "room aborted");
            self.give_back(rel);
        }
        if who == RoomAbort::Sender {
            self.free_quarantined(|q, l| q == room && l == lease);
        }
        self.rooms_version += 1;
        Ok(())
    }

    /// Rooms stuck past `fraction` of their state's deadline, each reported once per
    /// state; with `abort`, they are failed and their slots released.
    pub fn watchdog(&mut self, now: Instant, fraction: f64, abort: bool) -> Vec<Stuck> {
        let stuck = self.rooms.stuck(now, fraction);
        self.room_stats.stalls += stuck.len() as u64;
        if abort {
            for s in &stuck {
                if let Some(rel) = self.rooms.abort_any(s.room, "watchdog: stuck", now) {
                    *self
                        .room_stats
                        .aborts
                        .entry(RoomAbort::Watchdog)
                        .or_default() += 1;
                    self.give_back(rel);
                    self.rooms_version += 1;
                }
            }
        }
        stuck
    }

    /// Every room under way now (see [`crate::rooms::Rooms::under_way`]).
    pub fn rooms_under_way(&self, now: Instant) -> Vec<Stuck> {
        self.rooms.under_way(now)
    }
}

//! Expiry: leases whose holders stopped heartbeating, relays and rooms past their
//! deadlines, each giving back what it held.

use std::time::{Duration, Instant};

use pdmesh_cache_client::Lease;
use pdmesh_telemetry::labels::RoomAbort;

use super::State;
use crate::rooms::RoomState;

impl State {
    /// Ends every lease whose worker stopped heartbeating: its pins and reservations are
    /// dropped, so its pages become evictable. Returns the expired workers.
    pub fn expire(&mut self, now: Instant) -> Vec<String> {
        let dead: Vec<Lease> = self
            .leases
            .iter()
            .filter(|(_, l)| l.expires <= now)
            .map(|(&id, _)| id)
            .collect();
        let mut workers = Vec::new();
        for id in dead {
            let l = self.leases.remove(&id).expect("listed above");
            for (slot, n) in l.pins {
                for _ in 0..n {
                    self.unpin(slot);
                }
            }
            for slot in l.reserved {
                self.free_slot(slot);
            }
            let lost = self.rooms.lease_lost(id, now);
            *self
                .room_stats
                .aborts
                .entry(RoomAbort::LeaseLost)
                .or_default() += lost.len() as u64;
            for (_, rel) in lost {
                self.give_back(rel);
            }
            // Slots quarantined for this sender: it writes no more.
            self.free_quarantined(|_, lease| lease == id);
            let gone: Vec<u64> = self
                .relays
                .iter()
                .filter(|(_, r)| r.lease == id)
                .map(|(&room, _)| room)
                .collect();
            for room in gone {
                self.drop_relay(room, true, "the sender's lease was lost".to_owned());
            }
            self.rooms_version += 1;
            self.stats.expired_leases += 1;
            tracing::warn!(worker = %l.worker, lease = %id, "lease expired: its pins and reservations are released");
            workers.push(l.worker);
        }
        let late: Vec<(u64, bool)> = self
            .relays
            .iter()
            .filter_map(|(&room, r)| {
                let limit = if r.slots.is_empty() {
                    self.rooms.deadlines().bootstrapping + self.rooms.deadlines().waiting_for_input
                } else {
                    self.rooms.deadlines().transferring
                };
                (now.duration_since(r.since) >= limit).then_some((room, !r.slots.is_empty()))
            })
            .collect();
        for (room, writing) in late {
            *self
                .room_stats
                .timeouts
                .entry(if writing {
                    RoomState::Transferring
                } else {
                    RoomState::WaitingForInput
                })
                .or_default() += 1;
            self.drop_relay(room, false, "deadline passed on the sender's host".into());
        }
        let rooms = &self.rooms;
        self.peer_pages
            .retain(|&room, _| matches!(rooms.state(room), Some((RoomState::Transferring, _))));
        let expired = self.rooms.expire(now);
        if !expired.is_empty() {
            self.rooms_version += 1;
        }
        for (room, stuck_in, rel) in expired {
            if stuck_in != RoomState::Success {
                *self.room_stats.timeouts.entry(stuck_in).or_default() += 1;
                tracing::warn!(
                    room,
                    state = stuck_in.name(),
                    "room deadline passed: failed"
                );
                let crate::rooms::Story {
                    request_id,
                    trace_id,
                    history,
                } = self.rooms.story(room).unwrap_or_default();
                let mut i = pdmesh_incident::Incident::new(
                    pdmesh_incident::Kind::RoomDeadline,
                    format!(
                        "Room {room} of request {} stayed {} past that state's deadline and \
                         was failed: both sides were told, and its mirror slots came back.",
                        if request_id.is_empty() {
                            "(unnamed)"
                        } else {
                            &request_id
                        },
                        stuck_in.name()
                    ),
                    pdmesh_incident::Place {
                        room: Some(room),
                        request_id,
                        trace_id,
                        ..Default::default()
                    },
                );
                i.timeline = history
                    .into_iter()
                    .map(|(at, what)| pdmesh_incident::Step::new(at, what.to_string()))
                    .collect();
                self.incidents.push(i);
            }
            self.give_back(rel);
        }
        // Failed rooms stay long enough for both sides to learn why, then go.
        self.rooms
            .forget_failed(now, self.ttl.max(Duration::from_secs(30)));
        workers
    }
}

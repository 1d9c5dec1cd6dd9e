//! The figures the service reports: the mirror's use and the rooms' counts since it
//! started.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pdmesh_telemetry::labels::RoomAbort;

use super::State;
use super::peer_traffic::PeerStats;
use super::slots::Slot;
use crate::rooms::RoomState;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub total_pages: usize,
    pub used_pages: usize,
    pub pinned_pages: usize,
    pub leases: usize,
    pub evicted_pages: u64,
    pub checksum_failures: u64,
    pub expired_leases: u64,
}

/// Room counters since the service started.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoomStats {
    /// Rooms now by state, with the oldest one's age.
    pub census: Vec<(RoomState, usize, Duration)>,
    /// Rooms under way longer than each of `rooms::AGE_THRESHOLDS` in their state.
    pub older_than: Vec<(f64, usize)>,
    /// Rooms failed by a deadline, by the state they were stuck in.
    pub timeouts: HashMap<RoomState, u64>,
    /// Rooms aborted, by who or what.
    pub aborts: HashMap<RoomAbort, u64>,
    pub finished: u64,
    pub transfer_pages: u64,
    pub transfer_bytes: u64,
    pub room_slots: usize,
    pub quarantined_slots: usize,
    pub stalls: u64,
    pub late_writes_rejected: u64,
    pub peer: PeerStats,
}

impl State {
    pub fn stats(&self) -> Stats {
        Stats {
            used_pages: self.slots.len() - self.free.len(),
            pinned_pages: self
                .slots
                .iter()
                .filter(|s| matches!(s, Slot::Resident { pins, .. } if *pins > 0))
                .count(),
            leases: self.leases.len(),
            ..self.stats
        }
    }

    pub fn room_stats(&self, now: Instant) -> RoomStats {
        let mut st = self.room_stats.clone();
        st.census = self.rooms.census(now);
        st.older_than = crate::rooms::AGE_THRESHOLDS
            .into_iter()
            .zip(self.rooms.older_than(now))
            .collect();
        st.room_slots = self
            .slots
            .iter()
            .filter(|s| matches!(s, Slot::Room { .. }))
            .count();
        st.quarantined_slots = self
            .slots
            .iter()
            .filter(|s| matches!(s, Slot::Quarantined { .. }))
            .count();
        st
    }
}

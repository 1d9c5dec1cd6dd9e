//! The Stats call: the mirror's use, the rooms' figures, peer traffic and the incident
//! counts, in one answer.

use std::time::Instant;

use pdmesh_proto::cache::v1 as pb;
use tonic::{Request, Response, Status};

use super::CacheService;

impl CacheService {
    pub(super) async fn on_stats(
        &self,
        _request: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        let (st, layout, rooms, disk, page_tokens) = self.shared.with(|s| {
            (
                s.stats(),
                s.layout().map(|l| l.to_string()),
                s.room_stats(Instant::now()),
                s.disk().map(|d| d.figures()),
                s.layout().map_or(0, |l| l.page_size() as u64),
            )
        });
        Ok(Response::new(pb::StatsResponse {
            total_pages: st.total_pages as u32,
            used_pages: st.used_pages as u32,
            pinned_pages: st.pinned_pages as u32,
            leases: st.leases as u32,
            evicted_pages: st.evicted_pages,
            checksum_failures: st.checksum_failures,
            expired_leases: st.expired_leases,
            layout: layout.unwrap_or_default(),
            rooms: rooms
                .census
                .iter()
                .map(|(st, n, _)| (st.name().to_owned(), *n as u32))
                .collect(),
            rooms_older_than: rooms
                .older_than
                .iter()
                .map(|(t, n)| (format!("{t}"), *n as u32))
                .collect(),
            oldest_room_seconds: rooms
                .census
                .iter()
                .map(|(st, _, age)| (st.name().to_owned(), age.as_secs_f64()))
                .collect(),
            room_timeouts: rooms
                .timeouts
                .iter()
                .map(|(k, v)| (k.name().to_owned(), *v))
                .collect(),
            room_aborts: rooms
                .aborts
                .iter()
                .map(|(k, v)| (k.name().to_owned(), *v))
                .collect(),
            rooms_finished: rooms.finished,
            transfer_pages: rooms.transfer_pages,
            transfer_bytes: rooms.transfer_bytes,
            room_slots: rooms.room_slots as u32,
            quarantined_slots: rooms.quarantined_slots as u32,
            room_stalls: rooms.stalls,
            late_writes_rejected: rooms.late_writes_rejected,
            peer_layout_refusals: rooms.peer.layout_refusals,
            peer_pages_received: rooms.peer.pages_received,
            peer_bytes_received: rooms.peer.bytes_received,
            peer_pages_sent: rooms.peer.pages_sent,
            peer_bytes_sent: rooms.peer.bytes_sent,
            peer_transfer_failures: rooms.peer.transfer_failures,
            held_pages_skipped: rooms.peer.held_pages_skipped,
            incidents: self
                .incidents
                .as_ref()
                .map(|r| r.counts())
                .unwrap_or_default(),
            auth_refused: pdmesh_tls::auth::refused_total(),
            insecure_plaintext: pdmesh_tls::auth::insecure(),
            disk: disk.map(|d| pb::DiskStats {
                serving: d.serving,
                degraded: d.degraded,
                pages: d.pages,
                bytes: d.bytes,
                capacity_bytes: d.capacity,
                spilled_pages: d.spilled,
                spill_dropped_pages: d.spill_dropped,
                promoted_pages: d.promoted,
                hit_pages: d.hits,
                late_promotions: d.late,
                evicted_pages: d.evicted,
                written_bytes: d.written_bytes,
                read_bytes: d.read_bytes,
                promote_seconds: d.promote_seconds,
                discards: crate::disk::Discard::ALL
                    .iter()
                    .map(|r| (r.name().to_owned(), d.discards.get(r).copied().unwrap_or(0)))
                    .collect(),
                hit_tokens: d.hits * page_tokens,
            }),
        }))
    }
}

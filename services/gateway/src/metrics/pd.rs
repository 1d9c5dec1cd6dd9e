//! The disaggregation metrics (rooms, transfers, host tier) and the workers' totals as
//! `/metrics` sums them.

use pdmesh_telemetry::labels::{RoomAbort, RoomState, TransferFailure};
use prometheus::{IntGauge, Opts, Registry};

use super::{ALL_SIDES, HOST, OTHER, PREFILL_AND_DECODE, ROOM_AGE_THRESHOLDS};

/// The disaggregation metrics (see `render`'s help texts).
pub(crate) struct PdMetrics {
    pub rooms: prometheus::IntGaugeVec,
    pub room_oldest_seconds: prometheus::GaugeVec,
    pub room_timeouts: WorkerTotals,
    pub room_aborts: WorkerTotals,
    pub room_stalls: WorkerTotals,
    pub late_writes_rejected: WorkerTotals,
    pub peer_pages: WorkerTotals,
    pub peer_bytes: WorkerTotals,
    pub peer_layout_refusals: WorkerTotals,
    pub peer_transfer_failures: WorkerTotals,
    pub held_pages_skipped: WorkerTotals,
    pub room_slots: prometheus::IntGaugeVec,
    pub transfer_bytes: WorkerTotals,
    pub transfer_seconds: WorkerTotals,
    pub transfer_failures: WorkerTotals,
    pub transfers: WorkerTotals,
    pub handovers: prometheus::IntGaugeVec,
    pub handover_oldest_seconds: prometheus::GaugeVec,
    pub rooms_older_than: prometheus::IntGaugeVec,
    pub admission_timeouts: WorkerTotals,
    pub engine_stalls: WorkerTotals,
    pub watchdog_aborts: WorkerTotals,
    pub requests: prometheus::IntGaugeVec,
    pub reserved_pages: IntGauge,
    /// The router's view of each prefill worker's device cache, from its KV events.
    pub router_cached_pages: prometheus::IntGaugeVec,
    pub route_prefill: WorkerTotals,
}

impl PdMetrics {
    pub(super) fn new(r: &Registry) -> Result<Self, prometheus::Error> {
        let gauge_vec = |name: &str,
                         help: &str,
                         label: &str,
                         values: &mut dyn Iterator<Item = &'static str>| {
            let g = prometheus::IntGaugeVec::new(Opts::new(name, help), &[label])?;
            r.register(Box::new(g.clone()))?;
            for v in values {
                g.with_label_values(&[v]);
            }
            Ok::<_, prometheus::Error>(g)
        };
        let oldest = prometheus::GaugeVec::new(
            Opts::new(
                "mesh_room_oldest_seconds",
                "Age of the oldest room in each state at the cache service.",
            ),
            &["state"],
        )?;
        r.register(Box::new(oldest.clone()))?;
        for state in RoomState::names() {
            oldest.with_label_values(&[state]);
        }
        let handover_oldest_seconds = prometheus::GaugeVec::new(
            Opts::new(
                "mesh_handover_oldest_seconds",
                "Age of the oldest KV hand-over under way, as the workers on each side see it (it keeps rising while the cache service does not answer).",
            ),
            &["side"],
        )?;
        r.register(Box::new(handover_oldest_seconds.clone()))?;
        for side in PREFILL_AND_DECODE {
            handover_oldest_seconds.with_label_values(&[side]);
        }
        let reserved_pages = IntGauge::new(
            "mesh_kv_reserved_pages",
            "Decode pages reserved for prompts whose KV is still travelling.",
        )?;
        r.register(Box::new(reserved_pages.clone()))?;
        Ok(Self {
            rooms: gauge_vec(
                "mesh_rooms",
                "Rooms at the cache service, by state.",
                "state",
                &mut RoomState::names(),
            )?,
            room_oldest_seconds: oldest,
            room_timeouts: WorkerTotals::labeled(
                r,
                "mesh_room_timeouts_total",
                "Rooms failed by a deadline, by the state they were stuck in.",
                "stage",
                RoomState::names(),
            )?,
            room_aborts: WorkerTotals::labeled(
                r,
                "mesh_room_aborts_total",
                "Rooms aborted, by who: sender, receiver, lease_lost, watchdog.",
                "reason",
                RoomAbort::names(),
            )?,
            room_stalls: WorkerTotals::labeled(
                r,
                "mesh_stalls_total",
                "Stalls the watchdogs saw: rooms past half their deadline, engine loops with work and no step.",
                "component",
                ["room", "engine"],
            )?,
            late_writes_rejected: WorkerTotals::labeled(
                r,
                "mesh_room_late_writes_rejected_total",
                "Commits refused because their room had already failed.",
                "tier",
                HOST.iter().copied(),
            )?,
            peer_pages: WorkerTotals::labeled(
                r,
                "mesh_kv_peer_pages_total",
                "KV pages moved between hosts' cache services, by direction (summed over hosts).",
                "direction",
                ["sent", "received"],
            )?,
            peer_bytes: WorkerTotals::labeled(
                r,
                "mesh_kv_peer_bytes_total",
                "KV bytes moved between hosts' cache services, by direction (summed over hosts).",
                "direction",
                ["sent", "received"],
            )?,
            peer_layout_refusals: WorkerTotals::new(
                r,
                "mesh_kv_peer_layout_refusals_total",
                "Peer hosts refused because their KV layout differs from this host's.",
                HOST,
            )?,
            peer_transfer_failures: WorkerTotals::new(
                r,
                "mesh_kv_peer_transfer_failures_total",
                "Rooms whose pages could not be moved to their home host.",
                HOST,
            )?,
            held_pages_skipped: WorkerTotals::new(
                r,
                "mesh_kv_held_pages_skipped_total",
                "Prompt pages a receiver already held, so they did not cross between hosts.",
                HOST,
            )?,
            room_slots: gauge_vec(
                "mesh_room_slots",
                "Host-mirror slots held by rooms: transferring, or quarantined after a failure.",
                "state",
                &mut ["transferring", "quarantined"].into_iter(),
            )?,
            transfer_bytes: WorkerTotals::labeled(
                r,
                "mesh_kv_transfer_bytes_total",
                "KV bytes handed from prefill to decode workers, by side.",
                "side",
                ALL_SIDES.iter().copied(),
            )?,
            transfer_seconds: WorkerTotals::labeled(
                r,
                "mesh_kv_transfer_seconds_total",
                "Time spent copying transferred KV pages, checksums included, by side.",
                "side",
                ALL_SIDES.iter().copied(),
            )?,
            transfer_failures: WorkerTotals::labeled(
                r,
                "mesh_kv_transfer_failures_total",
                "Requests that failed in transfer, by reason.",
                "reason",
                TransferFailure::names(),
            )?,
            transfers: WorkerTotals::labeled(
                r,
                "mesh_kv_transfers_total",
                "KV hand-overs as the decode side ended them: ok (pages verified) or failed.",
                "outcome",
                ["ok", "failed"],
            )?,
            handovers: gauge_vec(
                "mesh_handovers",
                "KV hand-overs under way, by side (prefill: until its commit; decode: until its pages are verified).",
                "side",
                &mut PREFILL_AND_DECODE.iter().copied(),
            )?,
            handover_oldest_seconds,
            rooms_older_than: gauge_vec(
                "mesh_rooms_older_than",
                "Rooms under way longer than N seconds in their state (N = 1, 5, 30, 120; cumulative).",
                "seconds",
                &mut ROOM_AGE_THRESHOLDS.iter().copied(),
            )?,
            admission_timeouts: WorkerTotals::labeled(
                r,
                "mesh_admission_timeouts_total",
                "Requests refused because no KV pages became free before the admission deadline.",
                "side",
                ALL_SIDES.iter().copied(),
            )?,
            engine_stalls: WorkerTotals::labeled(
                r,
                "mesh_engine_stalls_total",
                "Times an engine loop had work but made no step past the watchdog threshold.",
                "side",
                ALL_SIDES.iter().copied(),
            )?,
            watchdog_aborts: WorkerTotals::labeled(
                r,
                "mesh_watchdog_aborts_total",
                "Requests a hard-mode watchdog ended because their engine loop stalled.",
                "component",
                ["engine"],
            )?,
            requests: gauge_vec(
                "mesh_worker_requests",
                "Requests in the workers now: waiting, reserved (decode, KV in flight), running.",
                "state",
                &mut ["waiting", "reserved", "running"].into_iter(),
            )?,
            reserved_pages,
            router_cached_pages: gauge_vec(
                "mesh_router_cached_pages",
                "Pages each prefill worker's device cache holds, as the gateway knows from its KV events.",
                "worker",
                // An open set: each worker's series appears at the first scrape.
                &mut std::iter::empty(),
            )?,
            route_prefill: WorkerTotals::labeled(
                r,
                "mesh_route_prefill_total",
                "Prefill workers chosen: for the longest cached prefix, or by load alone.",
                "reason",
                ["prefix", "load"],
            )?,
        })
    }
}

/// A counter mirroring a total the worker keeps since it started, by a label from a
/// closed set (cache tier, reason, ...): each scrape adds the difference from the last
/// total seen. A total lower than the last means the worker restarted, so all of it is
/// new. Every value of the set has its series from the start; a name outside the set
/// (from a newer worker) is counted as `other`.
pub(crate) struct WorkerTotals {
    counter: prometheus::CounterVec,
    values: Vec<&'static str>,
    seen: std::sync::Mutex<std::collections::HashMap<String, f64>>,
}

impl WorkerTotals {
    /// By cache tier, one of `tiers`.
    pub(super) fn new(
        registry: &Registry,
        name: &str,
        help: &str,
        tiers: &[&'static str],
    ) -> Result<Self, prometheus::Error> {
        Self::labeled(registry, name, help, "tier", tiers.iter().copied())
    }

    /// By `label`, whose closed set is `values`.
    pub(super) fn labeled(
        registry: &Registry,
        name: &str,
        help: &str,
        label: &str,
        values: impl IntoIterator<Item = &'static str>,
    ) -> Result<Self, prometheus::Error> {
        let counter = prometheus::CounterVec::new(Opts::new(name, help), &[label])?;
        registry.register(Box::new(counter.clone()))?;
        let values: Vec<_> = values.into_iter().collect();
        for v in &values {
            counter.with_label_values(&[v]);
        }
        Ok(Self {
            counter,
            values,
            seen: Default::default(),
        })
    }

    pub fn observe(&self, value: &str, total: f64) {
        let label = self
            .values
            .iter()
            .copied()
            .find(|v| *v == value)
            .unwrap_or(OTHER);
        let mut seen = self.seen.lock().expect("metrics lock");
        let last = seen.insert(value.to_owned(), total).unwrap_or(0.0);
        let new = if total >= last { total - last } else { total };
        self.counter.with_label_values(&[label]).inc_by(new);
    }

    #[cfg(test)]
    pub(super) fn get(&self, tier: &str) -> f64 {
        self.counter.with_label_values(&[tier]).get()
    }
}

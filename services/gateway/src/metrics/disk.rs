//! The disk tier's metrics, summed over the hosts' cache services as `/metrics` reads
//! their Stats.

use pdmesh_proto::cache::v1 as cpb;
use prometheus::{Gauge, IntGauge, IntGaugeVec, Opts, Registry};

use pdmesh_telemetry::labels::DiskDiscard;

use super::pd::WorkerTotals;

pub(crate) struct DiskMetrics {
    pub pages_events: WorkerTotals,
    pub bytes: WorkerTotals,
    pub promote_seconds: WorkerTotals,
    pub discards: WorkerTotals,
    pub pages: IntGauge,
    pub size: IntGaugeVec,
    pub tiers: IntGaugeVec,
    pub promote_mean_seconds: Gauge,
}

impl DiskMetrics {
    pub(super) fn new(r: &Registry) -> Result<Self, prometheus::Error> {
        let pages = IntGauge::new(
            "mesh_kv_disk_pages",
            "KV pages on the hosts' disk tiers (read at scrape).",
        )?;
        r.register(Box::new(pages.clone()))?;
        let size = IntGaugeVec::new(
            Opts::new(
                "mesh_kv_disk_bytes",
                "Bytes of page files on the hosts' disk tiers, and their capacity (--disk-size).",
            ),
            &["state"],
        )?;
        r.register(Box::new(size.clone()))?;
        let tiers = IntGaugeVec::new(
            Opts::new(
                "mesh_kv_disk_tier",
                "1 when any cache service's disk tier is in the state: serving (open, its index rebuilt), degraded (a write failed, the disk full or unwritable: nothing is spilled until a retry succeeds; requests go on without it).",
            ),
            &["state"],
        )?;
        r.register(Box::new(tiers.clone()))?;
        for s in ["used", "capacity"] {
            size.with_label_values(&[s]);
        }
        for s in ["serving", "degraded"] {
            tiers.with_label_values(&[s]);
        }
        let promote_mean_seconds = Gauge::new(
            "mesh_kv_disk_promote_mean_seconds",
            "Mean time from a match asking to a page promoted from disk being in the host mirror, since the cache services started.",
        )?;
        r.register(Box::new(promote_mean_seconds.clone()))?;
        Ok(Self {
            pages_events: WorkerTotals::labeled(
                r,
                "mesh_kv_disk_pages_total",
                "Disk tier pages by event: spilled (written from the host mirror), spill_dropped (not written: queue full, degraded or unsound), promoted (read back into the host mirror), late (not promoted by its match's deadline: a miss for that match, never a wait).",
                "event",
                ["spilled", "spill_dropped", "promoted", "late"],
            )?,
            bytes: WorkerTotals::labeled(
                r,
                "mesh_kv_disk_io_bytes_total",
                "Page bytes written to and read from the disk tiers.",
                "direction",
                ["written", "read"],
            )?,
            promote_seconds: WorkerTotals::new(
                r,
                "mesh_kv_disk_promote_seconds_total",
                "Time from a match asking to each promoted page being in the host mirror, summed.",
                &["disk"],
            )?,
            discards: WorkerTotals::labeled(
                r,
                "mesh_kv_disk_discards_total",
                "Disk tier page files discarded instead of served, by reason (at start and at load); each is a miss.",
                "reason",
                DiskDiscard::names(),
            )?,
            pages,
            size,
            tiers,
            promote_mean_seconds,
        })
    }

    /// Sets every disk figure from the cache services' summed Stats.
    pub fn observe(&self, d: &cpb::DiskStats) {
        self.pages.set(d.pages as i64);
        self.size.with_label_values(&["used"]).set(d.bytes as i64);
        self.size
            .with_label_values(&["capacity"])
            .set(d.capacity_bytes as i64);
        self.tiers
            .with_label_values(&["serving"])
            .set(i64::from(d.serving));
        self.tiers
            .with_label_values(&["degraded"])
            .set(i64::from(d.degraded));
        for (event, n) in [
            ("spilled", d.spilled_pages),
            ("spill_dropped", d.spill_dropped_pages),
            ("promoted", d.promoted_pages),
            ("late", d.late_promotions),
        ] {
            self.pages_events.observe(event, n as f64);
        }
        self.bytes.observe("written", d.written_bytes as f64);
        self.bytes.observe("read", d.read_bytes as f64);
        self.promote_seconds.observe("disk", d.promote_seconds);
        if d.promoted_pages > 0 {
            self.promote_mean_seconds
                .set(d.promote_seconds / d.promoted_pages as f64);
        }
        for (reason, n) in &d.discards {
            self.discards.observe(reason, *n as f64);
        }
    }
}

/// Adds one host's disk figures to `sum` (serving or degraded: any of them).
pub(crate) fn add_disk(sum: &mut cpb::DiskStats, d: &cpb::DiskStats) {
    sum.serving |= d.serving;
    sum.degraded |= d.degraded;
    sum.pages += d.pages;
    sum.bytes += d.bytes;
    sum.capacity_bytes += d.capacity_bytes;
    sum.spilled_pages += d.spilled_pages;
    sum.spill_dropped_pages += d.spill_dropped_pages;
    sum.promoted_pages += d.promoted_pages;
    sum.hit_pages += d.hit_pages;
    sum.late_promotions += d.late_promotions;
    sum.evicted_pages += d.evicted_pages;
    sum.written_bytes += d.written_bytes;
    sum.read_bytes += d.read_bytes;
    sum.promote_seconds += d.promote_seconds;
    for (k, v) in &d.discards {
        *sum.discards.entry(k.clone()).or_default() += v;
    }
    sum.hit_tokens += d.hit_tokens;
}

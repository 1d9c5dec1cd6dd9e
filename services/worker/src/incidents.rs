//! The worker's incident reports (with `--incident-dir`): checksum failures of host pages
//! loaded back, of a hand-over's pages on either side, and engine-loop stalls (filed by
//! the watchdog). Each report carries the worker's own figures (hand-overs under way,
//! transfers, failures, stalls) as they were at the last second's tick and as they are
//! when it is filed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use pdmesh_incident::{Incident, Kind, MetricDelta, PageCheck, Place, Reporter};

/// The worker's figures a report shows before and after.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Figures {
    pub handovers: usize,
    pub oldest_handover_seconds: f64,
    pub transfers: u64,
    pub transfer_bytes: u64,
    pub failed_transfers: u64,
}

type Source = Box<dyn Fn() -> Figures + Send + Sync>;

/// See the module docs.
pub(crate) struct Incidents {
    reporter: Reporter,
    /// `prefill pid 123`.
    worker: String,
    config: BTreeMap<String, String>,
    source: OnceLock<Source>,
    /// The figures at the last tick, and when.
    before: Mutex<Option<(Instant, Figures, Counts)>>,
    /// Engine-loop stalls seen (the watchdog's count).
    pub stalls: Arc<AtomicU64>,
    load_failures: AtomicU64,
}

/// Counters the worker keeps for its reports.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Counts {
    stalls: u64,
    load_failures: u64,
}

impl Incidents {
    /// None without `--incident-dir`; an error when it cannot be made or is not safe.
    pub(crate) fn from_flags(
        dir: Option<&std::path::Path>,
        (trace_link, replay_url, include_prompts): (Option<String>, Option<String>, bool),
        worker: String,
        config: BTreeMap<String, String>,
    ) -> Result<Option<Arc<Self>>, pdmesh_incident::Error> {
        let Some(reporter) = Reporter::from_flags(dir, trace_link, replay_url, include_prompts)?
        else {
            return Ok(None);
        };
        Ok(Some(Arc::new(Self {
            reporter,
            worker,
            config,
            source: OnceLock::new(),
            before: Mutex::default(),
            stalls: Arc::default(),
            load_failures: AtomicU64::new(0),
        })))
    }

    /// Where the worker's figures come from (set once, when the PD state exists).
    pub(crate) fn set_source(&self, f: impl Fn() -> Figures + Send + Sync + 'static) {
        let _ = self.source.set(Box::new(f));
    }

    fn now(&self) -> (Figures, Counts) {
        (
            self.source.get().map(|f| f()).unwrap_or_default(),
            Counts {
                stalls: self.stalls.load(Ordering::Relaxed),
                load_failures: self.load_failures.load(Ordering::Relaxed),
            },
        )
    }

    /// Failures reported so far, by kind (ModelInfo's `incidents`).
    pub(crate) fn counts(&self) -> std::collections::HashMap<String, u64> {
        self.reporter.counts()
    }

    /// This worker, at `stage`.
    pub(crate) fn place(&self, stage: &str) -> Place {
        Place {
            service: "worker".into(),
            host: pdmesh_incident::hostname(),
            worker: self.worker.clone(),
            stage: stage.into(),
            ..Default::default()
        }
    }

    /// Files `i` with the figures before and now, and the worker's configuration.
    pub(crate) fn file(&self, mut i: Incident) {
        let (now, counts) = self.now();
        let before = *self.before.lock().unwrap_or_else(PoisonError::into_inner);
        i.metrics = deltas(before.map(|(_, f, c)| (f, c)), (now, counts));
        if let Some((at, ..)) = before {
            i.details.insert(
                "metrics before".into(),
                format!("{:.1} s before the report", at.elapsed().as_secs_f64()),
            );
        }
        i.config.extend(self.config.clone());
        if let Err(e) = self.reporter.report(i) {
            tracing::warn!(error = %e, "an incident report could not be written");
        }
    }

    /// Once a second: keeps the figures a report shows as "before", and writes the
    /// repeats of open reports.
    pub(crate) fn tick(&self) {
        let (now, counts) = self.now();
        *self.before.lock().unwrap_or_else(PoisonError::into_inner) =
            Some((Instant::now(), now, counts));
        if let Err(e) = self.reporter.tick() {
            tracing::warn!(error = %e, "incident reports: repeats not written");
        }
    }

    /// The host tier's callback: a page loaded back from the mirror failed its checksum.
    /// The engine recomputes its tokens, so the request is not harmed; the page was
    /// corrupted in host memory, and the report says which and how.
    pub(crate) fn on_corrupt(self: &Arc<Self>) -> pdmesh_cache_client::OnCorrupt {
        let me = self.clone();
        Arc::new(move |c: pdmesh_cache_client::client::Corrupt| {
            me.load_failures.fetch_add(1, Ordering::Relaxed);
            let mut i = Incident::new(
                Kind::Checksum,
                format!(
                    "A prefix page this worker loaded back from the host mirror (hash \
                     {:#018x}, mirror slot {}) did not match the checksum recorded when it \
                     was stored: its bytes changed in host memory. The page and the rest \
                     of its run were not used: the engine recomputed those tokens, so no \
                     answer was affected, and the cache service was told to discard the \
                     page.",
                    c.hash, c.slot
                ),
                me.place("host load-back"),
            );
            i.pages.push(PageCheck {
                page: format!("hash {:#018x}, slot {}", c.hash, c.slot),
                expected: format!("{:#018x}", c.expected),
                found: format!("{:#018x}", c.found),
            });
            me.file(i);
        })
    }
}

/// A request whose hand-over failed, as a report names it.
pub(crate) struct Handed<'a> {
    pub req: &'a pdmesh_engine::GenRequest,
    pub trace_id: &'a str,
    pub room: u64,
}

/// A page of a hand-over whose bytes are not the engine's: its index among the pages
/// that travelled, its mirror slot, the engine's checksum and the one found. The decode
/// side's `fill` fails with it, and reads it back from the engine's error by type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "page {index} (mirror slot {slot}) does not match its checksum: {found:#018x}, committed {expected:#018x}"
)]
pub(crate) struct BadPage {
    pub index: usize,
    pub slot: u32,
    pub expected: u64,
    pub found: u64,
}

impl Incidents {
    /// A hand-over's pages failed their checksums at `stage` (`hand-over write` on the
    /// prefill, `hand-over read` on the decode). `layouts`: the engine's and the buffer's
    /// the pages went through, when this side knows both.
    pub(crate) fn handover_checksum(
        &self,
        stage: &str,
        h: &Handed<'_>,
        (bad, of): (&[BadPage], usize),
        layouts: Option<pdmesh_incident::LayoutPair>,
        summary: String,
    ) {
        let mut place = self.place(stage);
        place.room = Some(h.room);
        place.request_id = h.req.id.clone();
        place.trace_id = h.trace_id.to_owned();
        let mut i = Incident::new(Kind::Checksum, summary, place);
        i.pages = bad
            .iter()
            .map(|b| PageCheck {
                page: format!("page {} of {of} (mirror slot {})", b.index, b.slot),
                expected: format!("{:#018x}", b.expected),
                found: format!("{:#018x}", b.found),
            })
            .collect();
        i.details
            .insert("pages failing".into(), format!("{} of {of}", bad.len()));
        i.layouts = layouts;
        i.replay = Some(replay(h.req));
        self.file(i);
    }
}

/// A request as `/v1/completions` takes it: its prompt's token ids and its sampling, so
/// the same tokens come back from a healthy mesh (greedy, or with its seed).
pub(crate) fn replay(req: &pdmesh_engine::GenRequest) -> pdmesh_incident::Replay {
    let p = &req.params;
    let mut body = serde_json::json!({
        "prompt": req.prompt,
        "temperature": p.temperature,
        "top_p": p.top_p,
    });
    if let Some(n) = p.max_tokens {
        body["max_tokens"] = n.into();
    }
    if let Some(seed) = p.seed {
        body["seed"] = seed.into();
    }
    if p.ignore_eos {
        body["ignore_eos"] = true.into();
    }
    pdmesh_incident::Replay {
        body,
        prompt_token_ids: req.prompt.clone(),
        command: String::new(),
    }
}

/// The figures before (if a tick has run) and now.
fn deltas(before: Option<(Figures, Counts)>, (f, c): (Figures, Counts)) -> Vec<MetricDelta> {
    let rows = |f: Figures, c: Counts| {
        [
            ("hand-overs under way", f.handovers as f64),
            ("oldest hand-over, seconds", f.oldest_handover_seconds),
            ("hand-overs completed", f.transfers as f64),
            ("KV bytes handed over", f.transfer_bytes as f64),
            ("hand-overs failed", f.failed_transfers as f64),
            ("engine-loop stalls", c.stalls as f64),
            (
                "host pages failing their checksum on load",
                c.load_failures as f64,
            ),
        ]
    };
    let after = rows(f, c);
    let before = before.map(|(f, c)| rows(f, c));
    after
        .iter()
        .enumerate()
        .map(|(k, &(name, v))| MetricDelta {
            name: name.into(),
            before: before.map(|b| b[k].1),
            after: Some(v),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_shows_the_figures_at_the_last_tick_and_now() {
        let dir = tempfile::tempdir().unwrap();
        let inc = Incidents::from_flags(
            Some(dir.path()),
            (None, None, false),
            "prefill pid 1".into(),
            BTreeMap::from([("role".into(), "prefill".into())]),
        )
        .unwrap()
        .unwrap();
        let transfers = Arc::new(AtomicU64::new(3));
        let t = transfers.clone();
        inc.set_source(move || Figures {
            transfers: t.load(Ordering::Relaxed),
            ..Default::default()
        });
        inc.tick();
        transfers.store(5, Ordering::Relaxed);
        (inc.on_corrupt())(pdmesh_cache_client::client::Corrupt {
            hash: 0xab,
            slot: 7,
            expected: 1,
            found: 2,
        });
        let all = pdmesh_incident::list(dir.path()).unwrap();
        assert_eq!(all.len(), 1);
        let i = &all[0];
        assert_eq!(
            (i.kind, i.place.stage.as_str()),
            (Kind::Checksum, "host load-back")
        );
        assert_eq!(
            i.pages,
            [PageCheck {
                page: "hash 0x00000000000000ab, slot 7".into(),
                expected: "0x0000000000000001".into(),
                found: "0x0000000000000002".into(),
            }]
        );
        let row = |name: &str| i.metrics.iter().find(|m| m.name == name).unwrap().clone();
        let done = row("hand-overs completed");
        assert_eq!((done.before, done.after), (Some(3.0), Some(5.0)));
        let loads = row("host pages failing their checksum on load");
        assert_eq!((loads.before, loads.after), (Some(0.0), Some(1.0)));
        assert_eq!(i.config["role"], "prefill");
    }
}

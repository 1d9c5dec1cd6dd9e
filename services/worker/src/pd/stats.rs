//! What the disaggregated path counts: transfers, their bytes and failures by reason, the
//! hand-overs under way and their ages (for ModelInfo, the drain and incident reports), and
//! the span events that mark a transfer's start and end.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::Pd;
use super::error::PdError;
use crate::incidents::Figures;
use pdmesh_telemetry::KeyValue;
use pdmesh_telemetry::labels::TransferFailure;

/// Transfer counters since the worker started.
#[derive(Clone, Debug, Default)]
pub(crate) struct PdStats {
    pub pages: u64,
    pub bytes: u64,
    pub seconds: f64,
    /// Requests that failed in transfer, by reason.
    pub failures: HashMap<TransferFailure, u64>,
    pub admission_timeouts: u64,
    /// Hand-overs completed.
    pub transfers: u64,
    /// Hand-overs under way now, and the oldest one's age in seconds.
    pub handovers: usize,
    pub handover_oldest_seconds: f64,
}

/// A hand-over under way, counted until dropped (however the request ends).
pub(super) struct Handover {
    pd: Arc<Pd>,
    key: u64,
}

impl Drop for Handover {
    fn drop(&mut self) {
        self.pd
            .handovers
            .lock()
            .expect("handovers lock")
            .remove(&self.key);
    }
}

/// A transfer started or ended: its pages and bytes, and at the end the copy's seconds.
/// `held`: the prompt's leading pages decode held already, which did not move.
pub(super) fn transfer_event(
    name: &'static str,
    (pages, held): (usize, usize),
    page_bytes: usize,
    seconds: Option<f64>,
) {
    let mut attrs = vec![
        KeyValue::new("pdmesh.pages", pages as i64),
        KeyValue::new("pdmesh.pages_held", held as i64),
        KeyValue::new("pdmesh.bytes", (pages * page_bytes) as i64),
    ];
    if let Some(s) = seconds {
        attrs.push(KeyValue::new("pdmesh.seconds", s));
    }
    pdmesh_telemetry::event(&tracing::Span::current(), name, attrs);
}

impl Pd {
    /// This worker's hand-over figures, for incident reports.
    pub(crate) fn figures(&self) -> Figures {
        let st = self.stats();
        Figures {
            handovers: st.handovers,
            oldest_handover_seconds: st.handover_oldest_seconds,
            transfers: st.transfers,
            transfer_bytes: st.bytes,
            failed_transfers: st.failures.values().sum(),
        }
    }

    pub(super) fn handover(self: &Arc<Self>) -> Handover {
        let key = self
            .next_handover
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.handovers
            .lock()
            .expect("handovers lock")
            .insert(key, Instant::now());
        Handover {
            pd: self.clone(),
            key,
        }
    }

    pub(crate) fn stats(&self) -> PdStats {
        let mut st = self.stats.lock().expect("pd stats").clone();
        let handovers = self.handovers.lock().expect("handovers lock");
        st.handovers = handovers.len();
        st.handover_oldest_seconds = handovers
            .values()
            .map(|t| t.elapsed().as_secs_f64())
            .fold(0.0, f64::max);
        st
    }

    /// A hand-over moved `pages` (decode held `held` more) of `page_bytes` each in `secs`:
    /// counted, and its end marked on the request's span.
    pub(super) fn transferred(&self, (pages, held): (usize, usize), page_bytes: usize, secs: f64) {
        {
            let mut st = self.stats.lock().expect("pd stats");
            st.pages += pages as u64;
            st.bytes += (pages * page_bytes) as u64;
            st.seconds += secs;
            st.transfers += 1;
        }
        transfer_event(
            "kv_cache_transfer_end",
            (pages, held),
            page_bytes,
            Some(secs),
        );
    }

    pub(super) fn fail(&self, e: &PdError) {
        let mut st = self.stats.lock().expect("pd stats");
        let why = e.failure();
        *st.failures.entry(why).or_default() += 1;
        if why == TransferFailure::Admission {
            st.admission_timeouts += 1;
        }
    }
}

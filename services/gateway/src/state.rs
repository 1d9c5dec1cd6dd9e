//! State shared by every handler: configuration, backend clients, metrics, and the
//! worker's model facts (fetched once, on first need, since the worker may still be
//! loading when the gateway starts).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use crate::clients::{Backends, OutputFormat, WorkerInfo};
use crate::config::Config;
use crate::error::{ApiError, Error};
use crate::metrics::Metrics;

/// Cheap to clone; everything lives behind one `Arc`.
#[derive(Clone)]
pub(crate) struct AppState(Arc<Inner>);

/// The metrics' figures a report shows (`Metrics::figures`).
type Figures = Vec<(&'static str, f64)>;

pub(crate) struct Inner {
    pub cfg: Config,
    pub backends: Backends,
    pub metrics: Metrics,
    /// Ends the open streams ("shutting down"): cancelled when the drain is over.
    pub shutdown: CancellationToken,
    /// Set at SIGTERM: `/health` says `draining` (503) so no new traffic comes here.
    pub draining: std::sync::atomic::AtomicBool,
    /// Requests inside a handler (reading the body, tokenizing, starting on a worker):
    /// the drain waits for them as for open streams.
    pub handling: std::sync::atomic::AtomicUsize,
    /// One permit per generating request, held until its answer has been sent
    /// (`--max-concurrent-requests`); none left: shed with 503.
    pub admission: Arc<tokio::sync::Semaphore>,
    /// Unix time the gateway started: the `created` of `/v1/models`.
    pub started: u64,
    /// Incident reports (`--incident-dir`).
    pub incidents: Option<pdmesh_incident::Reporter>,
    /// The metrics' figures at the last second's tick (a report's "before"), and when.
    figures_before: std::sync::Mutex<Option<(std::time::Instant, Figures)>>,
    host: String,
    info: OnceCell<WorkerInfo>,
    output: OnceCell<OutputFormat>,
    /// The tokenizer loaded from `--model`, with its fingerprint.
    local: Option<(pdmesh_tokenize::TextTokenizer, String)>,
    /// Whether `local` matches the tokenizer service (decided once it answers).
    local_matches: OnceCell<bool>,
}

impl std::ops::Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl AppState {
    /// Counts `i` and, with `--incident-dir`, files its report (see `pdmesh_incident`):
    /// the gateway's host, its configuration (secrets replaced) and where to find the
    /// report are filled in here.
    /// Keeps the metrics' figures as a report's "before" (once a second).
    pub fn keep_figures(&self) {
        *self
            .figures_before
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some((std::time::Instant::now(), self.metrics.figures()));
    }

    pub fn incident(&self, mut i: pdmesh_incident::Incident) {
        self.metrics.incident(i.kind);
        let Some(r) = &self.incidents else {
            return;
        };
        i.place.service = "gateway".into();
        i.place.host = self.host.clone();
        let before = self
            .figures_before
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let now = self.metrics.figures();
        i.metrics = now
            .iter()
            .enumerate()
            .map(|(k, &(name, v))| pdmesh_incident::MetricDelta {
                name: name.into(),
                before: before.as_ref().map(|(_, b)| b[k].1),
                after: Some(v),
            })
            .collect();
        if let Some((at, _)) = before {
            i.details.insert(
                "metrics before".into(),
                format!("{:.1} s before the report", at.elapsed().as_secs_f64()),
            );
        }
        let c = &self.cfg;
        for (k, v) in [
            ("worker_url", c.worker_url.clone()),
            ("prefill_url", c.prefill_url.join(",")),
            ("decode_url", c.decode_url.join(",")),
            ("prefill_dns", c.prefill_dns.join(",")),
            ("decode_dns", c.decode_dns.join(",")),
            ("cache_url", c.cache_url.join(",")),
            ("model_name", c.model_name.clone().unwrap_or_default()),
            ("api_key", c.api_key.clone().unwrap_or_default()),
            ("include_prompts", c.incident_include_prompts.to_string()),
        ] {
            i.config.insert(k.into(), v);
        }
        if let Err(e) = r.report(i) {
            tracing::warn!(error = %e, "an incident report could not be written");
        }
    }
    pub fn new(
        cfg: Config,
        backends: Backends,
        local: Option<pdmesh_tokenize::TextTokenizer>,
        shutdown: CancellationToken,
    ) -> Result<Self, Error> {
        let admission = Arc::new(tokio::sync::Semaphore::new(cfg.max_concurrent_requests));
        let incidents = pdmesh_incident::Reporter::from_flags(
            cfg.incidents.dir.as_deref(),
            cfg.incidents.trace_link.clone(),
            cfg.incident_replay_url.clone(),
            cfg.incident_include_prompts,
        )
        .map_err(|e| Error::Config(e.to_string()))?;
        Ok(Self(Arc::new(Inner {
            incidents,
            figures_before: Default::default(),
            host: pdmesh_incident::hostname(),
            cfg,
            backends,
            metrics: Metrics::new()?,
            shutdown,
            draining: Default::default(),
            handling: Default::default(),
            admission,
            started: unix_now(),
            info: OnceCell::new(),
            output: OnceCell::new(),
            local: local.map(|t| {
                let fp = t.fingerprint();
                (t, fp)
            }),
            local_matches: OnceCell::new(),
        })))
    }

    /// The model's facts, from the first worker that answers; a 503 while none can be
    /// reached.
    pub async fn worker_info(&self) -> Result<&WorkerInfo, ApiError> {
        self.info
            .get_or_try_init(|| self.backends.model_facts())
            .await
    }

    /// The markup the model writes (tool calls, reasoning), from the tokenizer.
    pub async fn output_format(&self) -> Result<OutputFormat, ApiError> {
        self.output
            .get_or_try_init(|| self.backends.output_format())
            .await
            .copied()
    }

    /// The tokenizer to detokenize with in this process: `--model`'s, once the tokenizer
    /// service's fingerprint is known to equal it. A different one (another model, another
    /// revision) is never used, loudly: text from the wrong vocabulary would be silent
    /// corruption. Until the service answers, nothing local is used.
    pub async fn local_tokenizer(&self) -> Option<&pdmesh_tokenize::TextTokenizer> {
        let (tok, fp) = self.local.as_ref()?;
        let matches = self
            .local_matches
            .get_or_try_init(|| async {
                let theirs = self.backends.tokenizer_fingerprint().await?;
                let same = &theirs == fp;
                if same {
                    tracing::info!("detokenizing in the gateway: --model's tokenizer equals the tokenizer service's");
                } else {
                    tracing::error!(
                        ours = %fp,
                        theirs = %theirs,
                        "--model's tokenizer differs from the tokenizer service's: detokenizing through the service instead"
                    );
                }
                Ok::<bool, ApiError>(same)
            })
            .await
            .ok()?;
        matches.then_some(tok)
    }

    /// The model name clients must send.
    pub async fn served_model(&self) -> Result<String, ApiError> {
        match &self.cfg.model_name {
            Some(name) => Ok(name.clone()),
            None => Ok(self.worker_info().await?.model_id.clone()),
        }
    }

    /// A 404 unless `model` is the served model.
    pub async fn check_model(&self, model: &str) -> Result<String, ApiError> {
        let served = self.served_model().await?;
        if model == served {
            Ok(served)
        } else {
            Err(ApiError::model_not_found(model))
        }
    }
}

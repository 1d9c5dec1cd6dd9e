//! The gateway's Prometheus metrics, in a registry of their own (so several gateways can
//! live in one test process). Label values come from closed sets only, and every series
//! of a closed set exists (at 0) from the start, so a counter's first event is an
//! increase a dashboard or an `increase(...) > 0` alert sees, not a new series. Only the
//! router's per-worker gauges are open: they appear with their worker.

use pdmesh_telemetry::label_set;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry,
};

pub(crate) mod disk;
pub(crate) mod pd;

use self::pd::{PdMetrics, WorkerTotals};
use crate::error::ErrorType;

label_set! {
    /// Routes, as metric labels (`mesh_requests_total{endpoint}`).
    pub(crate) enum Endpoint {
        ChatCompletions => "chat_completions",
        Completions => "completions",
        Models => "models",
        Health => "health",
        Metrics => "metrics",
        FlushCache => "flush_cache",
        Messages => "messages",
        Responses => "responses",
        Incidents => "incidents",
        Tokenize => "tokenize",
        Other => "other",
    }
}

label_set! {
    /// HTTP status codes, as metric labels: the codes the gateway answers, and a class
    /// for any other.
    pub(crate) enum StatusLabel {
        Ok => "200",
        BadRequest => "400",
        Unauthorized => "401",
        NotFound => "404",
        MethodNotAllowed => "405",
        PayloadTooLarge => "413",
        TooManyRequests => "429",
        Internal => "500",
        Unavailable => "503",
        GatewayTimeout => "504",
        Other2xx => "2xx",
        Other4xx => "4xx",
        Other5xx => "5xx",
    }
}

label_set! {
    /// Request stages (`mesh_request_stage_seconds{stage}`): tokenize (here), queue,
    /// prefill, transfer, decode (the workers' report).
    pub(crate) enum Stage {
        Tokenize => "tokenize",
        Queue => "queue",
        Prefill => "prefill",
        Transfer => "transfer",
        Decode => "decode",
    }
}

label_set! {
    /// Where a prompt token's KV came from (`mesh_prompt_token_sources_total{source}`).
    enum PromptSource {
        Computed => "computed",
        Device => "device",
        Host => "host",
        Transferred => "transferred",
    }
}

/// Cache tiers (`tier` labels).
/// Hits and evictions: the disk tier's too (a disk hit is also a host hit: its pages
/// were promoted into the host mirror for the match that found them).
const EVERY_TIER: &[&str] = &["device", "host", "disk"];
const HOST: &[&str] = &["host"];
/// Counters summed over every worker (`side` labels).
const ALL_SIDES: &[&str] = &["all"];
/// Both ends of a KV hand-over.
const PREFILL_AND_DECODE: &[&str] = &["prefill", "decode"];
/// The cache service's room-age thresholds, in seconds (`mesh_rooms_older_than`).
pub(crate) const ROOM_AGE_THRESHOLDS: &[&str] = &["1", "5", "30", "120"];
/// The label value of a worker's total under a name outside its family's closed set.
const OTHER: &str = "other";

/// Every metric the gateway exports.
pub(crate) struct Metrics {
    registry: Registry,
    /// The other services' incident counts as last read, by service (its role and URL)
    /// and kind.
    incidents_read:
        std::sync::Mutex<std::collections::HashMap<(String, pdmesh_incident::Kind), u64>>,
    requests: IntCounterVec,
    duration: HistogramVec,
    pub generated_tokens: IntCounter,
    pub prompt_tokens: IntCounter,
    pub cached_prompt_tokens: IntCounter,
    errors: IntCounterVec,
    parse_failures: IntCounterVec,
    incidents: IntCounterVec,
    pub kv_pages_free: IntGauge,
    pub kv_pages_capacity: IntGauge,
    /// 1 when this scrape read every worker's state, else 0 (the worker gauges are then
    /// from an earlier scrape).
    pub workers_read: IntGauge,
    /// 1 when this scrape read every host's cache service.
    pub caches_read: IntGauge,
    /// 1 when a worker runs test-only fault injection (`--fault-*`), else 0.
    pub fault_injection_enabled: IntGauge,
    /// Internal calls refused for their mesh credential, by the service that refused them.
    pub auth_refused: WorkerTotals,
    /// 1 for each kind of service running with --insecure-plaintext.
    pub insecure_plaintext: prometheus::IntGaugeVec,
    pub kv_pages_cached: IntGauge,
    /// Cache counters the worker keeps since it started, mirrored at each scrape.
    pub kv_evictions: WorkerTotals,
    pub kv_hit_tokens: WorkerTotals,
    pub kv_load_back_bytes: WorkerTotals,
    pub kv_load_back_seconds: WorkerTotals,
    pub kv_write_back_bytes: WorkerTotals,
    pub kv_checksum_failures: WorkerTotals,
    /// Pages offered to the host tier's store queue while it was full (never written).
    pub kv_write_back_dropped_pages: WorkerTotals,
    /// Pages in the workers' host-tier store queues now.
    pub kv_write_back_queued_pages: IntGauge,
    /// Admitted requests whose prompt pages are being fetched from the host tier now.
    pub kv_host_fetching_requests: IntGauge,
    /// The cache service's host mirror, read at scrape.
    pub host_mirror_pages: prometheus::IntGaugeVec,
    pub host_mirror_leases: IntGauge,
    pub host_mirror_expired_leases: WorkerTotals,
    pub host_mirror_commit_rejections: WorkerTotals,
    pub stream_duration: Histogram,
    /// From the request to the first generated token reaching the gateway.
    pub ttft: Histogram,
    /// Between consecutive generated tokens reaching the gateway.
    pub itl: Histogram,
    /// Seconds per request stage: tokenize (here), queue, prefill, transfer, decode (the
    /// workers' report).
    stage_seconds: HistogramVec,
    /// Prompt tokens by where their KV came from.
    prompt_token_sources: IntCounterVec,
    /// How late the gateway's runtime wakes a timer (a busy or blocked event loop).
    pub event_loop_delay: Histogram,
    /// Generated tokens by where they were turned into text: `gateway` (in process, the
    /// same tokenizer as the tokenizer service's) or `tokenizer` (its Detokenize stream).
    pub detokenized_tokens: IntCounterVec,
    pub kv_write_back_seconds: WorkerTotals,
    /// Engine steps (the watchdogs' progress counter) and the longest wait for one.
    pub engine_steps: WorkerTotals,
    pub engine_idle_seconds: prometheus::Gauge,
    /// Prefill/decode disaggregation: rooms at the cache service, transfers at the workers.
    pub pd: PdMetrics,
    pub disk: disk::DiskMetrics,
}

/// Routes, as metric labels.
pub(crate) fn endpoint_label(path: &str) -> Endpoint {
    match path {
        "/v1/chat/completions" => Endpoint::ChatCompletions,
        "/v1/completions" => Endpoint::Completions,
        "/v1/models" | "/v1/models/{model}" => Endpoint::Models,
        "/health" => Endpoint::Health,
        "/metrics" => Endpoint::Metrics,
        "/flush_cache" => Endpoint::FlushCache,
        "/v1/messages" => Endpoint::Messages,
        "/v1/responses" | "/v1/responses/{id}" => Endpoint::Responses,
        "/debug/incidents" | "/debug/incidents/{id}" => Endpoint::Incidents,
        "/tokenize" | "/detokenize" => Endpoint::Tokenize,
        _ => Endpoint::Other,
    }
}

/// HTTP status codes, as metric labels (the set of codes the gateway can answer).
pub(crate) fn status_label(code: u16) -> StatusLabel {
    match code {
        200 => StatusLabel::Ok,
        400 => StatusLabel::BadRequest,
        401 => StatusLabel::Unauthorized,
        404 => StatusLabel::NotFound,
        405 => StatusLabel::MethodNotAllowed,
        413 => StatusLabel::PayloadTooLarge,
        429 => StatusLabel::TooManyRequests,
        500 => StatusLabel::Internal,
        503 => StatusLabel::Unavailable,
        504 => StatusLabel::GatewayTimeout,
        c if c < 300 => StatusLabel::Other2xx,
        c if c < 500 => StatusLabel::Other4xx,
        _ => StatusLabel::Other5xx,
    }
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "mesh_requests_total",
                "HTTP requests answered, by endpoint and status code.",
            ),
            &["endpoint", "status"],
        )?;
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "mesh_request_duration_seconds",
                "Time from request to response headers (streams: see mesh_stream_duration_seconds).",
            )
            .buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]),
            &["endpoint"],
        )?;
        let stream_duration = Histogram::with_opts(
            HistogramOpts::new(
                "mesh_stream_duration_seconds",
                "Time from request to the end of an SSE stream.",
            )
            .buckets(vec![
                0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
            ]),
        )?;
        let ttft = Histogram::with_opts(
            HistogramOpts::new(
                "mesh_time_to_first_token_seconds",
                "Time from a request's arrival to its first generated token reaching the gateway (both endpoints).",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            ]),
        )?;
        let itl = Histogram::with_opts(
            HistogramOpts::new(
                "mesh_inter_token_latency_seconds",
                "Time between consecutive generated tokens of one request reaching the gateway.",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
        )?;
        let generated_tokens = IntCounter::new(
            "mesh_generated_tokens_total",
            "Completion tokens generated.",
        )?;
        let prompt_tokens =
            IntCounter::new("mesh_prompt_tokens_total", "Prompt tokens processed.")?;
        let cached_prompt_tokens = IntCounter::new(
            "mesh_cached_prompt_tokens_total",
            "Prompt tokens served from the prefix cache.",
        )?;
        let errors = IntCounterVec::new(
            Opts::new(
                "mesh_errors_total",
                "Requests that ended in an error, by class.",
            ),
            &["error_type"],
        )?;
        let kv_pages_free = IntGauge::new(
            "mesh_kv_pages_free",
            "Free KV pages in the worker's pool (read at scrape).",
        )?;
        let kv_pages_capacity =
            IntGauge::new("mesh_kv_pages_capacity", "KV pages in the worker's pool.")?;
        let workers_read = IntGauge::new(
            "mesh_workers_read",
            "1 when this scrape read every worker's state; 0 when one did not answer (the worker gauges are then stale).",
        )?;
        let caches_read = IntGauge::new(
            "mesh_caches_read",
            "1 when this scrape read every host's cache service; 0 when one did not answer (the cache gauges then leave it out).",
        )?;
        registry.register(Box::new(caches_read.clone()))?;
        let fault_injection_enabled = IntGauge::new(
            "mesh_fault_injection_enabled",
            "1 when a worker was started with test-only fault injection (--fault-* flags), which breaks requests on purpose; 0 otherwise (read at scrape).",
        )?;
        let auth_refused = WorkerTotals::labeled(
            &registry,
            "mesh_auth_refused_total",
            "Internal calls and page-transport connections refused for a missing or wrong mesh credential, or a certificate without the role the call needs, by the service that refused them (read at scrape).",
            "service",
            ["worker", "cache"],
        )?;
        let insecure_plaintext = prometheus::IntGaugeVec::new(
            Opts::new(
                "mesh_insecure_plaintext",
                "1 when a service runs with --insecure-plaintext: it serves without a mesh credential or beyond loopback in clear (read at scrape).",
            ),
            &["service"],
        )?;
        registry.register(Box::new(insecure_plaintext.clone()))?;
        for s in ["gateway", "worker", "cache"] {
            insecure_plaintext.with_label_values(&[s]);
        }
        let kv_pages_cached = IntGauge::new(
            "mesh_kv_pages_cached",
            "KV pages only the worker's prefix cache holds, evictable (read at scrape).",
        )?;
        let kv_evictions = WorkerTotals::new(
            &registry,
            "mesh_kv_cache_evictions_total",
            "Cached KV pages evicted to make room, by cache tier (host: spilled to the disk tier when there is one).",
            EVERY_TIER,
        )?;
        let kv_hit_tokens = WorkerTotals::new(
            &registry,
            "mesh_kv_cache_hit_tokens_total",
            "Prompt tokens served from a KV cache tier instead of computed, by tier (disk: promoted into the host mirror for that request, so also counted as host).",
            EVERY_TIER,
        )?;
        let kv_load_back_bytes = WorkerTotals::new(
            &registry,
            "mesh_kv_cache_load_back_bytes_total",
            "KV bytes loaded from the host tier into the device pool.",
            HOST,
        )?;
        let kv_load_back_seconds = WorkerTotals::new(
            &registry,
            "mesh_kv_cache_load_back_seconds_total",
            "Time spent loading KV pages from the host tier, checksums included.",
            HOST,
        )?;
        let kv_write_back_bytes = WorkerTotals::new(
            &registry,
            "mesh_kv_cache_write_back_bytes_total",
            "KV bytes written from the device pool to the host tier.",
            HOST,
        )?;
        let kv_write_back_dropped_pages = WorkerTotals::new(
            &registry,
            "mesh_kv_cache_write_back_dropped_pages_total",
            "KV pages offered to the host tier while the worker's store queue was full: never written (the engine never waits for a store).",
            HOST,
        )?;
        let kv_write_back_queued_pages = IntGauge::new(
            "mesh_kv_cache_write_back_queued_pages",
            "KV pages in the workers' host-tier store queues, not yet written.",
        )?;
        registry.register(Box::new(kv_write_back_queued_pages.clone()))?;
        let kv_host_fetching_requests = IntGauge::new(
            "mesh_kv_cache_host_fetching_requests",
            "Admitted requests whose prompt pages are being fetched from the host tier (they hold their pages; the engine runs the others meanwhile).",
        )?;
        registry.register(Box::new(kv_host_fetching_requests.clone()))?;
        let host_mirror_pages = prometheus::IntGaugeVec::new(
            Opts::new(
                "mesh_host_mirror_pages",
                "Pages of the cache service's host mirror, by state (total, used, pinned).",
            ),
            &["state"],
        )?;
        registry.register(Box::new(host_mirror_pages.clone()))?;
        let host_mirror_leases = IntGauge::new(
            "mesh_host_mirror_leases",
            "Workers holding a live lease at the cache service.",
        )?;
        registry.register(Box::new(host_mirror_leases.clone()))?;
        let host_mirror_expired_leases = WorkerTotals::new(
            &registry,
            "mesh_host_mirror_expired_leases_total",
            "Leases of workers that stopped heartbeating (their pins and reservations were freed).",
            HOST,
        )?;
        let host_mirror_commit_rejections = WorkerTotals::new(
            &registry,
            "mesh_host_mirror_commit_rejections_total",
            "Pages the cache service refused at commit because their bytes failed the checksum.",
            HOST,
        )?;
        let kv_checksum_failures = WorkerTotals::new(
            &registry,
            "mesh_kv_cache_checksum_failures_total",
            "Host-tier pages whose bytes failed their checksum on load (recomputed, never served).",
            HOST,
        )?;
        let kv_write_back_seconds = WorkerTotals::new(
            &registry,
            "mesh_kv_cache_write_back_seconds_total",
            "Time spent writing KV pages to the host tier, checksums included.",
            HOST,
        )?;
        let engine_steps = WorkerTotals::labeled(
            &registry,
            "mesh_engine_steps_total",
            "Engine loop steps, summed over workers (the watchdogs' progress counter).",
            "side",
            ALL_SIDES.iter().copied(),
        )?;
        let engine_idle_seconds = prometheus::Gauge::new(
            "mesh_engine_idle_seconds",
            "The longest any worker's engine loop has had work without a step (read at scrape).",
        )?;
        registry.register(Box::new(engine_idle_seconds.clone()))?;
        let stage_seconds = HistogramVec::new(
            HistogramOpts::new(
                "mesh_request_stage_seconds",
                "Time a request spent in each stage: tokenize (gateway), queue (waiting for admission), prefill (to the first token), transfer (first token to KV in the decode pool), decode (first token to last).",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0,
            ]),
            &["stage"],
        )?;
        registry.register(Box::new(stage_seconds.clone()))?;
        let prompt_token_sources = IntCounterVec::new(
            Opts::new(
                "mesh_prompt_token_sources_total",
                "Prompt tokens by where their KV came from: computed, device (prefix cache hit), host (host tier hit); transferred counts, besides, the tokens whose KV a prefill worker handed to a decode worker.",
            ),
            &["source"],
        )?;
        registry.register(Box::new(prompt_token_sources.clone()))?;
        let event_loop_delay = Histogram::with_opts(
            HistogramOpts::new(
                "mesh_event_loop_delay_seconds",
                "How late the gateway's async runtime runs a timer due every 100 ms (a busy or blocked event loop).",
            )
            .buckets(vec![
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
            ]),
        )?;
        registry.register(Box::new(event_loop_delay.clone()))?;
        let detokenized_tokens = IntCounterVec::new(
            Opts::new(
                "mesh_detokenized_tokens_total",
                "Generated tokens by where the gateway had them turned into text: gateway (in process, with a tokenizer whose fingerprint equals the tokenizer service's) or tokenizer (the tokenizer service's Detokenize stream).",
            ),
            &["place"],
        )?;
        registry.register(Box::new(detokenized_tokens.clone()))?;
        for place in ["gateway", "tokenizer"] {
            detokenized_tokens.with_label_values(&[place]);
        }
        let build_info = prometheus::IntGaugeVec::new(
            Opts::new(
                "mesh_build_info",
                "1, labeled with the pdmesh version this gateway was built from.",
            ),
            &["version"],
        )?;
        registry.register(Box::new(build_info.clone()))?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let pd = PdMetrics::new(&registry)?;
        let disk = disk::DiskMetrics::new(&registry)?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(stream_duration.clone()))?;
        registry.register(Box::new(ttft.clone()))?;
        registry.register(Box::new(itl.clone()))?;
        registry.register(Box::new(generated_tokens.clone()))?;
        registry.register(Box::new(prompt_tokens.clone()))?;
        registry.register(Box::new(cached_prompt_tokens.clone()))?;
        registry.register(Box::new(errors.clone()))?;
        let parse_failures = IntCounterVec::new(
            Opts::new(
                "mesh_tool_call_parse_failures_total",
                "Model outputs whose tool-call markup failed to parse (the request failed; nothing was shown as content), by parser and reason.",
            ),
            &["parser", "reason"],
        )?;
        registry.register(Box::new(parse_failures.clone()))?;
        let incidents = IntCounterVec::new(
            Opts::new(
                "mesh_incidents_total",
                "Failures the mesh filed an incident report for (repeats of one cause included), by kind: the gateway's own, and the workers' and cache services' as last read.",
            ),
            &["kind"],
        )?;
        registry.register(Box::new(incidents.clone()))?;
        for kind in pdmesh_incident::Kind::ALL {
            incidents.with_label_values(&[kind.name()]);
        }
        registry.register(Box::new(kv_pages_free.clone()))?;
        registry.register(Box::new(kv_pages_capacity.clone()))?;
        registry.register(Box::new(workers_read.clone()))?;
        registry.register(Box::new(fault_injection_enabled.clone()))?;
        registry.register(Box::new(kv_pages_cached.clone()))?;
        // Every series of each closed label set, at 0, before the first event.
        for endpoint in Endpoint::names() {
            for status in StatusLabel::names() {
                requests.with_label_values(&[endpoint, status]);
            }
            duration.with_label_values(&[endpoint]);
        }
        for error_type in ErrorType::names() {
            errors.with_label_values(&[error_type]);
        }
        for parser in pdmesh_chat::PARSERS.into_iter().chain([OTHER]) {
            for reason in pdmesh_chat::FAILURE_REASONS.into_iter().chain([OTHER]) {
                parse_failures.with_label_values(&[parser, reason]);
            }
        }
        for stage in Stage::names() {
            stage_seconds.with_label_values(&[stage]);
        }
        for source in PromptSource::names() {
            prompt_token_sources.with_label_values(&[source]);
        }
        for state in ["total", "used", "pinned"] {
            host_mirror_pages.with_label_values(&[state]);
        }
        Ok(Self {
            registry,
            incidents_read: Default::default(),
            requests,
            duration,
            generated_tokens,
            prompt_tokens,
            cached_prompt_tokens,
            errors,
            parse_failures,
            incidents,
            kv_pages_free,
            kv_pages_capacity,
            workers_read,
            caches_read,
            fault_injection_enabled,
            auth_refused,
            insecure_plaintext,
            kv_pages_cached,
            kv_evictions,
            kv_hit_tokens,
            kv_load_back_bytes,
            kv_load_back_seconds,
            kv_write_back_bytes,
            kv_checksum_failures,
            kv_write_back_dropped_pages,
            kv_write_back_queued_pages,
            kv_host_fetching_requests,
            host_mirror_pages,
            host_mirror_leases,
            host_mirror_expired_leases,
            host_mirror_commit_rejections,
            stream_duration,
            ttft,
            itl,
            stage_seconds,
            prompt_token_sources,
            event_loop_delay,
            detokenized_tokens,
            kv_write_back_seconds,
            engine_steps,
            engine_idle_seconds,
            pd,
            disk,
        })
    }

    pub fn observe_request(&self, endpoint: Endpoint, status: u16, seconds: f64) {
        self.requests
            .with_label_values(&[endpoint.name(), status_label(status).name()])
            .inc();
        self.duration
            .with_label_values(&[endpoint.name()])
            .observe(seconds);
    }

    /// One request stage's duration.
    pub fn stage(&self, stage: Stage, seconds: f64) {
        self.stage_seconds
            .with_label_values(&[stage.name()])
            .observe(seconds);
    }

    /// A finished request's prompt tokens by source.
    pub fn prompt_sources(&self, computed: u32, device: u32, host: u32, transferred: u32) {
        for (source, n) in [
            (PromptSource::Computed, computed),
            (PromptSource::Device, device),
            (PromptSource::Host, host),
            (PromptSource::Transferred, transferred),
        ] {
            self.prompt_token_sources
                .with_label_values(&[source.name()])
                .inc_by(u64::from(n));
        }
    }

    /// One request that ended in an error of this class.
    pub fn error(&self, error_type: ErrorType) {
        self.errors.with_label_values(&[error_type.name()]).inc();
    }

    /// The incident counts `service` (`worker`, the workers summed, or `cache`) reported
    /// since it started: what grew since the last read is added to
    /// `mesh_incidents_total` (all of it after a restart, when the count fell). Kinds
    /// this gateway does not know are left out.
    pub fn remote_incidents<'a>(
        &self,
        service: &str,
        counts: impl IntoIterator<Item = (&'a String, &'a u64)>,
    ) {
        let mut seen = self.incidents_read.lock().expect("metrics lock");
        for (name, &total) in counts {
            let Some(kind) = pdmesh_incident::Kind::ALL
                .into_iter()
                .find(|k| k.name() == name)
            else {
                continue;
            };
            let last = seen.insert((service.to_owned(), kind), total).unwrap_or(0);
            let new = if total >= last { total - last } else { total };
            self.incidents.with_label_values(&[kind.name()]).inc_by(new);
        }
    }

    /// The figures an incident report shows before and after: request failures by the
    /// classes a mesh failure shows as, parse failures, tokens, first tokens, the free
    /// KV pages at the last scrape, and failures reported.
    pub fn figures(&self) -> Vec<(&'static str, f64)> {
        let failed = |t: ErrorType| self.errors.with_label_values(&[t.name()]).get() as f64;
        let parse: u64 = pdmesh_chat::PARSERS
            .iter()
            .chain([&OTHER])
            .flat_map(|p| {
                pdmesh_chat::FAILURE_REASONS
                    .iter()
                    .chain([&OTHER])
                    .map(move |r| (*p, *r))
            })
            .map(|(p, r)| self.parse_failures.with_label_values(&[p, r]).get())
            .sum();
        let reported: u64 = pdmesh_incident::Kind::ALL
            .iter()
            .map(|k| self.incidents.with_label_values(&[k.name()]).get())
            .sum();
        vec![
            (
                "requests failed: backend_error",
                failed(ErrorType::BackendError),
            ),
            (
                "requests failed: backend_unavailable",
                failed(ErrorType::BackendUnavailable),
            ),
            (
                "requests failed: unparsable_output",
                failed(ErrorType::UnparsableOutput),
            ),
            ("requests failed: timeout", failed(ErrorType::Timeout)),
            ("tool-call outputs that failed to parse", parse as f64),
            ("first tokens", self.ttft.get_sample_count() as f64),
            ("tokens generated", self.generated_tokens.get() as f64),
            (
                "KV pages free (last scrape)",
                self.kv_pages_free.get() as f64,
            ),
            ("failures reported (every kind)", reported as f64),
        ]
    }

    /// One failure an incident report was (or, without `--incident-dir`, would have
    /// been) filed for.
    pub fn incident(&self, kind: pdmesh_incident::Kind) {
        self.incidents.with_label_values(&[kind.name()]).inc();
    }

    /// One output that failed to parse; labels outside the parsers' closed sets read
    /// `other`.
    pub fn parse_failure(&self, parser: &str, reason: &str) {
        let known =
            |s: &str, set: &[&'static str]| set.iter().copied().find(|k| *k == s).unwrap_or(OTHER);
        let labels = [
            known(parser, &pdmesh_chat::PARSERS),
            known(reason, &pdmesh_chat::FAILURE_REASONS),
        ];
        self.parse_failures.with_label_values(&labels).inc();
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding into a Vec cannot fail for well-formed metrics.
        if let Err(e) = prometheus::TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        String::from_utf8_lossy(&buf).into_owned()
    }
}

#[cfg(test)]
mod tests;

//! The gateway's Prometheus metrics, in a registry of their own (so several gateways can
//! live in one test process). Label values come from closed sets only.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry,
};

/// Every metric the gateway exports.
pub(crate) struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    duration: HistogramVec,
    pub generated_tokens: IntCounter,
    pub prompt_tokens: IntCounter,
    pub cached_prompt_tokens: IntCounter,
    errors: IntCounterVec,
    pub kv_pages_free: IntGauge,
    pub kv_pages_total: IntGauge,
    pub kv_pages_cached: IntGauge,
    kv_evictions: IntCounterVec,
    /// The worker's eviction count at the last scrape: the counter grows by the difference.
    evictions_seen: std::sync::atomic::AtomicU64,
    pub stream_duration: Histogram,
}

/// Routes, as metric labels.
pub(crate) fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "chat_completions",
        "/v1/completions" => "completions",
        "/v1/models" | "/v1/models/{model}" => "models",
        "/health" => "health",
        "/metrics" => "metrics",
        _ => "other",
    }
}

/// HTTP status codes, as metric labels (the set of codes the gateway can answer).
pub(crate) fn status_label(code: u16) -> &'static str {
    match code {
        200 => "200",
        400 => "400",
        401 => "401",
        404 => "404",
        405 => "405",
        413 => "413",
        429 => "429",
        500 => "500",
        503 => "503",
        504 => "504",
        c if c < 300 => "2xx",
        c if c < 500 => "4xx",
        _ => "5xx",
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
        let kv_pages_total =
            IntGauge::new("mesh_kv_pages_total", "KV pages in the worker's pool.")?;
        let kv_pages_cached = IntGauge::new(
            "mesh_kv_pages_cached",
            "KV pages only the worker's prefix cache holds, evictable (read at scrape).",
        )?;
        let kv_evictions = IntCounterVec::new(
            Opts::new(
                "mesh_kv_cache_evictions_total",
                "Cached KV pages evicted to make room, by cache tier.",
            ),
            &["tier"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(stream_duration.clone()))?;
        registry.register(Box::new(generated_tokens.clone()))?;
        registry.register(Box::new(prompt_tokens.clone()))?;
        registry.register(Box::new(cached_prompt_tokens.clone()))?;
        registry.register(Box::new(errors.clone()))?;
        registry.register(Box::new(kv_pages_free.clone()))?;
        registry.register(Box::new(kv_pages_total.clone()))?;
        registry.register(Box::new(kv_pages_cached.clone()))?;
        registry.register(Box::new(kv_evictions.clone()))?;
        Ok(Self {
            registry,
            requests,
            duration,
            generated_tokens,
            prompt_tokens,
            cached_prompt_tokens,
            errors,
            kv_pages_free,
            kv_pages_total,
            kv_pages_cached,
            kv_evictions,
            evictions_seen: Default::default(),
            stream_duration,
        })
    }

    /// The worker's cumulative device-tier evictions, as read at a scrape. A count lower
    /// than the last one means the worker restarted: all of it is new.
    pub fn observe_device_evictions(&self, total: u64) {
        use std::sync::atomic::Ordering;
        let last = self.evictions_seen.swap(total, Ordering::Relaxed);
        let new = if total >= last { total - last } else { total };
        self.kv_evictions.with_label_values(&["device"]).inc_by(new);
    }

    pub fn observe_request(&self, endpoint: &'static str, status: u16, seconds: f64) {
        self.requests
            .with_label_values(&[endpoint, status_label(status)])
            .inc();
        self.duration
            .with_label_values(&[endpoint])
            .observe(seconds);
    }

    /// `error_type` is an [`crate::error::ApiError::error_type`] (a closed set).
    pub fn error(&self, error_type: &'static str) {
        self.errors.with_label_values(&[error_type]).inc();
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
mod tests {
    use super::*;

    #[test]
    fn exposition_has_the_documented_names_and_labels() {
        let m = Metrics::new().unwrap();
        m.observe_request("chat_completions", 200, 0.1);
        m.error("invalid_request");
        m.generated_tokens.inc_by(5);
        let text = m.render();
        assert!(
            text.contains(r#"mesh_requests_total{endpoint="chat_completions",status="200"} 1"#),
            "{text}"
        );
        assert!(
            text.contains("mesh_request_duration_seconds_bucket"),
            "{text}"
        );
        assert!(
            text.contains(r#"mesh_errors_total{error_type="invalid_request"} 1"#),
            "{text}"
        );
        assert!(text.contains("mesh_generated_tokens_total 5"), "{text}");
        assert!(text.contains("mesh_kv_pages_free"), "{text}");
    }

    #[test]
    fn device_evictions_count_differences_and_survive_a_worker_restart() {
        let m = Metrics::new().unwrap();
        let count = |m: &Metrics| m.kv_evictions.with_label_values(&["device"]).get();
        m.observe_device_evictions(7);
        m.observe_device_evictions(10);
        assert_eq!(count(&m), 10);
        m.observe_device_evictions(2); // the worker restarted and evicted 2 since
        assert_eq!(count(&m), 12);
        assert!(
            m.render()
                .contains(r#"mesh_kv_cache_evictions_total{tier="device"} 12"#)
        );
    }

    #[test]
    fn unknown_paths_and_codes_fall_into_closed_buckets() {
        assert_eq!(endpoint_label("/admin/secret/123"), "other");
        assert_eq!(status_label(418), "4xx");
        assert_eq!(status_label(502), "5xx");
    }
}

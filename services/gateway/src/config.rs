//! The gateway's configuration (flags and environment), checked before it serves.

use crate::error::Error;
use crate::route;

/// Configuration of the gateway.
#[derive(Clone, Debug, clap::Args)]
pub struct Config {
    /// gRPC address of the tokenizer service.
    #[arg(
        long,
        env = "PDMESH_TOKENIZER_URL",
        default_value = "http://127.0.0.1:50061"
    )]
    pub tokenizer_url: String,
    /// gRPC address of the worker service.
    #[arg(
        long,
        env = "PDMESH_WORKER_URL",
        default_value = "http://127.0.0.1:50062"
    )]
    pub worker_url: String,
    /// Prefill workers (repeat the flag or separate with commas). With --decode-url,
    /// requests are disaggregated and --worker-url is not used.
    #[arg(long, env = "PDMESH_PREFILL_URL", value_delimiter = ',')]
    pub prefill_url: Vec<String>,
    /// Decode workers (repeat the flag or separate with commas).
    #[arg(long, env = "PDMESH_DECODE_URL", value_delimiter = ',')]
    pub decode_url: Vec<String>,
    /// Prefill workers found through DNS: `name:port` (repeat the flag or separate with
    /// commas), looked up every --discovery-interval-ms; every address the name has is a
    /// worker (`http://address:port`), and one the name no longer has leaves once its
    /// requests end. On Kubernetes: the workers' headless Service
    /// (`pdmesh-prefill:50064`), which names the ready pods. Adds to --prefill-url.
    #[arg(long, env = "PDMESH_PREFILL_DNS", value_delimiter = ',')]
    pub prefill_dns: Vec<String>,
    /// Decode workers found through DNS, as --prefill-dns.
    #[arg(long, env = "PDMESH_DECODE_DNS", value_delimiter = ',')]
    pub decode_dns: Vec<String>,
    /// How often --prefill-dns and --decode-dns are looked up.
    #[arg(long, env = "PDMESH_DISCOVERY_INTERVAL_MS", default_value_t = 5_000)]
    pub discovery_interval_ms: u64,
    /// How long a worker may take to start a request (to answer the Generate call; the
    /// tokens may take as long as they take). A worker that does not (a stopped process,
    /// a host whose link black-holes packets) fails the start as UNAVAILABLE: the request
    /// is tried once more on another worker, and new requests pass that one over until it
    /// answers a health probe (every 2 s). Without it, requests picked for a hung worker
    /// would wait for it.
    #[arg(long, env = "PDMESH_WORKER_START_TIMEOUT_MS",
          default_value_t = route::START_TIMEOUT.as_millis() as u64)]
    pub worker_start_timeout_ms: u64,
    /// gRPC address of the cache service, whose host-mirror state `/metrics` reports;
    /// one per host when the mesh spans hosts (repeat the flag or separate with commas:
    /// `/metrics` sums them). Without it, a disaggregated gateway follows the cache
    /// services its prefill and decode workers name as their homes (each worker's
    /// --cache-advertise-url), as it learns them.
    #[arg(long, env = "PDMESH_CACHE_URL", value_delimiter = ',')]
    pub cache_url: Vec<String>,
    /// The model name clients must send; default: the model id the worker reports.
    #[arg(long, env = "PDMESH_MODEL_NAME")]
    pub model_name: Option<String>,
    /// When set, every `/v1/*` request must carry `Authorization: Bearer <key>`.
    #[arg(long, env = "PDMESH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Most generating requests (chat, completions, messages, responses) served at once,
    /// streams included until their last event; one more is shed at once with 503 and
    /// `Retry-After` instead of queueing without bound.
    #[arg(long, env = "PDMESH_MAX_CONCURRENT_REQUESTS", default_value_t = DEFAULT_MAX_CONCURRENT_REQUESTS)]
    pub max_concurrent_requests: usize,
    /// The key of the operators' routes, `/debug/*` (incident reports): they need
    /// `Authorization: Bearer <admin key>`, never the --api-key. Unset: they answer 403.
    #[arg(long, env = "PDMESH_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Largest accepted request body.
    #[arg(long, env = "PDMESH_MAX_BODY_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// The GGUF model file (the tokenizer service's `--model`): with it, generated tokens
    /// are turned into text in this process, with no round trip to the tokenizer service
    /// per token, once the service's tokenizer fingerprint is seen to be the same (else
    /// the service detokenizes, and the gateway logs an error).
    #[arg(long, env = "PDMESH_GATEWAY_MODEL")]
    pub model: Option<std::path::PathBuf>,
    /// Most responses kept for `previous_response_id` and `GET /v1/responses/{id}` (in
    /// memory; the oldest is forgotten first; 0 keeps none).
    #[arg(long, env = "PDMESH_RESPONSES_MAX_STORED", default_value_t = 1024)]
    pub responses_max_stored: usize,
    /// Most bytes of stored responses (their JSON and the conversation they continue);
    /// the oldest is forgotten first, and one larger than this is not stored.
    #[arg(long, env = "PDMESH_RESPONSES_MAX_STORED_BYTES", default_value_t = 256 * 1024 * 1024)]
    pub responses_max_stored_bytes: usize,
    /// Seconds a stored response is kept.
    #[arg(long, env = "PDMESH_RESPONSES_TTL_SECS", default_value_t = 3600)]
    pub responses_ttl_secs: u64,
    /// Where incident reports (an unparsable output, a first token that differs between
    /// prefill and decode) are written.
    #[command(flatten)]
    pub incidents: pdmesh_incident::IncidentArgs,
    /// This gateway's OpenAI endpoint as operators reach it (`http://host:port/v1`), for
    /// the reports' replay command (`pdmesh up` passes it).
    #[arg(long, env = "PDMESH_INCIDENT_REPLAY_URL")]
    pub incident_replay_url: Option<String>,
    /// Put the request's text in a report's replay recipe (by default only its token
    /// ids and the rest of its body go there).
    #[arg(long, env = "PDMESH_INCIDENT_INCLUDE_PROMPTS")]
    pub incident_include_prompts: bool,
    /// At SIGTERM the gateway drains: it stops accepting connections, `/health` says
    /// 503 `draining`, and the open streams run on for up to this long before they end
    /// with "shutting down". Keep it under the pod's terminationGracePeriodSeconds.
    #[arg(long, env = "PDMESH_DRAIN_TIMEOUT_MS", default_value_t = 20_000)]
    pub drain_timeout_ms: u64,
    /// The mesh credential (mutual TLS or the mesh token) for the gateway's calls to the
    /// tokenizer, workers and cache services (the HTTP API has its own --api-key).
    #[command(flatten)]
    pub tls: pdmesh_tls::TlsArgs,
}

impl Config {
    /// A gateway in front of the tokenizer and worker at these `http://host:port` URLs.
    pub fn new(tokenizer_url: impl Into<String>, worker_url: impl Into<String>) -> Self {
        Self {
            tokenizer_url: tokenizer_url.into(),
            worker_url: worker_url.into(),
            prefill_url: Vec::new(),
            decode_url: Vec::new(),
            prefill_dns: Vec::new(),
            decode_dns: Vec::new(),
            discovery_interval_ms: 5_000,
            worker_start_timeout_ms: route::START_TIMEOUT.as_millis() as u64,
            cache_url: Vec::new(),
            model_name: None,
            api_key: None,
            admin_key: None,
            max_body_bytes: 4 * 1024 * 1024,
            max_concurrent_requests: DEFAULT_MAX_CONCURRENT_REQUESTS,
            model: None,
            responses_max_stored: 1024,
            responses_max_stored_bytes: 256 * 1024 * 1024,
            responses_ttl_secs: 3600,
            incidents: pdmesh_incident::IncidentArgs::default(),
            incident_replay_url: None,
            drain_timeout_ms: 20_000,
            incident_include_prompts: false,
            tls: pdmesh_tls::TlsArgs::default(),
        }
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.max_body_bytes == 0 {
            return Err(Error::Config("--max-body-bytes must be at least 1".into()));
        }
        if !(1..=tokio::sync::Semaphore::MAX_PERMITS).contains(&self.max_concurrent_requests) {
            return Err(Error::Config(
                "--max-concurrent-requests must be at least 1".into(),
            ));
        }
        if self.api_key.as_deref() == Some("") {
            return Err(Error::Config(
                "--api-key must not be empty (unset it to disable auth)".into(),
            ));
        }
        if self.admin_key.as_deref() == Some("") {
            return Err(Error::Config(
                "--admin-key must not be empty (unset it to close /debug/*)".into(),
            ));
        }
        if self.admin_key.is_some() && self.admin_key == self.api_key {
            return Err(Error::Config(
                "--admin-key must differ from --api-key: every API client holds that one".into(),
            ));
        }
        if self.model_name.as_deref() == Some("") {
            return Err(Error::Config("--model-name must not be empty".into()));
        }
        if self.responses_ttl_secs == 0 {
            return Err(Error::Config(
                "--responses-ttl-secs must be at least 1 (use --responses-max-stored 0 to store none)"
                    .into(),
            ));
        }
        let prefill = !self.prefill_url.is_empty() || !self.prefill_dns.is_empty();
        let decode = !self.decode_url.is_empty() || !self.decode_dns.is_empty();
        if prefill != decode {
            return Err(Error::Config(
                "disaggregation needs prefill and decode workers: --prefill-url or --prefill-dns, and --decode-url or --decode-dns".into(),
            ));
        }
        for name in self.prefill_dns.iter().chain(&self.decode_dns) {
            if name.contains("://")
                || name
                    .rsplit_once(':')
                    .is_none_or(|(_, p)| p.parse::<u16>().is_err())
            {
                return Err(Error::Config(format!(
                    "--prefill-dns and --decode-dns take name:port, not {name:?}"
                )));
            }
        }
        if self.discovery_interval_ms == 0 {
            return Err(Error::Config(
                "--discovery-interval-ms must be at least 1".into(),
            ));
        }
        if self.worker_start_timeout_ms == 0 {
            return Err(Error::Config(
                "--worker-start-timeout-ms must be at least 1".into(),
            ));
        }
        Ok(())
    }

    /// Whether requests are disaggregated (prefill and decode workers, given or found).
    pub fn disaggregated(&self) -> bool {
        !self.prefill_url.is_empty() || !self.prefill_dns.is_empty()
    }
}

/// The default of `--max-concurrent-requests`.
pub const DEFAULT_MAX_CONCURRENT_REQUESTS: usize = 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_discovery_flags_need_both_sides_and_name_port() {
        let base = || Config::new("http://t:1", "http://w:1");
        let mut c = base();
        c.decode_dns = vec!["pdmesh-decode:50064".into()];
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("--prefill-url or --prefill-dns"), "{err}");
        c.prefill_url = vec!["http://p:1".into()];
        c.validate().unwrap();
        assert!(c.disaggregated());
        for bad in [
            "http://pdmesh-decode:50064",
            "pdmesh-decode",
            "pdmesh-decode:http",
        ] {
            c.decode_dns = vec![bad.into()];
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains("name:port"), "{bad}: {err}");
        }
        let mut c = base();
        c.prefill_dns = vec!["p:1".into()];
        c.decode_dns = vec!["d:1".into()];
        c.discovery_interval_ms = 0;
        assert!(c.validate().is_err());
        assert!(!base().disaggregated());
    }

    #[test]
    fn a_worker_start_timeout_of_zero_is_refused() {
        let mut c = Config::new("http://t:1", "http://w:1");
        c.validate().unwrap();
        c.worker_start_timeout_ms = 0;
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.contains("--worker-start-timeout-ms must be at least 1"),
            "{err}"
        );
    }
}

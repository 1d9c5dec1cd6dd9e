//! A mesh `pdmesh up` started: its ports file, its gateway's metrics, and whether it is
//! back to baseline — nothing held anywhere, as after a quiet start.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Why reading a mesh failed.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("reading the ports file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a ports file written by `pdmesh up --ports-json`: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("GET {url}: {why}")]
    Http { url: String, why: String },
}

/// Whether the mesh runs disaggregated prefill and decode workers or one unified worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Pd,
    Unified,
}

/// Process ids of the services (0: not running in this mesh).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pids {
    pub up: u32,
    pub tokenizer: u32,
    /// The unified worker, or the first decode worker.
    pub worker: u32,
    #[serde(default)]
    pub prefill: Vec<u32>,
    #[serde(default)]
    pub decode: Vec<u32>,
    pub gateway: u32,
    #[serde(default)]
    pub cache: u32,
}

/// The ports file `pdmesh up --ports-json FILE` writes (and rewrites when `--restart`
/// starts a service again, with its new pid).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshFile {
    /// The gateway's OpenAI base URL (ends in `/v1`).
    pub url: String,
    pub host: String,
    pub mode: Mode,
    pub gateway: u16,
    pub tokenizer: u16,
    /// The unified worker's port, or the first decode worker's.
    pub worker: u16,
    #[serde(default)]
    pub prefill: Vec<u16>,
    #[serde(default)]
    pub decode: Vec<u16>,
    /// 0 without a cache service.
    #[serde(default)]
    pub cache: u16,
    pub model: String,
    /// Whether `up` restarts a service that exits (files from before the flag: no).
    #[serde(default)]
    pub restart: bool,
    pub pids: Pids,
}

impl MeshFile {
    pub fn read(path: &Path) -> Result<Self, MeshError> {
        let text = std::fs::read_to_string(path).map_err(|source| MeshError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text).map_err(|source| MeshError::Parse {
            path: path.to_owned(),
            source,
        })
    }

    pub fn parse(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The gateway's root URL (`/health`, `/metrics`, `/flush_cache` live here).
    pub fn gateway_url(&self) -> String {
        let url = self.url.trim_end_matches('/');
        url.strip_suffix("/v1").unwrap_or(url).to_owned()
    }

    /// Whether a cache service (the host mirror) runs in this mesh.
    pub fn has_cache(&self) -> bool {
        self.cache != 0 && self.pids.cache != 0
    }
}

/// One scrape of a Prometheus text exposition: each series (name with its labels, as
/// written) and its value.
pub type Metrics = BTreeMap<String, f64>;

/// Parses Prometheus text: comments and blank lines are skipped, a sample's optional
/// timestamp is dropped, and lines that do not parse are ignored.
pub fn parse_metrics(text: &str) -> Metrics {
    let mut out = Metrics::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        // Label values may hold spaces: the series ends at the closing brace.
        let (series, rest) = match line.find('{') {
            Some(open) if open < line.find(' ').unwrap_or(usize::MAX) => match line.rfind('}') {
                Some(close) => (&line[..=close], &line[close + 1..]),
                None => continue,
            },
            _ => match line.split_once(' ') {
                Some((name, rest)) => (name, rest),
                None => continue,
            },
        };
        let Some(value) = rest.split_whitespace().next() else {
            continue;
        };
        if let Ok(v) = value.parse::<f64>() {
            out.insert(series.to_owned(), v);
        }
    }
    out
}

/// The sum of every series of metric `name`, whatever its labels (0 when absent).
pub fn sum(m: &Metrics, name: &str) -> f64 {
    m.iter()
        .filter(|(series, _)| series.split('{').next() == Some(name))
        .map(|(_, v)| v)
        .sum()
}

/// Reads `url` (a `/metrics` endpoint) once.
pub async fn scrape(http: &reqwest::Client, url: &str) -> Result<Metrics, MeshError> {
    let err = |why: String| MeshError::Http {
        url: url.to_owned(),
        why,
    };
    let resp = http
        .get(url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .map_err(|e| err(e.to_string()))?;
    if !resp.status().is_success() {
        return Err(err(format!("status {}", resp.status())));
    }
    let text = resp.text().await.map_err(|e| err(e.to_string()))?;
    Ok(parse_metrics(&text))
}

/// Whether the gateway at `gateway_url` answers `/health` with 200 (every backend up).
pub async fn healthy(http: &reqwest::Client, gateway_url: &str) -> bool {
    let call = http
        .get(format!("{gateway_url}/health"))
        .timeout(Duration::from_secs(10))
        .send();
    matches!(call.await, Ok(r) if r.status().is_success())
}

/// What a scrape says about pages and work held in the mesh.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Baseline {
    /// 1 when the scrape read every worker (the worker gauges are stale otherwise).
    pub workers_read: f64,
    /// Series that must be 0 when nothing runs and are not: requests in workers, pages
    /// reserved for transfers, rooms open (failed rooms are history), mirror slots rooms
    /// hold.
    pub held: BTreeMap<String, f64>,
    pub pages_free: f64,
    pub pages_cached: f64,
    pub pages_capacity: f64,
}

impl Baseline {
    pub fn of(m: &Metrics) -> Self {
        let held = m
            .iter()
            .filter(|(k, v)| {
                **v != 0.0
                    && (k.starts_with("mesh_worker_requests")
                        || k.starts_with("mesh_room_slots")
                        || *k == "mesh_kv_reserved_pages"
                        || (k.starts_with("mesh_rooms{") && !k.contains("state=\"failed\"")))
            })
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        let get = |k: &str| m.get(k).copied().unwrap_or(0.0);
        Self {
            workers_read: get("mesh_workers_read"),
            held,
            pages_free: get("mesh_kv_pages_free"),
            pages_cached: get("mesh_kv_pages_cached"),
            pages_capacity: get("mesh_kv_pages_capacity"),
        }
    }

    /// Pages neither free nor evictable: held by requests, reservations or leaks.
    pub fn pages_held(&self) -> f64 {
        self.pages_capacity - self.pages_free - self.pages_cached
    }

    /// Nothing held: every worker read, no request or room under way, every page free or
    /// only cached.
    pub fn ok(&self) -> bool {
        self.workers_read == 1.0
            && self.held.is_empty()
            && self.pages_capacity > 0.0
            && self.pages_held() == 0.0
    }

    /// One line for people.
    pub fn describe(&self) -> String {
        if self.workers_read != 1.0 {
            return "the gateway could not read every worker".into();
        }
        let mut out = format!(
            "{} of {} pages held (free {}, cached {})",
            self.pages_held(),
            self.pages_capacity,
            self.pages_free,
            self.pages_cached
        );
        if !self.held.is_empty() {
            let held: Vec<String> = self.held.iter().map(|(k, v)| format!("{k} {v}")).collect();
            out.push_str(&format!("; still under way: {}", held.join(", ")));
        }
        out
    }
}

/// Polls the gateway's metrics until the mesh is back to baseline or `timeout` passes;
/// returns the last reading and how long it took. A scrape that fails counts as not
/// there yet.
pub async fn wait_baseline(
    http: &reqwest::Client,
    gateway_url: &str,
    timeout: Duration,
) -> (Baseline, Duration) {
    let start = Instant::now();
    let url = format!("{gateway_url}/metrics");
    loop {
        let b = match scrape(http, &url).await {
            Ok(m) => Baseline::of(&m),
            Err(_) => Baseline::default(),
        };
        if b.ok() || start.elapsed() >= timeout {
            return (b, start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = r#"# HELP mesh_workers_read Whether the last scrape read every worker.
# TYPE mesh_workers_read gauge
mesh_workers_read 1
mesh_kv_pages_free 100
mesh_kv_pages_cached 28
mesh_kv_pages_capacity 128
mesh_kv_reserved_pages 0
mesh_worker_requests{state="running"} 0
mesh_worker_requests{state="waiting"} 0
mesh_rooms{state="failed"} 3
mesh_rooms{state="transferring"} 0
mesh_room_slots{state="quarantined"} 0
mesh_router_cached_pages{url="http://127.0.0.1:1 x"} 7 1700000000000
mesh_kv_cache_checksum_failures_total{tier="host"} 2
mesh_kv_cache_checksum_failures_total{tier="other"} 1
mesh_request_duration_seconds_bucket{endpoint="chat_completions",le="+Inf"} 5
not a sample
"#;

    #[test]
    fn metrics_parse_with_labels_spaces_timestamps_and_infinities() {
        let m = parse_metrics(SCRAPE);
        assert_eq!(m["mesh_workers_read"], 1.0);
        assert_eq!(m[r#"mesh_rooms{state="failed"}"#], 3.0);
        assert_eq!(
            m[r#"mesh_router_cached_pages{url="http://127.0.0.1:1 x"}"#],
            7.0
        );
        assert_eq!(
            m[r#"mesh_request_duration_seconds_bucket{endpoint="chat_completions",le="+Inf"}"#],
            5.0
        );
        assert!(!m.keys().any(|k| k.starts_with('#') || k.starts_with("not")));
        assert_eq!(sum(&m, "mesh_kv_cache_checksum_failures_total"), 3.0);
        assert_eq!(
            sum(&m, "mesh_kv_cache_checksum_failures"),
            0.0,
            "whole names only"
        );
        assert_eq!(parse_metrics("x +Inf\ny NaN\nz -1.5e3")["z"], -1500.0);
        assert!(parse_metrics("x +Inf")["x"].is_infinite());
    }

    #[test]
    fn baseline_needs_every_worker_read_nothing_under_way_and_every_page_back() {
        let m = parse_metrics(SCRAPE);
        let b = Baseline::of(&m);
        assert!(b.ok(), "{}", b.describe());
        assert_eq!(b.pages_held(), 0.0);

        let with = |k: &str, v: f64| {
            let mut m = m.clone();
            m.insert(k.to_owned(), v);
            Baseline::of(&m)
        };
        for (k, v) in [
            (r#"mesh_worker_requests{state="running"}"#, 1.0),
            ("mesh_kv_reserved_pages", 4.0),
            (r#"mesh_rooms{state="transferring"}"#, 1.0),
            (r#"mesh_room_slots{state="quarantined"}"#, 2.0),
        ] {
            let b = with(k, v);
            assert!(!b.ok(), "{k} {v}");
            assert!(b.describe().contains(k), "{}", b.describe());
        }
        // Failed rooms are history, not something held.
        assert!(with(r#"mesh_rooms{state="failed"}"#, 9.0).ok());
        let leaked = with("mesh_kv_pages_free", 96.0);
        assert!(!leaked.ok());
        assert_eq!(leaked.pages_held(), 4.0);
        assert!(
            leaked.describe().starts_with("4 of 128 pages held"),
            "{}",
            leaked.describe()
        );
        // A scrape that missed a worker says nothing about pages.
        let stale = with("mesh_workers_read", 0.0);
        assert!(!stale.ok());
        assert!(stale.describe().contains("could not read every worker"));
        assert!(
            !Baseline::default().ok(),
            "an empty scrape is not a baseline"
        );
    }

    #[test]
    fn the_ports_file_of_up_parses_and_old_files_default_to_no_restart() {
        let text = r#"{
  "url": "http://127.0.0.1:8080/v1", "host": "127.0.0.1", "mode": "pd",
  "gateway": 8080, "tokenizer": 1, "worker": 2, "prefill": [3], "decode": [2],
  "cache": 4, "model": "SmolLM2-135M-Instruct", "restart": true,
  "pids": {"up": 10, "tokenizer": 11, "worker": 12, "prefill": [13], "decode": [12],
           "gateway": 14, "cache": 15}
}"#;
        let f = MeshFile::parse(text).unwrap();
        assert_eq!(f.mode, Mode::Pd);
        assert!(f.restart && f.has_cache());
        assert_eq!(f.gateway_url(), "http://127.0.0.1:8080");
        assert_eq!((f.pids.prefill[0], f.pids.decode[0]), (13, 12));
        let old = text.replace(r#""restart": true,"#, "");
        assert!(!MeshFile::parse(&old).unwrap().restart);
        let unified = r#"{"url": "http://h:1/v1/", "host": "h", "mode": "unified", "gateway": 1,
            "tokenizer": 2, "worker": 3, "cache": 0, "model": "m",
            "pids": {"up": 1, "tokenizer": 2, "worker": 3, "gateway": 4, "cache": 0}}"#;
        let u = MeshFile::parse(unified).unwrap();
        assert_eq!((u.mode, u.has_cache()), (Mode::Unified, false));
        assert_eq!(u.gateway_url(), "http://h:1");
        assert!(u.pids.prefill.is_empty());
    }
}

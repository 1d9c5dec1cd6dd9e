//! Test harness: starts the real tokenizer (and, for generation tests, the real worker)
//! and the gateway on 127.0.0.1:0, plus a minimal HTTP/1.1 client so the tests see
//! exactly the bytes an OpenAI client would.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use pdmesh_testkit::service::{Service, credentials};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// A running set of services; everything stops when it is dropped.
pub struct Mesh {
    pub gateway: SocketAddr,
    pub worker: SocketAddr,
    pub tokenizer: SocketAddr,
    /// Each service's shutdown.
    stops: Vec<CancellationToken>,
    /// Holds the worker's port when no worker runs: it refuses every connection.
    _refusing: Option<pdmesh_testkit::Refusing>,
}

impl Drop for Mesh {
    fn drop(&mut self) {
        for stop in &self.stops {
            stop.cancel();
        }
    }
}

pub struct Options {
    /// Start the real worker (needs the engine); otherwise the worker URL is dead.
    pub worker: bool,
    pub model_name: Option<String>,
    pub api_key: Option<String>,
    /// The gateway's `--admin-key`, for `/debug/*`.
    pub admin_key: Option<String>,
    /// The gateway's `--incident-dir`.
    pub incident_dir: Option<std::path::PathBuf>,
    pub max_body_bytes: Option<usize>,
    pub kv_pages: Option<usize>,
    /// The gateway's `--model` (it then detokenizes in process).
    pub gateway_model: Option<std::path::PathBuf>,
    /// The tokenizer's `--model`, when not the worker's (the default model).
    pub tokenizer_model: Option<std::path::PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            worker: false,
            model_name: Some("test-model".into()),
            api_key: None,
            admin_key: None,
            incident_dir: None,
            max_body_bytes: None,
            kv_pages: None,
            gateway_model: None,
            tokenizer_model: None,
        }
    }
}

pub async fn start(opts: Options) -> Mesh {
    let model = pdmesh_gguf::models::require_default_model();
    let mut stops = Vec::new();

    let mut tok_cfg =
        pdmesh_tokenizer::Config::new(opts.tokenizer_model.as_ref().unwrap_or(&model));
    tok_cfg.tls = credentials();
    let tok = Service::start(|l, s| pdmesh_tokenizer::run(tok_cfg, l, s)).await;
    let tokenizer = tok.addr;
    stops.push(tok.shutdown);

    let refusing = (!opts.worker).then(pdmesh_testkit::Refusing::new);
    let worker = if opts.worker {
        let mut wcfg = pdmesh_worker::Config::new(&model);
        wcfg.tls = credentials();
        if let Some(p) = opts.kv_pages {
            wcfg.kv_pages = p;
        }
        let w = Service::start(|l, s| async move {
            let run = pdmesh_worker::run(wcfg, l, s).await;
            run.inspect_err(|e| panic!("worker failed: {e}"))
        })
        .await;
        stops.push(w.shutdown);
        w.addr
    } else {
        refusing.as_ref().expect("made when no worker runs").addr()
    };

    let mut cfg =
        pdmesh_gateway::Config::new(format!("http://{tokenizer}"), format!("http://{worker}"));
    // The mesh credential for its calls to the tokenizer and worker (both take it).
    cfg.tls = credentials();
    cfg.model_name = opts.model_name;
    cfg.api_key = opts.api_key;
    cfg.admin_key = opts.admin_key;
    cfg.incidents.dir = opts.incident_dir;
    cfg.model = opts.gateway_model;
    if let Some(b) = opts.max_body_bytes {
        cfg.max_body_bytes = b;
    }
    let gw = Service::start(|l, s| pdmesh_gateway::run(cfg, l, s)).await;
    let gateway = gw.addr;
    stops.push(gw.shutdown);
    let mesh = Mesh {
        gateway,
        worker,
        tokenizer,
        stops,
        _refusing: refusing,
    };
    // Wait until the gateway answers and the backends we started are healthy.
    for _ in 0..600 {
        if let Ok(r) = tokio::time::timeout(Duration::from_secs(5), get(gateway, "/health")).await {
            let body = r.json();
            if body["tokenizer"] == "ok" && (!opts.worker || body["worker"] == "ok") {
                return mesh;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the mesh did not become healthy");
}

/// An HTTP response.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse_data(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .flat_map(|ev| {
                ev.lines()
                    .filter_map(|l| l.strip_prefix("data: ").map(str::to_owned))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Asserts the OpenAI error shape and status; returns the `error` object.
    pub fn expect_error(&self, status: u16) -> serde_json::Value {
        assert_eq!(self.status, status, "body: {}", self.text());
        let body = self.json();
        let err = body["error"].clone();
        for k in ["message", "type", "param", "code"] {
            assert!(err.get(k).is_some(), "error body lacks {k}: {body}");
        }
        assert!(
            err["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{body}"
        );
        err
    }
}

fn decode_chunked(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size_line = std::str::from_utf8(&b[..eol]).unwrap();
        let size = usize::from_str_radix(size_line.split(';').next().unwrap().trim(), 16).unwrap();
        b = &b[eol + 2..];
        if size == 0 {
            break;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
    out
}

/// Sends one request (`Connection: close`) and reads the whole response.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Resp {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    parse_response(&raw)
}

pub fn parse_response(raw: &[u8]) -> Resp {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("no end of headers");
    let head = std::str::from_utf8(&raw[..split]).unwrap();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| {
            l.split_once(':')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        })
        .collect();
    let rest = &raw[split + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        decode_chunked(rest)
    } else {
        rest.to_vec()
    };
    Resp {
        status,
        headers,
        body,
    }
}

pub async fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, &[], b"").await
}

pub async fn post_json(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Resp {
    post_raw(addr, path, body.to_string().as_bytes()).await
}

pub async fn post_raw(addr: SocketAddr, path: &str, body: &[u8]) -> Resp {
    request(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body,
    )
    .await
}

/// The value of an unlabelled gauge or counter in a Prometheus exposition.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|r| r.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

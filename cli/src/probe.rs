//! Readiness probes `pdmesh up` and `pdmesh probe` (a container's healthcheck) use: the
//! gRPC Health call of the tokenizer and worker, Stats of the cache service, and
//! `GET /health` or `/ready` on the gateway (a minimal HTTP/1.1 exchange).

use std::net::SocketAddr;
use std::time::Duration;

use pdmesh_proto::tokenizer::v1 as tk;
use pdmesh_proto::worker::v1 as wk;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Longest a single probe may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

async fn channel(addr: SocketAddr, auth: &pdmesh_tls::MeshAuth) -> Option<pdmesh_tls::AuthChannel> {
    let ep = auth
        .endpoint(&format!("http://{addr}"))
        .ok()?
        .connect_timeout(PROBE_TIMEOUT);
    let ch = tokio::time::timeout(PROBE_TIMEOUT, ep.connect())
        .await
        .ok()?
        .ok()?;
    Some(auth.channel(ch))
}

/// Whether the tokenizer at `addr` answers Health with ok.
pub async fn tokenizer_healthy(addr: SocketAddr, tls: &pdmesh_tls::MeshAuth) -> bool {
    let Some(ch) = channel(addr, tls).await else {
        return false;
    };
    let mut c = tk::tokenizer_client::TokenizerClient::new(ch);
    matches!(tokio::time::timeout(PROBE_TIMEOUT, c.health(tk::HealthRequest {})).await, Ok(Ok(r)) if r.get_ref().ok)
}

/// Whether the tokenizer at `addr` has a chat format (its Info), if it answers.
pub async fn tokenizer_has_chat_template(
    addr: SocketAddr,
    tls: &pdmesh_tls::MeshAuth,
) -> Option<bool> {
    let mut c = tk::tokenizer_client::TokenizerClient::new(channel(addr, tls).await?);
    Some(answer(c.info(tk::InfoRequest {})).await?.has_chat_template)
}

/// A call's answer within [`PROBE_TIMEOUT`], if it came and was not an error.
async fn answer<T>(
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Option<T> {
    let r = tokio::time::timeout(PROBE_TIMEOUT, call).await.ok()?.ok()?;
    Some(r.into_inner())
}

/// Whether the cache service at `addr` answers Stats.
pub async fn cache_healthy(addr: SocketAddr, tls: &pdmesh_tls::MeshAuth) -> bool {
    let Some(ch) = channel(addr, tls).await else {
        return false;
    };
    let mut c = pdmesh_proto::cache::v1::cache_client::CacheClient::new(ch);
    let stats = c.stats(pdmesh_proto::cache::v1::StatsRequest {});
    matches!(tokio::time::timeout(PROBE_TIMEOUT, stats).await, Ok(Ok(_)))
}

/// Whether the worker at `addr` answers Health with ok.
pub async fn worker_healthy(addr: SocketAddr, tls: &pdmesh_tls::MeshAuth) -> bool {
    let Some(ch) = channel(addr, tls).await else {
        return false;
    };
    let mut c = wk::worker_client::WorkerClient::new(ch);
    matches!(tokio::time::timeout(PROBE_TIMEOUT, c.health(wk::HealthRequest {})).await, Ok(Ok(r)) if r.get_ref().ok)
}

/// The model id the worker at `addr` serves.
pub async fn worker_model_id(addr: SocketAddr, tls: &pdmesh_tls::MeshAuth) -> Option<String> {
    let mut c = wk::worker_client::WorkerClient::new(channel(addr, tls).await?);
    Some(
        answer(c.model_info(wk::ModelInfoRequest {}))
            .await?
            .model_id,
    )
}

/// The status code of `GET {path}` at `addr`, or `None` if there was no HTTP answer.
pub async fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    let raw = tokio::time::timeout(PROBE_TIMEOUT, exchange(addr, req.into_bytes()))
        .await
        .ok()??;
    parse_status_line(&raw)
}

/// `POST {path}` with a JSON body: the status and the body of the answer.
pub async fn http_post_json(
    addr: SocketAddr,
    path: &str,
    body: &serde_json::Value,
    bearer: Option<&str>,
    timeout: Duration,
) -> Option<(u16, Vec<u8>)> {
    let body = body.to_string();
    let auth = bearer
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let raw = tokio::time::timeout(timeout, exchange(addr, req.into_bytes()))
        .await
        .ok()??;
    let status = parse_status_line(&raw)?;
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    Some((status, raw[split + 4..].to_vec()))
}

/// `pdmesh probe`: whether the service at `args.addr` is ready; an error says why not.
pub async fn run(args: crate::args::ProbeArgs) -> anyhow::Result<()> {
    use crate::args::ProbeService;
    let auth = args.tls.auth()?;
    let addr = tokio::net::lookup_host(&args.addr)
        .await
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| anyhow::anyhow!("{}: not a HOST:PORT that resolves", args.addr))?;
    let ready = match args.service {
        ProbeService::Tokenizer => tokenizer_healthy(addr, &auth).await,
        ProbeService::Cache => cache_healthy(addr, &auth).await,
        ProbeService::Worker => worker_healthy(addr, &auth).await,
        ProbeService::Gateway => http_status(addr, "/ready").await == Some(200),
    };
    let name = clap::ValueEnum::to_possible_value(&args.service)
        .map(|v| v.get_name().to_owned())
        .unwrap_or_default();
    anyhow::ensure!(ready, "the {name} at {addr} is not ready");
    Ok(())
}

/// Writes `request`, reads until the server closes the connection.
async fn exchange(addr: SocketAddr, request: Vec<u8>) -> Option<Vec<u8>> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(&request).await.ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.ok()?;
    Some(buf)
}

fn parse_status_line(response: &[u8]) -> Option<u16> {
    let line = response.split(|&b| b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split_whitespace();
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines() {
        assert_eq!(
            parse_status_line(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
            Some(200)
        );
        assert_eq!(
            parse_status_line(b"HTTP/1.1 503 Service Unavailable\r\n"),
            Some(503)
        );
        assert_eq!(parse_status_line(b"SSH-2.0-OpenSSH\r\n"), None);
        assert_eq!(parse_status_line(b""), None);
    }

    #[tokio::test]
    async fn nothing_listening_is_unhealthy_not_an_error() {
        let refusing = pdmesh_testkit::Refusing::new();
        let addr = refusing.addr();
        assert_eq!(http_status(addr, "/health").await, None);
        assert!(!worker_healthy(addr, &pdmesh_tls::test_ca::auth()).await);
        assert!(!tokenizer_healthy(addr, &pdmesh_tls::test_ca::auth()).await);
    }

    #[tokio::test]
    async fn the_probe_command_fails_naming_what_is_not_ready() {
        let refusing = pdmesh_testkit::Refusing::new();
        let tls = pdmesh_tls::TlsArgs {
            insecure_plaintext: true,
            ..Default::default()
        };
        for service in [
            crate::args::ProbeService::Cache,
            crate::args::ProbeService::Gateway,
        ] {
            let args = crate::args::ProbeArgs {
                service,
                addr: refusing.addr().to_string(),
                tls: tls.clone(),
            };
            let err = run(args).await.unwrap_err().to_string();
            assert!(err.ends_with("is not ready"), "{err}");
        }
        let args = crate::args::ProbeArgs {
            service: crate::args::ProbeService::Worker,
            addr: "no such host:1".into(),
            tls,
        };
        let err = run(args).await.unwrap_err().to_string();
        assert!(err.contains("not a HOST:PORT"), "{err}");
    }
}

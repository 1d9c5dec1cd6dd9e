//! What every service does the same way around its server: the gRPC server set up (the
//! mesh's TLS, a span per traced call, Nagle off, a graceful stop) and the wait of a
//! drain at SIGTERM.

use std::future::Future;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::transport::Server;
use tonic::transport::server::{Router, TcpIncoming};

use crate::MeshAuth;

impl MeshAuth {
    /// A gRPC server for this credential ([`MeshAuth::server`]) that opens a span for
    /// each call carrying trace context (`pdmesh_telemetry::grpc_server_span`).
    pub fn traced_server(&self) -> Result<Server, tonic::transport::Error> {
        Ok(self.server()?.trace_fn(pdmesh_telemetry::grpc_server_span))
    }
}

/// Serves `router` on `listener` until `stop` completes, then lets the calls still open
/// end before it returns.
pub async fn serve(
    router: Router,
    listener: TcpListener,
    stop: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    router
        .serve_with_incoming_shutdown(
            // Small messages (tokens, control calls) must not wait for Nagle's algorithm.
            TcpIncoming::from(listener).with_nodelay(Some(true)),
            stop,
        )
        .await
}

/// How often a drain looks whether work is left.
pub const DRAIN_POLL: Duration = Duration::from_millis(50);

/// The lines a drain logs as it ends: once nothing is left, or (a warning, with how much
/// was left) when its time ran out.
#[derive(Clone, Copy, Debug)]
pub struct DrainEnd {
    pub drained: &'static str,
    pub timed_out: &'static str,
}

/// The wait of a drain: until `busy` counts nothing left or `timeout` passes, looking
/// every [`DRAIN_POLL`]. Logs which of the two ended it, and returns what was left (0
/// when drained).
pub async fn wait_drained<F: Future<Output = usize>>(
    timeout: Duration,
    mut busy: impl FnMut() -> F,
    end: DrainEnd,
) -> usize {
    let until = tokio::time::Instant::now() + timeout;
    loop {
        let left = busy().await;
        if left == 0 {
            tracing::info!("{}", end.drained);
            return 0;
        }
        if tokio::time::Instant::now() >= until {
            tracing::warn!(left, "{}", end.timed_out);
            return left;
        }
        tokio::time::sleep(DRAIN_POLL).await;
    }
}

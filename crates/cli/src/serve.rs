//! Running one service in the foreground: bind, announce the address, and turn Ctrl-C or
//! SIGTERM into the service's cancellation token (a second signal exits at once).

use std::future::Future;
use std::net::SocketAddr;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Why a service subcommand failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("installing signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("the {name} service failed")]
    Service {
        name: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// How long a graceful shutdown may drain connections before the process exits anyway.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// SIGINT (Ctrl-C) and SIGTERM, installed when created so no early signal is lost.
#[derive(Debug)]
pub struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    /// Must be called inside a tokio runtime.
    pub fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// The name of the next signal received.
    pub async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// Binds `listen`, prints `NAME listening on ADDR` to stderr and runs `service` until it
/// returns; the first SIGINT/SIGTERM cancels its token, a second one exits with 130, and
/// a drain longer than [`SHUTDOWN_GRACE`] exits with 1.
pub async fn serve<F, Fut, E>(
    name: &'static str,
    listen: SocketAddr,
    service: F,
) -> Result<(), ServeError>
where
    F: FnOnce(TcpListener, CancellationToken) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| ServeError::Bind {
        addr: listen,
        source,
    })?;
    eprintln!("{name} listening on {addr}");

    let shutdown = CancellationToken::new();
    let mut signals = Signals::new().map_err(ServeError::Signals)?;
    let token = shutdown.clone();
    tokio::spawn(async move {
        let sig = signals.recv().await;
        eprintln!("{name}: {sig} received, shutting down (send it again to exit at once)");
        token.cancel();
        tokio::select! {
            sig = signals.recv() => {
                eprintln!("{name}: second {sig}, exiting now");
                std::process::exit(130);
            }
            () = tokio::time::sleep(SHUTDOWN_GRACE) => {
                eprintln!("{name}: still draining connections after {SHUTDOWN_GRACE:?}; exiting now");
                std::process::exit(1);
            }
        }
    });
    service(listener, shutdown)
        .await
        .map_err(|e| ServeError::Service {
            name,
            source: Box::new(e),
        })
}

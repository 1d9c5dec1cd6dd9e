//! A service started in process for a test: bound on a loopback port before it runs (a
//! client connecting early waits in the listener's backlog), carrying the test process's
//! mesh credential, and stopped through its shutdown token.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How long a test waits for something that should happen promptly (a service stopping,
/// a stream's next message) before calling it hung.
pub const HANG: Duration = Duration::from_secs(120);

/// The credential flags of a service a test starts in process: the test process's mesh
/// token, which [`connect`] and [`Service::client`] carry too.
pub fn credentials() -> pdmesh_tls::TlsArgs {
    pdmesh_tls::test_ca::args()
}

/// A client made by `new` (a generated client's `new`) on a channel to `url` that carries
/// the test process's mesh token.
pub async fn connect<C>(url: impl AsRef<str>, new: impl FnOnce(pdmesh_tls::AuthChannel) -> C) -> C {
    let url = url.as_ref();
    pdmesh_tls::test_ca::client(url, new)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

/// What a call answered (a unary call's message, or the stream a streaming call opened);
/// a call that fails fails the test.
pub async fn answer<T>(call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>) -> T {
    call.await
        .unwrap_or_else(|status| panic!("the call failed: {status:?}"))
        .into_inner()
}

/// A service running on its own task.
#[derive(Debug)]
pub struct Service<E> {
    pub addr: SocketAddr,
    /// Cancelling it asks the service to stop.
    pub shutdown: CancellationToken,
    /// The service's `run`, ending when it stops.
    pub task: JoinHandle<Result<(), E>>,
}

impl<E: Send + 'static> Service<E> {
    /// Binds 127.0.0.1 on a port of its own and spawns `run` with the listener and a
    /// fresh shutdown token.
    pub async fn start<F>(run: impl FnOnce(TcpListener, CancellationToken) -> F) -> Self
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
    {
        Self::start_at(SocketAddr::from(([127, 0, 0, 1], 0)), run).await
    }

    /// [`Service::start`] on `addr` (a port a stopped service had, to start it again).
    pub async fn start_at<F>(
        addr: SocketAddr,
        run: impl FnOnce(TcpListener, CancellationToken) -> F,
    ) -> Self
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
    {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("bind {addr}: {e}"));
        Self::serve(listener, run)
    }

    /// Spawns `run` on `listener`, bound already (where a test needs the addresses of
    /// several services before it starts any).
    pub fn serve<F>(
        listener: TcpListener,
        run: impl FnOnce(TcpListener, CancellationToken) -> F,
    ) -> Self
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
    {
        let addr = listener.local_addr().expect("the bound address");
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(listener, shutdown.clone()));
        Self {
            addr,
            shutdown,
            task,
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A client of this service (see [`connect`]).
    pub async fn client<C>(&self, new: impl FnOnce(pdmesh_tls::AuthChannel) -> C) -> C {
        connect(self.url(), new).await
    }

    /// Waits at most [`HANG`] for the service to end by itself (its shutdown already
    /// cancelled, or its run failing): what its run returned.
    pub async fn join(self) -> Result<(), E> {
        tokio::time::timeout(HANG, self.task)
            .await
            .expect("the service did not stop in time")
            .expect("the service's task panicked")
    }

    /// Cancels the shutdown token and [`join`](Service::join)s.
    pub async fn stop(self) -> Result<(), E> {
        self.shutdown.cancel();
        self.join().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_service_runs_on_its_listener_and_stops_with_its_token() {
        let s = Service::start(|listener, shutdown| async move {
            tokio::select! {
                _ = shutdown.cancelled() => Ok::<_, String>(()),
                accepted = listener.accept() => Err(format!("accepted {:?}", accepted.map(|(_, a)| a))),
            }
        })
        .await;
        assert!(!s.task.is_finished());
        let addr = s.addr;
        s.stop().await.unwrap();
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "the port is closed"
        );
    }

    #[tokio::test]
    async fn answer_unwraps_an_answer_and_fails_on_a_status() {
        assert_eq!(answer(async { Ok(tonic::Response::new(7)) }).await, 7);
        let failed = tokio::spawn(answer(async {
            Err::<tonic::Response<()>, _>(tonic::Status::not_found("gone"))
        }));
        let panic = failed.await.unwrap_err().into_panic();
        let said = panic.downcast_ref::<String>().unwrap();
        assert!(said.contains("gone"), "{said}");
    }

    #[tokio::test]
    async fn join_returns_what_the_run_returned() {
        let s = Service::start(|_, _| async { Err::<(), _>("refused") }).await;
        assert_eq!(s.join().await, Err("refused"));
    }
}

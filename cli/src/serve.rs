//! Running one service in the foreground: take its listener (bound here, or inherited
//! from `pdmesh up`), announce the address and write the ports file, and turn Ctrl-C or
//! SIGTERM into the service's cancellation token (a second signal exits at once).

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

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
    #[error("--listen-fd {fd} is not a listening TCP socket")]
    Inherited {
        fd: i32,
        #[source]
        source: std::io::Error,
    },
    #[error("writing the ports file {}", path.display())]
    PortsFile {
        path: PathBuf,
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

/// Where a service's listeners come from and where it says what it bound; every service
/// subcommand flattens these beside its `--listen`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct ListenArgs {
    /// Once every listener is bound, write their ports (and this process's id) here as
    /// JSON: `{"pid": …, "listen": …}`, plus `health` (a worker's --health-listen) or
    /// `peer` (the cache service's page transport). With `--listen 127.0.0.1:0` this is
    /// how a script learns the port the kernel chose. Written whole (renamed into place).
    #[arg(long, env = "PDMESH_PORTS_FILE", value_name = "FILE")]
    pub ports_file: Option<PathBuf>,
    /// Serve on this already listening socket instead of binding --listen, which then
    /// only names its address for whoever reads the command line (`pdmesh up` binds
    /// every service's port before it starts any and hands each its socket, so no port
    /// is ever released and picked again).
    #[arg(long, value_name = "FD", hide = true)]
    pub listen_fd: Option<i32>,
}

impl ListenArgs {
    /// The service's main listener: the inherited socket, or `listen` bound now.
    pub async fn listener(&self, listen: SocketAddr) -> Result<TcpListener, ServeError> {
        match self.listen_fd {
            Some(fd) => inherited(fd).map_err(|source| ServeError::Inherited { fd, source }),
            None => bind(listen).await,
        }
    }
}

/// Binds `addr` (port 0: the kernel picks one, and the listener keeps it).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })
}

/// Takes over `fd`, a listening TCP socket this process inherited.
fn inherited(fd: i32) -> std::io::Result<TcpListener> {
    use std::os::fd::{FromRawFd, OwnedFd};
    if fd < 3 {
        return Err(std::io::Error::other("0, 1 and 2 are the standard streams"));
    }
    // Checked before ownership is taken: the descriptor must be open and a listening
    // TCP socket, not a file, a Unix socket or a connected stream that happens to sit there.
    let opt = |name: libc::c_int| -> std::io::Result<libc::c_int> {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `v`, a c_int on this stack
        // frame; an invalid fd is reported as an error, not UB.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                name,
                (&raw mut v).cast(),
                &raw mut len,
            )
        };
        if rc == 0 {
            Ok(v)
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    if !matches!(opt(libc::SO_DOMAIN)?, libc::AF_INET | libc::AF_INET6)
        || opt(libc::SO_TYPE)? != libc::SOCK_STREAM
    {
        return Err(std::io::Error::other("not a TCP socket"));
    }
    if opt(libc::SO_ACCEPTCONN)? == 0 {
        return Err(std::io::Error::other("the socket is not listening"));
    }
    // SAFETY: `fd` is open (getsockopt succeeded) and was handed to this process to own;
    // nothing else in the process uses it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let std = std::net::TcpListener::from(owned);
    // Not inherited by anything this process starts.
    // SAFETY: fcntl on an fd this process owns; no memory is passed.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    std.set_nonblocking(true)?;
    TcpListener::from_std(std)
}

/// The ports a service bound, for `--ports-file`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PortsFile {
    /// Filled in by [`serve`].
    pub pid: u32,
    /// Filled in by [`serve`].
    pub listen: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<u16>,
}

impl PortsFile {
    /// Written to a file beside `path`, then renamed over it: a reader polling for the
    /// file never sees half of it.
    pub fn write(&self, path: &Path) -> Result<(), ServeError> {
        let err = |source| ServeError::PortsFile {
            path: path.to_owned(),
            source,
        };
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".{}.tmp", std::process::id()));
        let json = serde_json::to_vec(self).map_err(|e| err(e.into()))?;
        std::fs::write(&tmp, json).map_err(err)?;
        std::fs::rename(&tmp, path).map_err(err)
    }
}

/// The port `l` is bound to (0 if the socket cannot say).
pub fn port(l: &TcpListener) -> u16 {
    l.local_addr().map_or(0, |a| a.port())
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

/// Prints `NAME listening on ADDR` to stderr, writes the ports file (`extra` names the
/// service's other listeners), and runs `service` on `main` until it returns; the first
/// SIGINT/SIGTERM cancels its token, a second one exits with 130, and a drain longer than
/// [`SHUTDOWN_GRACE`] exits with 1.
pub async fn serve<F, Fut, E>(
    name: &'static str,
    main: TcpListener,
    (args, extra): (&ListenArgs, PortsFile),
    service: F,
) -> Result<(), ServeError>
where
    F: FnOnce(TcpListener, CancellationToken) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    if let Ok(addr) = main.local_addr() {
        eprintln!("{name} listening on {addr}");
    }
    let ports = PortsFile {
        pid: std::process::id(),
        listen: port(&main),
        ..extra
    };
    let shutdown = CancellationToken::new();
    let mut signals = Signals::new().map_err(ServeError::Signals)?;
    if let Some(path) = &args.ports_file {
        ports.write(path)?;
    }
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
    service(main, shutdown)
        .await
        .map_err(|e| ServeError::Service {
            name,
            source: Box::new(e),
        })
}

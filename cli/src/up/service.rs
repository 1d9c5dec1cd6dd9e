//! One service `up` runs as a child process: started with its listening socket and its
//! secrets, probed until healthy, restarted after a backoff, and stopped in order.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

use super::error::UpError;
use crate::probe;

/// One running service.
pub(super) struct Service {
    pub(super) name: &'static str,
    /// Its command line after the executable, and the secrets it gets in its environment
    /// (the mesh token, the gateway's API key): a restart starts it the same way.
    args: Vec<String>,
    secrets: Secrets,
    pub(super) pid: u32,
    pub(super) child: Child,
    /// Its listening socket's address (a restart binds it again, see [`listen_on`]), and
    /// where to reach it.
    bound: SocketAddr,
    pub(super) addr: SocketAddr,
    pub(super) started: Instant,
}

/// The first wait before restarting a service that exited, the longest, and how long a
/// service must have run for its next exit to count as a fresh one.
pub(super) const BACKOFF_MIN: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
pub(super) const BACKOFF_RESET: Duration = Duration::from_secs(60);

/// How long to wait before restarting one service: [`BACKOFF_MIN`], doubling with every
/// exit that comes within [`BACKOFF_RESET`] of its start, up to [`BACKOFF_MAX`].
#[derive(Debug, Default)]
pub(super) struct Backoff {
    next: Option<Duration>,
}

impl Backoff {
    /// The wait before the restart after an exit of a service that ran for `ran`.
    pub(super) fn after_exit(&mut self, ran: Duration) -> Duration {
        let wait = match self.next {
            Some(d) if ran < BACKOFF_RESET => d,
            _ => BACKOFF_MIN,
        };
        self.next = Some((wait * 2).min(BACKOFF_MAX));
        wait
    }
}

/// Binds a listening socket for one service, which inherits it as [`LISTEN_FD`]
/// (`--listen-fd`): `up` binds every port before it starts any service and lets go of its
/// copy once the service has started, so no port is released and picked again (another
/// process could take it in between), and a service that exits closes its port
/// (connections are refused, not left waiting). A restart binds the same address again.
pub(super) fn listen_on(addr: SocketAddr) -> Result<std::net::TcpListener, UpError> {
    std::net::TcpListener::bind(addr).map_err(|source| UpError::Listen { addr, source })
}

/// The descriptor a service finds its listening socket at.
const LISTEN_FD: i32 = 3;

/// Environment variables a child gets that no command line may show.
pub(super) type Secrets = Vec<(&'static str, String)>;

/// The environment variables [`Secrets`] may set: each is removed from every child that
/// is not given it, so none reaches a child by inheritance.
const SECRET_VARS: [&str; 3] = [
    "PDMESH_API_KEY",
    "PDMESH_ADMIN_KEY",
    pdmesh_tls::auth::TOKEN_ENV,
];

/// Starts `exe SUBCOMMAND --listen ADDR FLAGS --listen-fd 3` as a child in its own
/// process group (so a terminal's Ctrl-C reaches only `up`, which then stops it in order)
/// that is killed if `up` dies, with `listener` as its descriptor 3.
pub(super) fn spawn(
    name: &'static str,
    exe: &Path,
    args: &[String],
    (listener, addr): (&std::net::TcpListener, SocketAddr),
    secrets: &[(&'static str, String)],
) -> Result<Service, UpError> {
    let mut cmd = Command::new(exe);
    // Secrets travel in the environment, not argv, so `ps` does not show them.
    for var in SECRET_VARS {
        cmd.env_remove(var);
    }
    for (var, value) in secrets {
        cmd.env(var, value);
    }
    // Each service names itself in traces (`pdmesh-<service>`); one name set for `up`
    // would merge them all.
    cmd.env_remove("OTEL_SERVICE_NAME");
    // TLS reaches each service as flags, from `up`'s own --tls-* (or PDMESH_TLS_*),
    // which its readiness probes use as well; never by inheritance behind their back.
    for var in ["PDMESH_TLS_CA", "PDMESH_TLS_CERT", "PDMESH_TLS_KEY"] {
        cmd.env_remove(var);
    }
    // `--listen` names the inherited socket's address for whoever reads the command
    // line (`ps`, `pdmesh chaos`); the service serves on the socket itself.
    let bound = listener
        .local_addr()
        .map_err(|source| UpError::Spawn { name, source })?;
    let (sub, flags) = args.split_first().expect("a service subcommand");
    cmd.arg(sub)
        .args(["--listen", &bound.to_string()])
        .args(flags)
        .args(["--listen-fd", &LISTEN_FD.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    cmd.process_group(0);
    let parent = std::process::id();
    let fd = listener.as_raw_fd();
    // SAFETY: the closure runs in the forked child before exec and only calls
    // async-signal-safe functions (prctl, getppid, dup2, fcntl); it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            // The listener at LISTEN_FD, kept open across exec (dup2 clears close-on-exec
            // on the copy; a listener already there keeps its flag, so clear it).
            let kept = if fd == LISTEN_FD {
                libc::fcntl(fd, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, LISTEN_FD)
            };
            if kept < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // `up` may have died between fork and prctl: then nobody would kill us.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::other("parent exited during spawn"));
            }
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .map_err(|source| UpError::Spawn { name, source })?;
    let pid = child.id().unwrap_or(0);
    Ok(Service {
        name,
        args: args.to_vec(),
        secrets: secrets.to_vec(),
        pid,
        child,
        bound,
        addr,
        started: Instant::now(),
    })
}

impl Service {
    /// Starts this service again with the same command line, key and address (bound
    /// again: the exited service's socket closed with it).
    pub(super) fn respawn(&self, exe: &Path) -> Result<Service, UpError> {
        let listener = listen_on(self.bound)?;
        spawn(
            self.name,
            exe,
            &self.args,
            (&listener, self.addr),
            &self.secrets,
        )
    }
}

/// Sends `sig` to the child's whole process group.
pub(super) fn signal_group(pid: u32, sig: libc::c_int) {
    if pid == 0 {
        return;
    }
    // SAFETY: kill(2) has no memory-safety preconditions; a negative pid names the
    // process group the child leads (it was started with process_group(0)).
    let _ = unsafe { libc::kill(-(pid as libc::pid_t), sig) };
}

/// SIGTERM to every child still running, then SIGKILL to those that outlive `grace`.
pub(super) async fn stop_all(services: &mut [Service], grace: Duration) {
    for s in services.iter_mut() {
        if matches!(s.child.try_wait(), Ok(None)) {
            signal_group(s.pid, libc::SIGTERM);
        }
    }
    let deadline = tokio::time::Instant::now() + grace;
    for s in services.iter_mut() {
        match tokio::time::timeout_at(deadline, s.child.wait()).await {
            Ok(_) => {}
            Err(_) => {
                eprintln!(
                    "pdmesh up: the {} (pid {}) did not stop within {grace:?}; killing it",
                    s.name, s.pid
                );
                signal_group(s.pid, libc::SIGKILL);
                let _ = s.child.start_kill();
                let _ = s.child.wait().await;
            }
        }
        // Anything the child left in its group goes too.
        signal_group(s.pid, libc::SIGKILL);
    }
}

async fn healthy(s: &Service, tls: &pdmesh_tls::MeshAuth) -> bool {
    match s.name {
        "tokenizer" => probe::tokenizer_healthy(s.addr, tls).await,
        "cache" => probe::cache_healthy(s.addr, tls).await,
        "gateway" => probe::http_status(s.addr, "/health").await == Some(200),
        _ => probe::worker_healthy(s.addr, tls).await,
    }
}

/// Polls every service until all are healthy; fails fast if one exits.
pub(super) async fn wait_healthy(
    services: &mut [Service],
    timeout: Duration,
    tls: &pdmesh_tls::MeshAuth,
) -> Result<(), UpError> {
    let start = Instant::now();
    let mut ready = vec![false; services.len()];
    loop {
        for (i, s) in services.iter_mut().enumerate() {
            if let Ok(Some(status)) = s.child.try_wait() {
                return Err(UpError::EarlyExit {
                    name: s.name,
                    pid: s.pid,
                    status,
                });
            }
            if !ready[i] && healthy(s, tls).await {
                ready[i] = true;
                eprintln!("pdmesh up: {} is ready on {}", s.name, s.addr);
            }
        }
        if ready.iter().all(|&r| r) {
            return Ok(());
        }
        if start.elapsed() >= timeout {
            let pending: Vec<String> = services
                .iter()
                .zip(&ready)
                .filter(|(_, r)| !**r)
                .map(|(s, _)| format!("{} (pid {}, {})", s.name, s.pid, s.addr))
                .collect();
            return Err(UpError::StartupTimeout {
                secs: timeout.as_secs(),
                pending: pending.join(", "),
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

//! `pdmesh up`: the whole mesh on one machine. Tokenizer, cache service (unless
//! `--no-host-cache`), worker and gateway run as separate child processes of this one (the same binary, re-executed with a service
//! subcommand) on loopback ports. `up` waits until each is healthy, prints the URL, then
//! supervises: a signal stops all children; a child that exits stops the others and
//! makes `up` fail naming it — or, with `--restart`, is started again the same way after
//! a backoff. Children die with `up` even if it is killed outright.
//!
//! With `--role`, `up` runs one host's part of a mesh over several: `prefill` or `decode`
//! (that host's cache service and workers, on `--host` at fixed ports) or `gateway` (the
//! tokenizer and the gateway, in front of the other hosts' workers).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use futures::future::select_all;
use pdmesh_gguf::models::{DEFAULT_MODEL, cached_model_path};
use tokio::process::{Child, Command};

use crate::args::{UpArgs, UpRole};
use crate::fetch::{self, FetchError, Outcome};
use crate::probe;
use crate::serve::Signals;

/// Why `up` failed.
#[derive(Debug, thiserror::Error)]
pub enum UpError {
    #[error(
        "the model file {0} does not exist: run `pdmesh model fetch` for the default model, \
         or pass --model PATH.gguf (or a checkpoint directory)"
    )]
    ModelMissing(PathBuf),
    #[error("fetching the default model failed")]
    Fetch(#[from] FetchError),
    #[error("cannot find this executable to start the services")]
    CurrentExe(#[source] std::io::Error),
    #[error("cannot listen on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the {name}")]
    Spawn {
        name: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("installing signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("the {name} (pid {pid}) exited with {status} before the mesh was ready")]
    EarlyExit {
        name: &'static str,
        pid: u32,
        status: ExitStatus,
    },
    #[error(
        "not healthy after {secs} s: {pending} (see the log above; raise --startup-timeout if the machine is slow)"
    )]
    StartupTimeout { secs: u64, pending: String },
    #[error("the {name} (pid {pid}) exited with {status}; stopped the other services")]
    ChildExited {
        name: &'static str,
        pid: u32,
        status: ExitStatus,
    },
    #[error(
        "disaggregated prefill/decode workers meet at the cache service: drop --no-host-cache, or add --unified"
    )]
    PdNeedsCache,
    #[error("--prefill and --decode must each be at least 1")]
    NoWorkers,
    #[error("{0}")]
    Role(String),
    #[error(transparent)]
    Tls(#[from] pdmesh_tls::TlsError),
    #[error("writing {path}")]
    PortsJson {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// How `up` ended without an error.
#[derive(Debug, PartialEq, Eq)]
pub enum Stopped {
    /// A signal asked for it.
    BySignal(&'static str),
}

/// One running service.
struct Service {
    name: &'static str,
    /// Its command line after the executable, and the secrets it gets in its environment
    /// (the mesh token, the gateway's API key): a restart starts it the same way.
    args: Vec<String>,
    secrets: Secrets,
    pid: u32,
    child: Child,
    /// Its listening socket's address (a restart binds it again, see [`listen_on`]), and
    /// where to reach it.
    bound: SocketAddr,
    addr: SocketAddr,
    started: Instant,
}

/// The first wait before restarting a service that exited, the longest, and how long a
/// service must have run for its next exit to count as a fresh one.
const BACKOFF_MIN: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
const BACKOFF_RESET: Duration = Duration::from_secs(60);

/// How long to wait before restarting one service: [`BACKOFF_MIN`], doubling with every
/// exit that comes within [`BACKOFF_RESET`] of its start, up to [`BACKOFF_MAX`].
#[derive(Debug, Default)]
struct Backoff {
    next: Option<Duration>,
}

impl Backoff {
    /// The wait before the restart after an exit of a service that ran for `ran`.
    fn after_exit(&mut self, ran: Duration) -> Duration {
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
fn listen_on(addr: SocketAddr) -> Result<std::net::TcpListener, UpError> {
    std::net::TcpListener::bind(addr).map_err(|source| UpError::Listen { addr, source })
}

/// The descriptor a service finds its listening socket at.
const LISTEN_FD: i32 = 3;

/// The model to serve: `--model`, else the cached default, fetched when missing.
fn resolve_model(arg: Option<&Path>) -> Result<PathBuf, UpError> {
    let default = cached_model_path(&DEFAULT_MODEL);
    let path = arg.map_or_else(|| default.clone(), Path::to_path_buf);
    // A GGUF file, or a checkpoint directory (DeepSeek V3.2: config.json, safetensors).
    if path.is_file() || path.join("config.json").is_file() {
        return Ok(path);
    }
    if path != default {
        return Err(UpError::ModelMissing(path));
    }
    eprintln!("the default model is not installed yet; fetching it (same as `pdmesh model fetch`)");
    match fetch::fetch_default(None)? {
        Outcome::Installed(p) | Outcome::AlreadyInstalled(p) => Ok(p),
    }
}

/// Environment variables a child gets that no command line may show.
type Secrets = Vec<(&'static str, String)>;

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
fn spawn(
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
    fn respawn(&self, exe: &Path) -> Result<Service, UpError> {
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
fn signal_group(pid: u32, sig: libc::c_int) {
    if pid == 0 {
        return;
    }
    // SAFETY: kill(2) has no memory-safety preconditions; a negative pid names the
    // process group the child leads (it was started with process_group(0)).
    let _ = unsafe { libc::kill(-(pid as libc::pid_t), sig) };
}

/// SIGTERM to every child still running, then SIGKILL to those that outlive `grace`.
async fn stop_all(services: &mut [Service], grace: Duration) {
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

/// The name of the i-th worker of a kind: `prefill`, then `prefill-2`, ...
fn worker_name(kind: &'static str, i: usize) -> &'static str {
    if i == 0 {
        kind
    } else {
        // A handful per run, for the life of the process.
        Box::leak(format!("{kind}-{}", i + 1).into_boxed_str())
    }
}

/// Where to reach a server bound to `host`: wildcard addresses are probed on loopback.
fn reachable(host: IpAddr, port: u16) -> SocketAddr {
    let ip = match host {
        IpAddr::V4(v) if v.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v) if v.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, port)
}

/// Polls every service until all are healthy; fails fast if one exits.
async fn wait_healthy(
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

/// Asks the served model one question through the gateway and prints the answer, so a
/// first `pdmesh up` shows the whole path works. A failure is reported, not fatal.
async fn smoke_test(gateway: SocketAddr, model: &str, api_key: Option<&str>) {
    const QUESTION: &str = "What is the capital of France? Answer in one sentence.";
    let body = serde_json::json!({
        "model": model,
        "messages": [{ "role": "user", "content": QUESTION }],
        "max_tokens": 48,
        "temperature": 0,
    });
    let answer = probe::http_post_json(
        gateway,
        "/v1/chat/completions",
        &body,
        api_key,
        SMOKE_TIMEOUT,
    )
    .await;
    match answer {
        Some((200, bytes)) => {
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            match v["choices"][0]["message"]["content"].as_str() {
                Some(text) => {
                    println!("asked: {QUESTION}");
                    println!("model: {}", text.trim());
                }
                None => eprintln!(
                    "pdmesh up: the first test question's answer has no message content: {}",
                    String::from_utf8_lossy(&bytes)
                ),
            }
        }
        Some((status, bytes)) => {
            eprintln!(
                "pdmesh up: the first test question failed with HTTP {status}: {}",
                String::from_utf8_lossy(&bytes)
            );
        }
        None => {
            eprintln!("pdmesh up: the first test question got no answer within {SMOKE_TIMEOUT:?}")
        }
    }
}

/// Longest the first test question may take.
const SMOKE_TIMEOUT: Duration = Duration::from_secs(120);

/// What the ports file says besides the process ids (which change when a service is
/// restarted).
struct MeshLayout {
    url: String,
    host: IpAddr,
    pd: bool,
    gateway: u16,
    tokenizer: u16,
    /// (name, port) of each worker of a role, in start order; the first one overall (the
    /// unified worker or the first decode worker) is "worker".
    workers: Vec<(&'static str, &'static str, u16)>,
    /// 0 without a cache service.
    cache: u16,
    model: String,
    restart: bool,
}

impl MeshLayout {
    /// The ports file's JSON, each service's pid from `pid` (by name; 0 when absent).
    fn json(&self, pid: impl Fn(&str) -> u32) -> serde_json::Value {
        let ports = |kind: &str| {
            let of = self.workers.iter().filter(|w| w.1 == kind);
            of.map(|w| w.2).collect::<Vec<_>>()
        };
        let pids = |kind: &str| {
            let of = self.workers.iter().filter(|w| w.1 == kind);
            of.map(|w| pid(w.0)).collect::<Vec<_>>()
        };
        let first = self.workers.first();
        serde_json::json!({
            "url": self.url,
            "host": self.host.to_string(),
            "mode": if self.pd { "pd" } else { "unified" },
            "gateway": self.gateway,
            "tokenizer": self.tokenizer,
            // The unified worker, or the first decode worker.
            "worker": first.map_or(0, |w| w.2),
            "prefill": ports("prefill"),
            "decode": ports("decode"),
            "cache": self.cache,
            "model": self.model,
            // Whether `up` restarts a service that exits (`--restart`).
            "restart": self.restart,
            "pids": {
                "up": std::process::id(),
                "tokenizer": pid("tokenizer"),
                "worker": first.map_or(0, |w| pid(w.0)),
                "prefill": pids("prefill"),
                "decode": pids("decode"),
                "gateway": pid("gateway"),
                "cache": pid("cache"),
            },
        })
    }

    /// Writes the ports file with the services' current pids.
    fn write(&self, path: &Path, services: &[Service]) -> Result<(), UpError> {
        let value = self.json(|name| {
            services
                .iter()
                .find(|s| s.name == name)
                .map_or(0, |s| s.pid)
        });
        write_ports_json(path, &value)
    }
}

fn write_ports_json(path: &Path, value: &serde_json::Value) -> Result<(), UpError> {
    let err = |source| UpError::PortsJson {
        path: path.to_owned(),
        source,
    };
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, format!("{value:#}\n")).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// Runs the mesh until a signal (`Ok`) or until a child exits (`Err` naming it; with
/// `--restart`, the child is started again and only a failed start ends the mesh). Must
/// run on a current-thread runtime: the parent-death signal is tied to the spawning thread
/// (restarted children are spawned from it too).
/// Flags that belong to another role, or that a role cannot do without.
fn check_role(args: &UpArgs) -> Result<(), UpError> {
    let role = args.role;
    let bad = |m: String| Err(UpError::Role(m));
    let remote = [
        ("--prefill-url", !args.prefill_url.is_empty()),
        ("--decode-url", !args.decode_url.is_empty()),
        ("--cache-url", !args.cache_url.is_empty()),
    ];
    match role {
        UpRole::Gateway => {
            if args.prefill_url.is_empty() || args.decode_url.is_empty() {
                return bad("--role gateway needs --prefill-url and --decode-url (the other hosts' workers)".into());
            }
            if args.unified {
                return bad(
                    "--role gateway fronts prefill and decode hosts: drop --unified".into(),
                );
            }
            for u in args
                .prefill_url
                .iter()
                .chain(&args.decode_url)
                .chain(&args.cache_url)
            {
                if !u.starts_with("http://") && !u.starts_with("https://") {
                    return bad(format!("{u:?} is not an http:// URL"));
                }
            }
        }
        UpRole::All => {
            if let Some((flag, _)) = remote.iter().find(|r| r.1) {
                return bad(format!(
                    "{flag} names other hosts' services: it needs --role gateway"
                ));
            }
        }
        UpRole::Prefill | UpRole::Decode => {
            if let Some((flag, _)) = remote.iter().find(|r| r.1) {
                return bad(format!(
                    "{flag} is for --role gateway, not --role {}",
                    role.name()
                ));
            }
            if args.unified {
                return bad(format!(
                    "--role {} runs one side of disaggregation: drop --unified",
                    role.name()
                ));
            }
            let n = if role == UpRole::Decode {
                args.decode
            } else {
                args.prefill
            };
            if args.worker_port == 0 || usize::from(args.worker_port) + n > 65536 {
                return bad(format!(
                    "--worker-port {} leaves no room for {n} workers",
                    args.worker_port
                ));
            }
            if args.cache_port == 0 {
                return bad("--cache-port must be a port, not 0".into());
            }
            if args.host.is_unspecified() || args.host.is_loopback() {
                return bad(format!(
                    "--role {} needs --host set to this host's address that the other hosts reach (not {})",
                    role.name(),
                    args.host
                ));
            }
        }
    }
    Ok(())
}

/// The address of `url`'s host and port.
async fn url_addr(url: &str) -> Result<SocketAddr, UpError> {
    let bad = || UpError::Role(format!("{url:?} is not a reachable http://HOST:PORT URL"));
    let uri: http::Uri = url.parse().map_err(|_| bad())?;
    let host = uri
        .host()
        .ok_or_else(bad)?
        .trim_matches(['[', ']'])
        .to_owned();
    let port = uri.port_u16().ok_or_else(bad)?;
    tokio::net::lookup_host((host.as_str(), port))
        .await
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(bad)
}

pub async fn run(args: UpArgs) -> Result<Stopped, UpError> {
    let mut signals = Signals::new().map_err(UpError::Signals)?;
    let model = resolve_model(args.model.as_deref())?;
    let exe = std::env::current_exe().map_err(UpError::CurrentExe)?;
    let pd = !args.unified;
    if pd && args.no_host_cache {
        return Err(UpError::PdNeedsCache);
    }
    if pd && (args.prefill == 0 || args.decode == 0) {
        return Err(UpError::NoWorkers);
    }
    check_role(&args)?;
    let role = args.role;
    // The mesh credential: the one given (TLS, a token file or PDMESH_MESH_TOKEN), else a
    // token made for this mesh; every child gets the token in its environment.
    let mut tls = args.tls.auth()?;
    if tls.mesh_token().is_none() {
        tls = pdmesh_tls::MeshAuth::new(
            tls.tls().cloned(),
            Some(pdmesh_tls::MeshToken::generate()),
            tls.is_insecure(),
        );
    }
    let mesh_env: Secrets = tls
        .mesh_token()
        .map(|t| (pdmesh_tls::auth::TOKEN_ENV, t.expose().to_owned()))
        .into_iter()
        .collect();
    let tls_args = args.tls.to_args();
    let (has_gateway, has_cache) = (
        matches!(role, UpRole::All | UpRole::Gateway),
        !args.no_host_cache && role != UpRole::Gateway,
    );
    // Every service's socket, bound here before any starts (see `listen_on`); the gateway's first,
    // so that a port the user named is taken before the kernel picks any other.
    let gateway_sock = has_gateway
        .then(|| listen_on(SocketAddr::new(args.host, args.port)))
        .transpose()?;
    let local = || listen_on(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0));
    let tok_sock = has_gateway.then(local).transpose()?;
    // (name, role subcommand, socket, extra flags): the decode worker (or the unified
    // one) first.
    let mut workers: Vec<(&'static str, &'static str, std::net::TcpListener, &[String])> =
        Vec::new();
    // This host's part of a mesh over several: its services on --host at fixed ports.
    let on_host = |port: u16| listen_on(SocketAddr::new(args.host, port));
    let part = match role {
        UpRole::Decode => Some(("decode", args.decode, &args.decode_args)),
        UpRole::Prefill => Some(("prefill", args.prefill, &args.prefill_args)),
        UpRole::All | UpRole::Gateway => None,
    };
    if let Some((kind, n, extra)) = part {
        for i in 0..n {
            let port = u16::try_from(i)
                .ok()
                .and_then(|i| args.worker_port.checked_add(i))
                .filter(|&p| p != 0)
                .ok_or_else(|| {
                    UpError::Role(format!(
                        "--worker-port {} leaves no room for {n} workers",
                        args.worker_port
                    ))
                })?;
            workers.push((worker_name(kind, i), kind, on_host(port)?, extra));
        }
    } else if role == UpRole::Gateway {
        // No workers here: they are on the other hosts.
    } else if pd {
        for i in 0..args.decode {
            workers.push((
                worker_name("decode", i),
                "decode",
                local()?,
                &args.decode_args,
            ));
        }
        for i in 0..args.prefill {
            workers.push((
                worker_name("prefill", i),
                "prefill",
                local()?,
                &args.prefill_args,
            ));
        }
    } else {
        workers.push(("worker", "worker", local()?, &[]));
    }
    let bound = |l: &std::net::TcpListener| {
        l.local_addr()
            .map(|a| reachable(a.ip(), a.port()))
            .map_err(|source| UpError::Listen {
                addr: SocketAddr::new(args.host, 0),
                source,
            })
    };
    let workers = workers
        .into_iter()
        .map(|(name, sub, l, extra)| Ok((name, sub, bound(&l)?, extra, l)))
        .collect::<Result<Vec<_>, UpError>>()?;
    let worker_addr = match role {
        // The model id comes from the first decode worker on another host.
        UpRole::Gateway => url_addr(&args.decode_url[0]).await?,
        _ => workers[0].2,
    };
    let cache_sock = match role {
        _ if !has_cache => None,
        UpRole::Prefill | UpRole::Decode => Some(on_host(args.cache_port)?),
        _ => Some(local()?),
    };
    let cache_addr = cache_sock.as_ref().map(bound).transpose()?;
    let tok_addr = tok_sock.as_ref().map(bound).transpose()?;
    let port = match &gateway_sock {
        Some(l) => bound(l)?.port(),
        None => args.port,
    };
    let model_arg = model.to_string_lossy().into_owned();
    // Every service writes its incident reports into one directory.
    let incident_dir = args
        .incident_dir
        .clone()
        .unwrap_or_else(crate::incident::default_dir)
        .display()
        .to_string();
    // Reports' replay commands name the gateway as this machine reaches it.
    let replay_url = format!("http://{}/v1", reachable(args.host, port));

    let mut services = Vec::new();
    let started = (|| -> Result<(), UpError> {
        if let (Some(sock), Some(addr)) = (&tok_sock, tok_addr) {
            let mut tok_args = vec!["tokenizer".into(), "--model".into(), model_arg.clone()];
            tok_args.extend(tls_args.iter().cloned());
            services.push(spawn(
                "tokenizer",
                &exe,
                &tok_args,
                (sock, addr),
                &mesh_env,
            )?);
        }
        if let (Some(sock), Some(addr)) = (&cache_sock, cache_addr) {
            let mut cache_args = vec![
                "cache".into(),
                "--incident-dir".into(),
                incident_dir.clone(),
            ];
            cache_args.extend(tls_args.iter().cloned());
            cache_args.extend(args.cache_args.iter().cloned());
            services.push(spawn("cache", &exe, &cache_args, (sock, addr), &mesh_env)?);
        }
        for (name, sub, addr, extra, sock) in &workers {
            let mut worker_args = vec![
                (*sub).into(),
                "--model".into(),
                model_arg.clone(),
                "--incident-dir".into(),
                incident_dir.clone(),
            ];
            if has_gateway {
                worker_args.extend(["--incident-replay-url".into(), replay_url.clone()]);
            }
            if let Some(cache) = cache_addr {
                worker_args.extend(["--cache-url".into(), format!("http://{cache}")]);
            }
            worker_args.extend(tls_args.iter().cloned());
            worker_args.extend(args.worker_args.iter().cloned());
            worker_args.extend(extra.iter().cloned());
            services.push(spawn(name, &exe, &worker_args, (sock, *addr), &mesh_env)?);
        }
        let (Some(gateway_sock), Some(tok_addr)) = (&gateway_sock, tok_addr) else {
            return Ok(());
        };
        let urls = |kind: &str| {
            workers
                .iter()
                .filter(|w| w.1 == kind)
                .map(|w| format!("http://{}", w.2))
                .collect::<Vec<_>>()
                .join(",")
        };
        let mut gw_args = vec![
            "gateway".into(),
            "--tokenizer-url".into(),
            format!("http://{tok_addr}"),
            // The tokenizer's own model file: the gateway detokenizes in process.
            "--model".into(),
            model_arg.clone(),
            "--incident-dir".into(),
            incident_dir.clone(),
            "--incident-replay-url".into(),
            replay_url.clone(),
        ];
        if role == UpRole::Gateway {
            gw_args.extend(["--prefill-url".into(), args.prefill_url.join(",")]);
            gw_args.extend(["--decode-url".into(), args.decode_url.join(",")]);
            if !args.cache_url.is_empty() {
                gw_args.extend(["--cache-url".into(), args.cache_url.join(",")]);
            }
        } else if pd {
            gw_args.extend(["--prefill-url".into(), urls("prefill")]);
            gw_args.extend(["--decode-url".into(), urls("decode")]);
        } else {
            gw_args.extend(["--worker-url".into(), format!("http://{worker_addr}")]);
        }
        if let Some(cache) = cache_addr {
            gw_args.extend(["--cache-url".into(), format!("http://{cache}")]);
        }
        gw_args.extend(tls_args.iter().cloned());
        gw_args.extend(args.gateway_args.iter().cloned());
        services.push(spawn(
            "gateway",
            &exe,
            &gw_args,
            (gateway_sock, reachable(args.host, port)),
            &[
                mesh_env.clone(),
                args.api_key
                    .iter()
                    .map(|k| ("PDMESH_API_KEY", k.clone()))
                    .collect(),
                args.admin_key
                    .iter()
                    .map(|k| ("PDMESH_ADMIN_KEY", k.clone()))
                    .collect(),
            ]
            .concat(),
        )?);
        Ok(())
    })();
    // Each started service has its own copy of its socket: `up` lets go of its copies,
    // so a service that exits closes its port.
    drop((gateway_sock, tok_sock, cache_sock));
    let workers: Vec<_> = workers
        .into_iter()
        .map(|(name, sub, addr, extra, _)| (name, sub, addr, extra))
        .collect();
    let grace = Duration::from_secs(args.grace);
    if let Err(e) = started {
        stop_all(&mut services, grace).await;
        return Err(e);
    }
    for s in &services {
        eprintln!(
            "pdmesh up: started the {} (pid {}) on {}",
            s.name, s.pid, s.addr
        );
    }

    let ready = tokio::select! {
        r = wait_healthy(&mut services, Duration::from_secs(args.startup_timeout), &tls) => r.map(|()| None),
        sig = signals.recv() => Ok(Some(sig)),
    };
    match ready {
        Err(e) => {
            stop_all(&mut services, grace).await;
            return Err(e);
        }
        Ok(Some(sig)) => {
            eprintln!("pdmesh up: {sig} received during startup; stopping");
            stop_all(&mut services, grace).await;
            return Ok(Stopped::BySignal(sig));
        }
        Ok(None) => {}
    }

    let model_id = probe::worker_model_id(worker_addr, &tls)
        .await
        .unwrap_or_else(|| DEFAULT_MODEL.id.to_owned());
    let shown = reachable(args.host, port);
    let url = format!("http://{shown}/v1");
    // Before the ports file: whoever waits for that file finds an idle mesh.
    if has_gateway && !args.no_smoke_test {
        tokio::select! {
            () = smoke_test(shown, &model_id, args.api_key.as_deref()) => {}
            sig = signals.recv() => {
                eprintln!("pdmesh up: {sig} received; stopping the services");
                stop_all(&mut services, grace).await;
                return Ok(Stopped::BySignal(sig));
            }
        }
    }
    let layout = MeshLayout {
        url: url.clone(),
        host: shown.ip(),
        pd,
        gateway: if has_gateway { port } else { 0 },
        tokenizer: tok_addr.map_or(0, |a| a.port()),
        workers: workers.iter().map(|w| (w.0, w.1, w.2.port())).collect(),
        cache: cache_addr.map_or(0, |a| a.port()),
        model: model_id.clone(),
        restart: args.restart,
    };
    if let Some(path) = &args.ports_json
        && let Err(e) = layout.write(path, &services)
    {
        stop_all(&mut services, grace).await;
        return Err(e);
    }
    let auth = match (&args.api_key, std::env::var_os("PDMESH_API_KEY")) {
        (None, _) => "",
        (Some(_), Some(_)) => " -H \"Authorization: Bearer $PDMESH_API_KEY\"",
        (Some(_), None) => " -H 'Authorization: Bearer <your --api-key>'",
    };
    if has_gateway {
        println!("pdmesh is up: {url} (model {model_id})");
        println!("try:");
        println!(
            "  curl {url}/chat/completions -H 'Content-Type: application/json'{auth} \\\n    -d '{{\"model\": \"{model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'"
        );
    } else {
        let kind = role.name();
        let list: Vec<String> = workers.iter().map(|w| format!("http://{}", w.2)).collect();
        let cache = cache_addr.map_or_else(String::new, |a| format!("http://{a}"));
        println!("pdmesh {kind} host is up (model {model_id}): cache service {cache}");
        println!(
            "  give the gateway host --{kind}-url {} --cache-url {cache}",
            list.join(",")
        );
        let peers_named = args.cache_args.iter().any(|a| a.starts_with("--peer"));
        if tls.tls().is_none() && !peers_named {
            // Without TLS a cache service relays rooms only to the homes --peer names.
            println!(
                "  and, without TLS, name the other hosts' cache services here: --cache-arg=--peer=http://HOST:PORT"
            );
        }
    }
    println!("press Ctrl-C to stop");

    let mut backoff: Vec<Backoff> = services.iter().map(|_| Backoff::default()).collect();
    loop {
        let exited = tokio::select! {
            (status, i, _) = select_all(services.iter_mut().map(|s| Box::pin(s.child.wait()))) => Ok((i, status)),
            sig = signals.recv() => Err(sig),
        };
        let (i, status) = match exited {
            Ok(x) => x,
            Err(sig) => {
                eprintln!("pdmesh up: {sig} received; stopping the services");
                stop_all(&mut services, grace).await;
                return Ok(Stopped::BySignal(sig));
            }
        };
        let (name, pid) = (services[i].name, services[i].pid);
        let status = match status {
            Ok(s) => s,
            Err(e) => {
                eprintln!("pdmesh up: waiting for the {name} failed: {e}");
                ExitStatus::default()
            }
        };
        if !args.restart {
            eprintln!(
                "pdmesh up: the {name} (pid {pid}) exited with {status}; stopping the other services"
            );
            stop_all(&mut services, grace).await;
            return Err(UpError::ChildExited { name, pid, status });
        }
        // Whatever the service left in its process group goes with it.
        signal_group(pid, libc::SIGKILL);
        let wait = backoff[i].after_exit(services[i].started.elapsed());
        eprintln!(
            "pdmesh up: the {name} (pid {pid}) exited with {status}; restarting it in {} s",
            wait.as_secs_f64()
        );
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            sig = signals.recv() => {
                eprintln!("pdmesh up: {sig} received; stopping the services");
                stop_all(&mut services, grace).await;
                return Ok(Stopped::BySignal(sig));
            }
        }
        match services[i].respawn(&exe) {
            Ok(s) => services[i] = s,
            Err(e) => {
                eprintln!("pdmesh up: restarting the {name} failed; stopping the other services");
                stop_all(&mut services, grace).await;
                return Err(e);
            }
        }
        eprintln!(
            "pdmesh up: restarted the {name} (pid {}) on {}",
            services[i].pid, services[i].addr
        );
        if let Some(path) = &args.ports_json
            && let Err(e) = layout.write(path, &services)
        {
            stop_all(&mut services, grace).await;
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcard_hosts_are_probed_on_loopback() {
        assert_eq!(
            reachable("0.0.0.0".parse().unwrap(), 80),
            "127.0.0.1:80".parse().unwrap()
        );
        assert_eq!(
            reachable("::".parse().unwrap(), 80),
            "[::1]:80".parse().unwrap()
        );
        assert_eq!(
            reachable("10.1.2.3".parse().unwrap(), 80),
            "10.1.2.3:80".parse().unwrap()
        );
    }

    #[test]
    fn an_explicit_missing_model_says_how_to_get_one() {
        let err = resolve_model(Some(Path::new("/nonexistent/model.gguf"))).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("pdmesh model fetch"), "{msg}");
        assert!(msg.contains("/nonexistent/model.gguf"), "{msg}");
    }

    fn up(argv: &[&str]) -> UpArgs {
        use clap::Parser;
        let cli = crate::args::Cli::try_parse_from(["pdmesh", "up"].iter().chain(argv)).unwrap();
        match cli.command {
            crate::args::Command::Up(u) => u,
            _ => unreachable!(),
        }
    }

    #[test]
    fn each_role_refuses_the_flags_of_another_and_needs_its_own() {
        let err = |argv: &[&str]| check_role(&up(argv)).unwrap_err().to_string();
        assert!(check_role(&up(&[])).is_ok());
        assert!(err(&["--prefill-url", "http://10.0.0.2:7200"]).contains("--role gateway"));
        assert!(err(&["--role", "gateway"]).contains("--prefill-url and --decode-url"));
        let gw = [
            "--role",
            "gateway",
            "--prefill-url",
            "http://10.0.0.2:7200",
            "--decode-url",
            "http://10.0.0.3:7200",
        ];
        assert!(check_role(&up(&gw)).is_ok());
        assert!(err(&[&gw[..], &["--unified"]].concat()).contains("--unified"));
        assert!(err(&[&gw[..], &["--cache-url", "10.0.0.3:7100"]].concat()).contains("http://"));
        // A host's part must listen where the other hosts reach it.
        assert!(err(&["--role", "decode"]).contains("--host"));
        assert!(err(&["--role", "decode", "--host", "0.0.0.0"]).contains("--host"));
        assert!(check_role(&up(&["--role", "decode", "--host", "10.0.0.3"])).is_ok());
        let d = ["--role", "decode", "--host", "10.0.0.3"];
        assert!(
            err(&[&d[..], &["--worker-port", "65535", "--decode", "2"]].concat())
                .contains("--worker-port")
        );
        assert!(err(&[&d[..], &["--worker-port", "0"]].concat()).contains("--worker-port"));
        assert!(err(&[&d[..], &["--cache-port", "0"]].concat()).contains("--cache-port"));
        assert!(
            check_role(&up(
                &[&d[..], &["--worker-port", "65534", "--decode", "2"]].concat()
            ))
            .is_ok()
        );
        assert!(
            err(&[
                "--role",
                "prefill",
                "--host",
                "10.0.0.2",
                "--decode-url",
                "http://x:1"
            ])
            .contains("--decode-url is for --role gateway")
        );
    }

    #[test]
    fn restarts_back_off_doubling_up_to_a_cap_and_reset_after_a_long_run() {
        let mut b = Backoff::default();
        let quick = Duration::from_secs(2);
        let waits: Vec<u64> = (0..7).map(|_| b.after_exit(quick).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
        // A service that stayed up a while starts again from the shortest wait.
        assert_eq!(b.after_exit(BACKOFF_RESET), BACKOFF_MIN);
        assert_eq!(b.after_exit(quick), Duration::from_secs(2));
    }

    #[test]
    fn the_ports_file_names_every_pid_and_whether_up_restarts() {
        let layout = MeshLayout {
            url: "http://127.0.0.1:8080/v1".into(),
            host: "127.0.0.1".parse().unwrap(),
            pd: true,
            gateway: 8080,
            tokenizer: 1,
            workers: vec![
                ("decode", "decode", 2),
                ("prefill", "prefill", 3),
                ("prefill-2", "prefill", 4),
            ],
            cache: 5,
            model: "m".into(),
            restart: true,
        };
        let pids = |name: &str| match name {
            "decode" => 20,
            "prefill" => 30,
            "prefill-2" => 40,
            "gateway" => 80,
            _ => 0,
        };
        let v = layout.json(pids);
        assert_eq!(v["restart"], true);
        assert_eq!(v["mode"], "pd");
        assert_eq!(v["worker"], 2);
        assert_eq!(v["prefill"], serde_json::json!([3, 4]));
        assert_eq!(v["decode"], serde_json::json!([2]));
        assert_eq!(
            v["pids"]["worker"], 20,
            "the first worker is the decode worker"
        );
        assert_eq!(v["pids"]["prefill"], serde_json::json!([30, 40]));
        assert_eq!(v["pids"]["gateway"], 80);
        assert_eq!(v["pids"]["up"], std::process::id());
        let unified = MeshLayout {
            pd: false,
            workers: vec![("worker", "worker", 2)],
            restart: false,
            ..layout
        };
        let v = unified.json(|n| if n == "worker" { 7 } else { 0 });
        assert_eq!(
            (v["mode"].as_str(), v["restart"].as_bool()),
            (Some("unified"), Some(false))
        );
        assert_eq!(v["pids"]["worker"], 7);
        assert_eq!(v["prefill"], serde_json::json!([]));
    }
}

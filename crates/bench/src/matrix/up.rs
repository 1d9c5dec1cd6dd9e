//! A mesh `pdmesh up` runs for one configuration of the matrix: a child process, started
//! until its ports file appears, and stopped in order (also when dropped).

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::error::MatrixError;
use crate::mesh::MeshFile;

/// A mesh `pdmesh up` runs for the matrix: stopped (SIGTERM, then SIGKILL after a grace)
/// by [`Up::stop`], or on drop.
pub(super) struct Up {
    child: tokio::process::Child,
    file: Option<MeshFile>,
}

impl Up {
    pub(super) async fn start(
        exe: &Path,
        args: &[String],
        api_key: Option<&str>,
        dir: &Path,
        timeout: Duration,
    ) -> Result<Self, MatrixError> {
        std::fs::create_dir_all(dir)
            .map_err(MatrixError::io(format!("creating {}", dir.display())))?;
        let ports = dir.join("ports.json");
        let _ = std::fs::remove_file(&ports);
        let log_path = dir.join("mesh.log");
        let log = std::fs::File::create(&log_path)
            .map_err(MatrixError::io(format!("creating {}", log_path.display())))?;
        let err_log = log
            .try_clone()
            .map_err(MatrixError::io(format!("opening {}", log_path.display())))?;
        let mut argv: Vec<String> = vec![
            "up".into(),
            "--port".into(),
            "0".into(),
            "--no-smoke-test".into(),
            "--ports-json".into(),
            ports.display().to_string(),
        ];
        argv.extend(args.iter().cloned());
        let shown = argv.join(" ");
        let mut cmd = tokio::process::Command::new(exe);
        cmd.args(&argv)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log)
            .kill_on_drop(true);
        if let Some(key) = api_key {
            cmd.env("PDMESH_API_KEY", key);
        }
        let fail = |why: String| MatrixError::Mesh {
            args: shown.clone(),
            why,
            log: tail(&log_path),
        };
        let mut child = cmd.spawn().map_err(|e| fail(e.to_string()))?;
        let t0 = Instant::now();
        loop {
            if let Ok(file) = MeshFile::read(&ports) {
                return Ok(Self {
                    child,
                    file: Some(file),
                });
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(fail(format!("it exited with {status}")));
            }
            if t0.elapsed() > timeout {
                let mut up = Self { child, file: None };
                up.stop().await;
                return Err(fail(format!("not up after {} s", timeout.as_secs())));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub(super) fn file(&self) -> &MeshFile {
        self.file
            .as_ref()
            .expect("a started mesh has its ports file")
    }

    /// SIGTERM (`up` stops its services), then SIGKILL after 30 s.
    pub(super) async fn stop(&mut self) {
        if let Some(pid) = self
            .child
            .id()
            .and_then(|p| rustix::process::Pid::from_raw(p as i32))
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            if tokio::time::timeout(Duration::from_secs(30), self.child.wait())
                .await
                .is_ok()
            {
                return;
            }
        }
        let _ = self.child.kill().await;
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        // An early return (an error, Ctrl-C) still lets `up` stop its services in order.
        if let Some(pid) = self
            .child
            .id()
            .and_then(|p| rustix::process::Pid::from_raw(p as i32))
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
    }
}

/// The last lines of a log, for an error message.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

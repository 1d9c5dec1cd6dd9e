//! The processes a fault aims at: the worker of a role, checked to be the service the
//! ports file names before any signal is sent, and the signals themselves.

use super::args::ChaosError;
use crate::mesh::MeshFile;

/// The worker a kill scenario aims at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }

    /// (pid, port) of the first worker of this role in the ports file.
    pub(super) fn target(self, m: &MeshFile) -> (u32, u16) {
        let (pids, ports) = match self {
            Self::Prefill => (&m.pids.prefill, &m.prefill),
            Self::Decode => (&m.pids.decode, &m.decode),
        };
        (
            pids.first().copied().unwrap_or(0),
            ports.first().copied().unwrap_or(0),
        )
    }
}

/// Makes sure `pid` runs `pdmesh SUBCOMMAND --listen HOST:PORT` as `up` starts the
/// service, so a stale ports file never aims a signal at another process.
pub(super) fn check_process(pid: u32, service: &'static str, port: u16) -> Result<(), ChaosError> {
    let wrong = |why: String| ChaosError::WrongProcess { pid, service, why };
    if pid == 0 {
        return Err(wrong("the ports file names no pid".into()));
    }
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map_err(|e| wrong(format!("no such process: {e}")))?;
    let argv: Vec<String> = cmdline
        .split(|&b| b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let listens = argv.get(2).is_some_and(|a| a == "--listen")
        && argv
            .get(3)
            .is_some_and(|a| a.ends_with(&format!(":{port}")));
    if argv.get(1).map(String::as_str) == Some(service) && listens {
        Ok(())
    } else {
        Err(wrong(format!("it runs {:?}", argv.join(" ").trim())))
    }
}

pub(super) fn signal(
    pid: u32,
    sig: rustix::process::Signal,
    name: &'static str,
    service: &'static str,
) -> Result<(), ChaosError> {
    let err = |source| ChaosError::Signal {
        signal: name,
        service,
        pid,
        source,
    };
    let target = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .ok_or_else(|| err(std::io::Error::other("not a process id")))?;
    rustix::process::kill_process(target, sig).map_err(|e| err(e.into()))
}

/// Sends SIGCONT to the process when dropped: a stopped cache service is never left
/// behind, whatever ends the stall.
pub(super) struct Resume {
    pub(super) pid: u32,
}

impl Drop for Resume {
    fn drop(&mut self) {
        if let Err(e) = signal(self.pid, rustix::process::Signal::CONT, "SIGCONT", "cache") {
            eprintln!("pdmesh chaos: {e}");
        }
    }
}

//! How `up` fails: one error for starting, supervising and stopping the mesh.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitStatus;

use crate::fetch::FetchError;

/// Why `up` failed.
#[derive(Debug, thiserror::Error)]
pub enum UpError {
    #[error(
        "the model file {} does not exist, and is not the name of a model pdmesh knows: \
         run `pdmesh model fetch` for the default model, pass --model PATH.gguf (or a \
         checkpoint directory), or name a known model, fetched if missing: {}",
        .0.display(),
        crate::fetch::known_names()
    )]
    ModelMissing(PathBuf),
    #[error("fetching the model failed")]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    ChatTemplate(pdmesh_tokenizer::Error),
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
    #[error(
        "the disk tier sits below the cache service's host mirror: drop --no-host-cache, or --disk-dir"
    )]
    DiskNeedsCache,
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

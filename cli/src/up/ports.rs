//! The ports file (`--ports-json`): where each service of the mesh listens and its
//! process id, rewritten whenever a restart changes one. Written as the one typed
//! `MeshFile` its readers parse.

use std::net::IpAddr;
use std::path::Path;

use pdmesh_bench::mesh::{MeshFile, Mode, Pids};

use super::error::UpError;
use super::service::Service;

/// What the ports file says besides the process ids (which change when a service is
/// restarted).
pub(super) struct MeshLayout {
    pub(super) url: String,
    pub(super) host: IpAddr,
    pub(super) pd: bool,
    pub(super) gateway: u16,
    pub(super) tokenizer: u16,
    /// (name, port) of each worker of a role, in start order; the first one overall (the
    /// unified worker or the first decode worker) is "worker".
    pub(super) workers: Vec<(&'static str, &'static str, u16)>,
    /// 0 without a cache service.
    pub(super) cache: u16,
    pub(super) model: String,
    pub(super) restart: bool,
}

impl MeshLayout {
    /// The ports file, each service's pid from `pid` (by name; 0 when absent): the typed
    /// form `pdmesh bench`, `pdmesh chaos` and the tests read back.
    pub(super) fn file(&self, pid: impl Fn(&str) -> u32) -> MeshFile {
        let ports = |kind: &str| {
            let of = self.workers.iter().filter(|w| w.1 == kind);
            of.map(|w| w.2).collect::<Vec<_>>()
        };
        let pids = |kind: &str| {
            let of = self.workers.iter().filter(|w| w.1 == kind);
            of.map(|w| pid(w.0)).collect::<Vec<_>>()
        };
        let first = self.workers.first();
        MeshFile {
            url: self.url.clone(),
            host: self.host.to_string(),
            mode: if self.pd { Mode::Pd } else { Mode::Unified },
            gateway: self.gateway,
            tokenizer: self.tokenizer,
            // The unified worker, or the first decode worker.
            worker: first.map_or(0, |w| w.2),
            prefill: ports("prefill"),
            decode: ports("decode"),
            cache: self.cache,
            model: self.model.clone(),
            restart: self.restart,
            pids: Pids {
                up: std::process::id(),
                tokenizer: pid("tokenizer"),
                worker: first.map_or(0, |w| pid(w.0)),
                prefill: pids("prefill"),
                decode: pids("decode"),
                gateway: pid("gateway"),
                cache: pid("cache"),
            },
        }
    }

    /// Writes the ports file with the services' current pids.
    pub(super) fn write(&self, path: &Path, services: &[Service]) -> Result<(), UpError> {
        let file = self.file(|name| {
            services
                .iter()
                .find(|s| s.name == name)
                .map_or(0, |s| s.pid)
        });
        let value = serde_json::to_value(&file).expect("a ports file is JSON");
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

//! What `pdmesh chaos` takes: the scenario (which fault), its flags, and how it fails.

use std::path::PathBuf;

use serde::Serialize;

use crate::client::ClientError;
use crate::mesh::MeshError;

/// The faults.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// SIGKILL the prefill worker mid-load (the mesh must run with `up --restart`).
    KillPrefill,
    /// SIGKILL the decode worker mid-load (the mesh must run with `up --restart`).
    KillDecode,
    /// SIGSTOP the cache service under load for --stall-s, then SIGCONT.
    StallCache,
    /// Clients that drop their streams during prefill and during decode.
    DisconnectClients,
    /// Many long requests at once, so decode pages run out: the refused ones must be 429s.
    ExhaustDecode,
    /// Flip bytes of the pages in the host mirror after flushing the device caches: the
    /// workers' checksums must catch them and recompute.
    FlipHostBytes,
}

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Self::KillPrefill => "kill-prefill",
            Self::KillDecode => "kill-decode",
            Self::StallCache => "stall-cache",
            Self::DisconnectClients => "disconnect-clients",
            Self::ExhaustDecode => "exhaust-decode",
            Self::FlipHostBytes => "flip-host-bytes",
        }
    }

    pub(super) fn default_requests(self) -> usize {
        match self {
            Self::ExhaustDecode => 80,
            _ => 12,
        }
    }

    pub(super) fn default_input_len(self) -> usize {
        match self {
            Self::ExhaustDecode => 512,
            _ => 300,
        }
    }
}

/// `pdmesh chaos`: one fault injected into a running mesh under load, then a verdict.
#[derive(Debug, clap::Args)]
pub struct ChaosArgs {
    /// The fault to inject.
    #[arg(value_enum)]
    pub scenario: Scenario,
    /// The ports file of the mesh (`pdmesh up --ports-json FILE`).
    #[arg(long, value_name = "FILE")]
    pub mesh: PathBuf,
    /// Compare answers with this OpenAI base URL's (each request sent alone) instead of
    /// the healthy mesh's own.
    #[arg(long, value_name = "URL")]
    pub reference: Option<String>,
    /// Bearer key for the gateway (and the reference).
    #[arg(long, env = "PDMESH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Model name to request (default: the first the gateway lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Requests in the loaded pass, all at once (default: 80 for exhaust-decode, else 12).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Prompt length in tokens, about (default: 512 for exhaust-decode, else 300).
    #[arg(long)]
    pub input_len: Option<usize>,
    /// Tokens each answer runs to.
    #[arg(long, default_value_t = 24)]
    pub max_tokens: u32,
    /// Every request must end (an answer or an HTTP error) within this many seconds.
    #[arg(long, default_value_t = 90.0)]
    pub deadline_s: f64,
    /// How long the mesh gets to be healthy and back to baseline after the fault.
    #[arg(long, default_value_t = 60.0)]
    pub settle_s: f64,
    /// The fault strikes this many seconds after the load started (kill-prefill,
    /// kill-decode, stall-cache): early, while the requests queue at prefill and hold
    /// their decode reservations.
    #[arg(long, default_value_t = 0.1)]
    pub fault_after_s: f64,
    /// stall-cache: how long the cache service stays stopped.
    #[arg(long, default_value_t = 20.0)]
    pub stall_s: f64,
    /// Seeds the prompts.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Directory for verdict.json.
    #[arg(long, default_value = "chaos-report")]
    pub out: PathBuf,
}

/// Why `pdmesh chaos` failed.
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    #[error(transparent)]
    Mesh(#[from] MeshError),
    #[error("{scenario} needs {what}")]
    Unsuitable {
        scenario: &'static str,
        what: String,
    },
    #[error(transparent)]
    Endpoint(#[from] ClientError),
    #[error("the mesh is not healthy ({gateway}/health) after {secs:.0} s")]
    Unhealthy { gateway: String, secs: f64 },
    #[error("the mesh is not at baseline before the fault: {0}")]
    NotBaseline(String),
    #[error(
        "{failed} of {sent} requests of the healthy pass failed ({kinds}): there is nothing to compare with"
    )]
    HealthyPass {
        failed: usize,
        sent: usize,
        kinds: String,
    },
    #[error("pid {pid} is not the {service} of this mesh ({why}): is the ports file stale?")]
    WrongProcess {
        pid: u32,
        service: &'static str,
        why: String,
    },
    #[error("sending {signal} to the {service} (pid {pid})")]
    Signal {
        signal: &'static str,
        service: &'static str,
        pid: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("the host mirror of the cache service (pid {pid}): {why}")]
    Mirror { pid: u32, why: String },
    #[error("POST {url}: {why}")]
    Flush { url: String, why: String },
    #[error("installing signal handlers")]
    Handlers(#[source] std::io::Error),
    #[error("interrupted by {0} (a cache service it had stopped was resumed)")]
    Interrupted(&'static str),
    #[error("writing {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{scenario}: {failed} failed (verdict in {out})")]
    Failed {
        scenario: &'static str,
        failed: String,
        out: String,
    },
}

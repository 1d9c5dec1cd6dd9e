//! The incident flags every service that files reports takes.

use std::path::PathBuf;

/// `--incident-dir` and `--incident-trace-link`: where a service's reports go and the
/// trace link in them (see [`crate::Reporter::from_flags`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct IncidentArgs {
    /// Where incident reports are written (a wedged room, an engine-loop stall, a page
    /// failing its checksum, an unparsable output, a first token that differs between
    /// prefill and decode), created owner-only; the gateway's `GET /debug/incidents`
    /// lists them. Unset: none are written (the failures are still logged and counted).
    #[arg(long = "incident-dir", env = "PDMESH_INCIDENT_DIR")]
    pub dir: Option<PathBuf>,
    /// A trace viewer's link with `{trace_id}` in it (Tempo, Jaeger), for the reports.
    #[arg(long = "incident-trace-link", env = "PDMESH_INCIDENT_TRACE_LINK")]
    pub trace_link: Option<String>,
}

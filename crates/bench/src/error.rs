//! How `pdmesh bench` and its matrix fail: one home for both errors, below the commands
//! that return them, so the command line and the matrix it runs each depend on it alone.

use crate::client::ClientError;
use crate::replay::ReplayError;
use crate::report::ReportError;

/// Why a bench command failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Endpoint(#[from] ClientError),
    #[error(transparent)]
    Replay(#[from] ReplayError),
    #[error("nothing to run: give --concurrency or --rate levels above 0")]
    NoLevels,
    #[error(transparent)]
    Report(#[from] ReportError),
    #[error(transparent)]
    Matrix(#[from] MatrixError),
    #[error(
        "the reference failed {failed} replays, so their answers were not checked (report in {out})"
    )]
    ReferenceFailed { failed: u32, out: String },
    #[error(
        "all {requests} requests of a level failed ({kinds}): nothing was measured (report in {out})"
    )]
    AllFailed {
        requests: u32,
        kinds: String,
        out: String,
    },
    #[error("{corrupted} of {compared} answers differ from their reference (report in {out})")]
    Corruption {
        corrupted: u32,
        compared: u32,
        out: String,
    },
}

/// Why the matrix could not run.
#[derive(Debug, thiserror::Error)]
pub enum MatrixError {
    #[error("nothing to run: the filters leave no configuration")]
    Empty,
    #[error(
        "--models {0} needs --chat-template FILE (a Jinja template): the model has no chat \
         template of its own, and the matrix's sessions are chat requests"
    )]
    NeedsChatTemplate(&'static str),
    #[error("meshes did not return every page after the load: {0}")]
    Leaked(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`pdmesh {args}` failed: {why}\n{log}")]
    Mesh {
        args: String,
        why: String,
        log: String,
    },
}

impl MatrixError {
    /// Wraps an I/O error with what was being done.
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| Self::Io { what, source }
    }
}

//! Fault injection for the mesh's own fault tests, switched on only by explicit
//! `--fault-*` flags on the worker's command line.
//!
//! These hooks deliberately break the worker (a late write deaf to aborts, a stalled
//! engine loop, the seed's mis-sized index-K buffer), so nothing a user can set by
//! accident turns them on: they have no `PDMESH_*` environment variable, they are hidden
//! from `--help`, and a worker running one says so loudly: a WARN per fault at start, the
//! faults in its Health and ModelInfo answers (the gateway shows them in `/health` and
//! as `mesh_fault_injection_enabled 1`). `PDMESH_FAULT_*` variables, which earlier
//! versions read, are ignored with a warning.

use std::time::Duration;

/// The worker's `--fault-*` flags. All unset (the default) means no fault at all.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct FaultArgs {
    /// TEST ONLY. A prefill sleeps this long after its room started transferring and
    /// before it writes, and does not hear the room's abort meanwhile: its write lands
    /// late (the late-write test).
    #[arg(long = "fault-write-delay-ms", value_name = "MS", hide = true)]
    pub write_delay_ms: Option<u64>,
    /// TEST ONLY. With --fault-write-delay-ms: only the first N transfers are delayed.
    #[arg(
        long = "fault-count",
        value_name = "N",
        hide = true,
        requires = "write_delay_ms"
    )]
    pub count: Option<u64>,
    /// TEST ONLY. Before engine step STEP the engine loop sleeps MS milliseconds (the
    /// watchdog tests).
    #[arg(long = "fault-stall-step", value_name = "STEP:MS", hide = true, value_parser = parse_stall)]
    pub stall_step: Option<StallStep>,
    /// TEST ONLY. The seed's bug: a prefill stages its bf16 index-K through a buffer
    /// sized for fp8. The hand-over's checksums (of the engine's own bytes) catch it:
    /// the request fails with DATA_LOSS and a checksum report shows both layouts.
    #[arg(long = "fault-missize-index-k", hide = true)]
    pub missize_index_k: bool,
    /// TEST ONLY, CORRUPTS KV. The seed's bug as its code had it: the same mis-sized
    /// copy, with the checksums taken after the loss, so nothing in the mesh can tell and
    /// only the differential (`pdmesh matrix`, the DeepSeek tests) sees the answers change.
    #[arg(
        long = "fault-missize-index-k-unchecked",
        hide = true,
        conflicts_with = "missize_index_k"
    )]
    pub missize_index_k_unchecked: bool,
}

/// The seed's bug, when a `--fault-missize-index-k*` flag is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Missize {
    /// Caught by the hand-over's checksums.
    Checked,
    /// Checksummed after the loss: silent.
    Unchecked,
}

/// `--fault-stall-step STEP:MS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StallStep {
    pub step: u64,
    pub pause: Duration,
}

/// Why `--fault-stall-step` could not be read.
#[derive(Debug, thiserror::Error)]
enum BadStall {
    #[error("expected STEP:MS, got {0:?}")]
    Shape(String),
    #[error("{what} {text:?}: {err}")]
    Number {
        what: &'static str,
        text: String,
        err: std::num::ParseIntError,
    },
}

fn parse_stall(s: &str) -> Result<StallStep, BadStall> {
    let (step, ms) = s
        .split_once(':')
        .ok_or_else(|| BadStall::Shape(s.to_owned()))?;
    let num = |what, text: &str| {
        text.parse::<u64>().map_err(|err| BadStall::Number {
            what,
            text: text.to_owned(),
            err,
        })
    };
    Ok(StallStep {
        step: num("STEP", step)?,
        pause: Duration::from_millis(num("MS", ms)?),
    })
}

impl FaultArgs {
    /// The faults switched on, as `name` or `name=value`; empty when none is.
    pub fn active(&self) -> Vec<String> {
        let mut on = Vec::new();
        if let Some(ms) = self.write_delay_ms {
            on.push(format!("write-delay-ms={ms}"));
            if let Some(n) = self.count {
                on.push(format!("count={n}"));
            }
        }
        if let Some(s) = self.stall_step {
            on.push(format!("stall-step={}:{}", s.step, s.pause.as_millis()));
        }
        if self.missize_index_k {
            on.push("missize-index-k".to_owned());
        }
        if self.missize_index_k_unchecked {
            on.push("missize-index-k-unchecked".to_owned());
        }
        on
    }

    /// The seed's bug, if switched on.
    pub fn missize(&self) -> Option<Missize> {
        match (self.missize_index_k, self.missize_index_k_unchecked) {
            (true, _) => Some(Missize::Checked),
            (_, true) => Some(Missize::Unchecked),
            _ => None,
        }
    }

    /// Says at start what is on, and that `PDMESH_FAULT_*` variables do nothing.
    pub fn announce(&self) {
        let ignored: Vec<String> = std::env::vars_os()
            .filter_map(|(k, _)| k.into_string().ok())
            .filter(|k| k.starts_with("PDMESH_FAULT_"))
            .collect();
        if !ignored.is_empty() {
            tracing::warn!(
                variables = ?ignored,
                "PDMESH_FAULT_* variables are ignored: fault injection is only switched on by --fault-* flags"
            );
        }
        for fault in self.active() {
            tracing::warn!(
                %fault,
                "FAULT INJECTION IS ON: this worker breaks requests on purpose; never run it in production"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        faults: FaultArgs,
    }

    fn parse(args: &[&str]) -> Result<FaultArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("worker").chain(args.iter().copied())).map(|c| c.faults)
    }

    #[test]
    fn no_flag_means_no_fault_whatever_the_environment_says() {
        // The flags have no environment variable: clap never reads one for them.
        let cmd = <Cli as clap::CommandFactory>::command();
        for arg in cmd.get_arguments() {
            assert_eq!(
                arg.get_env(),
                None,
                "{:?} must not read the environment",
                arg.get_id()
            );
            assert!(
                arg.is_hide_set(),
                "{:?} must stay out of --help",
                arg.get_id()
            );
        }
        let none = parse(&[]).unwrap();
        assert_eq!(none, FaultArgs::default());
        assert!(none.active().is_empty());
    }

    #[test]
    fn each_flag_is_named_in_the_active_list() {
        let f = parse(&[
            "--fault-write-delay-ms",
            "6000",
            "--fault-count",
            "1",
            "--fault-stall-step",
            "30:1500",
            "--fault-missize-index-k",
        ])
        .unwrap();
        assert_eq!(
            f.active(),
            [
                "write-delay-ms=6000",
                "count=1",
                "stall-step=30:1500",
                "missize-index-k"
            ]
        );
    }

    #[test]
    fn the_seeds_bug_is_checked_or_unchecked_never_both() {
        let f = parse(&["--fault-missize-index-k-unchecked"]).unwrap();
        assert_eq!(f.active(), ["missize-index-k-unchecked"]);
        assert_eq!(f.missize(), Some(Missize::Unchecked));
        let f = parse(&["--fault-missize-index-k"]).unwrap();
        assert_eq!(f.missize(), Some(Missize::Checked));
        assert!(
            parse(&[
                "--fault-missize-index-k",
                "--fault-missize-index-k-unchecked"
            ])
            .is_err()
        );
    }

    #[test]
    fn malformed_values_are_refused() {
        assert!(parse(&["--fault-stall-step", "30"]).is_err());
        assert!(parse(&["--fault-stall-step", "x:10"]).is_err());
        assert!(
            parse(&["--fault-count", "1"]).is_err(),
            "--fault-count needs a delay"
        );
    }
}

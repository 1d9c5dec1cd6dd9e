//! The steps `pdmesh bench` and its matrix share: running one load level with a progress
//! bar, checking its answers on a reference, judging the outcome, and saying what was
//! written.

use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};

use crate::client::Client;
use crate::error::BenchError;
use crate::report;
use crate::run::{self, Level, RequestCfg};
use crate::summary::LevelSummary;
use crate::workload::{Kind, Spec};

/// Fails a run that measured nothing (a level whose every request failed: a wrong model
/// name, an endpoint refusing everything), and one whose answers differ from the
/// reference, or were not all checked.
pub(crate) fn judge(levels: &[LevelSummary], out: &Path) -> Result<(), BenchError> {
    if let Some(l) = levels
        .iter()
        .find(|l| l.requests > 0 && l.errors == l.requests)
    {
        let kinds: Vec<String> = l
            .errors_by_kind
            .iter()
            .map(|(k, n)| format!("{n} {k}"))
            .collect();
        return Err(BenchError::AllFailed {
            requests: l.requests,
            kinds: kinds.join(", "),
            out: out.display().to_string(),
        });
    }
    let ds = || levels.iter().filter_map(|l| l.differential.as_ref());
    let (corrupted, compared) = ds().fold((0, 0), |(c, n), d| (c + d.corrupted, n + d.compared));
    let failed: u32 = ds().map(|d| d.reference_errors).sum();
    if corrupted == 0 && failed > 0 {
        // Unchecked answers are not correct answers: a dead reference must not pass.
        return Err(BenchError::ReferenceFailed {
            failed,
            out: out.display().to_string(),
        });
    }
    if corrupted > 0 {
        return Err(BenchError::Corruption {
            corrupted,
            compared,
            out: out.display().to_string(),
        });
    }
    Ok(())
}

/// Runs one level of `spec`'s sessions (salted with `salt`): what was sent and answered,
/// and the level's summary.
pub(crate) async fn load(
    client: &Client,
    cfg: &RequestCfg,
    spec: &Spec,
    salt: u64,
    level: Level,
    label: &str,
) -> (Vec<run::Exchange>, LevelSummary) {
    let sessions = spec.sessions(salt);
    let turns = if spec.kind == Kind::Sessions {
        spec.turns
    } else {
        1
    };
    let bar = progress(
        (sessions.len() * turns) as u64,
        &format!("{label} {}", level_name(level)),
    );
    let tick = || bar.inc(1);
    let (ex, wall) = run::run_level(client, cfg, sessions, level, spec.seed, &tick).await;
    bar.finish_and_clear();
    let summary = run::summarize(level, &ex, wall);
    (ex, summary)
}

/// Replays a level's answers on the reference into `summary.differential`; returns lines
/// describing differences.
pub(crate) async fn check(
    reference: &run::Reference,
    ex: &[run::Exchange],
    summary: &mut LevelSummary,
) -> Vec<String> {
    let bar = progress(ex.len() as u64, "reference, one at a time");
    let tick = || bar.inc(1);
    let (d, why) = run::differential(reference, ex, &tick).await;
    bar.finish_and_clear();
    summary.differential = Some(d);
    why
}

pub(crate) fn print_written(w: &report::Written) {
    for f in &w.files {
        println!("wrote {}", f.display());
    }
    if let Some(why) = &w.charts_skipped {
        println!("no charts: {why}");
    }
}

pub(crate) fn level_name(level: Level) -> String {
    match level {
        Level::Concurrency(c) => format!("concurrency {c}"),
        Level::Rate(r) => format!("rate {r}/s"),
    }
}

pub(crate) fn progress(total: u64, what: &str) -> ProgressBar {
    // Drawn only on a terminal (indicatif hides it otherwise).
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} requests, {elapsed}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_owned());
    bar
}

/// The current UTC time as RFC 3339, to the second.
pub(crate) fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_level_whose_every_request_failed_fails_the_run_naming_why() {
        let level = |requests, errors| LevelSummary {
            requests,
            errors,
            errors_by_kind: [("http_404".to_owned(), errors)].into(),
            ..LevelSummary::default()
        };
        let out = Path::new("out");
        assert!(judge(&[level(4, 3)], out).is_ok(), "some answers: measured");
        let err = judge(&[level(4, 0), level(8, 8)], out).unwrap_err();
        assert_eq!(
            err.to_string(),
            "all 8 requests of a level failed (8 http_404): nothing was measured (report in out)"
        );
        assert!(judge(&[], out).is_ok());
    }
}

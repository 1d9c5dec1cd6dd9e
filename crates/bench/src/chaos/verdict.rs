//! The verdict: how the requests ended, whether the mesh settled and the answers agreed,
//! the checks every scenario makes, and the table printed at the end.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde::Serialize;

use super::args::Scenario;
use crate::client::Answer;
use crate::mesh::Baseline;
use crate::run::Exchange;

/// One check of the verdict.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub passed: bool,
    pub detail: String,
}

/// How the requests ended.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Tally {
    pub sent: u32,
    pub ok: u32,
    /// Clean errors by class: an HTTP status ("503"), or an error the gateway reported
    /// inside a stream it had begun ("in_stream:overloaded").
    pub refused: BTreeMap<String, u32>,
    pub timed_out: u32,
    /// Requests whose connection failed or broke off without an error: not clean.
    pub broken: BTreeMap<String, u32>,
    /// Clients that went away on purpose (disconnect-clients).
    pub left: u32,
    pub slowest_s: f64,
    pub deadline_s: f64,
}

/// How a request ended, from its error class (`None`: it succeeded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Class {
    Ok,
    Refused(String),
    TimedOut,
    Broken(String),
}

pub(super) fn classify(error: Option<&str>) -> Class {
    match error {
        None => Class::Ok,
        Some("timeout") => Class::TimedOut,
        Some(e) if e.starts_with("in_stream:") => Class::Refused(e.to_owned()),
        Some(e) if e.parse::<u16>().is_ok_and(|s| (400..600).contains(&s)) => {
            Class::Refused(e.to_owned())
        }
        Some(e) => Class::Broken(e.to_owned()),
    }
}

/// Whether a clean refusal means "overloaded": a 429, or its form inside a stream.
pub(super) fn is_overloaded(class: &str) -> bool {
    class == "429" || class == "in_stream:overloaded"
}

impl Tally {
    pub(super) fn new(deadline_s: f64) -> Self {
        Self {
            deadline_s,
            ..Self::default()
        }
    }

    /// Counts one request that ended with `error` after `secs`.
    pub(super) fn add(&mut self, error: Option<&str>, secs: f64) {
        self.sent += 1;
        self.slowest_s = self.slowest_s.max(secs);
        match classify(error) {
            Class::Ok => self.ok += 1,
            Class::Refused(c) => *self.refused.entry(c).or_default() += 1,
            Class::TimedOut => self.timed_out += 1,
            Class::Broken(c) => *self.broken.entry(c).or_default() += 1,
        }
    }

    pub(super) fn add_all(&mut self, ex: &[Exchange]) {
        for e in ex {
            self.add(e.record.error.as_deref(), e.record.e2e_s);
        }
    }

    pub(super) fn refused_total(&self) -> u32 {
        self.refused.values().sum()
    }

    pub(super) fn describe(&self) -> String {
        let by = |m: &BTreeMap<String, u32>| {
            m.iter()
                .map(|(k, n)| format!("{k} x{n}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut out = format!("{} sent: {} ok", self.sent, self.ok);
        if self.left > 0 {
            out.push_str(&format!(", {} left on purpose", self.left));
        }
        out.push_str(&format!(", {} refused", self.refused_total()));
        if !self.refused.is_empty() {
            out.push_str(&format!(" ({})", by(&self.refused)));
        }
        out.push_str(&format!(", {} timed out", self.timed_out));
        let broken: u32 = self.broken.values().sum();
        out.push_str(&format!(", {broken} broken off"));
        if !self.broken.is_empty() {
            out.push_str(&format!(" ({})", by(&self.broken)));
        }
        out.push_str(&format!(
            "; slowest {:.1} s of {:.0} s allowed",
            self.slowest_s, self.deadline_s
        ));
        out
    }
}

/// Answers compared with their reference.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Answers {
    pub compared: u32,
    pub differing: u32,
    /// A few of the differences, for people.
    pub examples: Vec<String>,
}

impl Answers {
    /// Compares every successful answer of `ex` with `reference`'s answer to the same body.
    pub(super) fn compare(&mut self, reference: &HashMap<String, Answer>, ex: &[Exchange]) {
        for e in ex.iter().filter(|e| e.record.error.is_none()) {
            let Some(want) = reference.get(&e.body.to_string()) else {
                continue;
            };
            self.compared += 1;
            if &e.answer != want {
                self.differing += 1;
                if self.examples.len() < 5 {
                    self.examples.push(format!(
                        "got {:?} ({:?}), reference {:?} ({:?})",
                        e.answer.content, e.answer.finish_reason, want.content, want.finish_reason
                    ));
                }
            }
        }
    }
}

/// The mesh after the fault.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Settled {
    pub baseline: bool,
    pub waited_s: f64,
    pub pages_held: f64,
    pub pages_capacity: f64,
    pub detail: String,
}

impl Settled {
    pub(super) fn of(b: &Baseline, waited: Duration) -> Self {
        Self {
            baseline: b.ok(),
            waited_s: waited.as_secs_f64(),
            pages_held: b.pages_held(),
            pages_capacity: b.pages_capacity,
            detail: b.describe(),
        }
    }
}

/// The verdict, as printed and as `verdict.json`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    pub scenario: Scenario,
    pub url: String,
    pub passed: bool,
    pub checks: Vec<Check>,
    /// What was done to the mesh.
    pub fault: String,
    pub requests: Tally,
    pub settled: Settled,
    pub answers: Answers,
    /// flip-host-bytes: checksum failures the workers counted during the pass after the
    /// flip (`mesh_kv_cache_checksum_failures_total`, risen by this much).
    pub checksum_failures: Option<f64>,
    pub duration_s: f64,
}

/// The three checks every scenario makes, then the scenario's own.
pub(super) fn judge(
    tally: &Tally,
    settled: &Settled,
    answers: &Answers,
    reference: &str,
    own: Vec<Check>,
) -> Vec<Check> {
    let broken: u32 = tally.broken.values().sum();
    let mut checks = vec![
        Check {
            name: "requests ended in time",
            passed: tally.timed_out == 0 && broken == 0 && tally.slowest_s < tally.deadline_s,
            detail: tally.describe(),
        },
        Check {
            name: "no leaked pages",
            passed: settled.baseline,
            detail: if settled.baseline {
                format!(
                    "back to baseline after {:.1} s: {}",
                    settled.waited_s, settled.detail
                )
            } else {
                format!(
                    "not back to baseline after {:.1} s: {}",
                    settled.waited_s, settled.detail
                )
            },
        },
        Check {
            name: "answers identical",
            passed: answers.compared > 0 && answers.differing == 0,
            detail: if answers.compared == 0 {
                "no answer to compare: every request failed".to_owned()
            } else {
                let mut d = format!(
                    "{} compared with {reference}, {} differ",
                    answers.compared, answers.differing
                );
                if let Some(e) = answers.examples.first() {
                    d.push_str(&format!(", e.g. {e}"));
                }
                d
            },
        },
    ];
    checks.extend(own);
    checks
}

impl Verdict {
    /// The verdict as a short table.
    pub fn table(&self) -> String {
        let mut out = format!(
            "pdmesh chaos {}: {}\nfault: {}\n",
            self.scenario.name(),
            self.url,
            self.fault
        );
        let width = self.checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
        for c in &self.checks {
            out.push_str(&format!(
                "  {}  {:<width$}  {}\n",
                if c.passed { "PASS" } else { "FAIL" },
                c.name,
                c.detail
            ));
        }
        if let Some(n) = self.checksum_failures {
            out.push_str(&format!("checksum failures seen: {n}\n"));
        }
        out.push_str(&format!(
            "verdict: {} in {:.0} s",
            if self.passed { "PASS" } else { "FAIL" },
            self.duration_s
        ));
        out
    }
}

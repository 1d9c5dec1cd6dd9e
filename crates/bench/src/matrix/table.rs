//! The matrix's results: a row per configuration as `matrix.json` keeps them, the
//! Markdown table in the seed's terms, and the page of bar charts.

use serde::{Deserialize, Serialize};

use super::cells::{Cell, Family, Fault, IndexK, Mirror, Mode};
use crate::report::{Bar, BarChart, BarPage};
use crate::summary::{Differential, LevelSummary};

/// One measured configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub cell: Cell,
    pub name: String,
    /// The fault injected on purpose, if any.
    pub fault: Option<Fault>,
    /// What was still held once the load ended and the mesh had `--settle-s` to settle
    /// (None: nothing, every page back).
    pub leaked: Option<String>,
    /// Prompt tokens by where they came from (`computed`, `device`, `host`,
    /// `transferred`), as the mesh counted them.
    #[serde(default)]
    pub prompt_sources: std::collections::BTreeMap<String, f64>,
    pub summary: LevelSummary,
}

/// The whole matrix, as written to matrix.json.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Matrix {
    pub started: String,
    pub workload: String,
    pub rows: Vec<Row>,
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// One line per configuration while the matrix runs.
pub(super) fn row_line(r: &Row) -> String {
    let d = r.summary.differential.clone().unwrap_or_default();
    format!(
        "{:<26} {:>4} req {:>3} err  corrupted {}/{} ({})  tool calls valid {}  ttft p50 {:.0} ms  {:.1} tok/s",
        r.name,
        r.summary.requests,
        r.summary.errors,
        d.corrupted,
        d.compared,
        pct(d.corruption_rate()),
        calls(&d),
        r.summary.ttft.p50 * 1e3,
        r.summary.output_tokens_per_s
    )
}

/// Valid forced tool calls of those judged, and those `max_tokens` cut short (not judged).
fn calls(d: &Differential) -> String {
    let mut out = if d.tool_calls_expected > 0 {
        format!(
            "{}/{} ({})",
            d.tool_calls_valid,
            d.tool_calls_expected,
            pct(d.tool_call_validity())
        )
    } else {
        "none complete".to_owned()
    };
    if d.tool_calls_truncated > 0 {
        out.push_str(&format!(", {} cut short", d.tool_calls_truncated));
    }
    out
}

/// The table's columns, in the seed's terms.
const COLUMNS: [&str; 14] = [
    "model",
    "index-K",
    "host mirror",
    "mode",
    "requests",
    "errors",
    "corrupted",
    "corruption",
    "tool calls valid",
    "TTFT p50",
    "TTFT p99",
    "output tok/s",
    "cached",
    "pages back",
];

/// One table row per configuration, a cell per column of [`COLUMNS`].
fn table_rows(m: &Matrix) -> Vec<Vec<String>> {
    m.rows
        .iter()
        .map(|r| {
            let d = r.summary.differential.clone().unwrap_or_default();
            let c = r.cell;
            vec![
                format!(
                    "{}{}",
                    match c.model {
                        Family::Dsa => "DeepSeek V3.2 tiny",
                        Family::Smol => "SmolLM2-135M",
                        Family::Gemma => "Gemma 3 270M",
                    },
                    if r.fault.is_some() {
                        " (fault injected)"
                    } else {
                        ""
                    }
                ),
                match c.index_k {
                    Some(IndexK::Fp8) => "fp8",
                    Some(IndexK::Bf16) => "bf16",
                    None => "-",
                }
                .to_owned(),
                match c.mirror {
                    Mirror::On => "on",
                    Mirror::Off => "off",
                }
                .to_owned(),
                match c.mode {
                    Mode::Pd => "PD",
                    Mode::Unified => "unified",
                }
                .to_owned(),
                r.summary.requests.to_string(),
                r.summary.errors.to_string(),
                format!("{}/{}", d.corrupted, d.compared),
                pct(d.corruption_rate()),
                calls(&d),
                format!("{:.0} ms", r.summary.ttft.p50 * 1e3),
                format!("{:.0} ms", r.summary.ttft.p99 * 1e3),
                format!("{:.1}", r.summary.output_tokens_per_s),
                pct(r.summary.cached_share),
                if r.leaked.is_some() { "NO" } else { "yes" }.to_owned(),
            ]
        })
        .collect()
}

/// The table in the seed's terms, as Markdown.
pub fn table(m: &Matrix) -> String {
    let mut out = format!("workload: {}\n\n", m.workload);
    out.push_str(&format!("| {} |\n", COLUMNS.join(" | ")));
    out.push_str(&format!("|{}\n", "---|".repeat(COLUMNS.len())));
    for row in table_rows(m) {
        out.push_str(&format!("| {} |\n", row.join(" | ")));
    }
    out
}

/// A configuration as its bars are labelled: every part of its cell, in words.
fn bar_label(c: &Cell) -> String {
    let mut parts = vec![match c.model {
        Family::Dsa => "DeepSeek",
        Family::Smol => "SmolLM2",
        Family::Gemma => "Gemma 3",
    }];
    parts.push(match c.index_k {
        Some(IndexK::Fp8) => "index-K fp8",
        Some(IndexK::Bf16) => "index-K bf16",
        None => "",
    });
    parts.push(match c.mirror {
        Mirror::On => "mirror on",
        Mirror::Off => "mirror off",
    });
    parts.push(match c.mode {
        Mode::Pd => "PD",
        Mode::Unified => "unified",
    });
    parts.retain(|p| !p.is_empty());
    parts.join(" · ")
}

/// The bar colours: mode and host mirror, the same four in every chart and every run.
pub(super) const BAR_KEYS: [&str; 4] = [
    "PD, mirror on",
    "PD, mirror off",
    "unified, mirror on",
    "unified, mirror off",
];

fn bar_key(c: &Cell) -> usize {
    match (c.mode, c.mirror) {
        (Mode::Pd, Mirror::On) => 0,
        (Mode::Pd, Mirror::Off) => 1,
        (Mode::Unified, Mirror::On) => 2,
        (Mode::Unified, Mirror::Off) => 3,
    }
}

/// The matrix page: the table, and one bar chart per metric (corruption, TTFT p50 and
/// p99, output throughput) with a labelled bar per configuration, grouped by model and
/// index-K form.
pub fn page(m: &Matrix) -> BarPage {
    let fault = if m.rows.iter().any(|r| r.fault.is_some()) {
        " (fault injected)"
    } else {
        ""
    };
    type Value = fn(&Row) -> (f64, String);
    let metrics: [(&str, &str, &str, Value); 4] = [
        (
            "corruption",
            "Answers differing from the reference",
            "corrupted answers (% of those compared)",
            |r| match &r.summary.differential {
                Some(d) => (
                    d.corruption_rate() * 100.0,
                    format!(
                        "{} ({}/{})",
                        pct(d.corruption_rate()),
                        d.corrupted,
                        d.compared
                    ),
                ),
                None => (f64::NAN, "not checked".to_owned()),
            },
        ),
        (
            "ttft_p50",
            "Time to first token, p50",
            "TTFT p50 (ms)",
            |r| {
                let ms = r.summary.ttft.p50 * 1e3;
                (ms, format!("{ms:.0} ms"))
            },
        ),
        (
            "ttft_p99",
            "Time to first token, p99",
            "TTFT p99 (ms)",
            |r| {
                let ms = r.summary.ttft.p99 * 1e3;
                (ms, format!("{ms:.0} ms"))
            },
        ),
        ("throughput", "Output throughput", "output tokens/s", |r| {
            let t = r.summary.output_tokens_per_s;
            (t, format!("{t:.1} tok/s"))
        }),
    ];
    let charts = metrics
        .into_iter()
        .map(|(stem, title, value_desc, value)| BarChart {
            stem: stem.to_owned(),
            title: format!("{title}{fault}"),
            value_desc: value_desc.to_owned(),
            keys: BAR_KEYS.map(str::to_owned).to_vec(),
            bars: m
                .rows
                .iter()
                .map(|r| {
                    let (value, text) = value(r);
                    Bar {
                        group: format!("{:?} {:?}", r.cell.model, r.cell.index_k),
                        label: bar_label(&r.cell),
                        key: bar_key(&r.cell),
                        value,
                        text,
                    }
                })
                .collect(),
        })
        .collect();
    BarPage {
        title: format!("pdmesh bench matrix{fault}"),
        params: vec![
            ("Workload".to_owned(), m.workload.clone()),
            ("Started".to_owned(), m.started.clone()),
        ],
        header: COLUMNS.map(str::to_owned).to_vec(),
        rows: table_rows(m),
        charts,
    }
}

//! The `index.html` pages: self-contained (no scripts, no external files), with the run
//! parameters, the tables and the charts inline as SVG.

use std::fmt::Write as _;

use super::bars::{BarChart, BarPage};
use super::lines::{Chart, level_name, level_x};
use crate::summary::{LevelSummary, Report};

/// Escapes text for HTML element content and quoted attribute values.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

/// `v` with `decimals` decimals, or a dash when it is not a finite number.
fn num(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:.decimals$}")
    } else {
        "—".to_owned()
    }
}

const STYLE: &str = "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:2em;\
color:#222;max-width:1280px}\
h1{font-size:1.6em}h2{margin-top:1.8em;border-bottom:1px solid #ccc}\
table{border-collapse:collapse;margin:0.6em 0;font-variant-numeric:tabular-nums}\
th,td{border:1px solid #ccc;padding:0.25em 0.6em;text-align:right}td{white-space:nowrap}\
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}\
dl{display:grid;grid-template-columns:max-content auto;gap:0.2em 1em}dt{font-weight:bold}\
dd{margin:0}figure{margin:1em 0}svg{max-width:100%;height:auto}\
.note{color:#666;font-style:italic}";

pub(super) fn html(reports: &[Report], charts: &[Chart], svgs: &[String]) -> String {
    let labels: Vec<String> = reports.iter().map(|r| escape(&r.label)).collect();
    let title = if labels.is_empty() {
        "pdmesh bench report".to_owned()
    } else {
        format!("pdmesh bench report: {}", labels.join(" vs "))
    };
    let mut h = String::new();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{title}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<h1>{title}</h1>\n"
    );
    let has_levels = reports.iter().any(|r| !r.levels.is_empty());
    if !has_levels {
        h.push_str(
            "<p class=\"note\" id=\"no-data\">No data: this report has no measured load \
             levels, so there are no table rows and no charts.</p>\n",
        );
    }

    for (report, label) in reports.iter().zip(&labels) {
        report_section(&mut h, report, label);
    }

    if let [first, second] = reports {
        ratios_section(&mut h, first, second);
    }

    if !charts.is_empty() {
        h.push_str("<h2>Charts</h2>\n");
        for (chart, svg) in charts.iter().zip(svgs) {
            let _ = write!(
                h,
                "<figure id=\"chart-{}\">\n{svg}\n<figcaption>{} (also in {})</figcaption>\n\
                 </figure>\n",
                chart.name(),
                escape(&chart.title),
                escape(&chart.file_name("png")),
            );
        }
    }
    h.push_str("</body>\n</html>\n");
    h
}

fn report_section(h: &mut String, report: &Report, label: &str) {
    let _ = write!(
        h,
        "<h2>{label}</h2>\n<dl>\n<dt>URL</dt><dd>{}</dd>\n<dt>Model</dt><dd>{}</dd>\n\
         <dt>Workload</dt><dd>{}</dd>\n<dt>Started</dt><dd>{}</dd>\n</dl>\n",
        escape(&report.url),
        escape(&report.model),
        escape(&report.workload),
        escape(&report.started),
    );
    if report.levels.is_empty() {
        h.push_str("<p class=\"note\">No data: no load levels were measured.</p>\n");
        return;
    }
    let differential = report.levels.iter().any(|l| l.differential.is_some());
    h.push_str(
        "<table>\n<thead><tr><th>level</th><th>requests</th><th>errors</th>\
         <th>TTFT p50 (ms)</th><th>TTFT p99 (ms)</th><th>ITL p50 (ms)</th>\
         <th>ITL p99 (ms)</th><th>E2E p50 (s)</th><th>E2E p99 (s)</th>\
         <th>output tok/s</th><th>prefill tok/s</th><th>req/s</th><th>cached %</th>",
    );
    if differential {
        h.push_str("<th>corruption %</th><th>tool-call validity %</th>");
    }
    h.push_str("</tr></thead>\n<tbody>\n");
    for l in &report.levels {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>",
            escape(&level_name(l)),
            l.requests,
            errors_cell(l),
            num(l.ttft.p50 * 1e3, 1),
            num(l.ttft.p99 * 1e3, 1),
            num(l.itl.p50 * 1e3, 1),
            num(l.itl.p99 * 1e3, 1),
            num(l.e2e.p50, 2),
            num(l.e2e.p99, 2),
            num(l.output_tokens_per_s, 1),
            num(l.prefill_tokens_per_s, 1),
            num(l.requests_per_s, 2),
            num(l.cached_share * 100.0, 1),
        );
        if differential {
            match &l.differential {
                Some(d) => {
                    let _ = write!(
                        h,
                        "<td>{} ({}/{})</td><td>{} ({}/{})</td>",
                        num(d.corruption_rate() * 100.0, 2),
                        d.corrupted,
                        d.compared,
                        num(d.tool_call_validity() * 100.0, 1),
                        d.tool_calls_valid,
                        d.tool_calls_expected,
                    );
                }
                None => h.push_str("<td>—</td><td>—</td>"),
            }
        }
        h.push_str("</tr>\n");
    }
    h.push_str("</tbody>\n</table>\n");
}

/// The error count, with its kinds when there are any: "3 (429: 2, timeout: 1)".
fn errors_cell(l: &LevelSummary) -> String {
    let kinds: Vec<String> = l
        .errors_by_kind
        .iter()
        .filter(|&(_, &n)| n > 0)
        .map(|(kind, n)| format!("{}: {n}", escape(kind)))
        .collect();
    if kinds.is_empty() {
        l.errors.to_string()
    } else {
        format!("{} ({})", l.errors, kinds.join(", "))
    }
}

/// First / second, or a dash when it is not a finite number (e.g. the second is 0).
fn ratio(a: f64, b: f64) -> String {
    num(a / b, 2)
}

fn ratios_section(h: &mut String, first: &Report, second: &Report) {
    let _ = writeln!(
        h,
        "<h2 id=\"ratios\">Ratios: {} / {}</h2>",
        escape(&first.label),
        escape(&second.label)
    );
    let mut rows = String::new();
    for a in &first.levels {
        let Some(key) = level_x(a) else { continue };
        let Some(b) = second.levels.iter().find(|b| level_x(b) == Some(key)) else {
            continue;
        };
        let _ = writeln!(
            rows,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&level_name(a)),
            ratio(a.ttft.p50, b.ttft.p50),
            ratio(a.ttft.p99, b.ttft.p99),
            ratio(a.output_tokens_per_s, b.output_tokens_per_s),
        );
    }
    if rows.is_empty() {
        h.push_str("<p class=\"note\">No load level was run by both.</p>\n");
        return;
    }
    let _ = write!(
        h,
        "<p>Below 1 means the first ({}) is lower: better for TTFT, worse for throughput.</p>\n\
         <table id=\"ratios-table\">\n<thead><tr><th>level</th><th>TTFT p50</th>\
         <th>TTFT p99</th><th>output tok/s</th></tr></thead>\n<tbody>\n{rows}</tbody>\n\
         </table>\n",
        escape(&first.label)
    );
}

pub(super) fn bar_html(page: &BarPage, charts: &[&BarChart], svgs: &[String]) -> String {
    let title = escape(&page.title);
    let mut h = String::new();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{title}</title>\n<style>{STYLE}.text{{text-align:left}}#results{{font-size:0.9em}}#results th,#results td{{padding:0.25em 0.45em}}\
         .wide{{overflow-x:auto}}</style>\n</head>\n\
         <body>\n<h1>{title}</h1>\n"
    );
    if !page.params.is_empty() {
        h.push_str("<dl>\n");
        for (k, v) in &page.params {
            let _ = writeln!(h, "<dt>{}</dt><dd>{}</dd>", escape(k), escape(v));
        }
        h.push_str("</dl>\n");
    }
    if page.rows.is_empty() {
        h.push_str("<p class=\"note\" id=\"no-data\">No data: nothing was measured.</p>\n");
    } else {
        // Only columns of numbers (every cell starting with a digit) align right; words,
        // and columns mixing words and numbers, read better aligned left.
        let words: Vec<bool> = (0..page.header.len())
            .map(|j| {
                !page.rows.iter().all(|r| {
                    r.get(j)
                        .and_then(|c| c.chars().next())
                        .is_some_and(|c| c.is_ascii_digit())
                })
            })
            .collect();
        let class = |j: usize| {
            if words.get(j).copied().unwrap_or(false) {
                " class=\"text\""
            } else {
                ""
            }
        };
        h.push_str("<div class=\"wide\">\n<table id=\"results\">\n<thead><tr>");
        for (j, c) in page.header.iter().enumerate() {
            let _ = write!(h, "<th{}>{}</th>", class(j), escape(c));
        }
        h.push_str("</tr></thead>\n<tbody>\n");
        for row in &page.rows {
            h.push_str("<tr>");
            for (j, c) in row.iter().enumerate() {
                let _ = write!(h, "<td{}>{}</td>", class(j), escape(c));
            }
            h.push_str("</tr>\n");
        }
        h.push_str("</tbody>\n</table>\n</div>\n");
    }
    if !charts.is_empty() {
        h.push_str("<h2>Charts</h2>\n");
        for (chart, svg) in charts.iter().zip(svgs) {
            let _ = write!(
                h,
                "<figure id=\"chart-{}\">\n{svg}\n<figcaption>{} (also in {}.png)</figcaption>\n\
                 </figure>\n",
                escape(&chart.stem),
                escape(&chart.title),
                escape(&chart.stem),
            );
        }
    }
    h.push_str("</body>\n</html>\n");
    h
}

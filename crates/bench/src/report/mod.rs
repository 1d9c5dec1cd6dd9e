//! Turns one or more [`Report`]s into files a person can look at.
//!
//! [`write`] puts into one folder:
//! - `report.json`: the reports themselves (a JSON array), readable again with [`read_json`];
//! - PNG charts: `ttft.png`, `throughput.png`, `itl.png`, `e2e.png` and, when any level was
//!   checked in differential mode, `corruption.png`. These plot the closed-loop levels
//!   against concurrency. Open-loop levels go into the same charts with a `_rate` suffix
//!   (`ttft_rate.png`, ...), plotted against the request rate. A chart is only written when
//!   it has something to show;
//! - `index.html`: one self-contained page (no scripts, no external files) with the run
//!   parameters, a table per report, the same charts inline as SVG and, for exactly two
//!   reports, the ratios of the first to the second.
//!
//! [`write_bars`] is for results measured at one load across named configurations (the
//! matrix): a [`BarChart`] per metric, one labelled bar per configuration with its value
//! written at its end, ticks at round values only, the legend above the bars; as PNG and,
//! with the table, inline SVG in `index.html`.
//!
//! Chart text is drawn with the DejaVu Sans font built into the program, so no system fonts
//! (nor fontconfig) are needed.

mod bars;
mod html;
mod lines;
mod output;
#[cfg(test)]
mod tests;

use std::fs;
use std::path::Path;

use plotters::prelude::*;

use self::bars::{BarLayout, draw_bars};
use self::html::{bar_html, html};
use self::lines::{CHART_SIZE, charts, draw_chart, render_svg};
use self::output::{register_fonts, write_file, write_png};
use crate::summary::Report;

pub use self::bars::{Bar, BarChart, BarPage};
pub use self::output::{HTML_FILE, JSON_FILE, ReportError, Written};

/// Writes `report.json`, the PNG charts and `index.html` for `reports` into `dir`, creating
/// `dir` when needed. Empty input (no reports, or reports without levels) still gives a
/// valid `report.json` and an `index.html` that says there is no data; the charts are then
/// skipped and [`Written::charts_skipped`] says why.
pub fn write(dir: &Path, reports: &[Report]) -> Result<Written, ReportError> {
    fs::create_dir_all(dir).map_err(|source| ReportError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut written = Written::default();

    let json_path = dir.join(JSON_FILE);
    let mut json = serde_json::to_string_pretty(reports).map_err(|source| ReportError::Json {
        path: json_path.clone(),
        source,
    })?;
    json.push('\n');
    write_file(&json_path, json.as_bytes())?;
    written.files.push(json_path);

    let charts = charts(reports);
    if charts.is_empty() {
        written.charts_skipped = Some("no load level with a plottable value".to_owned());
    } else {
        register_fonts()?;
    }
    let mut svgs = Vec::with_capacity(charts.len());
    for chart in &charts {
        let path = dir.join(chart.file_name("png"));
        write_png(&path, CHART_SIZE, |root| draw_chart(root, chart))?;
        written.files.push(path);
        svgs.push(render_svg(chart).map_err(|e| ReportError::Chart {
            path: dir.join(HTML_FILE),
            message: e.to_string(),
        })?);
    }

    let html_path = dir.join(HTML_FILE);
    write_file(&html_path, html(reports, &charts, &svgs).as_bytes())?;
    written.files.push(html_path);
    Ok(written)
}

/// Reads the reports back from a `report.json` written by [`write`].
pub fn read_json(path: &Path) -> Result<Vec<Report>, ReportError> {
    let text = fs::read_to_string(path).map_err(|source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| ReportError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// Writes each chart of `page` that has bars as `<stem>.png`, then `index.html` with the
/// parameters, the table and the same charts inline as SVG, into `dir` (created when
/// needed).
pub fn write_bars(dir: &Path, page: &BarPage) -> Result<Written, ReportError> {
    fs::create_dir_all(dir).map_err(|source| ReportError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut written = Written::default();
    let charts: Vec<&BarChart> = page.charts.iter().filter(|c| !c.bars.is_empty()).collect();
    if charts.is_empty() {
        written.charts_skipped = Some("no configuration with a value to chart".to_owned());
    } else {
        register_fonts()?;
    }
    let mut svgs = Vec::with_capacity(charts.len());
    for chart in &charts {
        let layout = BarLayout::new(chart);
        let path = dir.join(format!("{}.png", chart.stem));
        write_png(&path, layout.size, |root| draw_bars(root, chart, &layout))?;
        written.files.push(path);
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, layout.size).into_drawing_area();
            draw_bars(&root, chart, &layout).map_err(|e| ReportError::Chart {
                path: dir.join(HTML_FILE),
                message: e.to_string(),
            })?;
        }
        svgs.push(svg);
    }
    let html_path = dir.join(HTML_FILE);
    write_file(&html_path, bar_html(page, &charts, &svgs).as_bytes())?;
    written.files.push(html_path);
    Ok(written)
}

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

use std::fmt::Write as _;
use std::fs;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;

use crate::summary::{LevelSummary, Report};

/// File name of the JSON copy of the reports.
pub const JSON_FILE: &str = "report.json";
/// File name of the HTML page.
pub const HTML_FILE: &str = "index.html";

/// Chart size in pixels (PNG) or user units (SVG).
const CHART_SIZE: (u32, u32) = (960, 560);

/// What [`write`] wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Written {
    /// Every file written, in the order written: `report.json` ([`write`] only), the
    /// charts, `index.html`.
    pub files: Vec<PathBuf>,
    /// Why no chart was written, when none was (for example: no load levels at all).
    pub charts_skipped: Option<String>,
}

/// Why writing or reading a report failed.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Creating, writing or reading a file or folder failed.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The reports could not be turned into JSON, or the file is not a JSON array of reports.
    #[error("{}: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// Drawing a chart failed.
    #[error("{}: drawing the chart failed: {message}", path.display())]
    Chart { path: PathBuf, message: String },
    /// Encoding a chart as PNG failed.
    #[error("{}: encoding the PNG failed: {source}", path.display())]
    Png {
        path: PathBuf,
        #[source]
        source: png::EncodingError,
    },
    /// The font built into the program could not be loaded (a build problem, not a data one).
    #[error("the built-in chart font could not be loaded")]
    Font,
}

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
        write_png(&path, CHART_SIZE, |root| {
            draw_chart(root, chart).map_err(|e| e.to_string())
        })?;
        written.files.push(path);
        svgs.push(render_svg(chart).map_err(|message| ReportError::Chart {
            path: dir.join(HTML_FILE),
            message,
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

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    fs::write(path, bytes).map_err(|source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    })
}

// ---------------------------------------------------------------------------------------
// Levels: closed loop (x = concurrency) or open loop (x = request rate).

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Closed,
    Open,
}

impl Mode {
    fn file_suffix(self) -> &'static str {
        match self {
            Mode::Closed => "",
            Mode::Open => "_rate",
        }
    }

    fn x_desc(self) -> &'static str {
        match self {
            Mode::Closed => "concurrency (requests in flight, log scale)",
            Mode::Open => "request rate (requests/s, log scale)",
        }
    }
}

/// Where a level sits: its mode and x value. Concurrency wins when both are set; `None`
/// when neither is.
fn level_x(level: &LevelSummary) -> Option<(Mode, f64)> {
    match (level.concurrency, level.rate) {
        (Some(c), _) => Some((Mode::Closed, f64::from(c))),
        (None, Some(r)) => Some((Mode::Open, r)),
        (None, None) => None,
    }
}

/// How a level is named in tables: "c=4", "2.5 req/s", or "?" when it has no load setting.
fn level_name(level: &LevelSummary) -> String {
    match level_x(level) {
        Some((Mode::Closed, x)) => format!("c={x}"),
        Some((Mode::Open, x)) => format!("{} req/s", axis_number(x)),
        None => "?".to_owned(),
    }
}

// ---------------------------------------------------------------------------------------
// Charts.

/// Picks one value (already in the chart's unit) from a level, if it has one.
type Pick = fn(&LevelSummary) -> Option<f64>;

struct Metric {
    stem: &'static str,
    title: &'static str,
    y_desc: &'static str,
    unit: &'static str,
    /// (series name suffix, dashed, value).
    series: &'static [(&'static str, bool, Pick)],
}

const METRICS: &[Metric] = &[
    Metric {
        stem: "ttft",
        title: "Time to first token",
        y_desc: "TTFT (ms)",
        unit: "ms",
        series: &[
            ("p50", false, |l| Some(l.ttft.p50 * 1e3)),
            ("p99", true, |l| Some(l.ttft.p99 * 1e3)),
        ],
    },
    Metric {
        stem: "throughput",
        title: "Output throughput",
        y_desc: "output tokens/s",
        unit: "tok/s",
        series: &[("", false, |l| Some(l.output_tokens_per_s))],
    },
    Metric {
        stem: "itl",
        title: "Inter-token latency",
        y_desc: "ITL (ms)",
        unit: "ms",
        series: &[
            ("p50", false, |l| Some(l.itl.p50 * 1e3)),
            ("p99", true, |l| Some(l.itl.p99 * 1e3)),
        ],
    },
    Metric {
        stem: "e2e",
        title: "End-to-end latency",
        y_desc: "end-to-end (s)",
        unit: "s",
        series: &[
            ("p50", false, |l| Some(l.e2e.p50)),
            ("p99", true, |l| Some(l.e2e.p99)),
        ],
    },
    Metric {
        stem: "corruption",
        title: "Answers differing from the reference",
        y_desc: "corrupted answers (%)",
        unit: "%",
        series: &[("", false, |l| {
            l.differential.as_ref().map(|d| d.corruption_rate() * 100.0)
        })],
    },
];

/// Line colours, one per report (cycled).
const PALETTE: &[RGBColor] = &[
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

struct Series {
    name: String,
    color: RGBColor,
    dashed: bool,
    /// (log2 of x, y), sorted by x.
    points: Vec<(f64, f64)>,
}

struct Chart {
    stem: &'static str,
    mode: Mode,
    title: String,
    y_desc: &'static str,
    series: Vec<Series>,
}

impl Chart {
    /// "ttft", "ttft_rate", ...
    fn name(&self) -> String {
        format!("{}{}", self.stem, self.mode.file_suffix())
    }

    fn file_name(&self, ext: &str) -> String {
        format!("{}.{ext}", self.name())
    }
}

/// Every chart that has at least one point, closed-loop ones first.
fn charts(reports: &[Report]) -> Vec<Chart> {
    let mut charts = Vec::new();
    for mode in [Mode::Closed, Mode::Open] {
        for metric in METRICS {
            let mut series = Vec::new();
            for (i, report) in reports.iter().enumerate() {
                for &(suffix, dashed, pick) in metric.series {
                    let mut points: Vec<(f64, f64)> = report
                        .levels
                        .iter()
                        .filter_map(|level| {
                            let (m, x) = level_x(level)?;
                            let y = pick(level)?;
                            // A log axis has no place for x <= 0.
                            (m == mode && x > 0.0 && x.is_finite() && y.is_finite())
                                .then(|| (x.log2(), y))
                        })
                        .collect();
                    if points.is_empty() {
                        continue;
                    }
                    points.sort_by(|a, b| a.0.total_cmp(&b.0));
                    let mut name = report.label.clone();
                    if !suffix.is_empty() {
                        name.push(' ');
                        name.push_str(suffix);
                    }
                    let _ = write!(name, " ({})", metric.unit);
                    series.push(Series {
                        name,
                        color: PALETTE[i % PALETTE.len()],
                        dashed,
                        points,
                    });
                }
            }
            if series.is_empty() {
                continue;
            }
            let title = match mode {
                Mode::Closed => format!("{} vs concurrency", metric.title),
                Mode::Open => format!("{} vs request rate", metric.title),
            };
            charts.push(Chart {
                stem: metric.stem,
                mode,
                title,
                y_desc: metric.y_desc,
                series,
            });
        }
    }
    charts
}

/// Registers the built-in DejaVu Sans under plotters' generic family names, once.
fn register_fonts() -> Result<(), ReportError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        ["sans-serif", "serif", "monospace"].iter().all(|family| {
            plotters::style::register_font(family, FontStyle::Normal, dejavu::sans::regular())
                .is_ok()
                && plotters::style::register_font(family, FontStyle::Bold, dejavu::sans::bold())
                    .is_ok()
        })
    });
    if ok { Ok(()) } else { Err(ReportError::Font) }
}

/// Axis tick text for a value: integers without decimals, others with up to 3 decimals.
fn axis_number(x: f64) -> String {
    if (x - x.round()).abs() < 1e-9 * x.abs().max(1.0) {
        format!("{}", x.round())
    } else {
        let s = format!("{x:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

fn draw_chart<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &Chart,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let all = chart.series.iter().flat_map(|s| s.points.iter());
    let (mut x_lo, mut x_hi, mut y_hi) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
    for &(x, y) in all {
        x_lo = x_lo.min(x);
        x_hi = x_hi.max(x);
        y_hi = y_hi.max(y);
    }
    // Room around the outer points, and above the highest one for the legend.
    let (x_lo, x_hi) = (x_lo - 0.25, x_hi + 0.25);
    let y_hi = if y_hi > 0.0 { y_hi * 1.3 } else { 1.0 };
    let x_labels = ((x_hi - x_lo).ceil() as usize + 1).max(2);

    let mut ctx = ChartBuilder::on(root)
        .caption(&chart.title, ("sans-serif", 26))
        .margin(16)
        .x_label_area_size(56)
        .y_label_area_size(80)
        .build_cartesian_2d(x_lo..x_hi, 0.0..y_hi)?;
    let x_fmt = |v: &f64| axis_number(v.exp2());
    let y_fmt = |v: &f64| axis_number(*v);
    ctx.configure_mesh()
        .x_labels(x_labels)
        .x_label_formatter(&x_fmt)
        .y_labels(8)
        .y_label_formatter(&y_fmt)
        .y_max_light_lines(1)
        .x_desc(chart.mode.x_desc())
        .y_desc(chart.y_desc)
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        // Light lines between ticks would sit at meaningless places on a log axis.
        .x_max_light_lines(0)
        .draw()?;

    for s in &chart.series {
        let style = s.color.stroke_width(2);
        let points = s.points.clone();
        let name = s.name.clone();
        if s.dashed {
            ctx.draw_series(DashedLineSeries::new(points, 8, 5, style))?
                .label(name)
                .legend(move |(x, y)| {
                    DashedPathElement::new(vec![(x, y), (x + 24, y)], 6, 3, style)
                });
        } else {
            ctx.draw_series(LineSeries::new(points, style))?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        }
        // Filled markers for p50 (solid lines), hollow ones for p99 (dashed lines).
        let marker = if s.dashed { style } else { style.filled() };
        ctx.draw_series(s.points.iter().map(|&p| Circle::new(p, 4, marker)))?;
    }
    ctx.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()?;
    root.present()
}

/// Draws a `size` picture with `draw` and writes it to `path` as PNG.
fn write_png(
    path: &Path,
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<BitMapBackend<'_>, Shift>) -> Result<(), String>,
) -> Result<(), ReportError> {
    let (w, h) = size;
    let mut rgb = vec![0u8; w as usize * h as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
        draw(&root).map_err(|message| ReportError::Chart {
            path: path.to_path_buf(),
            message,
        })?;
    }
    let file = fs::File::create(path).map_err(|source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let png_err = |source| ReportError::Png {
        path: path.to_path_buf(),
        source,
    };
    let mut encoder = png::Encoder::new(BufWriter::new(file), w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(png_err)?;
    writer.write_image_data(&rgb).map_err(png_err)?;
    writer.finish().map_err(png_err)
}

fn render_svg(chart: &Chart) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, CHART_SIZE).into_drawing_area();
        draw_chart(&root, chart).map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

// ---------------------------------------------------------------------------------------
// Bar charts: one labelled bar per configuration, for results measured at a single load
// (a matrix of configurations) rather than along a load axis.

/// One bar of a [`BarChart`]: one configuration's value.
#[derive(Clone, Debug, PartialEq)]
pub struct Bar {
    /// Consecutive bars of one group sit together; a gap separates groups.
    pub group: String,
    /// The configuration, written left of its bar.
    pub label: String,
    /// Its colour and legend entry: an index into [`BarChart::keys`].
    pub key: usize,
    /// Where the bar ends on the value axis (not finite: no bar, only its text).
    pub value: f64,
    /// The value as written right of the bar's end, e.g. "12 ms" or "0.0% (0/12)".
    pub text: String,
}

/// A horizontal bar chart: one labelled bar per configuration with its value written at
/// its end, a linear value axis from 0 with ticks at round values only, and the colour
/// legend between the title and the bars, never over them.
#[derive(Clone, Debug, PartialEq)]
pub struct BarChart {
    /// File name without extension: `corruption` is written as `corruption.png`.
    pub stem: String,
    pub title: String,
    /// What the value axis measures, with its unit.
    pub value_desc: String,
    /// What each colour means; the legend shows the keys some bar uses.
    pub keys: Vec<String>,
    pub bars: Vec<Bar>,
}

/// A page of results at a single load: parameters, one table, bar charts. What
/// [`write_bars`] writes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BarPage {
    pub title: String,
    /// (name, value) pairs shown above the table.
    pub params: Vec<(String, String)>,
    pub header: Vec<String>,
    /// The table's rows, one cell per header column.
    pub rows: Vec<Vec<String>>,
    pub charts: Vec<BarChart>,
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
        write_png(&path, layout.size, |root| {
            draw_bars(root, chart, &layout).map_err(|e| e.to_string())
        })?;
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

/// Bar colours, by [`Bar::key`] (cycled): pairs of a dark and a light shade, so that keys
/// 0/1 and 2/3 read as two settings of one thing under another.
const BAR_PALETTE: &[RGBColor] = &[
    RGBColor(31, 119, 180),
    RGBColor(158, 202, 225),
    RGBColor(230, 85, 13),
    RGBColor(253, 174, 107),
    RGBColor(49, 163, 84),
    RGBColor(161, 217, 155),
];

fn bar_color(key: usize) -> RGBColor {
    BAR_PALETTE[key % BAR_PALETTE.len()]
}

// Sizes in pixels (PNG) or user units (SVG), and font sizes.
const BAR_MIN_WIDTH: u32 = 1100;
const BAR_MARGIN: i32 = 20;
const BAR_ROW: i32 = 34;
const BAR_THICKNESS: i32 = 22;
const BAR_GROUP_GAP: i32 = 16;
const BAR_PLOT_MIN: i32 = 420;
const TITLE_FONT: u32 = 26;
const LEGEND_FONT: u32 = 18;
const LABEL_FONT: u32 = 18;
const VALUE_FONT: u32 = 17;
const TICK_FONT: u32 = 17;
const SWATCH: i32 = 16;

/// Width of `text` in the built-in font at `size` (a rough guess if the font is missing).
fn text_width(text: &str, size: u32) -> i32 {
    ("sans-serif", size)
        .into_font()
        .box_size(text)
        .map(|(w, _)| w as i32)
        .unwrap_or_else(|_| (text.chars().count() as u32 * size * 3 / 5) as i32)
}

/// Ticks for a value axis from 0 that covers `max`: about five steps of 1, 2 or 5 times a
/// power of ten, and the decimals that write them exactly.
fn round_ticks(max: f64) -> (Vec<f64>, usize) {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let raw = max / 5.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * magnitude);
    let n = ((max / step) - 1e-9).ceil().max(1.0) as usize;
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    ((0..=n).map(|i| i as f64 * step).collect(), decimals)
}

/// Where everything of a bar chart goes, worked out once for both the PNG and the SVG.
struct BarLayout {
    size: (u32, u32),
    /// The value axis: 0 at `x0`, the last tick at `x1`.
    x0: i32,
    x1: i32,
    plot_top: i32,
    plot_bottom: i32,
    /// Legend entries: (key, swatch x, swatch y), all above `plot_top`.
    legend: Vec<(usize, i32, i32)>,
    /// The centre line of each bar, in the order of [`BarChart::bars`].
    rows: Vec<i32>,
    ticks: Vec<f64>,
    decimals: usize,
}

impl BarLayout {
    fn new(chart: &BarChart) -> Self {
        let label_w = chart
            .bars
            .iter()
            .map(|b| text_width(&b.label, LABEL_FONT))
            .max()
            .unwrap_or(0)
            + 16;
        let value_w = chart
            .bars
            .iter()
            .map(|b| text_width(&b.text, VALUE_FONT))
            .max()
            .unwrap_or(0)
            .max(40)
            + 16;
        let title_w = text_width(&chart.title, TITLE_FONT) + 2 * BAR_MARGIN;
        let width = (BAR_MIN_WIDTH as i32)
            .max(2 * BAR_MARGIN + label_w + BAR_PLOT_MIN + value_w)
            .max(title_w);
        let x0 = BAR_MARGIN + label_w;
        let x1 = width - BAR_MARGIN - value_w;

        // The legend, in key order, wrapped to the width, between the title and the bars.
        let mut used: Vec<usize> = chart.bars.iter().map(|b| b.key).collect();
        used.sort_unstable();
        used.dedup();
        let mut legend = Vec::new();
        let legend_top = BAR_MARGIN + TITLE_FONT as i32 + 16;
        let (mut x, mut y) = (x0, legend_top);
        for key in used {
            let text = chart.keys.get(key).map(String::as_str).unwrap_or("");
            let w = SWATCH + 8 + text_width(text, LEGEND_FONT) + 28;
            if x + w > width - BAR_MARGIN && x > x0 {
                x = x0;
                y += SWATCH + 10;
            }
            legend.push((key, x, y));
            x += w;
        }
        let legend_bottom = if legend.is_empty() {
            legend_top
        } else {
            y + SWATCH
        };

        let plot_top = legend_bottom + 16;
        let mut y = plot_top + 8;
        let mut rows = Vec::with_capacity(chart.bars.len());
        for (i, bar) in chart.bars.iter().enumerate() {
            if i > 0 && chart.bars[i - 1].group != bar.group {
                y += BAR_GROUP_GAP;
            }
            rows.push(y + BAR_ROW / 2);
            y += BAR_ROW;
        }
        let plot_bottom = y + 8;
        let height = plot_bottom + 8 + TICK_FONT as i32 + 16 + LABEL_FONT as i32 + BAR_MARGIN;
        let max = chart
            .bars
            .iter()
            .map(|b| b.value)
            .filter(|v| v.is_finite())
            .fold(0.0f64, f64::max);
        let (ticks, decimals) = round_ticks(max);
        Self {
            size: (width as u32, height as u32),
            x0,
            x1,
            plot_top,
            plot_bottom,
            legend,
            rows,
            ticks,
            decimals,
        }
    }

    /// The x of `value` on the value axis, clamped to it.
    fn x(&self, value: f64) -> i32 {
        let top = self.ticks.last().copied().unwrap_or(1.0);
        let share = if value.is_finite() {
            (value / top).clamp(0.0, 1.0)
        } else {
            0.0
        };
        self.x0 + (share * f64::from(self.x1 - self.x0)).round() as i32
    }
}

fn draw_bars<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &BarChart,
    l: &BarLayout,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    use plotters::style::text_anchor::{HPos, Pos, VPos};
    let font = |size: u32, h: HPos, v: VPos| {
        ("sans-serif", size)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(h, v))
    };
    root.fill(&WHITE)?;
    root.draw_text(
        &chart.title,
        &font(TITLE_FONT, HPos::Left, VPos::Top),
        (BAR_MARGIN, BAR_MARGIN),
    )?;
    for &(key, x, y) in &l.legend {
        root.draw(&Rectangle::new(
            [(x, y), (x + SWATCH, y + SWATCH)],
            bar_color(key).filled(),
        ))?;
        root.draw(&Rectangle::new(
            [(x, y), (x + SWATCH, y + SWATCH)],
            BLACK.mix(0.5).stroke_width(1),
        ))?;
        let text = chart.keys.get(key).map(String::as_str).unwrap_or("");
        root.draw_text(
            text,
            &font(LEGEND_FONT, HPos::Left, VPos::Center),
            (x + SWATCH + 8, y + SWATCH / 2),
        )?;
    }
    // Grid lines and tick labels at the round ticks only.
    for &t in &l.ticks {
        let x = l.x(t);
        root.draw(&PathElement::new(
            vec![(x, l.plot_top), (x, l.plot_bottom)],
            BLACK.mix(0.15).stroke_width(1),
        ))?;
        root.draw_text(
            &format!("{t:.*}", l.decimals),
            &font(TICK_FONT, HPos::Center, VPos::Top),
            (x, l.plot_bottom + 8),
        )?;
    }
    let axis = BLACK.mix(0.7).stroke_width(1);
    root.draw(&PathElement::new(
        vec![
            (l.x0, l.plot_top),
            (l.x0, l.plot_bottom),
            (l.x1, l.plot_bottom),
        ],
        axis,
    ))?;
    root.draw_text(
        &chart.value_desc,
        &font(LABEL_FONT, HPos::Center, VPos::Top),
        ((l.x0 + l.x1) / 2, l.plot_bottom + 8 + TICK_FONT as i32 + 12),
    )?;
    for (bar, &y) in chart.bars.iter().zip(&l.rows) {
        let end = l.x(bar.value);
        let (top, bottom) = (y - BAR_THICKNESS / 2, y + BAR_THICKNESS / 2);
        if bar.value.is_finite() && end > l.x0 {
            root.draw(&Rectangle::new(
                [(l.x0, top), (end, bottom)],
                bar_color(bar.key).filled(),
            ))?;
            root.draw(&Rectangle::new(
                [(l.x0, top), (end, bottom)],
                BLACK.mix(0.5).stroke_width(1),
            ))?;
        }
        root.draw_text(
            &bar.label,
            &font(LABEL_FONT, HPos::Right, VPos::Center),
            (l.x0 - 10, y),
        )?;
        root.draw_text(
            &bar.text,
            &font(VALUE_FONT, HPos::Left, VPos::Center),
            (end + 6, y),
        )?;
    }
    root.present()
}

fn bar_html(page: &BarPage, charts: &[&BarChart], svgs: &[String]) -> String {
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

// ---------------------------------------------------------------------------------------
// HTML.

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

fn html(reports: &[Report], charts: &[Chart], svgs: &[String]) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::summary::{Differential, Percentiles};

    fn pct(p50: f64, p99: f64) -> Percentiles {
        Percentiles {
            mean: p50 * 1.1,
            p50,
            p90: (p50 + p99) / 2.0,
            p99,
            max: p99 * 1.2,
        }
    }

    /// A closed-loop level; `slow` scales latencies up and throughput down.
    fn level(concurrency: u32, slow: f64, differential: bool) -> LevelSummary {
        let c = f64::from(concurrency);
        LevelSummary {
            concurrency: Some(concurrency),
            rate: None,
            requests: 50 * concurrency,
            errors: concurrency / 4,
            errors_by_kind: [("429".to_owned(), concurrency / 4)].into_iter().collect(),
            duration_s: 30.0,
            ttft: pct(0.05 * slow * c.sqrt(), 0.2 * slow * c.sqrt()),
            itl: pct(0.012 * slow, 0.03 * slow),
            e2e: pct(1.5 * slow, 3.0 * slow),
            output_tokens_per_s: 80.0 * c / slow,
            requests_per_s: 0.6 * c / slow,
            cached_share: 0.25,
            prefill_tokens_per_s: 900.0 / slow,
            differential: differential.then_some(Differential {
                compared: 40 * concurrency,
                corrupted: concurrency / 2,
                tool_calls_expected: 10,
                tool_calls_valid: 9,
                tool_calls_truncated: 1,
                reference_errors: 0,
            }),
        }
    }

    fn report(label: &str, slow: f64, differential: bool) -> Report {
        Report {
            label: label.to_owned(),
            url: "http://127.0.0.1:8080/v1".to_owned(),
            model: "qwen2.5-0.5b-instruct".to_owned(),
            workload: "random in=512 out=128".to_owned(),
            started: "2025-01-02T03:04:05Z".to_owned(),
            levels: [1, 4, 16]
                .into_iter()
                .map(|c| level(c, slow, differential))
                .collect(),
        }
    }

    fn pair() -> Vec<Report> {
        vec![report("pdmesh", 1.0, true), report("llama.cpp", 2.0, false)]
    }

    fn names(written: &Written) -> Vec<String> {
        written
            .files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    }

    /// Checks the PNG signature and IHDR, decodes it, and returns its RGB pixels.
    fn check_png(path: &Path) -> Vec<u8> {
        let bytes = fs::read(path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{}", path.display());
        assert_eq!(&bytes[12..16], b"IHDR");
        let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
        let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
        assert_eq!((w, h), CHART_SIZE, "{}", path.display());

        let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
        let mut reader = decoder.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), CHART_SIZE);
        assert_eq!(info.color_type, png::ColorType::Rgb);
        buf.truncate(info.buffer_size());
        buf
    }

    /// Share of pixels that are not white.
    fn ink(pixels: &[u8]) -> f64 {
        let inked = pixels
            .chunks_exact(3)
            .filter(|p| p != &[255, 255, 255])
            .count();
        inked as f64 / (pixels.len() / 3) as f64
    }

    /// How many pixels right of column `from` have exactly `color`, and the rows they span
    /// (top, bottom).
    fn colored(pixels: &[u8], color: RGBColor, from: usize) -> (usize, usize, usize) {
        let (mut n, mut top, mut bottom) = (0, usize::MAX, 0);
        let width = CHART_SIZE.0 as usize;
        for (i, p) in pixels.chunks_exact(3).enumerate() {
            if p == [color.0, color.1, color.2] && i % width >= from {
                let row = i / width;
                n += 1;
                top = top.min(row);
                bottom = bottom.max(row);
            }
        }
        (n, top, bottom)
    }

    #[test]
    fn writes_every_file_for_a_pair() {
        let dir = tempfile::TempDir::new().unwrap();
        let out = dir.path().join("nested/out");
        let reports = pair();
        let written = write(&out, &reports).unwrap();

        assert_eq!(
            names(&written),
            [
                "report.json",
                "ttft.png",
                "throughput.png",
                "itl.png",
                "e2e.png",
                "corruption.png",
                "index.html",
            ]
        );
        assert_eq!(written.charts_skipped, None);
        for path in &written.files {
            assert!(path.starts_with(&out));
            let len = fs::metadata(path).unwrap().len();
            assert!(len > 0, "{} is empty", path.display());
            if path.extension().is_some_and(|e| e == "png") {
                let inked = ink(&check_png(path));
                // Axes, grid, lines and text: some ink, but mostly background.
                assert!(inked > 0.01 && inked < 0.5, "{}: {inked}", path.display());
            }
        }
        // Each report's lines are drawn in its own colour, and in the right half of the
        // TTFT chart (right of the legend) its p50 and p99 lines lie far apart.
        let ttft = check_png(&out.join("ttft.png"));
        let right_half = CHART_SIZE.0 as usize / 2;
        for color in &PALETTE[..2] {
            let (n, top, bottom) = colored(&ttft, *color, right_half);
            assert!(n > 500, "{color:?}: {n} pixels");
            assert!(bottom - top > 100, "{color:?}: rows {top}..{bottom}");
        }
        // One report in corruption.png: the second colour is absent.
        let corruption = check_png(&out.join("corruption.png"));
        assert!(colored(&corruption, PALETTE[0], 0).0 > 500);
        assert_eq!(colored(&corruption, PALETTE[1], 0).0, 0);
        // Only closed-loop levels: no `_rate` charts.
        assert!(!out.join("ttft_rate.png").exists());

        assert_eq!(read_json(&out.join(JSON_FILE)).unwrap(), reports);
    }

    #[test]
    fn html_has_parameters_tables_ratios_and_charts() {
        let dir = tempfile::TempDir::new().unwrap();
        let reports = pair();
        write(dir.path(), &reports).unwrap();
        let html = fs::read_to_string(dir.path().join(HTML_FILE)).unwrap();

        assert!(html.starts_with("<!DOCTYPE html>"));
        assert!(html.contains("<title>pdmesh bench report: pdmesh vs llama.cpp</title>"));
        for label in ["pdmesh", "llama.cpp"] {
            assert!(html.contains(&format!("<h2>{label}</h2>")), "{label}");
        }
        assert!(html.contains("<dd>http://127.0.0.1:8080/v1</dd>"));
        assert!(html.contains("<dd>qwen2.5-0.5b-instruct</dd>"));
        assert!(html.contains("<dd>random in=512 out=128</dd>"));
        assert!(html.contains("<dd>2025-01-02T03:04:05Z</dd>"));
        // Each level's row, in each report's table: c=4 for pdmesh has 200 requests, 1
        // error (a 429), TTFT p50 0.05*2 s = 100.0 ms, p99 400.0 ms, 2 corrupted of 160 =
        // 1.25 %, 9 of 10 tool calls valid, prefill 900 tokens/s.
        assert!(html.contains(
            "<tr><td>c=4</td><td>200</td><td>1 (429: 1)</td><td>100.0</td><td>400.0</td>\
             <td>12.0</td><td>30.0</td><td>1.50</td><td>3.00</td><td>320.0</td><td>900.0</td>\
             <td>2.40</td>\
             <td>25.0</td><td>1.25 (2/160)</td><td>90.0 (9/10)</td></tr>"
        ));
        // No errors at c=1: no kinds listed.
        assert!(html.contains("<tr><td>c=1</td><td>50</td><td>0</td><td>50.0</td>"));
        for c in [1, 4, 16] {
            let row = format!("<tr><td>c={c}</td><td>{}</td>", 50 * c);
            assert_eq!(html.matches(&row).count(), 2, "{row}");
        }
        // llama.cpp has no differential: no corruption columns in its table.
        assert_eq!(html.matches("<th>corruption %</th>").count(), 1);

        // Ratios: pdmesh is twice as fast: TTFT 0.5x, throughput 2x, at every level.
        assert!(html.contains("<h2 id=\"ratios\">Ratios: pdmesh / llama.cpp</h2>"));
        for c in [1, 4, 16] {
            let row = format!("<tr><td>c={c}</td><td>0.50</td><td>0.50</td><td>2.00</td></tr>");
            assert!(html.contains(&row), "{row}");
        }

        // Five charts inline as SVG, each with its series in the legend.
        assert_eq!(html.matches("<svg").count(), 5);
        assert!(html.contains("pdmesh p99 (ms)"));
        assert!(html.contains("llama.cpp (tok/s)"));
        assert!(html.contains("Time to first token vs concurrency"));
        // Self-contained: nothing loaded from elsewhere.
        assert!(!html.contains("<script"));
        assert!(!html.contains("<link"));
        assert!(!html.contains("src="));
        assert!(!html.contains(".png\""));
    }

    #[test]
    fn report_strings_are_escaped() {
        let dir = tempfile::TempDir::new().unwrap();
        let mut evil = report("<script>alert('x')</script>", 1.0, false);
        evil.model = "a&b \"quoted\"".to_owned();
        let written = write(dir.path(), &[evil.clone()]).unwrap();
        let html = fs::read_to_string(dir.path().join(HTML_FILE)).unwrap();

        assert!(!html.contains("<script"), "raw label in the page");
        assert!(html.contains("<h2>&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;</h2>"));
        assert!(html.contains("<dd>a&amp;b &quot;quoted&quot;</dd>"));
        // One report: no ratios.
        assert!(!html.contains("id=\"ratios\""));
        assert_eq!(read_json(&written.files[0]).unwrap(), vec![evil]);
    }

    #[test]
    fn empty_input_still_gives_json_and_html() {
        let dir = tempfile::TempDir::new().unwrap();
        let written = write(dir.path(), &[]).unwrap();
        assert_eq!(names(&written), ["report.json", "index.html"]);
        assert!(written.charts_skipped.is_some());
        assert_eq!(fs::read_to_string(&written.files[0]).unwrap().trim(), "[]");
        assert!(read_json(&written.files[0]).unwrap().is_empty());
        let html = fs::read_to_string(&written.files[1]).unwrap();
        assert!(html.contains("id=\"no-data\""));
        assert!(!html.contains("<svg"));

        // Reports without levels: the same, with their parameters shown.
        let mut a = report("pdmesh", 1.0, false);
        let mut b = report("llama.cpp", 1.0, false);
        a.levels.clear();
        b.levels.clear();
        let out = dir.path().join("levelless");
        let written = write(&out, &[a.clone(), b.clone()]).unwrap();
        assert_eq!(names(&written), ["report.json", "index.html"]);
        assert!(written.charts_skipped.is_some());
        assert_eq!(read_json(&written.files[0]).unwrap(), vec![a, b]);
        let html = fs::read_to_string(&written.files[1]).unwrap();
        assert!(html.contains("id=\"no-data\""));
        assert!(html.contains("<h2>pdmesh</h2>") && html.contains("<h2>llama.cpp</h2>"));
        assert!(html.contains("No load level was run by both."));
        assert!(!html.contains("<svg"));
    }

    #[test]
    fn open_loop_levels_go_to_rate_charts() {
        let dir = tempfile::TempDir::new().unwrap();
        let mut r = report("pdmesh", 1.0, false);
        let mut open = level(2, 1.0, false);
        open.concurrency = None;
        open.rate = Some(2.5);
        r.levels.push(open);
        let written = write(dir.path(), &[r]).unwrap();
        let files = names(&written);
        for stem in ["ttft", "throughput", "itl", "e2e"] {
            assert!(files.contains(&format!("{stem}.png")), "{stem}");
            assert!(files.contains(&format!("{stem}_rate.png")), "{stem}");
        }
        assert!(!files.iter().any(|n| n.starts_with("corruption")));
        for name in &files {
            if name.ends_with(".png") {
                check_png(&dir.path().join(name));
            }
        }
        let html = fs::read_to_string(dir.path().join(HTML_FILE)).unwrap();
        assert!(html.contains("<tr><td>2.5 req/s</td>"));
        assert!(html.contains("Time to first token vs request rate"));
        assert_eq!(html.matches("<svg").count(), 8);

        // Only open-loop levels: only `_rate` charts.
        let mut r = report("pdmesh", 1.0, true);
        for l in &mut r.levels {
            l.rate = l.concurrency.take().map(f64::from);
        }
        let out = dir.path().join("open");
        let files = names(&write(&out, &[r]).unwrap());
        assert!(files.contains(&"ttft_rate.png".to_owned()));
        assert!(files.contains(&"corruption_rate.png".to_owned()));
        assert!(!files.contains(&"ttft.png".to_owned()));
    }

    /// Text is drawn with the built-in font: no system fonts needed.
    #[test]
    fn text_renders_with_the_built_in_font() {
        register_fonts().unwrap();
        let (w, h) = (200u32, 60u32);
        let mut rgb = vec![255u8; (w * h * 3) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
            root.draw_text(
                "TTFT 123",
                &("sans-serif", 30).into_font().color(&BLACK),
                (5, 5),
            )
            .unwrap();
            root.present().unwrap();
        }
        let dark = rgb.chunks_exact(3).filter(|p| p[0] < 128).count();
        assert!(dark > 100, "only {dark} dark pixels: text was not drawn");
    }

    #[test]
    fn bad_json_names_the_path() {
        let dir = tempfile::TempDir::new().unwrap();
        let path = dir.path().join("report.json");
        fs::write(&path, "{\"not\": \"a list\"}").unwrap();
        let err = read_json(&path).unwrap_err();
        assert!(matches!(err, ReportError::Json { .. }));
        assert!(err.to_string().contains("report.json"), "{err}");
        let missing = dir.path().join("missing.json");
        let err = read_json(&missing).unwrap_err();
        assert!(matches!(err, ReportError::Io { .. }));
        assert!(err.to_string().contains("missing.json"), "{err}");
    }

    #[test]
    fn bar_axes_tick_at_round_values_covering_the_largest() {
        // The old log axis put its only ticks at 73.517 and 84.449 around c=80.
        let (ticks, decimals) = round_ticks(84.449);
        assert_eq!(ticks, [0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        assert_eq!(decimals, 0);
        assert_eq!(round_ticks(3941.0).0, [0.0, 1000.0, 2000.0, 3000.0, 4000.0]);
        assert_eq!(round_ticks(80.0).0.last(), Some(&80.0));
        // Nothing above zero (no corruption anywhere): a 0..1 axis, written with a decimal.
        let (ticks, decimals) = round_ticks(0.0);
        assert_eq!(ticks.len(), 6);
        assert_eq!((ticks[1], ticks[5], decimals), (0.2, 1.0, 1));
        assert_eq!(round_ticks(f64::NAN).0, round_ticks(0.0).0);
    }

    #[test]
    fn a_bar_page_without_rows_has_no_charts() {
        let dir = tempfile::TempDir::new().unwrap();
        let page = BarPage {
            title: "empty <matrix>".to_owned(),
            header: vec!["model".to_owned()],
            charts: vec![BarChart {
                stem: "corruption".to_owned(),
                title: "Answers differing".to_owned(),
                value_desc: "%".to_owned(),
                keys: vec!["PD".to_owned()],
                bars: Vec::new(),
            }],
            ..BarPage::default()
        };
        let written = write_bars(dir.path(), &page).unwrap();
        assert_eq!(names(&written), ["index.html"]);
        assert!(written.charts_skipped.is_some());
        let html = fs::read_to_string(dir.path().join(HTML_FILE)).unwrap();
        assert!(html.contains("<h1>empty &lt;matrix&gt;</h1>") && html.contains("id=\"no-data\""));
        assert!(!html.contains("<svg"));
    }

    #[test]
    fn axis_numbers_are_short() {
        assert_eq!(axis_number(16.0), "16");
        assert_eq!(axis_number(2f64.powf(-1.0)), "0.5");
        assert_eq!(axis_number(2.5), "2.5");
        assert_eq!(axis_number(1.0 / 3.0), "0.333");
    }
}

//! Line charts along a load axis: one series per report and percentile, plotted against
//! concurrency (closed loop) or request rate (open loop) on a log axis.

use std::fmt::Write as _;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;

use crate::summary::{LevelSummary, Report};

/// Chart size in pixels (PNG) or user units (SVG).
pub(super) const CHART_SIZE: (u32, u32) = (960, 560);

// ---------------------------------------------------------------------------------------
// Levels: closed loop (x = concurrency) or open loop (x = request rate).

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
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
pub(super) fn level_x(level: &LevelSummary) -> Option<(Mode, f64)> {
    match (level.concurrency, level.rate) {
        (Some(c), _) => Some((Mode::Closed, f64::from(c))),
        (None, Some(r)) => Some((Mode::Open, r)),
        (None, None) => None,
    }
}

/// How a level is named in tables: "c=4", "2.5 req/s", or "?" when it has no load setting.
pub(super) fn level_name(level: &LevelSummary) -> String {
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
pub(super) const PALETTE: &[RGBColor] = &[
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

pub(super) struct Chart {
    stem: &'static str,
    mode: Mode,
    pub(super) title: String,
    y_desc: &'static str,
    series: Vec<Series>,
}

impl Chart {
    /// "ttft", "ttft_rate", ...
    pub(super) fn name(&self) -> String {
        format!("{}{}", self.stem, self.mode.file_suffix())
    }

    pub(super) fn file_name(&self, ext: &str) -> String {
        format!("{}.{ext}", self.name())
    }
}

/// Every chart that has at least one point, closed-loop ones first.
pub(super) fn charts(reports: &[Report]) -> Vec<Chart> {
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

/// Axis tick text for a value: integers without decimals, others with up to 3 decimals.
pub(super) fn axis_number(x: f64) -> String {
    if (x - x.round()).abs() < 1e-9 * x.abs().max(1.0) {
        format!("{}", x.round())
    } else {
        let s = format!("{x:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

pub(super) fn draw_chart<DB: DrawingBackend>(
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

/// The chart as an SVG document, for the HTML page.
pub(super) fn render_svg(chart: &Chart) -> Result<String, DrawingAreaErrorKind<std::io::Error>> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, CHART_SIZE).into_drawing_area();
        draw_chart(&root, chart)?;
    }
    Ok(svg)
}

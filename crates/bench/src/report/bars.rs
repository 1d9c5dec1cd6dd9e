//! Bar charts for results measured at one load across named configurations (the
//! matrix): a labelled bar per configuration, round ticks, the legend above the bars.

use plotters::coord::Shift;
use plotters::prelude::*;

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
pub(super) fn round_ticks(max: f64) -> (Vec<f64>, usize) {
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
pub(super) struct BarLayout {
    pub(super) size: (u32, u32),
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
    pub(super) fn new(chart: &BarChart) -> Self {
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

pub(super) fn draw_bars<DB: DrawingBackend>(
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

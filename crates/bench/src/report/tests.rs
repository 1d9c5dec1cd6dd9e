//! Tests of the report files: what is written for a pair of reports, the HTML and its
//! escaping, empty input, open-loop charts, the built-in font, bad JSON, and the axes.

use super::bars::round_ticks;
use super::lines::{PALETTE, axis_number};
use super::*;
use crate::summary::{Differential, LevelSummary, Percentiles};

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

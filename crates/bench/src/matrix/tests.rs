//! Tests of the matrix: the configurations the flags expand to, their `pdmesh up` flags,
//! the table, and the bar charts of made-up results.

use clap::Parser;

use super::table::BAR_KEYS;
use super::*;
use crate::summary::Differential;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    m: MatrixArgs,
}

fn parse(argv: &[&str]) -> MatrixArgs {
    Cli::try_parse_from([&["matrix"], argv].concat()).unwrap().m
}

#[test]
fn the_default_matrix_is_the_issues_twelve_configurations() {
    let all = cells(&parse(&[]));
    let names: Vec<String> = all.iter().map(Cell::name).collect();
    assert_eq!(
        names,
        [
            "dsa-fp8-mirror-pd",
            "dsa-fp8-mirror-unified",
            "dsa-fp8-nomirror-pd",
            "dsa-fp8-nomirror-unified",
            "dsa-bf16-mirror-pd",
            "dsa-bf16-mirror-unified",
            "dsa-bf16-nomirror-pd",
            "dsa-bf16-nomirror-unified",
            "smol-mirror-pd",
            "smol-mirror-unified",
            "smol-nomirror-pd",
            "smol-nomirror-unified",
        ]
    );
    // Filters narrow it; SmolLM2 has no index-K forms to multiply by.
    let few = cells(&parse(&[
        "--models=smol,dsa",
        "--index-k=bf16",
        "--mirror=on",
        "--mode=pd",
    ]));
    assert_eq!(
        few.iter().map(Cell::name).collect::<Vec<_>>(),
        ["smol-mirror-pd", "dsa-bf16-mirror-pd"]
    );
    assert!(Cli::try_parse_from(["matrix", "--mode=both"]).is_err());
}

#[test]
fn gemma_runs_only_with_a_chat_template_and_passes_it_to_up() {
    let a = parse(&["--models=gemma", "--mirror=on"]);
    let gemma = cells(&a);
    assert_eq!(
        gemma.iter().map(Cell::name).collect::<Vec<_>>(),
        ["gemma-mirror-pd", "gemma-mirror-unified"]
    );
    // Refused before any mesh starts, saying what to add.
    let err = check_templates(&a, &gemma).unwrap_err().to_string();
    assert!(err.contains("--chat-template FILE"), "{err}");
    let a = parse(&["--models=gemma", "--chat-template=t.jinja"]);
    check_templates(&a, &cells(&a)).unwrap();
    let args = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(model_args(&a, Path::new("pdmesh"), Family::Gemma))
        .unwrap();
    assert_eq!(
        args,
        ["--model", "gemma3", "--chat-template", "t.jinja"],
        "`pdmesh up` resolves the name, fetching the model if missing"
    );
    // The other models have their own templates.
    check_templates(&parse(&[]), &cells(&parse(&[]))).unwrap();
}

#[test]
fn each_configuration_maps_to_up_flags() {
    let cell = |index_k, mirror, mode| Cell {
        model: Family::Dsa,
        index_k,
        mirror,
        mode,
    };
    assert_eq!(
        cell(Some(IndexK::Bf16), Mirror::On, Mode::Pd).up_args(),
        ["--worker-arg=--index-k-dtype=bf16"]
    );
    // Disaggregated workers keep the cache service for hand-overs, without its tier.
    assert_eq!(
        cell(None, Mirror::Off, Mode::Pd).up_args(),
        ["--worker-arg=--no-host-tier"]
    );
    assert_eq!(
        cell(Some(IndexK::Fp8), Mirror::Off, Mode::Unified).up_args(),
        [
            "--unified",
            "--no-host-cache",
            "--worker-arg=--index-k-dtype=fp8"
        ]
    );
    // The reference: alone, without any cache, in the same index-K form.
    let r = reference_args(Some(IndexK::Bf16));
    for flag in [
        "--unified",
        "--no-host-cache",
        "--worker-arg=--disable-prefix-cache",
        "--worker-arg=--max-batch=1",
        "--worker-arg=--index-k-dtype=bf16",
    ] {
        assert!(r.iter().any(|a| a == flag), "{flag} in {r:?}");
    }
}

#[test]
fn the_table_reads_in_the_seeds_terms() {
    let row = |cell: Cell, corrupted, leaked: Option<&str>| Row {
        name: cell.name(),
        cell,
        fault: None,
        leaked: leaked.map(str::to_owned),
        prompt_sources: Default::default(),
        summary: LevelSummary {
            requests: 160,
            errors: 1,
            output_tokens_per_s: 97.3,
            cached_share: 0.5,
            differential: Some(Differential {
                compared: 159,
                corrupted,
                tool_calls_expected: 40,
                tool_calls_valid: 40,
                ..Differential::default()
            }),
            ..LevelSummary::default()
        },
    };
    let m = Matrix {
        started: "now".into(),
        workload: "sessions".into(),
        rows: vec![
            row(
                Cell {
                    model: Family::Dsa,
                    index_k: Some(IndexK::Bf16),
                    mirror: Mirror::On,
                    mode: Mode::Pd,
                },
                0,
                None,
            ),
            row(
                Cell {
                    model: Family::Smol,
                    index_k: None,
                    mirror: Mirror::Off,
                    mode: Mode::Unified,
                },
                16,
                Some("3 pages held"),
            ),
        ],
    };
    let t = table(&m);
    let lines: Vec<&str> = t.lines().filter(|l| l.starts_with("| ")).collect();
    assert_eq!(lines.len(), 3, "{t}");
    assert!(
        lines[1].starts_with(
            "| DeepSeek V3.2 tiny | bf16 | on | PD | 160 | 1 | 0/159 | 0.0% | 40/40 (100.0%) |"
        ),
        "{}",
        lines[1]
    );
    assert!(lines[1].ends_with("| 97.3 | 50.0% | yes |"), "{}", lines[1]);
    assert!(
        lines[2].contains("| SmolLM2-135M | - | off | unified |"),
        "{}",
        lines[2]
    );
    assert!(
        lines[2].contains("| 16/159 | 10.1% |") && lines[2].ends_with("| NO |"),
        "{}",
        lines[2]
    );
    // matrix.json round-trips.
    let back: Matrix = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
    assert_eq!(back, m);
}

/// The default twelve configurations with made-up, different results; the bf16
/// disaggregated ones corrupted.
fn fabricated() -> Matrix {
    let rows = cells(&parse(&[]))
        .into_iter()
        .enumerate()
        .map(|(i, cell)| {
            let i = i as f64;
            let corrupted = if cell.index_k == Some(IndexK::Bf16) && cell.mode == Mode::Pd {
                7 + i as u32
            } else {
                0
            };
            let mut summary = LevelSummary {
                concurrency: Some(80),
                requests: 160,
                output_tokens_per_s: 37.5 + 11.0 * i,
                differential: Some(Differential {
                    compared: 160,
                    corrupted,
                    ..Differential::default()
                }),
                ..LevelSummary::default()
            };
            summary.ttft.p50 = 0.073517 * (1.0 + i);
            summary.ttft.p99 = 0.84449 * (1.0 + i / 3.0);
            Row {
                name: cell.name(),
                cell,
                fault: None,
                leaked: None,
                prompt_sources: Default::default(),
                summary,
            }
        })
        .collect();
    Matrix {
        started: "2025-01-02T03:04:05Z".into(),
        workload: "sessions".into(),
        rows,
    }
}

/// `<text>` elements of an SVG: (x, y, content).
fn svg_texts(svg: &str) -> Vec<(f64, f64, String)> {
    let attr = |tag: &str, name: &str| -> f64 {
        let at = tag.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
        tag[at..at + tag[at..].find('"').unwrap()].parse().unwrap()
    };
    svg.split("<text")
        .skip(1)
        .map(|t| {
            let (tag, rest) = t.split_once('>').unwrap();
            let content = rest.split("</text>").next().unwrap().trim();
            let content = content
                .replace("&amp;", "&")
                .replace("&lt;", "<")
                .replace("&gt;", ">");
            (attr(tag, "x"), attr(tag, "y"), content)
        })
        .collect()
}

#[test]
fn every_chart_names_every_configuration_with_round_ticks_and_the_legend_apart() {
    let m = fabricated();
    let dir = tempfile::TempDir::new().unwrap();
    let written = crate::report::write_bars(dir.path(), &page(&m)).unwrap();
    let files: Vec<String> = written
        .files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        files,
        [
            "corruption.png",
            "ttft_p50.png",
            "ttft_p99.png",
            "throughput.png",
            "index.html"
        ]
    );
    for f in &written.files[..4] {
        let png = std::fs::read(f).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{}", f.display());
    }
    let labels = [
        "DeepSeek · index-K fp8 · mirror on · PD",
        "DeepSeek · index-K fp8 · mirror on · unified",
        "DeepSeek · index-K fp8 · mirror off · PD",
        "DeepSeek · index-K fp8 · mirror off · unified",
        "DeepSeek · index-K bf16 · mirror on · PD",
        "DeepSeek · index-K bf16 · mirror on · unified",
        "DeepSeek · index-K bf16 · mirror off · PD",
        "DeepSeek · index-K bf16 · mirror off · unified",
        "SmolLM2 · mirror on · PD",
        "SmolLM2 · mirror on · unified",
        "SmolLM2 · mirror off · PD",
        "SmolLM2 · mirror off · unified",
    ];
    let html = std::fs::read_to_string(dir.path().join("index.html")).unwrap();
    // The table, one row per configuration, before the charts.
    assert_eq!(html.matches("<tr><td").count(), 12, "{html}");
    assert!(html.contains(
        "<tr><td class=\"text\">DeepSeek V3.2 tiny</td><td class=\"text\">bf16</td>\
             <td class=\"text\">on</td><td class=\"text\">PD</td><td>160</td><td>0</td>\
             <td>11/160</td><td>6.9%</td>"
    ));
    let figures: Vec<&str> = html.split("<figure id=\"chart-").skip(1).collect();
    let stems: Vec<&str> = figures
        .iter()
        .map(|f| f.split('"').next().unwrap())
        .collect();
    assert_eq!(stems, ["corruption", "ttft_p50", "ttft_p99", "throughput"]);
    for (stem, fig) in stems.iter().zip(&figures) {
        let svg = &fig[fig.find("<svg").unwrap()..fig.find("</svg>").unwrap()];
        let texts = svg_texts(svg);
        let find = |s: &str| texts.iter().filter(|t| t.2 == s).collect::<Vec<_>>();
        // Every configuration named once, on its own line, in the matrix's order.
        let mut rows = Vec::new();
        for label in labels {
            let hits = find(label);
            assert_eq!(hits.len(), 1, "{stem}: {label:?} in {texts:?}");
            rows.push(hits[0].1);
        }
        assert!(
            rows.windows(2).all(|w| w[1] - w[0] >= 24.0),
            "{stem}: rows {rows:?}"
        );
        // The legend (mode and mirror) sits above the first bar, not over the data.
        for key in BAR_KEYS {
            let hits = find(key);
            assert_eq!(hits.len(), 1, "{stem}: legend {key:?}");
            assert!(
                hits[0].1 + 24.0 < rows[0],
                "{stem}: legend {key:?} at {}",
                hits[0].1
            );
        }
        // Ticks: the bare numbers, at round values from 0 (at most two significant
        // digits, evenly spaced) up past the largest value; no log-axis leftovers.
        let ticks: Vec<f64> = texts.iter().filter_map(|t| t.2.parse().ok()).collect();
        assert!(
            ticks.len() >= 3 && ticks[0] == 0.0,
            "{stem}: ticks {ticks:?}"
        );
        let step = ticks[1];
        for (i, t) in ticks.iter().enumerate() {
            assert!(
                (t - step * i as f64).abs() < 1e-9 * step.max(1.0),
                "{stem}: {ticks:?}"
            );
            let digits = format!("{:e}", t)
                .split('e')
                .next()
                .unwrap()
                .replace(['.', '-'], "");
            assert!(
                digits.len() <= 2,
                "{stem}: tick {t} is not round: {ticks:?}"
            );
        }
        let max = m
            .rows
            .iter()
            .map(|r| match *stem {
                "corruption" => r.summary.differential.as_ref().unwrap().corruption_rate() * 100.0,
                "ttft_p50" => r.summary.ttft.p50 * 1e3,
                "ttft_p99" => r.summary.ttft.p99 * 1e3,
                _ => r.summary.output_tokens_per_s,
            })
            .fold(0.0, f64::max);
        assert!(
            *ticks.last().unwrap() >= max,
            "{stem}: {ticks:?} below {max}"
        );
    }
    // Each bar carries its value: the corrupted bf16 PD rows, the slowest TTFT p50,
    // the highest throughput.
    let corruption = figures[0];
    assert!(corruption.contains("6.9% (11/160)") && corruption.contains("8.1% (13/160)"));
    assert_eq!(corruption.matches("0.0% (0/160)").count(), 10);
    assert!(figures[1].contains("882 ms") && figures[3].contains("158.5 tok/s"));
}

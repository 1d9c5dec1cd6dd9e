//! `pdmesh bench matrix`: the corruption matrix in the seed's terms. For each
//! configuration (model, index-K cache form, host mirror on or off, disaggregated or
//! unified) it starts a mesh with `pdmesh up`, drives the same agentic sessions at once,
//! stops it, and replays every answer alone on a unified worker without any cache (one
//! reference mesh per model and cache form, kept up while its configurations run). The
//! table gives each configuration's corruption rate, tool-call validity, TTFT and
//! throughput; `index.html` shows it above one bar chart per metric with a labelled bar per
//! configuration.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::cli::{self, BenchError};
use crate::client::Client;
use crate::mesh::{self, MeshFile};
use crate::run::{Level, Reference, RequestCfg};
use crate::summary::{Differential, LevelSummary, Report};
use crate::workload::{Kind, Spec};

/// `pdmesh bench matrix`.
#[derive(Debug, clap::Args)]
pub struct MatrixArgs {
    /// Models to run: `dsa` (the DeepSeek V3.2 tiny model, with its index-K cache forms)
    /// and `smol` (the default SmolLM2 GGUF).
    #[arg(long, value_delimiter = ',', default_value = "dsa,smol")]
    pub models: Vec<Family>,
    /// The DeepSeek tiny checkpoint (default: written under --out with `pdmesh model synth
    /// deepseek-v32-tiny` the first time).
    #[arg(long, value_name = "DIR")]
    pub dsa_model: Option<PathBuf>,
    /// The SmolLM2 GGUF (default: `pdmesh up`'s default model).
    #[arg(long, value_name = "FILE")]
    pub smol_model: Option<PathBuf>,
    /// Index-K cache forms to run (DeepSeek only).
    #[arg(long, value_delimiter = ',', default_value = "fp8,bf16")]
    pub index_k: Vec<IndexK>,
    /// Host mirror settings to run: `on` (the host tier of the KV cache), `off`.
    #[arg(long, value_delimiter = ',', default_value = "on,off")]
    pub mirror: Vec<Mirror>,
    /// Modes to run: `pd` (prefill and decode workers) and `unified`.
    #[arg(long, value_delimiter = ',', default_value = "pd,unified")]
    pub mode: Vec<Mode>,
    /// Agentic sessions, all in flight at once.
    #[arg(long, default_value_t = 80)]
    pub sessions: usize,
    /// Turns per session (even turns force a tool call; odd ones are free follow-ups).
    #[arg(long, default_value_t = 2)]
    pub turns: usize,
    /// About this many tokens of shared system prompt.
    #[arg(long, default_value_t = 160)]
    pub input_len: usize,
    /// Most tokens per answer (a DeepSeek tiny tool call takes about 150 tokens, a
    /// SmolLM2 one about 35).
    #[arg(long, default_value_t = 192)]
    pub output_len: u32,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Inject the seed's bug on purpose in every mesh measured (never in references):
    /// `missize-index-k-unchecked` sends bf16 index-K pages through a buffer sized for fp8
    /// with the checksums taken after the loss, as the seed's code did. The bf16
    /// disaggregated rows must then show corruption: proof the instrument sees it.
    /// (`missize-index-k` keeps the mesh's own checksums: those rows fail instead.)
    #[arg(long, value_enum)]
    pub fault: Option<Fault>,
    /// Extra flag for every worker of every mesh, references included (repeatable), e.g.
    /// `--worker-arg=--threads=1`.
    #[arg(long = "worker-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub worker_args: Vec<String>,
    /// Extra flag for the cache service of every measured mesh (repeatable), e.g.
    /// `--cache-arg=--room-wait-ms=300000`.
    #[arg(long = "cache-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub cache_args: Vec<String>,
    /// The pdmesh binary that runs the meshes (default: this one).
    #[arg(long, value_name = "FILE")]
    pub pdmesh: Option<PathBuf>,
    /// Bearer key for the meshes (they are started with it).
    #[arg(long, env = "PDMESH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Directory for matrix.json, matrix.md, each configuration's report and mesh logs.
    #[arg(long, default_value = "bench-matrix")]
    pub out: PathBuf,
    /// Per-request limit, seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
    /// How long a mesh may take to return every page and room after the load, seconds.
    #[arg(long, default_value_t = 60)]
    pub settle_s: u64,
    /// How long a mesh may take to start, seconds.
    #[arg(long, default_value_t = 300)]
    pub startup_timeout_s: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    Dsa,
    Smol,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IndexK {
    Fp8,
    Bf16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mirror {
    On,
    Off,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    Pd,
    Unified,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    MissizeIndexK,
    MissizeIndexKUnchecked,
}

impl Fault {
    /// The worker flag that turns the fault on (the worker's test-only `--fault-*`).
    fn worker_flag(self) -> &'static str {
        match self {
            Self::MissizeIndexK => "--fault-missize-index-k",
            Self::MissizeIndexKUnchecked => "--fault-missize-index-k-unchecked",
        }
    }
}

/// One configuration of the matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cell {
    pub model: Family,
    /// The index-K cache form (DeepSeek only).
    pub index_k: Option<IndexK>,
    pub mirror: Mirror,
    pub mode: Mode,
}

impl Cell {
    /// A short name, for labels, directories and the table.
    pub fn name(&self) -> String {
        let mut parts = vec![match self.model {
            Family::Dsa => "dsa",
            Family::Smol => "smol",
        }];
        if let Some(ik) = self.index_k {
            parts.push(match ik {
                IndexK::Fp8 => "fp8",
                IndexK::Bf16 => "bf16",
            });
        }
        parts.push(match self.mirror {
            Mirror::On => "mirror",
            Mirror::Off => "nomirror",
        });
        parts.push(match self.mode {
            Mode::Pd => "pd",
            Mode::Unified => "unified",
        });
        parts.join("-")
    }

    /// `pdmesh up` flags (after the model) for this configuration.
    fn up_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if self.mode == Mode::Unified {
            a.push("--unified".to_owned());
        }
        match (self.mirror, self.mode) {
            (Mirror::On, _) => {}
            // Disaggregated workers still meet at the cache service for hand-overs.
            (Mirror::Off, Mode::Pd) => a.push("--worker-arg=--no-host-tier".to_owned()),
            (Mirror::Off, Mode::Unified) => a.push("--no-host-cache".to_owned()),
        }
        a.extend(index_k_arg(self.index_k));
        a
    }
}

fn index_k_arg(ik: Option<IndexK>) -> Option<String> {
    ik.map(|ik| {
        format!(
            "--worker-arg=--index-k-dtype={}",
            match ik {
                IndexK::Fp8 => "fp8",
                IndexK::Bf16 => "bf16",
            }
        )
    })
}

/// `pdmesh up` flags for the reference of a model and cache form: one unified worker, no
/// prefix cache, no host tier, one sequence at a time.
fn reference_args(ik: Option<IndexK>) -> Vec<String> {
    let mut a: Vec<String> = [
        "--unified",
        "--no-host-cache",
        "--worker-arg=--disable-prefix-cache",
        "--worker-arg=--max-batch=1",
    ]
    .map(str::to_owned)
    .to_vec();
    a.extend(index_k_arg(ik));
    a
}

/// The configurations `args` asks for, grouped by reference (model and index-K form), in
/// the issue's order: DeepSeek fp8 then bf16, then SmolLM2.
pub fn cells(args: &MatrixArgs) -> Vec<Cell> {
    let mut out = Vec::new();
    for &model in &args.models {
        let forms: Vec<Option<IndexK>> = match model {
            Family::Dsa => args.index_k.iter().copied().map(Some).collect(),
            Family::Smol => vec![None],
        };
        for index_k in forms {
            for &mirror in &args.mirror {
                for &mode in &args.mode {
                    let cell = Cell {
                        model,
                        index_k,
                        mirror,
                        mode,
                    };
                    if !out.contains(&cell) {
                        out.push(cell);
                    }
                }
            }
        }
    }
    out
}

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

/// Why the matrix could not run.
#[derive(Debug, thiserror::Error)]
pub enum MatrixError {
    #[error("nothing to run: the filters leave no configuration")]
    Empty,
    #[error("meshes did not return every page after the load: {0}")]
    Leaked(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`pdmesh {args}` failed: {why}\n{log}")]
    Mesh {
        args: String,
        why: String,
        log: String,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> MatrixError {
    let what = what.into();
    move |source| MatrixError::Io { what, source }
}

/// A mesh `pdmesh up` runs for the matrix: stopped (SIGTERM, then SIGKILL after a grace)
/// by [`Up::stop`], or on drop.
struct Up {
    child: tokio::process::Child,
    file: Option<MeshFile>,
}

impl Up {
    async fn start(
        exe: &Path,
        args: &[String],
        api_key: Option<&str>,
        dir: &Path,
        timeout: Duration,
    ) -> Result<Self, MatrixError> {
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        let ports = dir.join("ports.json");
        let _ = std::fs::remove_file(&ports);
        let log_path = dir.join("mesh.log");
        let log = std::fs::File::create(&log_path)
            .map_err(io(format!("creating {}", log_path.display())))?;
        let err_log = log
            .try_clone()
            .map_err(io(format!("opening {}", log_path.display())))?;
        let mut argv: Vec<String> = vec![
            "up".into(),
            "--port".into(),
            "0".into(),
            "--no-smoke-test".into(),
            "--ports-json".into(),
            ports.display().to_string(),
        ];
        argv.extend(args.iter().cloned());
        let shown = argv.join(" ");
        let mut cmd = tokio::process::Command::new(exe);
        cmd.args(&argv)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err_log)
            .kill_on_drop(true);
        if let Some(key) = api_key {
            cmd.env("PDMESH_API_KEY", key);
        }
        let fail = |why: String| MatrixError::Mesh {
            args: shown.clone(),
            why,
            log: tail(&log_path),
        };
        let mut child = cmd.spawn().map_err(|e| fail(e.to_string()))?;
        let t0 = Instant::now();
        loop {
            if let Ok(file) = MeshFile::read(&ports) {
                return Ok(Self {
                    child,
                    file: Some(file),
                });
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(fail(format!("it exited with {status}")));
            }
            if t0.elapsed() > timeout {
                let mut up = Self { child, file: None };
                up.stop().await;
                return Err(fail(format!("not up after {} s", timeout.as_secs())));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn file(&self) -> &MeshFile {
        self.file
            .as_ref()
            .expect("a started mesh has its ports file")
    }

    /// SIGTERM (`up` stops its services), then SIGKILL after 30 s.
    async fn stop(&mut self) {
        if let Some(pid) = self
            .child
            .id()
            .and_then(|p| rustix::process::Pid::from_raw(p as i32))
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            if tokio::time::timeout(Duration::from_secs(30), self.child.wait())
                .await
                .is_ok()
            {
                return;
            }
        }
        let _ = self.child.kill().await;
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        // An early return (an error, Ctrl-C) still lets `up` stop its services in order.
        if let Some(pid) = self
            .child
            .id()
            .and_then(|p| rustix::process::Pid::from_raw(p as i32))
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
    }
}

/// The last lines of a log, for an error message.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Runs the matrix; any corrupted answer fails it (after the table is written).
pub async fn run(a: MatrixArgs) -> Result<(), BenchError> {
    let cells = cells(&a);
    if cells.is_empty() {
        return Err(MatrixError::Empty.into());
    }
    let exe = match &a.pdmesh {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(io("finding the pdmesh binary"))?,
    };
    std::fs::create_dir_all(&a.out).map_err(io(format!("creating {}", a.out.display())))?;
    let spec = Spec {
        kind: Kind::Sessions,
        sessions: a.sessions.max(1),
        turns: a.turns.max(1),
        input_len: a.input_len,
        output_len: a.output_len,
        seed: a.seed,
    };
    let startup = Duration::from_secs(a.startup_timeout_s.max(1));
    let timeout = Duration::from_secs(a.timeout_s.max(1));
    let mut matrix = Matrix {
        started: cli::now_rfc3339(),
        workload: spec.describe(),
        rows: Vec::new(),
    };
    let mut diffs = Vec::new();
    let http = reqwest::Client::new();
    let mut i = 0;
    while i < cells.len() {
        // Cells sharing a model and index-K form share one reference mesh.
        let group: Vec<Cell> = cells[i..]
            .iter()
            .take_while(|c| (c.model, c.index_k) == (cells[i].model, cells[i].index_k))
            .copied()
            .collect();
        i += group.len();
        let model_args = model_args(&a, &exe, group[0].model).await?;
        let mut ref_args = model_args.clone();
        ref_args.extend(reference_args(group[0].index_k));
        ref_args.extend(worker_args(&a.worker_args));
        let ref_name = format!("{}-reference", group[0].name());
        eprintln!("starting the reference for {}", group[0].name());
        let key = a.api_key.as_deref();
        let mut ref_up = Up::start(&exe, &ref_args, key, &a.out.join(&ref_name), startup).await?;
        let reference = Reference::new(Client::new(&ref_up.file().url, a.api_key.clone(), timeout));
        for cell in group {
            let name = cell.name();
            let mut args = model_args.clone();
            args.extend(cell.up_args());
            args.extend(worker_args(&a.worker_args));
            if let Some(fault) = a.fault {
                args.extend(worker_args(&[fault.worker_flag().to_owned()]));
            }
            if !(cell.mirror == Mirror::Off && cell.mode == Mode::Unified) {
                args.extend(a.cache_args.iter().map(|c| format!("--cache-arg={c}")));
            }
            let dir = a.out.join(&name);
            eprintln!("{name}: starting `pdmesh up {}`", args.join(" "));
            let mut up = Up::start(&exe, &args, key, &dir, startup).await?;
            let mesh = up.file().clone();
            let client = Client::new(&mesh.url, a.api_key.clone(), timeout);
            let cfg = RequestCfg {
                model: mesh.model.clone(),
                max_tokens: a.output_len,
            };
            let level = Level::Concurrency(spec.sessions as u32);
            // The same salt for every cell: every configuration is asked the same first
            // turns, and while answers agree, the same whole sessions.
            let (ex, mut summary) = cli::load(&client, &cfg, &spec, 1, level, &name).await;
            // Every page and room back where it was: nothing leaked under the load.
            let (baseline, _) =
                mesh::wait_baseline(&http, &mesh.gateway_url(), Duration::from_secs(a.settle_s))
                    .await;
            // Where the prompt tokens came from (computed, device, host, transferred): what
            // the configuration really exercised.
            let prompt_sources = mesh::scrape(&http, &format!("{}/metrics", mesh.gateway_url()))
                .await
                .map(|m| {
                    m.into_iter()
                        .filter_map(|(k, v)| {
                            let source = k
                                .strip_prefix("mesh_prompt_token_sources_total{source=\"")?
                                .strip_suffix("\"}")?;
                            Some((source.to_owned(), v))
                        })
                        .collect()
                })
                .unwrap_or_default();
            up.stop().await;
            // Replayed once the measured mesh is down, so the reference has the CPU; a
            // request an earlier configuration sent is not replayed again.
            diffs.extend(cli::check(&reference, &ex, &mut summary).await);
            let report = Report {
                label: name.clone(),
                url: mesh.url.clone(),
                model: mesh.model.clone(),
                workload: spec.describe(),
                started: cli::now_rfc3339(),
                levels: vec![summary.clone()],
            };
            crate::report::write(&dir, std::slice::from_ref(&report))?;
            let row = Row {
                cell,
                name,
                fault: a.fault,
                leaked: (!baseline.ok()).then(|| baseline.describe()),
                prompt_sources,
                summary,
            };
            println!("{}", row_line(&row));
            matrix.rows.push(row);
        }
        eprintln!(
            "the reference answered {} distinct requests",
            reference.known()
        );
        ref_up.stop().await;
    }
    // The table and a bar per configuration in each chart, side by side.
    cli::print_written(&crate::report::write_bars(&a.out, &page(&matrix))?);
    let md = table(&matrix);
    println!("\n{md}");
    write(&a.out.join("matrix.md"), md.as_bytes())?;
    let json = serde_json::to_vec_pretty(&matrix).expect("the matrix serializes");
    write(&a.out.join("matrix.json"), &json)?;
    println!("wrote {}", a.out.join("matrix.json").display());
    println!("wrote {}", a.out.join("matrix.md").display());
    for d in diffs.iter().take(20) {
        eprintln!("{d}");
    }
    let leaks: Vec<String> = matrix
        .rows
        .iter()
        .filter_map(|r| Some(format!("{}: {}", r.name, r.leaked.as_ref()?)))
        .collect();
    let levels: Vec<LevelSummary> = matrix.rows.into_iter().map(|r| r.summary).collect();
    cli::judge(&levels, &a.out)?;
    if !leaks.is_empty() {
        return Err(MatrixError::Leaked(leaks.join("; ")).into());
    }
    Ok(())
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), MatrixError> {
    std::fs::write(path, bytes).map_err(io(format!("writing {}", path.display())))
}

/// Extra worker flags, as `pdmesh up` takes them.
fn worker_args(args: &[String]) -> Vec<String> {
    args.iter().map(|a| format!("--worker-arg={a}")).collect()
}

/// `--model` for a family, writing the DeepSeek tiny checkpoint first if it is missing.
async fn model_args(
    a: &MatrixArgs,
    exe: &Path,
    family: Family,
) -> Result<Vec<String>, MatrixError> {
    let path = match family {
        Family::Smol => match &a.smol_model {
            Some(p) => p.clone(),
            None => return Ok(Vec::new()),
        },
        Family::Dsa => {
            let dir = a
                .dsa_model
                .clone()
                .unwrap_or_else(|| a.out.join("deepseek-v32-tiny"));
            if !dir.join("config.json").exists() {
                let argv = ["model", "synth", "deepseek-v32-tiny", "--out"];
                let out = tokio::process::Command::new(exe)
                    .args(argv)
                    .arg(&dir)
                    .output()
                    .await
                    .map_err(io(format!("running {} model synth", exe.display())))?;
                if !out.status.success() {
                    return Err(MatrixError::Mesh {
                        args: format!("{} {}", argv.join(" "), dir.display()),
                        why: format!("it exited with {}", out.status),
                        log: String::from_utf8_lossy(&out.stderr).into_owned(),
                    });
                }
            }
            dir
        }
    };
    Ok(vec!["--model".into(), path.display().to_string()])
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// One line per configuration while the matrix runs.
fn row_line(r: &Row) -> String {
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
const BAR_KEYS: [&str; 4] = [
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
pub fn page(m: &Matrix) -> crate::report::BarPage {
    use crate::report::{Bar, BarChart};
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
    crate::report::BarPage {
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

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
                    "corruption" => {
                        r.summary.differential.as_ref().unwrap().corruption_rate() * 100.0
                    }
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
}

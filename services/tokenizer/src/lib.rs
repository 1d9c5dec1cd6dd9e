//! Tokenizer service: tokenize, chat template, streaming detokenize over gRPC.
//!
//! A library with one entry point, [`run`], so the `pdmesh` binary and the integration
//! tests start the same server; the gRPC ingress (`grpc`) is the only module that sees
//! prost types.

#![forbid(unsafe_code)]

mod error;
mod grpc;

use std::path::{Path, PathBuf};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use error::Error;

/// Configuration of the tokenizer service.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct Config {
    /// GGUF model file whose metadata carries the tokenizer and chat template.
    #[arg(long = "model", env = "PDMESH_MODEL", default_value_os_t = pdmesh_gguf::models::default_model_path())]
    pub model: PathBuf,
    /// A Jinja chat template file to render chat requests with, in place of the model's
    /// own, or where the model has none (a base model's GGUF, such as Gemma 3 270M's). It
    /// sees the model's BOS and EOS texts as `bos_token` and `eos_token`, as the model's
    /// own template would, so begin it with `{{ bos_token }}` where the model wants BOS.
    #[arg(long, env = "PDMESH_CHAT_TEMPLATE", value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// The mesh credential callers must present (mutual TLS or the mesh token).
    #[command(flatten)]
    pub tls: pdmesh_tls::TlsArgs,
}

impl Config {
    /// A configuration serving the tokenizer of the model at `model`.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        Self {
            model: model.into(),
            chat_template: None,
            tls: pdmesh_tls::TlsArgs::default(),
        }
    }
}

/// The Jinja source of the `--chat-template` file at `path`, once it is seen to compile:
/// `pdmesh up` checks the file with this before it starts any service, and the service
/// before it loads the model, so a file that cannot serve refuses the start, naming the
/// flag and the file.
pub fn read_chat_template(path: &Path) -> Result<String, Error> {
    let refuse = |problem: String| Error::ChatTemplate {
        path: path.to_owned(),
        problem,
    };
    let source = std::fs::read_to_string(path).map_err(|e| {
        refuse(format!(
            "cannot read it ({e}): give a readable Jinja file, or drop the flag to serve the model's own template"
        ))
    })?;
    // Compiling needs no tokenizer: BOS and EOS texts only matter when rendering.
    pdmesh_chat::ChatTemplate::new(&source, "", "").map_err(|e| uncompiled(path, &e))?;
    Ok(source)
}

/// The `--chat-template` file at `path` does not compile.
fn uncompiled(path: &Path, e: &pdmesh_chat::ChatError) -> Error {
    Error::ChatTemplate {
        path: path.to_owned(),
        problem: format!(
            "it does not compile ({e}): fix the Jinja, or drop the flag to serve the model's own template"
        ),
    }
}

/// The name the model is served under, as the worker names it: the file name up to its
/// first dot (a checkpoint directory's name).
fn model_name(path: &Path) -> String {
    path.file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.split('.').next())
        .filter(|n| !n.is_empty())
        .unwrap_or("model")
        .to_owned()
}

/// Loads the tokenizer named by `cfg`, then serves `pdmesh.tokenizer.v1.Tokenizer` on
/// `listener` until `shutdown` is cancelled. Returns once the server has stopped.
pub async fn run(
    cfg: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    // Read before the model loads: a file that cannot serve refuses the start at once.
    let template = match &cfg.chat_template {
        Some(path) => Some((path, read_chat_template(path)?)),
        None => None,
    };
    let path = cfg.model.clone();
    let tokenizer =
        tokio::task::spawn_blocking(move || pdmesh_chat::ChatTokenizer::from_path(&path))
            .await
            .map_err(|e| Error::Startup(format!("tokenizer loader panicked: {e}")))?
            .map_err(|source| Error::Load {
                path: cfg.model.clone(),
                source,
            })?;
    let tokenizer = match &template {
        Some((path, source)) => tokenizer
            .with_chat_template(source)
            .map_err(|e| uncompiled(path, &e))?,
        None => tokenizer,
    };
    let addr = listener.local_addr().ok();
    tracing::info!(?addr, model = %cfg.model.display(), chat_template = ?cfg.chat_template, vocab = tokenizer.tokenizer().vocab_size(), "tokenizer service listening");

    let service = grpc::TokenizerService::new(tokenizer, model_name(&cfg.model));
    let auth = cfg.tls.auth()?;
    if let Some(a) = addr {
        auth.check_listen("the tokenizer service", a)?;
    }
    let router = auth.traced_server()?.add_service(auth.guard(
        &grpc::POLICY,
        pdmesh_proto::tokenizer::v1::tokenizer_server::TokenizerServer::new(service),
    ));
    pdmesh_tls::serve(router, listener, shutdown.cancelled_owned()).await?;
    tracing::info!(?addr, "tokenizer service stopped");
    Ok(())
}

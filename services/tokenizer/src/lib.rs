//! Tokenizer service: tokenize, chat template, streaming detokenize over gRPC.
//!
//! A library with one entry point, [`run`], so the `pdmesh` binary and the integration
//! tests start the same server; the gRPC ingress (`grpc`) is the only module that sees
//! prost types.

#![forbid(unsafe_code)]

mod error;
mod grpc;

use std::path::PathBuf;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use error::Error;

/// Configuration of the tokenizer service.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct Config {
    /// GGUF model file whose metadata carries the tokenizer and chat template.
    #[arg(long = "model", env = "PDMESH_MODEL", default_value_os_t = pdmesh_gguf::models::default_model_path())]
    pub model: PathBuf,
    /// The mesh credential callers must present (mutual TLS or the mesh token).
    #[command(flatten)]
    pub tls: pdmesh_tls::TlsArgs,
}

impl Config {
    /// A configuration serving the tokenizer of the model at `model`.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        Self {
            model: model.into(),
            tls: pdmesh_tls::TlsArgs::default(),
        }
    }
}

/// Loads the tokenizer named by `cfg`, then serves `pdmesh.tokenizer.v1.Tokenizer` on
/// `listener` until `shutdown` is cancelled. Returns once the server has stopped.
pub async fn run(
    cfg: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let path = cfg.model.clone();
    let tokenizer =
        tokio::task::spawn_blocking(move || pdmesh_chat::ChatTokenizer::from_path(&path))
            .await
            .map_err(|e| Error::Startup(format!("tokenizer loader panicked: {e}")))?
            .map_err(|source| Error::Load {
                path: cfg.model.clone(),
                source,
            })?;
    let addr = listener.local_addr().ok();
    tracing::info!(?addr, model = %cfg.model.display(), vocab = tokenizer.tokenizer().vocab_size(), "tokenizer service listening");

    let service = grpc::TokenizerService::new(tokenizer);
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

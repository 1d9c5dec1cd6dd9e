//! `sglang.grpc.scheduler.SglangScheduler`, served beside `pdmesh.worker.v1` on the same
//! port, so gateways built for SGLang and vLLM workers (smg) drive pdmesh workers in
//! token ids. Every call is translated to the pdmesh service's own: the same admission,
//! watchdog, rooms and engine. Like `grpc.rs`, this is an ingress module: prost types stop
//! here.
//!
//! proto3 zero values are read as SGLang reads them where a zero is meaningful
//! (temperature 0 is greedy) and as "unset" where it is not (top_p 0, top_k 0,
//! repetition_penalty 0); features pdmesh does not have (n > 1, chosen ids' logprobs,
//! hidden states, embeddings, EBNF grammars, multimodal input) are INVALID_ARGUMENT
//! naming the field, never silently dropped.
//!
//! `request` reads SGLang's requests into pdmesh's (with `grammar` for their
//! constraints), `response` writes pdmesh's answers in SGLang's form, and `service`
//! serves each RPC through the pdmesh service.

mod grammar;
mod request;
mod response;
mod service;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use pdmesh_proto::worker::v1 as pb;
use pdmesh_proto::worker::v1::worker_server::Worker;
use tonic::{Request, Status};

use crate::bundle::{self, TokenizerBundle};
use crate::error::Error;
use crate::grpc::WorkerService;
use crate::pd::Role;

#[cfg(test)]
mod tests;

/// The SGLang face of one worker.
pub(crate) struct SglangService {
    worker: Arc<WorkerService>,
    model: PathBuf,
    bundle_dir: PathBuf,
    bundle: tokio::sync::OnceCell<TokenizerBundle>,
    role: Role,
    started: SystemTime,
    /// Requests with `n` > 1 running now: their choices run as `{id}-{i}`, so Abort of
    /// `id` aborts each.
    groups: Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>,
}

/// Forgets a running `n` > 1 request when its stream ends.
struct GroupEntry {
    groups: Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>,
    id: String,
}

impl Drop for GroupEntry {
    fn drop(&mut self) {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}

impl SglangService {
    pub(crate) fn new(worker: Arc<WorkerService>, model: PathBuf, role: Role) -> Self {
        Self {
            bundle_dir: bundle::default_dir(&model),
            worker,
            model,
            bundle: tokio::sync::OnceCell::new(),
            role,
            started: SystemTime::now(),
            groups: Default::default(),
        }
    }

    async fn info(&self) -> Result<pb::ModelInfoResponse, Status> {
        Ok(self
            .worker
            .model_info(Request::new(pb::ModelInfoRequest {}))
            .await?
            .into_inner())
    }

    /// The tokenizer directory and zip, written on first need (off the async threads).
    async fn bundle(&self) -> Result<&TokenizerBundle, Status> {
        self.bundle
            .get_or_try_init(|| async {
                // The engine's own facts, as the worker's ModelInfo is made from them.
                let (facts, _) = self.worker.engine.info().await.map_err(Error::from)?;
                let (model, dir) = (self.model.clone(), self.bundle_dir.clone());
                let built =
                    tokio::task::spawn_blocking(move || bundle::build(&model, &dir, &facts))
                        .await
                        .map_err(|error| Error::Task {
                            what: "writing the tokenizer bundle",
                            error,
                        })?;
                Ok(built?)
            })
            .await
    }

    fn disaggregation_mode(&self) -> &'static str {
        match self.role {
            Role::Unified => "null",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// A request field the facade cannot take: INVALID_ARGUMENT naming it.
#[derive(Debug, thiserror::Error)]
#[error("{field}: {msg}")]
pub(super) struct Invalid {
    field: &'static str,
    msg: String,
}

impl From<Invalid> for Status {
    fn from(e: Invalid) -> Self {
        Status::invalid_argument(e.to_string())
    }
}

/// The refusal of a request's `field`, naming it.
fn invalid(field: &'static str, msg: impl std::fmt::Display) -> Invalid {
    Invalid {
        field,
        msg: msg.to_string(),
    }
}

/// Who may call each SGLang scheduler RPC over mutual TLS: a gateway (smg, or anything
/// holding a gateway's certificate); any member may ask the health check.
pub static POLICY: pdmesh_tls::Policy = {
    use pdmesh_tls::Roles;
    const G: Roles = Roles::GATEWAY;
    pdmesh_tls::Policy {
        service: "sglang.grpc.scheduler.SglangScheduler",
        methods: &[
            ("Generate", G),
            ("Embed", G),
            ("HealthCheck", Roles::ANY),
            ("Abort", G),
            ("GetModelInfo", G),
            ("GetServerInfo", G),
            ("GetLoads", G),
            ("FlushCache", G),
            ("GetTokenizer", G),
            ("SubscribeKvEvents", G),
        ],
    }
};

#[cfg(test)]
#[test]
fn every_scheduler_rpc_has_the_roles_that_may_call_it() {
    let proto = include_str!("../../../../proto/sglang/grpc/scheduler/scheduler.proto");
    assert_eq!(POLICY.unlisted(proto), Vec::<&str>::new());
}

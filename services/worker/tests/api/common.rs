//! The worker test harness: the real worker (real model, real engine on its actor
//! thread) started on 127.0.0.1:0 with a small KV pool, and helpers over its
//! `pdmesh.worker.v1` client.

#![allow(dead_code)]

pub use std::time::Duration;

pub use pdmesh_proto::worker::v1 as pb;
pub use pdmesh_proto::worker::v1::generate_response::Kind;
pub use pdmesh_proto::worker::v1::worker_client::WorkerClient;
pub use pdmesh_testkit::service::{HANG, Service, answer, credentials};
pub use pdmesh_tls::AuthChannel as Channel;
pub use pdmesh_worker::{Config, Error, run};
pub use tokio::net::TcpListener;
pub use tokio_util::sync::CancellationToken;
pub use tonic::{Code, Streaming};
pub const KV_PAGES: u32 = 256;
pub const MAX_CONTEXT: usize = 512;

/// "<|im_start|>user\nWrite a long story about a dragon.<|im_end|>\n<|im_start|>assistant\n"
/// in the default model's vocabulary (as llama.cpp tokenizes it).
pub const PROMPT: &[u32] = &[
    1, 4093, 198, 19161, 253, 986, 1977, 563, 253, 17422, 30, 2, 198, 1, 520, 9531, 198,
];

pub struct Server {
    pub svc: Service<Error>,
    pub client: WorkerClient<Channel>,
}

impl Server {
    /// Starts generating `req`: its stream.
    pub async fn generate(&mut self, req: pb::GenerateRequest) -> Streaming<pb::GenerateResponse> {
        answer(self.client.generate(req)).await
    }

    /// Generates `req` to its end: its tokens and Finished (see [`collect`]).
    pub async fn complete(&mut self, req: pb::GenerateRequest) -> (Vec<u32>, pb::Finished) {
        collect(self.generate(req).await).await
    }

    pub async fn healthy(&mut self) -> bool {
        answer(self.client.health(pb::HealthRequest {})).await.ok
    }

    pub async fn info(&mut self) -> pb::ModelInfoResponse {
        answer(self.client.model_info(pb::ModelInfoRequest {})).await
    }

    /// Whether `request_id` was running when asked to abort.
    pub async fn abort(&mut self, request_id: &str) -> bool {
        let req = pb::AbortRequest {
            request_id: request_id.into(),
        };
        answer(self.client.abort(req)).await.found
    }

    pub async fn kv_events(&mut self) -> Streaming<pdmesh_proto::cache::v1::KvEvent> {
        let req = pb::SubscribeKvEventsRequest {};
        answer(self.client.subscribe_kv_events(req)).await
    }

    /// How many cached pages a flush freed.
    pub async fn flush(&mut self) -> u64 {
        let req = pb::FlushCacheRequest {};
        answer(self.client.flush_cache(req)).await.pages_flushed
    }

    /// Pages a new request could get: free plus those only the prefix cache holds. With no
    /// request running, anything short of the baseline is a leak.
    pub async fn free_pages(&mut self) -> u32 {
        let info = self.info().await;
        info.free_pages + info.cached_pages
    }

    /// Polls ModelInfo until free plus cached pages are `want`, failing after [`HANG`].
    pub async fn wait_free_pages(&mut self, want: u32) {
        let deadline = tokio::time::Instant::now() + HANG;
        loop {
            let free = self.free_pages().await;
            if free == want {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "free_pages stuck at {free}, want {want}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

pub async fn start() -> Server {
    start_with(|_| {}).await
}

/// [`start`] with `f` applied to the configuration.
pub async fn start_with(f: impl FnOnce(&mut Config)) -> Server {
    start_with_health(f, None).await
}

/// A worker with `health` as its plaintext health port.
pub async fn start_with_health(f: impl FnOnce(&mut Config), health: Option<TcpListener>) -> Server {
    let mut cfg = Config {
        kv_pages: KV_PAGES as usize,
        max_context: Some(MAX_CONTEXT),
        max_batch: 8,
        threads: 2,
        tls: credentials(),
        ..Config::new(pdmesh_gguf::models::require_default_model())
    };
    f(&mut cfg);
    let svc = Service::start(|grpc, shutdown| {
        run(cfg, pdmesh_worker::Listeners { grpc, health }, shutdown)
    })
    .await;
    // The listener is already bound: the connection waits in its backlog while the model
    // loads.
    let client = svc.client(WorkerClient::new).await;
    Server { svc, client }
}

pub fn greedy(max_tokens: u32) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: Some(0.0),
        max_tokens,
        ignore_eos: true,
        logprobs: true,
        ..Default::default()
    }
}

pub fn request(id: &str, input_ids: &[u32], sampling: pb::SamplingParams) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: id.into(),
        input_ids: input_ids.to_vec(),
        sampling: Some(sampling),
        ..Default::default()
    }
}

/// Reads a Generate stream to its end: the tokens (one per chunk, checked) and Finished.
pub async fn collect(mut stream: Streaming<pb::GenerateResponse>) -> (Vec<u32>, pb::Finished) {
    let mut tokens = Vec::new();
    let mut finished = None;
    while let Some(msg) = tokio::time::timeout(HANG, stream.message())
        .await
        .expect("stream hung")
        .unwrap()
    {
        assert!(finished.is_none(), "message after Finished: {msg:?}");
        match msg.kind.expect("response without kind") {
            Kind::Chunk(c) => {
                assert_eq!(c.token_ids.len(), 1, "one token per chunk: {c:?}");
                if let Some(lp) = c.logprob {
                    assert!(lp <= 0.0 && lp.is_finite(), "{c:?}");
                }
                tokens.extend(c.token_ids);
            }
            Kind::Finished(f) => finished = Some(f),
        }
    }
    (tokens, finished.expect("stream ended without Finished"))
}

/// Reads one message and expects a token.
pub async fn next_token(stream: &mut Streaming<pb::GenerateResponse>) -> u32 {
    let msg = tokio::time::timeout(HANG, stream.message())
        .await
        .expect("stream hung")
        .unwrap()
        .expect("stream ended");
    match msg.kind {
        Some(Kind::Chunk(c)) => c.token_ids[0],
        other => panic!("expected a token, got {other:?}"),
    }
}

//! Tests of the gateway against fake tokenizer and worker services, where only a fake can
//! tell what happened: a generation's data loss and its abort on drop (the real worker also
//! aborts when its stream is dropped, so only a fake can tell the explicit Abort apart),
//! readiness, the model's facts and the drain.

use std::time::Duration;

use pdmesh_proto::tokenizer::v1 as tk;
use pdmesh_proto::worker::v1 as wk;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

use futures::StreamExt;

use super::*;
use crate::clients::{Backends, GenParams};
use crate::generate::{GenEvent, GenStream, start};
use crate::state::AppState;

/// Streams token 7 forever (or once, then fails with DATA_LOSS as a disaggregated
/// request whose decode side got other KV does); reports Abort calls and when the
/// Generate stream closes.
struct FakeWorker {
    aborts: mpsc::UnboundedSender<String>,
    closed: mpsc::UnboundedSender<()>,
    /// The DATA_LOSS message to fail with after the first token.
    data_loss: Option<String>,
}

#[tonic::async_trait]
impl wk::worker_server::Worker for FakeWorker {
    type GenerateStream = ReceiverStream<Result<wk::GenerateResponse, Status>>;
    async fn generate(
        &self,
        _r: Request<wk::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let (tx, rx) = mpsc::channel(1);
        let closed = self.closed.clone();
        let data_loss = self.data_loss.clone();
        tokio::spawn(async move {
            let chunk = || wk::GenerateResponse {
                kind: Some(wk::generate_response::Kind::Chunk(wk::TokenChunk {
                    token_ids: vec![7],
                    ..Default::default()
                })),
            };
            if let Some(m) = data_loss {
                let _ = tx.send(Ok(chunk())).await;
                let _ = tx.send(Err(Status::data_loss(m))).await;
                return;
            }
            while tx.send(Ok(chunk())).await.is_ok() {}
            let _ = closed.send(());
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
    async fn abort(
        &self,
        r: Request<wk::AbortRequest>,
    ) -> Result<Response<wk::AbortResponse>, Status> {
        let _ = self.aborts.send(r.into_inner().request_id);
        Ok(Response::new(wk::AbortResponse { found: true }))
    }
    async fn health(
        &self,
        _r: Request<wk::HealthRequest>,
    ) -> Result<Response<wk::HealthResponse>, Status> {
        Ok(Response::new(wk::HealthResponse {
            ok: true,
            ..Default::default()
        }))
    }
    async fn model_info(
        &self,
        _r: Request<wk::ModelInfoRequest>,
    ) -> Result<Response<wk::ModelInfoResponse>, Status> {
        Ok(Response::new(wk::ModelInfoResponse {
            model_id: "fake-model".into(),
            context_length: 4096,
            vocab_size: 100,
            ..Default::default()
        }))
    }
    async fn flush_cache(
        &self,
        _r: Request<wk::FlushCacheRequest>,
    ) -> Result<Response<wk::FlushCacheResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    type SubscribeKvEventsStream = ReceiverStream<Result<pdmesh_proto::cache::v1::KvEvent, Status>>;
    async fn subscribe_kv_events(
        &self,
        _r: Request<wk::SubscribeKvEventsRequest>,
    ) -> Result<Response<Self::SubscribeKvEventsStream>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

/// Answers every Detokenize message with "x".
struct FakeTokenizer;

#[tonic::async_trait]
impl tk::tokenizer_server::Tokenizer for FakeTokenizer {
    async fn tokenize(
        &self,
        _r: Request<tk::TokenizeRequest>,
    ) -> Result<Response<tk::TokenizeResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn apply_chat_template(
        &self,
        _r: Request<tk::ChatTemplateRequest>,
    ) -> Result<Response<tk::ChatTemplateResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    type DetokenizeStream = ReceiverStream<Result<tk::DetokenizeResponse, Status>>;
    async fn detokenize(
        &self,
        r: Request<Streaming<tk::DetokenizeRequest>>,
    ) -> Result<Response<Self::DetokenizeStream>, Status> {
        let mut inbound = r.into_inner();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            while let Ok(Some(_)) = inbound.message().await {
                if tx
                    .send(Ok(tk::DetokenizeResponse {
                        text: "x".into(),
                        ..Default::default()
                    }))
                    .await
                    .is_err()
                {
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
    async fn health(
        &self,
        _r: Request<tk::HealthRequest>,
    ) -> Result<Response<tk::HealthResponse>, Status> {
        Ok(Response::new(tk::HealthResponse { ok: true }))
    }
    async fn info(
        &self,
        _r: Request<tk::InfoRequest>,
    ) -> Result<Response<tk::InfoResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

async fn listener() -> (TcpListenerStream, String) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    (TcpListenerStream::new(l), url)
}

/// Fake backends: the worker (see [`FakeWorker`]) and the tokenizer; the gateway's
/// state for them, writing incident reports into `incidents` when given.
/// A gateway before a fake worker that, with `data_loss`, fails with it after its
/// first token (and streams forever without), its reports in `incidents`.
async fn gateway(data_loss: Option<String>, incidents: Option<&std::path::Path>) -> AppState {
    let (aborts, _) = mpsc::unbounded_channel();
    let (closed, _) = mpsc::unbounded_channel();
    let worker = FakeWorker {
        aborts,
        closed,
        data_loss,
    };
    fakes(worker, incidents).await
}

/// Request `id`'s stream (prompt 1, 2, 3) through `st`.
async fn open(st: &AppState, id: &str) -> GenStream {
    start(
        st,
        id.into(),
        vec![1, 2, 3],
        GenParams::default(),
        None,
        std::time::Instant::now(),
    )
    .await
    .unwrap()
}

async fn fakes(worker: FakeWorker, incidents: Option<&std::path::Path>) -> AppState {
    let (wl, wurl) = listener().await;
    let (tl, turl) = listener().await;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(wk::worker_server::WorkerServer::new(worker))
            .serve_with_incoming(wl),
    );
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(tk::tokenizer_server::TokenizerServer::new(FakeTokenizer))
            .serve_with_incoming(tl),
    );
    let mut cfg = Config::new(&turl, &wurl);
    cfg.tls = pdmesh_tls::test_ca::args();
    cfg.api_key = Some("sk-test-secret".into());
    cfg.incidents.dir = incidents.map(std::path::Path::to_owned);
    let backends = Backends::connect_lazy(&turl, &wurl).unwrap();
    AppState::new(
        cfg,
        backends,
        None,
        tokio_util::sync::CancellationToken::new(),
    )
    .unwrap()
}

#[tokio::test]
async fn data_loss_fails_the_request_and_files_a_first_token_report() {
    let dir = tempfile::tempdir().unwrap();
    let incidents = dir.path().join("incidents");
    let loss = format!(
        "prefill sent first token 7 but decode Some(5): {}",
        crate::route::pd::FIRST_TOKEN_MISMATCH
    );
    let st = gateway(Some(loss), Some(&incidents)).await;
    let stream = open(&st, "req-9").await;
    let events: Vec<_> = stream.collect().await;
    let err = events.last().unwrap().as_ref().unwrap_err();
    assert_eq!(err.code, Some(crate::error::DATA_LOSS), "{err:?}");
    let all = pdmesh_incident::list(&incidents).unwrap();
    assert_eq!(all.len(), 1);
    let i = &all[0];
    assert_eq!(i.kind, pdmesh_incident::Kind::FirstTokenMismatch);
    assert_eq!(
        (&*i.place.service, &*i.place.request_id),
        ("gateway", "req-9")
    );
    assert!(i.details["error"].contains("first token 7 but decode Some(5)"));
    // Without --incident-include-prompts: the prompt's length, never its ids.
    assert!(i.replay.as_ref().unwrap().prompt_token_ids.is_empty());
    assert_eq!(i.details["prompt tokens"], "3");
    assert_eq!(i.config["api_key"], "[redacted]");
    // The gateway's figures now (no tick ran yet, so no "before"), this failure
    // counted among those reported.
    let reported = i
        .metrics
        .iter()
        .find(|m| m.name == "failures reported (every kind)")
        .unwrap();
    assert_eq!((reported.before, reported.after), (None, Some(1.0)));
    let md = std::fs::read_to_string(incidents.join(format!("{}.md", i.id))).unwrap();
    assert!(!md.contains("sk-test-secret"));
    let m = st.metrics.render();
    assert!(
        m.contains(r#"mesh_incidents_total{kind="first_token_mismatch"} 1"#),
        "{m}"
    );
    // A worker's own DATA_LOSS (a page failing its checksum) fails the request the
    // same way; that worker files the report, so the gateway files none.
    let others = dir.path().join("others");
    let loss = "1 of 3 pages changed between the engine and the host mirror";
    let st = gateway(Some(loss.into()), Some(&others)).await;
    let stream = open(&st, "req-10").await;
    let events: Vec<_> = stream.collect().await;
    let err = events.last().unwrap().as_ref().unwrap_err();
    assert_eq!(err.code, Some(crate::error::DATA_LOSS), "{err:?}");
    assert!(pdmesh_incident::list(&others).unwrap().is_empty());
}

#[tokio::test]
async fn dropping_the_stream_sends_abort_and_closes_the_generate_call() {
    let (aborts_tx, mut aborts) = mpsc::unbounded_channel();
    let (closed_tx, mut closed) = mpsc::unbounded_channel();
    let worker = FakeWorker {
        aborts: aborts_tx,
        closed: closed_tx,
        data_loss: None,
    };
    let st = fakes(worker, None).await;

    let mut stream = start(
        &st,
        "req-42".into(),
        vec![1, 2, 3],
        GenParams::default(),
        None,
        std::time::Instant::now(),
    )
    .await
    .unwrap();
    for _ in 0..3 {
        assert!(matches!(stream.next().await, Some(Ok(GenEvent::Text(t))) if t == "x"));
    }
    drop(stream);
    let id = tokio::time::timeout(Duration::from_secs(10), aborts.recv())
        .await
        .expect("no Abort was sent");
    assert_eq!(id.as_deref(), Some("req-42"));
    tokio::time::timeout(Duration::from_secs(10), closed.recv())
        .await
        .expect("the Generate stream stayed open");
}

#[tokio::test]
async fn ready_while_the_tokenizer_and_a_worker_answer_and_not_once_the_worker_is_gone() {
    let st = gateway(None, None).await;
    let ask = || async {
        let r = crate::http::ops::ready(axum::extract::State(st.clone())).await;
        let status = r.status();
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        (
            status,
            serde_json::from_slice::<serde_json::Value>(&body).unwrap(),
        )
    };
    let (status, body) = ask().await;
    assert_eq!(status, axum::http::StatusCode::OK, "{body}");
    assert_eq!(
        (body["workers_ok"].clone(), body["workers"].clone()),
        (1.into(), 1.into())
    );
    // A gateway whose only worker is unreachable cannot serve.
    let refusing = pdmesh_testkit::Refusing::new();
    let dead = refusing.url();
    let mut cfg = st.cfg.clone();
    cfg.worker_url = dead.clone();
    let tokenizer = cfg.tokenizer_url.clone();
    let st = AppState::new(
        cfg,
        Backends::connect_lazy(&tokenizer, &dead).unwrap(),
        None,
        tokio_util::sync::CancellationToken::new(),
    )
    .unwrap();
    let r = crate::http::ops::ready(axum::extract::State(st)).await;
    assert_eq!(r.status(), axum::http::StatusCode::SERVICE_UNAVAILABLE);
    // Liveness asks nothing of the backends.
    assert_eq!(
        crate::http::ops::live().await.status(),
        axum::http::StatusCode::OK
    );
}

/// A worker that accepts connections and never answers (a hung or stopped process).
async fn hung_worker() -> (String, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    (url, task)
}

#[tokio::test]
async fn the_models_facts_come_from_the_first_worker_that_answers() {
    let st = gateway(None, None).await;
    let alive = st.cfg.worker_url.clone();
    let (hung, _task) = hung_worker().await;
    let b = Backends::connect_pd(
        &st.cfg.tokenizer_url,
        "http://127.0.0.1:1",
        (
            true,
            std::slice::from_ref(&hung),
            &[alive.clone(), hung.clone()],
        ),
        pdmesh_tls::test_ca::auth(),
    )
    .unwrap();
    let t0 = std::time::Instant::now();
    let info = b.model_facts().await.unwrap();
    assert_eq!(
        (info.model_id.as_str(), info.context_length),
        ("fake-model", 4096)
    );
    // Without waiting for the hung workers' probe timeout.
    assert!(
        t0.elapsed() < crate::route::BACKEND_PROBE_TIMEOUT,
        "{:?}",
        t0.elapsed()
    );
    // The summed figures (for /metrics) still need every worker.
    let err = b.model_info().await.unwrap_err();
    assert!(err.message.contains("in time"), "{}", err.message);
}

#[tokio::test]
async fn the_drain_waits_for_a_request_still_in_its_handler() {
    let st = gateway(None, None).await;
    // A request being tokenized when SIGTERM comes: no stream is open yet.
    st.handling
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let mut drain = tokio::spawn(crate::drain(
        st.clone(),
        Duration::from_secs(30),
        shutdown.clone(),
        st.shutdown.clone(),
    ));
    shutdown.cancel();
    // It does not end while the request is in its handler...
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut drain)
            .await
            .is_err()
    );
    assert!(!st.shutdown.is_cancelled());
    // ...and ends once it has answered (its stream, if any, is counted by then).
    st.handling
        .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    tokio::time::timeout(Duration::from_secs(5), drain)
        .await
        .expect("drained")
        .unwrap();
    assert!(st.shutdown.is_cancelled());
}

#[tokio::test]
async fn a_draining_gateway_says_so_and_ends_open_streams_only_at_its_bound() {
    let st = gateway(None, None).await;
    // A stream that never ends by itself is open when the drain starts.
    let mut stream = open(&st, "req-7").await;
    assert!(matches!(stream.next().await, Some(Ok(GenEvent::Text(_)))));
    let shutdown = tokio_util::sync::CancellationToken::new();
    let bound = Duration::from_millis(300);
    let drain = tokio::spawn(crate::drain(
        st.clone(),
        bound,
        shutdown.clone(),
        st.shutdown.clone(),
    ));
    let t0 = std::time::Instant::now();
    shutdown.cancel();
    // /health says draining (503) to anyone still connected. (Before the drain task
    // has begun it may say 503 for another reason: this gateway's tokenizer is not
    // there. Only "draining" counts.)
    let mut draining = false;
    for _ in 0..100 {
        let r = crate::http::ops::health(axum::extract::State(st.clone())).await;
        let status = r.status();
        let body = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        if v["status"] == "draining" {
            assert_eq!(status, axum::http::StatusCode::SERVICE_UNAVAILABLE);
            draining = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(draining, "/health never said draining");
    // And so does /ready, which a load balancer asks.
    let ready = crate::http::ops::ready(axum::extract::State(st.clone())).await;
    assert_eq!(ready.status(), axum::http::StatusCode::SERVICE_UNAVAILABLE);
    // The open stream holds the drain until its bound; then it ends with "shutting
    // down" (the stream checks that first).
    drain.await.unwrap();
    assert!(t0.elapsed() >= bound, "{:?}", t0.elapsed());
    assert_eq!(st.backends.workers.in_flight(), 1);
    let err = stream.next().await.unwrap().unwrap_err();
    assert!(err.message.contains("shutting down"), "{err:?}");
}

//! Integration tests: the real worker (real model, real engine on its actor thread),
//! started on 127.0.0.1:0 with a small KV pool and spoken to through the generated
//! tonic client.

use pdmesh_proto::cache::v1::kv_event::Kind as KvKind;

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_info_describes_the_configured_pool() {
    let mut s = start().await;
    assert!(s.healthy().await);
    let info = s.info().await;
    assert_eq!(info.vocab_size, 49_152);
    assert_eq!(info.context_length, MAX_CONTEXT as u32);
    assert_eq!(
        (
            info.page_size,
            info.total_pages,
            info.free_pages,
            info.max_batch
        ),
        (16, KV_PAGES, KV_PAGES, 8)
    );
    assert!(info.eos_token_ids.contains(&2), "{:?}", info.eos_token_ids);
    assert_eq!(info.kv_layout_fingerprint.len(), 16);
    assert!(
        info.kv_layout_fingerprint
            .chars()
            .all(|c| c.is_ascii_hexdigit()),
        "{}",
        info.kv_layout_fingerprint
    );
}

/// `cache_salt` namespaces the prefix cache: a prompt is reused only by requests of the
/// same salt (or, salt-less, by salt-less ones), and the answer never depends on it. An
/// empty or overlong salt is the caller's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_salted_prompt_shares_cached_pages_only_with_its_own_salt() {
    let mut s = start().await;
    let mut run = async |id: &str, salt: Option<&str>| {
        let mut req = request(id, PROMPT, greedy(6));
        req.cache_salt = salt.map(str::to_owned);
        let stream = s.client.generate(req).await?.into_inner();
        Ok::<_, tonic::Status>(collect(stream).await)
    };
    let (want, f) = run("a1", Some("tenant-a")).await.unwrap();
    assert_eq!(f.cached_tokens, 0);
    for (id, salt, cached) in [
        ("b1", Some("tenant-b"), 0),
        ("none1", None, 0),
        ("a2", Some("tenant-a"), 16),
        ("b2", Some("tenant-b"), 16),
        ("none2", None, 16),
    ] {
        let (got, f) = run(id, salt).await.unwrap();
        assert_eq!(
            got, want,
            "{id}: the salt changes what is reused, never the answer"
        );
        assert_eq!(f.cached_tokens, cached, "{id} ({salt:?})");
    }
    for (salt, why) in [
        (String::new(), "non-empty"),
        ("s".repeat(257), "at most 256 bytes"),
    ] {
        let err = run("bad", Some(&salt)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(
            err.message().contains("cache_salt") && err.message().contains(why),
            "{err:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_reuses_its_cached_page_and_answers_the_same() {
    let mut s = start().await;
    let mut run = async |id: &str| {
        let stream = s.generate(request(id, PROMPT, greedy(6))).await;
        collect(stream).await
    };
    let (first, f1) = run("first").await;
    let (second, f2) = run("second").await;
    assert_eq!(first, second);
    // 17 prompt tokens: one whole 16-token page can be reused, the last token is computed.
    assert_eq!((f1.cached_tokens, f2.cached_tokens), (0, 16));
    let info = s.info().await;
    assert_eq!(info.prefix_hit_tokens, 16);
    assert!(info.cached_pages >= 1, "{info:?}");
    assert_eq!(info.free_pages + info.cached_pages, KV_PAGES);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_generate_streams_each_token_then_finished_length() {
    let mut s = start().await;
    let (tokens, finished) = s.complete(request("g8", PROMPT, greedy(8))).await;
    assert_eq!(tokens.len(), 8, "{tokens:?}");
    assert!(tokens.iter().all(|&t| t < 49_152));
    assert_eq!(finished.reason(), pb::FinishReason::Length);
    assert_eq!(
        (finished.prompt_tokens, finished.completion_tokens),
        (PROMPT.len() as u32, 8)
    );
    assert!(
        finished.matched_stop.is_empty() && finished.matched_token.is_none(),
        "{finished:?}"
    );
    assert_eq!(
        s.free_pages().await,
        KV_PAGES,
        "pages returned after the request finished"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_identical_greedy_requests_get_identical_tokens() {
    let s = start().await;
    async fn twin(mut client: WorkerClient<Channel>, id: &str) -> (Vec<u32>, pb::Finished) {
        collect(answer(client.generate(request(id, PROMPT, greedy(16)))).await).await
    }
    let (a, b) = tokio::join!(
        twin(s.client.clone(), "twin-a"),
        twin(s.client.clone(), "twin-b")
    );
    assert_eq!(a.0.len(), 16);
    assert_eq!(
        a.0, b.0,
        "batched greedy decoding must not depend on the batch"
    );
    assert_eq!(a.1.reason(), pb::FinishReason::Length);
    assert_eq!(b.1.reason(), pb::FinishReason::Length);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_mid_stream_finishes_with_abort_and_frees_pages() {
    let mut s = start().await;
    let baseline = s.free_pages().await;
    let mut stream = s.generate(request("long", PROMPT, greedy(0))).await;
    next_token(&mut stream).await;
    assert!(
        s.free_pages().await < baseline,
        "a running request holds pages"
    );

    let found = s.abort("long").await;
    assert!(found);
    let (tokens, finished) = collect(stream).await;
    assert_eq!(finished.reason(), pb::FinishReason::Abort);
    assert_eq!(finished.prompt_tokens, PROMPT.len() as u32);
    assert_eq!(
        finished.completion_tokens as usize,
        tokens.len() + 1,
        "counts the token read before the abort"
    );
    // The abort is answered after the engine released the pages.
    assert_eq!(s.free_pages().await, baseline);
    assert!(!s.abort("long").await, "an aborted request is gone");
}

/// A client that drops its Generate stream mid-generation must not keep the request
/// running. A second request decoding in the same batch is the clock: the dropped one
/// would need hundreds more steps to end by itself, so it must be gone within far fewer
/// of the witness's tokens (no wall-clock timing involved).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_client_stream_aborts_the_request() {
    let mut s = start().await;
    let baseline = s.free_pages().await;
    let mut leaver = s.generate(request("leaver", PROMPT, greedy(0))).await;
    next_token(&mut leaver).await;
    let mut witness = s.generate(request("witness", PROMPT, greedy(0))).await;
    next_token(&mut witness).await;
    drop(leaver);

    let mut witnessed = 0;
    loop {
        // Reusing the id is refused while the dropped request still runs.
        match s
            .client
            .generate(request("leaver", PROMPT, greedy(1)))
            .await
        {
            Ok(stream) => {
                let (tokens, _) = collect(stream.into_inner()).await;
                assert_eq!(tokens.len(), 1);
                break;
            }
            Err(e) => assert!(e.message().contains("already running"), "{e:?}"),
        }
        next_token(&mut witness).await;
        witnessed += 1;
        assert!(
            witnessed < 200,
            "the dropped request was still running {witnessed} steps later"
        );
    }
    drop(witness);
    s.wait_free_pages(baseline).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_invalid_argument_and_hold_nothing() {
    let mut s = start().await;
    let baseline = s.free_pages().await;
    let long_prompt: Vec<u32> = PROMPT
        .iter()
        .copied()
        .cycle()
        .take(MAX_CONTEXT + 40)
        .collect();
    let mut out_of_vocab = PROMPT.to_vec();
    out_of_vocab[3] = 49_152;
    let cases: Vec<(&str, pb::GenerateRequest)> = vec![
        (
            "temperature",
            request(
                "t",
                PROMPT,
                pb::SamplingParams {
                    temperature: Some(-1.0),
                    ..greedy(4)
                },
            ),
        ),
        (
            "top_p",
            request(
                "p",
                PROMPT,
                pb::SamplingParams {
                    top_p: Some(0.0),
                    ..greedy(4)
                },
            ),
        ),
        ("empty", request("e", &[], greedy(4))),
        ("context length", request("l", &long_prompt, greedy(4))),
        (
            "exceeds the context length",
            request("m", PROMPT, greedy(MAX_CONTEXT as u32)),
        ),
        ("vocabulary", request("v", &out_of_vocab, greedy(4))),
        (
            "prompt_group_size must be between 1 and 64",
            pb::GenerateRequest {
                prompt_group: "g".into(),
                prompt_group_size: 1_000_000,
                ..request("g", PROMPT, greedy(4))
            },
        ),
        (
            "stop[1] is not valid UTF-8",
            request(
                "s",
                PROMPT,
                pb::SamplingParams {
                    stop: vec![b"ok".to_vec(), vec![0xff, 0xfe]],
                    ..greedy(4)
                },
            ),
        ),
    ];
    for (needle, req) in cases {
        let id = req.request_id.clone();
        let err = s.client.generate(req).await.map(|_| ()).unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{needle}: {err:?}");
        assert!(
            err.message().contains(needle),
            "{needle:?} not in {:?}",
            err.message()
        );
        assert!(
            !s.abort(&id).await,
            "{needle}: a rejected request must not be running"
        );
    }
    assert_eq!(s.free_pages().await, baseline);
    // The worker still serves after rejecting all of that.
    let (tokens, _) = s.complete(request("ok", PROMPT, greedy(2))).await;
    assert_eq!(tokens.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_then_aborts_what_is_left_and_stops_the_server() {
    // A request without a length limit outlasts the drain's bound.
    let mut s = start_with(|c| c.drain_timeout_ms = 300).await;
    let mut stream = s.generate(request("bye", PROMPT, greedy(0))).await;
    next_token(&mut stream).await;
    s.svc.shutdown.cancel();
    let (_, finished) = collect(stream).await;
    assert_eq!(finished.reason(), pb::FinishReason::Abort);
    drop(s.client);
    let result = s.svc.join().await;
    assert!(result.is_ok(), "{result:?}");
}

/// The next KV event's kind, or a hang.
async fn next_kv(stream: &mut Streaming<pdmesh_proto::cache::v1::KvEvent>) -> (u64, KvKind) {
    let e = tokio::time::timeout(HANG, stream.message())
        .await
        .expect("a KV event in time")
        .unwrap()
        .expect("the stream stays open");
    (e.seq, e.kind.expect("every event has a kind"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_name_the_cached_prompt_pages_and_a_late_subscriber_gets_them_as_a_snapshot() {
    let mut s = start().await;
    let info = s.info().await;
    let seed = u64::from_str_radix(&info.kv_layout_fingerprint, 16).unwrap();
    let mut early = s.kv_events().await;
    assert!(matches!(next_kv(&mut early).await.1, KvKind::Cleared(_)));
    // A 40-token prompt: two whole pages.
    let prompt: Vec<u32> = PROMPT
        .iter()
        .chain(PROMPT)
        .chain(&PROMPT[..6])
        .copied()
        .collect();
    let want = pdmesh_kv::page_hashes(seed, &prompt, info.page_size as usize);
    assert_eq!(want.len(), 2);
    s.complete(request("kv", &prompt, greedy(4))).await;
    let (seq, kind) = next_kv(&mut early).await;
    let KvKind::Stored(st) = kind else {
        panic!("{kind:?}")
    };
    assert_eq!(
        (seq, st.parent_hash),
        (1, seed),
        "the first page's parent is the seed"
    );
    assert_eq!(
        st.hashes[..2],
        want[..],
        "the prompt's pages, by the shared naming"
    );
    // Someone subscribing now learns the same pages from the snapshot.
    let mut late = s.kv_events().await;
    assert!(matches!(next_kv(&mut late).await.1, KvKind::Cleared(_)));
    let mut seen = Vec::new();
    while seen.len() < st.hashes.len() {
        let (n, kind) = next_kv(&mut late).await;
        let KvKind::Stored(p) = kind else {
            panic!("{kind:?}")
        };
        assert_eq!(n, seq, "snapshot events carry the last change's number");
        seen.extend(p.hashes);
    }
    assert_eq!(seen, st.hashes);
    // The event streams end with the server instead of holding it open.
    s.svc.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_cache_frees_the_cached_pages_and_subscribers_see_them_removed() {
    let mut s = start().await;
    let mut events = s.kv_events().await;
    assert!(matches!(next_kv(&mut events).await.1, KvKind::Cleared(_)));
    let (first, _) = s.complete(request("cached", PROMPT, greedy(6))).await;
    let KvKind::Stored(stored) = next_kv(&mut events).await.1 else {
        panic!("the request's pages are cached first")
    };
    let info = s.info().await;
    assert!(info.cached_pages >= 1, "{info:?}");

    let flushed = s.flush().await;
    assert_eq!(flushed, u64::from(info.cached_pages));
    let KvKind::Removed(removed) = next_kv(&mut events).await.1 else {
        panic!("a flush removes pages")
    };
    let (mut a, mut b) = (removed.hashes, stored.hashes);
    a.sort_unstable();
    b.sort_unstable();
    assert_eq!(a, b, "exactly the stored pages are removed");
    let info = s.info().await;
    assert_eq!((info.cached_pages, info.free_pages), (0, KV_PAGES));

    // Nothing is reused any more, and the answer is the same.
    let (again, f) = s.complete(request("again", PROMPT, greedy(6))).await;
    assert_eq!((again, f.cached_tokens), (first, 0));
    // The second answer's pages go too; then an empty cache frees nothing and fails
    // nothing.
    s.flush().await;
    assert_eq!(s.flush().await, 0);
    s.wait_free_pages(KV_PAGES).await;
}

/// The standard gRPC health service Kubernetes' probes ask: ready and live once the
/// model is loaded; at shutdown no longer ready while the running request finishes (the
/// drain), and that request still runs to its length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_says_ready_and_live_then_not_ready_while_draining() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let mut s = start().await;
    let channel = tonic::transport::Endpoint::from_shared(s.svc.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let mut ask = async |service: &str| {
        health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .map(|r| r.into_inner().status())
    };
    // The model is loaded once the worker answers its own calls.
    s.info().await;
    for name in ["", "readiness", "liveness"] {
        assert_eq!(ask(name).await.unwrap(), ServingStatus::Serving, "{name:?}");
    }
    assert_eq!(ask("nope").await.unwrap_err().code(), tonic::Code::NotFound);
    let mut running = s.generate(request("drained", PROMPT, greedy(48))).await;
    next_token(&mut running).await;
    s.svc.shutdown.cancel();
    // Not ready within the probes' refresh; still live.
    let mut ready = ServingStatus::Serving;
    for _ in 0..40 {
        ready = ask("readiness").await.unwrap();
        if ready == ServingStatus::NotServing {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(ready, ServingStatus::NotServing);
    assert_eq!(ask("liveness").await.unwrap(), ServingStatus::Serving);
    let (ids, fin) = collect(running).await;
    assert_eq!(ids.len() + 1, 48, "{fin:?}");
    s.svc.join().await.unwrap();
}

/// `--health-listen`: a plaintext port for probes that cannot speak the mesh's TLS
/// (Kubernetes' gRPC probes). It answers readiness and liveness as the worker's own port
/// does, and nothing else: the Worker service is not there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_port_answers_health_and_nothing_else() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let health = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = health.local_addr().unwrap();
    let mut s = start_with_health(|_| {}, Some(health)).await;
    s.info().await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel.clone());
    for name in ["readiness", "liveness"] {
        let mut status = ServingStatus::Unknown;
        // The probes' first refresh may follow the model's load by one tick.
        for _ in 0..40 {
            status = answer(health.check(HealthCheckRequest {
                service: name.into(),
            }))
            .await
            .status();
            if status == ServingStatus::Serving {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert_eq!(status, ServingStatus::Serving, "{name}");
    }
    let err = WorkerClient::new(channel)
        .model_info(pb::ModelInfoRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unimplemented, "{err}");
    s.svc.stop().await.unwrap();
    // Gone with the worker.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

#[tokio::test]
async fn a_taken_health_port_fails_the_start() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let mut cfg = Config::new(pdmesh_gguf::models::require_default_model());
    cfg.tls = credentials();
    cfg.health_listen = Some(addr);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let err = run(cfg, listener, CancellationToken::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("--health-listen"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_queue_limit_a_request_is_resource_exhausted_and_the_queue_moves_on() {
    let mut s = start_with(|c| {
        c.max_batch = 1;
        c.max_queued_requests = 1;
    })
    .await;
    let baseline = s.free_pages().await;
    // One runs (the batch is full), one waits: the queue is at its limit.
    let mut running = s.generate(request("running", PROMPT, greedy(0))).await;
    next_token(&mut running).await;
    let waiting = s.generate(request("waiting", PROMPT, greedy(2))).await;
    let refused = s
        .client
        .generate(request("refused", PROMPT, greedy(2)))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("queue is full"), "{refused:?}");
    // The running one leaves: the waiting one runs, and the queue takes requests again.
    drop(running);
    let (tokens, _) = collect(waiting).await;
    assert_eq!(tokens.len(), 2);
    let (tokens, _) = s.complete(request("later", PROMPT, greedy(1))).await;
    assert_eq!(tokens.len(), 1);
    s.wait_free_pages(baseline).await;
}

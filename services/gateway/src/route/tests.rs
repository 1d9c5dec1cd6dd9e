//! Tests of worker selection: cache-aware and load-based routing, PD pairing, DNS changes,
//! hung and refusing workers, and the merge of a disaggregated request's streams.

use std::collections::HashSet;

use super::*;

impl Workers {
    /// The prefill worker `pick_prefill` gives for `ids`, by index.
    fn pick(&self, ids: &[u32], decode_home: Option<&str>) -> usize {
        self.pick_salted((ids, None), decode_home)
    }

    fn pick_salted(&self, prompt: (&[u32], Option<&str>), decode_home: Option<&str>) -> usize {
        self.pick_prefill(&self.pool(), prompt, decode_home)
            .expect("a prefill worker")
    }
}

/// A worker whose Generate streams `script` (token chunks), then Finished; it says it
/// is on the host whose cache service is `home`, and records the room homes it is told.
#[derive(Default)]
struct Scripted {
    script: Vec<Vec<u32>>,
    home: &'static str,
    told: Arc<Mutex<Vec<String>>>,
    /// How many Generate calls to refuse as UNAVAILABLE first.
    refuse: std::sync::atomic::AtomicUsize,
    /// While set, answer neither Generate nor Health (a stopped process).
    hang: Arc<std::sync::atomic::AtomicBool>,
    /// Refuse a request id it runs already, as an engine does, until told to abort it
    /// (a dropped stream alone is not seen in time).
    exclusive: bool,
    running: Mutex<HashSet<String>>,
}

#[tonic::async_trait]
impl wk::worker_server::Worker for Scripted {
    type GenerateStream = GenStream;
    async fn generate(
        &self,
        r: tonic::Request<wk::GenerateRequest>,
    ) -> Result<tonic::Response<GenStream>, Status> {
        let r = r.into_inner();
        self.told.lock().unwrap().push(r.kv_home);
        if self.hang.load(Ordering::Relaxed) {
            std::future::pending::<()>().await;
        }
        if self
            .refuse
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(Status::unavailable("scripted: connection reset"));
        }
        if self.exclusive && !self.running.lock().unwrap().insert(r.request_id.clone()) {
            return Err(Status::invalid_argument(format!(
                "request id {:?} is already running",
                r.request_id
            )));
        }
        let script = self.script.clone();
        Ok(tonic::Response::new(Box::pin(async_stream::stream! {
            for ids in script {
                yield Ok(chunk(&ids));
            }
            yield Ok(finished());
        })))
    }
    async fn abort(
        &self,
        r: tonic::Request<wk::AbortRequest>,
    ) -> Result<tonic::Response<wk::AbortResponse>, Status> {
        let found = self
            .running
            .lock()
            .unwrap()
            .remove(&r.into_inner().request_id);
        Ok(tonic::Response::new(wk::AbortResponse { found }))
    }
    async fn health(
        &self,
        _r: tonic::Request<wk::HealthRequest>,
    ) -> Result<tonic::Response<wk::HealthResponse>, Status> {
        if self.hang.load(Ordering::Relaxed) {
            std::future::pending::<()>().await;
        }
        Ok(tonic::Response::new(wk::HealthResponse {
            ok: true,
            ..Default::default()
        }))
    }
    async fn model_info(
        &self,
        _r: tonic::Request<wk::ModelInfoRequest>,
    ) -> Result<tonic::Response<wk::ModelInfoResponse>, Status> {
        Ok(tonic::Response::new(wk::ModelInfoResponse {
            cache_url: self.home.into(),
            ..Default::default()
        }))
    }
    async fn flush_cache(
        &self,
        _r: tonic::Request<wk::FlushCacheRequest>,
    ) -> Result<tonic::Response<wk::FlushCacheResponse>, Status> {
        Err(Status::unimplemented("scripted"))
    }
    type SubscribeKvEventsStream = Pin<Box<dyn Stream<Item = Result<cpb::KvEvent, Status>> + Send>>;
    async fn subscribe_kv_events(
        &self,
        _r: tonic::Request<wk::SubscribeKvEventsRequest>,
    ) -> Result<tonic::Response<Self::SubscribeKvEventsStream>, Status> {
        Err(Status::unimplemented("scripted"))
    }
}

async fn serve(w: Scripted) -> (String, WorkerClient<Channel>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(wk::worker_server::WorkerServer::new(w))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
    );
    let ch = tonic::transport::Endpoint::from_shared(url.clone())
        .unwrap()
        .connect_lazy();
    (
        url,
        WorkerClient::new(pdmesh_tls::test_ca::auth().channel(ch)),
    )
}

/// The token ids a PD request's merged stream shows, or its error.
async fn merged(prefill: Scripted, decode: Scripted) -> Result<Vec<u32>, Status> {
    ids_of(&Workers::pd(
        vec![serve(prefill).await],
        vec![serve(decode).await],
    ))
    .await
}

/// The token ids one request through `w` shows, or its error.
async fn ids_of(w: &Workers) -> Result<Vec<u32>, Status> {
    // What the gateway's client sees of a routing failure: the worker's status, or
    // UNAVAILABLE with routing's words.
    let mut s = w
        .generate(wk::GenerateRequest::default())
        .await
        .map_err(|e| match e {
            RouteError::Worker(s) => s,
            e => Status::unavailable(e.to_string()),
        })?;
    let mut ids = Vec::new();
    while let Some(m) = s.next().await {
        if let Some(wk::generate_response::Kind::Chunk(c)) = m?.kind {
            ids.extend(c.token_ids);
        }
    }
    Ok(ids)
}

fn chunk(ids: &[u32]) -> wk::GenerateResponse {
    wk::GenerateResponse {
        kind: Some(wk::generate_response::Kind::Chunk(wk::TokenChunk {
            token_ids: ids.to_vec(),
            ..Default::default()
        })),
    }
}

fn finished() -> wk::GenerateResponse {
    wk::GenerateResponse {
        kind: Some(wk::generate_response::Kind::Finished(
            wk::Finished::default(),
        )),
    }
}

#[tokio::test]
async fn a_pd_request_shows_prefills_first_token_once_and_fails_when_decode_disagrees() {
    let s = |script: Vec<Vec<u32>>| Scripted {
        script,
        ..Scripted::default()
    };
    assert_eq!(
        merged(s(vec![vec![5]]), s(vec![vec![5], vec![7]]))
            .await
            .unwrap(),
        [5, 7]
    );
    let e = merged(s(vec![vec![5]]), s(vec![vec![6], vec![7]]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::DataLoss, "{e:?}");
}

#[tokio::test]
async fn a_start_refused_as_unavailable_is_tried_once_more() {
    for (refused, want_ok) in [(1, true), (2, false)] {
        let (ptold, dtold) = (Arc::default(), Arc::default());
        let p = Scripted {
            script: vec![vec![5]],
            told: Arc::clone(&ptold),
            refuse: refused.into(),
            ..Scripted::default()
        };
        let d = Scripted {
            script: vec![vec![5], vec![7]],
            told: Arc::clone(&dtold),
            ..Scripted::default()
        };
        let r = merged(p, d).await;
        if want_ok {
            assert_eq!(r.unwrap(), [5, 7]);
        } else {
            assert_eq!(r.unwrap_err().code(), tonic::Code::Unavailable);
        }
        // One more try, never more.
        assert_eq!(ptold.lock().unwrap().len(), 2, "prefill refused {refused}");
        assert_eq!(dtold.lock().unwrap().len(), 2, "prefill refused {refused}");
    }
}

#[tokio::test]
async fn the_second_try_finds_the_side_that_started_the_first_free_of_it() {
    // Prefill refuses the first start, which decode took: decode must have let go of
    // the request before the second try names it again.
    let (ptold, dtold) = (Arc::default(), Arc::default());
    let p = Scripted {
        script: vec![vec![5]],
        told: Arc::clone(&ptold),
        refuse: 1.into(),
        ..Scripted::default()
    };
    let d = Scripted {
        script: vec![vec![5], vec![7]],
        told: Arc::clone(&dtold),
        exclusive: true,
        ..Scripted::default()
    };
    assert_eq!(merged(p, d).await.unwrap(), [5, 7]);
    assert_eq!(ptold.lock().unwrap().len(), 2);
    assert_eq!(dtold.lock().unwrap().len(), 2);
}

type Told = Arc<Mutex<Vec<String>>>;

/// A prefill worker and two decode workers streaming `[5]` then `[7]`, the first of
/// them `first` otherwise; and what each decode worker was told, one entry a start.
async fn two_decode(first: Scripted) -> (Workers, Told, Told) {
    let (t1, t2): (Told, Told) = (Arc::default(), Arc::default());
    let p = Scripted {
        script: vec![vec![5]],
        ..Scripted::default()
    };
    let d = |told: &Told, base: Scripted| Scripted {
        script: vec![vec![5], vec![7]],
        told: Arc::clone(told),
        ..base
    };
    let (d1, d2) = (d(&t1, first), d(&t2, Scripted::default()));
    let w = Workers::pd(vec![serve(p).await], vec![serve(d1).await, serve(d2).await]);
    (w, t1, t2)
}

/// Runs one PD request through `w` and wants decode's `[5, 7]`.
async fn answered(w: &Workers) {
    assert_eq!(ids_of(w).await.unwrap(), [5, 7]);
}

/// Three requests: `first` is asked once and then passed over, `other` takes all three.
async fn passed_over(w: &Workers, first: &Told, other: &Told) {
    for _ in 0..3 {
        answered(w).await;
    }
    assert_eq!(
        first.lock().unwrap().len(),
        1,
        "asked once, then passed over"
    );
    assert_eq!(other.lock().unwrap().len(), 3);
}

#[tokio::test]
async fn a_worker_that_does_not_start_requests_is_passed_over_until_it_answers() {
    // The first decode worker accepts connections but answers nothing (a stopped
    // process): the start fails after the timeout, the retry goes to the second, and
    // so do the requests after it, for as long as it does not answer.
    let stopped = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let (w, hung, other) = two_decode(Scripted {
        hang: Arc::clone(&stopped),
        ..Scripted::default()
    })
    .await;
    w.set_start_timeout(std::time::Duration::from_millis(300));
    passed_over(&w, &hung, &other).await;
    assert!(w.pool().decode[0].avoided());
    // It answers again (SIGCONT): a health probe finds it, and picks take it again.
    stopped.store(false, Ordering::Relaxed);
    let deadline = std::time::Instant::now() + HUNG_PROBE_EVERY * 5;
    while w.pool().decode[0].avoided() {
        assert!(std::time::Instant::now() < deadline, "never taken back");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    answered(&w).await;
    assert_eq!(
        hung.lock().unwrap().len(),
        2,
        "taken again once it answered"
    );
    // With no other worker, the request fails as UNAVAILABLE and says why.
    let p = Scripted {
        script: vec![vec![5]],
        ..Scripted::default()
    };
    let d = Scripted {
        hang: Arc::new(true.into()),
        ..Scripted::default()
    };
    let w = Workers::pd(vec![serve(p).await], vec![serve(d).await]);
    w.set_start_timeout(std::time::Duration::from_millis(200));
    let e = match w.generate(wk::GenerateRequest::default()).await {
        Err(e) => e,
        Ok(_) => panic!("a hung decode worker started the request"),
    };
    assert!(e.unavailable(), "{e:?}");
    assert!(
        e.to_string()
            .contains("did not start the request within 200 ms"),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_decode_worker_that_refuses_starts_is_passed_over_for_the_other() {
    // The first decode worker drains (it refuses every start as UNAVAILABLE): the
    // retry goes to the second, and so do the requests after it.
    let (w, draining, other) = two_decode(Scripted {
        refuse: usize::MAX.into(),
        ..Scripted::default()
    })
    .await;
    passed_over(&w, &draining, &other).await;
}

#[tokio::test]
async fn a_prefill_worker_on_another_host_is_told_the_decode_hosts_cache_as_the_rooms_home() {
    for (phome, dhome, want) in [
        (
            "http://10.0.0.2:7100",
            "http://10.0.0.3:7100",
            "http://10.0.0.3:7100",
        ),
        ("http://10.0.0.3:7100", "http://10.0.0.3:7100", ""),
    ] {
        let (ptold, dtold) = (Arc::default(), Arc::default());
        let p = Scripted {
            script: vec![vec![5]],
            home: phome,
            told: Arc::clone(&ptold),
            ..Scripted::default()
        };
        let d = Scripted {
            script: vec![vec![5], vec![7]],
            home: dhome,
            told: Arc::clone(&dtold),
            ..Scripted::default()
        };
        assert_eq!(merged(p, d).await.unwrap(), [5, 7]);
        assert_eq!(*ptold.lock().unwrap(), [want], "{phome} → {dhome}");
        assert_eq!(*dtold.lock().unwrap(), [""], "decode's rooms are at home");
    }
}

#[tokio::test]
async fn hosts_are_known_only_once_every_worker_told_its_own() {
    let scripted = |home| Scripted {
        script: Vec::new(),
        home,
        ..Scripted::default()
    };
    let p = serve(scripted("http://10.0.0.2:7100")).await;
    let d = serve(scripted("http://10.0.0.3:7100")).await;
    // A second prefill worker that is not up: its host is unknown.
    let refusing = pdmesh_testkit::Refusing::new();
    let down = {
        let url = refusing.url();
        let ch = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .connect_lazy();
        (
            url,
            WorkerClient::new(pdmesh_tls::test_ca::auth().channel(ch)),
        )
    };
    let w = Workers::pd(vec![p.clone(), down], vec![d.clone()]);
    assert!(!w.hosts_known().await);
    let w = Workers::pd(vec![p], vec![d]);
    assert!(w.hosts_known().await);
    // Learned: routing sees them without asking again.
    assert_eq!(
        w.pool().prefill[0].home.get().map(String::as_str),
        Some("http://10.0.0.2:7100")
    );
    assert_eq!(
        w.pool().decode[0].home.get().map(String::as_str),
        Some("http://10.0.0.3:7100")
    );
    assert!(
        Workers::unified("http://x", w.pool().prefill[0].client.clone())
            .hosts_known()
            .await
    );
}

type Msg = Result<wk::GenerateResponse, Status>;

/// One side of a merge, fed by the test: `send` returns once the merge has taken the
/// message (false if it ended first), so the test decides which side it hears first.
struct Feed(tokio::sync::mpsc::UnboundedSender<(Msg, tokio::sync::oneshot::Sender<()>)>);

impl Feed {
    fn new() -> (Self, impl Stream<Item = Msg> + Send + 'static) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let s = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(
            |(m, taken): (Msg, tokio::sync::oneshot::Sender<()>)| {
                let _ = taken.send(());
                m
            },
        );
        (Self(tx), s)
    }

    async fn send(&self, m: Msg) -> bool {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.0.send((m, tx)).is_ok() && rx.await.is_ok()
    }
}

/// What a merge's client sees, each message as it comes; closed when the stream ends.
fn watch(mut s: GenStream) -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(m) = s.next().await {
            let shown = match m {
                Ok(wk::GenerateResponse {
                    kind: Some(wk::generate_response::Kind::Chunk(c)),
                }) => format!("{:?}", c.token_ids),
                Ok(wk::GenerateResponse {
                    kind: Some(wk::generate_response::Kind::Finished(_)),
                }) => "finished".into(),
                Ok(_) => "empty".into(),
                Err(s) => format!("{:?}: {}", s.code(), s.message()),
            };
            let _ = tx.send(shown);
        }
    });
    rx
}

/// The rest of what `out` shows, until its stream ends (bounded, so a merge that waits
/// forever fails the test instead of hanging it).
async fn rest(mut out: tokio::sync::mpsc::UnboundedReceiver<String>) -> Vec<String> {
    let mut seen = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(m) = out.recv().await {
            seen.push(m);
        }
    })
    .await
    .expect("the merged stream ends");
    seen
}

fn merge_of(
    prefill: impl Stream<Item = Msg> + Send + 'static,
    decode: impl Stream<Item = Msg> + Send + 'static,
) -> GenStream {
    let n = Arc::default();
    merge(prefill, decode, (Inflight::new(&n), Inflight::new(&n)))
}

/// What the client of a PD request sees when prefill's first token is `first` and
/// decode streams `decoded`, the merge hearing prefill's token first or decode's.
async fn in_order(first: u32, decoded: &[&[u32]], prefill_first: bool) -> Vec<String> {
    let ((p, ps), (d, ds)) = (Feed::new(), Feed::new());
    let mut out = watch(merge_of(ps, ds));
    let mut seen = Vec::new();
    if prefill_first {
        assert!(p.send(Ok(chunk(&[first]))).await);
        // Shown at once, before decode has sent anything.
        seen.push(out.recv().await.expect("prefill's token is shown"));
    }
    for ids in decoded {
        d.send(Ok(chunk(ids))).await;
    }
    d.send(Ok(finished())).await;
    drop(d);
    if !prefill_first {
        // Decode's messages are taken, and wait for prefill's token.
        assert!(
            out.try_recv().is_err(),
            "decode's tokens went out before prefill's"
        );
        assert!(p.send(Ok(chunk(&[first]))).await);
    }
    p.send(Ok(finished())).await;
    drop(p);
    seen.extend(rest(out).await);
    seen
}

#[tokio::test]
async fn the_first_token_check_holds_whichever_streams_token_arrives_first() {
    for prefill_first in [true, false] {
        // Shown once, though both sides stream it (alone, or in one chunk with more).
        assert_eq!(
            in_order(5, &[&[5], &[7]], prefill_first).await,
            ["[5]", "[7]", "finished"],
            "prefill first: {prefill_first}"
        );
        assert_eq!(
            in_order(5, &[&[5, 7, 9]], prefill_first).await,
            ["[5]", "[7, 9]", "finished"],
            "prefill first: {prefill_first}"
        );
        // A decode side that disagrees got other KV: the request fails, and none of
        // decode's tokens is shown.
        let seen = in_order(6, &[&[5], &[7]], prefill_first).await;
        assert_eq!(seen.len(), 2, "prefill first: {prefill_first}: {seen:?}");
        assert_eq!(seen[0], "[6]");
        assert!(
            seen[1].starts_with("DataLoss: prefill sent first token 6 but decode Some(5)"),
            "prefill first: {prefill_first}: {seen:?}"
        );
    }
}

#[tokio::test]
async fn decode_alone_goes_through_when_prefills_first_token_ended_the_generation() {
    // Prefill sends no token that ends the generation, and decode does not stream it:
    // decode's end waits for prefill's, and nothing is checked.
    let ((p, ps), (d, ds)) = (Feed::new(), Feed::new());
    let out = watch(merge_of(ps, ds));
    assert!(d.send(Ok(finished())).await);
    drop(d);
    assert!(p.send(Ok(finished())).await);
    drop(p);
    assert_eq!(rest(out).await, ["finished"]);
}

#[tokio::test]
async fn either_sides_error_ends_the_request_before_prefills_first_token() {
    // Decode refused it (its pool is full): the client hears so at once, although
    // prefill is still computing.
    let ((_p, ps), (d, ds)) = (Feed::new(), Feed::new());
    let out = watch(merge_of(ps, ds));
    assert!(d.send(Err(Status::resource_exhausted("no KV pages"))).await);
    assert_eq!(rest(out).await, ["ResourceExhausted: no KV pages"]);
    // Prefill failed: so did the request, not at decode's room deadline.
    let ((p, ps), (_d, ds)) = (Feed::new(), Feed::new());
    let out = watch(merge_of(ps, ds));
    assert!(p.send(Err(Status::aborted("the room failed"))).await);
    assert_eq!(rest(out).await, ["Aborted: prefill: the room failed"]);
}

#[tokio::test]
async fn a_room_that_failed_under_decode_reports_prefills_error_as_the_cause() {
    // Prefill found its pages corrupt and aborted the room; decode's ABORTED about the
    // room reached the gateway first. The client hears prefill's DATA_LOSS.
    let ((p, ps), (d, ds)) = (Feed::new(), Feed::new());
    let out = watch(merge_of(ps, ds));
    let room = "KV transfer failed: aborted: prefill ended before its pages were sent";
    assert!(d.send(Err(Status::aborted(room))).await);
    assert!(p.send(Err(Status::data_loss("pages changed"))).await);
    assert_eq!(rest(out).await, ["DataLoss: prefill: pages changed"]);
    // A prefill that ended without an error leaves decode's error as it was.
    let ((p, ps), (d, ds)) = (Feed::new(), Feed::new());
    let out = watch(merge_of(ps, ds));
    assert!(d.send(Err(Status::aborted(room))).await);
    drop(p);
    assert_eq!(rest(out).await, [format!("Aborted: {room}")]);
    // Decode's other errors do not wait for prefill.
    let ((_p, ps), (d, ds)) = (Feed::new(), Feed::new());
    let out = watch(merge_of(ps, ds));
    assert!(d.send(Err(Status::unavailable("gone"))).await);
    assert_eq!(rest(out).await, ["Unavailable: gone"]);
}

fn workers(n: usize) -> Workers {
    let ch =
        || {
            WorkerClient::new(pdmesh_tls::test_ca::auth().channel(
                tonic::transport::Endpoint::from_static("http://127.0.0.1:9").connect_lazy(),
            ))
        };
    Workers::pd(
        (0..n).map(|i| (format!("p{i}"), ch())).collect(),
        vec![("d".into(), ch())],
    )
}

const SEED: u64 = 0x1234;

/// Tells worker `i`'s view that it holds `ids`' whole pages, as its events would.
/// `n` workers, each with a view of its (empty) cache.
fn holding_nothing(n: usize) -> Workers {
    let w = workers(n);
    for i in 0..n {
        holds(&w, i, &[]);
    }
    w
}

/// How many whole pages of `ids` prefill worker `i`'s view matches (no salt).
fn matched(w: &Workers, i: usize, ids: &[u32]) -> usize {
    let view = w.pool().prefill[i].view.clone();
    view.lock().unwrap().matched((ids, None), &mut Vec::new())
}

fn holds(w: &Workers, i: usize, ids: &[u32]) {
    let hashes = pdmesh_kv::page_hashes(SEED, ids, 16);
    let view = w.pool().prefill[i].view.clone();
    let mut v = view.lock().unwrap();
    v.naming = Some((SEED, 16));
    v.apply(&cpb::KvEvent {
        seq: 1,
        kind: Some(cpb::kv_event::Kind::Stored(cpb::PagesStored {
            parent_hash: SEED,
            hashes,
            token_ids: Vec::new(),
            ..Default::default()
        })),
    });
}

#[tokio::test]
async fn prefill_goes_to_the_longest_cached_prefix_unless_that_worker_is_overloaded() {
    let w = holding_nothing(3);
    let system: Vec<u32> = (0..64).collect();
    let long: Vec<u32> = system.iter().copied().chain(100..140).collect();
    holds(&w, 1, &system[..32]);
    holds(&w, 2, &long);
    let ask: Vec<u32> = system.iter().copied().chain(100..120).collect();
    // Worker 2 holds 5 of its pages, worker 1 two: 2 wins though busier than 0.
    let _busy: Vec<_> = (0..5)
        .map(|_| Inflight::new(&w.pool().prefill[2].inflight))
        .collect();
    assert_eq!(w.pick(&ask, None), 2);
    assert_eq!(w.counts.prefix.load(Ordering::Relaxed), 1);
    // A prompt nobody holds goes to the least loaded: 0 (1 is as idle, but holds more).
    assert_eq!(w.pick(&(500..600).collect::<Vec<_>>(), None), 0);
    let _one = Inflight::new(&w.pool().prefill[0].inflight);
    assert_eq!(w.pick(&(500..600).collect::<Vec<_>>(), None), 1);
    drop(_one);
    // Worker 1 holds 2 of this prompt's 6 pages: too little to decide.
    let thin: Vec<u32> = system[..32].iter().copied().chain(700..764).collect();
    assert_eq!(w.pick(&thin, None), 0);
    // Far busier than the least loaded: the cache is not worth the queue.
    let _more: Vec<_> = (0..BALANCE_ABS)
        .map(|_| Inflight::new(&w.pool().prefill[2].inflight))
        .collect();
    assert_eq!(w.pick(&ask, None), 0);
    assert_eq!(w.counts.load.load(Ordering::Relaxed), 4);
    // Removed pages stop counting; `cleared` forgets everything.
    let view = w.pool().prefill[1].view.clone();
    let mut v = view.lock().unwrap();
    v.apply(&cpb::KvEvent {
        seq: 2,
        kind: Some(cpb::kv_event::Kind::Cleared(cpb::PagesCleared {})),
    });
    assert_eq!(v.matched((&ask, None), &mut Vec::new()), 0);
    drop(v);
    let h = pdmesh_kv::page_hashes(SEED, &long, 16);
    let view = w.pool().prefill[2].view.clone();
    let mut v = view.lock().unwrap();
    v.apply(&cpb::KvEvent {
        seq: 3,
        kind: Some(cpb::kv_event::Kind::Removed(cpb::PagesRemoved {
            hashes: vec![h[2]],
            ..Default::default()
        })),
    });
    assert_eq!(
        v.matched((&long, None), &mut Vec::new()),
        2,
        "a hole ends the prefix"
    );
}

/// A hybrid model's worker holds a long prompt's pages, but its sliding window passed the
/// first ones, so only a hit of the whole prompt would be served: a prompt sharing just
/// the first pages is not routed there, one sharing all of them is. Removing the pages
/// forgets which were unservable.
#[tokio::test]
async fn pages_a_window_slid_past_are_not_a_prefix_to_route_by() {
    let w = holding_nothing(2);
    let long: Vec<u32> = (0..160).collect();
    let h = pdmesh_kv::page_hashes(SEED, &long, 16);
    let view = w.pool().prefill[1].view.clone();
    view.lock().unwrap().apply(&cpb::KvEvent {
        seq: 1,
        kind: Some(cpb::kv_event::Kind::Stored(cpb::PagesStored {
            parent_hash: SEED,
            hashes: h.clone(),
            // One name the event does not store is not kept.
            unservable: [&h[..8], &[42]].concat(),
            ..Default::default()
        })),
    });
    let head: Vec<u32> = long[..128].iter().copied().chain(900..964).collect();
    assert_eq!(
        matched(&w, 1, &head),
        0,
        "8 pages held, none ends a servable prefix"
    );
    assert_eq!(
        view.lock().unwrap().unservable.len(),
        8,
        "the name it does not hold is dropped"
    );
    let _busy = Inflight::new(&w.pool().prefill[1].inflight);
    assert_eq!(w.pick(&head, None), 0, "routed by load");
    let whole: Vec<u32> = long.iter().copied().chain(900..932).collect();
    assert_eq!(matched(&w, 1, &whole), 10);
    assert_eq!(w.pick(&whole, None), 1, "the whole prompt is a hit");
    let nine: Vec<u32> = long[..144].iter().copied().chain(900..964).collect();
    assert_eq!(matched(&w, 1, &nine), 9, "page 8 ends a servable prefix");
    view.lock().unwrap().apply(&cpb::KvEvent {
        seq: 2,
        kind: Some(cpb::kv_event::Kind::Removed(cpb::PagesRemoved {
            hashes: h.clone(),
            ..Default::default()
        })),
    });
    assert!(view.lock().unwrap().unservable.is_empty());
}

/// A salted prompt's pages have names of their own: a worker holding the same tokens
/// salt-less, or under another salt, is no cache hit for it, and one holding them under
/// its salt is.
#[tokio::test]
async fn a_salted_prompt_goes_only_where_its_own_salts_pages_are() {
    let w = holding_nothing(3);
    let ask: Vec<u32> = (0..64).collect();
    holds(&w, 1, &ask);
    // Worker 2 holds the prompt under salt "a".
    let view = w.pool().prefill[2].view.clone();
    view.lock().unwrap().apply(&cpb::KvEvent {
        seq: 2,
        kind: Some(cpb::kv_event::Kind::Stored(cpb::PagesStored {
            parent_hash: pdmesh_kv::salted_seed(SEED, Some("a")),
            hashes: pdmesh_kv::page_hashes(pdmesh_kv::salted_seed(SEED, Some("a")), &ask, 16),
            token_ids: Vec::new(),
            ..Default::default()
        })),
    });
    assert_eq!(w.pick(&ask, None), 1, "salt-less: the salt-less copy");
    assert_eq!(
        w.pick_salted((&ask, Some("a")), None),
        2,
        "salt a: its own copy"
    );
    let before = w.counts.prefix.load(Ordering::Relaxed);
    // Salt b: neither copy is a hit; the least loaded, emptiest cache takes it.
    assert_eq!(w.pick_salted((&ask, Some("b")), None), 0);
    assert_eq!(
        w.counts.prefix.load(Ordering::Relaxed),
        before,
        "routed by load"
    );
}

#[tokio::test]
async fn prefill_prefers_a_host_whose_tier_holds_the_prefix_then_the_decode_host() {
    let w = workers(2);
    for (i, home) in ["http://a", "http://b"].into_iter().enumerate() {
        holds(&w, i, &[]);
        w.pool().prefill[i].home.set(home.into()).unwrap();
    }
    let ask: Vec<u32> = (0..100).collect();
    // Nothing cached anywhere: of two idle workers, the one on decode's host.
    assert_eq!(w.pick(&ask, Some("http://a")), 0);
    assert_eq!(w.pick(&ask, Some("http://b")), 1);
    // Host b's tiers hold the prompt (its device caches are empty), the first pages in its
    // mirror and the rest on its disk: b, wherever decode is.
    let hashes = pdmesh_kv::page_hashes(SEED, &ask, 16);
    let hv: Arc<Mutex<CacheView>> = Arc::default();
    let stored = |seq, hashes: &[u64], tier: cpb::KvTier| cpb::KvEvent {
        seq,
        kind: Some(cpb::kv_event::Kind::Stored(cpb::PagesStored {
            hashes: hashes.to_vec(),
            tier: tier.into(),
            ..Default::default()
        })),
    };
    hv.lock()
        .unwrap()
        .apply(&stored(1, &hashes[..2], cpb::KvTier::Memory));
    hv.lock()
        .unwrap()
        .apply(&stored(2, &hashes[2..], cpb::KvTier::Disk));
    w.hosts
        .lock()
        .unwrap()
        .insert("http://b".into(), hv.clone());
    assert_eq!(w.pick(&ask, Some("http://a")), 1);
    assert_eq!(w.counts.prefix.load(Ordering::Relaxed), 1);
    {
        let mut v = hv.lock().unwrap();
        v.naming = Some((SEED, 16));
        assert_eq!(v.matched((&ask, None), &mut Vec::new()), hashes.len());
        // A page leaving the mirror for the disk stays cached; one leaving the disk does not.
        let removed = |seq, h: u64, tier: cpb::KvTier| cpb::KvEvent {
            seq,
            kind: Some(cpb::kv_event::Kind::Removed(cpb::PagesRemoved {
                hashes: vec![h],
                tier: tier.into(),
            })),
        };
        v.apply(&removed(3, hashes[1], cpb::KvTier::Memory));
        v.apply(&stored(4, &hashes[1..2], cpb::KvTier::Disk));
        assert_eq!(v.matched((&ask, None), &mut Vec::new()), hashes.len());
        v.apply(&removed(5, hashes[3], cpb::KvTier::Disk));
        assert_eq!(
            v.matched((&ask, None), &mut Vec::new()),
            3,
            "a hole on disk ends the prefix"
        );
    }
    // Much busier than the worker on decode's host: load wins again.
    let _busy: Vec<_> = (0..BALANCE_ABS + 1)
        .map(|_| Inflight::new(&w.pool().prefill[1].inflight))
        .collect();
    assert_eq!(w.pick(&ask, Some("http://a")), 0);
}

#[tokio::test]
async fn workers_found_through_dns_come_and_go_and_those_given_by_url_stay() {
    let ch =
        || {
            WorkerClient::new(pdmesh_tls::test_ca::auth().channel(
                tonic::transport::Endpoint::from_static("http://127.0.0.1:9").connect_lazy(),
            ))
        };
    let w = Workers::pd(vec![("given".into(), ch())], Vec::new());
    let stop = tokio_util::sync::CancellationToken::new();
    w.run_tasks(stop.clone());
    let urls = |w: &Workers, role: Role| -> Vec<String> {
        w.named()
            .into_iter()
            .filter(|(r, _)| *r == role)
            .map(|(_, t)| t.url().to_owned())
            .collect()
    };
    // No decode worker yet: a request is refused as UNAVAILABLE, saying why.
    let req = wk::GenerateRequest {
        input_ids: vec![1, 2, 3],
        ..Default::default()
    };
    let err = w.pick_pair(&req).await.err().expect("no decode worker");
    assert!(err.unavailable(), "{err}");
    assert!(err.to_string().contains("no decode worker"), "{err}");
    assert!(!w.hosts_known().await);

    let found = |u: &[&str]| u.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let changed = w.set_discovered(false, &found(&["d1", "d2"]), |_| Some(ch()));
    assert_eq!(changed.added, ["d1", "d2"]);
    assert_eq!(urls(&w, Role::Decode), ["d1", "d2"]);
    let d1 = w.pool().decode[0].clone();
    let _busy = Inflight::new(&d1.inflight);
    // DNS names d2 and d3 now: d1 leaves (its tasks end; the request it serves keeps
    // its target), d3 comes; unchanged names change nothing.
    let changed = w.set_discovered(false, &found(&["d2", "d3"]), |_| Some(ch()));
    assert_eq!(
        (changed.added, changed.removed),
        (vec!["d3".to_owned()], vec!["d1".to_owned()])
    );
    assert!(d1.tasks.is_cancelled());
    assert_eq!(d1.inflight.load(Ordering::Relaxed), 1);
    assert_eq!(urls(&w, Role::Decode), ["d2", "d3"]);
    assert_eq!(w.in_flight(), 0, "only the pool's decode workers count");
    assert_eq!(
        w.set_discovered(false, &found(&["d3", "d2"]), |_| Some(ch())),
        Changed::default()
    );
    // The prefill worker given by URL stays whatever DNS says.
    w.set_discovered(true, &found(&["p1"]), |_| Some(ch()));
    assert_eq!(urls(&w, Role::Prefill), ["given", "p1"]);
    w.set_discovered(true, &[], |_| Some(ch()));
    assert_eq!(urls(&w, Role::Prefill), ["given"]);
    // A worker whose client cannot be made is left out.
    w.set_discovered(true, &found(&["bad"]), |_| None);
    assert_eq!(urls(&w, Role::Prefill), ["given"]);
    stop.cancel();
}

#[tokio::test]
async fn a_view_without_naming_matches_nothing_and_partial_pages_do_not_count() {
    let w = workers(1);
    let ids: Vec<u32> = (0..40).collect();
    assert_eq!(matched(&w, 0, &ids), 0);
    holds(&w, 0, &ids);
    assert_eq!(matched(&w, 0, &ids), 2);
    assert_eq!(matched(&w, 0, &ids[..31]), 1);
}

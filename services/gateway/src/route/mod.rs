//! Which worker serves a request. Unified: the one worker. Disaggregated: one prefill and
//! one decode worker per request, meeting in a fresh room of the cache service; decode is
//! the least loaded, prefill the one whose device cache holds the longest prefix of the
//! prompt — known from each prefill worker's KV events (`SubscribeKvEvents`) — unless that
//! would overload it, least loaded otherwise.

mod cache;
mod error;
pub(crate) mod pd;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cpb::cache_client::CacheClient;
use futures::{Stream, StreamExt};
use pdmesh_proto::cache::v1 as cpb;
use pdmesh_proto::worker::v1 as wk;
use pdmesh_tls::AuthChannel as Channel;
use tonic::Status;
use wk::worker_client::WorkerClient;

use self::cache::{CacheView, follow, follow_host};
pub(crate) use self::error::RouteError;
use self::pd::merge;

/// What a worker does in the mesh: the whole request, or one side of a hand-over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    Unified,
    Prefill,
    Decode,
}

impl Role {
    /// The role's name, as workers report it (ModelInfo's `role`) and labels carry it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Unified => "unified",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// The role a worker reports; `None` for a name this gateway does not know.
    pub fn from_wire(name: &str) -> Option<Self> {
        [Role::Unified, Role::Prefill, Role::Decode]
            .into_iter()
            .find(|r| r.as_str() == name)
    }
}

/// Subscribes to one host's cache service's KV events (its host tier) and applies them to
/// `view` until the stream ends; returns why it ended.
/// How long a unary backend call (health, model info) may take before it counts as down.
pub(crate) const BACKEND_PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// A worker with the prefix is passed over for the least loaded when it has this many more
/// requests in flight than that one and more than this factor times as many.
const BALANCE_ABS: usize = 8;
const BALANCE_REL: f64 = 1.5;
/// A cached prefix decides only when it covers at least this share of the prompt's whole
/// pages: a shared system prompt alone should not pile every request onto one worker.
const MIN_MATCH: f64 = 0.5;
/// How long a lost KV event stream waits before subscribing again.
const RESUBSCRIBE: Duration = Duration::from_millis(500);

pub(crate) struct Target {
    url: String,
    client: WorkerClient<Channel>,
    /// A prefill worker's device cache, as its KV events tell it.
    view: Arc<Mutex<CacheView>>,
    /// Found through DNS (`--prefill-dns`, `--decode-dns`): dropped from the pool once
    /// DNS no longer names it. Workers given by URL stay.
    discovered: bool,
    /// Ends its background tasks (its KV events, learning its host) when it leaves.
    tasks: tokio_util::sync::CancellationToken,
    /// Requests routed here and not yet finished.
    inflight: std::sync::Arc<AtomicUsize>,
    /// Its host's cache service as other hosts reach it (ModelInfo's cache_url), asked
    /// once: which host it is on, and the home of the rooms it receives in.
    home: tokio::sync::OnceCell<String>,
    /// When it last refused a start as UNAVAILABLE (draining at shutdown, its cache link
    /// registering again): picks avoid it for [`AVOID_REFUSED`] while another can serve.
    refused: Mutex<Option<std::time::Instant>>,
    /// It did not start a request in time (a stopped process, a black-holed link): picks
    /// pass it over until it answers a health probe again (see [`Target::probe_until_it_answers`]).
    hung: std::sync::atomic::AtomicBool,
}

/// How long a worker that refused a start as UNAVAILABLE is passed over.
const AVOID_REFUSED: std::time::Duration = std::time::Duration::from_secs(10);

/// How often a worker that did not start a request in time is asked for its health.
const HUNG_PROBE_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

impl Target {
    fn new((url, client): (String, WorkerClient<Channel>)) -> Self {
        Self {
            url,
            client,
            view: Arc::default(),
            discovered: false,
            tasks: tokio_util::sync::CancellationToken::new(),
            inflight: Default::default(),
            home: tokio::sync::OnceCell::new(),
            refused: Mutex::default(),
            hung: Default::default(),
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn client(&self) -> WorkerClient<Channel> {
        self.client.clone()
    }

    /// Whether its host is known.
    pub fn host_known(&self) -> bool {
        self.home.get().is_some()
    }

    /// Notes `r`'s UNAVAILABLE, if it is one.
    fn note<T>(&self, r: &Result<T, RouteError>) {
        if matches!(r, Err(e) if e.unavailable()) {
            *self.refused.lock().expect("refused lock") = Some(std::time::Instant::now());
        }
    }

    /// Whether it refused a start within [`AVOID_REFUSED`], or did not start one in time
    /// and has not answered since.
    fn avoided(&self) -> bool {
        self.hung.load(Ordering::Relaxed)
            || self
                .refused
                .lock()
                .expect("refused lock")
                .is_some_and(|t| t.elapsed() < AVOID_REFUSED)
    }

    /// Marks it hung, and asks for its health every [`HUNG_PROBE_EVERY`] until it answers
    /// (then picks take it again) or it leaves. One prober at a time.
    fn probe_until_it_answers(self: &Arc<Self>) {
        if self.hung.swap(true, Ordering::Relaxed) {
            return;
        }
        let t = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = t.tasks.cancelled() => return,
                    () = tokio::time::sleep(HUNG_PROBE_EVERY) => {}
                }
                let mut c = t.client.clone();
                let call = c.health(wk::HealthRequest {});
                if let Ok(Ok(_)) =
                    tokio::time::timeout(crate::route::BACKEND_PROBE_TIMEOUT, call).await
                {
                    t.hung.store(false, Ordering::Relaxed);
                    tracing::info!(worker = %t.url, "answers again: no longer passed over");
                    return;
                }
            }
        });
    }

    async fn home(&self) -> Result<&str, RouteError> {
        let home = self
            .home
            .get_or_try_init(|| async {
                let mut c = self.client.clone();
                match tokio::time::timeout(
                    crate::route::BACKEND_PROBE_TIMEOUT,
                    c.model_info(wk::ModelInfoRequest {}),
                )
                .await
                {
                    Ok(Ok(r)) => Ok(r.into_inner().cache_url),
                    Ok(Err(s)) => Err(RouteError::NoHome {
                        url: self.url.clone(),
                        why: s.message().to_owned(),
                    }),
                    Err(_) => Err(RouteError::HomeTimeout {
                        url: self.url.clone(),
                    }),
                }
            })
            .await?;
        Ok(home)
    }
}

/// Decrements a target's in-flight count when the request's stream ends.
struct Inflight(std::sync::Arc<AtomicUsize>);

impl Inflight {
    fn new(c: &std::sync::Arc<AtomicUsize>) -> Self {
        c.fetch_add(1, Ordering::Relaxed);
        Self(c.clone())
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How prefill workers were chosen (for `/metrics`).
#[derive(Debug, Default)]
pub(crate) struct RouteCounts {
    /// For the longest cached prefix.
    pub prefix: AtomicU64,
    /// By load alone: nothing cached, or the worker with the prefix was too busy.
    pub load: AtomicU64,
}

pub(crate) type GenStream =
    Pin<Box<dyn Stream<Item = Result<wk::GenerateResponse, Status>> + Send>>;

/// The prefill and decode workers requests are routed to now. Swapped whole when DNS
/// finds workers coming or going; a request holds the targets it picked.
#[derive(Default)]
struct Pool {
    prefill: Vec<Arc<Target>>,
    decode: Vec<Arc<Target>>,
}

pub(crate) struct Workers {
    unified: Vec<Arc<Target>>,
    pool: std::sync::RwLock<Arc<Pool>>,
    /// Cancelled at shutdown; set by [`Workers::run_tasks`], which starts every target's
    /// background tasks (and those of targets found later).
    stop: std::sync::OnceLock<tokio_util::sync::CancellationToken>,
    /// Each host's host tier, by its cache service's URL, as its KV events tell it.
    hosts: Mutex<std::collections::HashMap<String, Arc<Mutex<CacheView>>>>,
    /// Where each prompt group's first choice went (prefill and decode URLs), so the
    /// group's other choices meet it there and share its prompt; dropped after
    /// [`GROUP_TTL`].
    groups: Mutex<std::collections::HashMap<String, (String, String, std::time::Instant)>>,
    pub counts: RouteCounts,
    /// How long a worker may take to start a request (answer Generate with its stream's
    /// headers), in milliseconds; see [`Workers::set_start_timeout`].
    start_timeout_ms: std::sync::atomic::AtomicU64,
}

/// How long a worker may take to start a request unless the gateway is told otherwise.
pub(crate) const START_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How long a prompt group's route is kept: its choices start together, so a short time.
const GROUP_TTL: std::time::Duration = std::time::Duration::from_secs(30);

/// The least loaded worker of `ts`, passing over those that just refused a start; `None`
/// when there is none.
fn least_loaded(ts: &[Arc<Target>]) -> Option<usize> {
    (0..ts.len()).min_by_key(|&i| (ts[i].avoided(), ts[i].inflight.load(Ordering::Relaxed)))
}

/// Workers found or lost by one DNS look-up.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Changed {
    pub added: Vec<String>,
    pub removed: Vec<String>,
}

impl Workers {
    pub fn unified(url: &str, client: WorkerClient<Channel>) -> Self {
        Self {
            unified: vec![Arc::new(Target::new((url.to_owned(), client)))],
            pool: Default::default(),
            stop: std::sync::OnceLock::new(),
            hosts: Mutex::default(),
            groups: Mutex::default(),
            counts: RouteCounts::default(),
            start_timeout_ms: (START_TIMEOUT.as_millis() as u64).into(),
        }
    }

    pub fn pd(
        prefill: Vec<(String, WorkerClient<Channel>)>,
        decode: Vec<(String, WorkerClient<Channel>)>,
    ) -> Self {
        let targets = |v: Vec<_>| v.into_iter().map(|w| Arc::new(Target::new(w))).collect();
        Self {
            unified: Vec::new(),
            pool: std::sync::RwLock::new(Arc::new(Pool {
                prefill: targets(prefill),
                decode: targets(decode),
            })),
            stop: std::sync::OnceLock::new(),
            hosts: Mutex::default(),
            groups: Mutex::default(),
            counts: RouteCounts::default(),
            start_timeout_ms: (START_TIMEOUT.as_millis() as u64).into(),
        }
    }

    fn pool(&self) -> Arc<Pool> {
        self.pool.read().expect("pool lock").clone()
    }

    /// How long a worker may take to start a request. One that takes longer (a stopped
    /// process, a host that black-holes packets) fails the start as UNAVAILABLE: the
    /// request is tried once more elsewhere, and picks pass the worker over for a while.
    pub fn set_start_timeout(&self, limit: std::time::Duration) {
        self.start_timeout_ms
            .store(limit.as_millis() as u64, Ordering::Relaxed);
    }

    fn start_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.start_timeout_ms.load(Ordering::Relaxed))
    }

    /// Requests whose streams are open: on the unified worker, or at decode (a PD
    /// request holds its decode worker until its stream ends).
    pub fn in_flight(&self) -> usize {
        let pool = self.pool();
        self.unified
            .iter()
            .chain(&pool.decode)
            .map(|t| t.inflight.load(Ordering::Relaxed))
            .sum()
    }

    /// Follows every host's cache service's KV events (its host tier) until `stop`.
    pub fn watch_hosts(
        &self,
        caches: Vec<(String, CacheClient<Channel>)>,
        stop: tokio_util::sync::CancellationToken,
    ) {
        for (url, client) in caches {
            let view: Arc<Mutex<CacheView>> = Arc::default();
            self.hosts
                .lock()
                .expect("hosts lock")
                .insert(url.clone(), view.clone());
            let stop = stop.clone();
            tokio::spawn(async move {
                loop {
                    let followed = follow_host(client.clone(), &view);
                    let err = tokio::select! {
                        e = followed => e,
                        _ = stop.cancelled() => return,
                    };
                    tracing::debug!(cache = %url, error = %err.message(), "host KV event stream ended; subscribing again");
                    {
                        let mut v = view.lock().expect("view lock");
                        v.pages.clear();
                        v.disk.clear();
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(RESUBSCRIBE) => {}
                        _ = stop.cancelled() => return,
                    }
                }
            });
        }
    }

    /// Starts, until `stop`, every prefill and decode worker's background tasks, and
    /// those of workers found later: following a prefill worker's KV events (subscribing
    /// again whenever its stream ends: a worker that restarts starts with an empty view),
    /// and asking each which host it is on, so routing knows before the first request.
    pub fn run_tasks(&self, stop: tokio_util::sync::CancellationToken) {
        if self.stop.set(stop).is_err() {
            return;
        }
        let pool = self.pool();
        for t in &pool.prefill {
            self.follow(t, true);
        }
        for t in &pool.decode {
            self.follow(t, false);
        }
    }

    /// Starts `t`'s background tasks (once [`Workers::run_tasks`] has run), ending at
    /// shutdown or when `t` leaves the pool.
    fn follow(&self, t: &Arc<Target>, prefill: bool) {
        let Some(stop) = self.stop.get() else {
            return;
        };
        let until = |stop: &tokio_util::sync::CancellationToken, t: &Target| {
            let (stop, gone) = (stop.clone(), t.tasks.clone());
            async move {
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = gone.cancelled() => {}
                }
            }
        };
        let (t2, ended) = (t.clone(), until(stop, t));
        tokio::spawn(async move {
            let learn = async {
                while t2.home().await.is_err() {
                    tokio::time::sleep(RESUBSCRIBE).await;
                }
            };
            tokio::select! {
                _ = learn => {}
                _ = ended => {}
            }
        });
        if !prefill {
            return;
        }
        let (t, ended) = (t.clone(), until(stop, t));
        tokio::spawn(async move {
            let watch = async {
                loop {
                    let err = follow(t.client.clone(), &t.view).await;
                    tracing::debug!(worker = %t.url, error = %err.message(), "KV event stream ended; subscribing again");
                    *t.view.lock().expect("view lock") = CacheView::default();
                    tokio::time::sleep(RESUBSCRIBE).await;
                }
            };
            tokio::select! {
                _ = watch => {}
                _ = ended => {}
            }
        });
    }

    /// Makes the discovered prefill (or decode) workers those at `urls`: adds those not in
    /// the pool (clients from `client`), drops discovered ones DNS no longer names
    /// (requests they serve finish; their tasks end). Workers given by URL stay.
    pub fn set_discovered(
        &self,
        prefill: bool,
        urls: &[String],
        client: impl Fn(&str) -> Option<WorkerClient<Channel>>,
    ) -> Changed {
        let mut changed = Changed::default();
        let mut added = Vec::new();
        {
            let mut guard = self.pool.write().expect("pool lock");
            let old = if prefill {
                &guard.prefill
            } else {
                &guard.decode
            };
            let mut next: Vec<Arc<Target>> = Vec::new();
            for t in old {
                if !t.discovered || urls.contains(&t.url) {
                    next.push(t.clone());
                } else {
                    t.tasks.cancel();
                    changed.removed.push(t.url.clone());
                }
            }
            for url in urls {
                if next.iter().any(|t| &t.url == url) {
                    continue;
                }
                let Some(c) = client(url) else { continue };
                let mut t = Target::new((url.clone(), c));
                t.discovered = true;
                let t = Arc::new(t);
                next.push(t.clone());
                added.push(t);
                changed.added.push(url.clone());
            }
            if changed.added.is_empty() && changed.removed.is_empty() {
                return changed;
            }
            let mut pool = Pool {
                prefill: guard.prefill.clone(),
                decode: guard.decode.clone(),
            };
            if prefill {
                pool.prefill = next;
            } else {
                pool.decode = next;
            }
            *guard = Arc::new(pool);
        }
        for t in &added {
            self.follow(t, prefill);
        }
        changed
    }

    /// Each prefill worker's URL and the pages its view holds (for `/metrics`).
    pub fn cache_views(&self) -> Vec<(String, usize)> {
        self.pool()
            .prefill
            .iter()
            .map(|t| (t.url.clone(), t.view.lock().expect("view lock").pages.len()))
            .collect()
    }

    /// Every worker with its role.
    pub fn named(&self) -> Vec<(Role, Arc<Target>)> {
        let pool = self.pool();
        let role =
            |r: Role, ts: &[Arc<Target>]| ts.iter().map(|t| (r, t.clone())).collect::<Vec<_>>();
        [
            role(Role::Unified, &self.unified),
            role(Role::Prefill, &pool.prefill),
            role(Role::Decode, &pool.decode),
        ]
        .concat()
    }

    /// Whether there is a prefill and a decode worker (or the unified one) and the host
    /// of every prefill and decode worker is known, learning it now where it is not:
    /// until then routing cannot tell which prefill worker shares decode's host.
    pub async fn hosts_known(&self) -> bool {
        let pool = self.pool();
        if self.unified.is_empty() && (pool.prefill.is_empty() || pool.decode.is_empty()) {
            return false;
        }
        let all = pool.prefill.iter().chain(&pool.decode).map(|t| t.home());
        futures::future::join_all(all)
            .await
            .iter()
            .all(Result::is_ok)
    }

    /// The cache services the prefill and decode workers named as their homes so far.
    pub fn homes(&self) -> Vec<String> {
        let pool = self.pool();
        let mut homes: Vec<String> = (pool.prefill.iter().chain(&pool.decode))
            .filter_map(|t| t.home.get().cloned())
            .filter(|h| !h.is_empty())
            .collect();
        homes.sort();
        homes.dedup();
        homes
    }

    pub fn all(&self) -> Vec<WorkerClient<Channel>> {
        self.named().into_iter().map(|(_, t)| t.client()).collect()
    }

    /// The prefill worker of `pool` for `ids`: the one holding the longest prefix (the
    /// least loaded of those), unless it is much busier than the least loaded worker or
    /// holds less than half of the prompt: then the least loaded takes it (of equally
    /// loaded workers, the one whose cache holds the fewest pages). `None` without
    /// prefill workers.
    fn pick_prefill(
        &self,
        pool: &Pool,
        (ids, salt): (&[u32], Option<&str>),
        decode_home: Option<&str>,
    ) -> Option<usize> {
        let prefill = &pool.prefill;
        // A worker that just refused a start counts as more loaded than any other.
        let load = |i: usize| {
            let t = &prefill[i];
            let n = t.inflight.load(Ordering::Relaxed);
            if t.avoided() {
                n.saturating_add(usize::MAX / 2)
            } else {
                n
            }
        };
        let home = |i: usize| prefill[i].home.get().map(String::as_str);
        let hosts = self.hosts.lock().expect("hosts lock");
        let mut named = Vec::new();
        let (matched, (held, device)): (Vec<usize>, (Vec<usize>, Vec<usize>)) = prefill
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let v = t.view.lock().expect("view lock");
                let device = v.matched((ids, salt), &mut named);
                // What its host's tier holds loads from shared memory instead of being
                // computed: as good as its own device cache for routing.
                let host = match (v.naming, home(i).and_then(|h| hosts.get(h))) {
                    (Some(naming), Some(hv)) => {
                        let mut hv = hv.lock().expect("view lock");
                        hv.naming = Some(naming);
                        hv.matched((ids, salt), &mut named)
                    }
                    _ => 0,
                };
                (device.max(host), (v.pages.len(), device))
            })
            .unzip();
        drop(hosts);
        // Among the least loaded, one on decode's host (its KV then stays on the host),
        // then the emptiest cache: new prefixes spread over workers.
        let elsewhere = |i: usize| decode_home.is_some() && home(i) != decode_home;
        let idle = (0..prefill.len()).min_by_key(|&i| (load(i), elsewhere(i), held[i]))?;
        let best = matched.iter().copied().max().unwrap_or(0);
        let pages = prefill
            .iter()
            .find_map(|t| t.view.lock().expect("view lock").naming)
            .map_or(0, |(_, page)| ids.len() / page);
        let cached = (best > 0 && best as f64 >= MIN_MATCH * pages as f64).then(|| {
            (0..prefill.len())
                .filter(|&i| matched[i] == best)
                // Its own device cache first (nothing to load), then load, then host.
                .min_by_key(|&i| (std::cmp::Reverse(device[i]), load(i), elsewhere(i)))
                .expect("a best match exists")
        });
        Some(match cached {
            Some(i)
                if load(i) <= load(idle) + BALANCE_ABS
                    || (load(i) as f64) <= load(idle) as f64 * BALANCE_REL =>
            {
                self.counts.prefix.fetch_add(1, Ordering::Relaxed);
                i
            }
            _ => {
                self.counts.load.fetch_add(1, Ordering::Relaxed);
                idle
            }
        })
    }

    /// The prefill and decode workers for `req`: those its prompt group's first choice
    /// went to (while both are still in the pool), else the least loaded decode worker
    /// and the best prefill worker for it.
    async fn pick_pair(
        &self,
        req: &wk::GenerateRequest,
    ) -> Result<(Arc<Target>, Arc<Target>), RouteError> {
        let pool = self.pool();
        let by_url = |ts: &[Arc<Target>], url: &str| ts.iter().find(|t| t.url == url).cloned();
        let group = &req.prompt_group;
        if !group.is_empty() {
            let mut groups = self.groups.lock().expect("groups lock");
            let now = std::time::Instant::now();
            groups.retain(|_, (_, _, at)| now.duration_since(*at) < GROUP_TTL);
            if let Some((p, d, _)) = groups.get(group)
                && let (Some(p), Some(d)) = (by_url(&pool.prefill, p), by_url(&pool.decode, d))
            {
                return Ok((p, d));
            }
        }
        let none = |side| RouteError::NoWorker { side };
        let d = pool.decode[least_loaded(&pool.decode).ok_or_else(|| none("decode"))?].clone();
        let dhome = d.home().await?.to_owned();
        let p = pool.prefill[self
            .pick_prefill(
                &pool,
                (&req.input_ids, req.cache_salt.as_deref()),
                Some(&dhome),
            )
            .ok_or_else(|| none("prefill"))?]
        .clone();
        if !group.is_empty() {
            // A choice that raced this one to the pick may have set it: the first stays.
            let mut groups = self.groups.lock().expect("groups lock");
            let (pu, du, _) = groups.entry(group.clone()).or_insert((
                p.url.clone(),
                d.url.clone(),
                std::time::Instant::now(),
            ));
            if let (Some(p), Some(d)) = (by_url(&pool.prefill, pu), by_url(&pool.decode, du)) {
                return Ok((p, d));
            }
        }
        Ok((p, d))
    }

    /// Starts `req`: on the unified worker, or on a prefill and a decode worker meeting in
    /// a fresh room. The stream is decode's, behind prefill's first token (see [`merge`]).
    ///
    /// A start refused as UNAVAILABLE is tried once more, in a fresh room: a worker's
    /// channel whose connection broke (a link that went down and came back) fails its
    /// next call once before it connects again, and a worker whose cache service link is
    /// registering again says UNAVAILABLE too. Nothing of the request has run then; the
    /// other side's call of the first try is dropped, which aborts its room, and that side
    /// has let go of the request before the second try names it again (see [`let_go`]).
    pub async fn generate(&self, req: wk::GenerateRequest) -> Result<GenStream, RouteError> {
        match self.start(req.clone()).await {
            Err(e) if e.unavailable() => {
                tracing::debug!(request_id = %req.request_id, error = %e, "start refused as unavailable; trying once more");
                self.start(req).await
            }
            r => r,
        }
    }

    async fn start(&self, mut req: wk::GenerateRequest) -> Result<GenStream, RouteError> {
        let limit = self.start_timeout();
        if let Some(t) = self.unified.first() {
            let guard = Inflight::new(&t.inflight);
            let mut c = t.client.clone();
            let s = started(t, limit, c.generate(pdmesh_telemetry::request(req)))
                .await?
                .into_inner();
            return Ok(Box::pin(s.map(move |m| {
                let _keep = &guard;
                m
            })));
        }
        let (pt, dt) = self.pick_pair(&req).await?;
        req.room = loop {
            let r = uuid::Uuid::new_v4().as_u64_pair().0;
            if r != 0 {
                break r;
            }
        };
        // The trace id the rooms at the cache service are filed under: this request's
        // trace when traces are exported, so a stuck room's log line names its trace.
        if req.trace_id.is_empty() {
            req.trace_id = pdmesh_telemetry::trace_id(&tracing::Span::current())
                .unwrap_or_else(|| format!("{:032x}", uuid::Uuid::new_v4().as_u128()));
        }
        tracing::Span::current().record("pdmesh.room", req.room);
        tracing::debug!(request_id = %req.request_id, room = req.room, prefill = %pt.url, decode = %dt.url, "routed");
        let guards = (Inflight::new(&pt.inflight), Inflight::new(&dt.inflight));
        let (mut pc, mut dc) = (pt.client.clone(), dt.client.clone());
        let mut preq = req.clone();
        // The room lives at decode's host; a prefill worker on another host is told where.
        let (phome, dhome) = (pt.home().await?, dt.home().await?);
        if phome != dhome {
            preq.kv_home = dhome.to_owned();
        }
        // Both at once: decode reserves its pages while prefill computes.
        let (preq, req) = (
            pdmesh_telemetry::request(preq),
            pdmesh_telemetry::request(req),
        );
        let id = req.get_ref().request_id.clone();
        let (ps, ds) = match tokio::join!(
            started(&pt, limit, pc.generate(preq)),
            started(&dt, limit, dc.generate(req))
        ) {
            (Ok(ps), Ok(ds)) => (ps.into_inner(), ds.into_inner()),
            (Err(e), Ok(_)) => return Err(let_go(&dt, &id, e).await),
            (Ok(_), Err(e)) => return Err(let_go(&pt, &id, e).await),
            (Err(e), Err(_)) => return Err(e),
        };
        Ok(merge(ps, ds, guards))
    }
}

/// Worker `t` started request `id`, whose other side failed with `e`: `t` is told to let
/// go of it, and answers (within the probe timeout) before `e` returns. Dropping its
/// stream would too, but in its own time: a second try of the request, under the same
/// id, could reach `t` first and be refused as a duplicate (a client error, for a fault
/// of the mesh's).
async fn let_go(t: &Target, id: &str, e: RouteError) -> RouteError {
    let mut c = t.client.clone();
    let call = c.abort(wk::AbortRequest {
        request_id: id.to_owned(),
    });
    match tokio::time::timeout(crate::route::BACKEND_PROBE_TIMEOUT, call).await {
        Ok(Ok(_)) => {}
        Ok(Err(s)) => {
            tracing::debug!(worker = %t.url, request_id = id, error = %s, "letting go of a half-started request failed")
        }
        Err(_) => {
            tracing::debug!(worker = %t.url, request_id = id, "letting go of a half-started request: no answer in time")
        }
    }
    e
}

/// `call`, worker `t`'s Generate, bounded by `limit` until the worker answers with its
/// stream's headers: one that does not is UNAVAILABLE, and passed over until it answers a
/// health probe. A refusal as UNAVAILABLE is noted too (passed over for a while).
async fn started<T>(
    t: &Arc<Target>,
    limit: std::time::Duration,
    call: impl std::future::Future<Output = Result<T, Status>>,
) -> Result<T, RouteError> {
    match tokio::time::timeout(limit, call).await {
        Ok(r) => {
            let r = r.map_err(RouteError::Worker);
            t.note(&r);
            r
        }
        Err(_) => {
            let e = RouteError::NotStarted {
                url: t.url.clone(),
                limit,
            };
            tracing::warn!("{e}: passed over until it answers a health probe");
            t.probe_until_it_answers();
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests;

//! Which worker serves a request. Unified: the one worker. Disaggregated: one prefill and
//! one decode worker per request, meeting in a fresh room of the cache service; decode is
//! the least loaded, prefill the one whose device cache holds the longest prefix of the
//! prompt — known from each prefill worker's KV events (`SubscribeKvEvents`) — unless that
//! would overload it, least loaded otherwise.

use std::collections::HashSet;
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

/// Subscribes to one host's cache service's KV events (its host tier) and applies them to
/// `view` until the stream ends; returns why it ended.
async fn follow_host(mut client: CacheClient<Channel>, view: &Mutex<CacheView>) -> Status {
    let mut stream = match client
        .subscribe_events(cpb::SubscribeEventsRequest {})
        .await
    {
        Ok(r) => r.into_inner(),
        Err(s) => return s,
    };
    loop {
        match stream.message().await {
            Ok(Some(e)) => view.lock().expect("view lock").apply(&e),
            Ok(None) => return Status::unavailable("the cache service ended the stream"),
            Err(s) => return s,
        }
    }
}

/// Subscribes to one worker's KV events and applies them to `view` until the stream ends;
/// returns why it ended.
async fn follow(mut client: WorkerClient<Channel>, view: &Mutex<CacheView>) -> Status {
    let info = match client.model_info(wk::ModelInfoRequest {}).await {
        Ok(r) => r.into_inner(),
        Err(s) => return s,
    };
    let Ok(seed) = u64::from_str_radix(&info.kv_layout_fingerprint, 16) else {
        return Status::internal(format!(
            "the worker's KV layout fingerprint {:?} is not hex",
            info.kv_layout_fingerprint
        ));
    };
    let mut stream = match client
        .subscribe_kv_events(wk::SubscribeKvEventsRequest {})
        .await
    {
        Ok(r) => r.into_inner(),
        Err(s) => return s,
    };
    loop {
        match stream.message().await {
            Ok(Some(e)) => {
                let mut v = view.lock().expect("view lock");
                v.naming = Some((seed, info.page_size.max(1) as usize));
                v.apply(&e);
            }
            Ok(None) => return Status::unavailable("the worker ended the stream"),
            Err(s) => return s,
        }
    }
}

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
    fn note<T>(&self, r: &Result<T, Status>) {
        if matches!(r, Err(s) if s.code() == tonic::Code::Unavailable) {
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
                if let Ok(Ok(_)) = tokio::time::timeout(crate::BACKEND_PROBE_TIMEOUT, call).await {
                    t.hung.store(false, Ordering::Relaxed);
                    tracing::info!(worker = %t.url, "answers again: no longer passed over");
                    return;
                }
            }
        });
    }

    async fn home(&self) -> Result<&str, Status> {
        let home = self
            .home
            .get_or_try_init(|| async {
                let mut c = self.client.clone();
                match tokio::time::timeout(
                    crate::BACKEND_PROBE_TIMEOUT,
                    c.model_info(wk::ModelInfoRequest {}),
                )
                .await
                {
                    Ok(Ok(r)) => Ok(r.into_inner().cache_url),
                    Ok(Err(s)) => Err(Status::unavailable(format!(
                        "worker {}: {}",
                        self.url,
                        s.message()
                    ))),
                    Err(_) => Err(Status::unavailable(format!(
                        "worker {} did not say which host it is on in time",
                        self.url
                    ))),
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

/// One prefill worker's device cache, as its KV events tell it.
#[derive(Debug, Default)]
struct CacheView {
    /// How it names pages: the hash chain's seed (its KV layout's fingerprint) and the
    /// page size. `None` while not subscribed.
    naming: Option<(u64, usize)>,
    pages: HashSet<u64>,
}

impl CacheView {
    fn apply(&mut self, e: &cpb::KvEvent) {
        match &e.kind {
            Some(cpb::kv_event::Kind::Stored(s)) => self.pages.extend(&s.hashes),
            Some(cpb::kv_event::Kind::Removed(r)) => {
                for h in &r.hashes {
                    self.pages.remove(h);
                }
            }
            Some(cpb::kv_event::Kind::Cleared(_)) => self.pages.clear(),
            None => {}
        }
    }

    /// Leading pages of prompt `ids` with `cache_salt` `salt` this worker holds (a salted
    /// prompt's pages have names of their own). `named` caches the prompt's page hashes
    /// per naming, so workers that share one (the usual case) hash the prompt once.
    fn matched(
        &self,
        (ids, salt): (&[u32], Option<&str>),
        named: &mut Vec<((u64, usize), Vec<u64>)>,
    ) -> usize {
        let Some(naming) = self.naming else {
            return 0;
        };
        let at = match named.iter().position(|(n, _)| *n == naming) {
            Some(i) => i,
            None => {
                let seed = pdmesh_kv::salted_seed(naming.0, salt);
                named.push((naming, pdmesh_kv::page_hashes(seed, ids, naming.1)));
                named.len() - 1
            }
        };
        named[at]
            .1
            .iter()
            .take_while(|h| self.pages.contains(h))
            .count()
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
                    view.lock().expect("view lock").pages.clear();
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

    /// Every worker with its role (`unified`, `prefill`, `decode`).
    pub fn named(&self) -> Vec<(&'static str, Arc<Target>)> {
        let pool = self.pool();
        let role = |r: &'static str, ts: &[Arc<Target>]| {
            ts.iter().map(|t| (r, t.clone())).collect::<Vec<_>>()
        };
        [
            role("unified", &self.unified),
            role("prefill", &pool.prefill),
            role("decode", &pool.decode),
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
    ) -> Result<(Arc<Target>, Arc<Target>), Status> {
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
        let none = |side: &str| {
            Status::unavailable(format!(
                "no {side} worker is known yet (none given, or DNS names none)"
            ))
        };
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
    pub async fn generate(&self, req: wk::GenerateRequest) -> Result<GenStream, Status> {
        match self.start(req.clone()).await {
            Err(s) if s.code() == tonic::Code::Unavailable => {
                tracing::debug!(request_id = %req.request_id, error = %s, "start refused as unavailable; trying once more");
                self.start(req).await
            }
            r => r,
        }
    }

    async fn start(&self, mut req: wk::GenerateRequest) -> Result<GenStream, Status> {
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
async fn let_go(t: &Target, id: &str, e: Status) -> Status {
    let mut c = t.client.clone();
    let call = c.abort(wk::AbortRequest {
        request_id: id.to_owned(),
    });
    match tokio::time::timeout(crate::BACKEND_PROBE_TIMEOUT, call).await {
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
) -> Result<T, Status> {
    match tokio::time::timeout(limit, call).await {
        Ok(r) => {
            t.note(&r);
            r
        }
        Err(_) => {
            let e = format!(
                "worker {} did not start the request within {} ms",
                t.url,
                limit.as_millis()
            );
            tracing::warn!("{e}: passed over until it answers a health probe");
            t.probe_until_it_answers();
            Err(Status::unavailable(e))
        }
    }
}

/// How long decode's ABORTED (its room failed) waits for prefill's own error, the cause
/// when prefill failed: it aborts the room as it fails, and which of the two errors reaches
/// the gateway first is a race. A prefill that ends well ends the wait at once.
const PREFILL_CAUSE_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// How the DATA_LOSS of a first token that differs between prefill and decode ends (the
/// gateway's own check; the workers' checksum failures say otherwise and report
/// themselves).
pub(crate) const FIRST_TOKEN_MISMATCH: &str = "the KV hand-over is corrupt";

/// A disaggregated request's two streams as the one its client sees. Prefill streams the
/// first token before the hand-over, so it is shown first; decode streams it again, and
/// its copy is checked against prefill's and dropped (a mismatch means decode got other
/// KV: the request fails with DATA_LOSS). Decode's messages that reach the gateway before
/// prefill's first token wait for it, so the check and what the client sees are the same
/// whichever stream's token comes first. Prefill's error, if it fails first, ends the
/// request at once rather than at decode's room deadline; so does decode's. Dropping the
/// stream ends prefill's call too (it aborts what it still holds), so a request that
/// failed or left at decode costs no more compute.
fn merge<P, D>(prefill: P, decode: D, (pguard, dguard): (Inflight, Inflight)) -> GenStream
where
    P: Stream<Item = Result<wk::GenerateResponse, Status>> + Send + 'static,
    D: Stream<Item = Result<wk::GenerateResponse, Status>> + Send + 'static,
{
    // From prefill's own stream: its first token, and its error if it fails.
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<wk::TokenChunk>();
    let (fail_tx, fail_rx) = tokio::sync::oneshot::channel::<Status>();
    let (done_tx, mut done_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _p = pguard;
        let mut ps = Box::pin(prefill);
        let mut first_tx = Some(first_tx);
        // The prompt's logprobs (only prefill computes them): they ride on its first token.
        let mut prompt = Vec::new();
        loop {
            tokio::select! {
                m = ps.next() => match m {
                    Some(Ok(wk::GenerateResponse {
                        kind: Some(wk::generate_response::Kind::Chunk(mut c)),
                    })) if !c.token_ids.is_empty() => {
                        if let Some(tx) = first_tx.take() {
                            c.prompt_logprobs = std::mem::take(&mut prompt);
                            let _ = tx.send(c);
                        }
                    }
                    Some(Ok(wk::GenerateResponse {
                        kind: Some(wk::generate_response::Kind::Chunk(c)),
                    })) => prompt = c.prompt_logprobs,
                    Some(Ok(_)) => {}
                    None => {
                        // A first token that ends the generation is never sent: the
                        // prompt's logprobs go alone.
                        if !prompt.is_empty() && let Some(tx) = first_tx.take() {
                            let _ = tx.send(wk::TokenChunk {
                                prompt_logprobs: prompt,
                                ..Default::default()
                            });
                        }
                        return;
                    }
                    // Sent before `first_tx` drops: a first token that never comes because
                    // prefill failed finds the failure already there.
                    Some(Err(s)) => {
                        let _ = fail_tx.send(s);
                        return;
                    }
                },
                _ = &mut done_rx => return,
            }
        }
    });
    let stream = async_stream::stream! {
        let _d = dguard;
        let _done = done_tx;
        let mut ds = Box::pin(decode);
        let mut fail_rx = Some(fail_rx);
        let mut first_rx = Some(first_rx);
        // Prefill's first token once known (`Some(None)`: prefill ended without one, as
        // it does when that token ends the generation).
        let mut first: Option<Option<u32>> = None;
        // Decode's messages (`None`: its end) that came before prefill's first token.
        let mut held = std::collections::VecDeque::new();
        let mut decode_open = true;
        let mut checked = false;
        loop {
            let m = if first.is_some() && let Some(m) = held.pop_front() {
                m
            } else {
                tokio::select! {
                    // Decode before prefill's failure: when decode refused the request
                    // (its pool is full), prefill's failure is only the consequence.
                    biased;
                    m = ds.next(), if decode_open => {
                        let m = match m {
                            Some(Ok(m)) => Some(m),
                            Some(Err(s)) => {
                                // ABORTED: decode's room failed, which is what a prefill
                                // that failed does to it. Prefill's own error says why.
                                let s = match (s.code(), fail_rx.take()) {
                                    (tonic::Code::Aborted, Some(rx)) => {
                                        match tokio::time::timeout(PREFILL_CAUSE_GRACE, rx).await {
                                            Ok(Ok(p)) => Status::new(p.code(), format!("prefill: {}", p.message())),
                                            _ => s,
                                        }
                                    }
                                    _ => s,
                                };
                                yield Err(s);
                                break;
                            }
                            None => { decode_open = false; None }
                        };
                        if first.is_none() {
                            held.push_back(m);
                            continue;
                        }
                        m
                    },
                    f = async { fail_rx.as_mut().expect("polled while present").await },
                        if fail_rx.is_some() => match f {
                        Ok(s) => {
                            yield Err(Status::new(s.code(), format!("prefill: {}", s.message())));
                            break;
                        }
                        // Prefill finished normally: only decode matters now.
                        Err(_) => { fail_rx = None; continue; }
                    },
                    c = async { first_rx.as_mut().expect("polled while present").await },
                        if first_rx.is_some() => {
                        first_rx = None;
                        match c {
                            Ok(c) => {
                                first = Some(c.token_ids.first().copied());
                                yield Ok(wk::GenerateResponse {
                                    kind: Some(wk::generate_response::Kind::Chunk(c)),
                                });
                            }
                            Err(_) => {
                                if let Some(Ok(s)) = fail_rx.as_mut().map(|r| r.try_recv()) {
                                    yield Err(Status::new(s.code(), format!("prefill: {}", s.message())));
                                    break;
                                }
                                first = Some(None);
                            }
                        }
                        continue;
                    },
                    else => break,
                }
            };
            let Some(mut m) = m else { break };
            if !checked && let Some(wk::generate_response::Kind::Chunk(c)) = m.kind.as_mut() {
                checked = true;
                if let Some(Some(t)) = first {
                    if c.token_ids.first() != Some(&t) {
                        yield Err(Status::data_loss(format!(
                            "prefill sent first token {t} but decode {:?}: {FIRST_TOKEN_MISMATCH}",
                            c.token_ids.first()
                        )));
                        break;
                    }
                    c.token_ids.remove(0);
                    if c.token_ids.is_empty() {
                        continue;
                    }
                }
            }
            yield Ok(m);
        }
    };
    Box::pin(stream)
}

#[cfg(test)]
mod tests {
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
        type SubscribeKvEventsStream =
            Pin<Box<dyn Stream<Item = Result<cpb::KvEvent, Status>> + Send>>;
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
        let mut s = w.generate(wk::GenerateRequest::default()).await?;
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
        for _ in 0..3 {
            answered(&w).await;
        }
        assert_eq!(
            hung.lock().unwrap().len(),
            1,
            "asked once, then passed over"
        );
        assert_eq!(other.lock().unwrap().len(), 3);
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
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        assert!(
            e.message()
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
        for _ in 0..3 {
            answered(&w).await;
        }
        assert_eq!(
            draining.lock().unwrap().len(),
            1,
            "asked once, then passed over"
        );
        assert_eq!(other.lock().unwrap().len(), 3);
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
        let ch = || {
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
            })),
        });
    }

    #[tokio::test]
    async fn prefill_goes_to_the_longest_cached_prefix_unless_that_worker_is_overloaded() {
        let w = workers(3);
        for i in 0..3 {
            holds(&w, i, &[]);
        }
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
            })),
        });
        assert_eq!(
            v.matched((&long, None), &mut Vec::new()),
            2,
            "a hole ends the prefix"
        );
    }

    /// A salted prompt's pages have names of their own: a worker holding the same tokens
    /// salt-less, or under another salt, is no cache hit for it, and one holding them under
    /// its salt is.
    #[tokio::test]
    async fn a_salted_prompt_goes_only_where_its_own_salts_pages_are() {
        let w = workers(3);
        for i in 0..3 {
            holds(&w, i, &[]);
        }
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
        // Host b's tier holds the prompt (its device caches are empty): b, wherever decode is.
        let hv: Arc<Mutex<CacheView>> = Arc::default();
        hv.lock().unwrap().apply(&cpb::KvEvent {
            seq: 1,
            kind: Some(cpb::kv_event::Kind::Stored(cpb::PagesStored {
                parent_hash: 0,
                hashes: pdmesh_kv::page_hashes(SEED, &ask, 16),
                token_ids: Vec::new(),
            })),
        });
        w.hosts.lock().unwrap().insert("http://b".into(), hv);
        assert_eq!(w.pick(&ask, Some("http://a")), 1);
        assert_eq!(w.counts.prefix.load(Ordering::Relaxed), 1);
        // Much busier than the worker on decode's host: load wins again.
        let _busy: Vec<_> = (0..BALANCE_ABS + 1)
            .map(|_| Inflight::new(&w.pool().prefill[1].inflight))
            .collect();
        assert_eq!(w.pick(&ask, Some("http://a")), 0);
    }

    #[tokio::test]
    async fn workers_found_through_dns_come_and_go_and_those_given_by_url_stay() {
        let ch = || {
            WorkerClient::new(pdmesh_tls::test_ca::auth().channel(
                tonic::transport::Endpoint::from_static("http://127.0.0.1:9").connect_lazy(),
            ))
        };
        let w = Workers::pd(vec![("given".into(), ch())], Vec::new());
        let stop = tokio_util::sync::CancellationToken::new();
        w.run_tasks(stop.clone());
        let urls = |w: &Workers, role: &str| -> Vec<String> {
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
        assert_eq!(err.code(), tonic::Code::Unavailable);
        assert!(err.message().contains("no decode worker"), "{err}");
        assert!(!w.hosts_known().await);

        let found = |u: &[&str]| u.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let changed = w.set_discovered(false, &found(&["d1", "d2"]), |_| Some(ch()));
        assert_eq!(changed.added, ["d1", "d2"]);
        assert_eq!(urls(&w, "decode"), ["d1", "d2"]);
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
        assert_eq!(urls(&w, "decode"), ["d2", "d3"]);
        assert_eq!(w.in_flight(), 0, "only the pool's decode workers count");
        assert_eq!(
            w.set_discovered(false, &found(&["d3", "d2"]), |_| Some(ch())),
            Changed::default()
        );
        // The prefill worker given by URL stays whatever DNS says.
        w.set_discovered(true, &found(&["p1"]), |_| Some(ch()));
        assert_eq!(urls(&w, "prefill"), ["given", "p1"]);
        w.set_discovered(true, &[], |_| Some(ch()));
        assert_eq!(urls(&w, "prefill"), ["given"]);
        // A worker whose client cannot be made is left out.
        w.set_discovered(true, &found(&["bad"]), |_| None);
        assert_eq!(urls(&w, "prefill"), ["given"]);
        stop.cancel();
    }

    #[tokio::test]
    async fn a_view_without_naming_matches_nothing_and_partial_pages_do_not_count() {
        let w = workers(1);
        let ids: Vec<u32> = (0..40).collect();
        assert_eq!(
            w.pool().prefill[0]
                .view
                .lock()
                .unwrap()
                .matched((&ids, None), &mut Vec::new()),
            0
        );
        holds(&w, 0, &ids);
        assert_eq!(
            w.pool().prefill[0]
                .view
                .lock()
                .unwrap()
                .matched((&ids, None), &mut Vec::new()),
            2
        );
        assert_eq!(
            w.pool().prefill[0]
                .view
                .lock()
                .unwrap()
                .matched((&ids[..31], None), &mut Vec::new()),
            1
        );
    }
}

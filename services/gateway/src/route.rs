//! Which worker serves a request. Unified: the one worker. Disaggregated: one prefill and
//! one decode worker per request, meeting in a fresh room of the cache service; decode is
//! the least loaded, prefill the one that most likely holds the longest prefix of the
//! prompt in its cache (the prompt pages this gateway routed to it before), least loaded
//! otherwise.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::{Stream, StreamExt};
use pdmesh_proto::worker::v1 as wk;
use tonic::Status;
use tonic::transport::Channel;
use wk::worker_client::WorkerClient;

/// Tokens per routing page (the workers' default page size).
const PAGE: usize = 16;
/// Pages remembered per prefill worker before the least recently routed are forgotten.
const REMEMBERED: usize = 200_000;

struct Target {
    url: String,
    client: WorkerClient<Channel>,
    /// Requests routed here and not yet finished.
    inflight: std::sync::Arc<AtomicUsize>,
}

impl Target {
    fn new((url, client): (String, WorkerClient<Channel>)) -> Self {
        Self {
            url,
            client,
            inflight: Default::default(),
        }
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

/// Page hashes routed to each prefill worker, with a use tick for forgetting.
#[derive(Default)]
struct PrefixMemory {
    tick: u64,
    pages: Vec<HashMap<u64, u64>>,
}

pub(crate) type GenStream =
    Pin<Box<dyn Stream<Item = Result<wk::GenerateResponse, Status>> + Send>>;

pub(crate) struct Workers {
    unified: Vec<Target>,
    prefill: Vec<Target>,
    decode: Vec<Target>,
    memory: Mutex<PrefixMemory>,
}

/// Chained hashes of the prompt's whole pages: page i's covers every token up to its end.
fn page_hashes(ids: &[u32]) -> Vec<u64> {
    let mut out = Vec::with_capacity(ids.len() / PAGE);
    let mut prev = 0u64;
    for page in ids.chunks_exact(PAGE) {
        // SipHash with fixed keys: the same on every run, which the routing needs.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        prev.hash(&mut h);
        page.hash(&mut h);
        prev = h.finish();
        out.push(prev);
    }
    out
}

fn least_loaded(ts: &[Target]) -> usize {
    (0..ts.len())
        .min_by_key(|&i| ts[i].inflight.load(Ordering::Relaxed))
        .expect("at least one worker")
}

impl Workers {
    pub fn unified(url: &str, client: WorkerClient<Channel>) -> Self {
        Self {
            unified: vec![Target::new((url.to_owned(), client))],
            prefill: Vec::new(),
            decode: Vec::new(),
            memory: Mutex::default(),
        }
    }

    pub fn pd(
        prefill: Vec<(String, WorkerClient<Channel>)>,
        decode: Vec<(String, WorkerClient<Channel>)>,
    ) -> Self {
        let n = prefill.len();
        Self {
            unified: Vec::new(),
            prefill: prefill.into_iter().map(Target::new).collect(),
            decode: decode.into_iter().map(Target::new).collect(),
            memory: Mutex::new(PrefixMemory {
                tick: 0,
                pages: vec![HashMap::new(); n],
            }),
        }
    }

    pub fn all(&self) -> impl Iterator<Item = &WorkerClient<Channel>> {
        self.unified
            .iter()
            .chain(&self.prefill)
            .chain(&self.decode)
            .map(|t| &t.client)
    }

    /// The prefill worker for `ids`: the longest remembered prefix, then the least load.
    fn pick_prefill(&self, ids: &[u32]) -> usize {
        let hashes = page_hashes(ids);
        let mut mem = self.memory.lock().expect("router lock");
        mem.tick += 1;
        let tick = mem.tick;
        let matched: Vec<usize> = mem
            .pages
            .iter()
            .map(|m| hashes.iter().take_while(|h| m.contains_key(h)).count())
            .collect();
        let best = matched.iter().copied().max().unwrap_or(0);
        let i = if best == 0 {
            least_loaded(&self.prefill)
        } else {
            (0..self.prefill.len())
                .filter(|&i| matched[i] == best)
                .min_by_key(|&i| self.prefill[i].inflight.load(Ordering::Relaxed))
                .expect("a best match exists")
        };
        let m = &mut mem.pages[i];
        for h in hashes {
            m.insert(h, tick);
        }
        if m.len() > REMEMBERED {
            // Forget the older half.
            let mut ticks: Vec<u64> = m.values().copied().collect();
            let mid = ticks.len() / 2;
            let cut = *ticks.select_nth_unstable(mid).1;
            m.retain(|_, t| *t > cut);
        }
        i
    }

    /// Starts `req`: on the unified worker, or on a prefill and a decode worker meeting in
    /// a fresh room. The stream is decode's; prefill's error, if it fails first, ends it.
    pub async fn generate(&self, mut req: wk::GenerateRequest) -> Result<GenStream, Status> {
        if let Some(t) = self.unified.first() {
            let guard = Inflight::new(&t.inflight);
            let s = t.client.clone().generate(req).await?.into_inner();
            return Ok(Box::pin(s.map(move |m| {
                let _keep = &guard;
                m
            })));
        }
        let p = self.pick_prefill(&req.input_ids);
        let d = least_loaded(&self.decode);
        req.room = loop {
            let r = uuid::Uuid::new_v4().as_u64_pair().0;
            if r != 0 {
                break r;
            }
        };
        if req.trace_id.is_empty() {
            req.trace_id = format!("{:032x}", uuid::Uuid::new_v4().as_u128());
        }
        let (pt, dt) = (&self.prefill[p], &self.decode[d]);
        tracing::debug!(request_id = %req.request_id, room = req.room, prefill = %pt.url, decode = %dt.url, "routed");
        let guards = (Inflight::new(&pt.inflight), Inflight::new(&dt.inflight));
        let (mut pc, mut dc) = (pt.client.clone(), dt.client.clone());
        let preq = req.clone();
        // Both at once: decode reserves its pages while prefill computes.
        let (ps, ds) = tokio::join!(pc.generate(preq), dc.generate(req));
        let (mut ps, ds) = (ps?.into_inner(), ds?.into_inner());
        // Prefill's own stream only matters if it fails: then the request fails now
        // rather than when decode's room deadline passes.
        let (fail_tx, fail_rx) = tokio::sync::oneshot::channel::<Status>();
        // Dropped with the decode stream: prefill's call ends too (it aborts what it
        // still holds), so a request that failed or left at decode costs no more compute.
        let (done_tx, mut done_rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _p = guards.0;
            loop {
                tokio::select! {
                    m = ps.message() => match m {
                        Ok(Some(_)) => {}
                        Ok(None) => return,
                        Err(s) => {
                            let _ = fail_tx.send(s);
                            return;
                        }
                    },
                    _ = &mut done_rx => return,
                }
            }
        });
        let dguard = guards.1;
        let stream = async_stream::stream! {
            let _d = dguard;
            let _done = done_tx;
            let mut ds = ds;
            let mut fail_rx = Some(fail_rx);
            loop {
                tokio::select! {
                    m = ds.message() => match m {
                        Ok(Some(m)) => yield Ok(m),
                        Ok(None) => break,
                        Err(s) => { yield Err(s); break; }
                    },
                    f = async { fail_rx.as_mut().expect("polled while present").await },
                        if fail_rx.is_some() => match f {
                        Ok(s) => {
                            yield Err(Status::new(s.code(), format!("prefill: {}", s.message())));
                            break;
                        }
                        // Prefill finished normally: only decode matters now.
                        Err(_) => fail_rx = None,
                    },
                }
            }
        };
        Ok(Box::pin(stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workers(n: usize) -> Workers {
        let ch = || {
            WorkerClient::new(
                tonic::transport::Endpoint::from_static("http://127.0.0.1:9").connect_lazy(),
            )
        };
        Workers::pd(
            (0..n).map(|i| (format!("p{i}"), ch())).collect(),
            vec![("d".into(), ch())],
        )
    }

    #[tokio::test]
    async fn prefill_goes_where_the_longest_prefix_went_and_balances_otherwise() {
        let w = workers(3);
        let system: Vec<u32> = (0..64).collect();
        let a: Vec<u32> = system.iter().copied().chain(100..140).collect();
        let first = w.pick_prefill(&a);
        // Keep it busy: a new prefix still goes to an idle worker...
        let _busy = Inflight::new(&w.prefill[first].inflight);
        let other: Vec<u32> = (500..600).collect();
        assert_ne!(w.pick_prefill(&other), first);
        // ...but the shared system prompt follows its cache, busy or not.
        let b: Vec<u32> = system.iter().copied().chain(200..230).collect();
        assert_eq!(w.pick_prefill(&b), first);
        // A prompt shorter than a page matches nothing and goes to the least loaded.
        assert_ne!(w.pick_prefill(&[1, 2, 3]), first);
    }

    #[test]
    fn page_hashes_chain_so_equal_pages_after_different_prefixes_differ() {
        let x: Vec<u32> = (0..32).collect();
        let mut y = x.clone();
        y[0] = 99;
        let (hx, hy) = (page_hashes(&x), page_hashes(&y));
        assert_eq!(hx.len(), 2);
        assert_ne!(hx[1], hy[1], "page 1 is equal but its prefix is not");
        assert_eq!(page_hashes(&x[..31]).len(), 1, "only whole pages count");
    }
}

//! What each prefill worker's device cache and each host's cache service hold, as their KV
//! events tell it: the view cache-aware routing matches a prompt's pages against.

use std::collections::HashSet;
use std::sync::Mutex;

use cpb::cache_client::CacheClient;
use pdmesh_proto::cache::v1 as cpb;
use pdmesh_proto::worker::v1 as wk;
use pdmesh_tls::AuthChannel as Channel;
use tonic::Status;
use wk::worker_client::WorkerClient;

/// Subscribes to one host's cache service's KV events (its host tier) and applies them to
/// `view` until the stream ends; returns why it ended.
pub(super) async fn follow_host(
    mut client: CacheClient<Channel>,
    view: &Mutex<CacheView>,
) -> Status {
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
pub(super) async fn follow(mut client: WorkerClient<Channel>, view: &Mutex<CacheView>) -> Status {
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

/// One prefill worker's device cache, as its KV events tell it.
#[derive(Debug, Default)]
pub(super) struct CacheView {
    /// How it names pages: the hash chain's seed (its KV layout's fingerprint) and the
    /// page size. `None` while not subscribed.
    pub(super) naming: Option<(u64, usize)>,
    /// Pages in memory: a worker's device pool, a cache service's host mirror.
    pub(super) pages: HashSet<u64>,
    /// Pages on a cache service's disk tier: promoted to its mirror on a hit, so a prompt
    /// that finds them is served from cache, more slowly than from memory.
    pub(super) disk: HashSet<u64>,
    /// Pages held that no hit could end at (a hybrid model's window layers dropped pages
    /// their window reads there): a prefix counts only up to its last servable page.
    pub(super) unservable: HashSet<u64>,
}

impl CacheView {
    pub(super) fn apply(&mut self, e: &cpb::KvEvent) {
        let on_disk = |tier: i32| tier == cpb::KvTier::Disk as i32;
        match &e.kind {
            Some(cpb::kv_event::Kind::Stored(s)) if on_disk(s.tier) => self.disk.extend(&s.hashes),
            Some(cpb::kv_event::Kind::Stored(s)) => {
                self.pages.extend(&s.hashes);
                // Only pages this event stores: a name it does not hold is never kept.
                let stored: std::collections::HashSet<&u64> = s.hashes.iter().collect();
                self.unservable
                    .extend(s.unservable.iter().filter(|h| stored.contains(h)));
            }
            Some(cpb::kv_event::Kind::Removed(r)) => {
                let set = if on_disk(r.tier) {
                    &mut self.disk
                } else {
                    &mut self.pages
                };
                for h in &r.hashes {
                    set.remove(h);
                    self.unservable.remove(h);
                }
            }
            Some(cpb::kv_event::Kind::Cleared(_)) => {
                self.pages.clear();
                self.disk.clear();
                self.unservable.clear();
            }
            None => {}
        }
    }

    /// Leading pages of prompt `ids` with `cache_salt` `salt` this worker or host holds,
    /// in memory or on disk (a salted
    /// prompt's pages have names of their own). `named` caches the prompt's page hashes
    /// per naming, so workers that share one (the usual case) hash the prompt once.
    pub(super) fn matched(
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
        let hashes = &named[at].1;
        let held = hashes
            .iter()
            .take_while(|h| self.pages.contains(h) || self.disk.contains(h))
            .count();
        hashes[..held]
            .iter()
            .rposition(|h| !self.unservable.contains(h))
            .map_or(0, |i| i + 1)
    }
}

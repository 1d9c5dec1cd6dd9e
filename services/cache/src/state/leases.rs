//! Leases: the workers and peer hosts' cache services admitted to the mirror (the first
//! registration fixes its layout and creates it), kept alive by heartbeats; a lease is
//! the capability to pin, reserve and commit.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdmesh_cache_client::Lease;
use pdmesh_kv::KvLayout;

use super::slots::{MirrorSize, Slot};
use super::{CacheError, State};
use pdmesh_cache_client::mirror::Mirror;

/// What a worker needs to use the mirror.
#[derive(Clone, Debug)]
pub struct Registration {
    pub lease: Lease,
    pub lease_ttl: Duration,
    pub shm_path: PathBuf,
    pub page_bytes: usize,
    pub total_pages: usize,
    pub layout: Arc<KvLayout>,
}

#[derive(Debug)]
pub(super) struct Holder {
    pub(super) worker: String,
    pub(super) expires: Instant,
    /// Pins per slot (a lease may pin a page more than once).
    pub(super) pins: HashMap<u32, u32>,
    pub(super) reserved: HashSet<u32>,
    /// Another host's cache service: this service writes its pages itself, checking
    /// the room under the lock, so a late write from it can never land.
    pub(super) peer: bool,
}

/// A `layout_refused` report: this mirror's layout against `theirs`, side by side.
fn layout_incident(
    ours: &KvLayout,
    theirs: &KvLayout,
    who: &str,
    summary: String,
) -> pdmesh_incident::Incident {
    let mut i = pdmesh_incident::Incident::new(
        pdmesh_incident::Kind::LayoutRefused,
        summary,
        pdmesh_incident::Place {
            worker: who.to_owned(),
            ..Default::default()
        },
    );
    i.layouts = Some(pdmesh_incident::LayoutPair {
        ours_label: "this host's mirror".into(),
        ours: pdmesh_incident::LayoutView::of(ours),
        theirs_label: who.to_owned(),
        theirs: pdmesh_incident::LayoutView::of(theirs),
    });
    i
}

/// A lease number nobody holds: random, so that no caller can guess another's (a lease is
/// the capability to pin, reserve and commit) and a restarted cache service never hands
/// out a lease its killed predecessor did. A worker still heartbeating the old lease then
/// hears NOT_FOUND and registers again (mapping the new mirror file), instead of keeping
/// another worker's lease alive and reading the new mirror's slots through the old file's
/// mapping.
fn fresh_lease(taken: &HashMap<Lease, Holder>) -> Lease {
    loop {
        let l = Lease::random();
        if !taken.contains_key(&l) {
            return l;
        }
    }
}

impl State {
    /// Admits a worker. The first registration fixes the layout and creates the mirror
    /// file sized from it; later ones must bring the same fingerprint.
    pub fn register(
        &mut self,
        worker: &str,
        layout: KvLayout,
        now: Instant,
    ) -> Result<Registration, CacheError> {
        match &self.layout {
            Some(ours) if ours.fingerprint() != layout.fingerprint() => {
                self.incidents.push(layout_incident(
                    ours,
                    &layout,
                    &format!("worker {worker}"),
                    format!(
                        "Worker {worker} registered with another KV layout than this host's \
                         mirror holds, and was refused: pages written with one layout and read \
                         with the other would be read as the wrong bytes."
                    ),
                ));
                return Err(CacheError::LayoutMismatch {
                    ours: ours.to_string(),
                    theirs: layout.to_string(),
                });
            }
            Some(_) => {}
            None => {
                let page_bytes = layout.bytes_per_page();
                let pages = match self.size {
                    MirrorSize::Bytes(b) => b as usize / page_bytes,
                    MirrorSize::Tokens(t) => t as usize / layout.page_size(),
                };
                if pages == 0 {
                    return Err(CacheError::TooSmall {
                        size: self.size,
                        page_bytes,
                    });
                }
                let dir = match &self.dir {
                    Some(d) => {
                        pdmesh_cache_client::mirror::ensure_private(d)?;
                        d.clone()
                    }
                    None => pdmesh_cache_client::mirror::default_dir((page_bytes * pages) as u64)?,
                };
                let mirror = Mirror::create(&dir, page_bytes, pages)?;
                tracing::info!(path = %mirror.path().display(), pages, page_bytes, layout = %layout, "host mirror created");
                self.mirror = Some(Arc::new(mirror));
                self.slots = (0..pages).map(|_| Slot::Free).collect();
                self.free = (0..pages as u32).rev().collect();
                self.stats.total_pages = pages;
                self.layout = Some(Arc::new(layout));
            }
        }
        tracing::info!(worker, "worker registered");
        Ok(self.admit(worker, false, now))
    }

    /// A new lease for `name` (a worker, or a peer host's cache service) on the mirror.
    fn admit(&mut self, name: &str, peer: bool, now: Instant) -> Registration {
        let lease = fresh_lease(&self.leases);
        self.leases.insert(
            lease,
            Holder {
                worker: name.to_owned(),
                expires: now + self.ttl,
                pins: HashMap::new(),
                reserved: HashSet::new(),
                peer,
            },
        );
        let mirror = self.mirror.as_ref().expect("a layout implies a mirror");
        Registration {
            lease,
            lease_ttl: self.ttl,
            shm_path: mirror.path().to_owned(),
            page_bytes: mirror.page_bytes(),
            total_pages: mirror.pages(),
            layout: self.layout.clone().expect("a mirror implies a layout"),
        }
    }

    /// Whether `lease` is another host's cache service's (not a worker's of this host).
    pub fn is_peer_lease(&self, lease: Lease) -> bool {
        self.leases.get(&lease).is_some_and(|l| l.peer)
    }

    pub(super) fn lease_mut(&mut self, lease: Lease) -> Result<&mut Holder, CacheError> {
        self.leases
            .get_mut(&lease)
            .ok_or(CacheError::UnknownLease(lease))
    }

    /// Admits another host's cache service, which sends rooms' pages here. It must bring
    /// this mirror's layout (a mismatch is refused naming both, with each component's
    /// bytes per token, and counted) and never fixes it: a host with no worker yet
    /// refuses it.
    pub fn register_peer(
        &mut self,
        peer: &str,
        layout: &KvLayout,
        now: Instant,
    ) -> Result<Registration, CacheError> {
        let Some(ours) = self.layout.clone() else {
            return Err(CacheError::NoLayoutYet);
        };
        if ours.fingerprint() != layout.fingerprint() {
            self.room_stats.peer.layout_refusals += 1;
            self.incidents.push(layout_incident(
                &ours,
                layout,
                &format!("peer {peer}"),
                format!(
                    "The cache service of another host ({peer}) registered with another KV \
                     layout and was refused: no room's pages cross between the two hosts."
                ),
            ));
            tracing::warn!(peer, ours = %ours, theirs = %layout, "peer refused: another KV layout");
            return Err(CacheError::PeerLayoutMismatch {
                ours: crate::transfer::describe(&ours),
                theirs: crate::transfer::describe(layout),
            });
        }
        tracing::info!(peer, "peer cache service registered");
        Ok(self.admit(peer, true, now))
    }

    pub fn heartbeat(&mut self, lease: Lease, now: Instant) -> Result<(), CacheError> {
        let ttl = self.ttl;
        self.lease_mut(lease)?.expires = now + ttl;
        Ok(())
    }
}

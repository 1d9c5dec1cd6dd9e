//! Links from this cache service to other hosts' cache services, for rooms whose receiver
//! is on another host (their "home"). A link registers here as a peer at the home host
//! (which checks the KV layout, refusing another one naming both), keeps that lease
//! alive, relays the room calls over gRPC and moves pages over the tcp page transport
//! ([`crate::transfer`]). Every call has a deadline, so a home host that vanishes, stops
//! or loses its link fails the call in bounded time; the room's own deadlines do the rest
//! on both sides.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pb::cache_client::CacheClient;
use pdmesh_cache_client::Lease;
use pdmesh_kv::KvLayout;
use pdmesh_proto::cache::v1 as pb;
use tonic::Status;

mod error;
pub(crate) use error::PeerError;

use crate::transfer::{Pages, Sent, TcpOptions, TcpSender, TransferError, Transport};
use pdmesh_cache_client::wire::layout_to_pb;

/// One home's link behind a lock of its own: connecting to a home that is gone (which
/// takes up to the I/O deadline) never holds up rooms bound for another home.
type Slot = Arc<tokio::sync::Mutex<Option<Arc<Link>>>>;

/// Most homes one cache service links to at once.
pub(crate) const MAX_LINKS: usize = 64;

/// Every link of this service, by the home's URL.
pub(crate) struct Peers {
    links: std::sync::Mutex<HashMap<String, Slot>>,
    pub opts: TcpOptions,
    /// How this service names itself when it registers at a peer.
    name: String,
    /// The mesh credential, for gRPC and pages alike.
    auth: pdmesh_tls::MeshAuth,
    /// The homes rooms may be relayed to (see [`Homes`]).
    homes: Homes,
}

/// Which cache services a room's home may be: a room open names its home, and this
/// service dials it, so a caller must not be able to point it anywhere.
#[derive(Debug)]
enum Homes {
    /// The `--peer` list, by authority (`host:port`, lower case).
    Listed(std::collections::HashSet<String>),
    /// Any home whose certificate names the cache role (mutual TLS, no list).
    ByCertificate,
    /// None (the mesh token or no credential, and no list).
    Nowhere,
}

/// `url`'s `host:port`, lower case: how the `--peer` list and room homes are compared.
fn authority(url: &str) -> Option<String> {
    let uri = url.parse::<http::Uri>().ok()?;
    let a = uri.authority()?;
    let port = a.port_u16().or(match uri.scheme_str() {
        Some("https") => Some(443),
        Some("http") => Some(80),
        _ => None,
    })?;
    Some(format!("{}:{port}", a.host().to_ascii_lowercase()))
}

impl Peers {
    /// `peers`: the `--peer` list (URLs of the other hosts' cache services).
    pub fn new(
        name: String,
        opts: TcpOptions,
        auth: pdmesh_tls::MeshAuth,
        peers: &[String],
    ) -> Result<Self, crate::Error> {
        let homes = if !peers.is_empty() {
            let listed = peers
                .iter()
                .map(|u| {
                    authority(u).ok_or_else(|| {
                        crate::Error::Config(format!(
                            "--peer {u:?} is not a URL with a host and port (http://HOST:PORT)"
                        ))
                    })
                })
                .collect::<Result<_, _>>()?;
            Homes::Listed(listed)
        } else if auth.tls().is_some() {
            Homes::ByCertificate
        } else {
            Homes::Nowhere
        };
        Ok(Self {
            links: Default::default(),
            opts,
            name,
            auth,
            homes,
        })
    }

    /// Whether rooms may be relayed to `home`; PERMISSION_DENIED naming the flag if not.
    pub(crate) fn admits(&self, home: &str) -> Result<(), PeerError> {
        let home = home.to_owned();
        match &self.homes {
            Homes::ByCertificate => Ok(()),
            Homes::Listed(l) if authority(&home).is_some_and(|a| l.contains(&a)) => Ok(()),
            Homes::Listed(_) => Err(PeerError::NotListed { home }),
            Homes::Nowhere => Err(PeerError::NoPeerList { home }),
        }
    }

    /// The link to `url`, connecting (and registering with `layout`) if there is none or
    /// the last one lost its lease.
    ///
    /// At most [`MAX_LINKS`] homes are kept; a home that could not be reached is
    /// forgotten, so URLs named in room opens cannot grow the map.
    pub async fn link(&self, url: &str, layout: &Arc<KvLayout>) -> Result<Arc<Link>, PeerError> {
        self.admits(url)?;
        let slot = {
            let mut links = self.links.lock().expect("links lock");
            if !links.contains_key(url) && links.len() >= MAX_LINKS {
                // Make room from links that are down (or still being made and failed).
                links.retain(|_, slot| {
                    slot.try_lock().map_or(true, |l| {
                        l.as_ref().is_some_and(|l| l.alive.load(Ordering::Relaxed))
                    })
                });
                if links.len() >= MAX_LINKS {
                    return Err(PeerError::TooManyLinks);
                }
            }
            links.entry(url.to_owned()).or_default().clone()
        };
        let mut cur = slot.lock().await;
        if let Some(l) = cur.as_ref()
            && l.alive.load(Ordering::Relaxed)
            && l.layout.fingerprint() == layout.fingerprint()
        {
            return Ok(l.clone());
        }
        let connected = Link::connect(
            url,
            &self.name,
            layout.clone(),
            self.opts,
            self.auth.clone(),
        )
        .await;
        match connected {
            Ok(link) => {
                let link = Arc::new(link);
                *cur = Some(link.clone());
                Ok(link)
            }
            Err(e) => {
                *cur = None;
                drop(cur);
                let mut links = self.links.lock().expect("links lock");
                // Forget it, unless another call is using the slot right now.
                if links.get(url).is_some_and(|s| Arc::ptr_eq(s, &slot))
                    && Arc::strong_count(&slot) == 2
                {
                    links.remove(url);
                }
                Err(e)
            }
        }
    }

    /// How many homes are linked (or being linked) now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.links.lock().expect("links lock").len()
    }

    /// The link to `url` if one is up (for telling a home that a room failed here).
    pub async fn existing(&self, url: &str) -> Option<Arc<Link>> {
        let slot = self.links.lock().expect("links lock").get(url).cloned()?;
        slot.lock().await.clone()
    }
}

/// One registered link to a home host.
pub(crate) struct Link {
    pub url: String,
    rpc: CacheClient<pdmesh_tls::AuthChannel>,
    /// This service's lease at the home host.
    pub lease: Lease,
    /// The home host's tcp page transport, and the host name its URL gives (which its
    /// TLS certificate names).
    data: SocketAddr,
    host: String,
    alive: Arc<AtomicBool>,
    heartbeat: tokio::task::JoinHandle<()>,
    /// Idle transport connections, reused by later transfers, and since when each idles.
    senders: std::sync::Mutex<Vec<(TcpSender, Instant)>>,
    layout: Arc<KvLayout>,
    opts: TcpOptions,
    auth: pdmesh_tls::MeshAuth,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.heartbeat.abort();
    }
}

/// The peer's answer to call `what` within `t`, or the deadline naming the peer and the
/// call; a refusal keeps the peer's code and says where it came from.
async fn bounded<T>(
    url: &str,
    what: &'static str,
    t: Duration,
    fut: impl Future<Output = Result<T, Status>>,
) -> Result<T, PeerError> {
    match tokio::time::timeout(t, fut).await {
        Ok(r) => r.map_err(|status| PeerError::Answered {
            what,
            url: url.to_owned(),
            status,
        }),
        Err(_) => Err(PeerError::Deadline {
            what,
            url: url.to_owned(),
            limit: t,
        }),
    }
}

fn request<T>(msg: T, t: Duration) -> tonic::Request<T> {
    let mut r = pdmesh_telemetry::request(msg);
    r.set_timeout(t);
    r
}

impl Link {
    async fn connect(
        url: &str,
        name: &str,
        layout: Arc<KvLayout>,
        opts: TcpOptions,
        auth: pdmesh_tls::MeshAuth,
    ) -> Result<Self, PeerError> {
        let t = opts.io_timeout;
        let endpoint = auth
            .endpoint(url)
            .map_err(|e| PeerError::BadHome {
                url: url.to_owned(),
                why: e.to_string(),
            })?
            .connect_timeout(t)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(t)
            .keep_alive_timeout(t);
        let what = "connecting";
        let channel = match tokio::time::timeout(t, endpoint.connect()).await {
            Ok(Ok(channel)) => channel,
            Ok(Err(e)) => {
                return Err(PeerError::Unreachable {
                    what,
                    url: url.to_owned(),
                    why: e.to_string(),
                });
            }
            Err(_) => {
                return Err(PeerError::Deadline {
                    what,
                    url: url.to_owned(),
                    limit: t,
                });
            }
        };
        let mut rpc = CacheClient::new(auth.channel(channel)).max_decoding_message_size(64 << 20);
        let reg = bounded(url, "registering as a peer", t, async {
            Ok(rpc
                .register(request(
                    pb::RegisterRequest {
                        worker_id: name.to_owned(),
                        layout: Some(layout_to_pb(&layout)),
                        data_plane: pb::DataPlane::Peer.into(),
                        // A peer fixes neither the layout nor the model; rooms check
                        // what they carry.
                        model: String::new(),
                    },
                    t,
                ))
                .await?
                .into_inner())
        })
        .await?;
        if reg.page_bytes as usize != layout.bytes_per_page() || reg.peer_port == 0 {
            return Err(PeerError::BadRegistration {
                url: url.to_owned(),
                page_bytes: reg.page_bytes,
                port: reg.peer_port,
            });
        }
        let host = url
            .parse::<http::Uri>()
            .ok()
            .and_then(|u| u.host().map(|h| h.trim_matches(['[', ']']).to_owned()))
            .ok_or_else(|| PeerError::BadHome {
                url: url.to_owned(),
                why: "it names no host".into(),
            })?;
        let data = tokio::net::lookup_host((host.as_str(), reg.peer_port as u16))
            .await
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| PeerError::Unresolved { host: host.clone() })?;
        let lease = Lease::from_wire(&reg.lease).map_err(|e| PeerError::Garbled {
            url: url.to_owned(),
            what: "a peer registration",
            why: e.to_string(),
        })?;
        let alive = Arc::new(AtomicBool::new(true));
        let heartbeat = {
            let (mut rpc, alive, url) = (rpc.clone(), alive.clone(), url.to_owned());
            let ttl = Duration::from_millis(u64::from(reg.lease_ttl_ms));
            let every = (ttl / 3).max(Duration::from_millis(1));
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                // When the home last renewed the lease, at the latest: it lets the lease
                // go a lease's time after that.
                let mut renewed = Instant::now();
                loop {
                    tick.tick().await;
                    let beat = rpc.heartbeat(request(
                        pb::HeartbeatRequest {
                            lease: lease.to_wire(),
                        },
                        every,
                    ));
                    match tokio::time::timeout(every, beat).await {
                        Ok(Ok(_)) => {
                            renewed = Instant::now();
                            if !alive.swap(true, Ordering::Relaxed) {
                                tracing::info!(peer = %url, %lease, "the peer renews the lease again");
                            }
                        }
                        Ok(Err(s)) if s.code() == tonic::Code::NotFound => {
                            tracing::warn!(peer = %url, %lease, "peer lease expired; the next room registers again");
                            alive.store(false, Ordering::Relaxed);
                            return;
                        }
                        // Unreachable (a partition, a stopped home): once no beat has
                        // landed for a lease's time, the home has let the lease go, so
                        // the next room registers again on a fresh connection instead
                        // of naming it. Beats go on meanwhile: one that lands says the
                        // lease lived after all.
                        _ => {
                            let lost = renewed.elapsed() >= ttl;
                            if lost && alive.swap(false, Ordering::Relaxed) {
                                tracing::warn!(peer = %url, %lease, "no heartbeat reached the peer for a lease's time; the next room registers again");
                            }
                        }
                    }
                }
            })
        };
        tracing::info!(peer = url, %lease, %data, "linked to a peer cache service");
        Ok(Self {
            url: url.to_owned(),
            rpc,
            lease,
            data,
            host,
            alive,
            heartbeat,
            senders: Default::default(),
            layout,
            opts,
            auth,
        })
    }

    fn t(&self) -> Duration {
        self.opts.io_timeout
    }

    /// The home no longer knows this link's lease (it said so): the next room registers
    /// again.
    pub fn lost(&self) {
        if self.alive.swap(false, Ordering::Relaxed) {
            tracing::warn!(peer = %self.url, lease = %self.lease, "the peer no longer knows the lease; the next room registers again");
        }
    }

    pub async fn room_open(
        &self,
        room: u64,
        request_id: &str,
        trace_id: &str,
    ) -> Result<pb::RoomStatus, PeerError> {
        let msg = pb::RoomOpenRequest {
            lease: self.lease.to_wire(),
            room,
            side: pb::RoomSide::Sender.into(),
            request_id: request_id.to_owned(),
            trace_id: trace_id.to_owned(),
            home: String::new(),
            held_pages: 0,
        };
        let t = self.t();
        bounded(&self.url, "room open", t, async {
            Ok(self
                .rpc
                .clone()
                .room_open(request(msg, t))
                .await?
                .into_inner())
        })
        .await
    }

    /// A long poll: bounded by its own timeout plus the I/O deadline.
    pub async fn room_wait(
        &self,
        room: u64,
        until: i32,
        timeout_ms: u32,
    ) -> Result<pb::RoomStatus, PeerError> {
        let msg = pb::RoomWaitRequest {
            lease: self.lease.to_wire(),
            room,
            until,
            timeout_ms,
        };
        let t = Duration::from_millis(u64::from(timeout_ms.min(60_000))) + self.t();
        bounded(&self.url, "room wait", t, async {
            Ok(self
                .rpc
                .clone()
                .room_wait(request(msg, t))
                .await?
                .into_inner())
        })
        .await
    }

    pub async fn room_start(&self, room: u64, pages: u32) -> Result<Vec<u32>, PeerError> {
        let msg = pb::RoomStartRequest {
            lease: self.lease.to_wire(),
            room,
            pages,
        };
        let t = self.t();
        bounded(&self.url, "room start", t, async {
            Ok(self
                .rpc
                .clone()
                .room_start(request(msg, t))
                .await?
                .into_inner()
                .slots)
        })
        .await
    }

    pub async fn room_abort(&self, room: u64, reason: &str) -> Result<(), PeerError> {
        let msg = pb::RoomAbortRequest {
            lease: self.lease.to_wire(),
            room,
            reason: reason.to_owned(),
        };
        let t = self.t();
        bounded(&self.url, "room abort", t, async {
            self.rpc.clone().room_abort(request(msg, t)).await?;
            Ok(())
        })
        .await
    }

    fn dial(&self) -> (&pdmesh_tls::MeshAuth, &str) {
        (&self.auth, self.host.as_str())
    }

    /// Moves `pages` of `room` to the home host over an idle transport connection (or a
    /// new one), with `trailer` after them; a connection whose send failed is dropped.
    pub async fn send<P: Pages + ?Sized>(
        &self,
        room: u64,
        pages: &P,
        trailer: Option<&[u8]>,
    ) -> Result<Sent, TransferError> {
        // The home closes a connection idle past its idle timeout: one idle for half of it
        // is dropped here rather than risked.
        let fresh = self.opts.idle_timeout / 2;
        let idle = {
            let mut idle = self.senders.lock().expect("senders lock");
            idle.retain(|(_, since)| since.elapsed() < fresh);
            idle.pop().map(|(s, _)| s)
        };
        let reused = idle.is_some();
        let mut sender = match idle {
            Some(s) => s,
            None => {
                TcpSender::connect(self.data, &self.layout, self.opts, self.dial(), self.lease)
                    .await?
            }
        };
        let sent = match sender.send(room, pages, trailer).await {
            Ok(sent) => sent,
            // An idle connection the home closed meanwhile: once more on a fresh one
            // (pages land by index, so sending one again writes the same bytes). Had the
            // home committed before the link broke, the retry's pages and commit find the
            // room no longer transferring and are refused: the request fails cleanly,
            // nothing lands twice.
            Err(TransferError::Io { .. }) if reused => {
                sender =
                    TcpSender::connect(self.data, &self.layout, self.opts, self.dial(), self.lease)
                        .await?;
                sender.send(room, pages, trailer).await?
            }
            Err(e) => return Err(e),
        };
        self.senders
            .lock()
            .expect("senders lock")
            .push((sender, Instant::now()));
        Ok(sent)
    }
}

#[cfg(test)]
mod tests;

//! The worker side of `pdmesh.cache.v1`: register with a layout, keep the lease alive,
//! find pages, load them (verifying each checksum) and store new ones, over either data
//! plane. Page bytes always have the device pool's page format for the registered layout.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pb::cache_client::CacheClient;
use pdmesh_kv::KvLayout;
use pdmesh_proto::cache::v1 as pb;

use crate::Lease;
use crate::mirror::Mirror;
use crate::wire::layout_to_pb;

/// How page bytes travel between a worker and the mirror.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DataPlane {
    /// Map the mirror file and copy pages directly (same host).
    Shm,
    /// Page bytes in gRPC messages.
    Grpc,
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cache service: {0}")]
    Rpc(#[from] tonic::Status),
    #[error("connecting to the cache service: {0}")]
    Connect(#[from] tonic::transport::Error),
    #[error("mapping the host mirror: {0}")]
    Map(#[from] std::io::Error),
    #[error("the cache service sent {got} bytes for a {want}-byte page")]
    WrongSize { want: usize, got: usize },
    #[error("the cache service sent a malformed lease: {0}")]
    BadLease(#[from] crate::BadLease),
}

impl ClientError {
    /// The gRPC code of the cache service's answer; UNAVAILABLE when it could not be
    /// reached, INTERNAL when what it sent makes no sense.
    pub fn code(&self) -> tonic::Code {
        match self {
            Self::Rpc(s) => s.code(),
            Self::Connect(_) | Self::Map(_) => tonic::Code::Unavailable,
            Self::WrongSize { .. } | Self::BadLease(_) => tonic::Code::Internal,
        }
    }
}

/// Where a room lives and what its receiver holds (see `RoomOpenRequest`).
#[derive(Clone, Copy, Debug, Default)]
pub struct RoomOpen<'a> {
    /// The receiver's host's cache service, when it is not this one (senders only).
    pub home: &'a str,
    /// Leading prompt pages the receiver holds already (receivers only).
    pub held_pages: u32,
}

/// A page the mirror holds, pinned for this worker until loaded.
pub type PageRef = pb::PageRef;

/// What [`HostClient::load_into`] verified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loaded {
    /// Leading pages copied and verified.
    pub pages: usize,
    /// The first page whose bytes did not match its checksum (the rest were not used).
    pub corrupt: Option<Corrupt>,
}

/// A page that failed its checksum on load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Corrupt {
    pub hash: u64,
    pub slot: u32,
    /// The checksum the mirror recorded when the page was stored, and the one of the
    /// bytes read now.
    pub expected: u64,
    pub found: u64,
}

impl Corrupt {
    fn of(p: &PageRef, found: u64) -> Self {
        Self {
            hash: p.hash,
            slot: p.slot,
            expected: p.checksum,
            found,
        }
    }
}

/// What [`HostClient::store`] did with the pages it was given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stored {
    pub written: usize,
    /// Already in the mirror, or no room.
    pub skipped: usize,
    /// Refused by the service's checksum check.
    pub rejected: usize,
}

/// A registered worker's connection to the cache service.
pub struct HostClient {
    rpc: CacheClient<pdmesh_tls::AuthChannel>,
    lease: Lease,
    plane: DataPlane,
    page_bytes: usize,
    mirror: Option<Arc<Mirror>>,
    alive: Arc<AtomicBool>,
    heartbeat: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for HostClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostClient")
            .field("lease", &self.lease)
            .field("plane", &self.plane)
            .finish()
    }
}

impl Drop for HostClient {
    fn drop(&mut self) {
        self.heartbeat.abort();
    }
}

impl HostClient {
    /// Registers `worker_id`, serving `model` (its name and weights digest, or empty),
    /// with `layout` at `endpoint` (e.g. `http://127.0.0.1:50063`) with the mesh
    /// credential `auth`, and starts heartbeating. A service holding another layout or
    /// model answers FAILED_PRECONDITION with both in the message.
    pub async fn connect(
        endpoint: &str,
        (worker_id, model): (&str, &str),
        layout: &KvLayout,
        plane: DataPlane,
        auth: &pdmesh_tls::MeshAuth,
    ) -> Result<Self, ClientError> {
        let channel = auth.connect(endpoint).await?;
        let mut rpc = CacheClient::new(channel).max_decoding_message_size(usize::MAX);
        let reg = rpc
            .register(pb::RegisterRequest {
                worker_id: worker_id.to_owned(),
                model: model.to_owned(),
                layout: Some(layout_to_pb(layout)),
                data_plane: match plane {
                    DataPlane::Shm => pb::DataPlane::Shm,
                    DataPlane::Grpc => pb::DataPlane::Grpc,
                }
                .into(),
            })
            .await?
            .into_inner();
        let lease = Lease::from_wire(&reg.lease)?;
        let page_bytes = reg.page_bytes as usize;
        if page_bytes != layout.bytes_per_page() {
            return Err(ClientError::WrongSize {
                want: layout.bytes_per_page(),
                got: page_bytes,
            });
        }
        let mirror = match plane {
            DataPlane::Shm => Some(Arc::new(Mirror::open(
                Path::new(&reg.shm_path),
                page_bytes,
                reg.total_pages as usize,
            )?)),
            DataPlane::Grpc => None,
        };
        let alive = Arc::new(AtomicBool::new(true));
        let heartbeat = {
            let (mut rpc, alive) = (rpc.clone(), alive.clone());
            let every = Duration::from_millis(u64::from(reg.lease_ttl_ms) / 3)
                .max(Duration::from_millis(1));
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tick.tick().await;
                    if let Err(s) = rpc
                        .heartbeat(pb::HeartbeatRequest {
                            lease: lease.to_wire(),
                        })
                        .await
                        && s.code() == tonic::Code::NotFound
                    {
                        tracing::warn!(%lease, "cache lease expired");
                        alive.store(false, Ordering::Relaxed);
                        return;
                    }
                }
            })
        };
        Ok(Self {
            rpc,
            lease,
            plane,
            page_bytes,
            mirror,
            alive,
            heartbeat,
        })
    }

    pub fn lease(&self) -> Lease {
        self.lease
    }

    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// The mapped mirror (shm data plane only).
    pub fn mirror(&self) -> Option<&Mirror> {
        self.mirror.as_deref()
    }

    /// The mapped mirror, to copy pages on another thread (shm data plane only).
    pub fn shared_mirror(&self) -> Option<Arc<Mirror>> {
        self.mirror.clone()
    }

    /// False once the service said the lease expired: register again.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Relaxed)
    }

    /// The leading pages of `hashes` the mirror holds, pinned until [`Self::load_into`]
    /// or [`Self::release`].
    pub async fn match_pages(&mut self, hashes: &[u64]) -> Result<Vec<PageRef>, ClientError> {
        if hashes.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self
            .rpc
            .r#match(pb::MatchRequest {
                lease: self.lease.to_wire(),
                hashes: hashes.to_vec(),
            })
            .await?
            .into_inner()
            .pages)
    }

    /// Copies `pages` into `dsts` (one page-sized buffer each), checking every copy's
    /// checksum; stops at the first mismatch. Releases every pin of `pages` either way,
    /// and asks the service to discard a corrupt page so it is stored afresh.
    pub async fn load_into(
        &mut self,
        pages: &[PageRef],
        dsts: &mut [&mut [u8]],
    ) -> Result<Loaded, ClientError> {
        assert_eq!(pages.len(), dsts.len());
        let result = self.copy_verified(pages, dsts).await;
        let slots: Vec<u32> = pages.iter().map(|p| p.slot).collect();
        self.release(&slots).await?;
        if let Ok(Loaded {
            pages: good,
            corrupt: Some(_),
        }) = result
        {
            self.rpc
                .discard(pb::DiscardRequest {
                    lease: self.lease.to_wire(),
                    hashes: vec![pages[good].hash],
                })
                .await?;
        }
        result
    }

    async fn copy_verified(
        &mut self,
        pages: &[PageRef],
        dsts: &mut [&mut [u8]],
    ) -> Result<Loaded, ClientError> {
        match (self.mirror.as_deref(), self.plane) {
            (Some(m), DataPlane::Shm) => {
                // Pages are independent: copy and check them on several threads, each in
                // one pass that hashes the bytes as it copies them.
                let threads = std::thread::available_parallelism()
                    .map_or(1, |n| n.get())
                    .min(pages.len().div_ceil(4))
                    .max(1);
                let per = pages.len().div_ceil(threads);
                let found: Vec<u64> = std::thread::scope(|s| {
                    let jobs: Vec<_> = pages
                        .chunks(per)
                        .zip(dsts.chunks_mut(per))
                        .map(|(ps, ds)| {
                            s.spawn(move || {
                                ps.iter()
                                    .zip(ds.iter_mut())
                                    .map(|(p, d)| m.read_checked(p.slot, d))
                                    .collect::<Vec<u64>>()
                            })
                        })
                        .collect();
                    jobs.into_iter()
                        .flat_map(|j| j.join().expect("a page copy panicked"))
                        .collect()
                });
                if let Some(i) = pages.iter().zip(&found).position(|(p, &f)| f != p.checksum) {
                    return Ok(Loaded {
                        pages: i,
                        corrupt: Some(Corrupt::of(&pages[i], found[i])),
                    });
                }
            }
            _ => {
                if pages.is_empty() {
                    return Ok(Loaded {
                        pages: 0,
                        corrupt: None,
                    });
                }
                let mut stream = self
                    .rpc
                    .load(pb::LoadRequest {
                        lease: self.lease.to_wire(),
                        slots: pages.iter().map(|p| p.slot).collect(),
                    })
                    .await?
                    .into_inner();
                for (i, (p, d)) in pages.iter().zip(dsts.iter_mut()).enumerate() {
                    let msg = stream
                        .message()
                        .await?
                        .ok_or_else(|| tonic::Status::data_loss("the page stream ended early"))?;
                    if msg.data.len() != d.len() {
                        return Err(ClientError::WrongSize {
                            want: d.len(),
                            got: msg.data.len(),
                        });
                    }
                    d.copy_from_slice(&msg.data);
                    let found = pdmesh_kv::page_checksum(d);
                    if msg.slot != p.slot || found != p.checksum {
                        return Ok(Loaded {
                            pages: i,
                            corrupt: Some(Corrupt::of(p, found)),
                        });
                    }
                }
            }
        }
        Ok(Loaded {
            pages: pages.len(),
            corrupt: None,
        })
    }

    /// Drops pins taken by [`Self::match_pages`].
    pub async fn release(&mut self, slots: &[u32]) -> Result<(), ClientError> {
        if slots.is_empty() {
            return Ok(());
        }
        self.rpc
            .release(pb::ReleaseRequest {
                lease: self.lease.to_wire(),
                slots: slots.to_vec(),
            })
            .await?;
        Ok(())
    }

    /// Writes pages into the mirror: `(hash, parent hash, bytes)` each, in prefix order.
    /// Pages the mirror already holds are skipped, as are pages it has no room for.
    pub async fn store(&mut self, pages: &[(u64, u64, &[u8])]) -> Result<Stored, ClientError> {
        if pages.is_empty() {
            return Ok(Stored::default());
        }
        for (_, _, d) in pages {
            if d.len() != self.page_bytes {
                return Err(ClientError::WrongSize {
                    want: self.page_bytes,
                    got: d.len(),
                });
            }
        }
        let grants = self
            .rpc
            .reserve(pb::ReserveRequest {
                lease: self.lease.to_wire(),
                hashes: pages.iter().map(|p| p.0).collect(),
            })
            .await?
            .into_inner()
            .grants;
        let mut commit = Vec::with_capacity(grants.len());
        for g in &grants {
            let &(hash, parent, bytes) = pages
                .iter()
                .find(|p| p.0 == g.hash)
                .ok_or_else(|| tonic::Status::internal("a grant for a page not asked for"))?;
            let (data, checksum) = match (self.mirror.as_deref(), self.plane) {
                (Some(m), DataPlane::Shm) => (Vec::new(), m.write_checked(g.slot, bytes)),
                _ => (bytes.to_vec(), pdmesh_kv::page_checksum(bytes)),
            };
            commit.push(pb::CommitPage {
                hash,
                slot: g.slot,
                checksum,
                data,
                parent_hash: parent,
            });
        }
        let rejected = self
            .rpc
            .commit(pb::CommitRequest {
                lease: self.lease.to_wire(),
                pages: commit,
            })
            .await?
            .into_inner()
            .rejected_slots
            .len();
        Ok(Stored {
            written: grants.len() - rejected,
            skipped: pages.len() - grants.len(),
            rejected,
        })
    }
}

/// Room calls (prefill/decode disaggregation). They take `&self`, so many requests' rooms
/// proceed at once over one connection; each names this client's lease and carries the
/// current span's trace context.
impl HostClient {
    pub async fn room_open(
        &self,
        room: u64,
        side: pb::RoomSide,
        request_id: &str,
        trace_id: &str,
    ) -> Result<pb::RoomStatus, ClientError> {
        self.room_open_with(room, side, request_id, trace_id, RoomOpen::default())
            .await
    }

    /// [`Self::room_open`] with a room on another host (a sender's `home`) or the pages a
    /// receiver holds already.
    pub async fn room_open_with(
        &self,
        room: u64,
        side: pb::RoomSide,
        request_id: &str,
        trace_id: &str,
        how: RoomOpen<'_>,
    ) -> Result<pb::RoomStatus, ClientError> {
        let r = self
            .rpc
            .clone()
            .room_open(pdmesh_telemetry::request(pb::RoomOpenRequest {
                lease: self.lease.to_wire(),
                room,
                side: side.into(),
                request_id: request_id.to_owned(),
                trace_id: trace_id.to_owned(),
                home: how.home.to_owned(),
                held_pages: how.held_pages,
            }))
            .await;
        match r {
            Ok(r) => Ok(r.into_inner()),
            // A room open names no room the service must know (it makes it), so NOT_FOUND
            // is this client's lease, gone before the next heartbeat could tell (the
            // service was paused past the lease's time, or restarted): register again now,
            // so the next request waits for the new lease instead of meeting the same
            // refusal.
            Err(s) => {
                if s.code() == tonic::Code::NotFound {
                    tracing::warn!(lease = %self.lease, "cache lease expired");
                    self.alive.store(false, Ordering::Relaxed);
                }
                Err(s.into())
            }
        }
    }

    /// Waits up to `timeout` for `room` to reach `until` (or fail).
    pub async fn room_wait(
        &self,
        room: u64,
        until: pb::RoomState,
        timeout: Duration,
    ) -> Result<pb::RoomStatus, ClientError> {
        Ok(self
            .rpc
            .clone()
            .room_wait(pdmesh_telemetry::request(pb::RoomWaitRequest {
                lease: self.lease.to_wire(),
                room,
                until: until.into(),
                timeout_ms: timeout.as_millis().min(u128::from(u32::MAX)) as u32,
            }))
            .await?
            .into_inner())
    }

    pub async fn room_start(&self, room: u64, pages: u32) -> Result<Vec<u32>, ClientError> {
        Ok(self
            .rpc
            .clone()
            .room_start(pdmesh_telemetry::request(pb::RoomStartRequest {
                lease: self.lease.to_wire(),
                room,
                pages,
            }))
            .await?
            .into_inner()
            .slots)
    }

    pub async fn room_commit(
        &self,
        room: u64,
        pages: Vec<pb::RoomPage>,
        aux: pb::RoomAux,
    ) -> Result<(), ClientError> {
        self.rpc
            .clone()
            .room_commit(pdmesh_telemetry::request(pb::RoomCommitRequest {
                lease: self.lease.to_wire(),
                room,
                pages,
                aux: Some(aux),
            }))
            .await?;
        Ok(())
    }

    pub async fn room_result(&self, room: u64) -> Result<pb::RoomResultResponse, ClientError> {
        Ok(self
            .rpc
            .clone()
            .room_result(pdmesh_telemetry::request(pb::RoomRef {
                lease: self.lease.to_wire(),
                room,
            }))
            .await?
            .into_inner())
    }

    pub async fn room_finish(&self, room: u64) -> Result<(), ClientError> {
        self.rpc
            .clone()
            .room_finish(pdmesh_telemetry::request(pb::RoomRef {
                lease: self.lease.to_wire(),
                room,
            }))
            .await?;
        Ok(())
    }

    pub async fn room_abort(&self, room: u64, reason: &str) -> Result<(), ClientError> {
        self.rpc
            .clone()
            .room_abort(pdmesh_telemetry::request(pb::RoomAbortRequest {
                lease: self.lease.to_wire(),
                room,
                reason: reason.to_owned(),
            }))
            .await?;
        Ok(())
    }
}

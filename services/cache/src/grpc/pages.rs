//! The worker's page calls (register, heartbeat, match, reserve, commit, load, release,
//! discard) and the stream of KV events they produce.

use std::time::Instant;

use pdmesh_proto::cache::v1 as pb;
use tokio_stream::StreamExt as _;
use tonic::{Request, Response, Status};

use super::{CacheService, EventStream, PageStream, lease_of};
use crate::state::CacheError;
use crate::state::index::CommitPage;
use pdmesh_cache_client::wire::layout_from_pb;

impl CacheService {
    pub(super) async fn on_register(
        &self,
        request: Request<pb::RegisterRequest>,
    ) -> Result<Response<pb::RegisterResponse>, Status> {
        let caller = pdmesh_tls::Caller::of(&request);
        let r = request.into_inner();
        if r.data_plane == pb::DataPlane::Peer as i32 {
            caller.require(pdmesh_tls::Roles::CACHE, "Register as a peer cache service")?;
        }
        let layout = r
            .layout
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("layout is required"))
            .and_then(|l| layout_from_pb(l).map_err(|e| CacheError::BadLayout(e).into()))?;
        if r.worker_id.is_empty() {
            return Err(Status::invalid_argument("worker_id is required"));
        }
        let reg = if r.data_plane == pb::DataPlane::Peer as i32 {
            self.shared
                .with(|s| s.register_peer(&r.worker_id, &layout, Instant::now()))?
        } else {
            self.shared.with(|s| {
                if s.layout()
                    .is_none_or(|l| l.fingerprint() == layout.fingerprint())
                {
                    s.check_model(&r.model)?;
                }
                let reg = s.register(&r.worker_id, layout, Instant::now())?;
                s.start_disk();
                Ok::<_, CacheError>(reg)
            })?
        };
        Ok(Response::new(pb::RegisterResponse {
            lease: reg.lease.to_wire(),
            lease_ttl_ms: reg.lease_ttl.as_millis() as u32,
            shm_path: reg.shm_path.to_string_lossy().into_owned(),
            page_bytes: reg.page_bytes as u64,
            total_pages: reg.total_pages as u32,
            layout_fingerprint: reg.layout.fingerprint_hex(),
            peer_port: u32::from(self.peer_port),
        }))
    }

    pub(super) async fn on_heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let lease = lease_of(&request.into_inner().lease)?;
        self.shared.with(|s| s.heartbeat(lease, Instant::now()))?;
        Ok(Response::new(pb::HeartbeatResponse {}))
    }

    pub(super) async fn on_match(
        &self,
        request: Request<pb::MatchRequest>,
    ) -> Result<Response<pb::MatchResponse>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        let (mut pages, plan) = self.shared.with(|s| {
            let pages = s.match_pages(lease, &r.hashes)?;
            let plan = s.plan_promotion(&r.hashes[pages.len()..], Instant::now());
            Ok::<_, CacheError>((pages, plan))
        })?;
        if !plan.is_empty() {
            let more = self.promote(lease, &r.hashes[pages.len()..], plan).await?;
            pages.extend(more);
        }
        Ok(Response::new(pb::MatchResponse {
            pages: pages
                .into_iter()
                .map(|p| pb::PageRef {
                    hash: p.hash,
                    slot: p.slot,
                    checksum: p.checksum,
                })
                .collect(),
        }))
    }

    /// Promotes `plan`'s pages from the disk tier (each read on its own, so later pages
    /// load while earlier ones do), waits for them and those other matches are promoting
    /// until they are all in or the promotion deadline passes, then pins the leading run
    /// of `rest` now resident. A page not in by the deadline is a miss; its promotion
    /// goes on and serves a later match.
    async fn promote(
        &self,
        lease: pdmesh_cache_client::Lease,
        rest: &[u64],
        plan: crate::state::disk::Promotion,
    ) -> Result<Vec<crate::state::index::PageRef>, Status> {
        let Some(disk) = self.shared.with(|s| s.disk().cloned()) else {
            return Ok(Vec::new());
        };
        let deadline = tokio::time::Instant::now() + self.promote_timeout;
        let mut waiting: Vec<u64> = plan.wait;
        let mut changed = self.shared.promotions.subscribe();
        for (hash, slot) in plan.start {
            waiting.push(hash);
            let (shared, disk) = (self.shared.clone(), disk.clone());
            tokio::spawn(async move {
                let page = disk.load(hash).await;
                shared.with(|s| s.promoted(hash, slot, page, Instant::now()));
                shared.promotions.send_modify(|v| *v += 1);
            });
        }
        loop {
            changed.borrow_and_update();
            if self.shared.with(|s| s.still_promoting(&waiting)) == 0 {
                break;
            }
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                disk.late(self.shared.with(|s| s.still_promoting(&waiting)));
                break;
            }
        }
        let more = self.shared.with(|s| s.match_pages(lease, rest))?;
        disk.hits(more.len());
        Ok(more)
    }

    pub(super) async fn on_reserve(
        &self,
        request: Request<pb::ReserveRequest>,
    ) -> Result<Response<pb::ReserveResponse>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        let grants = self.shared.with(|s| s.reserve(lease, &r.hashes))?;
        Ok(Response::new(pb::ReserveResponse {
            grants: grants
                .into_iter()
                .map(|(hash, slot)| pb::Grant { hash, slot })
                .collect(),
        }))
    }

    pub(super) async fn on_commit(
        &self,
        request: Request<pb::CommitRequest>,
    ) -> Result<Response<pb::CommitResponse>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        let pages = r
            .pages
            .into_iter()
            .map(|p| CommitPage {
                hash: p.hash,
                slot: p.slot,
                checksum: p.checksum,
                data: (!p.data.is_empty()).then_some(p.data),
                parent: p.parent_hash,
            })
            .collect();
        let rejected = self.shared.with(|s| s.commit(lease, pages))?;
        Ok(Response::new(pb::CommitResponse {
            rejected_slots: rejected,
        }))
    }

    pub(super) async fn on_load(
        &self,
        request: Request<pb::LoadRequest>,
    ) -> Result<Response<PageStream>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        let (checksums, mirror) = self.shared.with(|s| {
            let sums = s.check_pinned(lease, &r.slots)?;
            Ok::<_, CacheError>((sums, s.mirror().expect("a lease implies a mirror")))
        })?;
        // Pinned pages cannot be evicted or rewritten while the lease holds them, so their
        // bytes are read outside the lock, one page per message.
        let pages = r
            .slots
            .into_iter()
            .zip(checksums)
            .map(move |(slot, checksum)| {
                let mut data = vec![0u8; mirror.page_bytes()];
                mirror.read(slot, &mut data);
                Ok(pb::PageData {
                    slot,
                    checksum,
                    data,
                })
            });
        Ok(Response::new(Box::pin(tokio_stream::iter(pages))))
    }

    pub(super) async fn on_release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        self.shared.with(|s| s.release(lease, &r.slots))?;
        Ok(Response::new(pb::ReleaseResponse {}))
    }

    pub(super) async fn on_discard(
        &self,
        request: Request<pb::DiscardRequest>,
    ) -> Result<Response<pb::DiscardResponse>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        let n = self.shared.with(|s| s.discard(lease, &r.hashes))?;
        Ok(Response::new(pb::DiscardResponse {
            discarded: n as u32,
        }))
    }

    pub(super) async fn on_subscribe_events(
        &self,
        _request: Request<pb::SubscribeEventsRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let rx = self.shared.events.subscribe();
        let stream = tokio_stream::wrappers::BroadcastStream::new(rx).map(|e| {
            e.map_err(|lag| Status::data_loss(format!("event stream fell behind: {lag}")))
        });
        let stream =
            futures::StreamExt::take_until(stream, self.shutdown.clone().cancelled_owned());
        Ok(Response::new(Box::pin(stream)))
    }
}

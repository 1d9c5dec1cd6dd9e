//! The room calls of rooms whose home is this host, from its workers or from peer hosts
//! (a peer's commit rides on its last batch of pages); relayed rooms go to `relay.rs`.

use std::time::Instant;

use pdmesh_cache_client::Lease;
use pdmesh_proto::cache::v1 as pb;
use prost::Message as _;
use tonic::{Request, Response, Status};

use super::convert::{Held, aux_from_pb, aux_to_pb, pages_from_pb, room_state_from_pb, status};
use super::{CacheService, Shared, lease_of};
use crate::rooms::{RoomError, RoomState, Side};
use crate::state::CacheError;

impl CacheService {
    pub(super) async fn on_room_open(
        &self,
        request: Request<pb::RoomOpenRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        let side = match pb::RoomSide::try_from(r.side) {
            Ok(pb::RoomSide::Sender) => Side::Sender,
            Ok(pb::RoomSide::Receiver) => Side::Receiver,
            _ => return Err(Status::invalid_argument("side must be SENDER or RECEIVER")),
        };
        let span = traced(r.room, None);
        span.record("pdmesh.request_id", r.request_id.as_str());
        if !r.home.is_empty() {
            return self.relayed_open(lease, side, &r).await;
        }
        let (st, held) = self.shared.with(|s| {
            let st = s.room_open(
                lease,
                r.room,
                side,
                (&r.request_id, &r.trace_id),
                r.held_pages,
                Instant::now(),
            )?;
            Ok::<_, CacheError>((st, s.room_held(r.room)))
        })?;
        traced(r.room, Some(st));
        Ok(Response::new(status(st, None).held(held)))
    }

    pub(super) async fn on_room_wait(
        &self,
        request: Request<pb::RoomWaitRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        let until = room_state_from_pb(r.until)
            .ok_or_else(|| Status::invalid_argument("until must be a room state"))?;
        if let Some(link) = self.relay(r.room).await? {
            self.shared.with(|s| s.heartbeat(lease, Instant::now()))?;
            let st = link.room_wait(r.room, r.until, r.timeout_ms).await;
            if let Ok(st) = &st
                && st.state == pb::RoomState::Failed as i32
            {
                self.shared.with(|s| s.relay_end(r.room, true));
            }
            return st.map(Response::new).map_err(Status::from);
        }
        // Long polls are bounded so a vanished caller never holds a task for long.
        let deadline = tokio::time::Instant::now()
            + std::time::Duration::from_millis(u64::from(r.timeout_ms.min(60_000)));
        let mut changed = self.shared.rooms.subscribe();
        loop {
            let (now, held) = self.shared.with(|s| {
                s.heartbeat(lease, Instant::now())?;
                Ok::<_, CacheError>((s.room_state(r.room), s.room_held(r.room)))
            })?;
            let Some((st, why)) = now else {
                return Err(CacheError::Room(RoomError::Unknown(r.room)).into());
            };
            // The state the wait ends in: a room stuck in a state shows up as waits
            // ending in it.
            traced(r.room, Some(st));
            if st == RoomState::Failed || st as i32 >= until as i32 {
                return Ok(Response::new(status(st, why).held(held)));
            }
            tokio::select! {
                c = changed.changed() => if c.is_err() {
                    return Err(Status::unavailable("the cache service is stopping"));
                },
                _ = tokio::time::sleep_until(deadline) => {
                    return Ok(Response::new(status(st, why).held(held)));
                }
                _ = self.shutdown.cancelled() => {
                    return Err(Status::unavailable("the cache service is stopping"));
                }
            }
        }
    }

    pub(super) async fn on_room_start(
        &self,
        request: Request<pb::RoomStartRequest>,
    ) -> Result<Response<pb::RoomStartResponse>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        traced(r.room, None);
        if let Some(link) = self.relay(r.room).await? {
            // Slots here first: a full mirror here leaves the home's room waiting.
            let slots = self
                .shared
                .with(|s| s.relay_take_slots(lease, r.room, r.pages as usize))?;
            let remote = link.room_start(r.room, r.pages).await;
            return match remote {
                Ok(remote) if remote.len() == slots.len() => {
                    if self
                        .shared
                        .with(|s| s.relay_started(r.room, slots.clone(), remote, Instant::now()))
                    {
                        traced(r.room, Some(RoomState::Transferring));
                        Ok(Response::new(pb::RoomStartResponse { slots }))
                    } else {
                        Err(CacheError::Room(RoomError::Unknown(r.room)).into())
                    }
                }
                Ok(remote) => {
                    self.shared.with(|s| s.relay_unstart(&slots));
                    let msg = format!(
                        "the room's home granted {} slots for {} pages",
                        remote.len(),
                        slots.len()
                    );
                    self.end_relay(Some(link), r.room, true, msg.clone());
                    Err(Status::internal(msg))
                }
                Err(e) => {
                    self.shared.with(|s| s.relay_unstart(&slots));
                    Err(e.into())
                }
            };
        }
        let slots = self
            .shared
            .with(|s| s.room_start(lease, r.room, r.pages as usize, Instant::now()))?;
        traced(r.room, Some(RoomState::Transferring));
        Ok(Response::new(pb::RoomStartResponse { slots }))
    }

    pub(super) async fn on_room_commit(
        &self,
        request: Request<pb::RoomCommitRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        if r.aux.as_ref().is_none_or(|a| a.room != r.room) {
            return Err(Status::invalid_argument(
                "aux is required and must name the room",
            ));
        }
        if let Some(link) = self.relay(r.room).await? {
            return self.relayed_commit(link, lease, r).await;
        }
        Ok(Response::new(commit_here(&self.shared, r)?))
    }

    pub(super) async fn on_room_result(
        &self,
        request: Request<pb::RoomRef>,
    ) -> Result<Response<pb::RoomResultResponse>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        traced(r.room, None);
        self.not_relayed(r.room)?;
        let (pages, aux) = self.shared.with(|s| s.room_result(lease, r.room))?;
        Ok(Response::new(pb::RoomResultResponse {
            pages: pages
                .into_iter()
                .map(|p| pb::RoomPage {
                    slot: p.slot,
                    checksum: p.checksum,
                })
                .collect(),
            aux: Some(aux_to_pb(aux)),
        }))
    }

    pub(super) async fn on_room_finish(
        &self,
        request: Request<pb::RoomRef>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        traced(r.room, None);
        self.not_relayed(r.room)?;
        self.shared.with(|s| s.room_finish(lease, r.room))?;
        Ok(Response::new(status(RoomState::Success, None)))
    }

    pub(super) async fn on_room_abort(
        &self,
        request: Request<pb::RoomAbortRequest>,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let r = request.into_inner();
        let lease = lease_of(&r.lease)?;
        traced(r.room, Some(RoomState::Failed));
        let reason = if r.reason.is_empty() {
            "no reason given"
        } else {
            &r.reason
        };
        let relayed = self.shared.with(|s| {
            s.relay_home(r.room).map(str::to_owned).or_else(|| {
                // A relayed room that failed here already: its sender is done now.
                s.relay_sender_done(lease, r.room, false);
                None
            })
        });
        if let Some(home) = relayed {
            let mine = self.shared.with(|s| s.relay_owner(r.room) == Some(lease));
            if !mine {
                return Err(Status::permission_denied(format!(
                    "this lease is not the sender of room {}",
                    r.room
                )));
            }
            let link = self.peers.existing(&home).await;
            self.end_relay(link, r.room, true, format!("aborted: {reason}"));
            return Ok(Response::new(status(
                RoomState::Failed,
                Some(reason.to_owned()),
            )));
        }
        let st = self.shared.with(|s| {
            s.room_abort(lease, r.room, reason, Instant::now())?;
            Ok::<_, CacheError>(s.room_state(r.room))
        })?;
        let (st, why) = st.unwrap_or((RoomState::Failed, None));
        Ok(Response::new(status(st, why)))
    }

    fn not_relayed(&self, room: u64) -> Result<(), CacheError> {
        match self.shared.with(|s| s.relay_home(room).is_some()) {
            true => Err(CacheError::BadRoomCall(format!(
                "room {room} lives on another host: its receiver takes its pages there"
            ))),
            false => Ok(()),
        }
    }
}

/// Commits a room whose home is this host (from a worker here, or from a peer host).
fn commit_here(shared: &Shared, r: pb::RoomCommitRequest) -> Result<pb::RoomStatus, Status> {
    let aux = r
        .aux
        .ok_or_else(|| Status::invalid_argument("aux is required"))?;
    if aux.room != r.room {
        return Err(Status::invalid_argument("aux must name the room"));
    }
    let pages = pages_from_pb(&r.pages);
    let aux = aux_from_pb(aux);
    traced(r.room, None);
    let lease = lease_of(&r.lease)?;
    shared.with(|s| s.room_commit(lease, r.room, pages, aux, Instant::now()))?;
    traced(r.room, Some(RoomState::Success));
    Ok(status(RoomState::Success, None))
}

/// The page transport's trailer at a room's home: a peer's commit of `room` (an encoded
/// RoomCommitRequest), run once its last pages landed. The reply is an encoded
/// PeerCommitReply.
/// The commit riding on a peer's last batch for `room`, over the connection of `sender`'s
/// lease: only that lease may commit with it.
pub(crate) fn peer_commit(shared: &Shared, room: u64, sender: Lease, trailer: &[u8]) -> Vec<u8> {
    let done = match pb::RoomCommitRequest::decode(trailer) {
        Err(e) => Err(Status::invalid_argument(format!(
            "a room commit that does not decode: {e}"
        ))),
        Ok(r) if r.room != room => Err(Status::invalid_argument(format!(
            "a commit of room {} after the pages of room {room}",
            r.room
        ))),
        // The page transport carries peers' rooms only: a local worker's lease is not
        // one a peer may commit with.
        Ok(r) if Lease::from_wire(&r.lease).is_ok_and(|l| !shared.with(|s| s.is_peer_lease(l))) => {
            Err(Status::permission_denied(
                "this lease is not a peer host's".to_owned(),
            ))
        }
        Ok(r) if Lease::from_wire(&r.lease).is_ok_and(|l| l != sender) => {
            Err(Status::permission_denied(
                "a commit with another lease than this connection's".to_owned(),
            ))
        }
        Ok(r) => commit_here(shared, r),
    };
    let reply = match done {
        Ok(st) => pb::PeerCommitReply {
            code: 0,
            message: String::new(),
            status: Some(st),
        },
        Err(e) => {
            tracing::warn!(room, code = ?e.code(), error = %e.message(), "a peer's room commit refused");
            pb::PeerCommitReply {
                code: e.code() as i32,
                message: e.message().to_owned(),
                status: None,
            }
        }
    };
    reply.encode_to_vec()
}

/// Records a room call's room (and the state it leaves the room in) on the call's span,
/// which exists when the call carries trace context.
fn traced(room: u64, state: Option<RoomState>) -> tracing::Span {
    let span = tracing::Span::current();
    span.record("pdmesh.room", room);
    if let Some(st) = state {
        span.record("pdmesh.room.state", st.name());
    }
    span
}

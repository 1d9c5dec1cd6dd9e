//! Rooms relayed from here to their home on another host: the room calls forwarded over
//! this service's link there, and the pages sent over the page transport with the
//! commit riding on the last batch.

use std::sync::Arc;
use std::time::Instant;

use pdmesh_cache_client::Lease;
use pdmesh_cache_client::mirror::Mirror;
use pdmesh_proto::cache::v1 as pb;
use prost::Message as _;
use tonic::{Response, Status};

use super::CacheService;
use super::convert::pages_from_pb;
use crate::peers::{Link, PeerError};
use crate::rooms::{RoomError, RoomPage, Side};
use crate::state::CacheError;
use crate::transfer::Pages;

impl CacheService {
    /// The link to the home of relayed `room`, if it is relayed from here: the one the
    /// home opened the room for. The room lives there only as long as that link's lease;
    /// once the link registered again (the lease ran out, over a partition say), the room
    /// is gone at its home, and it fails here too.
    pub(super) async fn relay(&self, room: u64) -> Result<Option<Arc<Link>>, CacheError> {
        let Some((home, lease)) = self.shared.with(|s| {
            s.relay_link(room)
                .map(|(home, lease)| (home.to_owned(), lease))
        }) else {
            return Ok(None);
        };
        match self.peers.existing(&home).await {
            Some(link) if Some(link.lease) == lease => Ok(Some(link)),
            _ => {
                self.shared.with(|s| s.relay_end(room, true));
                let reason = format!(
                    "this host's link to the room's home {home} lost the lease the room was opened with"
                );
                Err(CacheError::Room(RoomError::Failed { room, reason }))
            }
        }
    }

    /// Ends relayed `room` here and tells its home (bounded, in the background).
    pub(super) fn end_relay(
        &self,
        link: Option<Arc<Link>>,
        room: u64,
        sender_done: bool,
        reason: String,
    ) {
        self.shared.with(|s| s.relay_end(room, sender_done));
        if let Some(link) = link {
            tokio::spawn(async move {
                if let Err(e) = link.room_abort(room, &reason).await {
                    tracing::debug!(room, error = %e, "telling the room's home it failed");
                }
            });
        }
    }

    /// Opens `room` for the sender `lease` at its home on another host, through this
    /// service's link there.
    pub(super) async fn relayed_open(
        &self,
        lease: Lease,
        side: Side,
        r: &pb::RoomOpenRequest,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        if side != Side::Sender {
            return Err(Status::invalid_argument(
                "only a sender names a room's home: a receiver opens it on its own host",
            ));
        }
        self.peers.admits(&r.home)?;
        let layout = self.shared.with(|s| {
            s.relay_open(lease, r.room, &r.home, Instant::now())?;
            Ok::<_, CacheError>(s.layout().cloned().expect("a lease implies a layout"))
        })?;
        let opened = async {
            let link = self.peers.link(&r.home, &layout).await?;
            match link.room_open(r.room, &r.request_id, &r.trace_id).await {
                // A room open names no room the home must know (it makes it): NOT_FOUND
                // is this host's lease there, which ran out while the hosts could not
                // reach each other, before a heartbeat could tell. Nothing was opened:
                // register again and open once more.
                Err(e) if e.code() == tonic::Code::NotFound => {
                    link.lost();
                    let link = self.peers.link(&r.home, &layout).await?;
                    let st = link.room_open(r.room, &r.request_id, &r.trace_id).await?;
                    Ok((link, st))
                }
                opened => opened.map(|st| (link, st)),
            }
        }
        .await;
        match opened {
            Ok((link, st)) => {
                self.shared.with(|s| {
                    if st.state == pb::RoomState::Failed as i32 {
                        s.relay_end(r.room, true);
                    } else {
                        s.relay_linked(r.room, link.lease);
                    }
                });
                Ok(Response::new(st))
            }
            Err(e) => {
                if e.code() == tonic::Code::FailedPrecondition {
                    tracing::warn!(room = r.room, home = %r.home, error = %e, "the room's home refused this host");
                }
                self.shared.with(|s| s.relay_end(r.room, true));
                // The home's NOT_FOUND names this host's lease there, never the
                // sender's here, which would take it for its own and register again.
                Err(match e.code() {
                    tonic::Code::NotFound => Status::unavailable(format!(
                        "the room's home does not know this host's link: {e}"
                    )),
                    _ => e.into(),
                })
            }
        }
    }

    pub(super) async fn relayed_commit(
        &self,
        link: Arc<Link>,
        lease: Lease,
        r: pb::RoomCommitRequest,
    ) -> Result<Response<pb::RoomStatus>, Status> {
        let room = r.room;
        let pages = pages_from_pb(&r.pages);
        let plan = match self.shared.with(|s| s.relay_commit(lease, room, &pages)) {
            Ok(p) => p,
            Err(e @ CacheError::Room(RoomError::Unknown(_))) => {
                // The relay failed here already: a late commit, refused.
                self.shared.with(|s| s.relay_sender_done(lease, room, true));
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        };
        let t0 = Instant::now();
        // The sender finished writing these slots; they stay ours until the relay ends,
        // and the transport copies each straight from the mirror into its frame.
        let out = MirrorPages {
            mirror: &plan.mirror,
            slots: &plan.slots,
            pages: &pages,
        };
        // The commit rides on the last batch: the home runs it once every page landed.
        let commit = pb::RoomCommitRequest {
            lease: link.lease.to_wire(),
            room,
            pages: plan
                .remote_slots
                .iter()
                .zip(&pages)
                .map(|(&slot, p)| pb::RoomPage {
                    slot,
                    checksum: p.checksum,
                })
                .collect(),
            aux: r.aux,
        }
        .encode_to_vec();
        let done = match link.send(room, &out, Some(&commit)).await {
            Err(e) => {
                if let crate::transfer::TransferError::LayoutRefused { peer, reason } = &e {
                    self.shared.with(|s| s.peer_layout_refused(peer, reason));
                }
                Err(PeerError::from(e))
            }
            Ok(sent) => peer_commit_result(&link.url, sent.reply.as_deref()).map(|st| (st, sent)),
        };
        match done {
            Ok((st, sent)) => {
                self.shared.with(|s| {
                    s.relay_end(room, true);
                    s.count_peer_sent(sent.pages, sent.bytes);
                });
                tracing::debug!(room, pages = sent.pages, bytes = sent.bytes, secs = t0.elapsed().as_secs_f64(), home = %link.url, "pages moved to the room's home");
                Ok(Response::new(st))
            }
            Err(e) => {
                self.shared.with(|s| s.count_peer_failure());
                tracing::warn!(room, home = %link.url, error = %e, "moving a room's pages to its home failed");
                let reason = format!("the sender's host could not move the pages: {e}");
                self.end_relay(Some(link), room, true, reason);
                Err(e.into())
            }
        }
    }
}

/// What a home's reply to a commit trailer says.
pub(super) fn peer_commit_result(
    home: &str,
    reply: Option<&[u8]>,
) -> Result<pb::RoomStatus, PeerError> {
    let garbled = |why: String| PeerError::Garbled {
        url: home.to_owned(),
        what: "a room commit",
        why,
    };
    let reply = reply
        .map(pb::PeerCommitReply::decode)
        .transpose()
        .map_err(|e| garbled(e.to_string()))?
        .unwrap_or_default();
    match (reply.code, reply.status) {
        (0, Some(st)) => Ok(st),
        (0, None) => Err(garbled("no status".into())),
        (code, _) => Err(PeerError::Answered {
            what: "room commit",
            url: home.to_owned(),
            status: Status::new(tonic::Code::from(code), reply.message),
        }),
    }
}

/// A relayed room's pages, read from the slots its sender wrote in this host's mirror.
struct MirrorPages<'a> {
    mirror: &'a Mirror,
    slots: &'a [u32],
    pages: &'a [RoomPage],
}

impl Pages for MirrorPages<'_> {
    fn count(&self) -> usize {
        self.slots.len()
    }
    fn meta(&self, i: usize) -> (u32, u64) {
        (i as u32, self.pages[i].checksum)
    }
    fn len_of(&self, _: usize) -> usize {
        self.mirror.page_bytes()
    }
    fn copy_to(&self, i: usize, dst: &mut [u8]) {
        self.mirror.read(self.slots[i], dst);
    }
}

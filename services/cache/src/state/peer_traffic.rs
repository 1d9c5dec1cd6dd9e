//! What other hosts' cache services send here: their pages written into rooms under the
//! lock, the layouts and pages refused on the way, and the traffic counted both ways.

use pdmesh_cache_client::Lease;

use super::State;
use crate::rooms::RoomState;

/// Why a page a peer host sent was refused (its text goes back to the sender).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PageRefused {
    #[error("room {room} is {state}{why}")]
    NotTransferring {
        room: u64,
        state: &'static str,
        /// `: ` and why the room failed, or empty.
        why: String,
    },
    #[error("room {0} does not exist")]
    NoRoom(u64),
    #[error("room {0}'s sender is not a peer host")]
    NotFromAPeer(u64),
    #[error("room {0} is sent by another peer than this connection's")]
    OtherSender(u64),
    #[error("room {room} has {pages} pages; page {index} is not one")]
    NoSuchPage { room: u64, pages: usize, index: u32 },
    #[error("a page is {want} bytes, got {got}")]
    WrongSize { want: usize, got: usize },
}

/// Traffic with other hosts' cache services, since the service started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerStats {
    /// Peers refused for another KV layout (registration or transport handshake).
    pub layout_refusals: u64,
    pub pages_received: u64,
    pub bytes_received: u64,
    pub pages_sent: u64,
    pub bytes_sent: u64,
    pub transfer_failures: u64,
    /// Pages receivers held already, so they did not travel.
    pub held_pages_skipped: u64,
}

impl State {
    /// Counts a peer refused for its layout in the page transport's handshake (by
    /// either side), and queues its report: the handshake carries the other side's
    /// layout as a description only, so the report quotes it beside this side's layout.
    pub fn peer_layout_refused(&mut self, peer: &str, reason: &str) {
        self.room_stats.peer.layout_refusals += 1;
        let mut i = pdmesh_incident::Incident::new(
            pdmesh_incident::Kind::LayoutRefused,
            format!(
                "The page transport between this host and {peer} refused the other side's KV \
                 layout: no room's pages cross between the two hosts. {reason}"
            ),
            pdmesh_incident::Place {
                worker: format!("peer {peer}"),
                ..Default::default()
            },
        );
        if let Some(ours) = &self.layout {
            i.details
                .insert("this host's layout".into(), crate::transfer::describe(ours));
        }
        i.details.insert("refusal".into(), reason.to_owned());
        self.incidents.push(i);
    }

    /// A page of a room that arrived from a peer's cache service with bytes not matching
    /// the checksum the peer sent it with: the batch was refused, so the sender's
    /// hand-over fails with DATA_LOSS.
    pub fn arrival_checksum_failed(&mut self, bad: crate::transfer::BadArrival<'_>) {
        let story = self.rooms.story(bad.room).unwrap_or_default();
        let mut i = pdmesh_incident::Incident::new(
            pdmesh_incident::Kind::Checksum,
            format!(
                "Page {} of room {} arrived from the cache service at {} with bytes that do not \
                 match the checksum it was sent with: they changed on the way (the network \
                 path, or the sender's memory after it checksummed them). Its batch was \
                 refused, so the page never landed here and the hand-over failed with \
                 DATA_LOSS.",
                bad.index, bad.room, bad.peer
            ),
            pdmesh_incident::Place {
                worker: format!("peer {}", bad.peer),
                stage: "page transport arrival".into(),
                room: Some(bad.room),
                request_id: story.request_id,
                trace_id: story.trace_id,
                ..Default::default()
            },
        );
        i.timeline = story
            .history
            .iter()
            .map(|(at, what)| pdmesh_incident::Step::new(*at, what.to_string()))
            .collect();
        i.pages.push(pdmesh_incident::PageCheck {
            page: format!("page {} of room {}", bad.index, bad.room),
            expected: format!("{:016x}", bad.expected),
            found: format!("{:016x}", bad.found),
        });
        self.incidents.push(i);
    }

    /// One page of a room from a peer, its checksum already verified by the transport:
    /// written into the room's `index`th slot if the room is transferring with a peer as
    /// its sender. Checked and written under the state lock, so a page that arrives after
    /// its room failed is refused and never lands in a slot someone else now uses.
    /// A page a peer host sent over the page transport for `room`, from the connection of
    /// `sender`'s lease: it lands only in a room that lease sends in.
    pub fn peer_write(
        &mut self,
        sender: Lease,
        room: u64,
        index: u32,
        bytes: &[u8],
    ) -> Result<(), PageRefused> {
        let refuse = |why: PageRefused| {
            tracing::warn!(room, index, "page from a peer refused: {why}");
            why
        };
        match self.rooms.state(room) {
            Some((RoomState::Transferring, _)) => {}
            Some((st, why)) => {
                self.room_stats.late_writes_rejected += 1;
                let why = why.map(|w| format!(": {w}")).unwrap_or_default();
                return Err(refuse(PageRefused::NotTransferring {
                    room,
                    state: st.name(),
                    why,
                }));
            }
            None => {
                self.room_stats.late_writes_rejected += 1;
                return Err(refuse(PageRefused::NoRoom(room)));
            }
        }
        let from_peer = self
            .rooms
            .sender(room)
            .and_then(|l| self.leases.get(&l))
            .is_some_and(|l| l.peer);
        if !from_peer {
            return Err(refuse(PageRefused::NotFromAPeer(room)));
        }
        if self.rooms.sender(room) != Some(sender) {
            return Err(refuse(PageRefused::OtherSender(room)));
        }
        let Some(&slot) = self.rooms.slots(room).get(index as usize) else {
            return Err(refuse(PageRefused::NoSuchPage {
                room,
                pages: self.rooms.slots(room).len(),
                index,
            }));
        };
        let mirror = self.mirror.as_ref().expect("a room implies a mirror");
        if bytes.len() != mirror.page_bytes() {
            return Err(refuse(PageRefused::WrongSize {
                want: mirror.page_bytes(),
                got: bytes.len(),
            }));
        }
        mirror.write(slot, bytes);
        *self.peer_pages.entry(room).or_default() += 1;
        self.room_stats.peer.pages_received += 1;
        self.room_stats.peer.bytes_received += bytes.len() as u64;
        Ok(())
    }

    /// Counts pages sent to a peer, or a failed transfer.
    pub fn count_peer_sent(&mut self, pages: u64, bytes: u64) {
        self.room_stats.peer.pages_sent += pages;
        self.room_stats.peer.bytes_sent += bytes;
    }

    pub fn count_peer_failure(&mut self) {
        self.room_stats.peer.transfer_failures += 1;
    }
}

//! Moving KV pages between hosts' cache services: the `tcp` transport.
//!
//! A connection starts with a layout handshake: the sender names its `KvLayout`
//! (fingerprint, page size in bytes, and a description with each component's bytes per
//! token); the receiver refuses another fingerprint, naming both layouts, so no page ever
//! crosses between different layouts. Then the sender streams batches of whole pages
//! (large frames, no per-page round trip), keeping up to `window` batches unacknowledged;
//! the receiver checks every page's checksum as it arrives, before its sink sees the page,
//! and acknowledges each batch. The last batch of a send may carry a trailer, bytes the
//! transport does not read: the receiver's sink gets it once every page of the batch has
//! landed and its reply comes back in the acknowledgement (the cache service commits the
//! room this way, with no round trip of its own after the pages). Every read and write has
//! a deadline, so a peer that stops reading, stops writing or vanishes fails the transfer
//! in bounded time instead of wedging it.
//!
//! A batch is built in one buffer and written in one go: each page is copied once, from
//! its source (the host mirror) into the frame, and the receiver reads whole runs of pages
//! straight into its buffer, so a byte is copied no more often than iperf3's are plus the
//! copy out of the mirror and into it.
//!
//! With the mesh's TLS on (`pdmesh_tls`), the connection is mutual TLS before the hello:
//! the receiver accepts only senders holding a certificate the mesh CA signed, and the
//! sender checks the receiver's certificate names the host its URL gives. Without TLS the
//! hello starts with the mesh token, checked (in constant time) before the receiver reads
//! or allocates anything else; a sender without it is answered "refused" and cut off.
//!
//! Frames (integers little-endian):
//! - hello: `PDKV` | version u16 | token (u8 len + bytes) | the sender's lease at the
//!   receiver (16 bytes) | fingerprint u64 | page bytes u64 | description (u32 len + UTF-8)
//! - hello reply: status u8 (0 accepted, 1 layout refused, 2 credential refused) | text
//!   (u32 len + UTF-8)
//! - batch: room u64 | sequence u32 | pages u32 | trailer bytes u32 | per page: index u32 |
//!   checksum u64 | bytes | then the trailer
//! - ack: sequence u32 | status u8 (0 ok, 2 checksum, 3 refused) | page index u32 | reply
//!   (u32 len + bytes): the sink's reply to the trailer, or why the batch failed (UTF-8)

mod frame;
mod receiver;
mod sender;

use std::future::Future;
use std::io;
use std::time::Duration;

use pdmesh_kv::KvLayout;

pub use receiver::{BadArrival, InPage, Received, Sink, serve_connection, serve_stream};
pub use sender::TcpSender;

/// The protocol version a hello names; a receiver refuses any other.
pub const VERSION: u16 = 4;
/// Longest trailer, and longest reply to one. A trailer is a room's commit (a checksum
/// per page: a 128k-token prompt's is about 200 KB).
pub const MAX_TRAILER: usize = 1 << 20;

/// One page to send: the room's page index, its checksum and its bytes (one whole page of
/// the layout).
#[derive(Clone, Copy, Debug)]
pub struct OutPage<'a> {
    pub index: u32,
    pub checksum: u64,
    pub bytes: &'a [u8],
}

impl<'a> OutPage<'a> {
    /// `pages` as one room's pages `0..`, each with the checksum of its bytes.
    pub fn numbered(pages: &'a [Vec<u8>]) -> Vec<Self> {
        pages
            .iter()
            .enumerate()
            .map(|(i, b)| OutPage {
                index: i as u32,
                checksum: pdmesh_kv::page_checksum(b),
                bytes: b,
            })
            .collect()
    }
}

/// The pages of one send, wherever their bytes are: the transport asks for each page's
/// index and checksum, and has its bytes copied straight into the frame it sends.
pub trait Pages: Sync {
    fn count(&self) -> usize;
    /// Page `i`'s index in its room and its checksum.
    fn meta(&self, i: usize) -> (u32, u64);
    /// Page `i`'s length in bytes (a send refuses any that is not the layout's page size).
    fn len_of(&self, i: usize) -> usize;
    /// Copies page `i` into `dst`, which is `len_of(i)` bytes.
    fn copy_to(&self, i: usize, dst: &mut [u8]);
}

impl Pages for [OutPage<'_>] {
    fn count(&self) -> usize {
        self.len()
    }
    fn meta(&self, i: usize) -> (u32, u64) {
        (self[i].index, self[i].checksum)
    }
    fn len_of(&self, i: usize) -> usize {
        self[i].bytes.len()
    }
    fn copy_to(&self, i: usize, dst: &mut [u8]) {
        dst.copy_from_slice(self[i].bytes);
    }
}

/// What one `send` moved, and the receiver's reply to its trailer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    pub pages: u64,
    pub bytes: u64,
    pub batches: u64,
    /// The reply to the trailer, when the send had one.
    pub reply: Option<Vec<u8>>,
}

/// The sending side of a transport: moves a room's pages to the host that holds the room,
/// then (optionally) a trailer the receiver acts on once they all landed, returning its
/// reply. Rooms and the engine see only this; a transport over RDMA (NIXL, say) would be
/// another implementation with its own handshake.
pub trait Transport {
    fn send<P: Pages + ?Sized>(
        &mut self,
        room: u64,
        pages: &P,
        trailer: Option<&[u8]>,
    ) -> impl Future<Output = Result<Sent, TransferError>> + Send;
}

#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("connecting to {peer}: {source}")]
    Connect { peer: String, source: io::Error },
    #[error("{peer} refused the layout: {reason}")]
    LayoutRefused { peer: String, reason: String },
    #[error("{what} with {peer} passed its {timeout:?} deadline")]
    Deadline {
        peer: String,
        what: &'static str,
        timeout: Duration,
    },
    #[error("the link to {peer} failed: {source}")]
    Io { peer: String, source: io::Error },
    #[error("page {index} of room {room} failed its checksum on arrival at {peer}")]
    Checksum { peer: String, room: u64, index: u32 },
    #[error("page {index} of room {room} was refused by {peer}: {reason}")]
    Refused {
        peer: String,
        room: u64,
        index: u32,
        reason: String,
    },
    #[error("page {index} has {got} bytes; the layout's pages have {want}")]
    PageSize { index: u32, got: usize, want: usize },
    #[error("a trailer of {0} bytes is longer than the transport's limit of {MAX_TRAILER}")]
    TrailerSize(usize),
    #[error("{peer} broke the protocol: {what}")]
    Protocol { peer: String, what: String },
    /// The hello's credential was refused (by the receiver, or a sender's at the
    /// receiver), or the receiver's certificate does not name the cache role.
    #[error("the page transport with {peer} refused the mesh credential: {reason}")]
    Unauthenticated { peer: String, reason: String },
    /// An earlier send on this connection failed; its framing cannot be trusted, so it
    /// carries nothing more (connect again).
    #[error("the connection to {peer} failed earlier ({first}); connect again")]
    Broken { peer: String, first: String },
}

/// Tuning of the tcp transport.
#[derive(Clone, Copy, Debug)]
pub struct TcpOptions {
    /// Deadline of every read and write of a frame (and of connecting).
    pub io_timeout: Duration,
    /// How long a receiver waits for the next batch before closing an idle connection.
    pub idle_timeout: Duration,
    /// Bytes of pages per batch (at least one page).
    pub batch_bytes: usize,
    /// Batches sent before the first acknowledgement must arrive.
    pub window: usize,
    /// A receiver serves at most this many connections at once; one more is closed at
    /// once.
    pub max_connections: usize,
    /// ... and at most this many from one peer address.
    pub max_per_peer: usize,
}

impl Default for TcpOptions {
    fn default() -> Self {
        Self {
            io_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            batch_bytes: 4 << 20,
            window: 4,
            max_connections: 1024,
            max_per_peer: 256,
        }
    }
}

/// A layout as the handshake names it: its display form and each component's bytes per
/// token (per layer), the figures a mismatch is explained by.
pub fn describe(layout: &KvLayout) -> String {
    let parts: Vec<String> = layout
        .components()
        .iter()
        .map(|c| format!("{} {} B/token", c.name, c.bytes_per_token()))
        .collect();
    format!("{layout}; per layer {}", parts.join(", "))
}

#[cfg(test)]
mod tests;

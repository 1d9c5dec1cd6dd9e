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

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use pdmesh_cache_client::Lease;
use pdmesh_kv::{KvLayout, page_checksum};
use pdmesh_tls::{Role, Roles};
use tokio::io::{
    AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter, ReadHalf, WriteHalf,
};
use tokio::net::TcpStream;

/// A connection the transport runs over: plain tcp, or TLS over tcp.
trait Conn: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Conn for T {}
type Stream = Box<dyn Conn>;

const MAGIC: [u8; 4] = *b"PDKV";
/// The protocol version a hello names; a receiver refuses any other.
pub const VERSION: u16 = 4;
/// The read buffer in front of the socket: small, since pages are read in runs much larger
/// than it, which bypass it (no copy through the buffer); headers gather in it.
const READ_BUFFER: usize = 16 << 10;
/// Bytes of pages the receiver reads at once (whole pages, at least one), and the sender
/// writes at once.
const READ_RUN: usize = 256 << 10;
/// Longest text a peer may send in a hello.
const MAX_TEXT: u32 = 64 << 10;
/// Longest trailer, and longest reply to one. A trailer is a room's commit (a checksum
/// per page: a 128k-token prompt's is about 200 KB).
pub const MAX_TRAILER: usize = 1 << 20;
const HEAD: usize = 20;
const PAGE_HEAD: usize = 12;

const ACK_OK: u8 = 0;
const ACK_CHECKSUM: u8 = 2;
const ACK_REFUSED: u8 = 3;

/// One page to send: the room's page index, its checksum and its bytes (one whole page of
/// the layout).
#[derive(Clone, Copy, Debug)]
pub struct OutPage<'a> {
    pub index: u32,
    pub checksum: u64,
    pub bytes: &'a [u8],
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

async fn deadline<T>(
    peer: &str,
    what: &'static str,
    timeout: Duration,
    fut: impl Future<Output = io::Result<T>>,
) -> Result<T, TransferError> {
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(TransferError::Io {
            peer: peer.to_owned(),
            source,
        }),
        Err(_) => Err(TransferError::Deadline {
            peer: peer.to_owned(),
            what,
            timeout,
        }),
    }
}

async fn read_blob<R: AsyncReadExt + Unpin>(r: &mut R, max: usize) -> io::Result<Vec<u8>> {
    let len = r.read_u32_le().await? as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{len} bytes of text or reply, more than {max}"),
        ));
    }
    let mut buf = vec![0; len];
    r.read_exact(&mut buf).await?;
    Ok(buf)
}

async fn read_text<R: AsyncReadExt + Unpin>(r: &mut R) -> io::Result<String> {
    let buf = read_blob(r, MAX_TEXT as usize).await?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

fn put_blob(out: &mut Vec<u8>, b: &[u8], max: usize) {
    let b = &b[..b.len().min(max)];
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

fn put_text(out: &mut Vec<u8>, s: &str) {
    put_blob(out, s.as_bytes(), MAX_TEXT as usize);
}

/// The sending end of one tcp connection to a peer cache service.
pub struct TcpSender {
    peer: String,
    rd: BufReader<ReadHalf<Stream>>,
    wr: WriteHalf<Stream>,
    page_bytes: usize,
    opts: TcpOptions,
    seq: u32,
    /// One batch's frame, built here and written in one go; kept for the next batch (its
    /// memory already faulted in).
    frame: Vec<u8>,
    /// Why an earlier send failed: batches may still be unacknowledged, so the connection
    /// is never used again.
    broken: Option<String>,
}

impl TcpSender {
    /// Connects (mutual TLS when `auth` has it: the receiver's certificate must name
    /// `host`, the name the peer is known by) and performs the hello: the mesh token,
    /// then the layout handshake.
    pub async fn connect(
        addr: SocketAddr,
        layout: &KvLayout,
        opts: TcpOptions,
        (auth, host): (&pdmesh_tls::MeshAuth, &str),
        lease: Lease,
    ) -> Result<Self, TransferError> {
        let peer = addr.to_string();
        let stream = deadline(
            &peer,
            "connecting",
            opts.io_timeout,
            TcpStream::connect(addr),
        )
        .await
        .map_err(|e| match e {
            TransferError::Io { peer, source } => TransferError::Connect { peer, source },
            other => other,
        })?;
        let _ = stream.set_nodelay(true);
        let stream: Stream = match auth.tls() {
            None => Box::new(stream),
            Some(tls) => {
                let name = tls.peer_name(host).map_err(|e| TransferError::Connect {
                    peer: peer.clone(),
                    source: io::Error::new(io::ErrorKind::InvalidInput, e.to_string()),
                })?;
                let s = deadline(
                    &peer,
                    "the TLS handshake",
                    opts.io_timeout,
                    tls.connector().connect(name, stream),
                )
                .await?;
                // Pages go only to a cache service: the receiver's certificate must say so.
                let certs = s.get_ref().1.peer_certificates().unwrap_or_default();
                if !Roles::of_chain(certs).contains(Role::Cache) {
                    return Err(TransferError::Unauthenticated {
                        peer,
                        reason: format!(
                            "its certificate names {}, not the cache role",
                            Roles::of_chain(certs)
                        ),
                    });
                }
                Box::new(s)
            }
        };
        let (rd, wr) = tokio::io::split(stream);
        let mut s = Self {
            rd: BufReader::new(rd),
            wr,
            page_bytes: layout.bytes_per_page(),
            peer,
            opts,
            seq: 0,
            frame: Vec::new(),
            broken: None,
        };
        let mut hello = Vec::new();
        hello.extend_from_slice(&MAGIC);
        hello.extend_from_slice(&VERSION.to_le_bytes());
        let token = auth.hello_token();
        let token = &token[..token.len().min(usize::from(u8::MAX))];
        hello.push(token.len() as u8);
        hello.extend_from_slice(token);
        hello.extend_from_slice(&lease.to_bytes());
        hello.extend_from_slice(&layout.fingerprint().to_le_bytes());
        hello.extend_from_slice(&(s.page_bytes as u64).to_le_bytes());
        put_text(&mut hello, &describe(layout));
        let (peer, t) = (s.peer.clone(), s.opts.io_timeout);
        deadline(&peer, "the hello", t, async {
            s.wr.write_all(&hello).await?;
            s.wr.flush().await
        })
        .await?;
        let (status, text) = deadline(&peer, "the hello reply", t, async {
            let status = s.rd.read_u8().await?;
            Ok((status, read_text(&mut s.rd).await?))
        })
        .await?;
        match status {
            0 => Ok(s),
            1 => Err(TransferError::LayoutRefused { peer, reason: text }),
            2 => Err(TransferError::Unauthenticated { peer, reason: text }),
            other => Err(TransferError::Protocol {
                peer,
                what: format!("hello reply status {other}"),
            }),
        }
    }

    /// The acknowledgement of batch `want`: its reply bytes, or why the batch failed.
    async fn read_ack(&mut self, room: u64, want: u32) -> Result<Vec<u8>, TransferError> {
        let (peer, t) = (self.peer.clone(), self.opts.io_timeout);
        let rd = &mut self.rd;
        let (seq, status, index, reply) = deadline(&peer, "an acknowledgement", t, async {
            let seq = rd.read_u32_le().await?;
            let status = rd.read_u8().await?;
            let index = rd.read_u32_le().await?;
            Ok((seq, status, index, read_blob(rd, MAX_TRAILER).await?))
        })
        .await?;
        if seq != want {
            return Err(TransferError::Protocol {
                peer,
                what: format!("acknowledged batch {seq}, expected {want}"),
            });
        }
        match status {
            ACK_OK => Ok(reply),
            ACK_CHECKSUM => Err(TransferError::Checksum { peer, room, index }),
            ACK_REFUSED => Err(TransferError::Refused {
                peer,
                room,
                index,
                reason: String::from_utf8_lossy(&reply).into_owned(),
            }),
            other => Err(TransferError::Protocol {
                peer,
                what: format!("acknowledgement status {other}"),
            }),
        }
    }
}

impl Transport for TcpSender {
    async fn send<P: Pages + ?Sized>(
        &mut self,
        room: u64,
        pages: &P,
        trailer: Option<&[u8]>,
    ) -> Result<Sent, TransferError> {
        if let Some(first) = &self.broken {
            return Err(TransferError::Broken {
                peer: self.peer.clone(),
                first: first.clone(),
            });
        }
        let r = self.send_batches(room, pages, trailer).await;
        if let Err(e) = &r
            && !matches!(
                e,
                TransferError::PageSize { .. } | TransferError::TrailerSize(_)
            )
        {
            self.broken = Some(e.to_string());
        }
        r
    }
}

impl TcpSender {
    async fn send_batches<P: Pages + ?Sized>(
        &mut self,
        room: u64,
        pages: &P,
        trailer: Option<&[u8]>,
    ) -> Result<Sent, TransferError> {
        let n = pages.count();
        if let Some(i) = (0..n).find(|&i| pages.len_of(i) != self.page_bytes) {
            return Err(TransferError::PageSize {
                index: pages.meta(i).0,
                got: pages.len_of(i),
                want: self.page_bytes,
            });
        }
        if let Some(t) = trailer
            && t.len() > MAX_TRAILER
        {
            return Err(TransferError::TrailerSize(t.len()));
        }
        let per_batch = (self.opts.batch_bytes / self.page_bytes.max(1)).max(1);
        // A trailer rides on the last batch; with no pages it is a batch of its own.
        let batches = n.div_ceil(per_batch).max(usize::from(trailer.is_some()));
        let window = self.opts.window.max(1);
        let mut sent = Sent::default();
        let mut unacked = VecDeque::new();
        for b in 0..batches {
            let (first, end) = (b * per_batch, ((b + 1) * per_batch).min(n));
            let tail = if b + 1 == batches { trailer } else { None };
            let seq = self.seq;
            self.seq = self.seq.wrapping_add(1);
            self.write_batch(room, seq, pages, first..end, tail).await?;
            sent.batches += 1;
            sent.pages += (end - first) as u64;
            sent.bytes += ((end - first) * self.page_bytes) as u64;
            unacked.push_back(seq);
            if unacked.len() >= window {
                let want = unacked.pop_front().expect("not empty");
                self.read_ack(room, want).await?;
            }
        }
        while let Some(want) = unacked.pop_front() {
            let reply = self.read_ack(room, want).await?;
            if unacked.is_empty() && trailer.is_some() {
                sent.reply = Some(reply);
            }
        }
        Ok(sent)
    }

    /// Writes batch `seq` of `pages[range]` (and `trailer`): laid out in `self.frame`,
    /// each page copied straight from its source, and written a run at a time as it is
    /// laid out, so the receiver reads one run while the next is copied.
    async fn write_batch<P: Pages + ?Sized>(
        &mut self,
        room: u64,
        seq: u32,
        pages: &P,
        range: std::ops::Range<usize>,
        trailer: Option<&[u8]>,
    ) -> Result<(), TransferError> {
        let (pb, count) = (self.page_bytes, range.len());
        let tail = trailer.unwrap_or_default();
        let len = HEAD + count * (PAGE_HEAD + pb) + tail.len();
        // Grown, never shrunk: bytes past `len` are stale and never sent, and nothing
        // below `len` is left unwritten, so no pass zeroes the frame.
        if self.frame.len() < len {
            self.frame.resize(len, 0);
        }
        let (peer, t) = (self.peer.clone(), self.opts.io_timeout);
        let (wr, f) = (&mut self.wr, &mut self.frame[..len]);
        f[..8].copy_from_slice(&room.to_le_bytes());
        f[8..12].copy_from_slice(&seq.to_le_bytes());
        f[12..16].copy_from_slice(&(count as u32).to_le_bytes());
        f[16..20].copy_from_slice(&(tail.len() as u32).to_le_bytes());
        let mut written = 0;
        for (k, i) in range.enumerate() {
            let at = HEAD + k * (PAGE_HEAD + pb);
            let (index, checksum) = pages.meta(i);
            f[at..at + 4].copy_from_slice(&index.to_le_bytes());
            f[at + 4..at + PAGE_HEAD].copy_from_slice(&checksum.to_le_bytes());
            pages.copy_to(i, &mut f[at + PAGE_HEAD..at + PAGE_HEAD + pb]);
            let built = at + PAGE_HEAD + pb;
            if built - written >= READ_RUN && built < len {
                let run = &f[written..built];
                deadline(&peer, "writing a batch", t, wr.write_all(run)).await?;
                written = built;
            }
        }
        f[len - tail.len()..].copy_from_slice(tail);
        let rest = &f[written..];
        deadline(&peer, "writing a batch", t, async {
            wr.write_all(rest).await?;
            wr.flush().await
        })
        .await
    }
}

/// One page as the receiver hands it to its sink: its checksum already verified. The
/// bytes are the receiver's buffer, reused for the next page.
#[derive(Debug)]
pub struct InPage<'a> {
    /// The sender's lease at this host, as its hello named it: pages may land only in the
    /// rooms that lease sends in.
    pub sender: Lease,
    pub room: u64,
    pub index: u32,
    pub checksum: u64,
    pub bytes: &'a [u8],
}

/// What a receiving connection did before it ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Received {
    pub pages: u64,
    pub batches: u64,
    pub checksum_failures: u64,
}

/// Where a receiver's pages go.
pub trait Sink {
    /// A page whose checksum matched, in order; an error refuses the page (and the rest
    /// of its batch) with that reason.
    fn page(&mut self, page: InPage<'_>) -> Result<(), String>;
    /// A send's trailer, once every page of its batch was taken; the reply goes back to
    /// the sender. Never called for a batch that failed.
    fn trailer(&mut self, _room: u64, _sender: Lease, _trailer: &[u8]) -> Vec<u8> {
        Vec::new()
    }
    /// A page that arrived from `peer` with bytes not matching its checksum (refused,
    /// with the rest of its batch).
    fn checksum_failed(&mut self, _bad: BadArrival<'_>) {}
}

/// A page that failed its checksum on arrival.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadArrival<'a> {
    pub peer: &'a str,
    pub room: u64,
    pub index: u32,
    /// The checksum the sender framed the page with, and the one of the bytes received.
    pub expected: u64,
    pub found: u64,
}

impl<F: FnMut(InPage<'_>) -> Result<(), String>> Sink for F {
    fn page(&mut self, page: InPage<'_>) -> Result<(), String> {
        self(page)
    }
}

/// Serves one incoming connection for a cache service whose layout is `layout`: the TLS
/// handshake when `tls` is given (a sender without the mesh's certificate is refused
/// there), the layout handshake, then batches until the sender closes or sends no page for
/// `idle_timeout` (a batch without pages, a trailer alone, does not keep it open).
/// `sink` gets each page whose checksum matched, and each trailer (see [`Sink`]). A page
/// with a bad checksum never reaches the sink. Returns when the connection ends; an error
/// says why it ended early.
pub async fn serve_connection(
    stream: TcpStream,
    auth: &pdmesh_tls::MeshAuth,
    layout: &KvLayout,
    opts: TcpOptions,
    sink: impl Sink,
) -> Result<Received, TransferError> {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "?".to_owned(), |a| a.to_string());
    let _ = stream.set_nodelay(true);
    // Over TLS, the certificate chain the sender presented: it must name the cache role.
    let (stream, peer_certs): (Stream, _) = match auth.tls() {
        None => (Box::new(stream), None),
        Some(tls) => {
            let s = deadline(
                &peer,
                "the TLS handshake",
                opts.io_timeout,
                tls.acceptor().accept(stream),
            )
            .await?;
            let certs: Vec<Vec<u8>> = s
                .get_ref()
                .1
                .peer_certificates()
                .unwrap_or_default()
                .iter()
                .map(|c| c.to_vec())
                .collect();
            (Box::new(s), Some(certs))
        }
    };
    serve_stream(stream, (peer, peer_certs), auth, layout, opts, sink).await
}

/// [`serve_connection`] over a stream already past the TLS handshake (if any): `peer`
/// names the sender, with the certificate chain it presented over TLS. Without TLS any
/// byte stream works, which is how the frame decoder is fuzzed (`fuzz/`).
pub async fn serve_stream(
    stream: impl AsyncRead + AsyncWrite + Send + Unpin + 'static,
    (peer, peer_certs): (String, Option<Vec<Vec<u8>>>),
    auth: &pdmesh_tls::MeshAuth,
    layout: &KvLayout,
    opts: TcpOptions,
    mut sink: impl Sink,
) -> Result<Received, TransferError> {
    let stream: Stream = Box::new(stream);
    let (rd, wr) = tokio::io::split(stream);
    let mut rd = BufReader::with_capacity(READ_BUFFER, rd);
    let mut wr = BufWriter::new(wr);
    let t = opts.io_timeout;
    // The credential first, into a fixed buffer: a peer without it gets nothing read,
    // allocated or answered beyond "refused".
    let (magic, version) = deadline(&peer, "the hello", t, async {
        let mut magic = [0u8; 4];
        rd.read_exact(&mut magic).await?;
        Ok((magic, rd.read_u16_le().await?))
    })
    .await?;
    if magic != MAGIC || version != VERSION {
        return Err(TransferError::Protocol {
            peer,
            what: format!("hello {magic:?} version {version}"),
        });
    }
    let (token_len, token) = deadline(&peer, "the hello", t, async {
        let n = usize::from(rd.read_u8().await?);
        let mut token = [0u8; u8::MAX as usize];
        rd.read_exact(&mut token[..n]).await?;
        Ok((n, token))
    })
    .await?;
    if !auth.admits_hello(&token[..token_len], peer_certs.as_deref()) {
        let reason = if peer_certs.is_some() {
            "only a certificate naming the cache role may send pages"
        } else {
            "the mesh credential is missing or wrong"
        };
        let mut reply = vec![2u8];
        put_text(&mut reply, reason);
        let _ = deadline(&peer, "the hello reply", t, async {
            wr.write_all(&reply).await?;
            wr.flush().await
        })
        .await;
        return Err(TransferError::Unauthenticated {
            peer,
            reason: reason.to_owned(),
        });
    }
    let (sender, fingerprint, page_bytes, theirs) = deadline(&peer, "the hello", t, async {
        let mut sender = [0u8; Lease::BYTES];
        rd.read_exact(&mut sender).await?;
        let sender = Lease::from_bytes(sender);
        let fingerprint = rd.read_u64_le().await?;
        let page_bytes = rd.read_u64_le().await?;
        Ok((sender, fingerprint, page_bytes, read_text(&mut rd).await?))
    })
    .await?;
    let ours = describe(layout);
    let accepted =
        fingerprint == layout.fingerprint() && page_bytes == layout.bytes_per_page() as u64;
    let mut reply = vec![u8::from(!accepted)];
    if accepted {
        put_text(&mut reply, &ours);
    } else {
        put_text(
            &mut reply,
            &format!("KV layouts differ: this host has {ours}; the sender has {theirs}"),
        );
    }
    deadline(&peer, "the hello reply", t, async {
        wr.write_all(&reply).await?;
        wr.flush().await
    })
    .await?;
    if !accepted {
        return Err(TransferError::LayoutRefused {
            peer,
            reason: format!("this host has {ours}; the sender has {theirs}"),
        });
    }

    let page_bytes = layout.bytes_per_page();
    let frame_bytes = PAGE_HEAD + page_bytes;
    let per_run = (READ_RUN / frame_bytes).max(1);
    let mut got = Received::default();
    // One buffer for every run of pages: no allocation (nor fresh memory to fault in) per
    // page.
    let mut run = vec![0u8; per_run * frame_bytes];
    // Only pages move it: a sender that sends none for `idle_timeout` is closed.
    let mut idle_until = tokio::time::Instant::now() + opts.idle_timeout;
    loop {
        // Between batches the connection may idle; inside one every read has a deadline.
        let mut head = [0u8; HEAD];
        match tokio::time::timeout_at(idle_until, rd.read_exact(&mut head[..1])).await {
            Err(_) => return Ok(got),
            Ok(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(got),
            Ok(Err(source)) => return Err(TransferError::Io { peer, source }),
            Ok(Ok(_)) => {}
        }
        deadline(&peer, "a batch header", t, rd.read_exact(&mut head[1..])).await?;
        let room = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
        let seq = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
        let count = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes")) as usize;
        let tail = u32::from_le_bytes(head[16..].try_into().expect("4 bytes")) as usize;
        if tail > MAX_TRAILER {
            return Err(TransferError::Protocol {
                peer,
                what: format!("a trailer of {tail} bytes"),
            });
        }
        if count > 0 {
            idle_until = tokio::time::Instant::now() + opts.idle_timeout;
        }
        let (mut status, mut bad_index, mut text) = (ACK_OK, 0u32, String::new());
        let mut left = count;
        while left > 0 {
            let k = left.min(per_run);
            left -= k;
            let buf = &mut run[..k * frame_bytes];
            deadline(&peer, "a page", t, rd.read_exact(buf)).await?;
            for f in buf.chunks_exact(frame_bytes) {
                if status != ACK_OK {
                    break; // the batch already failed: read on to keep the framing
                }
                let index = u32::from_le_bytes(f[..4].try_into().expect("4 bytes"));
                let checksum = u64::from_le_bytes(f[4..PAGE_HEAD].try_into().expect("8 bytes"));
                let bytes = &f[PAGE_HEAD..];
                let found = page_checksum(bytes);
                if found != checksum {
                    got.checksum_failures += 1;
                    (status, bad_index) = (ACK_CHECKSUM, index);
                    sink.checksum_failed(BadArrival {
                        peer: &peer,
                        room,
                        index,
                        expected: checksum,
                        found,
                    });
                    break;
                }
                let page = InPage {
                    sender,
                    room,
                    index,
                    checksum,
                    bytes,
                };
                match sink.page(page) {
                    Ok(()) => got.pages += 1,
                    Err(reason) => (status, bad_index, text) = (ACK_REFUSED, index, reason),
                }
            }
        }
        let mut reply = Vec::new();
        if tail > 0 {
            let mut trailer = vec![0u8; tail];
            deadline(&peer, "a trailer", t, rd.read_exact(&mut trailer)).await?;
            if status == ACK_OK {
                reply = sink.trailer(room, sender, &trailer);
            }
        }
        if status != ACK_OK {
            reply = text.into_bytes();
        }
        got.batches += 1;
        let mut ack = Vec::with_capacity(16 + reply.len());
        ack.extend_from_slice(&seq.to_le_bytes());
        ack.push(status);
        ack.extend_from_slice(&bad_index.to_le_bytes());
        put_blob(&mut ack, &reply, MAX_TRAILER);
        deadline(&peer, "an acknowledgement", t, async {
            wr.write_all(&ack).await?;
            wr.flush().await
        })
        .await?;
    }
}

#[cfg(test)]
mod tests {
    /// A sender's lease, for tests that do not look at it.
    const SEVEN: Lease = Lease::from_test_number(7);
    use std::sync::{Arc, Mutex};

    use pdmesh_kv::{Component, DType};
    use pdmesh_tls::MeshAuth;
    use tokio::net::TcpListener;

    use super::*;

    fn layout(dtype: DType) -> KvLayout {
        KvLayout::new(
            "test-kv",
            2,
            16,
            vec![
                Component::plain("k", dtype, 64),
                Component::plain("v", dtype, 64),
            ],
        )
        .unwrap()
    }

    fn pages(layout: &KvLayout, n: usize) -> Vec<Vec<u8>> {
        (0..n)
            .map(|i| {
                (0..layout.bytes_per_page())
                    .map(|b| (b * 31 + i * 7) as u8)
                    .collect()
            })
            .collect()
    }

    fn out(pages: &[Vec<u8>]) -> Vec<OutPage<'_>> {
        pages
            .iter()
            .enumerate()
            .map(|(i, b)| OutPage {
                index: i as u32,
                checksum: page_checksum(b),
                bytes: b,
            })
            .collect()
    }

    fn quick() -> TcpOptions {
        TcpOptions {
            io_timeout: Duration::from_millis(500),
            idle_timeout: Duration::from_secs(5),
            batch_bytes: 3 * layout(DType::F16).bytes_per_page(),
            window: 2,
            ..TcpOptions::default()
        }
    }

    /// A delivered page, kept.
    #[derive(Debug)]
    struct Kept {
        room: u64,
        index: u32,
        checksum: u64,
        bytes: Vec<u8>,
    }

    type Delivered = Arc<Mutex<Vec<Kept>>>;
    /// Each trailer delivered: its room, its bytes, and how many pages had landed then.
    type Trailers = Arc<Mutex<Vec<(u64, Vec<u8>, usize)>>>;

    /// Keeps what arrives; refuses page `refuse_index`; answers a trailer with
    /// `done:` and the trailer.
    struct Keep {
        delivered: Delivered,
        trailers: Trailers,
        refuse_index: Option<u32>,
    }

    impl Sink for Keep {
        fn page(&mut self, p: InPage<'_>) -> Result<(), String> {
            if Some(p.index) == self.refuse_index {
                return Err("room failed".into());
            }
            self.delivered.lock().unwrap().push(Kept {
                room: p.room,
                index: p.index,
                checksum: p.checksum,
                bytes: p.bytes.to_vec(),
            });
            Ok(())
        }

        fn trailer(&mut self, room: u64, _sender: Lease, trailer: &[u8]) -> Vec<u8> {
            let landed = self.delivered.lock().unwrap().len();
            self.trailers
                .lock()
                .unwrap()
                .push((room, trailer.to_vec(), landed));
            [b"done:", trailer].concat()
        }
    }

    /// A receiver for one connection on loopback; its result and the pages it delivered.
    async fn receiver(
        layout: KvLayout,
        refuse_index: Option<u32>,
    ) -> (
        SocketAddr,
        tokio::task::JoinHandle<Result<Received, TransferError>>,
        Delivered,
    ) {
        let (addr, task, delivered, _) = receiver_with(layout, refuse_index, mesh()).await;
        (addr, task, delivered)
    }

    /// The test process's mesh token.
    fn mesh() -> MeshAuth {
        pdmesh_tls::test_ca::auth()
    }

    /// Mutual TLS only.
    fn over(tls: pdmesh_tls::MeshTls) -> MeshAuth {
        MeshAuth::new(Some(tls), None, false)
    }

    /// As `receiver`, with the credential `auth`, also keeping the trailers.
    async fn receiver_with(
        layout: KvLayout,
        refuse_index: Option<u32>,
        auth: MeshAuth,
    ) -> (
        SocketAddr,
        tokio::task::JoinHandle<Result<Received, TransferError>>,
        Delivered,
        Trailers,
    ) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let sink = Keep {
            delivered: Delivered::default(),
            trailers: Trailers::default(),
            refuse_index,
        };
        let (delivered, trailers) = (sink.delivered.clone(), sink.trailers.clone());
        let task = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            serve_connection(s, &auth, &layout, quick(), sink).await
        });
        (addr, task, delivered, trailers)
    }

    #[tokio::test]
    async fn a_trailer_reaches_the_sink_after_every_page_and_its_reply_comes_back() {
        let l = layout(DType::F16);
        let (addr, task, delivered, trailers) = receiver_with(l.clone(), None, mesh()).await;
        let data = pages(&l, 7);
        let mut tx = TcpSender::connect(addr, &l, quick(), (&mesh(), "127.0.0.1"), SEVEN)
            .await
            .unwrap();
        // Batches of three: the trailer rides on the third.
        let sent = tx
            .send(9, &out(&data)[..], Some(b"commit 9"))
            .await
            .unwrap();
        assert_eq!((sent.pages, sent.batches), (7, 3));
        assert_eq!(sent.reply.as_deref(), Some(&b"done:commit 9"[..]));
        // No pages at all (the receiver held them): the trailer is a batch of its own.
        let none: Vec<OutPage<'_>> = Vec::new();
        let sent = tx.send(10, &none[..], Some(b"commit 10")).await.unwrap();
        assert_eq!((sent.pages, sent.batches), (0, 1));
        assert_eq!(sent.reply.as_deref(), Some(&b"done:commit 10"[..]));
        // Without a trailer there is no reply.
        assert_eq!(
            tx.send(11, &out(&data[..1])[..], None).await.unwrap().reply,
            None
        );
        drop(tx);
        task.await.unwrap().unwrap();
        assert_eq!(
            *trailers.lock().unwrap(),
            [(9, b"commit 9".to_vec(), 7), (10, b"commit 10".to_vec(), 7)]
        );
        assert_eq!(delivered.lock().unwrap().len(), 8);
    }

    #[tokio::test]
    async fn a_batch_that_failed_never_delivers_its_trailer() {
        let l = layout(DType::F16);
        let data = pages(&l, 7);
        // A page of the last batch refused, then (another connection) one changed on the way.
        for bad in ["refused", "checksum"] {
            let refuse = (bad == "refused").then_some(6);
            let (addr, task, delivered, trailers) = receiver_with(l.clone(), refuse, mesh()).await;
            let mut pages = out(&data);
            if bad == "checksum" {
                pages[6].checksum ^= 1;
            }
            let mut tx = TcpSender::connect(addr, &l, quick(), (&mesh(), "127.0.0.1"), SEVEN)
                .await
                .unwrap();
            let err = tx.send(9, &pages[..], Some(b"commit")).await.unwrap_err();
            assert!(
                matches!(
                    err,
                    TransferError::Refused { index: 6, .. }
                        | TransferError::Checksum { index: 6, .. }
                ),
                "{err}"
            );
            drop(tx);
            task.await.unwrap().unwrap();
            assert!(trailers.lock().unwrap().is_empty(), "{bad}");
            assert_eq!(delivered.lock().unwrap().len(), 6);
        }
    }

    #[tokio::test]
    async fn batches_without_pages_do_not_keep_a_connection_open() {
        let l = layout(DType::F16);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let opts = TcpOptions {
            idle_timeout: Duration::from_millis(300),
            ..quick()
        };
        let sink = Keep {
            delivered: Delivered::default(),
            trailers: Trailers::default(),
            refuse_index: None,
        };
        let (layout, auth) = (l.clone(), mesh());
        let task = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            serve_connection(s, &auth, &layout, opts, sink).await
        });
        let mut tx = TcpSender::connect(addr, &l, opts, (&mesh(), "127.0.0.1"), SEVEN)
            .await
            .unwrap();
        tx.send(1, &out(&pages(&l, 1))[..], None).await.unwrap();
        // Trailers alone, back to back: the receiver still closes once no page came for
        // the idle timeout, and the sender's next batch fails.
        let none: Vec<OutPage<'_>> = Vec::new();
        let mut sent = 0;
        let failed = loop {
            match tx.send(2, &none[..], Some(b"again")).await {
                Ok(_) if sent < 1_000_000 => sent += 1,
                Ok(_) => break None,
                Err(e) => break Some(e),
            }
        };
        assert!(failed.is_some(), "{sent} trailer batches kept it open");
        let got = task.await.unwrap().unwrap();
        assert_eq!((got.pages, got.batches), (1, sent + 1));
    }

    #[tokio::test]
    async fn a_trailer_past_the_limit_is_refused_before_anything_is_sent() {
        let l = layout(DType::F16);
        let (addr, task, delivered, trailers) = receiver_with(l.clone(), None, mesh()).await;
        let data = pages(&l, 2);
        let mut tx = TcpSender::connect(addr, &l, quick(), (&mesh(), "127.0.0.1"), SEVEN)
            .await
            .unwrap();
        let huge = vec![0u8; MAX_TRAILER + 1];
        let err = tx.send(1, &out(&data)[..], Some(&huge)).await.unwrap_err();
        assert!(matches!(err, TransferError::TrailerSize(_)), "{err}");
        // Nothing was written: the connection still works.
        let sent = tx.send(2, &out(&data)[..], Some(b"ok")).await.unwrap();
        assert_eq!(sent.reply.as_deref(), Some(&b"done:ok"[..]));
        drop(tx);
        task.await.unwrap().unwrap();
        assert_eq!(delivered.lock().unwrap().len(), 2);
        assert_eq!(trailers.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_sender_without_the_mesh_token_or_with_another_is_refused_at_the_hello_and_moves_nothing()
     {
        let l = layout(DType::F16);
        let data = pages(&l, 3);
        let other = MeshAuth::token(pdmesh_tls::MeshToken::generate());
        for (auth, name) in [(other, "another token"), (MeshAuth::open(), "no token")] {
            let before = pdmesh_tls::auth::refused_total();
            let (addr, task, delivered, _) = receiver_with(l.clone(), None, mesh()).await;
            let err = match TcpSender::connect(addr, &l, quick(), (&auth, "127.0.0.1"), SEVEN).await
            {
                Ok(_) => panic!("{name}: the receiver accepted the hello"),
                Err(e) => e,
            };
            assert!(
                matches!(err, TransferError::Unauthenticated { .. }),
                "{name}: {err}"
            );
            let err = task.await.unwrap().unwrap_err();
            assert!(
                matches!(err, TransferError::Unauthenticated { .. }),
                "{name}: {err}"
            );
            assert!(delivered.lock().unwrap().is_empty(), "{name}");
            assert!(pdmesh_tls::auth::refused_total() > before, "{name}");
        }
        // The right token moves pages.
        let (addr, task, delivered, _) = receiver_with(l.clone(), None, mesh()).await;
        let mut tx = TcpSender::connect(addr, &l, quick(), (&mesh(), "127.0.0.1"), SEVEN)
            .await
            .unwrap();
        assert_eq!(tx.send(1, &out(&data)[..], None).await.unwrap().pages, 3);
        drop(tx);
        task.await.unwrap().unwrap();
        assert_eq!(delivered.lock().unwrap().len(), 3);
    }

    #[tokio::test]
    async fn over_the_meshs_tls_pages_arrive_whole_and_a_sender_without_its_certificate_moves_nothing()
     {
        use pdmesh_tls::test_ca::Ca;
        let ca = Ca::new("mesh");
        let l = layout(DType::F16);
        let (addr, task, delivered, _) =
            receiver_with(l.clone(), None, over(ca.mesh(&["127.0.0.1"]))).await;
        let data = pages(&l, 8);
        let sender = over(ca.mesh(&["127.0.0.2"]));
        let mut tx = TcpSender::connect(addr, &l, quick(), (&sender, "127.0.0.1"), SEVEN)
            .await
            .unwrap();
        assert_eq!(tx.send(5, &out(&data)[..], None).await.unwrap().pages, 8);
        drop(tx);
        assert_eq!(task.await.unwrap().unwrap().pages, 8);
        let got: Vec<Vec<u8>> = delivered
            .lock()
            .unwrap()
            .iter()
            .map(|p| p.bytes.clone())
            .collect();
        assert_eq!(got, data);

        // Another CA's certificate, and plain tcp: refused before the layout handshake.
        let intruder = Ca::new("intruder");
        let (cert, key) = intruder.leaf(&["127.0.0.1"]);
        let foreign =
            pdmesh_tls::MeshTls::from_pem(ca.pem.as_bytes(), cert.as_bytes(), key.as_bytes())
                .unwrap();
        for auth in [over(foreign), mesh()] {
            let (addr, task, delivered, _) =
                receiver_with(l.clone(), None, over(ca.mesh(&["127.0.0.1"]))).await;
            if let Ok(mut tx) =
                TcpSender::connect(addr, &l, quick(), (&auth, "127.0.0.1"), SEVEN).await
            {
                assert!(tx.send(5, &out(&data)[..], None).await.is_err());
            }
            let err = task.await.unwrap().unwrap_err();
            assert!(
                matches!(
                    err,
                    TransferError::Io { .. } | TransferError::Deadline { .. }
                ),
                "{err}"
            );
            assert!(delivered.lock().unwrap().is_empty());
        }

        // A receiver whose certificate is a worker's gets no page.
        let (addr, task, delivered, _) = receiver_with(
            l.clone(),
            None,
            over(ca.member(&["127.0.0.1"], &["worker"])),
        )
        .await;
        let err = TcpSender::connect(addr, &l, quick(), (&sender, "127.0.0.1"), SEVEN)
            .await
            .map(|_| ())
            .unwrap_err();
        assert!(err.to_string().contains("not the cache role"), "{err}");
        let _ = task.await;
        assert!(delivered.lock().unwrap().is_empty());

        // The mesh's own CA, but a worker's certificate: only a cache service sends pages.
        let (addr, task, delivered, _) =
            receiver_with(l.clone(), None, over(ca.mesh(&["127.0.0.1"]))).await;
        let worker = over(ca.member(&["127.0.0.2"], &["worker"]));
        let refused =
            match TcpSender::connect(addr, &l, quick(), (&worker, "127.0.0.1"), SEVEN).await {
                Ok(mut tx) => tx.send(5, &out(&data)[..], None).await.unwrap_err(),
                Err(e) => e,
            };
        assert!(refused.to_string().contains("cache role"), "{refused}");
        let err = task.await.unwrap().unwrap_err();
        assert!(
            matches!(err, TransferError::Unauthenticated { .. }),
            "{err}"
        );
        assert!(delivered.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn pages_arrive_whole_in_order_in_batches_with_several_in_flight() {
        let l = layout(DType::F16);
        let (addr, task, delivered) = receiver(l.clone(), None).await;
        let data = pages(&l, 64);
        let mut tx = TcpSender::connect(addr, &l, quick(), (&mesh(), "127.0.0.1"), SEVEN)
            .await
            .unwrap();
        let sent = tx.send(9, &out(&data)[..], None).await.unwrap();
        assert_eq!(
            sent,
            Sent {
                pages: 64,
                bytes: (64 * l.bytes_per_page()) as u64,
                batches: 22,
                reply: None,
            }
        );
        // The connection carries the next room too.
        tx.send(10, &out(&data[..2])[..], None).await.unwrap();
        drop(tx);
        let got = task.await.unwrap().unwrap();
        assert_eq!((got.pages, got.batches, got.checksum_failures), (66, 23, 0));
        let d = delivered.lock().unwrap();
        for (i, p) in d[..64].iter().enumerate() {
            assert_eq!((p.room, p.index as usize), (9, i));
            assert_eq!(p.bytes, data[i]);
            assert_eq!(p.checksum, page_checksum(&data[i]));
        }
        assert_eq!((d[64].room, d[65].index), (10, 1));
    }

    #[tokio::test]
    async fn another_layout_is_refused_naming_both_and_no_page_crosses() {
        let (addr, task, delivered) = receiver(layout(DType::F16), None).await;
        let theirs = layout(DType::Bf16);
        let err =
            match TcpSender::connect(addr, &theirs, quick(), (&mesh(), "127.0.0.1"), SEVEN).await {
                Err(e) => e.to_string(),
                Ok(_) => panic!("a bf16 sender was accepted by an f16 host"),
            };
        assert!(err.contains("KV layouts differ"), "{err}");
        assert!(err.contains("k:f16") && err.contains("k:bf16"), "{err}");
        assert!(err.contains("k 128 B/token"), "{err}");
        assert!(matches!(
            task.await.unwrap(),
            Err(TransferError::LayoutRefused { .. })
        ));
        assert!(delivered.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_page_whose_bytes_changed_on_the_way_never_reaches_the_sink() {
        let l = layout(DType::F16);
        let (addr, task, delivered) = receiver(l.clone(), None).await;
        let data = pages(&l, 6);
        let mut pages = out(&data);
        pages[4].checksum ^= 1; // as if a byte flipped after the checksum was taken
        let mut tx = TcpSender::connect(addr, &l, quick(), (&mesh(), "127.0.0.1"), SEVEN)
            .await
            .unwrap();
        let err = tx.send(3, &pages[..], None).await.unwrap_err();
        assert!(
            matches!(
                err,
                TransferError::Checksum {
                    room: 3,
                    index: 4,
                    ..
                }
            ),
            "{err}"
        );
        // Its framing may hold unacknowledged batches: the connection carries no more.
        let again = tx.send(4, &out(&data[..1])[..], None).await.unwrap_err();
        assert!(matches!(again, TransferError::Broken { .. }), "{again}");
        drop(tx);
        let got = task.await.unwrap().unwrap();
        assert_eq!(got.checksum_failures, 1);
        // Batches of three: the first batch went through; of the second, only the page
        // before the bad one.
        let idx: Vec<u32> = delivered.lock().unwrap().iter().map(|p| p.index).collect();
        assert_eq!(idx, [0, 1, 2, 3]);
    }

    #[tokio::test]
    async fn a_refusal_by_the_receiver_names_the_page_and_its_reason() {
        let l = layout(DType::F16);
        let (addr, _task, _) = receiver(l.clone(), Some(1)).await;
        let data = pages(&l, 2);
        let mut tx = TcpSender::connect(addr, &l, quick(), (&mesh(), "127.0.0.1"), SEVEN)
            .await
            .unwrap();
        let err = tx.send(5, &out(&data)[..], None).await.unwrap_err();
        assert!(
            matches!(&err, TransferError::Refused { room: 5, index: 1, reason, .. } if reason == "room failed"),
            "{err}"
        );
    }

    /// A peer that answers the hello by hand and then does what the test says.
    async fn fake_peer(
        listener: TcpListener,
        layout: &KvLayout,
    ) -> (
        BufReader<tokio::net::tcp::OwnedReadHalf>,
        tokio::net::tcp::OwnedWriteHalf,
    ) {
        let (s, _) = listener.accept().await.unwrap();
        let (rd, mut wr) = s.into_split();
        let mut rd = BufReader::new(rd);
        let mut head = vec![0u8; 4 + 2 + 1];
        rd.read_exact(&mut head).await.unwrap();
        // The token, then the lease, fingerprint and page size, then the description.
        let mut rest = vec![0u8; usize::from(head[6]) + Lease::BYTES + 8 + 8];
        rd.read_exact(&mut rest).await.unwrap();
        read_text(&mut rd).await.unwrap();
        let mut reply = vec![0u8];
        put_text(&mut reply, &describe(layout));
        wr.write_all(&reply).await.unwrap();
        (rd, wr)
    }

    #[tokio::test]
    async fn a_peer_that_stops_reading_fails_the_send_by_its_deadline() {
        let l = layout(DType::F16);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let layout2 = l.clone();
        // Answers the hello, then never reads again (a SIGSTOPped cache service).
        let stalled = tokio::spawn(async move {
            let _held = fake_peer(listener, &layout2).await;
            std::future::pending::<()>().await;
        });
        let data = pages(&l, 64); // more than the socket buffers hold
        let mut tx = TcpSender::connect(addr, &l, quick(), (&mesh(), "127.0.0.1"), SEVEN)
            .await
            .unwrap();
        let big: Vec<OutPage<'_>> = (0..40).flat_map(|_| out(&data)).collect();
        let err = tx.send(1, &big[..], None).await.unwrap_err();
        assert!(matches!(err, TransferError::Deadline { .. }), "{err}");
        stalled.abort();
    }

    #[tokio::test]
    async fn a_peer_that_vanishes_mid_transfer_is_an_error_not_a_hang() {
        let l = layout(DType::F16);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let layout2 = l.clone();
        // Answers the hello, takes part of the first batch, and is gone (killed).
        tokio::spawn(async move {
            let (mut rd, _wr) = fake_peer(listener, &layout2).await;
            let mut part = vec![0u8; 5000];
            rd.read_exact(&mut part).await.unwrap();
        });
        let data = pages(&l, 64);
        let mut tx = TcpSender::connect(addr, &l, quick(), (&mesh(), "127.0.0.1"), SEVEN)
            .await
            .unwrap();
        let err = tx.send(1, &out(&data)[..], None).await.unwrap_err();
        // The reset arrives long before any deadline.
        assert!(matches!(err, TransferError::Io { .. }), "{err}");
    }

    #[tokio::test]
    async fn a_page_of_the_wrong_size_is_refused_before_anything_is_sent() {
        let l = layout(DType::F16);
        let (addr, _task, delivered) = receiver(l.clone(), None).await;
        let mut tx = TcpSender::connect(addr, &l, quick(), (&mesh(), "127.0.0.1"), SEVEN)
            .await
            .unwrap();
        let short = vec![0u8; 10];
        let err = tx
            .send(
                1,
                &[OutPage {
                    index: 0,
                    checksum: page_checksum(&short),
                    bytes: &short,
                }][..],
                None,
            )
            .await
            .unwrap_err();
        assert!(
            matches!(err, TransferError::PageSize { got: 10, .. }),
            "{err}"
        );
        assert!(delivered.lock().unwrap().is_empty());
        // Nothing was written, so the connection still carries whole pages.
        let data = pages(&l, 1);
        tx.send(2, &out(&data)[..], None).await.unwrap();
        assert_eq!(delivered.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_stranger_or_a_bogus_length_is_refused_and_delivers_nothing() {
        let l = layout(DType::F16);
        let token = pdmesh_tls::test_ca::token().expose().to_owned();
        for hello in [
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            // Our magic, version and token, then a description claiming 4 GiB.
            [
                &MAGIC[..],
                &VERSION.to_le_bytes(),
                &[token.len() as u8],
                token.as_bytes(),
                &[0; Lease::BYTES + 16],
                &u32::MAX.to_le_bytes(),
            ]
            .concat(),
        ] {
            let (addr, task, delivered) = receiver(l.clone(), None).await;
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(&hello).await.unwrap();
            let err = task.await.unwrap().unwrap_err();
            assert!(
                matches!(
                    err,
                    TransferError::Protocol { .. } | TransferError::Io { .. }
                ),
                "{err}"
            );
            assert!(delivered.lock().unwrap().is_empty());
        }
    }
}

//! The sending end of a tcp connection: the hello, then batches of pages with up to
//! `window` of them unacknowledged.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;

use pdmesh_cache_client::Lease;
use pdmesh_kv::KvLayout;
use pdmesh_tls::{Role, Roles};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, ReadHalf, WriteHalf};
use tokio::net::TcpStream;

use super::frame::{
    ACK_CHECKSUM, ACK_OK, ACK_REFUSED, HEAD, MAGIC, PAGE_HEAD, READ_RUN, Stream, deadline,
    put_text, read_blob, read_text,
};
use super::{MAX_TRAILER, Pages, Sent, TcpOptions, TransferError, Transport, VERSION, describe};

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

//! The receiving end of a tcp connection: it checks the hello, then every page's checksum
//! as it arrives, hands good pages to its sink and acknowledges each batch.

use std::io;

use pdmesh_cache_client::Lease;
use pdmesh_kv::{KvLayout, page_checksum};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;

use super::frame::{
    ACK_CHECKSUM, ACK_OK, ACK_REFUSED, HEAD, MAGIC, PAGE_HEAD, READ_BUFFER, READ_RUN, Stream,
    deadline, put_blob, put_text, read_text,
};
use super::{MAX_TRAILER, TcpOptions, TransferError, VERSION, describe};

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
    /// Why a page was refused: its text goes back to the sender in the acknowledgement.
    type Refusal: std::fmt::Display;
    /// A page whose checksum matched, in order; an error refuses the page (and the rest
    /// of its batch) with that reason.
    fn page(&mut self, page: InPage<'_>) -> Result<(), Self::Refusal>;
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

impl<E: std::fmt::Display, F: FnMut(InPage<'_>) -> Result<(), E>> Sink for F {
    type Refusal = E;
    fn page(&mut self, page: InPage<'_>) -> Result<(), E> {
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
                    Err(reason) => {
                        (status, bad_index, text) = (ACK_REFUSED, index, reason.to_string())
                    }
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

//! Tests of the tcp transport: both ends over loopback, and fake peers that misbehave.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdmesh_cache_client::Lease;
use pdmesh_kv::{Component, DType, KvLayout, page_checksum};
use pdmesh_tls::MeshAuth;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use super::frame::{MAGIC, put_text, read_text};
use super::*;

/// A sender's lease, for tests that do not look at it.
const SEVEN: Lease = Lease::from_test_number(7);

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
    OutPage::numbered(pages)
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
    type Refusal = &'static str;
    fn page(&mut self, p: InPage<'_>) -> Result<(), &'static str> {
        if Some(p.index) == self.refuse_index {
            return Err("room failed");
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
                TransferError::Refused { index: 6, .. } | TransferError::Checksum { index: 6, .. }
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
        let err = match TcpSender::connect(addr, &l, quick(), (&auth, "127.0.0.1"), SEVEN).await {
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
        pdmesh_tls::MeshTls::from_pem(ca.pem.as_bytes(), cert.as_bytes(), key.as_bytes()).unwrap();
    for auth in [over(foreign), mesh()] {
        let (addr, task, delivered, _) =
            receiver_with(l.clone(), None, over(ca.mesh(&["127.0.0.1"]))).await;
        if let Ok(mut tx) = TcpSender::connect(addr, &l, quick(), (&auth, "127.0.0.1"), SEVEN).await
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
    let refused = match TcpSender::connect(addr, &l, quick(), (&worker, "127.0.0.1"), SEVEN).await {
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
    let err = match TcpSender::connect(addr, &theirs, quick(), (&mesh(), "127.0.0.1"), SEVEN).await
    {
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

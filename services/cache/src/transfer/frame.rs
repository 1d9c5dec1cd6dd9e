//! The transport's framing: the constants of its frames and the helpers that read and
//! write their parts, each read and write under a deadline.

use std::future::Future;
use std::io;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};

use super::TransferError;

/// A connection the transport runs over: plain tcp, or TLS over tcp.
pub(super) trait Conn: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Conn for T {}
pub(super) type Stream = Box<dyn Conn>;

pub(super) const MAGIC: [u8; 4] = *b"PDKV";
/// The read buffer in front of the socket: small, since pages are read in runs much larger
/// than it, which bypass it (no copy through the buffer); headers gather in it.
pub(super) const READ_BUFFER: usize = 16 << 10;
/// Bytes of pages the receiver reads at once (whole pages, at least one), and the sender
/// writes at once.
pub(super) const READ_RUN: usize = 256 << 10;
/// Longest text a peer may send in a hello.
pub(super) const MAX_TEXT: u32 = 64 << 10;
pub(super) const HEAD: usize = 20;
pub(super) const PAGE_HEAD: usize = 12;

pub(super) const ACK_OK: u8 = 0;
pub(super) const ACK_CHECKSUM: u8 = 2;
pub(super) const ACK_REFUSED: u8 = 3;

pub(super) async fn deadline<T>(
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

pub(super) async fn read_blob<R: AsyncReadExt + Unpin>(
    r: &mut R,
    max: usize,
) -> io::Result<Vec<u8>> {
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

pub(super) async fn read_text<R: AsyncReadExt + Unpin>(r: &mut R) -> io::Result<String> {
    let buf = read_blob(r, MAX_TEXT as usize).await?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

pub(super) fn put_blob(out: &mut Vec<u8>, b: &[u8], max: usize) {
    let b = &b[..b.len().min(max)];
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

pub(super) fn put_text(out: &mut Vec<u8>, s: &str) {
    put_blob(out, s.as_bytes(), MAX_TEXT as usize);
}

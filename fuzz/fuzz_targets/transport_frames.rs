//! The page transport's receiver on what a sender may send. The first byte picks how the
//! rest is read: bit 0 puts the real hello (mesh token, lease, layout) first; bit 1 makes
//! the rest a script of batches built with real checksums (some of them corrupted,
//! mis-sized or cut short) instead of raw bytes. The receiver must end with an error or a
//! clean close within its deadlines, hand the sink only pages whose checksum matched, and
//! never panic or allocate what a frame merely claims.
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use pdmesh_cache::transfer::{self, InPage, Sink, TcpOptions};
use pdmesh_kv::{DType, KvLayout, page_checksum};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "fuzz-mesh-token-0123456789abcdef0123456789abcdef";

struct Pages<'a> {
    layout: &'a KvLayout,
    taken: usize,
}

impl Sink for Pages<'_> {
    type Refusal = &'static str;
    fn page(&mut self, p: InPage<'_>) -> Result<(), &'static str> {
        assert_eq!(p.bytes.len(), self.layout.bytes_per_page());
        assert_eq!(
            page_checksum(p.bytes),
            p.checksum,
            "a page whose checksum failed"
        );
        self.taken += 1;
        // Refuse some pages, as a room that is not transferring would.
        if p.room % 3 == 2 {
            return Err("room not transferring");
        }
        Ok(())
    }
}

fn hello(layout: &KvLayout) -> Vec<u8> {
    let mut h = b"PDKV".to_vec();
    h.extend(transfer::VERSION.to_le_bytes());
    h.push(TOKEN.len() as u8);
    h.extend(TOKEN.as_bytes());
    h.extend([7u8; 16]); // the sender's lease
    h.extend(layout.fingerprint().to_le_bytes());
    h.extend((layout.bytes_per_page() as u64).to_le_bytes());
    let d = transfer::describe(layout);
    h.extend((d.len() as u32).to_le_bytes());
    h.extend(d.as_bytes());
    h
}

/// Batches from a script of 4-byte steps `[room, pages, faults, trailer]`: each a batch
/// of `pages % 4` whole pages for room `room % 4`, its trailer `trailer % 32` bytes;
/// `faults` bit 0 corrupts a page's bytes, bit 1 claims `pages` more pages than follow,
/// bit 2 claims a huge trailer, bit 3 cuts the stream inside the batch.
fn script(layout: &KvLayout, steps: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    for (seq, step) in steps.chunks_exact(4).enumerate() {
        let [room, pages, faults, trailer] = [step[0], step[1], step[2], step[3]];
        let (n, tail) = (u32::from(pages % 4), usize::from(trailer % 32));
        let claimed = if faults & 2 != 0 {
            n + u32::from(pages)
        } else {
            n
        };
        let claimed_tail = if faults & 4 != 0 {
            u32::MAX
        } else {
            tail as u32
        };
        out.extend(u64::from(room % 4).to_le_bytes());
        out.extend((seq as u32).to_le_bytes());
        out.extend(claimed.to_le_bytes());
        out.extend(claimed_tail.to_le_bytes());
        for i in 0..n {
            let mut bytes: Vec<u8> = (0..layout.bytes_per_page())
                .map(|b| (b as u8).wrapping_mul(31).wrapping_add(room ^ i as u8))
                .collect();
            let checksum = page_checksum(&bytes);
            if faults & 1 != 0 && i == 0 {
                bytes[0] ^= 0x40;
            }
            out.extend(i.to_le_bytes());
            out.extend(checksum.to_le_bytes());
            out.extend(bytes);
        }
        out.extend(std::iter::repeat_n(trailer, tail));
        if faults & 8 != 0 {
            out.truncate(out.len() - usize::from(faults >> 4).min(out.len()));
            break;
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    // Small pages, so that inputs hold whole ones.
    let layout = KvLayout::llama(1, 1, 4, DType::F16, 2);
    let mut input = if mode & 1 == 1 {
        hello(&layout)
    } else {
        Vec::new()
    };
    if mode & 2 == 2 {
        input.extend(script(&layout, rest));
    } else {
        input.extend_from_slice(rest);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let (near, far) = tokio::io::duplex(1 << 16);
        let (mut far_rd, mut far_wr) = tokio::io::split(far);
        // The sender: its bytes, then the end of the stream; replies are read and dropped.
        let send = async move {
            let _ = far_wr.write_all(&input).await;
            let _ = far_wr.shutdown().await;
            drop(far_wr);
        };
        let drain = async move {
            let mut sink = Vec::new();
            let _ = far_rd.read_to_end(&mut sink).await;
        };
        let auth = pdmesh_tls::MeshAuth::token(
            pdmesh_tls::MeshToken::parse(TOKEN, "the fuzz target").unwrap(),
        );
        let opts = TcpOptions {
            io_timeout: Duration::from_millis(200),
            idle_timeout: Duration::from_millis(200),
            ..TcpOptions::default()
        };
        let sink = Pages {
            layout: &layout,
            taken: 0,
        };
        let serve = transfer::serve_stream(near, ("fuzz".into(), None), &auth, &layout, opts, sink);
        let (_, _, served) = tokio::join!(send, drain, serve);
        let _ = served;
    });
});

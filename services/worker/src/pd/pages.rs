//! The pages a hand-over moves: staged out of the prefill engine with each page's
//! checksum, written into their mirror slots and checked against those checksums, and the
//! report and error when one changed on the way (the seed's index-K fault included).

use pdmesh_engine::GenRequest;
use pdmesh_kv::KvLayout;

use super::PdError;
use crate::actor::EngineHandle;
use crate::faults::Missize;
use crate::incidents::{BadPage, Handed, Incidents};

#[cfg(test)]
mod tests;

/// Copies prefilled request `id`'s pages (submission `ticket`'s) from the `held`-th on out
/// of the engine (on its thread, between steps) into one buffer, `page_bytes` each, with
/// each page's checksum taken from the engine's own bytes.
pub(super) async fn stage(
    engine: &EngineHandle,
    (id, ticket): (&str, u64),
    held: usize,
    page_bytes: usize,
) -> Result<(Vec<u8>, Vec<u64>), PdError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    engine
        .export(
            id.to_owned(),
            ticket,
            Box::new(move |src: &[&[u8]]| {
                let staged = stage_pages(src, held, page_bytes);
                let sums = staged.as_ref().map(|(_, s)| s.clone()).unwrap_or_default();
                let _ = tx.send(staged);
                sums
            }),
        )
        .await?;
    rx.await
        .map_err(|_| PdError::Internal("the engine exported no pages".into()))?
        .map_err(|e| PdError::Internal(e.to_string()))
}

/// The engine's KV pages are not the size of the cache service's: nothing is copied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the engine's KV pages are {engine} bytes, the cache service's {cache}")]
pub(super) struct PageSizeMismatch {
    engine: usize,
    cache: usize,
}

/// The pages of `src` from the `held`-th on, copied into one buffer with each one's
/// checksum. A page of another size than the cache service's is refused, naming both
/// sizes, not copied into a buffer sized for the other.
fn stage_pages(
    src: &[&[u8]],
    held: usize,
    page_bytes: usize,
) -> Result<(Vec<u8>, Vec<u64>), PageSizeMismatch> {
    let src = src.get(held..).unwrap_or_default();
    if let Some(p) = src.iter().find(|p| p.len() != page_bytes) {
        return Err(PageSizeMismatch {
            engine: p.len(),
            cache: page_bytes,
        });
    }
    let mut buf = vec![0u8; src.len() * page_bytes];
    let sums = src
        .iter()
        .zip(buf.chunks_exact_mut(page_bytes))
        .map(|(page, dst)| {
            dst.copy_from_slice(page);
            pdmesh_kv::page_checksum(dst)
        })
        .collect();
    Ok((buf, sums))
}

/// Writes the staged pages into their mirror slots. Each write checksums what it wrote,
/// which must equal the checksum taken from the engine's bytes: a page that changed on
/// the way is an error here (the pages that did, named), not a corrupted answer later.
/// `missize` is the seed's fault: a copy through a buffer sized for fp8 index-K, either
/// caught by these checksums or, `Unchecked`, checksummed after the loss as the seed's
/// code did, so that nothing downstream can tell.
pub(super) fn write_pages(
    mirror: &pdmesh_cache_client::mirror::Mirror,
    staged: &[u8],
    slots: &[u32],
    sums: &[u64],
    missize: Option<(Missize, &KvLayout)>,
) -> Result<Result<Vec<u64>, Vec<BadPage>>, PdError> {
    let page_bytes = mirror.page_bytes();
    if staged.len() != slots.len() * page_bytes || sums.len() != slots.len() {
        return Err(PdError::Internal(format!(
            "{} staged bytes and {} checksums for {} slots of {page_bytes} bytes",
            staged.len(),
            sums.len(),
            slots.len()
        )));
    }
    let mut bad = Vec::new();
    let written = staged
        .chunks_exact(page_bytes)
        .zip(slots)
        .zip(sums)
        .enumerate()
        .map(|(index, ((page, &slot), &expected))| {
            let found = match missize {
                None => mirror.write_checked(slot, page),
                Some((_, layout)) => {
                    let mut copy = page.to_vec();
                    pdmesh_kv::faults::truncate_bf16_index_k_like_fp8(layout, &mut copy);
                    mirror.write_checked(slot, &copy)
                }
            };
            if found != expected && missize.is_none_or(|(m, _)| m == Missize::Checked) {
                bad.push(BadPage {
                    index,
                    slot,
                    expected,
                    found,
                });
            }
            found
        })
        .collect();
    Ok(if bad.is_empty() {
        Ok(written)
    } else {
        Err(bad)
    })
}

/// Files the report of a hand-over whose pages changed between the prefill engine and
/// the mirror: the pages, and the engine's layout beside the staging buffer's (another
/// one only under the seed's fault, whose differences the report then marks).
pub(super) fn report_write(
    inc: &Incidents,
    (req, trace_id, room): (&GenRequest, &str, u64),
    bad: &[BadPage],
    pages: usize,
    engine: &KvLayout,
    missize: Option<Missize>,
) {
    let staging = missize
        .and_then(|_| pdmesh_kv::faults::fp8_sized_index_k(engine))
        .unwrap_or_else(|| engine.clone());
    let layouts = pdmesh_incident::LayoutPair {
        ours_label: "prefill engine".into(),
        ours: pdmesh_incident::LayoutView::of(engine),
        theirs_label: "host staging buffer".into(),
        theirs: pdmesh_incident::LayoutView::of(&staging),
    };
    let diffs = layouts.differences();
    let cause = if diffs.is_empty() {
        "The staging buffer has the engine's layout, so the bytes changed in the copy \
         itself (host memory, or a write into the wrong slot)."
            .to_owned()
    } else {
        format!(
            "The staging buffer was sized with another layout than the engine's ({}): \
             a copy through it loses what does not fit.",
            diffs.join("; ")
        )
    };
    let summary = format!(
        "Room {room}: {} of the {pages} pages this prefill wrote to the host mirror for \
         decode do not match the checksums taken from the engine's own bytes. {cause} The \
         request failed with DATA_LOSS before its room committed, so decode never used \
         these pages and no corrupted answer was sent.",
        bad.len()
    );
    let h = Handed {
        req,
        trace_id,
        room,
    };
    inc.handover_checksum("hand-over write", &h, (bad, pages), Some(layouts), summary);
}

/// The DATA_LOSS a hand-over's changed pages end the request with.
pub(super) fn changed(bad: &[BadPage], of: usize, between: &str) -> PdError {
    let b = bad[0];
    PdError::Corrupt(format!(
        "{} of {of} pages changed between {between}: page {} (mirror slot {}) has checksum {:#018x}, the engine's {:#018x}",
        bad.len(),
        b.index,
        b.slot,
        b.found,
        b.expected
    ))
}

//! flip-host-bytes: bytes of every page in the cache service's host mirror inverted, so
//! the workers' checksums must catch them.

use std::path::{Path, PathBuf};

use super::args::ChaosError;
use super::ctx::{Ctx, Outcome};
use super::process::check_process;
use super::verdict::Check;
use crate::mesh;

/// The path of the host mirror's shared-memory file, from the cache service's mappings.
fn mirror_path(pid: u32) -> Result<PathBuf, ChaosError> {
    let err = |why: String| ChaosError::Mirror { pid, why };
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(|e| err(format!("reading /proc/{pid}/maps: {e}")))?;
    let line = maps
        .lines()
        .find(|l| l.contains("/pdmesh-mirror-"))
        .ok_or_else(|| {
            err("no pdmesh-mirror-* file is mapped (no worker registered yet?)".into())
        })?;
    // The path is the last field and the only one with a slash.
    let path = line
        .find('/')
        .map(|i| line[i..].trim_end())
        .ok_or_else(|| err(format!("unreadable mapping {line:?}")))?;
    if path.ends_with(" (deleted)") {
        return Err(err(format!("{path}: the file is gone")));
    }
    Ok(PathBuf::from(path))
}

/// Bytes flipped in a mirror file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Flipped {
    pub(super) bytes: u64,
    pub(super) file_bytes: u64,
}

/// Granularity of the flip: one byte in every block of this size that holds data.
pub(super) const FLIP_BLOCK: usize = 4096;

/// Inverts one byte in every [`FLIP_BLOCK`] of `path` that is not all zeros — every page a
/// worker wrote gets at least one — leaving never-written blocks (holes of the
/// shared-memory file) untouched.
pub(super) fn flip_file(path: &Path) -> std::io::Result<Flipped> {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let len = file.metadata()?.len();
    let mut buf = vec![0u8; 1 << 20];
    let mut out = Flipped {
        bytes: 0,
        file_bytes: len,
    };
    let mut at = 0u64;
    while at < len {
        let n = usize::try_from((len - at).min(buf.len() as u64)).unwrap_or(buf.len());
        file.read_exact_at(&mut buf[..n], at)?;
        for (i, block) in buf[..n].chunks(FLIP_BLOCK).enumerate() {
            if block.iter().any(|&b| b != 0) {
                let off = at + (i * FLIP_BLOCK) as u64;
                file.write_all_at(&[!block[0]], off)?;
                out.bytes += 1;
            }
        }
        at += n as u64;
    }
    Ok(out)
}

/// flip-host-bytes: the healthy pass wrote its pages to the host mirror; every worker's
/// device cache is flushed, bytes of every page in the mirror flipped, and the same
/// requests sent again: the workers' checksums must catch the pages and recompute them.
pub(super) async fn flip(ctx: &Ctx) -> Result<Outcome, ChaosError> {
    let (pid, port) = (ctx.mesh.pids.cache, ctx.mesh.cache);
    check_process(pid, "cache", port)?;
    let n = ctx.sessions.len();
    let mut passes = Vec::new();
    if ctx.args.reference.is_some() {
        // The reference answered elsewhere: warm the host mirror here first.
        eprintln!("warm pass: {n} requests, each alone, writing their pages to the host mirror");
        passes.push(ctx.pass(&ctx.client, &ctx.sessions, 1).await);
        let (b, _) = mesh::wait_baseline(&ctx.http, &ctx.gateway, ctx.settle).await;
        if !b.ok() {
            return Err(ChaosError::NotBaseline(b.describe()));
        }
    }
    let flushed = ctx.flush().await?;
    let path = mirror_path(pid)?;
    let file = path.clone();
    let flipped = tokio::task::spawn_blocking(move || flip_file(&file))
        .await
        .map_err(|e| ChaosError::Mirror {
            pid,
            why: format!("the flip did not finish: {e}"),
        })?
        .map_err(|e| ChaosError::Mirror {
            pid,
            why: format!("flipping bytes in {}: {e}", path.display()),
        })?;
    let before = mesh::sum(
        &ctx.metrics().await?,
        "mesh_kv_cache_checksum_failures_total",
    );
    eprintln!(
        "flushed {flushed} device pages, flipped {} bytes in {}; loaded pass: the same {n} requests at once",
        flipped.bytes,
        path.display()
    );
    passes.push(ctx.pass(&ctx.client, &ctx.sessions, n).await);
    Ok(Outcome {
        checks: vec![Check {
            name: "pages flipped",
            passed: flipped.bytes > 0,
            detail: format!(
                "{} bytes inverted in {} MiB of {} after {flushed} device pages were flushed",
                flipped.bytes,
                flipped.file_bytes >> 20,
                path.display()
            ),
        }],
        passes,
        settled: None,
        leavers: Vec::new(),
        fault: format!(
            "device caches flushed ({flushed} pages), one byte inverted in every written 4 KiB of the host mirror ({} bytes), the same {n} requests again",
            flipped.bytes
        ),
        checksum_before: Some(before),
    })
}

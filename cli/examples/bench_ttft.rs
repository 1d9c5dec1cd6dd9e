//! Time to first token for a long prompt: cold (computed), device hit (prefix cache of
//! the same engine), host hit (a fresh engine whose prefix comes back from the cache
//! service's shared-memory mirror) and disk hit (a fresh engine whose prefix the cache
//! service promotes from its disk tier, the mirror holding another prompt by then). Then
//! the disk tier's promote throughput: one match promoting a whole prompt's pages, against
//! `dd` reading the same bytes as one file in one stream, the page cache dropped before
//! each when this runs as root.
//!
//! `cargo run --release -p pdmesh-cli --example bench_ttft -- [PROMPT_TOKENS] [ROUNDS] [--tp N]`

use std::time::{Duration, Instant};

use std::os::unix::fs::PermissionsExt;

use pdmesh_cache::client::DataPlane;
use pdmesh_cache::{Config, MirrorSize, RemoteTier, TierConfig};
use pdmesh_engine::{Engine, EngineConfig, GenRequest, SamplingParams, StepEvent, WritePolicy};
use pdmesh_proto::cache::v1::{self as pb, cache_client::CacheClient};
use pdmesh_testkit::bench::{args, median, numbers, take_flag};
use pdmesh_testkit::service::{Service, credentials};

fn ttft(e: &mut Engine, id: &str, prompt: &[u32]) -> f64 {
    let t = Instant::now();
    e.submit(GenRequest {
        id: id.into(),
        prompt: prompt.to_vec(),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(1)
        },
    })
    .unwrap();
    let mut first = None;
    while e.has_work() || e.awaiting_host() > 0 {
        if !e.has_work() {
            // Waiting for the host tier's answer: its waker unparks this thread.
            std::thread::park_timeout(Duration::from_millis(100));
            continue;
        }
        for ev in e.step() {
            if matches!(ev, StepEvent::Token { .. }) && first.is_none() {
                first = Some(t.elapsed().as_secs_f64());
            }
        }
    }
    first.expect("a first token")
}

fn main() {
    let mut args = args();
    // `--tp N`: tensor-parallel ranks (1, unsharded, by default).
    let tp = take_flag(&mut args, "--tp").unwrap_or(1);
    let args = numbers(&args);
    let n = *args.first().unwrap_or(&2048);
    let rounds = *args.get(1).unwrap_or(&3);
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The mirror holds one prompt: the next one evicts it to the disk tier.
    let disk = tempfile::tempdir().unwrap();
    std::fs::set_permissions(disk.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let mut cfg = Config::new(MirrorSize::Tokens(n as u64));
    cfg.tls = credentials();
    cfg.disk.disk_dir = Some(disk.path().join("pages"));
    cfg.disk.disk_promote_timeout_ms = 8_000;
    let cache = rt.block_on(Service::start(|listener, shutdown| {
        pdmesh_cache::run(cfg, listener, shutdown)
    }));
    let url = cache.url();

    let engine = |tier: bool| {
        let mut cfg = EngineConfig::new(pdmesh_gguf::models::require_default_model());
        cfg.kv_pages = 512;
        cfg.prefill_chunk = 4096;
        cfg.tp = tp;
        let mut e = Engine::load(cfg).expect("load");
        if tier {
            let mut tc = TierConfig::new(
                url.clone(),
                "bench",
                DataPlane::Shm,
                pdmesh_tls::test_ca::auth(),
            );
            tc.call_timeout = Duration::from_secs(10);
            tc.retry_every = Duration::from_millis(20);
            let t = RemoteTier::start(rt.handle().clone(), tc, e.pool().layout().as_ref().clone());
            while !t.connected() {
                std::thread::sleep(Duration::from_millis(10));
            }
            e.set_host_tier(Box::new(t), WritePolicy::WriteThrough);
            e.set_host_waker(pdmesh_testkit::wake_here());
        }
        e
    };
    let stats = || {
        rt.block_on(async {
            let mut c = pdmesh_testkit::service::connect(&url, CacheClient::new).await;
            let s = c.stats(pb::StatsRequest {}).await.unwrap().into_inner();
            s.disk.unwrap_or_default()
        })
    };
    // Waits until the disk tier has spilled `pages` pages in all.
    let spilled = |pages: u64| {
        while stats().spilled_pages < pages {
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let prompt_of = |r: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| 100 + (i * 7 + r * 13) % 40_000)
            .collect()
    };
    let pages = (n / 16) as u64;
    let (mut cold, mut device, mut host, mut from_disk) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds as u32 {
        // A distinct prompt per round, so every cold run is really cold.
        let prompt = prompt_of(2 * r);
        let mut writer = engine(true);
        cold.push(ttft(&mut writer, "cold", &prompt));
        device.push(ttft(&mut writer, "device", &prompt));
        while writer.host_stats().queued_pages > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut reader = engine(true);
        host.push(ttft(&mut reader, "host", &prompt));
        assert!(
            reader.host_stats().hit_tokens as usize >= n - 16,
            "{:?}",
            reader.host_stats()
        );
        // Another prompt takes the mirror: this one's pages go to disk.
        let before = stats().spilled_pages;
        ttft(&mut writer, "other", &prompt_of(2 * r + 1));
        while writer.host_stats().queued_pages > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        spilled(before + pages);
        let mut reader = engine(true);
        from_disk.push(ttft(&mut reader, "disk", &prompt));
        assert!(
            reader.host_stats().hit_tokens as usize >= n - 16,
            "{:?} {:?}",
            reader.host_stats(),
            stats()
        );
    }
    let (c, d, h, k) = (
        median(cold),
        median(device),
        median(host),
        median(from_disk),
    );
    println!("time to first token, {n}-token prompt, median of {rounds}:");
    println!("  cold (computed):        {:8.1} ms", c * 1e3);
    println!(
        "  device prefix hit:      {:8.1} ms  ({:.3}x cold)",
        d * 1e3,
        d / c
    );
    println!(
        "  host mirror hit (shm):  {:8.1} ms  ({:.3}x cold)",
        h * 1e3,
        h / c
    );
    println!(
        "  disk tier hit:          {:8.1} ms  ({:.3}x cold)",
        k * 1e3,
        k / c
    );
    promote_vs_dd(&rt, &url, disk.path(), n, &engine, (&stats, &spilled));
    cache.shutdown.cancel();
}

/// Drops the page cache (root only): true if it did.
fn drop_caches() -> bool {
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// One match promoting a fresh prompt's pages from disk, timed, against `dd` reading the
/// same bytes as one file.
fn promote_vs_dd(
    rt: &tokio::runtime::Runtime,
    url: &str,
    disk: &std::path::Path,
    n: usize,
    engine: &dyn Fn(bool) -> Engine,
    (stats, spilled): (&dyn Fn() -> pb::DiskStats, &dyn Fn(u64)),
) {
    let prompt: Vec<u32> = (0..n as u32).map(|i| 200 + (i * 11) % 30_000).collect();
    let other: Vec<u32> = (0..n as u32).map(|i| 300 + (i * 5) % 30_000).collect();
    let mut writer = engine(true);
    ttft(&mut writer, "p", &prompt);
    let layout = writer.pool().layout().as_ref().clone();
    while writer.host_stats().queued_pages > 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let before = stats().spilled_pages;
    ttft(&mut writer, "o", &other);
    while writer.host_stats().queued_pages > 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let hashes = pdmesh_kv::page_hashes(layout.fingerprint(), &prompt, layout.page_size());
    spilled(before + hashes.len() as u64);
    let files: Vec<std::path::PathBuf> = hashes
        .iter()
        .map(|h| disk.join("pages").join(format!("{h:016x}.page")))
        .collect();
    let bytes: u64 = files
        .iter()
        .map(|f| std::fs::metadata(f).map_or(0, |m| m.len()))
        .sum();
    let (found, promote, dropped) = rt.block_on(async {
        let mut c = pdmesh_cache::client::HostClient::connect(
            url,
            ("bench", ""),
            &layout,
            DataPlane::Shm,
            &pdmesh_tls::test_ca::auth(),
        )
        .await
        .unwrap();
        let dropped = drop_caches();
        let t = Instant::now();
        let found = c.match_pages(&hashes).await.unwrap().len();
        (found, t.elapsed().as_secs_f64(), dropped)
    });
    assert_eq!(found, hashes.len(), "every page promoted");
    // The same bytes as one file on the same file system, read in one stream by `dd`.
    let one = disk.join("all-pages");
    {
        let mut out = std::fs::File::create(&one).unwrap();
        for f in &files {
            std::io::copy(&mut std::fs::File::open(f).unwrap(), &mut out).unwrap();
        }
        out.sync_all().unwrap();
    }
    drop_caches();
    let t = Instant::now();
    let ok = std::process::Command::new("dd")
        .arg(format!("if={}", one.display()))
        .args(["of=/dev/null", "bs=1M", "status=none"])
        .status()
        .unwrap()
        .success();
    let dd = t.elapsed().as_secs_f64();
    assert!(ok, "dd {}", one.display());
    let gbps = |s: f64| bytes as f64 / s / 1e9;
    println!(
        "disk promote, {} pages ({:.1} MB, page cache {}):",
        hashes.len(),
        bytes as f64 / 1e6,
        if dropped {
            "dropped before each"
        } else {
            "warm"
        }
    );
    println!("  one match promoting:    {:8.3} GB/s", gbps(promote));
    println!(
        "  dd of the same bytes:   {:8.3} GB/s  (promote {:.2}x dd)",
        gbps(dd),
        dd / promote
    );
}

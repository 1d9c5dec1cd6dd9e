//! Time to first token for a long prompt: cold (computed), device hit (prefix cache of
//! the same engine), host hit (a fresh engine whose prefix comes back from the cache
//! service's shared-memory mirror).
//!
//! `cargo run --release -p pdmesh-cli --example bench_ttft -- [PROMPT_TOKENS] [ROUNDS] [--tp N]`

use std::time::{Duration, Instant};

use pdmesh_cache::client::DataPlane;
use pdmesh_cache::{Config, MirrorSize, RemoteTier, TierConfig};
use pdmesh_engine::{Engine, EngineConfig, GenRequest, SamplingParams, StepEvent, WritePolicy};
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
    let mut cfg = Config::new(MirrorSize::Bytes(1 << 30));
    cfg.tls = credentials();
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
    let (mut cold, mut device, mut host) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        // A distinct prompt per round, so every cold run is really cold.
        let prompt: Vec<u32> = (0..n as u32)
            .map(|i| 100 + (i * 7 + r as u32 * 13) % 40_000)
            .collect();
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
    }
    let (c, d, h) = (median(cold), median(device), median(host));
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
    cache.shutdown.cancel();
}

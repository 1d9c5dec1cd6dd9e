//! Time to first token for a long prompt: cold (computed), device hit (prefix cache of
//! the same engine), host hit (a fresh engine whose prefix comes back from the cache
//! service's shared-memory mirror).
//!
//! `cargo run --release -p pdmesh-cli --example bench_ttft -- [PROMPT_TOKENS] [ROUNDS] [--tp N]`

use std::time::{Duration, Instant};

use pdmesh_cache::client::DataPlane;
use pdmesh_cache::{Config, MirrorSize, RemoteTier, TierConfig};
use pdmesh_engine::{Engine, EngineConfig, GenRequest, SamplingParams, StepEvent, WritePolicy};

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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // `--tp N`: tensor-parallel ranks (1, unsharded, by default).
    let tp = match args.iter().position(|a| a == "--tp") {
        Some(i) => {
            let n = args
                .get(i + 1)
                .and_then(|a| a.parse().ok())
                .expect("--tp N");
            args.drain(i..i + 2);
            n
        }
        None => 1,
    };
    let args: Vec<usize> = args.iter().map(|a| a.parse().expect("number")).collect();
    let n = *args.first().unwrap_or(&2048);
    let rounds = *args.get(1).unwrap_or(&3);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let mut cache = Config::new(MirrorSize::Bytes(1 << 30));
    cache.tls = pdmesh_tls::test_ca::args();
    rt.spawn(pdmesh_cache::run(cache, listener, shutdown.clone()));

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
    shutdown.cancel();
}

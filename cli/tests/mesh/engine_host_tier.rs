//! The host tier of the KV cache, through a real cache service on loopback: multi-turn
//! sessions give bit-identical tokens and logits when their prefixes come back from the
//! shared-memory mirror (device pool too small to keep them) over either data plane, with
//! each write policy; a byte flipped in the mirror is caught, recomputed and counted; and
//! a cache service that is not there costs nothing but the host hits. The DeepSeek tiny
//! model goes through the mirror in two of its cache forms over both planes too.

use std::time::Duration;

use crate::engine_common::{assert_same_turns, available, greedy, run_all, sessions};
use pdmesh_cache::client::DataPlane;
use pdmesh_cache::{Config, MirrorSize, RemoteTier, TierConfig};
use pdmesh_engine::{Engine, WritePolicy};
use pdmesh_testkit::service::{Service, credentials};

/// A cache service on its own runtime, its mirror file in a temporary directory.
struct Cache {
    rt: tokio::runtime::Runtime,
    svc: Service<pdmesh_cache::Error>,
    dir: tempfile::TempDir,
}

impl Cache {
    fn start(size: &str) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::new(size.parse::<MirrorSize>().unwrap());
        cfg.tls = credentials();
        cfg.shm_dir = Some(dir.path().to_owned());
        let svc = rt.block_on(Service::start(|listener, shutdown| {
            pdmesh_cache::run(cfg, listener, shutdown)
        }));
        Self { rt, svc, dir }
    }

    /// Attach the host tier to `e` and wait until it registered.
    fn attach(&self, e: &mut Engine, plane: DataPlane, policy: WritePolicy) {
        let tier = self.tier(e, plane);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !tier.connected() {
            assert!(std::time::Instant::now() < deadline, "never connected");
            std::thread::sleep(Duration::from_millis(20));
        }
        e.set_host_tier(Box::new(tier), policy);
        e.set_host_waker(pdmesh_testkit::wake_here());
    }

    fn tier(&self, e: &Engine, plane: DataPlane) -> RemoteTier {
        let layout = e.pool().layout().as_ref().clone();
        let mut cfg = TierConfig::new(
            self.svc.url(),
            format!("test-{plane:?}"),
            plane,
            pdmesh_tls::test_ca::auth(),
        );
        cfg.call_timeout = Duration::from_secs(5);
        cfg.retry_every = Duration::from_millis(50);
        RemoteTier::start(self.rt.handle().clone(), cfg, layout)
    }

    /// The mirror file's path (in the service user's private directory under --shm-dir).
    fn file(&self) -> std::path::PathBuf {
        let dirs = pdmesh_cache::mirror::dirs(Some(self.dir.path()));
        let mut files: Vec<_> = std::fs::read_dir(&dirs[0])
            .unwrap()
            .map(|f| f.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1, "{files:?}");
        files.remove(0)
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        self.svc.shutdown.cancel();
    }
}

#[test]
fn slow_eighty_sessions_are_bit_identical_with_no_cache_the_device_tier_and_the_host_mirror() {
    const N: usize = 80;
    let mut plain = crate::engine_common::engine(|c| {
        c.prefix_cache = false;
        c.kv_pages = 2048;
    });
    let reference = sessions(&mut plain, N);
    // The device tier alone against no cache is prefix_cache.rs's slow test.

    // Shared memory with write-through (the default) and with selective write-through
    // take all 80 sessions through a pool of 72 pages; the selective policy needs that
    // many to see pages hit on the device before it writes them (with 20 sessions none
    // came back from the host). The gRPC plane and write-back move the same pages by
    // other paths: a quarter of the sessions, through a pool too small for them as
    // well, still evict and reload from the host, in a quarter of the time. Each
    // session's answers do not depend on which others ran beside it, so a quarter is
    // compared with the same sessions of the reference.
    for (plane, policy, n, pages) in [
        (DataPlane::Shm, WritePolicy::WriteThrough, N, 72),
        (
            DataPlane::Shm,
            WritePolicy::WriteThroughSelective { hits: 1 },
            N,
            72,
        ),
        (DataPlane::Grpc, WritePolicy::WriteThrough, N / 4, 36),
        (DataPlane::Shm, WritePolicy::WriteBack, N / 4, 36),
    ] {
        let what = format!("host tier over {plane:?} with {policy:?}, {n} sessions");
        let cache = Cache::start("512MiB");
        let mut e = crate::engine_common::engine(|c| c.kv_pages = pages);
        cache.attach(&mut e, plane, policy);
        let got = sessions(&mut e, n);
        assert!(got.iter().all(|turn| turn.len() == n), "{what}");
        // Every session that ran, against the reference's same session.
        assert_same_turns(&got, &reference, &what);
        let st = e.host_stats();
        assert!(
            st.hit_tokens > 0,
            "{what}: nothing came from the host: {st:?}"
        );
        assert!(st.written_pages > 0, "{what}: {st:?}");
        assert_eq!(st.checksum_failures, 0, "{what}");
        assert!(
            e.cache_stats().evicted_pages > 0,
            "{what}: the device pool must evict"
        );
        assert_eq!(available(&e), pages, "{what}: pages leaked");
    }
}

#[test]
fn deepseek_sessions_are_bit_identical_through_the_host_mirror_over_both_planes() {
    use pdmesh_kv::{IndexKDtype, MlaCacheDtype};
    const N: usize = 40;
    for (mla, ik) in [
        (MlaCacheDtype::Bf16, IndexKDtype::Bf16),
        (MlaCacheDtype::Fp8, IndexKDtype::Fp8),
    ] {
        let form = |c: &mut pdmesh_engine::EngineConfig| {
            c.kv_cache_dtype = mla;
            c.index_k_dtype = ik;
        };
        let mut plain = crate::engine_common::tiny_engine(|c| {
            form(c);
            c.prefix_cache = false;
            c.kv_pages = 1024;
        });
        let reference = sessions(&mut plain, N);
        for plane in [DataPlane::Shm, DataPlane::Grpc] {
            let what = format!("{mla:?}/{ik:?} over {plane:?}");
            let cache = Cache::start("256MiB");
            // Too small to keep the histories: later turns load them from the mirror.
            let mut e = crate::engine_common::tiny_engine(|c| {
                form(c);
                c.kv_pages = 48;
            });
            cache.attach(&mut e, plane, WritePolicy::WriteThrough);
            let got = sessions(&mut e, N);
            assert_same_turns(&reference, &got, &what);
            let st = e.host_stats();
            assert!(
                st.hit_tokens > 0,
                "{what}: nothing came from the host: {st:?}"
            );
            assert_eq!(st.checksum_failures, 0, "{what}");
            assert_eq!(available(&e), 48, "{what}: pages leaked");
        }
    }
}

#[test]
fn a_byte_flipped_in_the_mirror_is_caught_recomputed_and_counted() {
    let cache = Cache::start("64MiB");
    let fx = crate::engine_common::fixture_prompts();
    let prompt: Vec<u32> = fx[0].iter().chain(&fx[1]).chain(&fx[2]).copied().collect();
    assert!(prompt.len() > 48);

    let mut writer = crate::engine_common::engine(|_| {});
    cache.attach(&mut writer, DataPlane::Shm, WritePolicy::WriteThrough);
    let first = run_all(&mut writer, vec![greedy("w", &prompt, 8)])
        .remove("w")
        .unwrap();
    crate::engine_common::wait_stored(&writer);
    assert!(writer.host_stats().written_pages >= 3);

    // Below the load threshold a host hit is recomputed, not loaded.
    let mut picky = crate::engine_common::engine(|c| c.host_min_pages = 1000);
    cache.attach(&mut picky, DataPlane::Shm, WritePolicy::WriteThrough);
    let got = run_all(&mut picky, vec![greedy("p", &prompt, 8)])
        .remove("p")
        .unwrap();
    assert_eq!(got.tokens, first.tokens);
    assert_eq!(picky.host_stats().hit_tokens, 0);

    // A fresh worker (empty device tier) loads the prefix from the host: intact.
    let mut clean = crate::engine_common::engine(|_| {});
    cache.attach(&mut clean, DataPlane::Grpc, WritePolicy::WriteThrough);
    let got = run_all(&mut clean, vec![greedy("c", &prompt, 8)])
        .remove("c")
        .unwrap();
    assert_eq!(got.tokens, first.tokens);
    assert!(clean.host_stats().hit_tokens >= 48);

    // Flip one byte in every slot of the mirror file.
    let path = cache.file();
    let mut bytes = std::fs::read(&path).unwrap();
    let layout = writer.pool().layout().clone();
    for slot in 0..bytes.len() / layout.bytes_per_page() {
        bytes[layout.page_offset(slot) + 4321] ^= 0x04;
    }
    std::fs::write(&path, &bytes).unwrap();

    let mut e = crate::engine_common::engine(|_| {});
    cache.attach(&mut e, DataPlane::Shm, WritePolicy::WriteThrough);
    let got = run_all(&mut e, vec![greedy("x", &prompt, 8)])
        .remove("x")
        .unwrap();
    assert_eq!(
        got.tokens, first.tokens,
        "a corrupt page must never be served"
    );
    for (a, b) in got.logits.iter().zip(&first.logits) {
        assert!(crate::engine_common::bits(a) == crate::engine_common::bits(b));
    }
    let st = e.host_stats();
    assert_eq!((st.checksum_failures, st.hit_tokens), (1, 0), "{st:?}");
}

/// The host tier keeps salts apart too: what one tenant's request wrote is loaded by a
/// fresh worker only for a request of the same salt; another salt, or none, recomputes
/// it, with the same answer.
#[test]
fn a_salted_prompt_comes_back_from_the_host_only_for_its_own_salt() {
    let cache = Cache::start("64MiB");
    let fx = crate::engine_common::fixture_prompts();
    let prompt: Vec<u32> = fx[0].iter().chain(&fx[1]).chain(&fx[2]).copied().collect();
    let salted = |id: &str, salt: Option<&str>| {
        let mut r = greedy(id, &prompt, 8);
        r.params.cache_salt = salt.map(str::to_owned);
        r
    };
    let mut writer = crate::engine_common::engine(|_| {});
    cache.attach(&mut writer, DataPlane::Shm, WritePolicy::WriteThrough);
    let first = run_all(&mut writer, vec![salted("w", Some("tenant-a"))])
        .remove("w")
        .unwrap();
    crate::engine_common::wait_stored(&writer);
    assert!(writer.host_stats().written_pages >= 3);
    for (salt, hit) in [
        (Some("tenant-b"), false),
        (None, false),
        (Some("tenant-a"), true),
    ] {
        // A fresh worker each time: its device tier holds nothing.
        let mut e = crate::engine_common::engine(|_| {});
        cache.attach(&mut e, DataPlane::Shm, WritePolicy::WriteThrough);
        let got = run_all(&mut e, vec![salted("r", salt)])
            .remove("r")
            .unwrap();
        assert_eq!(got.tokens, first.tokens, "{salt:?}");
        let st = e.host_stats();
        assert_eq!(st.hit_tokens > 0, hit, "{salt:?}: {st:?}");
    }
}

#[test]
fn without_a_cache_service_requests_are_served_from_the_device_tier() {
    // Nothing listens here: the tier never connects, and nothing waits on it.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let refusing = pdmesh_testkit::Refusing::new();
    let mut e = crate::engine_common::engine(|_| {});
    let mut cfg = TierConfig::new(
        refusing.url(),
        "lonely",
        DataPlane::Shm,
        pdmesh_tls::test_ca::auth(),
    );
    cfg.call_timeout = Duration::from_secs(1);
    cfg.retry_every = Duration::from_millis(50);
    let tier = RemoteTier::start(rt.handle().clone(), cfg, e.pool().layout().as_ref().clone());
    e.set_host_tier(Box::new(tier), WritePolicy::WriteThrough);
    e.set_host_waker(pdmesh_testkit::wake_here());
    let fx = crate::engine_common::fixture_prompts();
    let out = run_all(&mut e, vec![greedy("a", &fx[3], 6), greedy("b", &fx[3], 6)]);
    assert_eq!(out["a"].tokens, out["b"].tokens);
    assert_eq!(out["a"].tokens.len(), 6);
    assert_eq!(e.host_stats().hit_tokens, 0);
}

/// Gemma 3 through the host mirror: a page goes to the host tier whole, before the
/// sliding window passes it and its local layers are given back, so a fresh worker finds
/// both a prefix inside the part the window slid past and one past it on the host, and
/// answers with the bits of a worker without a cache.
#[test]
fn gemma3_prefixes_past_the_window_come_back_whole_from_the_host_mirror() {
    use pdmesh_engine::EngineConfig;
    let fx: serde_json::Value = pdmesh_testkit::fixture("gemma3_reference.json");
    let prompt = |name: &str| {
        let p = fx["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap();
        crate::engine_common::ids(&p["prompt_ids"])
    };
    let gemma = |f: &dyn Fn(&mut EngineConfig)| {
        let mut c = EngineConfig::new(pdmesh_gguf::models::require_gemma3_model());
        c.kv_pages = 128;
        c.capture_logits = true;
        f(&mut c);
        Engine::load(c).unwrap()
    };
    let mut long = prompt("long_recall");
    long.truncate(700);
    let cache = Cache::start("256MiB");
    let mut writer = gemma(&|_| {});
    cache.attach(&mut writer, DataPlane::Shm, WritePolicy::WriteThrough);
    let first = run_all(&mut writer, vec![greedy("w", &long, 4)])
        .remove("w")
        .unwrap();
    crate::engine_common::wait_stored(&writer);
    // The 43 whole pages of the prompt and the 3 tokens computed after it: the first 12
    // written as the window passed them, the rest when the request finished.
    assert_eq!(writer.host_stats().written_pages, 43);
    let inside = [&long[..160], &prompt("story")[..]].concat();
    let past = [&long[..], &first.tokens[..], &prompt("weekdays")[..]].concat();
    let mut cold = gemma(&|c| c.prefix_cache = false);
    for (id, p, pages) in [("inside", &inside, 10), ("past", &past, 43)] {
        // A fresh worker: its device tier holds nothing.
        let mut e = gemma(&|_| {});
        cache.attach(&mut e, DataPlane::Shm, WritePolicy::WriteThrough);
        let got = run_all(&mut e, vec![greedy(id, p, 6)]).remove(id).unwrap();
        let want = run_all(&mut cold, vec![greedy(id, p, 6)])
            .remove(id)
            .unwrap();
        assert_eq!(got.tokens, want.tokens, "{id}");
        for (a, b) in got.logits.iter().zip(&want.logits) {
            assert_eq!(
                crate::engine_common::bits(a),
                crate::engine_common::bits(b),
                "{id}"
            );
        }
        let st = e.host_stats();
        assert_eq!(st.hit_tokens, pages * 16, "{id}: {st:?}");
        assert_eq!(st.checksum_failures, 0, "{id}");
    }
}

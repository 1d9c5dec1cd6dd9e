//! The host tier across real processes: a `pdmesh cache` and `pdmesh worker --cache-url`,
//! driven over gRPC. A worker killed with SIGKILL loses its lease and the mirror takes its
//! pages back; a cache service killed and restarted under load fails no request, and the
//! worker registers with the new one.

use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use pdmesh_proto::cache::v1 as cpb;
use pdmesh_proto::worker::v1 as wpb;

/// Any free loopback port: the service binds port 0 and says which in its ports file.
const ANY: &str = "127.0.0.1:0";

/// A child process killed (SIGKILL) when dropped.
struct Proc(Child);

impl Proc {
    fn kill9(&mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Starts `pdmesh ARGS --listen LISTEN` and waits for its ports file: the process and
/// the address it bound.
fn spawn(listen: &str, args: &[String]) -> (Proc, SocketAddr) {
    let ports = tempfile::tempdir().unwrap();
    let file = ports.path().join("ports.json");
    let mut p = Proc(
        crate::pdmesh()
            .args(args)
            .args(["--listen", listen])
            .arg("--ports-file")
            .arg(&file)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let port = crate::ports_file(&mut p.0, &file)["listen"]
        .as_u64()
        .unwrap() as u16;
    (p, SocketAddr::from(([127, 0, 0, 1], port)))
}

/// A cache service on `listen` (`ANY`, or the port of the one it replaces).
fn cache(listen: &str, dir: &std::path::Path) -> (Proc, SocketAddr) {
    spawn(
        listen,
        &[
            "cache".into(),
            "--host-mirror-size".into(),
            "2000tokens".into(),
            "--lease-ttl-ms".into(),
            "600".into(),
            "--shm-dir".into(),
            dir.display().to_string(),
        ],
    )
}

fn worker(cache: SocketAddr) -> (Proc, SocketAddr) {
    let model = pdmesh_gguf::models::require_default_model();
    spawn(
        ANY,
        &[
            "worker".into(),
            "--model".into(),
            model.display().to_string(),
            "--kv-pages".into(),
            "256".into(),
            "--cache-url".into(),
            format!("http://{cache}"),
        ],
    )
}

async fn until<T>(what: &str, secs: u64, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn stats(addr: SocketAddr) -> Option<cpb::StatsResponse> {
    let mut c = pdmesh_tls::test_ca::client(
        format!("http://{addr}"),
        cpb::cache_client::CacheClient::new,
    )
    .await
    .ok()?;
    Some(c.stats(cpb::StatsRequest {}).await.ok()?.into_inner())
}

async fn worker_client(
    addr: SocketAddr,
) -> wpb::worker_client::WorkerClient<pdmesh_tls::AuthChannel> {
    until("the worker", 120, async || {
        let mut c = pdmesh_tls::test_ca::client(
            format!("http://{addr}"),
            wpb::worker_client::WorkerClient::new,
        )
        .await
        .ok()?;
        c.health(wpb::HealthRequest {})
            .await
            .ok()
            .filter(|r| r.get_ref().ok)?;
        Some(c)
    })
    .await
}

/// Greedy tokens of `prompt`, and the prompt tokens served from a cache.
async fn generate(
    c: &mut wpb::worker_client::WorkerClient<pdmesh_tls::AuthChannel>,
    id: &str,
    prompt: &[u32],
) -> Result<(Vec<u32>, u32), tonic::Status> {
    let mut stream = c
        .generate(wpb::GenerateRequest {
            request_id: id.into(),
            input_ids: prompt.to_vec(),
            sampling: Some(wpb::SamplingParams {
                temperature: Some(0.0),
                max_tokens: 6,
                ignore_eos: true,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut tokens = Vec::new();
    while let Some(m) = stream.message().await? {
        match m.kind {
            Some(wpb::generate_response::Kind::Chunk(ch)) => tokens.extend(ch.token_ids),
            Some(wpb::generate_response::Kind::Finished(f)) => {
                return Ok((tokens, f.cached_tokens));
            }
            None => {}
        }
    }
    Err(tonic::Status::internal("stream ended without Finished"))
}

/// A prompt of `n` tokens unique to `seed` after a shared 32-token head.
fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            if i < 32 {
                1000 + i
            } else {
                2000 + seed * 97 + i
            }
        })
        .collect()
}

#[test]
fn a_worker_killed_with_sigkill_loses_its_lease_and_the_mirror_reclaims_its_pages() {
    let dir = tempfile::tempdir().unwrap();
    let (_cache, caddr) = cache(ANY, dir.path());
    let (mut w, waddr) = worker(caddr);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = worker_client(waddr).await;
        until("the worker's registration", 30, async || {
            stats(caddr).await.filter(|s| s.leases == 1)
        })
        .await;
        // Fill the mirror (2000 tokens = 125 pages of 16) with this worker's pages.
        for i in 0..12 {
            generate(&mut c, &format!("fill{i}"), &prompt(i, 200))
                .await
                .unwrap();
        }
        let before = stats(caddr).await.unwrap();
        assert!(before.used_pages >= 100, "{before:?}");
        w.kill9();
        let after = until("the dead worker's lease to expire", 30, async || {
            stats(caddr).await.filter(|s| s.expired_leases == 1)
        })
        .await;
        assert_eq!((after.leases, after.pinned_pages), (0, 0), "{after:?}");
        // Its pages are evictable: a new worker stores its own in their place.
        let (_w2, w2addr) = worker(caddr);
        let mut c2 = worker_client(w2addr).await;
        for i in 100..106 {
            generate(&mut c2, &format!("new{i}"), &prompt(i, 200))
                .await
                .unwrap();
        }
        let last = stats(caddr).await.unwrap();
        assert!(last.evicted_pages > 0, "{last:?}");
    });
}

#[test]
fn restarting_the_cache_service_under_load_fails_no_request() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cache_proc, caddr) = cache(ANY, dir.path());
    let (_w, waddr) = worker(caddr);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = worker_client(waddr).await;
        until("registration", 30, async || {
            stats(caddr).await.filter(|s| s.leases == 1)
        })
        .await;
        // The expected answers, computed before any fault.
        let mut expected = Vec::new();
        for i in 0..8 {
            let mut c = c.clone();
            expected.push(
                generate(&mut c, &format!("ref{i}"), &prompt(i, 80))
                    .await
                    .unwrap()
                    .0,
            );
        }
        // Clients keep sending; meanwhile the cache service dies and comes back.
        let load = (0..4).map(|k| {
            let (mut c, expected) = (c.clone(), expected.clone());
            tokio::spawn(async move {
                let mut n = 0;
                for round in 0..12 {
                    let i = (round + k) % 8;
                    let (tokens, _) =
                        generate(&mut c, &format!("load{k}-{round}"), &prompt(i as u32, 80))
                            .await
                            .unwrap_or_else(|e| {
                                panic!("request failed during the cache restart: {e}")
                            });
                    assert_eq!(
                        tokens, expected[i],
                        "answer changed during the cache restart"
                    );
                    n += 1;
                }
                n
            })
        });
        let load: Vec<_> = load.collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        cache_proc.kill9();
        tokio::time::sleep(Duration::from_millis(500)).await;
        // On its port: the worker knows the service by its address.
        let _cache2 = cache(&caddr.to_string(), dir.path());
        let mut done = 0;
        for t in load {
            done += t.await.unwrap();
        }
        assert_eq!(done, 48);
        // The worker found the new service and uses it again.
        until("re-registration", 30, async || {
            stats(caddr).await.filter(|s| s.leases == 1)
        })
        .await;
        let mut c = c.clone();
        generate(&mut c, "after", &prompt(50, 80)).await.unwrap();
        let s = until("pages in the new mirror", 10, async || {
            stats(caddr).await.filter(|s| s.used_pages > 0)
        })
        .await;
        assert!(s.used_pages >= 4, "{s:?}");
    });
}

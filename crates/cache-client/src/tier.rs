//! [`RemoteTier`]: the `HostTier` an engine uses, over [`HostClient`]. The engine's thread
//! calls it synchronously; each call runs on a tokio runtime with a deadline. When the
//! cache service is down, slow, or forgot the lease, calls answer "nothing held" and
//! "nothing stored", the connection is dropped, and a background task registers again —
//! requests keep being served from the device tier alone meanwhile.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use pdmesh_kv::{HostLoad, HostPage, HostTier, KvLayout};
use pdmesh_proto::cache::v1 as pb;
use tokio::sync::Mutex;

use crate::client::{Corrupt, DataPlane, HostClient};

/// Told of each host page that fails its checksum on load (an incident report).
pub type OnCorrupt = Arc<dyn Fn(Corrupt) + Send + Sync>;

/// Where and how to reach the cache service.
#[derive(Clone, Debug)]
pub struct TierConfig {
    /// e.g. `http://127.0.0.1:50063`
    pub url: String,
    pub worker_id: String,
    pub plane: DataPlane,
    /// Deadline of each call made for the engine.
    pub call_timeout: Duration,
    /// Pause between registration attempts while disconnected.
    pub retry_every: Duration,
    /// The mesh credential.
    pub auth: pdmesh_tls::MeshAuth,
}

/// See the module docs.
pub struct RemoteTier {
    rt: tokio::runtime::Handle,
    client: Arc<Mutex<Option<HostClient>>>,
    timeout: Duration,
    failures: Arc<AtomicU64>,
    /// Registrations so far: each one may face a mirror that lost everything.
    registrations: Arc<AtomicU64>,
    reconnect: tokio::task::JoinHandle<()>,
    on_corrupt: Option<OnCorrupt>,
}

impl std::fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteTier")
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Drop for RemoteTier {
    fn drop(&mut self) {
        self.reconnect.abort();
    }
}

impl RemoteTier {
    /// Starts connecting in the background (on `rt`); the tier is usable at once and
    /// serves nothing until the first registration succeeds.
    pub fn start(rt: tokio::runtime::Handle, cfg: TierConfig, layout: KvLayout) -> Self {
        let client: Arc<Mutex<Option<HostClient>>> = Arc::default();
        let registrations: Arc<AtomicU64> = Arc::default();
        let reconnect = {
            let client = client.clone();
            let registrations = registrations.clone();
            rt.spawn(async move {
                let mut warned = false;
                loop {
                    let connected = client.lock().await.as_ref().is_some_and(HostClient::is_alive);
                    if !connected {
                        let attempt = tokio::time::timeout(
                            cfg.call_timeout.max(Duration::from_secs(1)),
                            HostClient::connect(
                                &cfg.url,
                                &cfg.worker_id,
                                &layout,
                                cfg.plane,
                                &cfg.auth,
                            ),
                        )
                        .await;
                        match attempt {
                            Ok(Ok(c)) => {
                                tracing::info!(url = %cfg.url, lease = %c.lease(), plane = ?cfg.plane, "host tier connected");
                                *client.lock().await = Some(c);
                                registrations.fetch_add(1, Ordering::Relaxed);
                                warned = false;
                            }
                            Ok(Err(crate::client::ClientError::Rpc(s)))
                                if s.code() == tonic::Code::FailedPrecondition =>
                            {
                                // Another layout: retrying cannot help. Say so once, loudly.
                                tracing::error!(url = %cfg.url, error = %s.message(), "the cache service refused this worker; serving without the host tier");
                                return;
                            }
                            Ok(Err(e)) if !warned => {
                                tracing::warn!(url = %cfg.url, error = %e, "host tier unavailable; serving from the device tier, retrying");
                                warned = true;
                            }
                            Err(_) if !warned => {
                                tracing::warn!(url = %cfg.url, "host tier registration timed out; retrying");
                                warned = true;
                            }
                            _ => {}
                        }
                    }
                    tokio::time::sleep(cfg.retry_every).await;
                }
            })
        };
        Self {
            rt,
            client,
            timeout: cfg.call_timeout,
            failures: Arc::default(),
            registrations,
            reconnect,
            on_corrupt: None,
        }
    }

    /// Calls `f` with each page that fails its checksum on load.
    pub fn on_corrupt(mut self, f: OnCorrupt) -> Self {
        self.on_corrupt = Some(f);
        self
    }

    /// Calls that failed or timed out (each dropped the connection).
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Whether a registered connection is up now.
    pub fn connected(&self) -> bool {
        self.rt.block_on(async {
            self.client
                .lock()
                .await
                .as_ref()
                .is_some_and(HostClient::is_alive)
        })
    }
}

/// Runs one call on the connected client under the deadline; on failure drops the
/// connection (its lease then expires at the service, releasing whatever it held).
macro_rules! call {
    ($self:ident, $c:ident => $body:expr) => {{
        let (timeout, failures, client) = ($self.timeout, &$self.failures, &$self.client);
        $self.rt.block_on(async {
            let mut guard = client.lock().await;
            let $c = guard.as_mut().filter(|c| c.is_alive())?;
            match tokio::time::timeout(timeout, $body).await {
                Ok(Ok(v)) => Some(v),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "host tier call failed; reconnecting");
                    failures.fetch_add(1, Ordering::Relaxed);
                    *guard = None;
                    None
                }
                Err(_) => {
                    tracing::warn!("host tier call timed out; reconnecting");
                    failures.fetch_add(1, Ordering::Relaxed);
                    *guard = None;
                    None
                }
            }
        })
    }};
}

impl HostTier for RemoteTier {
    fn lookup(&mut self, hashes: &[u64]) -> Vec<HostPage> {
        call!(self, c => c.match_pages(hashes))
            .unwrap_or_default()
            .into_iter()
            .map(|p| HostPage {
                hash: p.hash,
                slot: p.slot,
                checksum: p.checksum,
            })
            .collect()
    }

    fn load(&mut self, pages: &[HostPage], dsts: &mut [&mut [u8]]) -> HostLoad {
        let refs: Vec<pb::PageRef> = pages
            .iter()
            .map(|p| pb::PageRef {
                hash: p.hash,
                slot: p.slot,
                checksum: p.checksum,
            })
            .collect();
        match call!(self, c => c.load_into(&refs, dsts)) {
            Some(l) => {
                if let (Some(c), Some(f)) = (l.corrupt, &self.on_corrupt) {
                    f(c);
                }
                HostLoad {
                    pages: l.pages,
                    corrupt: l.corrupt.is_some(),
                }
            }
            None => HostLoad::default(),
        }
    }

    fn release(&mut self, pages: &[HostPage]) {
        let slots: Vec<u32> = pages.iter().map(|p| p.slot).collect();
        call!(self, c => c.release(&slots));
    }

    fn store(&mut self, pages: &[(u64, u64, &[u8])]) -> usize {
        call!(self, c => c.store(pages)).map_or(0, |s| s.written)
    }

    fn generation(&self) -> u64 {
        self.registrations.load(Ordering::Relaxed)
    }
}

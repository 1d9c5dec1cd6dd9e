//! What a scenario works with: the mesh, its clients and the requests ([`Ctx`]), the
//! passes it runs, and what it hands back ([`Outcome`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::args::{ChaosArgs, ChaosError};
use super::verdict::{Check, Settled};
use crate::client::{Answer, Client, RequestError};
use crate::mesh::{self, Baseline, MeshFile};
use crate::run::{self, Exchange, Level, RequestCfg};
use crate::workload::{Kind, Session, Spec};

/// Everything a scenario works with.
pub(super) struct Ctx {
    pub(super) args: ChaosArgs,
    pub(super) mesh: MeshFile,
    pub(super) gateway: String,
    pub(super) http: reqwest::Client,
    pub(super) client: Client,
    pub(super) cfg: RequestCfg,
    pub(super) deadline: Duration,
    pub(super) settle: Duration,
    /// The loaded pass's requests.
    pub(super) sessions: Vec<Session>,
}

impl Ctx {
    pub(super) fn spec(&self, n: usize, input_len: usize) -> Spec {
        Spec {
            kind: Kind::Random,
            sessions: n,
            turns: 1,
            input_len,
            output_len: self.args.max_tokens,
            seed: self.args.seed,
        }
    }

    /// Runs `sessions` with `concurrency` in flight.
    pub(super) async fn pass(
        &self,
        client: &Client,
        sessions: &[Session],
        concurrency: usize,
    ) -> Vec<Exchange> {
        let level = Level::Concurrency(u32::try_from(concurrency.max(1)).unwrap_or(u32::MAX));
        let (ex, _) = run::run_level(
            client,
            &self.cfg,
            sessions.to_vec(),
            level,
            self.args.seed,
            &|| {},
        )
        .await;
        ex
    }

    /// The reference answers: each request alone on the reference or the healthy mesh.
    pub(super) async fn reference(
        &self,
        sessions: &[Session],
    ) -> Result<HashMap<String, Answer>, ChaosError> {
        let client = match &self.args.reference {
            Some(url) => Client::new(url, self.args.api_key.clone(), self.deadline),
            None => self.client.clone(),
        };
        let ex = self.pass(&client, sessions, 1).await;
        let failed: Vec<&str> = ex
            .iter()
            .filter_map(|e| e.record.error.as_deref())
            .collect();
        if !failed.is_empty() {
            return Err(ChaosError::HealthyPass {
                failed: failed.len(),
                sent: ex.len(),
                kinds: failed.join(", "),
            });
        }
        Ok(ex
            .into_iter()
            .map(|e| (e.body.to_string(), e.answer))
            .collect())
    }

    pub(super) async fn wait_healthy(&self) -> Result<Duration, ChaosError> {
        let start = Instant::now();
        while !mesh::healthy(&self.http, &self.gateway).await {
            if start.elapsed() >= self.settle {
                return Err(ChaosError::Unhealthy {
                    gateway: self.gateway.clone(),
                    secs: self.settle.as_secs_f64(),
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(start.elapsed())
    }

    /// Waits until `--fault-after-s` after `start`: when the fault strikes. Returns when,
    /// and whether the load (which sets `done` when it ends) was still running.
    pub(super) async fn strike(&self, start: Instant, done: &AtomicBool) -> Strike {
        let after = Duration::from_secs_f64(self.args.fault_after_s.max(0.0));
        tokio::time::sleep_until(tokio::time::Instant::from_std(start + after)).await;
        Strike {
            at_s: start.elapsed().as_secs_f64(),
            under_load: !done.load(Ordering::Relaxed),
        }
    }

    /// The loaded pass: every request at once; `done` is set when they have all ended.
    pub(super) async fn loaded(&self, done: &AtomicBool) -> Vec<Exchange> {
        let ex = self
            .pass(&self.client, &self.sessions, self.sessions.len())
            .await;
        done.store(true, Ordering::Relaxed);
        ex
    }

    /// Waits until the mesh is healthy and back to baseline, up to `--settle-s` each.
    pub(super) async fn settle_now(&self) -> Settled {
        let (b, waited) = match self.wait_healthy().await {
            Ok(_) => mesh::wait_baseline(&self.http, &self.gateway, self.settle).await,
            Err(_) => (Baseline::default(), self.settle),
        };
        Settled::of(&b, waited)
    }

    pub(super) async fn metrics(&self) -> Result<mesh::Metrics, ChaosError> {
        Ok(mesh::scrape(&self.http, &format!("{}/metrics", self.gateway)).await?)
    }

    /// Every worker's device prefix cache flushed through the gateway; pages flushed.
    pub(super) async fn flush(&self) -> Result<u64, ChaosError> {
        let url = format!("{}/flush_cache", self.gateway);
        let err = |why: String| ChaosError::Flush {
            url: url.clone(),
            why,
        };
        let mut req = self.http.post(&url).timeout(Duration::from_secs(60));
        if let Some(k) = &self.args.api_key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await.map_err(|e| err(e.to_string()))?;
        let status = resp.status();
        let body: Value = resp.json().await.map_err(|e| err(e.to_string()))?;
        if !status.is_success() {
            return Err(err(format!("{status}: {}", body["error"]["message"])));
        }
        body["pages_flushed"]
            .as_u64()
            .ok_or_else(|| err(format!("no pages_flushed in {body}")))
    }
}

/// What a scenario did: its passes' requests (compared with the reference), clients meant
/// to leave ([`Client::chat_and_leave`]'s results), a description of the fault, and its
/// own checks.
#[derive(Default)]
pub(super) struct Outcome {
    pub(super) passes: Vec<Vec<Exchange>>,
    /// The mesh right after the fault, when a recovery pass followed.
    pub(super) settled: Option<Settled>,
    pub(super) leavers: Vec<Result<usize, RequestError>>,
    pub(super) fault: String,
    pub(super) checks: Vec<Check>,
    /// flip-host-bytes: the checksum failure counter before the pass over flipped pages.
    pub(super) checksum_before: Option<f64>,
}

/// When a fault struck.
#[derive(Clone, Copy, Debug)]
pub(super) struct Strike {
    pub(super) at_s: f64,
    pub(super) under_load: bool,
}

impl std::fmt::Display for Strike {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.under_load {
            write!(f, "{:.1} s into the load", self.at_s)
        } else {
            write!(
                f,
                "{:.1} s in, after the load had ended: lower --fault-after-s or raise --requests",
                self.at_s
            )
        }
    }
}

//! `pdmesh chaos SCENARIO`: a fault injected into a running mesh under load, ending in a
//! verdict. Against a mesh `pdmesh up --ports-json` started: a healthy pass (each request
//! alone: the reference answers, unless `--reference`), the load with the fault, then the
//! checks — every request ended in time with an answer or a clean error, the mesh came
//! back to baseline (no page, request, room or slot held), and every answer equals its
//! reference.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};

use crate::client::{Answer, Client};
use crate::mesh::{self, Baseline, MeshError, MeshFile, Mode};
use crate::run::{self, Exchange, Level, RequestCfg};
use crate::workload::{Kind, Session, Spec};

/// The faults.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scenario {
    /// SIGKILL the prefill worker mid-load (the mesh must run with `up --restart`).
    KillPrefill,
    /// SIGKILL the decode worker mid-load (the mesh must run with `up --restart`).
    KillDecode,
    /// SIGSTOP the cache service under load for --stall-s, then SIGCONT.
    StallCache,
    /// Clients that drop their streams during prefill and during decode.
    DisconnectClients,
    /// Many long requests at once, so decode pages run out: the refused ones must be 429s.
    ExhaustDecode,
    /// Flip bytes of the pages in the host mirror after flushing the device caches: the
    /// workers' checksums must catch them and recompute.
    FlipHostBytes,
}

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Self::KillPrefill => "kill-prefill",
            Self::KillDecode => "kill-decode",
            Self::StallCache => "stall-cache",
            Self::DisconnectClients => "disconnect-clients",
            Self::ExhaustDecode => "exhaust-decode",
            Self::FlipHostBytes => "flip-host-bytes",
        }
    }

    fn default_requests(self) -> usize {
        match self {
            Self::ExhaustDecode => 80,
            _ => 12,
        }
    }

    fn default_input_len(self) -> usize {
        match self {
            Self::ExhaustDecode => 512,
            _ => 300,
        }
    }
}

/// `pdmesh chaos`: one fault injected into a running mesh under load, then a verdict.
#[derive(Debug, clap::Args)]
pub struct ChaosArgs {
    /// The fault to inject.
    #[arg(value_enum)]
    pub scenario: Scenario,
    /// The ports file of the mesh (`pdmesh up --ports-json FILE`).
    #[arg(long, value_name = "FILE")]
    pub mesh: PathBuf,
    /// Compare answers with this OpenAI base URL's (each request sent alone) instead of
    /// the healthy mesh's own.
    #[arg(long, value_name = "URL")]
    pub reference: Option<String>,
    /// Bearer key for the gateway (and the reference).
    #[arg(long, env = "PDMESH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Model name to request (default: the first the gateway lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Requests in the loaded pass, all at once (default: 80 for exhaust-decode, else 12).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Prompt length in tokens, about (default: 512 for exhaust-decode, else 300).
    #[arg(long)]
    pub input_len: Option<usize>,
    /// Tokens each answer runs to.
    #[arg(long, default_value_t = 24)]
    pub max_tokens: u32,
    /// Every request must end (an answer or an HTTP error) within this many seconds.
    #[arg(long, default_value_t = 90.0)]
    pub deadline_s: f64,
    /// How long the mesh gets to be healthy and back to baseline after the fault.
    #[arg(long, default_value_t = 60.0)]
    pub settle_s: f64,
    /// The fault strikes this many seconds after the load started (kill-prefill,
    /// kill-decode, stall-cache): early, while the requests queue at prefill and hold
    /// their decode reservations.
    #[arg(long, default_value_t = 0.1)]
    pub fault_after_s: f64,
    /// stall-cache: how long the cache service stays stopped.
    #[arg(long, default_value_t = 20.0)]
    pub stall_s: f64,
    /// Seeds the prompts.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Directory for verdict.json.
    #[arg(long, default_value = "chaos-report")]
    pub out: PathBuf,
}

/// Why `pdmesh chaos` failed.
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    #[error(transparent)]
    Mesh(#[from] MeshError),
    #[error("{scenario} needs {what}")]
    Unsuitable {
        scenario: &'static str,
        what: String,
    },
    #[error("{0}")]
    Endpoint(String),
    #[error("the mesh is not healthy ({gateway}/health) after {secs:.0} s")]
    Unhealthy { gateway: String, secs: f64 },
    #[error("the mesh is not at baseline before the fault: {0}")]
    NotBaseline(String),
    #[error(
        "{failed} of {sent} requests of the healthy pass failed ({kinds}): there is nothing to compare with"
    )]
    HealthyPass {
        failed: usize,
        sent: usize,
        kinds: String,
    },
    #[error("pid {pid} is not the {service} of this mesh ({why}): is the ports file stale?")]
    WrongProcess {
        pid: u32,
        service: &'static str,
        why: String,
    },
    #[error("sending {signal} to the {service} (pid {pid})")]
    Signal {
        signal: &'static str,
        service: &'static str,
        pid: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("the host mirror of the cache service (pid {pid}): {why}")]
    Mirror { pid: u32, why: String },
    #[error("POST {url}: {why}")]
    Flush { url: String, why: String },
    #[error("installing signal handlers")]
    Handlers(#[source] std::io::Error),
    #[error("interrupted by {0} (a cache service it had stopped was resumed)")]
    Interrupted(&'static str),
    #[error("writing {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{scenario}: {failed} failed (verdict in {out})")]
    Failed {
        scenario: &'static str,
        failed: String,
        out: String,
    },
}

/// One check of the verdict.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub passed: bool,
    pub detail: String,
}

/// How the requests ended.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Tally {
    pub sent: u32,
    pub ok: u32,
    /// Clean errors by class: an HTTP status ("503"), or an error the gateway reported
    /// inside a stream it had begun ("in_stream:overloaded").
    pub refused: BTreeMap<String, u32>,
    pub timed_out: u32,
    /// Requests whose connection failed or broke off without an error: not clean.
    pub broken: BTreeMap<String, u32>,
    /// Clients that went away on purpose (disconnect-clients).
    pub left: u32,
    pub slowest_s: f64,
    pub deadline_s: f64,
}

/// How a request ended, from its error class (`None`: it succeeded).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Class {
    Ok,
    Refused(String),
    TimedOut,
    Broken(String),
}

fn classify(error: Option<&str>) -> Class {
    match error {
        None => Class::Ok,
        Some("timeout") => Class::TimedOut,
        Some(e) if e.starts_with("in_stream:") => Class::Refused(e.to_owned()),
        Some(e) if e.parse::<u16>().is_ok_and(|s| (400..600).contains(&s)) => {
            Class::Refused(e.to_owned())
        }
        Some(e) => Class::Broken(e.to_owned()),
    }
}

/// Whether a clean refusal means "overloaded": a 429, or its form inside a stream.
fn is_overloaded(class: &str) -> bool {
    class == "429" || class == "in_stream:overloaded"
}

impl Tally {
    fn new(deadline_s: f64) -> Self {
        Self {
            deadline_s,
            ..Self::default()
        }
    }

    /// Counts one request that ended with `error` after `secs`.
    fn add(&mut self, error: Option<&str>, secs: f64) {
        self.sent += 1;
        self.slowest_s = self.slowest_s.max(secs);
        match classify(error) {
            Class::Ok => self.ok += 1,
            Class::Refused(c) => *self.refused.entry(c).or_default() += 1,
            Class::TimedOut => self.timed_out += 1,
            Class::Broken(c) => *self.broken.entry(c).or_default() += 1,
        }
    }

    fn add_all(&mut self, ex: &[Exchange]) {
        for e in ex {
            self.add(e.record.error.as_deref(), e.record.e2e_s);
        }
    }

    fn refused_total(&self) -> u32 {
        self.refused.values().sum()
    }

    fn describe(&self) -> String {
        let by = |m: &BTreeMap<String, u32>| {
            m.iter()
                .map(|(k, n)| format!("{k} x{n}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut out = format!("{} sent: {} ok", self.sent, self.ok);
        if self.left > 0 {
            out.push_str(&format!(", {} left on purpose", self.left));
        }
        out.push_str(&format!(", {} refused", self.refused_total()));
        if !self.refused.is_empty() {
            out.push_str(&format!(" ({})", by(&self.refused)));
        }
        out.push_str(&format!(", {} timed out", self.timed_out));
        let broken: u32 = self.broken.values().sum();
        out.push_str(&format!(", {broken} broken off"));
        if !self.broken.is_empty() {
            out.push_str(&format!(" ({})", by(&self.broken)));
        }
        out.push_str(&format!(
            "; slowest {:.1} s of {:.0} s allowed",
            self.slowest_s, self.deadline_s
        ));
        out
    }
}

/// Answers compared with their reference.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Answers {
    pub compared: u32,
    pub differing: u32,
    /// A few of the differences, for people.
    pub examples: Vec<String>,
}

impl Answers {
    /// Compares every successful answer of `ex` with `reference`'s answer to the same body.
    fn compare(&mut self, reference: &HashMap<String, Answer>, ex: &[Exchange]) {
        for e in ex.iter().filter(|e| e.record.error.is_none()) {
            let Some(want) = reference.get(&e.body.to_string()) else {
                continue;
            };
            self.compared += 1;
            if &e.answer != want {
                self.differing += 1;
                if self.examples.len() < 5 {
                    self.examples.push(format!(
                        "got {:?} ({:?}), reference {:?} ({:?})",
                        e.answer.content, e.answer.finish_reason, want.content, want.finish_reason
                    ));
                }
            }
        }
    }
}

/// The mesh after the fault.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Settled {
    pub baseline: bool,
    pub waited_s: f64,
    pub pages_held: f64,
    pub pages_capacity: f64,
    pub detail: String,
}

impl Settled {
    fn of(b: &Baseline, waited: Duration) -> Self {
        Self {
            baseline: b.ok(),
            waited_s: waited.as_secs_f64(),
            pages_held: b.pages_held(),
            pages_capacity: b.pages_capacity,
            detail: b.describe(),
        }
    }
}

/// The verdict, as printed and as `verdict.json`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    pub scenario: Scenario,
    pub url: String,
    pub passed: bool,
    pub checks: Vec<Check>,
    /// What was done to the mesh.
    pub fault: String,
    pub requests: Tally,
    pub settled: Settled,
    pub answers: Answers,
    /// flip-host-bytes: checksum failures the workers counted during the pass after the
    /// flip (`mesh_kv_cache_checksum_failures_total`, risen by this much).
    pub checksum_failures: Option<f64>,
    pub duration_s: f64,
}

/// The three checks every scenario makes, then the scenario's own.
fn judge(
    tally: &Tally,
    settled: &Settled,
    answers: &Answers,
    reference: &str,
    own: Vec<Check>,
) -> Vec<Check> {
    let broken: u32 = tally.broken.values().sum();
    let mut checks = vec![
        Check {
            name: "requests ended in time",
            passed: tally.timed_out == 0 && broken == 0 && tally.slowest_s < tally.deadline_s,
            detail: tally.describe(),
        },
        Check {
            name: "no leaked pages",
            passed: settled.baseline,
            detail: if settled.baseline {
                format!(
                    "back to baseline after {:.1} s: {}",
                    settled.waited_s, settled.detail
                )
            } else {
                format!(
                    "not back to baseline after {:.1} s: {}",
                    settled.waited_s, settled.detail
                )
            },
        },
        Check {
            name: "answers identical",
            passed: answers.compared > 0 && answers.differing == 0,
            detail: if answers.compared == 0 {
                "no answer to compare: every request failed".to_owned()
            } else {
                let mut d = format!(
                    "{} compared with {reference}, {} differ",
                    answers.compared, answers.differing
                );
                if let Some(e) = answers.examples.first() {
                    d.push_str(&format!(", e.g. {e}"));
                }
                d
            },
        },
    ];
    checks.extend(own);
    checks
}

impl Verdict {
    /// The verdict as a short table.
    pub fn table(&self) -> String {
        let mut out = format!(
            "pdmesh chaos {}: {}\nfault: {}\n",
            self.scenario.name(),
            self.url,
            self.fault
        );
        let width = self.checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
        for c in &self.checks {
            out.push_str(&format!(
                "  {}  {:<width$}  {}\n",
                if c.passed { "PASS" } else { "FAIL" },
                c.name,
                c.detail
            ));
        }
        if let Some(n) = self.checksum_failures {
            out.push_str(&format!("checksum failures seen: {n}\n"));
        }
        out.push_str(&format!(
            "verdict: {} in {:.0} s",
            if self.passed { "PASS" } else { "FAIL" },
            self.duration_s
        ));
        out
    }
}

/// Runs `pdmesh chaos`: prints the verdict, writes `verdict.json`, and fails when any
/// check did.
pub async fn run(args: ChaosArgs) -> Result<(), ChaosError> {
    use tokio::signal::unix::{SignalKind, signal};
    let out = args.out.clone();
    let handlers = |source| ChaosError::Handlers(source);
    let mut int = signal(SignalKind::interrupt()).map_err(handlers)?;
    let mut term = signal(SignalKind::terminate()).map_err(handlers)?;
    // A signal drops the run wherever it is, and with it any guard that resumes a stopped
    // service: nothing is left stopped.
    let verdict = tokio::select! {
        v = chaos(args) => v?,
        _ = int.recv() => return Err(ChaosError::Interrupted("SIGINT")),
        _ = term.recv() => return Err(ChaosError::Interrupted("SIGTERM")),
    };
    std::fs::create_dir_all(&out).map_err(|source| ChaosError::Write {
        path: out.clone(),
        source,
    })?;
    let path = out.join("verdict.json");
    let text = serde_json::to_string_pretty(&verdict).expect("a verdict serializes");
    std::fs::write(&path, text + "\n").map_err(|source| ChaosError::Write {
        path: path.clone(),
        source,
    })?;
    println!("{}", verdict.table());
    println!("wrote {}", path.display());
    if verdict.passed {
        return Ok(());
    }
    let failed: Vec<&str> = verdict
        .checks
        .iter()
        .filter(|c| !c.passed)
        .map(|c| c.name)
        .collect();
    Err(ChaosError::Failed {
        scenario: verdict.scenario.name(),
        failed: failed.join(", "),
        out: path.display().to_string(),
    })
}

/// Refuses a scenario the mesh cannot run, before any load.
fn check_suitable(scenario: Scenario, mesh: &MeshFile) -> Result<(), ChaosError> {
    let refuse = |what: String| {
        Err(ChaosError::Unsuitable {
            scenario: scenario.name(),
            what,
        })
    };
    let pd = matches!(
        scenario,
        Scenario::KillPrefill | Scenario::KillDecode | Scenario::ExhaustDecode
    );
    if pd && mesh.mode != Mode::Pd {
        return refuse(
            "a disaggregated mesh (prefill and decode workers), and the ports file says it \
             runs one unified worker: start it with `pdmesh up` without --unified"
                .into(),
        );
    }
    if matches!(scenario, Scenario::KillPrefill | Scenario::KillDecode) && !mesh.restart {
        return refuse(
            "a mesh that restarts what dies, and the ports file says restart is false: start \
             it with `pdmesh up --restart`"
                .into(),
        );
    }
    if matches!(scenario, Scenario::StallCache | Scenario::FlipHostBytes) && !mesh.has_cache() {
        return refuse(
            "the cache service (the host mirror), and this mesh runs without one: start it \
             without --no-host-cache"
                .into(),
        );
    }
    Ok(())
}

/// Everything a scenario works with.
struct Ctx {
    args: ChaosArgs,
    mesh: MeshFile,
    gateway: String,
    http: reqwest::Client,
    client: Client,
    cfg: RequestCfg,
    deadline: Duration,
    settle: Duration,
    /// The loaded pass's requests.
    sessions: Vec<Session>,
}

impl Ctx {
    fn spec(&self, n: usize, input_len: usize) -> Spec {
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
    async fn pass(
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
    async fn reference(&self, sessions: &[Session]) -> Result<HashMap<String, Answer>, ChaosError> {
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

    async fn wait_healthy(&self) -> Result<Duration, ChaosError> {
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
    async fn strike(&self, start: Instant, done: &AtomicBool) -> Strike {
        let after = Duration::from_secs_f64(self.args.fault_after_s.max(0.0));
        tokio::time::sleep_until(tokio::time::Instant::from_std(start + after)).await;
        Strike {
            at_s: start.elapsed().as_secs_f64(),
            under_load: !done.load(Ordering::Relaxed),
        }
    }

    /// The loaded pass: every request at once; `done` is set when they have all ended.
    async fn loaded(&self, done: &AtomicBool) -> Vec<Exchange> {
        let ex = self
            .pass(&self.client, &self.sessions, self.sessions.len())
            .await;
        done.store(true, Ordering::Relaxed);
        ex
    }

    /// Waits until the mesh is healthy and back to baseline, up to `--settle-s` each.
    async fn settle_now(&self) -> Settled {
        let (b, waited) = match self.wait_healthy().await {
            Ok(_) => mesh::wait_baseline(&self.http, &self.gateway, self.settle).await,
            Err(_) => (Baseline::default(), self.settle),
        };
        Settled::of(&b, waited)
    }

    async fn metrics(&self) -> Result<mesh::Metrics, ChaosError> {
        Ok(mesh::scrape(&self.http, &format!("{}/metrics", self.gateway)).await?)
    }

    /// Every worker's device prefix cache flushed through the gateway; pages flushed.
    async fn flush(&self) -> Result<u64, ChaosError> {
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

async fn chaos(args: ChaosArgs) -> Result<Verdict, ChaosError> {
    let t0 = Instant::now();
    let scenario = args.scenario;
    let mesh = MeshFile::read(&args.mesh)?;
    check_suitable(scenario, &mesh)?;
    let deadline = Duration::from_secs_f64(args.deadline_s.max(0.1));
    let settle = Duration::from_secs_f64(args.settle_s.max(0.0));
    let client = Client::new(&mesh.url, args.api_key.clone(), deadline);
    let model = match &args.model {
        Some(m) => m.clone(),
        None => client.first_model().await.map_err(ChaosError::Endpoint)?,
    };
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()
        .expect("a client without TLS builds");
    let mut ctx = Ctx {
        gateway: mesh.gateway_url(),
        cfg: RequestCfg {
            model,
            max_tokens: args.max_tokens,
        },
        mesh,
        http,
        client,
        deadline,
        settle,
        sessions: Vec::new(),
        args,
    };
    let n = ctx
        .args
        .requests
        .unwrap_or(scenario.default_requests())
        .max(1);
    let input_len = ctx.args.input_len.unwrap_or(scenario.default_input_len());
    ctx.sessions = ctx.spec(n, input_len).sessions(1);
    ctx.wait_healthy().await?;

    eprintln!(
        "pdmesh chaos {}: {n} requests of about {input_len} tokens, each alone first ({})",
        scenario.name(),
        ctx.args.reference.as_deref().unwrap_or("the healthy mesh")
    );
    let reference = ctx.reference(&ctx.sessions).await?;
    let reference_name = match &ctx.args.reference {
        Some(url) => format!("{url}'s answers"),
        None => "the healthy mesh's answers".to_owned(),
    };
    let (before, _) = mesh::wait_baseline(&ctx.http, &ctx.gateway, ctx.settle).await;
    if !before.ok() {
        return Err(ChaosError::NotBaseline(before.describe()));
    }

    let mut tally = Tally::new(ctx.args.deadline_s);
    let mut answers = Answers::default();
    let outcome = match scenario {
        Scenario::KillPrefill => kill(&ctx, Role::Prefill).await?,
        Scenario::KillDecode => kill(&ctx, Role::Decode).await?,
        Scenario::StallCache => stall(&ctx).await?,
        Scenario::DisconnectClients => disconnect(&ctx).await,
        Scenario::ExhaustDecode => exhaust(&ctx).await,
        Scenario::FlipHostBytes => flip(&ctx).await?,
    };
    for ex in &outcome.passes {
        tally.add_all(ex);
        answers.compare(&reference, ex);
    }
    for left in &outcome.leavers {
        match left {
            Ok(_) => {
                tally.left += 1;
                tally.sent += 1;
            }
            // A whole answer before the client could leave.
            Err(e) if e == "finished" => tally.add(None, 0.0),
            Err(e) => tally.add(Some(e), 0.0),
        }
    }
    // The checks read the mesh once it is healthy and quiet again.
    let last = ctx.settle_now().await;
    // After a recovery pass, the mesh must have come back both before it and after it.
    let settled = match outcome.settled {
        Some(first) if !first.baseline || last.baseline => first,
        _ => last,
    };
    let mut own = outcome.checks;
    let checksum_failures = match outcome.checksum_before {
        Some(before) => {
            let now = ctx
                .metrics()
                .await
                .map(|m| mesh::sum(&m, "mesh_kv_cache_checksum_failures_total"));
            let seen = now.as_ref().map_or(0.0, |now| now - before);
            own.push(Check {
                name: "corruption caught",
                passed: seen > 0.0,
                detail: match now {
                    Ok(_) => format!(
                        "the workers' checksums failed {seen} loads of flipped host pages (recomputed)"
                    ),
                    Err(e) => format!("the checksum failures could not be read: {e}"),
                },
            });
            Some(seen)
        }
        None => None,
    };
    let checks = judge(&tally, &settled, &answers, &reference_name, own);
    Ok(Verdict {
        scenario,
        url: ctx.mesh.url.clone(),
        passed: checks.iter().all(|c| c.passed),
        checks,
        fault: outcome.fault,
        requests: tally,
        settled,
        answers,
        checksum_failures,
        duration_s: t0.elapsed().as_secs_f64(),
    })
}

/// What a scenario did: its passes' requests (compared with the reference), clients meant
/// to leave ([`Client::chat_and_leave`]'s results), a description of the fault, and its
/// own checks.
#[derive(Default)]
struct Outcome {
    passes: Vec<Vec<Exchange>>,
    /// The mesh right after the fault, when a recovery pass followed.
    settled: Option<Settled>,
    leavers: Vec<Result<usize, String>>,
    fault: String,
    checks: Vec<Check>,
    /// flip-host-bytes: the checksum failure counter before the pass over flipped pages.
    checksum_before: Option<f64>,
}

/// When a fault struck.
#[derive(Clone, Copy, Debug)]
struct Strike {
    at_s: f64,
    under_load: bool,
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

/// The worker a kill scenario aims at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Prefill,
    Decode,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }

    /// (pid, port) of the first worker of this role in the ports file.
    fn target(self, m: &MeshFile) -> (u32, u16) {
        let (pids, ports) = match self {
            Self::Prefill => (&m.pids.prefill, &m.prefill),
            Self::Decode => (&m.pids.decode, &m.decode),
        };
        (
            pids.first().copied().unwrap_or(0),
            ports.first().copied().unwrap_or(0),
        )
    }
}

/// Makes sure `pid` runs `pdmesh SUBCOMMAND --listen HOST:PORT` as `up` starts the
/// service, so a stale ports file never aims a signal at another process.
fn check_process(pid: u32, service: &'static str, port: u16) -> Result<(), ChaosError> {
    let wrong = |why: String| ChaosError::WrongProcess { pid, service, why };
    if pid == 0 {
        return Err(wrong("the ports file names no pid".into()));
    }
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map_err(|e| wrong(format!("no such process: {e}")))?;
    let argv: Vec<String> = cmdline
        .split(|&b| b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let listens = argv.get(2).is_some_and(|a| a == "--listen")
        && argv
            .get(3)
            .is_some_and(|a| a.ends_with(&format!(":{port}")));
    if argv.get(1).map(String::as_str) == Some(service) && listens {
        Ok(())
    } else {
        Err(wrong(format!("it runs {:?}", argv.join(" ").trim())))
    }
}

fn signal(
    pid: u32,
    sig: rustix::process::Signal,
    name: &'static str,
    service: &'static str,
) -> Result<(), ChaosError> {
    let err = |source| ChaosError::Signal {
        signal: name,
        service,
        pid,
        source,
    };
    let target = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .ok_or_else(|| err(std::io::Error::other("not a process id")))?;
    rustix::process::kill_process(target, sig).map_err(|e| err(e.into()))
}

/// kill-prefill, kill-decode: SIGKILL the worker mid-load, wait until `up --restart`
/// brought it back and the mesh is healthy, then ask everything again.
async fn kill(ctx: &Ctx, role: Role) -> Result<Outcome, ChaosError> {
    let (pid, port) = role.target(&ctx.mesh);
    check_process(pid, role.name(), port)?;
    let n = ctx.sessions.len();
    // The healthy pass left every prompt in the device caches: without them the prefill
    // does its work again, so the kill finds it busy.
    let flushed = match role {
        Role::Prefill => Some(ctx.flush().await?),
        Role::Decode => None,
    };
    let (start, done) = (Instant::now(), AtomicBool::new(false));
    let fault = async {
        let at = ctx.strike(start, &done).await;
        signal(pid, rustix::process::Signal::KILL, "SIGKILL", role.name()).map(|()| at)
    };
    eprintln!(
        "loaded pass: {n} requests at once; SIGKILL to the {} (pid {pid}) {:.1} s in",
        role.name(),
        ctx.args.fault_after_s,
    );
    let (loaded, killed) = tokio::join!(ctx.loaded(&done), fault);
    let at = killed?;
    let hit = loaded.iter().filter(|e| e.record.error.is_some()).count();

    // `up --restart` rewrites the ports file with the new pid.
    let start = Instant::now();
    let back = loop {
        let now = MeshFile::read(&ctx.args.mesh)?;
        let (new, _) = role.target(&now);
        if new != 0 && new != pid {
            break Some(new);
        }
        if start.elapsed() >= ctx.settle {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let healthy = match back {
        Some(_) => ctx.wait_healthy().await.is_ok(),
        None => false,
    };
    let recovered_in = start.elapsed().as_secs_f64();
    let mut checks = vec![
        under_load(at, hit, n),
        Check {
            name: "restarted",
            passed: back.is_some() && healthy,
            detail: match back {
                Some(new) if healthy => format!(
                    "the {} came back as pid {new}; the mesh was healthy {recovered_in:.1} s after the load",
                    role.name()
                ),
                Some(new) => format!(
                    "the {} came back as pid {new} but the mesh was not healthy within {:.0} s",
                    role.name(),
                    ctx.settle.as_secs_f64()
                ),
                None => format!(
                    "the ports file named no new {} within {:.0} s",
                    role.name(),
                    ctx.settle.as_secs_f64()
                ),
            },
        },
    ];
    let mut passes = vec![loaded];
    let mut settled = None;
    if healthy {
        settled = Some(ctx.settle_now().await);
        eprintln!("recovery pass: the same {n} requests again");
        let again = ctx.pass(&ctx.client, &ctx.sessions, n).await;
        checks.push(recovered(&again));
        passes.push(again);
    }
    Ok(Outcome {
        passes,
        settled,
        leavers: Vec::new(),
        fault: format!(
            "{}SIGKILL to the {} (pid {pid}) {:.1} s after a load of {n} requests began; {hit} of them failed",
            flushed.map_or(String::new(), |p| format!(
                "device caches flushed ({p} pages), then "
            )),
            role.name(),
            at.at_s,
        ),
        checks,
        checksum_before: None,
    })
}

/// The check that the fault struck while the load ran.
fn under_load(at: Strike, hit: usize, n: usize) -> Check {
    Check {
        name: "fault under load",
        passed: at.under_load,
        detail: format!("struck {at}; {hit} of {n} requests failed"),
    }
}

/// The check that every request after recovery got its answer.
fn recovered(again: &[Exchange]) -> Check {
    let ok = again.iter().filter(|e| e.record.error.is_none()).count();
    Check {
        name: "answers after recovery",
        passed: ok == again.len(),
        detail: format!("{ok} of {} requests answered after recovery", again.len()),
    }
}

/// Sends SIGCONT to the process when dropped: a stopped cache service is never left
/// behind, whatever ends the stall.
struct Resume {
    pid: u32,
}

impl Drop for Resume {
    fn drop(&mut self) {
        if let Err(e) = signal(self.pid, rustix::process::Signal::CONT, "SIGCONT", "cache") {
            eprintln!("pdmesh chaos: {e}");
        }
    }
}

/// stall-cache: SIGSTOP the cache service under load for --stall-s, then SIGCONT.
async fn stall(ctx: &Ctx) -> Result<Outcome, ChaosError> {
    let (pid, port) = (ctx.mesh.pids.cache, ctx.mesh.cache);
    check_process(pid, "cache", port)?;
    let n = ctx.sessions.len();
    let stall = Duration::from_secs_f64(ctx.args.stall_s.max(0.0));
    // Without the device caches the healthy pass filled, prompts go to the host tier (the
    // stopped service) again and the hand-overs take long enough to be caught.
    let flushed = ctx.flush().await?;
    let (start, done) = (Instant::now(), AtomicBool::new(false));
    let fault = async {
        let at = ctx.strike(start, &done).await;
        signal(pid, rustix::process::Signal::STOP, "SIGSTOP", "cache")?;
        // SIGCONT when the stall ends, or when the run is dropped in the middle of it.
        let _resume = Resume { pid };
        tokio::time::sleep(stall).await;
        Ok::<_, ChaosError>(at)
    };
    eprintln!(
        "loaded pass: {n} requests at once; the cache service (pid {pid}) stopped {:.1} s in, for {:.0} s",
        ctx.args.fault_after_s,
        stall.as_secs_f64()
    );
    let (loaded, stalled) = tokio::join!(ctx.loaded(&done), fault);
    let at = stalled?;
    let hit = loaded.iter().filter(|e| e.record.error.is_some()).count();
    ctx.wait_healthy().await?;
    let settled = Some(ctx.settle_now().await);
    eprintln!("recovery pass: the same {n} requests again");
    let again = ctx.pass(&ctx.client, &ctx.sessions, n).await;
    Ok(Outcome {
        checks: vec![under_load(at, hit, n), recovered(&again)],
        passes: vec![loaded, again],
        settled,
        leavers: Vec::new(),
        fault: format!(
            "device caches flushed ({flushed} pages), then SIGSTOP to the cache service (pid {pid}) {:.1} s after a load of {n} requests began, SIGCONT {:.0} s later; {hit} of them failed",
            at.at_s,
            stall.as_secs_f64()
        ),
        checksum_before: None,
    })
}

/// One request body for a leaving client: long answers, so it is still decoding when it
/// leaves.
fn leaver_body(model: &str, s: &Session) -> Value {
    let text = s.turns.first().map_or("", |t| t.text.as_str());
    json!({
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": true,
    })
}

/// disconnect-clients: the load, with as many clients again that leave — half right after
/// asking (during prefill), half after a few tokens (during decode).
async fn disconnect(ctx: &Ctx) -> Outcome {
    let n = ctx.sessions.len();
    let input_len = ctx
        .args
        .input_len
        .unwrap_or(Scenario::DisconnectClients.default_input_len());
    // Their own prompts (another salt), so they share nothing with the compared ones.
    let leavers = ctx.spec(n, input_len).sessions(2);
    let early = n.div_ceil(2);
    eprintln!(
        "loaded pass: {n} requests, and {n} clients that leave ({early} during prefill, {} during decode)",
        n - early
    );
    let leave = futures::future::join_all(leavers.iter().enumerate().map(|(i, s)| {
        let events = if i < early { 0 } else { 4 };
        ctx.client
            .chat_and_leave(leaver_body(&ctx.cfg.model, s), events)
    }));
    let (loaded, left) = tokio::join!(ctx.pass(&ctx.client, &ctx.sessions, n), leave);
    let (in_prefill, in_decode) = (
        left[..early].iter().filter(|r| r.is_ok()).count(),
        left[early..].iter().filter(|r| r.is_ok()).count(),
    );
    let ended_first: Vec<&String> = left.iter().filter_map(|r| r.as_ref().err()).collect();
    let mut detail = format!("{in_prefill} left during prefill, {in_decode} during decode");
    if !ended_first.is_empty() {
        detail.push_str(&format!(
            "; {} ended before they could leave: {ended_first:?}",
            ended_first.len()
        ));
    }
    Outcome {
        checks: vec![Check {
            name: "clients left",
            // Each phase was exercised at least once (the others are judged as requests).
            passed: in_prefill > 0 && (in_decode > 0 || early == n),
            detail,
        }],
        passes: vec![loaded],
        settled: None,
        leavers: left,
        fault: format!(
            "{n} clients closed their streams: {early} right after asking, {} after 4 events",
            n - early
        ),
        checksum_before: None,
    }
}

/// exhaust-decode: every request at once, so the decode pool runs out; the refused ones
/// must be 429s.
async fn exhaust(ctx: &Ctx) -> Outcome {
    let n = ctx.sessions.len();
    eprintln!("loaded pass: {n} requests at once");
    let loaded = ctx.pass(&ctx.client, &ctx.sessions, n).await;
    let mut refused = 0;
    let mut other: BTreeMap<String, u32> = BTreeMap::new();
    for e in &loaded {
        match classify(e.record.error.as_deref()) {
            Class::Refused(c) if is_overloaded(&c) => refused += 1,
            Class::Ok => {}
            Class::Refused(c) | Class::Broken(c) => *other.entry(c).or_default() += 1,
            Class::TimedOut => *other.entry("timeout".into()).or_default() += 1,
        }
    }
    Outcome {
        checks: vec![
            Check {
                name: "refused with 429",
                passed: other.is_empty(),
                detail: if other.is_empty() {
                    format!("{refused} refused, all as overloaded (429)")
                } else {
                    format!("refused otherwise than with 429: {other:?}")
                },
            },
            Check {
                name: "pool exhausted",
                passed: refused > 0,
                detail: if refused > 0 {
                    format!("{refused} of {n} requests found no decode pages in time")
                } else {
                    "every request found decode pages: raise --requests or --input-len, or \
                     give the decode worker fewer pages (--decode-arg=--kv-pages=N)"
                        .into()
                },
            },
        ],
        passes: vec![loaded],
        settled: None,
        leavers: Vec::new(),
        fault: format!("{n} requests at once against the decode pool"),
        checksum_before: None,
    }
}

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
struct Flipped {
    bytes: u64,
    file_bytes: u64,
}

/// Granularity of the flip: one byte in every block of this size that holds data.
const FLIP_BLOCK: usize = 4096;

/// Inverts one byte in every [`FLIP_BLOCK`] of `path` that is not all zeros — every page a
/// worker wrote gets at least one — leaving never-written blocks (holes of the
/// shared-memory file) untouched.
fn flip_file(path: &Path) -> std::io::Result<Flipped> {
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
async fn flip(ctx: &Ctx) -> Result<Outcome, ChaosError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn tally(errors: &[(Option<&str>, f64)]) -> Tally {
        let mut t = Tally::new(40.0);
        for (e, s) in errors {
            t.add(*e, *s);
        }
        t
    }

    fn settled(ok: bool) -> Settled {
        Settled {
            baseline: ok,
            waited_s: 0.5,
            pages_held: if ok { 0.0 } else { 3.0 },
            pages_capacity: 128.0,
            detail: "x".into(),
        }
    }

    fn answers(compared: u32, differing: u32) -> Answers {
        Answers {
            compared,
            differing,
            examples: Vec::new(),
        }
    }

    fn passed(checks: &[Check]) -> Vec<(&'static str, bool)> {
        checks.iter().map(|c| (c.name, c.passed)).collect()
    }

    #[test]
    fn errors_are_clean_refusals_timeouts_or_broken_connections() {
        assert_eq!(classify(None), Class::Ok);
        assert_eq!(classify(Some("503")), Class::Refused("503".into()));
        assert_eq!(classify(Some("429")), Class::Refused("429".into()));
        assert_eq!(
            classify(Some("in_stream:service_unavailable")),
            Class::Refused("in_stream:service_unavailable".into())
        );
        assert_eq!(classify(Some("timeout")), Class::TimedOut);
        for e in ["stream", "connect", "send", "200", "abc"] {
            assert_eq!(classify(Some(e)), Class::Broken(e.into()), "{e}");
        }
        assert!(is_overloaded("429") && is_overloaded("in_stream:overloaded"));
        assert!(!is_overloaded("503") && !is_overloaded("in_stream:service_unavailable"));
    }

    #[test]
    fn a_mesh_that_answers_or_refuses_cleanly_in_time_settles_and_agrees_passes() {
        let t = tally(&[
            (None, 1.0),
            (Some("503"), 2.0),
            (Some("in_stream:service_unavailable"), 3.5),
        ]);
        assert_eq!((t.sent, t.ok, t.refused_total()), (3, 1, 2));
        assert_eq!(t.slowest_s, 3.5);
        let d = t.describe();
        assert!(
            d.contains("3 sent: 1 ok, 2 refused (503 x1, in_stream:service_unavailable x1)"),
            "{d}"
        );
        let checks = judge(
            &t,
            &settled(true),
            &answers(4, 0),
            "the healthy mesh's answers",
            vec![],
        );
        assert_eq!(
            passed(&checks),
            [
                ("requests ended in time", true),
                ("no leaked pages", true),
                ("answers identical", true)
            ]
        );
    }

    #[test]
    fn each_failure_fails_its_own_check() {
        let ok = tally(&[(None, 1.0)]);
        let fails = |t: &Tally, s: &Settled, a: &Answers, own: Vec<Check>| {
            judge(t, s, a, "r", own)
                .into_iter()
                .filter(|c| !c.passed)
                .map(|c| c.name)
                .collect::<Vec<_>>()
        };
        // A hang past the deadline, a connection broken without an error, a request slower
        // than the deadline however it ended.
        for t in [
            tally(&[(None, 1.0), (Some("timeout"), 40.0)]),
            tally(&[(None, 1.0), (Some("stream"), 2.0)]),
            tally(&[(None, 41.0)]),
        ] {
            assert_eq!(
                fails(&t, &settled(true), &answers(1, 0), vec![]),
                ["requests ended in time"]
            );
        }
        assert_eq!(
            fails(&ok, &settled(false), &answers(1, 0), vec![]),
            ["no leaked pages"]
        );
        assert_eq!(
            fails(&ok, &settled(true), &answers(3, 1), vec![]),
            ["answers identical"]
        );
        // Nothing compared is nothing shown.
        let none = judge(&ok, &settled(true), &answers(0, 0), "r", vec![]);
        assert!(none[2].detail.contains("no answer to compare"));
        assert!(!none[2].passed);
        let own = Check {
            name: "corruption caught",
            passed: false,
            detail: String::new(),
        };
        assert_eq!(
            fails(&ok, &settled(true), &answers(1, 0), vec![own]),
            ["corruption caught"]
        );
    }

    #[test]
    fn the_verdict_table_shows_every_check_and_the_outcome() {
        let t = tally(&[(None, 1.0)]);
        let checks = judge(&t, &settled(false), &answers(1, 0), "r", vec![]);
        let v = Verdict {
            scenario: Scenario::FlipHostBytes,
            url: "http://127.0.0.1:1/v1".into(),
            passed: checks.iter().all(|c| c.passed),
            checks,
            fault: "flipped".into(),
            requests: t,
            settled: settled(false),
            answers: answers(1, 0),
            checksum_failures: Some(6.0),
            duration_s: 12.0,
        };
        let table = v.table();
        assert!(
            table
                .starts_with("pdmesh chaos flip-host-bytes: http://127.0.0.1:1/v1\nfault: flipped"),
            "{table}"
        );
        assert!(table.contains("  PASS  requests ended in time"), "{table}");
        assert!(table.contains("  FAIL  no leaked pages"), "{table}");
        assert!(table.contains("checksum failures seen: 6"), "{table}");
        assert!(table.ends_with("verdict: FAIL in 12 s"), "{table}");
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["scenario"], "flip-host-bytes");
        assert_eq!(json["passed"], false);
        assert_eq!(json["checks"][1]["name"], "no leaked pages");
        assert_eq!(json["requests"]["ok"], 1);
    }

    fn mesh_file(mode: &str, restart: bool, cache: u16) -> MeshFile {
        MeshFile::parse(&format!(
            r#"{{"url": "http://127.0.0.1:1/v1", "host": "127.0.0.1", "mode": "{mode}",
                "gateway": 1, "tokenizer": 2, "worker": 3, "cache": {cache}, "model": "m",
                "restart": {restart},
                "pids": {{"up": 1, "tokenizer": 2, "worker": 3, "gateway": 4, "cache": {cache}}}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn scenarios_the_mesh_cannot_run_are_refused_up_front_saying_why() {
        let refused = |s: Scenario, m: &MeshFile| check_suitable(s, m).unwrap_err().to_string();
        let no_restart = mesh_file("pd", false, 9);
        let e = refused(Scenario::KillPrefill, &no_restart);
        assert!(
            e.starts_with("kill-prefill needs") && e.contains("pdmesh up --restart"),
            "{e}"
        );
        let unified = mesh_file("unified", true, 9);
        for s in [Scenario::KillDecode, Scenario::ExhaustDecode] {
            let e = refused(s, &unified);
            assert!(e.contains("disaggregated") && e.contains("unified"), "{e}");
        }
        let no_cache = mesh_file("unified", false, 0);
        for s in [Scenario::StallCache, Scenario::FlipHostBytes] {
            assert!(refused(s, &no_cache).contains("--no-host-cache"));
        }
        assert!(check_suitable(Scenario::DisconnectClients, &no_cache).is_ok());
        assert!(check_suitable(Scenario::FlipHostBytes, &unified).is_ok());
        assert!(check_suitable(Scenario::KillPrefill, &mesh_file("pd", true, 9)).is_ok());
    }

    #[test]
    fn a_signal_only_goes_to_the_process_the_ports_file_names() {
        // This test process is not a pdmesh service on port 1.
        let me = std::process::id();
        let e = check_process(me, "prefill", 1).unwrap_err().to_string();
        assert!(e.contains(&format!("pid {me} is not the prefill")), "{e}");
        assert!(e.contains("stale"), "{e}");
        let e = check_process(0, "cache", 1).unwrap_err().to_string();
        assert!(e.contains("names no pid"), "{e}");
    }

    #[test]
    fn flipping_changes_one_byte_per_written_block_and_leaves_holes_alone() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pdmesh-mirror-test");
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(4 * FLIP_BLOCK as u64 + 100).unwrap();
        // Two blocks with data (one of them starting with a zero byte), the rest holes.
        file.write_all_at(&[0, 7, 7], FLIP_BLOCK as u64).unwrap();
        file.write_all_at(&[9], 3 * FLIP_BLOCK as u64 + 10).unwrap();
        let before = std::fs::read(&path).unwrap();
        let f = flip_file(&path).unwrap();
        assert_eq!(
            f,
            Flipped {
                bytes: 2,
                file_bytes: before.len() as u64
            }
        );
        let after = std::fs::read(&path).unwrap();
        let changed: Vec<usize> = (0..before.len())
            .filter(|&i| before[i] != after[i])
            .collect();
        assert_eq!(changed, [FLIP_BLOCK, 3 * FLIP_BLOCK]);
        assert_eq!(after[FLIP_BLOCK], 0xff);
        assert_eq!(after[3 * FLIP_BLOCK], 0xff);
    }
}

//! `pdmesh chaos SCENARIO`: a fault injected into a running mesh under load, ending in a
//! verdict. Against a mesh `pdmesh up --ports-json` started: a healthy pass (each request
//! alone: the reference answers, unless `--reference`), the load with the fault, then the
//! checks — every request ended in time with an answer or a clean error, the mesh came
//! back to baseline (no page, request, room or slot held), and every answer equals its
//! reference.

mod args;
mod ctx;
mod flip;
mod process;
mod scenarios;
#[cfg(test)]
mod tests;
mod verdict;

use std::time::{Duration, Instant};

use self::ctx::Ctx;
use self::flip::flip;
use self::process::Role;
use self::scenarios::{disconnect, exhaust, kill, stall};
use self::verdict::judge;
use crate::client::{Client, RequestError};
use crate::mesh::{self, MeshFile, Mode};
use crate::run::RequestCfg;

pub use self::args::{ChaosArgs, ChaosError, Scenario};
pub use self::verdict::{Answers, Check, Settled, Tally, Verdict};

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
        None => client.first_model().await?,
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
            Err(RequestError::Finished) => tally.add(None, 0.0),
            Err(e) => tally.add(Some(&e.to_string()), 0.0),
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

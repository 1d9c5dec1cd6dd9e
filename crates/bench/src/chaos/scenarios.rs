//! The scenarios that strike a running mesh under load: kill a worker, stall the cache
//! service, clients that leave, and a decode pool run dry.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::args::{ChaosError, Scenario};
use super::ctx::{Ctx, Outcome, Strike};
use super::process::{Resume, Role, check_process, signal};
use super::verdict::{Check, Class, classify, is_overloaded};
use crate::mesh::MeshFile;
use crate::run::Exchange;
use crate::workload::Session;

/// kill-prefill, kill-decode: SIGKILL the worker mid-load, wait until `up --restart`
/// brought it back and the mesh is healthy, then ask everything again.
pub(super) async fn kill(ctx: &Ctx, role: Role) -> Result<Outcome, ChaosError> {
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

/// stall-cache: SIGSTOP the cache service under load for --stall-s, then SIGCONT.
pub(super) async fn stall(ctx: &Ctx) -> Result<Outcome, ChaosError> {
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
pub(super) async fn disconnect(ctx: &Ctx) -> Outcome {
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
    let ended_first: Vec<String> = left
        .iter()
        .filter_map(|r| Some(r.as_ref().err()?.to_string()))
        .collect();
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
pub(super) async fn exhaust(ctx: &Ctx) -> Outcome {
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

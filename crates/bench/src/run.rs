//! Driving a load level: closed loop (a fixed number of sessions in flight) or open loop
//! (sessions started at Poisson arrivals), each session's turns in order, every request
//! streamed and timed. Then the summary, and in differential mode the comparison of
//! every answer with the same request run alone on a reference endpoint.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::StreamExt;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};

use crate::client::{Answer, Client, RequestError};
use crate::summary::{Differential, LevelSummary, Percentiles, Record};
use crate::workload::{self, Session};

/// A load level.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Level {
    /// This many sessions in flight at all times.
    Concurrency(u32),
    /// Sessions started per second, with exponential gaps.
    Rate(f64),
}

/// One request sent, with what came back (kept for the differential replay).
#[derive(Clone, Debug)]
pub struct Exchange {
    pub body: Value,
    pub record: Record,
    pub answer: Answer,
    /// The tool the turn asked for, if any.
    pub expect_tool: Option<&'static str>,
}

/// Request settings shared by every request of a run.
#[derive(Clone, Debug)]
pub struct RequestCfg {
    pub model: String,
    pub max_tokens: u32,
}

/// Runs one level's sessions against `client`; `tick` is called once per request ended.
pub async fn run_level(
    client: &Client,
    cfg: &RequestCfg,
    sessions: Vec<Session>,
    level: Level,
    seed: u64,
    tick: &(dyn Fn() + Sync),
) -> (Vec<Exchange>, f64) {
    let out = Mutex::new(Vec::new());
    let t0 = Instant::now();
    match level {
        Level::Concurrency(c) => {
            futures::stream::iter(sessions)
                .for_each_concurrent(c.max(1) as usize, |s| {
                    run_session(client, cfg, s, t0, &out, tick)
                })
                .await;
        }
        Level::Rate(r) => {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let mut at = Duration::ZERO;
            let mut starts = Vec::with_capacity(sessions.len());
            for s in sessions {
                starts.push((at, s));
                // Exponential inter-arrival times: a Poisson process of rate r.
                let u: f64 = rng.random_range(f64::EPSILON..1.0);
                at += Duration::from_secs_f64(-u.ln() / r.max(1e-6));
            }
            futures::future::join_all(starts.into_iter().map(|(at, s)| {
                let out = &out;
                async move {
                    tokio::time::sleep_until(tokio::time::Instant::from_std(t0 + at)).await;
                    run_session(client, cfg, s, t0, out, tick).await;
                }
            }))
            .await;
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let mut ex = out.into_inner().expect("exchanges lock");
    ex.sort_by(|a, b| a.record.start_s.total_cmp(&b.record.start_s));
    (ex, wall)
}

/// One session's turns in order; a failed turn ends the session (its history is gone).
async fn run_session(
    client: &Client,
    cfg: &RequestCfg,
    s: Session,
    t0: Instant,
    out: &Mutex<Vec<Exchange>>,
    tick: &(dyn Fn() + Sync),
) {
    let mut messages: Vec<Value> = s
        .system
        .iter()
        .map(|sys| json!({"role": "system", "content": sys}))
        .collect();
    for (t, turn) in s.turns.iter().enumerate() {
        messages.push(json!({"role": "user", "content": turn.text}));
        let mut body = json!({
            "model": cfg.model,
            "messages": messages,
            "max_tokens": cfg.max_tokens,
            "temperature": 0,
        });
        if s.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        if s.tools {
            body["tools"] = workload::tools();
            body["tool_choice"] = match turn.tool {
                Some(name) => json!({"type": "function", "function": {"name": name}}),
                None => json!("auto"),
            };
        }
        let (record, answer) = client.chat(body.clone(), t0).await;
        tick();
        let failed = record.error.is_some();
        let mut assistant = json!({"role": "assistant", "content": answer.content});
        if !answer.tool_calls.is_empty() {
            let calls: Vec<Value> = answer
                .tool_calls
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    json!({"id": format!("call_{t}_{i}"), "type": "function",
                           "function": {"name": c.name, "arguments": c.arguments}})
                })
                .collect();
            assistant["tool_calls"] = json!(calls);
        }
        let results: Vec<Value> = answer
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"role": "tool", "tool_call_id": format!("call_{t}_{i}"),
                       "content": workload::tool_result(&c.name, &c.arguments)})
            })
            .collect();
        out.lock().expect("exchanges lock").push(Exchange {
            body,
            record,
            answer,
            expect_tool: turn.tool,
        });
        if failed {
            // The rest of the session is skipped, but still counted as ended.
            for _ in t + 1..s.turns.len() {
                tick();
            }
            return;
        }
        messages.push(assistant);
        messages.extend(results);
    }
}

fn percentiles(mut v: Vec<f64>) -> Percentiles {
    if v.is_empty() {
        return Percentiles::default();
    }
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Percentiles {
        mean: v.iter().sum::<f64>() / v.len() as f64,
        p50: q(0.5),
        p90: q(0.9),
        p99: q(0.99),
        max: v[v.len() - 1],
    }
}

/// The summary of one level's requests (`wall`: seconds the level took).
pub fn summarize(level: Level, ex: &[Exchange], wall: f64) -> LevelSummary {
    let ok: Vec<&Record> = ex
        .iter()
        .map(|e| &e.record)
        .filter(|r| r.error.is_none())
        .collect();
    let mut errors_by_kind = std::collections::BTreeMap::new();
    for e in ex.iter().filter_map(|e| e.record.error.as_ref()) {
        *errors_by_kind.entry(e.clone()).or_insert(0) += 1;
    }
    let tokens: u64 = ok.iter().map(|r| u64::from(r.completion_tokens)).sum();
    let prompt: u64 = ok.iter().map(|r| u64::from(r.prompt_tokens)).sum();
    let cached: u64 = ok.iter().map(|r| u64::from(r.cached_tokens)).sum();
    let per_s = |n: f64| if wall > 0.0 { n / wall } else { 0.0 };
    LevelSummary {
        concurrency: match level {
            Level::Concurrency(c) => Some(c),
            Level::Rate(_) => None,
        },
        rate: match level {
            Level::Rate(r) => Some(r),
            Level::Concurrency(_) => None,
        },
        requests: ex.len() as u32,
        errors: (ex.len() - ok.len()) as u32,
        errors_by_kind,
        duration_s: wall,
        ttft: percentiles(ok.iter().filter_map(|r| r.ttft_s).collect()),
        itl: percentiles(ok.iter().flat_map(|r| r.itl_s.iter().copied()).collect()),
        e2e: percentiles(ok.iter().map(|r| r.e2e_s).collect()),
        output_tokens_per_s: per_s(tokens as f64),
        requests_per_s: per_s(ok.len() as f64),
        cached_share: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        prefill_tokens_per_s: {
            let (n, secs) = ok
                .iter()
                .filter_map(|r| Some((r.prompt_tokens.saturating_sub(r.cached_tokens), r.ttft_s?)))
                .fold((0u64, 0f64), |(n, s), (p, t)| (n + u64::from(p), s + t));
            if secs > 0.0 { n as f64 / secs } else { 0.0 }
        },
        differential: None,
    }
}

/// The reference endpoint of differential mode, with the answers it already gave: it is
/// greedy and computes each request alone, so the same request body always has the same
/// answer, and a request seen before (a second configuration sending what the first did)
/// is not replayed again.
pub struct Reference {
    client: Client,
    answers: Mutex<HashMap<String, Answer>>,
}

impl Reference {
    pub fn new(client: Client) -> Self {
        Self {
            client,
            answers: Mutex::new(HashMap::new()),
        }
    }

    /// The reference's answer to `body`, or why the replay failed.
    async fn answer(&self, body: &Value, t0: Instant) -> Result<Answer, RequestError> {
        let key = body.to_string();
        if let Some(a) = self.answers.lock().expect("answers lock").get(&key) {
            return Ok(a.clone());
        }
        let (_, want, out) = self.client.chat_checked(body.clone(), t0).await;
        out?;
        self.answers
            .lock()
            .expect("answers lock")
            .insert(key, want.clone());
        Ok(want)
    }

    /// Distinct requests answered so far.
    pub fn known(&self) -> usize {
        self.answers.lock().expect("answers lock").len()
    }
}

/// Differential mode: replays every successful request, one at a time, on `reference`
/// (meant to be a unified worker without a cache: each request computed alone) and
/// compares the answers token for token (text, tool calls, finish reason, length).
/// `tick` is called once per replayed request. Also returns up to ten lines describing
/// differing answers and invalid tool calls.
pub async fn differential(
    reference: &Reference,
    ex: &[Exchange],
    tick: &(dyn Fn() + Sync),
) -> (Differential, Vec<String>) {
    let mut d = Differential::default();
    let mut diffs = Vec::new();
    let t0 = Instant::now();
    for e in ex {
        let cut = e.answer.finish_reason.as_deref() == Some("length");
        if let (Some(_), true) = (e.expect_tool, cut) {
            d.tool_calls_truncated += 1;
        } else if let Some(name) = e.expect_tool {
            d.tool_calls_expected += 1;
            let valid = e.record.error.is_none()
                && e.answer.tool_calls.len() == 1
                && e.answer.tool_calls[0].name == name
                && workload::valid_call(name, &e.answer.tool_calls[0].arguments);
            d.tool_calls_valid += u32::from(valid);
            if !valid && e.record.error.is_none() && diffs.len() < 10 {
                diffs.push(format!(
                    "invalid tool call (expected {name}): {:?}, finish {:?}",
                    e.answer.tool_calls, e.answer.finish_reason
                ));
            }
        }
        if e.record.error.is_some() {
            tick();
            continue;
        }
        let want = reference.answer(&e.body, t0).await;
        tick();
        let want = match want {
            Ok(w) => w,
            Err(why) => {
                d.reference_errors += 1;
                if diffs.len() < 10 {
                    diffs.push(format!("the reference failed a replay: {why}"));
                }
                continue;
            }
        };
        d.compared += 1;
        if e.answer != want {
            d.corrupted += 1;
            if diffs.len() < 10 {
                diffs.push(format!(
                    "differs: got {:?} {:?} ({:?}), reference {:?} {:?} ({:?})",
                    e.answer.content,
                    e.answer.tool_calls,
                    e.answer.finish_reason,
                    want.content,
                    want.tool_calls,
                    want.finish_reason
                ));
            }
        }
    }
    (d, diffs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let p = percentiles((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p90, p.p99, p.max), (50.0, 90.0, 99.0, 100.0));
        assert_eq!(p.mean, 50.5);
        assert_eq!(percentiles(vec![]), Percentiles::default());
        assert_eq!(percentiles(vec![3.0]).p99, 3.0);
    }

    #[test]
    fn the_summary_counts_errors_by_kind_and_only_successes_in_latency() {
        let rec = |ttft: f64, error: Option<&str>| Exchange {
            body: Value::Null,
            record: Record {
                ttft_s: Some(ttft),
                e2e_s: ttft * 2.0,
                prompt_tokens: 10,
                completion_tokens: 4,
                cached_tokens: 5,
                itl_s: vec![0.01, 0.03],
                error: error.map(str::to_owned),
                ..Record::default()
            },
            answer: Answer::default(),
            expect_tool: None,
        };
        let ex = [
            rec(0.1, None),
            rec(0.3, None),
            rec(9.0, Some("429")),
            rec(9.0, Some("429")),
        ];
        let s = summarize(Level::Concurrency(4), &ex, 2.0);
        assert_eq!((s.requests, s.errors), (4, 2));
        assert_eq!(s.errors_by_kind.get("429"), Some(&2));
        assert_eq!(s.ttft.max, 0.3);
        assert_eq!(s.output_tokens_per_s, 4.0);
        assert_eq!(s.requests_per_s, 1.0);
        assert_eq!(s.cached_share, 0.5);
        // Two successes, 5 uncached prompt tokens each, over 0.1 + 0.3 s to first token.
        assert!(
            (s.prefill_tokens_per_s - 25.0).abs() < 1e-9,
            "{}",
            s.prefill_tokens_per_s
        );
        assert_eq!(s.itl.p50, 0.01);
        assert_eq!(s.concurrency, Some(4));
    }
}

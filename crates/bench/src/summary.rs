//! What one benchmark run measured: per-request records, and their summary per load level.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One request as the client saw it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Seconds from the run's start to sending the request.
    pub start_s: f64,
    /// Seconds from sending to the first content token (streamed), if one came.
    pub ttft_s: Option<f64>,
    /// Gaps between consecutive streamed content chunks, seconds.
    pub itl_s: Vec<f64>,
    /// Seconds from sending to the end of the answer (or the error).
    pub e2e_s: f64,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
    /// `None` when it succeeded; else a short class: an HTTP status ("429"), an error
    /// the server reported mid-stream ("in_stream:overloaded"), "timeout", "connect",
    /// "stream" (the stream broke off).
    pub error: Option<String>,
}

/// Percentiles of one quantity, seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// Differential mode: each answer compared with the reference run alone.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Differential {
    /// Answers compared (successful on both sides).
    pub compared: u32,
    /// Answers that differ from their reference in any token.
    pub corrupted: u32,
    /// Answers that should hold a tool call, and those whose call parsed and matched the
    /// tool's schema. Answers cut off by `max_tokens` are not judged: they are counted in
    /// `tool_calls_truncated` instead.
    pub tool_calls_expected: u32,
    pub tool_calls_valid: u32,
    #[serde(default)]
    pub tool_calls_truncated: u32,
    /// Replays the reference answered with an error (those answers were not compared).
    #[serde(default)]
    pub reference_errors: u32,
}

impl Differential {
    /// Share of compared answers that differ, 0..=1 (0 when nothing was compared).
    pub fn corruption_rate(&self) -> f64 {
        ratio(self.corrupted, self.compared)
    }

    /// Share of expected tool calls that were valid, 0..=1 (1 when none were expected).
    pub fn tool_call_validity(&self) -> f64 {
        if self.tool_calls_expected == 0 {
            1.0
        } else {
            ratio(self.tool_calls_valid, self.tool_calls_expected)
        }
    }
}

fn ratio(a: u32, b: u32) -> f64 {
    if b == 0 {
        0.0
    } else {
        f64::from(a) / f64::from(b)
    }
}

/// One load level (a concurrency, or a request rate) of a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LevelSummary {
    /// Closed loop: this many requests in flight at all times.
    pub concurrency: Option<u32>,
    /// Open loop: requests started per second (Poisson arrivals).
    pub rate: Option<f64>,
    pub requests: u32,
    pub errors: u32,
    pub errors_by_kind: BTreeMap<String, u32>,
    /// Wall seconds from the first request sent to the last answer.
    pub duration_s: f64,
    pub ttft: Percentiles,
    pub itl: Percentiles,
    pub e2e: Percentiles,
    /// Completion tokens per second over the level's duration.
    pub output_tokens_per_s: f64,
    pub requests_per_s: f64,
    /// Cached prompt tokens over prompt tokens, 0..=1.
    pub cached_share: f64,
    /// Uncached prompt tokens over the time to their first token, both summed over the
    /// requests: with one request in flight and one token out, the prefill speed.
    #[serde(default)]
    pub prefill_tokens_per_s: f64,
    pub differential: Option<Differential>,
}

/// A whole run: what was driven, how, and each load level's summary.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// What the series is called in plots ("pdmesh", "llama.cpp").
    pub label: String,
    pub url: String,
    pub model: String,
    /// "random", "sessions" or "long", with its parameters.
    pub workload: String,
    /// RFC 3339 UTC time the run started.
    pub started: String,
    pub levels: Vec<LevelSummary>,
}

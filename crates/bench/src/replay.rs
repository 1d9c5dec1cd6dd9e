//! `pdmesh bench replay REPORT`: sends the request an incident report recorded to a mesh
//! (and to a reference, when given) and prints what came back. The request goes to
//! `/completions` as the prompt's token ids with the recorded sampling (its text may be
//! redacted in the report; its ids never are), so a healthy mesh gives the same tokens
//! the failing request should have had: greedy, or sampled with its seed. Requests whose
//! output was constrained by a grammar (a forced tool call, `response_format`) replay
//! without it.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{Value, json};

use crate::client::{Client, ClientError};

/// `pdmesh bench replay`.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// An incident report's JSON file (`<id>.json` in the reports' directory).
    pub report: PathBuf,
    /// The mesh to replay it on (OpenAI-compatible, ending in `/v1`).
    #[arg(long, default_value = "http://127.0.0.1:8080/v1")]
    pub url: String,
    /// A reference endpoint (a unified mesh with no cache, say): the answers must be
    /// the same, or the command fails.
    #[arg(long)]
    pub reference: Option<String>,
    #[arg(long, env = "PDMESH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model to ask for (default: the report's, else the first the mesh lists).
    #[arg(long)]
    pub model: Option<String>,
    #[arg(long, default_value_t = 300)]
    pub timeout_s: u64,
}

/// Why `pdmesh bench replay` failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("reading {path}: {why}")]
    Report { path: String, why: BadReport },
    #[error(transparent)]
    Endpoint(#[from] ClientError),
    #[error(
        "the replayed answer differs from the reference's:\n  mesh:      {ours}\n  reference: {theirs}"
    )]
    Differs { ours: String, theirs: String },
}

/// Why an incident report's file is no replay.
#[derive(Debug, thiserror::Error)]
pub enum BadReport {
    #[error("{0}")]
    Read(#[from] std::io::Error),
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error("the report's replay has no prompt token ids")]
    NoPromptIds,
}

/// Sampling fields a recorded body carries that `/completions` takes as they are.
const SAMPLING: [&str; 13] = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "min_tokens",
];

/// The `/completions` body replaying `replay` (a report's `replay` section) with `model`.
pub fn request(replay: &Value, model: &str) -> Result<Value, BadReport> {
    let ids = replay["prompt_token_ids"]
        .as_array()
        .filter(|a| !a.is_empty())
        .ok_or(BadReport::NoPromptIds)?;
    let body = &replay["body"];
    let mut req = json!({"model": model, "prompt": ids, "stream": false});
    for key in SAMPLING {
        if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
            req[key] = v.clone();
        }
    }
    // Chat's names for the length limit, then the Responses API's.
    if let Some(n) = ["max_tokens", "max_completion_tokens", "max_output_tokens"]
        .iter()
        .find_map(|k| body.get(*k).filter(|v| v.is_u64()))
    {
        req["max_tokens"] = n.clone();
    }
    Ok(req)
}

/// What one endpoint answered, as printed.
fn answer(url: &str, r: &Value) -> Value {
    let c = &r["choices"][0];
    json!({
        "url": url,
        "text": c["text"],
        "finish_reason": c["finish_reason"],
        "completion_tokens": r["usage"]["completion_tokens"],
    })
}

pub async fn run(a: ReplayArgs) -> Result<(), ReplayError> {
    let path = a.report.display().to_string();
    let report: Value = std::fs::read(&a.report)
        .map_err(BadReport::from)
        .and_then(|b| Ok(serde_json::from_slice(&b)?))
        .map_err(|why| ReplayError::Report {
            path: path.clone(),
            why,
        })?;
    let timeout = Duration::from_secs(a.timeout_s.max(1));
    let mesh = Client::new(&a.url, a.api_key.clone(), timeout);
    let model = match a.model.clone().or_else(|| {
        report["replay"]["body"]["model"]
            .as_str()
            .map(str::to_owned)
    }) {
        Some(m) => m,
        None => mesh.first_model().await?,
    };
    let body =
        request(&report["replay"], &model).map_err(|why| ReplayError::Report { path, why })?;
    let ours = answer(&a.url, &mesh.complete(&body).await?);
    let mut out = json!({"report": report["id"], "request": body, "answer": ours});
    let mut verdict = Ok(());
    if let Some(r) = &a.reference {
        let theirs = answer(
            r,
            &Client::new(r, a.api_key.clone(), timeout)
                .complete(&body)
                .await?,
        );
        let same =
            ours["text"] == theirs["text"] && ours["finish_reason"] == theirs["finish_reason"];
        if !same {
            verdict = Err(ReplayError::Differs {
                ours: ours["text"].to_string(),
                theirs: theirs["text"].to_string(),
            });
        }
        out["reference"] = theirs;
        out["same_as_reference"] = same.into();
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&out).expect("JSON values serialize")
    );
    verdict
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_body_replays_as_its_token_ids_with_its_sampling() {
        let replay = json!({
            "body": {"model": "m", "messages": [{"role": "user", "content": "[redacted: 5 chars]"}],
                     "temperature": 0.7, "seed": 3, "max_completion_tokens": 9, "tools": [], "stop": null},
            "prompt_token_ids": [1, 2, 3],
        });
        assert_eq!(
            request(&replay, "m").unwrap(),
            json!({"model": "m", "prompt": [1, 2, 3], "stream": false,
                   "temperature": 0.7, "seed": 3, "max_tokens": 9})
        );
        let err = request(&json!({"body": {}}), "m").unwrap_err().to_string();
        assert!(err.contains("no prompt token ids"), "{err}");
    }
}

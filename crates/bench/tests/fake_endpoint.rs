//! `pdmesh bench` against small fake OpenAI endpoints (test fakes, in process): the client
//! reads streamed content, tool-call fragments and usage; the differential mode counts
//! every answer that differs from its reference and fails the run, and a forced tool call
//! with arguments outside the tool's schema counts as invalid.

use std::net::SocketAddr;

use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use clap::Parser;
use serde_json::{Value, json};

/// How a fake answers.
#[derive(Clone, Copy)]
enum Mode {
    /// "answer N" where N is the length of the last user message.
    Honest,
    /// "answer N!": every text answer differs from Honest's (tool calls do not).
    Corrupt,
    /// Tool calls with an argument of the wrong type.
    BadArguments,
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}))
}

fn chunk(delta: Value, finish: Option<&str>) -> String {
    let v = json!({"id": "x", "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    format!("data: {v}\n\n")
}

async fn chat(State(mode): State<Mode>, Json(body): Json<Value>) -> impl IntoResponse {
    let last = body["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
        .len();
    let mut sse = chunk(json!({"role": "assistant", "content": ""}), None);
    let forced = body["tool_choice"]["function"]["name"].as_str();
    if let Some(name) = forced {
        let arg = match (mode, name) {
            (Mode::BadArguments, _) => r#"{"city": 7}"#.to_owned(),
            (_, "get_weather") => r#"{"city": "Oslo"}"#.to_owned(),
            _ => r#"{"query": "timeouts"}"#.to_owned(),
        };
        let (a, b) = arg.split_at(arg.len() / 2);
        sse += &chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                    "function": {"name": name, "arguments": ""}}]}),
            None,
        );
        sse += &chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": a}}]}),
            None,
        );
        sse += &chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": b}}]}),
            None,
        );
        sse += &chunk(json!({}), Some("tool_calls"));
    } else {
        let bang = matches!(mode, Mode::Corrupt);
        for piece in ["answer ", &last.to_string(), if bang { "!" } else { "" }] {
            if !piece.is_empty() {
                sse += &chunk(json!({"content": piece}), None);
            }
        }
        sse += &chunk(json!({}), Some("stop"));
    }
    let usage = json!({"id": "x", "object": "chat.completion.chunk", "choices": [],
        "usage": {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23,
                  "prompt_tokens_details": {"cached_tokens": 10}}});
    sse += &format!("data: {usage}\n\ndata: [DONE]\n\n");
    ([(header::CONTENT_TYPE, "text/event-stream")], sse)
}

async fn serve(mode: Mode) -> SocketAddr {
    let app = axum::Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .with_state(mode);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    addr
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    bench: pdmesh_bench::BenchArgs,
}

fn args(
    url: SocketAddr,
    reference: Option<SocketAddr>,
    out: &std::path::Path,
) -> pdmesh_bench::BenchArgs {
    let mut argv = vec![
        "bench".to_owned(),
        format!("--url=http://{url}/v1"),
        "--workload=sessions".into(),
        "--requests=4".into(),
        "--turns=4".into(),
        "--concurrency=2".into(),
        "--input-len=10".into(),
        format!("--out={}", out.display()),
    ];
    if let Some(r) = reference {
        argv.push(format!("--reference=http://{r}/v1"));
    }
    Cli::parse_from(argv).bench
}

fn report(out: &std::path::Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap()
}

#[tokio::test]
async fn identical_answers_pass_and_the_report_counts_them() {
    let (sut, reference) = (serve(Mode::Honest).await, serve(Mode::Honest).await);
    let dir = tempfile::tempdir().unwrap();
    pdmesh_bench::run(args(sut, Some(reference), dir.path()))
        .await
        .expect("no answer differs");
    let r = report(dir.path());
    assert_eq!(r[0]["model"], "fake-model");
    let level = &r[0]["levels"][0];
    assert_eq!(level["requests"], 16);
    assert_eq!(level["errors"], 0);
    assert_eq!(level["cached_share"], 0.5);
    let d = &level["differential"];
    assert_eq!(
        (d["compared"].as_u64(), d["corrupted"].as_u64()),
        (Some(16), Some(0))
    );
    // Turns 1 and 3 of 4 sessions force a tool; the fake's calls are valid.
    assert_eq!(d["tool_calls_expected"], 8);
    assert_eq!(d["tool_calls_valid"], 8);
}

#[tokio::test]
async fn answers_that_differ_from_the_reference_fail_the_run_and_are_counted() {
    let (sut, reference) = (serve(Mode::Corrupt).await, serve(Mode::Honest).await);
    let dir = tempfile::tempdir().unwrap();
    let err = pdmesh_bench::run(args(sut, Some(reference), dir.path()))
        .await
        .expect_err("corrupted answers fail the run");
    let pdmesh_bench::BenchError::Corruption {
        corrupted,
        compared,
        ..
    } = err
    else {
        panic!("{err}");
    };
    // The follow-up turns (2 of 4 in each of 4 sessions) answer text, which differs.
    assert_eq!((corrupted, compared), (8, 16));
    let d = &report(dir.path())[0]["levels"][0]["differential"];
    assert_eq!(d["corrupted"], 8);
}

#[tokio::test]
async fn forced_calls_with_mistyped_arguments_are_invalid() {
    let (sut, reference) = (
        serve(Mode::BadArguments).await,
        serve(Mode::BadArguments).await,
    );
    let dir = tempfile::tempdir().unwrap();
    pdmesh_bench::run(args(sut, Some(reference), dir.path()))
        .await
        .expect("the answers match each other");
    let d = &report(dir.path())[0]["levels"][0]["differential"];
    assert_eq!(d["tool_calls_expected"], 8);
    assert_eq!(d["tool_calls_valid"], 0);
}

#[tokio::test]
async fn an_endpoint_that_refuses_is_counted_as_errors() {
    // Nothing listens here: every request fails to connect. The report counts them, and
    // the run fails: a level with no answer measured nothing.
    let dir = tempfile::tempdir().unwrap();
    let mut a = args("127.0.0.1:9".parse().unwrap(), None, dir.path());
    a.run.model = Some("m".into());
    a.run.workload = pdmesh_bench::workload::Kind::Random;
    let err = pdmesh_bench::run(a).await.unwrap_err();
    assert!(
        err.to_string()
            .starts_with("all 4 requests of a level failed (4 connect)"),
        "{err}"
    );
    let level = &report(dir.path())[0]["levels"][0];
    assert_eq!(level["requests"], 4);
    assert_eq!(level["errors"], 4);
    assert_eq!(level["errors_by_kind"]["connect"], 4);
}

/// A server that drops its first connection after reading the request (as a server that
/// closed a kept-alive connection at that moment), then answers normally.
async fn serve_dropping_the_first_connection() -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let mut first = true;
        loop {
            let (mut sock, _) = l.accept().await.unwrap();
            let drop_it = std::mem::take(&mut first);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let _ = sock.read(&mut buf).await;
                if drop_it {
                    return;
                }
                let body = format!(
                    "{}{}data: [DONE]\n\n",
                    chunk(json!({"content": "ok"}), None),
                    chunk(json!({}), Some("stop"))
                );
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = sock.write_all(head.as_bytes()).await;
                let _ = sock.write_all(body.as_bytes()).await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_connection_closed_before_any_answer_is_retried_once() {
    let addr = serve_dropping_the_first_connection().await;
    let client = pdmesh_bench::client::Client::new(
        &format!("http://{addr}/v1"),
        None,
        std::time::Duration::from_secs(10),
    );
    let (rec, ans) = client
        .chat(
            json!({"model": "m", "messages": []}),
            std::time::Instant::now(),
        )
        .await;
    assert_eq!(rec.error, None);
    assert_eq!(ans.content, "ok");
    assert_eq!(ans.finish_reason.as_deref(), Some("stop"));
}

#[tokio::test]
async fn a_reference_that_fails_its_replays_fails_the_run() {
    // Nothing listens on port 9: no answer can be checked, so nothing may pass as checked.
    let sut = serve(Mode::Honest).await;
    let dir = tempfile::tempdir().unwrap();
    let err = pdmesh_bench::run(args(sut, Some("127.0.0.1:9".parse().unwrap()), dir.path()))
        .await
        .expect_err("unchecked answers fail the run");
    assert!(
        matches!(
            err,
            pdmesh_bench::BenchError::ReferenceFailed { failed: 16, .. }
        ),
        "{err}"
    );
    let d = &report(dir.path())[0]["levels"][0]["differential"];
    assert_eq!(
        (d["compared"].as_u64(), d["reference_errors"].as_u64()),
        (Some(0), Some(16))
    );
}

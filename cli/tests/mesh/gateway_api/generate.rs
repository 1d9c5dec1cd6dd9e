//! Generation through the real mesh (tokenizer + worker + gateway, all in-process on
//! 127.0.0.1:0): streaming equals non-streaming, stop strings never reach the client,
//! usage adds up, context limits are 400s, and a client that disconnects mid-stream gets
//! its KV pages freed on the worker. Needs the engine and the default model.

use std::time::Duration;

use super::common::{Mesh, Options, get, metric, post_json, start};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn mesh() -> Mesh {
    start(Options {
        worker: true,
        model_name: None,
        ..Options::default()
    })
    .await
}

async fn model_name(m: &Mesh) -> String {
    get(m.gateway, "/v1/models").await.json()["data"][0]["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn chat_body(model: &str, content: &str, extra: Value) -> Value {
    let mut body = json!({
        "model": model,
        "messages": [{ "role": "user", "content": content }],
        "temperature": 0,
        "max_tokens": 24,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// (content, finish_reason, usage) of a non-streamed chat completion.
async fn chat(m: &Mesh, body: &Value) -> (String, String, Value) {
    let r = post_json(m.gateway, "/v1/chat/completions", body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    (
        choice["message"]["content"].as_str().unwrap().to_owned(),
        choice["finish_reason"].as_str().unwrap().to_owned(),
        v["usage"].clone(),
    )
}

/// (concatenated deltas, finish_reason, usage chunk) of a streamed chat completion.
async fn chat_stream(m: &Mesh, body: &Value) -> (String, String, Option<Value>) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({ "include_usage": true });
    let r = post_json(m.gateway, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let (mut text, mut finish, mut usage) = (String::new(), String::new(), None);
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        assert!(v.get("error").is_none(), "stream error: {v}");
        assert_eq!(v["object"], "chat.completion.chunk");
        if let Some(c) = v["choices"].as_array().and_then(|c| c.first()) {
            if let Some(t) = c["delta"]["content"].as_str() {
                text.push_str(t);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = f.to_owned();
            }
        } else {
            usage = Some(v["usage"].clone());
        }
    }
    (text, finish, usage)
}

#[tokio::test]
async fn slow_stream_and_non_stream_give_the_same_greedy_answer() {
    let m = mesh().await;
    let model = model_name(&m).await;
    let body = chat_body(&model, "Name three colors.", json!({}));
    let (text, finish, usage) = chat(&m, &body).await;
    assert!(!text.is_empty());
    assert!(finish == "stop" || finish == "length", "{finish}");
    let (streamed, s_finish, s_usage) = chat_stream(&m, &body).await;
    assert_eq!(streamed, text);
    assert_eq!(s_finish, finish);
    let s_usage = s_usage.expect("include_usage sends a usage chunk");
    assert_eq!(s_usage["completion_tokens"], usage["completion_tokens"]);
    let (p, c) = (
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["completion_tokens"].as_u64().unwrap(),
    );
    assert!(p > 0 && c > 0 && c <= 24, "{usage}");
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), p + c);
    assert!(
        usage["prompt_tokens_details"]["cached_tokens"].is_u64(),
        "{usage}"
    );
}

#[tokio::test]
async fn slow_completions_stream_and_non_stream_agree() {
    let m = mesh().await;
    let model = model_name(&m).await;
    let body = json!({ "model": model, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 12 });
    let r = post_json(m.gateway, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    // A whole answer says its length (plain HTTP clients read it so, not chunked).
    assert_eq!(
        r.header("content-length"),
        Some(r.body.len().to_string().as_str()),
        "{:?}",
        r.headers
    );
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_owned();
    assert!(!text.is_empty());
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let r = post_json(m.gateway, "/v1/completions", &sbody).await;
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let streamed: String = data[..data.len() - 1]
        .iter()
        .map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        })
        .collect();
    assert_eq!(streamed, text);
}

#[tokio::test]
async fn slow_stop_strings_are_cut_from_the_text_streamed_or_not() {
    let m = mesh().await;
    let model = model_name(&m).await;
    let (full, _, _) = chat(
        &m,
        &chat_body(
            &model,
            "Count from 1 to 20, separated by commas.",
            json!({}),
        ),
    )
    .await;
    // A stop string that first occurs in the middle of the greedy answer.
    let chars: Vec<(usize, char)> = full.char_indices().collect();
    assert!(chars.len() >= 8, "answer too short to test stops: {full:?}");
    let start = chars[chars.len() / 2].0;
    let end = chars.get(chars.len() / 2 + 2).map_or(full.len(), |c| c.0);
    let stop = &full[start..end];
    let cut = &full[..full.find(stop).unwrap()];
    let body = chat_body(
        &model,
        "Count from 1 to 20, separated by commas.",
        json!({ "stop": [stop] }),
    );
    let (text, finish, _) = chat(&m, &body).await;
    assert_eq!(text, cut, "stop {stop:?}");
    assert_eq!(finish, "stop");
    let (streamed, s_finish, _) = chat_stream(&m, &body).await;
    assert_eq!(streamed, cut, "stop {stop:?}");
    assert_eq!(s_finish, "stop");
}

#[tokio::test]
async fn slow_context_limits_are_400_context_length_exceeded() {
    let m = mesh().await;
    let model = model_name(&m).await;
    let r = post_json(
        m.gateway,
        "/v1/chat/completions",
        &chat_body(&model, "hi", json!({ "max_tokens": 10_000_000 })),
    )
    .await;
    assert_eq!(r.expect_error(400)["code"], "context_length_exceeded");
    let long = "hello ".repeat(40_000);
    let r = post_json(
        m.gateway,
        "/v1/completions",
        &json!({ "model": model, "prompt": long, "max_tokens": 4 }),
    )
    .await;
    assert_eq!(r.expect_error(400)["code"], "context_length_exceeded");
    let r = post_json(
        m.gateway,
        "/v1/completions",
        &json!({ "model": model, "prompt": [1, 2, 4_000_000] }),
    )
    .await;
    r.expect_error(400);
}

#[tokio::test]
async fn slow_concurrent_requests_get_their_solo_answers() {
    let m = mesh().await;
    let model = model_name(&m).await;
    let prompts = [
        "Say hello.",
        "What is 2+2?",
        "Name a fruit.",
        "Describe the sea in one sentence.",
    ];
    let mut solo = Vec::new();
    for p in prompts {
        solo.push(
            chat(&m, &chat_body(&model, p, json!({ "max_tokens": 16 })))
                .await
                .0,
        );
    }
    let together = futures::future::join_all(
        prompts
            .iter()
            .map(|p| chat_body(&model, p, json!({ "max_tokens": 16 })))
            .map(|b| {
                let m = &m;
                async move { chat(m, &b).await.0 }
            }),
    )
    .await;
    assert_eq!(together, solo);
}

#[tokio::test]
async fn slow_a_client_disconnect_mid_stream_frees_the_worker_pages() {
    let m = mesh().await;
    let model = model_name(&m).await;
    // Pages a new request could get: free plus those only the prefix cache holds.
    let pages = |text: &str| {
        (
            metric(text, "mesh_kv_pages_free")
                .zip(metric(text, "mesh_kv_pages_cached"))
                .map(|(f, c)| f + c),
            metric(text, "mesh_kv_pages_capacity"),
        )
    };
    let prompt = "Tell me a very long story.";
    // Warm-up with the same prompt, so pages a prefix cache keeps are in the baseline.
    chat(&m, &chat_body(&model, prompt, json!({ "max_tokens": 1 }))).await;
    let (free0, total) = pages(&get(m.gateway, "/metrics").await.text());
    let (free0, total) = (free0.unwrap(), total.unwrap());
    assert!(total > 0.0);

    // A generation up to the context length (ignore_eos: it cannot end early on its own).
    let body = chat_body(
        &model,
        prompt,
        json!({ "stream": true, "max_tokens": null, "ignore_eos": true }),
    );
    let payload = body.to_string();
    let mut s = tokio::net::TcpStream::connect(m.gateway).await.unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{payload}",
        payload.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    // Read until a few content deltas arrived: the request is running on the worker.
    while seen.windows(9).filter(|w| w == b"\"content\"").count() < 4 {
        let n = s.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    let (busy, _) = pages(&get(m.gateway, "/metrics").await.text());
    assert!(busy.unwrap() < free0, "a running request holds pages");
    drop(s);

    // Generating to the context length takes far longer than this; only an abort frees them.
    let mut free = busy.unwrap();
    for _ in 0..300 {
        free = pages(&get(m.gateway, "/metrics").await.text()).0.unwrap();
        if free == free0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        free, free0,
        "pages were not returned after the client went away"
    );
}

#[tokio::test]
async fn slow_flush_cache_frees_every_cached_page_and_the_answer_stays_the_same() {
    let m = mesh().await;
    let model = model_name(&m).await;
    let body = chat_body(
        &model,
        "List the colors of the rainbow, one per line, and say why each appears.",
        json!({}),
    );
    let (first, _, _) = chat(&m, &body).await;
    let text = get(m.gateway, "/metrics").await.text();
    let cached = metric(&text, "mesh_kv_pages_cached").unwrap();
    assert!(cached > 0.0, "the answer's pages are cached");

    let r = post_json(m.gateway, "/flush_cache", &json!({})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["pages_flushed"].as_f64(), Some(cached), "{v}");
    assert_eq!(v["workers"][0]["role"], "unified", "{v}");
    assert_eq!(v["workers"][0]["pages_flushed"].as_f64(), Some(cached));
    let text = get(m.gateway, "/metrics").await.text();
    assert_eq!(metric(&text, "mesh_kv_pages_cached"), Some(0.0));
    assert_eq!(
        metric(&text, "mesh_kv_pages_free"),
        metric(&text, "mesh_kv_pages_capacity"),
    );
    // Nothing cached any more: the same question is computed again, to the same answer.
    let (again, _, usage) = chat(&m, &body).await;
    assert_eq!(again, first);
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 0,
        "{usage}"
    );
    // A second flush finds only the pages the second answer left.
    let r = post_json(m.gateway, "/flush_cache", &json!({})).await;
    assert_eq!(r.json()["pages_flushed"].as_f64(), Some(cached));
}

/// The default model's tokenizer metadata (no tensors) with two ordinary tokens' strings
/// swapped: a tokenizer that loads, whose fingerprint differs from the service's.
fn other_tokenizer_gguf(dir: &std::path::Path) -> std::path::PathBuf {
    use pdmesh_gguf::{GgufFile, GgufWriter, MetaValue};
    let g = GgufFile::open(pdmesh_gguf::models::require_default_model()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in &g.metadata {
        let mut v = v.clone();
        if k == "tokenizer.ggml.tokens"
            && let MetaValue::Array(tokens) = &mut v
        {
            tokens.swap(1000, 1001);
        }
        w.meta(k, v);
    }
    let path = dir.join("other-tokenizer.gguf");
    w.write_to(&path).unwrap();
    path
}

/// (content, tool calls as [name, arguments], finish_reason, completion_tokens).
async fn answer(m: &Mesh, body: &Value) -> (Value, Value, Value, u64) {
    let r = post_json(m.gateway, "/v1/chat/completions", body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let msg = &v["choices"][0]["message"];
    let calls: Vec<Value> = msg["tool_calls"]
        .as_array()
        .map(|c| {
            c.iter()
                .map(|c| json!([c["function"]["name"], c["function"]["arguments"]]))
                .collect()
        })
        .unwrap_or_default();
    (
        msg["content"].clone(),
        Value::Array(calls),
        v["choices"][0]["finish_reason"].clone(),
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    )
}

async fn detokenized(m: &Mesh, place: &str) -> f64 {
    let text = get(m.gateway, "/metrics").await.text();
    metric(
        &text,
        &format!("mesh_detokenized_tokens_total{{place=\"{place}\"}}"),
    )
    .unwrap_or_else(|| panic!("no detokenized count for {place}"))
}

/// With `--model` the gateway turns tokens into text itself: plain answers, stop strings,
/// tool calls (Hermes markup parsed into `tool_calls`) and streamed deltas all equal what
/// the tokenizer service makes of the same tokens, and the tokens are counted as made in
/// the gateway. Given another tokenizer (two ids' strings swapped) it never uses it: the
/// answers still come from the service, also equal.
#[tokio::test]
async fn slow_in_process_detokenizing_gives_the_tokenizer_services_text() {
    let dir = tempfile::tempdir().unwrap();
    let remote = mesh().await;
    let with = |model| {
        start(Options {
            worker: true,
            model_name: None,
            gateway_model: Some(model),
            ..Options::default()
        })
    };
    let local = with(pdmesh_gguf::models::require_default_model()).await;
    let other = with(other_tokenizer_gguf(dir.path())).await;
    let model = model_name(&remote).await;
    let tools = json!([{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }]);
    let bodies = [
        chat_body(
            &model,
            "Write a short poem about the sea, with an emoji 🌊.",
            json!({}),
        ),
        chat_body(
            &model,
            "Count from one to twenty in words.",
            json!({ "stop": [" five"] }),
        ),
        chat_body(
            &model,
            "What is the weather in Paris?",
            json!({ "tools": tools, "tool_choice": "required", "max_tokens": 60 }),
        ),
        chat_body(&model, "Say hello.", json!({ "max_tokens": 3 })),
    ];
    let mut generated = 0;
    for body in &bodies {
        let want = answer(&remote, body).await;
        assert_eq!(answer(&local, body).await, want, "{body}");
        assert_eq!(answer(&other, body).await, want, "{body}");
        assert_eq!(
            chat_stream(&local, body).await.0,
            chat_stream(&remote, body).await.0
        );
        generated += 2 * want.3;
    }
    let calls = answer(&remote, &bodies[2]).await.1;
    assert_eq!(
        calls[0][0], "get_weather",
        "tool_choice=required gave {calls}"
    );
    // Every token up to each answer's end (a stop string's tail is never detokenized).
    let made = detokenized(&local, "gateway").await;
    assert!(
        made > 0.0 && made <= generated as f64,
        "{made} of {generated}"
    );
    assert_eq!(detokenized(&local, "tokenizer").await, 0.0);
    assert_eq!(detokenized(&other, "gateway").await, 0.0);
    assert!(detokenized(&other, "tokenizer").await > 0.0);
}

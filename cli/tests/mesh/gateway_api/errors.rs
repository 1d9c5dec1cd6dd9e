//! The gateway's answers that need no engine: OpenAI error bodies for bad input, auth,
//! routing, body limits, a worker that is down, `/health` and `/metrics`. The real
//! tokenizer runs; the worker URL points at a closed port, except where a refusal comes
//! only after the model's facts (a chat request to a model without a chat template).

use super::common::{Options, get, post_json, post_raw, request, start};
use serde_json::json;

fn chat(extra: serde_json::Value) -> serde_json::Value {
    let mut body =
        json!({ "model": "test-model", "messages": [{ "role": "user", "content": "hi" }] });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test]
async fn bad_requests_get_400_with_an_openai_error_body() {
    let mesh = start(Options::default()).await;
    let g = mesh.gateway;
    let cases: Vec<(&str, serde_json::Value, Option<&str>)> = vec![
        (
            "max_tokens 0",
            chat(json!({ "max_tokens": 0 })),
            Some("max_tokens"),
        ),
        (
            "negative max_tokens",
            chat(json!({ "max_tokens": -3 })),
            Some("max_tokens"),
        ),
        (
            "negative temperature",
            chat(json!({ "temperature": -0.5 })),
            Some("temperature"),
        ),
        ("top_p 0", chat(json!({ "top_p": 0.0 })), Some("top_p")),
        (
            "top_p above 1",
            chat(json!({ "top_p": 1.01 })),
            Some("top_p"),
        ),
        ("n 17", chat(json!({ "n": 17 })), Some("n")),
        (
            "five stop strings",
            chat(json!({ "stop": ["a", "b", "c", "d", "e"] })),
            Some("stop"),
        ),
        (
            // This gateway has no --model: it cannot name tokens.
            "logprobs without the gateway's tokenizer",
            chat(json!({ "logprobs": true })),
            Some("logprobs"),
        ),
        (
            "top_logprobs without logprobs",
            chat(json!({ "top_logprobs": 2 })),
            Some("top_logprobs"),
        ),
        (
            "a logit_bias key that is no token id",
            chat(json!({ "logit_bias": { "x": 1 } })),
            Some("logit_bias"),
        ),
        (
            "wrong type",
            chat(json!({ "temperature": "warm" })),
            Some("temperature"),
        ),
        (
            "no messages",
            chat(json!({ "messages": [] })),
            Some("messages"),
        ),
        (
            "missing messages",
            json!({ "model": "test-model" }),
            Some("messages"),
        ),
        (
            "missing model",
            json!({ "messages": [{ "role": "user", "content": "x" }] }),
            Some("model"),
        ),
        (
            "unknown role",
            chat(json!({ "messages": [{ "role": "robot", "content": "x" }] })),
            Some("messages[0].role"),
        ),
    ];
    for (what, body, param) in cases {
        let r = post_json(g, "/v1/chat/completions", &body).await;
        let err = r.expect_error(400);
        assert_eq!(err["type"], "invalid_request_error", "{what}: {err}");
        if let Some(p) = param {
            assert_eq!(err["param"], p, "{what}: {err}");
        }
    }
    let comp = |prompt: serde_json::Value| json!({ "model": "test-model", "prompt": prompt });
    for (what, body) in [
        ("two prompts", comp(json!(["a", "b"]))),
        ("empty prompt", comp(json!(""))),
        ("negative token id", comp(json!([1, -2]))),
        ("prompt object", comp(json!({ "text": "x" }))),
    ] {
        let r = post_json(g, "/v1/completions", &body).await;
        r.expect_error(400);
        assert!(!r.text().is_empty(), "{what}");
    }
}

#[tokio::test]
async fn malformed_and_non_utf8_bodies_are_400_json_not_plain_text() {
    let mesh = start(Options::default()).await;
    for body in [
        &b"{\"model\": \"test-model\", \"messages\": ["[..],
        b"",
        b"not json",
        b"[1, 2]",
    ] {
        let r = post_raw(mesh.gateway, "/v1/chat/completions", body).await;
        r.expect_error(400);
        assert!(
            r.header("content-type")
                .unwrap()
                .starts_with("application/json")
        );
    }
    let invalid_utf8 = b"{\"model\": \"test-model\", \"messages\": [{\"role\": \"user\", \"content\": \"caf\xe9\"}]}";
    let r = post_raw(mesh.gateway, "/v1/chat/completions", invalid_utf8).await;
    let err = r.expect_error(400);
    assert!(err["message"].as_str().unwrap().contains("UTF-8"), "{err}");
    let r = post_raw(
        mesh.gateway,
        "/v1/completions",
        b"{\"model\": \"test-model\", \"prompt\": \"\xff\xfe\"}",
    )
    .await;
    r.expect_error(400);
}

#[tokio::test]
async fn an_unknown_model_is_404_model_not_found() {
    let mesh = start(Options::default()).await;
    let r = post_json(
        mesh.gateway,
        "/v1/chat/completions",
        &chat(json!({ "model": "gpt-17" })),
    )
    .await;
    let err = r.expect_error(404);
    assert_eq!(err["code"], "model_not_found");
    let r = post_json(
        mesh.gateway,
        "/v1/completions",
        &json!({ "model": "nope", "prompt": "x" }),
    )
    .await;
    assert_eq!(r.expect_error(404)["code"], "model_not_found");
    let r = get(mesh.gateway, "/v1/models/nope").await;
    r.expect_error(404);
}

#[tokio::test]
async fn models_lists_the_served_name() {
    let mesh = start(Options::default()).await;
    let r = get(mesh.gateway, "/v1/models").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let body = r.json();
    assert_eq!(body["object"], "list");
    assert_eq!(body["data"][0]["id"], "test-model");
    assert_eq!(body["data"][0]["object"], "model");
    assert_eq!(
        get(mesh.gateway, "/v1/models/test-model").await.json()["id"],
        "test-model"
    );
}

#[tokio::test]
async fn a_worker_that_is_down_is_503_and_health_says_which() {
    let mesh = start(Options::default()).await;
    let r = post_json(mesh.gateway, "/v1/chat/completions", &chat(json!({}))).await;
    let err = r.expect_error(503);
    assert_eq!(err["type"], "server_error");
    let r = get(mesh.gateway, "/health").await;
    assert_eq!(r.status, 503);
    let body = r.json();
    assert_eq!(body["tokenizer"], "ok");
    assert_eq!(body["worker"], "unavailable");
    // A cache flush that cannot reach the worker names it.
    let r = post_json(mesh.gateway, "/flush_cache", &json!({})).await;
    let err = r.expect_error(503);
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("the unified worker http://") && msg.contains("flushed 0 pages"),
        "{msg}"
    );
}

#[tokio::test]
async fn api_key_is_required_on_v1_when_configured() {
    let mesh = start(Options {
        api_key: Some("s3cret".into()),
        ..Options::default()
    })
    .await;
    let g = mesh.gateway;
    let r = get(g, "/v1/models").await;
    assert_eq!(r.expect_error(401)["type"], "authentication_error");
    let models =
        async |auth: &str| request(g, "GET", "/v1/models", &[("Authorization", auth)], b"").await;
    models("Bearer wrong").await.expect_error(401);
    let r = models("Bearer s3cret").await;
    assert_eq!(r.status, 200, "{}", r.text());
    // Auth comes before anything else on /v1, even a malformed body.
    let r = post_raw(g, "/v1/chat/completions", b"{").await;
    r.expect_error(401);
    // Flushing the workers' caches is behind the same key.
    post_raw(g, "/flush_cache", b"").await.expect_error(401);
    // Health and metrics stay open for probes and scrapers.
    assert_ne!(get(g, "/health").await.status, 401);
    assert_eq!(get(g, "/metrics").await.status, 200);
}

/// `/debug/*` is the operators': closed (403) without `--admin-key`, 401 without it or
/// with any other key (the API key included), open with it; the admin key opens no
/// `/v1/*` route either.
#[tokio::test]
async fn debug_routes_need_the_admin_key_and_never_take_the_api_key() {
    let dir = tempfile::tempdir().unwrap();
    let closed = start(Options {
        api_key: Some("s3cret".into()),
        incident_dir: Some(dir.path().join("incidents")),
        ..Options::default()
    })
    .await;
    for headers in [&[][..], &[("Authorization", "Bearer s3cret")][..]] {
        let r = request(closed.gateway, "GET", "/debug/incidents", headers, b"").await;
        let e = r.expect_error(403);
        assert_eq!(e["type"], "permission_error", "{e}");
        assert!(
            e["message"].as_str().unwrap().contains("--admin-key"),
            "{e}"
        );
    }
    drop(closed);

    let open = start(Options {
        api_key: Some("s3cret".into()),
        admin_key: Some("adm1n-key".into()),
        incident_dir: Some(dir.path().join("incidents")),
        ..Options::default()
    })
    .await;
    let g = open.gateway;
    for path in [
        "/debug/incidents",
        "/debug/incidents/20000101T000000000Z-wedge-x-1",
    ] {
        assert_eq!(
            get(g, path).await.expect_error(401)["type"],
            "authentication_error"
        );
        for wrong in [
            "Bearer s3cret",
            "Bearer adm1n-kez",
            "Bearer adm1n-key-and-more",
            "adm1n-key",
        ] {
            let r = request(g, "GET", path, &[("Authorization", wrong)], b"").await;
            r.expect_error(401);
        }
    }
    let admin = [("Authorization", "Bearer adm1n-key")];
    let r = request(g, "GET", "/debug/incidents", &admin, b"").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json(), serde_json::json!({"object": "list", "data": []}));
    let r = request(
        g,
        "GET",
        "/debug/incidents/20000101T000000000Z-wedge-x-1",
        &admin,
        b"",
    )
    .await;
    r.expect_error(404);
    let r = request(g, "GET", "/v1/models", &admin, b"").await;
    r.expect_error(401);
}

/// An incident directory others may write to stops the gateway at start, naming it.
#[tokio::test]
async fn a_world_writable_incident_directory_makes_the_gateway_refuse_to_start() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let reports = dir.path().join("incidents");
    std::fs::create_dir(&reports).unwrap();
    std::fs::set_permissions(&reports, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut cfg = pdmesh_gateway::Config::new("http://127.0.0.1:9", "http://127.0.0.1:9");
    cfg.tls = pdmesh_tls::test_ca::args();
    cfg.incidents.dir = Some(reports.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let e = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        pdmesh_gateway::run(cfg, listener, tokio_util::sync::CancellationToken::new()),
    )
    .await
    .expect("the gateway started instead of refusing")
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(&reports.display().to_string()) && e.contains("mode is 0777"),
        "{e}"
    );
}

#[tokio::test]
async fn unknown_routes_wrong_methods_and_huge_bodies_get_json_errors() {
    let mesh = start(Options {
        max_body_bytes: Some(1024),
        ..Options::default()
    })
    .await;
    let g = mesh.gateway;
    get(g, "/v1/embeddings").await.expect_error(404);
    get(g, "/v1/chat/completions").await.expect_error(405);
    let big = chat(json!({ "messages": [{ "role": "user", "content": "x".repeat(4096) }] }));
    post_json(g, "/v1/chat/completions", &big)
        .await
        .expect_error(413);
}

#[tokio::test]
async fn metrics_count_requests_by_endpoint_status_and_error_class() {
    let mesh = start(Options::default()).await;
    let g = mesh.gateway;
    post_json(
        g,
        "/v1/chat/completions",
        &chat(json!({ "temperature": -1 })),
    )
    .await
    .expect_error(400);
    post_json(g, "/v1/chat/completions", &chat(json!({ "model": "x" })))
        .await
        .expect_error(404);
    let r = get(g, "/metrics").await;
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/plain"));
    let text = r.text();
    for needle in [
        r#"mesh_requests_total{endpoint="chat_completions",status="400"} 1"#,
        r#"mesh_requests_total{endpoint="chat_completions",status="404"} 1"#,
        r#"mesh_errors_total{error_type="invalid_request"} 1"#,
        r#"mesh_errors_total{error_type="model_not_found"} 1"#,
        "mesh_request_duration_seconds_bucket",
        "# TYPE mesh_generated_tokens_total counter",
        "# TYPE mesh_prompt_tokens_total counter",
        "# TYPE mesh_kv_pages_free gauge",
    ] {
        assert!(text.contains(needle), "missing {needle} in:\n{text}");
    }
}

/// A model without a chat template (a base model, as Gemma 3 270M is): every chat-shaped
/// endpoint answers 400 in its own API's shape, naming the model and both ways out,
/// streamed or not; never a 500.
#[tokio::test]
async fn chat_to_a_model_without_a_chat_template_is_400_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base-model");
    pdmesh_tokenize::TextTokenizer::from_path(pdmesh_gguf::models::require_default_model())
        .unwrap()
        .write_hf_dir(&base)
        .unwrap();
    let mesh = start(Options {
        worker: true,
        tokenizer_model: Some(base),
        ..Options::default()
    })
    .await;
    let g = mesh.gateway;
    let want = "this model (base-model) has no chat template: serve it with --chat-template FILE \
                (a Jinja template), or use /v1/completions";
    let hi = json!([{ "role": "user", "content": "hi" }]);
    for stream in [false, true] {
        let r = post_json(
            g,
            "/v1/chat/completions",
            &chat(json!({ "stream": stream })),
        )
        .await;
        let err = r.expect_error(400);
        assert_eq!(err["message"], want, "stream {stream}");
        assert_eq!(err["type"], "invalid_request_error");

        let body =
            json!({ "model": "test-model", "max_tokens": 8, "messages": hi, "stream": stream });
        let r = post_json(g, "/v1/messages", &body).await;
        assert_eq!(r.status, 400, "stream {stream}: {}", r.text());
        let v = r.json();
        assert_eq!(
            (&v["type"], &v["error"]["type"], &v["error"]["message"]),
            (
                &json!("error"),
                &json!("invalid_request_error"),
                &json!(want)
            ),
            "stream {stream}"
        );

        let body = json!({ "model": "test-model", "max_output_tokens": 8, "input": "hi", "stream": stream });
        let err = post_json(g, "/v1/responses", &body).await.expect_error(400);
        assert_eq!(err["message"], want, "stream {stream}");
    }
    // Completions need no template.
    let body = json!({ "model": "test-model", "prompt": "hi", "max_tokens": 1 });
    let r = post_json(g, "/v1/completions", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
}

//! Tests of the OpenAPI document: it is served, valid, and says what the handlers check.

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use serde_json::Value;
use tower::ServiceExt as _;

use utoipa::PartialSchema;

use super::*;
use crate::api::responses::request::{FIELDS, IGNORED};
use crate::clients::Backends;
use crate::generate::sampling::{
    MAX_CACHE_SALT_BYTES, MAX_CHOICES, MAX_COMPLETION_LOGPROBS, MAX_STOP, MAX_STOP_BYTES,
    MAX_TOP_LOGPROBS, SamplingFields,
};
use crate::json;
use crate::state::AppState;

/// Every route `handlers::router` serves: (method, path as the router writes it, a
/// path that reaches it, whether it needs the API key (else the admin key, or none)).
const ROUTES: [(&str, &str, &str, Key); 19] = [
    (
        "post",
        "/v1/chat/completions",
        "/v1/chat/completions",
        Key::Api,
    ),
    ("post", "/v1/completions", "/v1/completions", Key::Api),
    ("post", "/v1/messages", "/v1/messages", Key::Api),
    ("post", "/v1/responses", "/v1/responses", Key::Api),
    (
        "get",
        "/v1/responses/{id}",
        "/v1/responses/resp_1",
        Key::Api,
    ),
    (
        "delete",
        "/v1/responses/{id}",
        "/v1/responses/resp_1",
        Key::Api,
    ),
    ("get", "/v1/models", "/v1/models", Key::Api),
    ("get", "/v1/models/{model}", "/v1/models/m", Key::Api),
    ("post", "/tokenize", "/tokenize", Key::Api),
    ("post", "/detokenize", "/detokenize", Key::Api),
    ("post", "/flush_cache", "/flush_cache", Key::Api),
    ("get", "/debug/incidents", "/debug/incidents", Key::Admin),
    (
        "get",
        "/debug/incidents/{id}",
        "/debug/incidents/i1",
        Key::Admin,
    ),
    ("get", "/health", "/health", Key::None),
    ("get", "/ready", "/ready", Key::None),
    ("get", "/live", "/live", Key::None),
    ("get", "/metrics", "/metrics", Key::None),
    ("get", "/openapi.json", "/openapi.json", Key::None),
    // Not a route: what the fallback answers, to tell the routes from it.
    ("get", "", "/no/such/route", Key::None),
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Key {
    Api,
    Admin,
    None,
}

fn doc() -> Value {
    serde_json::from_str(document()).expect("the document is JSON")
}

/// A gateway whose backends refuse every connection, with an API key and an admin key.
fn router(refusing: &pdmesh_testkit::Refusing) -> axum::Router {
    let url = refusing.url();
    let mut cfg = crate::Config::new(&url, &url);
    cfg.tls = pdmesh_tls::test_ca::args();
    cfg.api_key = Some("sk-test".into());
    cfg.admin_key = Some("admin-test".into());
    let backends = Backends::connect_lazy(&url, &url).unwrap();
    let st = AppState::new(cfg, backends, None, Default::default()).unwrap();
    crate::http::router(st)
}

async fn send(app: &axum::Router, method: &str, uri: &str) -> (StatusCode, Vec<u8>) {
    let req = Request::builder()
        .method(Method::from_bytes(method.to_uppercase().as_bytes()).unwrap())
        .uri(uri)
        .body(Body::empty())
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, body.to_vec())
}

#[tokio::test]
async fn every_route_is_served_and_documented_with_its_security() {
    let refusing = pdmesh_testkit::Refusing::new();
    let app = router(&refusing);
    let doc = doc();
    let paths = doc["paths"].as_object().unwrap();
    for (method, path, uri, key) in ROUTES {
        let (status, body) = send(&app, method, uri).await;
        let body: Value = serde_json::from_slice(&body).unwrap_or_default();
        // The fallback's answer (404 "no route for ...") and 405 mean no route here.
        let fallback = status == StatusCode::METHOD_NOT_ALLOWED
            || body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("no route for"));
        if path.is_empty() {
            assert!(fallback, "{uri}: {status} {body}");
            continue;
        }
        assert!(!fallback, "{method} {uri} is not served: {status} {body}");
        // Without a key, a route that needs one answers 401 before its handler runs.
        assert_eq!(
            status == StatusCode::UNAUTHORIZED,
            key != Key::None,
            "{method} {uri}: {status} {body}"
        );
        let op = &paths
            .get(path)
            .unwrap_or_else(|| panic!("{path} is not in the document"))[method];
        assert!(op.is_object(), "{method} {path} is not in the document");
        let security: Vec<&str> = op["security"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|s| s.as_object().unwrap().keys().map(String::as_str))
            .collect();
        let want: &[&str] = match key {
            Key::Api => &["bearer", "api_key"],
            Key::Admin => &["admin"],
            Key::None => &[],
        };
        assert_eq!(security, want, "{method} {path}'s security");
        if key != Key::None {
            assert!(
                op["responses"]["401"].is_object(),
                "{method} {path} does not document its 401"
            );
        }
    }
    // And the document has no operation the router does not serve.
    let documented: Vec<(String, String)> = paths
        .iter()
        .flat_map(|(p, item)| {
            item.as_object()
                .unwrap()
                .keys()
                .map(move |m| (m.clone(), p.clone()))
        })
        .collect();
    let served: Vec<(String, String)> = ROUTES
        .iter()
        .filter(|r| !r.1.is_empty())
        .map(|(m, p, _, _)| (m.to_string(), p.to_string()))
        .collect();
    let sorted = |mut v: Vec<(String, String)>| {
        v.sort();
        v
    };
    assert_eq!(sorted(documented), sorted(served));
}

#[tokio::test]
async fn the_document_is_served_without_a_key_as_openapi_3_1() {
    let refusing = pdmesh_testkit::Refusing::new();
    let (status, body) = send(&router(&refusing), "get", "/openapi.json").await;
    assert_eq!(status, StatusCode::OK);
    let served: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(served, doc());
    assert!(
        served["openapi"].as_str().unwrap().starts_with("3.1"),
        "{}",
        served["openapi"]
    );
    // Every reference resolves.
    let text = document();
    for (i, _) in text.match_indices("\"$ref\":\"#/components/") {
        let rest = &text[i + "\"$ref\":\"#/components/".len()..];
        let target = &rest[..rest.find('"').unwrap()];
        let (kind, name) = target.split_once('/').unwrap();
        assert!(
            served["components"][kind][name].is_object(),
            "dangling reference to {target}"
        );
    }
    for scheme in ["bearer", "api_key", "admin"] {
        assert!(served["components"]["securitySchemes"][scheme].is_object());
    }
    assert_eq!(
        served["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
}

fn request_schema(doc: &Value, method: &str, path: &str) -> Value {
    let body = &doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"];
    let name = body["$ref"]
        .as_str()
        .unwrap_or_else(|| panic!("{path}: {body}"))
        .rsplit('/')
        .next()
        .unwrap();
    doc["components"]["schemas"][name].clone()
}

#[test]
fn the_chat_body_is_the_request_and_its_sampling_fields() {
    let doc = doc();
    let chat = request_schema(&doc, "post", "/v1/chat/completions");
    let required: Vec<&str> = chat["required"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(required, ["model", "messages"]);
    let props = chat["properties"].as_object().unwrap();
    for field in [
        "messages",
        "cache_salt",
        "max_tokens",
        "max_completion_tokens",
        "response_format",
        "stop",
        "n",
        "logit_bias",
        "tools",
    ] {
        assert!(props.contains_key(field), "{field} missing: {chat}");
    }
    assert_eq!(props["messages"]["minItems"], 1);
    assert_eq!(props["max_tokens"]["minimum"], 1);
    assert_eq!(props["n"]["maximum"], MAX_CHOICES);
    assert_eq!(props["top_logprobs"]["maximum"], MAX_TOP_LOGPROBS);
    let completions = request_schema(&doc, "post", "/v1/completions");
    assert!(completions["properties"]["cache_salt"].is_object());
    assert!(completions["properties"]["prompt"]["oneOf"].is_array());
    assert_eq!(
        completions["properties"]["logprobs"]["maximum"],
        MAX_COMPLETION_LOGPROBS
    );
    let messages = request_schema(&doc, "post", "/v1/messages");
    assert_eq!(
        messages["required"],
        json!(["model", "max_tokens", "messages"])
    );
    assert_eq!(
        request_schema(&doc, "post", "/detokenize")["required"],
        json!(["tokens"])
    );
    let tokenize = request_schema(&doc, "post", "/tokenize");
    let alternatives = &tokenize["allOf"][1]["oneOf"];
    assert_eq!(alternatives[0]["required"], json!(["prompt"]));
    assert_eq!(alternatives[1]["required"], json!(["messages"]));
}

#[test]
fn the_responses_body_lists_what_its_field_check_lets_through() {
    let doc = doc();
    let schema = request_schema(&doc, "post", "/v1/responses");
    let props = schema["properties"].as_object().unwrap();
    for f in FIELDS.iter().chain(&IGNORED) {
        assert!(props.contains_key(*f), "{f} missing");
    }
    // Anything else is refused unless null.
    assert_eq!(schema["additionalProperties"], json!({"type": "null"}));
    for refused in ["n", "max_tokens", "max_completion_tokens"] {
        assert!(!props.contains_key(refused), "{refused}");
    }
    let items = &doc["components"]["schemas"]["ResponseInputItem"]["oneOf"];
    assert_eq!(items.as_array().unwrap().len(), 4);
    assert_eq!(
        items[1]["properties"]["type"]["enum"],
        json!(["function_call"])
    );
}

#[test]
fn anthropic_blocks_are_the_served_types() {
    let doc = doc();
    let blocks = doc["components"]["schemas"]["AnthropicContentBlock"]["oneOf"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["properties"]["type"]["enum"][0].as_str().unwrap())
        .collect::<Vec<_>>();
    assert_eq!(blocks, ["text", "tool_use", "tool_result", "thinking"]);
}

/// The document's limits are the handlers': each bound of a sampling field is
/// accepted, and a step past it refused naming the field.
#[test]
fn sampling_limits_are_the_ones_the_gateway_checks() {
    let doc = doc();
    let chat = request_schema(&doc, "post", "/v1/chat/completions");
    let sampling = SamplingFields::schema();
    let RefOr::T(Schema::Object(sampling)) = sampling else {
        panic!("an object");
    };
    let check = |field: &str, v: Value, ok: bool| {
        let body = json!({ field: v }).to_string();
        let got = json::parse::<SamplingFields>(body.as_bytes()).and_then(|f| f.to_params());
        match (got, ok) {
            (Ok(_), true) => {}
            (Err(e), false) => assert_eq!(e.param.as_deref(), Some(field), "{body}"),
            (got, _) => panic!("{body}: {:?}", got.map(|_| ())),
        }
    };
    let mut checked = 0;
    for field in sampling.properties.keys() {
        let p = &chat["properties"][field];
        let integer = p["type"][0] == "integer";
        let step = if integer { json!(1) } else { json!(0.001) };
        let shift = |b: &Value, up: bool| {
            let (b, s) = (b.as_f64().unwrap(), step.as_f64().unwrap());
            let v = if up { b + s } else { b - s };
            if integer { json!(v as i64) } else { json!(v) }
        };
        if let Some(min) = p.get("minimum") {
            check(field, min.clone(), true);
            check(field, shift(min, false), false);
            checked += 1;
        }
        if let Some(min) = p.get("exclusiveMinimum") {
            check(field, min.clone(), false);
            check(field, shift(min, true), true);
            checked += 1;
        }
        if let Some(max) = p.get("maximum") {
            check(field, max.clone(), true);
            check(field, shift(max, true), false);
            checked += 1;
        }
    }
    assert!(checked >= 15, "only {checked} bounds checked");
    for (field, longest) in [
        ("cache_salt", MAX_CACHE_SALT_BYTES),
        ("stop", MAX_STOP_BYTES),
    ] {
        check(field, json!("é".repeat(longest / 2)), true);
        check(field, json!("x".repeat(longest + 1)), false);
        check(field, json!(""), false);
    }
    check("stop", json!(vec!["a"; MAX_STOP]), true);
    check("stop", json!(vec!["a"; MAX_STOP + 1]), false);
    check("logit_bias", json!({"0": -100, "999999999": 100}), true);
    check("logit_bias", json!({"x": 1}), false);
}

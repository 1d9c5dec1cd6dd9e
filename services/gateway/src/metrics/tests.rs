//! Tests of the metrics: their names, labels and what `/metrics` renders.

use pdmesh_telemetry::labels::{RoomAbort, RoomState, TransferFailure};

use super::*;

#[test]
fn the_other_services_incident_counts_add_what_grew_since_the_last_read() {
    let m = Metrics::new().unwrap();
    let count = |m: &Metrics| m.incidents.with_label_values(&["checksum"]).get();
    let c = |n: u64| [("checksum".to_owned(), n), ("no_such_kind".to_owned(), 9)];
    let (w1, w2) = ("worker http://a:1", "worker http://b:1");
    m.remote_incidents(w1, c(2).iter().map(|(k, v)| (k, v)));
    m.remote_incidents(w2, c(4).iter().map(|(k, v)| (k, v)));
    m.remote_incidents("cache http://a:2", c(1).iter().map(|(k, v)| (k, v)));
    assert_eq!(count(&m), 7);
    m.remote_incidents(w1, c(5).iter().map(|(k, v)| (k, v)));
    assert_eq!(count(&m), 10);
    // One worker restarted: its count starts again from what it says, and the other
    // worker's, unchanged, adds nothing (read summed, the fall from 9 to 5 would have
    // counted all 5 again).
    m.remote_incidents(w1, c(1).iter().map(|(k, v)| (k, v)));
    m.remote_incidents(w2, c(4).iter().map(|(k, v)| (k, v)));
    assert_eq!(count(&m), 11);
    m.incident(pdmesh_incident::Kind::Checksum);
    assert_eq!(count(&m), 12);
    assert!(!m.render().contains("no_such_kind"));
}

#[test]
fn exposition_has_the_documented_names_and_labels() {
    let m = Metrics::new().unwrap();
    m.observe_request(Endpoint::ChatCompletions, 200, 0.1);
    m.error(ErrorType::InvalidRequest);
    m.generated_tokens.inc_by(5);
    let text = m.render();
    assert!(
        text.contains(r#"mesh_requests_total{endpoint="chat_completions",status="200"} 1"#),
        "{text}"
    );
    assert!(
        text.contains("mesh_request_duration_seconds_bucket"),
        "{text}"
    );
    assert!(
        text.contains(r#"mesh_errors_total{error_type="invalid_request"} 1"#),
        "{text}"
    );
    assert!(text.contains("mesh_generated_tokens_total 5"), "{text}");
    assert!(text.contains("mesh_kv_pages_free"), "{text}");
}

#[test]
fn device_evictions_count_differences_and_survive_a_worker_restart() {
    let m = Metrics::new().unwrap();
    let count = |m: &Metrics| m.kv_evictions.get("device");
    m.kv_evictions.observe("device", 7.0);
    m.kv_evictions.observe("device", 10.0);
    assert_eq!(count(&m), 10.0);
    m.kv_evictions.observe("device", 2.0); // the worker restarted and evicted 2 since
    assert_eq!(count(&m), 12.0);
    assert!(
        m.render()
            .contains(r#"mesh_kv_cache_evictions_total{tier="device"} 12"#)
    );
}

#[test]
fn unknown_paths_and_codes_fall_into_closed_buckets() {
    assert_eq!(endpoint_label("/admin/secret/123"), Endpoint::Other);
    assert_eq!(status_label(418), StatusLabel::Other4xx);
    assert_eq!(status_label(502), StatusLabel::Other5xx);
}

/// `name{label="value"} 0` is in `text`.
fn at_zero(text: &str, name: &str, labels: &[(&str, &str)]) -> bool {
    let labels: Vec<_> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    text.contains(&format!("{name}{{{}}} 0\n", labels.join(",")))
}

#[test]
fn every_value_of_every_closed_label_set_is_at_zero_before_any_event() {
    let text = Metrics::new().unwrap().render();
    let mut missing = Vec::new();
    let mut check = |name: &str, labels: &[(&str, &str)]| {
        if !at_zero(&text, name, labels) {
            missing.push(format!("{name}{labels:?}"));
        }
    };
    for e in Endpoint::names() {
        for s in StatusLabel::names() {
            check("mesh_requests_total", &[("endpoint", e), ("status", s)]);
        }
        check("mesh_request_duration_seconds_count", &[("endpoint", e)]);
    }
    for e in ErrorType::names() {
        check("mesh_errors_total", &[("error_type", e)]);
    }
    for p in pdmesh_chat::PARSERS {
        for r in pdmesh_chat::FAILURE_REASONS {
            check(
                "mesh_tool_call_parse_failures_total",
                &[("parser", p), ("reason", r)],
            );
        }
    }
    for r in TransferFailure::names() {
        check("mesh_kv_transfer_failures_total", &[("reason", r)]);
    }
    for r in RoomAbort::names() {
        check("mesh_room_aborts_total", &[("reason", r)]);
    }
    for st in RoomState::names() {
        check("mesh_room_timeouts_total", &[("stage", st)]);
        check("mesh_rooms", &[("state", st)]);
        check("mesh_room_oldest_seconds", &[("state", st)]);
    }
    for st in Stage::names() {
        check("mesh_request_stage_seconds_count", &[("stage", st)]);
    }
    for src in PromptSource::names() {
        check("mesh_prompt_token_sources_total", &[("source", src)]);
    }
    for t in EVERY_TIER {
        check("mesh_kv_cache_evictions_total", &[("tier", t)]);
        check("mesh_kv_cache_hit_tokens_total", &[("tier", t)]);
    }
    for e in ["spilled", "spill_dropped", "promoted", "late"] {
        check("mesh_kv_disk_pages_total", &[("event", e)]);
    }
    for r in pdmesh_telemetry::labels::DiskDiscard::names() {
        check("mesh_kv_disk_discards_total", &[("reason", r)]);
    }
    for s in ["serving", "degraded"] {
        check("mesh_kv_disk_tier", &[("state", s)]);
    }
    check("mesh_kv_transfers_total", &[("outcome", "failed")]);
    check("mesh_route_prefill_total", &[("reason", "prefix")]);
    check("mesh_stalls_total", &[("component", "room")]);
    check("mesh_handovers", &[("side", "decode")]);
    check("mesh_rooms_older_than", &[("seconds", "120")]);
    assert!(
        missing.is_empty(),
        "not at 0 from the start: {missing:?}\n{text}"
    );
    // An open set: no worker is known yet.
    assert!(!text.contains("mesh_router_cached_pages{"), "{text}");
}

#[test]
fn a_reason_a_newer_worker_sends_counts_as_other() {
    let m = Metrics::new().unwrap();
    m.pd.transfer_failures.observe("deadline", 2.0);
    m.pd.transfer_failures.observe("cosmic_ray", 3.0);
    m.pd.room_aborts.observe("gremlin", 1.0);
    let text = m.render();
    assert!(
        text.contains(r#"mesh_kv_transfer_failures_total{reason="deadline"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(r#"mesh_kv_transfer_failures_total{reason="other"} 3"#),
        "{text}"
    );
    assert!(
        text.contains(r#"mesh_room_aborts_total{reason="other"} 1"#),
        "{text}"
    );
    assert!(
        !text.contains("cosmic_ray") && !text.contains("gremlin"),
        "{text}"
    );
}

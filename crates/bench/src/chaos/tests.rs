//! Tests of the verdict and the checks made before any fault: error classes, each failing
//! check, refused scenarios, the process check, and the byte flip.

use super::flip::{FLIP_BLOCK, Flipped, flip_file};
use super::process::check_process;
use super::verdict::{Class, classify, is_overloaded};
use super::*;

fn tally(errors: &[(Option<&str>, f64)]) -> Tally {
    let mut t = Tally::new(40.0);
    for (e, s) in errors {
        t.add(*e, *s);
    }
    t
}

fn settled(ok: bool) -> Settled {
    Settled {
        baseline: ok,
        waited_s: 0.5,
        pages_held: if ok { 0.0 } else { 3.0 },
        pages_capacity: 128.0,
        detail: "x".into(),
    }
}

fn answers(compared: u32, differing: u32) -> Answers {
    Answers {
        compared,
        differing,
        examples: Vec::new(),
    }
}

fn passed(checks: &[Check]) -> Vec<(&'static str, bool)> {
    checks.iter().map(|c| (c.name, c.passed)).collect()
}

#[test]
fn errors_are_clean_refusals_timeouts_or_broken_connections() {
    assert_eq!(classify(None), Class::Ok);
    assert_eq!(classify(Some("503")), Class::Refused("503".into()));
    assert_eq!(classify(Some("429")), Class::Refused("429".into()));
    assert_eq!(
        classify(Some("in_stream:service_unavailable")),
        Class::Refused("in_stream:service_unavailable".into())
    );
    assert_eq!(classify(Some("timeout")), Class::TimedOut);
    for e in ["stream", "connect", "send", "200", "abc"] {
        assert_eq!(classify(Some(e)), Class::Broken(e.into()), "{e}");
    }
    assert!(is_overloaded("429") && is_overloaded("in_stream:overloaded"));
    assert!(!is_overloaded("503") && !is_overloaded("in_stream:service_unavailable"));
}

#[test]
fn a_mesh_that_answers_or_refuses_cleanly_in_time_settles_and_agrees_passes() {
    let t = tally(&[
        (None, 1.0),
        (Some("503"), 2.0),
        (Some("in_stream:service_unavailable"), 3.5),
    ]);
    assert_eq!((t.sent, t.ok, t.refused_total()), (3, 1, 2));
    assert_eq!(t.slowest_s, 3.5);
    let d = t.describe();
    assert!(
        d.contains("3 sent: 1 ok, 2 refused (503 x1, in_stream:service_unavailable x1)"),
        "{d}"
    );
    let checks = judge(
        &t,
        &settled(true),
        &answers(4, 0),
        "the healthy mesh's answers",
        vec![],
    );
    assert_eq!(
        passed(&checks),
        [
            ("requests ended in time", true),
            ("no leaked pages", true),
            ("answers identical", true)
        ]
    );
}

#[test]
fn each_failure_fails_its_own_check() {
    let ok = tally(&[(None, 1.0)]);
    let fails = |t: &Tally, s: &Settled, a: &Answers, own: Vec<Check>| {
        judge(t, s, a, "r", own)
            .into_iter()
            .filter(|c| !c.passed)
            .map(|c| c.name)
            .collect::<Vec<_>>()
    };
    // A hang past the deadline, a connection broken without an error, a request slower
    // than the deadline however it ended.
    for t in [
        tally(&[(None, 1.0), (Some("timeout"), 40.0)]),
        tally(&[(None, 1.0), (Some("stream"), 2.0)]),
        tally(&[(None, 41.0)]),
    ] {
        assert_eq!(
            fails(&t, &settled(true), &answers(1, 0), vec![]),
            ["requests ended in time"]
        );
    }
    assert_eq!(
        fails(&ok, &settled(false), &answers(1, 0), vec![]),
        ["no leaked pages"]
    );
    assert_eq!(
        fails(&ok, &settled(true), &answers(3, 1), vec![]),
        ["answers identical"]
    );
    // Nothing compared is nothing shown.
    let none = judge(&ok, &settled(true), &answers(0, 0), "r", vec![]);
    assert!(none[2].detail.contains("no answer to compare"));
    assert!(!none[2].passed);
    let own = Check {
        name: "corruption caught",
        passed: false,
        detail: String::new(),
    };
    assert_eq!(
        fails(&ok, &settled(true), &answers(1, 0), vec![own]),
        ["corruption caught"]
    );
}

#[test]
fn the_verdict_table_shows_every_check_and_the_outcome() {
    let t = tally(&[(None, 1.0)]);
    let checks = judge(&t, &settled(false), &answers(1, 0), "r", vec![]);
    let v = Verdict {
        scenario: Scenario::FlipHostBytes,
        url: "http://127.0.0.1:1/v1".into(),
        passed: checks.iter().all(|c| c.passed),
        checks,
        fault: "flipped".into(),
        requests: t,
        settled: settled(false),
        answers: answers(1, 0),
        checksum_failures: Some(6.0),
        duration_s: 12.0,
    };
    let table = v.table();
    assert!(
        table.starts_with("pdmesh chaos flip-host-bytes: http://127.0.0.1:1/v1\nfault: flipped"),
        "{table}"
    );
    assert!(table.contains("  PASS  requests ended in time"), "{table}");
    assert!(table.contains("  FAIL  no leaked pages"), "{table}");
    assert!(table.contains("checksum failures seen: 6"), "{table}");
    assert!(table.ends_with("verdict: FAIL in 12 s"), "{table}");
    let json = serde_json::to_value(&v).unwrap();
    assert_eq!(json["scenario"], "flip-host-bytes");
    assert_eq!(json["passed"], false);
    assert_eq!(json["checks"][1]["name"], "no leaked pages");
    assert_eq!(json["requests"]["ok"], 1);
}

fn mesh_file(mode: &str, restart: bool, cache: u16) -> MeshFile {
    MeshFile::parse(&format!(
        r#"{{"url": "http://127.0.0.1:1/v1", "host": "127.0.0.1", "mode": "{mode}",
                "gateway": 1, "tokenizer": 2, "worker": 3, "cache": {cache}, "model": "m",
                "restart": {restart},
                "pids": {{"up": 1, "tokenizer": 2, "worker": 3, "gateway": 4, "cache": {cache}}}}}"#
    ))
    .unwrap()
}

#[test]
fn scenarios_the_mesh_cannot_run_are_refused_up_front_saying_why() {
    let refused = |s: Scenario, m: &MeshFile| check_suitable(s, m).unwrap_err().to_string();
    let no_restart = mesh_file("pd", false, 9);
    let e = refused(Scenario::KillPrefill, &no_restart);
    assert!(
        e.starts_with("kill-prefill needs") && e.contains("pdmesh up --restart"),
        "{e}"
    );
    let unified = mesh_file("unified", true, 9);
    for s in [Scenario::KillDecode, Scenario::ExhaustDecode] {
        let e = refused(s, &unified);
        assert!(e.contains("disaggregated") && e.contains("unified"), "{e}");
    }
    let no_cache = mesh_file("unified", false, 0);
    for s in [Scenario::StallCache, Scenario::FlipHostBytes] {
        assert!(refused(s, &no_cache).contains("--no-host-cache"));
    }
    assert!(check_suitable(Scenario::DisconnectClients, &no_cache).is_ok());
    assert!(check_suitable(Scenario::FlipHostBytes, &unified).is_ok());
    assert!(check_suitable(Scenario::KillPrefill, &mesh_file("pd", true, 9)).is_ok());
}

#[test]
fn a_signal_only_goes_to_the_process_the_ports_file_names() {
    // This test process is not a pdmesh service on port 1.
    let me = std::process::id();
    let e = check_process(me, "prefill", 1).unwrap_err().to_string();
    assert!(e.contains(&format!("pid {me} is not the prefill")), "{e}");
    assert!(e.contains("stale"), "{e}");
    let e = check_process(0, "cache", 1).unwrap_err().to_string();
    assert!(e.contains("names no pid"), "{e}");
}

#[test]
fn flipping_changes_one_byte_per_written_block_and_leaves_holes_alone() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pdmesh-mirror-test");
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(4 * FLIP_BLOCK as u64 + 100).unwrap();
    // Two blocks with data (one of them starting with a zero byte), the rest holes.
    file.write_all_at(&[0, 7, 7], FLIP_BLOCK as u64).unwrap();
    file.write_all_at(&[9], 3 * FLIP_BLOCK as u64 + 10).unwrap();
    let before = std::fs::read(&path).unwrap();
    let f = flip_file(&path).unwrap();
    assert_eq!(
        f,
        Flipped {
            bytes: 2,
            file_bytes: before.len() as u64
        }
    );
    let after = std::fs::read(&path).unwrap();
    let changed: Vec<usize> = (0..before.len())
        .filter(|&i| before[i] != after[i])
        .collect();
    assert_eq!(changed, [FLIP_BLOCK, 3 * FLIP_BLOCK]);
    assert_eq!(after[FLIP_BLOCK], 0xff);
    assert_eq!(after[3 * FLIP_BLOCK], 0xff);
}

//! Tests of `up`'s parts that need no services: addresses, the model check, each role's
//! flags, the restart backoff and the ports file.

use std::path::Path;

use super::service::{BACKOFF_MIN, BACKOFF_RESET};
use super::*;

#[test]
fn wildcard_hosts_are_probed_on_loopback() {
    assert_eq!(
        reachable("0.0.0.0".parse().unwrap(), 80),
        "127.0.0.1:80".parse().unwrap()
    );
    assert_eq!(
        reachable("::".parse().unwrap(), 80),
        "[::1]:80".parse().unwrap()
    );
    assert_eq!(
        reachable("10.1.2.3".parse().unwrap(), 80),
        "10.1.2.3:80".parse().unwrap()
    );
}

#[test]
fn an_explicit_missing_model_says_how_to_get_one() {
    let err = resolve_model(Some(Path::new("/nonexistent/model.gguf"))).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("pdmesh model fetch"), "{msg}");
    assert!(msg.contains("/nonexistent/model.gguf"), "{msg}");
}

fn up(argv: &[&str]) -> UpArgs {
    use clap::Parser;
    let cli = crate::args::Cli::try_parse_from(["pdmesh", "up"].iter().chain(argv)).unwrap();
    match cli.command {
        crate::args::Command::Up(u) => u,
        _ => unreachable!(),
    }
}

#[test]
fn each_role_refuses_the_flags_of_another_and_needs_its_own() {
    let err = |argv: &[&str]| check_role(&up(argv)).unwrap_err().to_string();
    assert!(check_role(&up(&[])).is_ok());
    assert!(err(&["--prefill-url", "http://10.0.0.2:7200"]).contains("--role gateway"));
    assert!(err(&["--role", "gateway"]).contains("--prefill-url and --decode-url"));
    let gw = [
        "--role",
        "gateway",
        "--prefill-url",
        "http://10.0.0.2:7200",
        "--decode-url",
        "http://10.0.0.3:7200",
    ];
    assert!(check_role(&up(&gw)).is_ok());
    assert!(err(&[&gw[..], &["--unified"]].concat()).contains("--unified"));
    assert!(err(&[&gw[..], &["--cache-url", "10.0.0.3:7100"]].concat()).contains("http://"));
    // A host's part must listen where the other hosts reach it.
    assert!(err(&["--role", "decode"]).contains("--host"));
    assert!(err(&["--role", "decode", "--host", "0.0.0.0"]).contains("--host"));
    assert!(check_role(&up(&["--role", "decode", "--host", "10.0.0.3"])).is_ok());
    let d = ["--role", "decode", "--host", "10.0.0.3"];
    assert!(
        err(&[&d[..], &["--worker-port", "65535", "--decode", "2"]].concat())
            .contains("--worker-port")
    );
    assert!(err(&[&d[..], &["--worker-port", "0"]].concat()).contains("--worker-port"));
    assert!(err(&[&d[..], &["--cache-port", "0"]].concat()).contains("--cache-port"));
    assert!(
        check_role(&up(
            &[&d[..], &["--worker-port", "65534", "--decode", "2"]].concat()
        ))
        .is_ok()
    );
    assert!(
        err(&[
            "--role",
            "prefill",
            "--host",
            "10.0.0.2",
            "--decode-url",
            "http://x:1"
        ])
        .contains("--decode-url is for --role gateway")
    );
}

#[test]
fn restarts_back_off_doubling_up_to_a_cap_and_reset_after_a_long_run() {
    let mut b = Backoff::default();
    let quick = Duration::from_secs(2);
    let waits: Vec<u64> = (0..7).map(|_| b.after_exit(quick).as_secs()).collect();
    assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
    // A service that stayed up a while starts again from the shortest wait.
    assert_eq!(b.after_exit(BACKOFF_RESET), BACKOFF_MIN);
    assert_eq!(b.after_exit(quick), Duration::from_secs(2));
}

#[test]
fn the_ports_file_names_every_pid_and_whether_up_restarts() {
    let layout = MeshLayout {
        url: "http://127.0.0.1:8080/v1".into(),
        host: "127.0.0.1".parse().unwrap(),
        pd: true,
        gateway: 8080,
        tokenizer: 1,
        workers: vec![
            ("decode", "decode", 2),
            ("prefill", "prefill", 3),
            ("prefill-2", "prefill", 4),
        ],
        cache: 5,
        model: "m".into(),
        restart: true,
    };
    let pids = |name: &str| match name {
        "decode" => 20,
        "prefill" => 30,
        "prefill-2" => 40,
        "gateway" => 80,
        _ => 0,
    };
    let file = layout.file(pids);
    // What a reader gets back is what was written.
    let text = serde_json::to_string(&file).unwrap();
    assert_eq!(pdmesh_bench::mesh::MeshFile::parse(&text).unwrap(), file);
    let v = serde_json::to_value(&file).unwrap();
    assert_eq!(v["restart"], true);
    assert_eq!(v["mode"], "pd");
    assert_eq!(v["worker"], 2);
    assert_eq!(v["prefill"], serde_json::json!([3, 4]));
    assert_eq!(v["decode"], serde_json::json!([2]));
    assert_eq!(
        v["pids"]["worker"], 20,
        "the first worker is the decode worker"
    );
    assert_eq!(v["pids"]["prefill"], serde_json::json!([30, 40]));
    assert_eq!(v["pids"]["gateway"], 80);
    assert_eq!(v["pids"]["up"], std::process::id());
    let unified = MeshLayout {
        pd: false,
        workers: vec![("worker", "worker", 2)],
        restart: false,
        ..layout
    };
    let v = serde_json::to_value(unified.file(|n| if n == "worker" { 7 } else { 0 })).unwrap();
    assert_eq!(
        (v["mode"].as_str(), v["restart"].as_bool()),
        (Some("unified"), Some(false))
    );
    assert_eq!(v["pids"]["worker"], 7);
    assert_eq!(v["prefill"], serde_json::json!([]));
}

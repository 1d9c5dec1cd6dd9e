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

/// Resolves `arg` against a model cache in `cache` (a known model is there only if its
/// file is), recording the models a fetch was asked for instead of downloading them.
fn resolve_in(
    cache: &Path,
    arg: &str,
    fetched: &mut Vec<&'static str>,
) -> Result<std::path::PathBuf, UpError> {
    use super::setup::resolve_model_with;
    resolve_model_with(
        Some(Path::new(arg)),
        |m| cache.join(m.file_name),
        |m| {
            fetched.push(m.id);
            Ok(cache.join(m.file_name))
        },
    )
}

#[test]
fn a_known_models_name_serves_its_cached_file_and_fetches_it_when_missing() {
    use pdmesh_gguf::models::{DEFAULT_MODEL, GEMMA3_270M};
    let cache = tempfile::tempdir().unwrap();
    let gemma = cache.path().join(GEMMA3_270M.file_name);
    let mut fetched = Vec::new();
    // Not cached yet: each name fetches its model, and serves where the fetch put it.
    for name in ["gemma3", "gemma3-270m", "GEMMA3"] {
        assert_eq!(resolve_in(cache.path(), name, &mut fetched).unwrap(), gemma);
    }
    assert_eq!(fetched, [GEMMA3_270M.id; 3]);
    let smol = resolve_in(cache.path(), "smollm2", &mut fetched).unwrap();
    assert_eq!(smol, cache.path().join(DEFAULT_MODEL.file_name));
    assert_eq!(fetched.last(), Some(&DEFAULT_MODEL.id));
    // Cached: served as it is, with no fetch.
    std::fs::write(&gemma, b"GGUF").unwrap();
    fetched.clear();
    assert_eq!(
        resolve_in(cache.path(), "gemma3", &mut fetched).unwrap(),
        gemma
    );
    assert!(fetched.is_empty(), "{fetched:?}");
    // A path that exists is served as given, even where a name would match too.
    let here = cache.path().join("gemma3");
    std::fs::write(&here, b"GGUF").unwrap();
    let given = here.to_str().unwrap();
    assert_eq!(resolve_in(cache.path(), given, &mut fetched).unwrap(), here);
    assert!(fetched.is_empty(), "{fetched:?}");
}

#[test]
fn a_name_that_is_no_file_and_no_known_model_lists_the_known_ones() {
    let cache = tempfile::tempdir().unwrap();
    let mut fetched = Vec::new();
    let err = resolve_in(cache.path(), "gemma4", &mut fetched)
        .unwrap_err()
        .to_string();
    assert!(fetched.is_empty(), "{fetched:?}");
    assert!(err.contains("gemma4 does not exist"), "{err}");
    for known in [
        "gemma3-270m (gemma3)",
        "SmolLM2-135M-Instruct (smollm2)",
        "pdmesh model fetch",
    ] {
        assert!(err.contains(known), "{known}: {err}");
    }
}

#[test]
fn a_chat_template_that_cannot_serve_refuses_the_start_naming_flag_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.jinja");
    std::fs::write(&good, "{{ bos_token }}{{ messages[0].content }}").unwrap();
    let broken = dir.path().join("broken.jinja");
    std::fs::write(&broken, "{% if messages %}{{ messages[0].content }}").unwrap();
    let missing = dir.path().join("missing.jinja");
    let args = |f: &Path| up(&["--chat-template", f.to_str().unwrap()]);
    assert!(check_chat_template(&args(&good)).is_ok());
    assert!(check_chat_template(&up(&[])).is_ok());
    for (file, why) in [(&broken, "does not compile"), (&missing, "cannot read it")] {
        let err = check_chat_template(&args(file)).unwrap_err().to_string();
        let flag = format!("--chat-template {}: ", file.display());
        assert!(err.starts_with(&flag) && err.contains(why), "{err}");
    }
    // Only the tokenizer renders chat: a host without one refuses the flag.
    let decode = [
        "--role",
        "decode",
        "--host",
        "10.0.0.3",
        "--chat-template",
        good.to_str().unwrap(),
    ];
    let err = check_role(&up(&decode)).unwrap_err().to_string();
    assert!(
        err.contains("--chat-template is for the tokenizer"),
        "{err}"
    );
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

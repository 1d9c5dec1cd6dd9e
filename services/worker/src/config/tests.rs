//! The worker's flags as a command line gives them: defaults, the checks at start, and
//! what reaches the engine.

use clap::Parser;

use super::*;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    cfg: Config,
}

#[test]
fn command_line_defaults_are_config_new() {
    let cli = Cli::try_parse_from(["worker", "--model", "m.gguf"]).unwrap();
    assert_eq!(cli.cfg, Config::new("m.gguf"));
    let cli = Cli::try_parse_from([
        "worker",
        "--model",
        "m.gguf",
        "--kv-pages",
        "64",
        "--max-context",
        "256",
    ])
    .unwrap();
    assert_eq!((cli.cfg.kv_pages, cli.cfg.max_context), (64, Some(256)));
}

#[test]
fn gpu_flags_are_checked_and_reach_the_engine() {
    let parse = |args: &[&str]| {
        let mut all = vec!["worker", "--model", "m.gguf"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all).unwrap().cfg.engine_config()
    };
    assert_eq!(parse(&[]).unwrap().gpu, None);
    for bad in [
        &["--gpus", "0"][..],
        &["--gpu-fast"],
        &["--gpu-arch", "sm_90"],
    ] {
        let err = parse(bad).unwrap_err().to_string();
        assert!(err.contains("need --device cuda"), "{bad:?}: {err}");
    }
    let cuda = parse(&[
        "--device",
        "cuda",
        "--tp",
        "2",
        "--gpu-arch",
        "sm_120",
        "--gpu-fast",
    ]);
    if !pdmesh_engine::CUDA_BUILT {
        let err = cuda.unwrap_err().to_string();
        assert!(err.contains("built without the CUDA backend"), "{err}");
        return;
    }
    let g = cuda.unwrap().gpu.unwrap();
    assert_eq!(
        (g.devices, g.invariant, g.arch.as_deref()),
        (vec![0, 1], false, Some("sm_120"))
    );
    let g = parse(&["--device", "cuda", "--gpus", "3,1"])
        .unwrap()
        .gpu
        .unwrap();
    assert_eq!((g.devices, g.invariant), (vec![3, 1], true));
    for (bad, want) in [
        (
            &["--device", "cuda", "--tp", "2", "--gpus", "0,1,2"][..],
            "each tensor-parallel rank is one GPU",
        ),
        (&["--device", "cuda", "--gpus", "1,1"], "names a GPU twice"),
        (
            &["--device", "cuda", "--gpu-arch", "90"],
            "not an architecture",
        ),
    ] {
        let err = parse(bad).unwrap_err().to_string();
        assert!(err.contains(want), "{bad:?}: {err}");
    }
}

#[test]
fn tp_reaches_the_engine_and_zero_is_refused() {
    assert_eq!(Config::new("m.gguf").engine_config().unwrap().tp, 1);
    let cli = Cli::try_parse_from(["worker", "--model", "m.gguf", "--tp", "3"]).unwrap();
    assert_eq!(cli.cfg.tp, 3);
    assert_eq!(cli.cfg.engine_config().unwrap().tp, 3);
    let cli = Cli::try_parse_from(["worker", "--tp", "0"]).unwrap();
    let err = cli.cfg.engine_config().unwrap_err().to_string();
    assert!(err.contains("--tp"), "{err}");
}

#[test]
fn zero_sizes_are_refused_naming_the_flag() {
    let cfg = Config {
        kv_pages: 0,
        ..Config::new("m.gguf")
    };
    let err = cfg.engine_config().unwrap_err();
    assert!(err.to_string().contains("--kv-pages"), "{err}");
    let ok = Config::new("m.gguf").engine_config().unwrap();
    assert_eq!((ok.kv_pages, ok.page_size, ok.max_batch), (2048, 16, 32));
}

/// The step target reaches the engine in milliseconds; 0 turns it off (the fixed
/// prefill chunk).
#[test]
fn the_step_target_reaches_the_engine_and_zero_turns_it_off() {
    let on = Config::new("m.gguf").engine_config().unwrap();
    assert_eq!(on.step_target, Some(std::time::Duration::from_millis(200)));
    let off = Config {
        step_target_ms: 0,
        ..Config::new("m.gguf")
    };
    assert_eq!(off.engine_config().unwrap().step_target, None);
}

#[test]
fn a_malformed_cache_url_is_refused_at_start() {
    for bad in ["127.0.0.1:50063", "not a url", ""] {
        let cfg = Config {
            cache_url: Some(bad.into()),
            ..Config::new("m.gguf")
        };
        let err = cfg.engine_config().unwrap_err().to_string();
        assert!(err.contains("--cache-url"), "{bad:?}: {err}");
    }
    let good = Config {
        cache_url: Some("http://127.0.0.1:50063".into()),
        ..Config::new("m.gguf")
    };
    assert!(good.engine_config().is_ok());
}

#[test]
fn no_host_tier_keeps_the_cache_service_for_hand_overs_only() {
    let cli = Cli::try_parse_from([
        "worker",
        "--role",
        "decode",
        "--cache-url",
        "http://127.0.0.1:50063",
        "--no-host-tier",
    ])
    .unwrap();
    assert!(cli.cfg.no_host_tier);
    assert!(cli.cfg.engine_config().is_ok());
    // Without a cache service there is no host tier to turn off.
    let err = Config {
        no_host_tier: true,
        ..Config::new("m.gguf")
    }
    .engine_config()
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("--no-host-tier") && err.contains("--cache-url"),
        "{err}"
    );
}

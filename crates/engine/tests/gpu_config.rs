//! Asking for the CUDA backend where it cannot run is a clear error at load, never a
//! silent fall-back to the CPU. These run in CI (no GPU there): in the default build, and
//! in a `cuda` build on a machine without the NVIDIA driver.

mod common;

use pdmesh_engine::{Engine, EngineConfig, EngineError, GpuConfig};

fn load(f: impl FnOnce(&mut EngineConfig)) -> EngineError {
    let mut cfg = EngineConfig::new(pdmesh_gguf::models::require_default_model());
    cfg.kv_pages = 64;
    cfg.gpu = Some(GpuConfig::default());
    f(&mut cfg);
    Engine::load(cfg).expect_err("no GPU engine can load here")
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_build_without_cuda_says_so() {
    let err = load(|_| {}).to_string();
    assert!(
        err.contains("no CUDA backend") && err.contains("--features cuda"),
        "{err}"
    );
}

/// Only meaningful where libcuda.so.1 is absent (CI): there the driver cannot be loaded,
/// and the error must say so instead of panicking.
#[cfg(feature = "cuda")]
#[test]
fn a_cuda_build_without_the_driver_says_so() {
    let err = load(|_| {}).to_string();
    assert!(err.contains("CUDA driver could not be used"), "{err}");
}

#[test]
fn gpus_and_tp_must_agree() {
    let err = load(|c| {
        c.tp = 2;
        c.gpu = Some(GpuConfig {
            devices: vec![0, 1, 2],
            ..GpuConfig::default()
        });
    });
    assert!(
        matches!(&err, EngineError::InvalidParam { field: "tp", msg } if msg.contains("tp 2 with 3 devices")),
        "{err}"
    );
    let err = load(|c| {
        c.gpu = Some(GpuConfig {
            devices: vec![],
            ..GpuConfig::default()
        })
    });
    assert!(err.to_string().contains("at least one GPU"), "{err}");
}

/// A DeepSeek checkpoint on one GPU is no longer refused by name: a build without CUDA
/// says it has no backend, a `cuda` build without the driver says the driver is missing.
#[test]
fn deepseek_checkpoints_on_one_gpu_need_only_the_cuda_backend() {
    let err = load(|c| c.model_path = common::tiny_dir().to_path_buf()).to_string();
    assert!(!err.contains("llama-family"), "{err}");
    if cfg!(feature = "cuda") {
        assert!(err.contains("CUDA driver could not be used"), "{err}");
    } else {
        assert!(
            err.contains("no CUDA backend") && err.contains("--features cuda"),
            "{err}"
        );
    }
}

/// Tensor parallelism stays llama-only, on GPUs as on the CPU.
#[test]
fn deepseek_checkpoints_are_not_split_across_gpus() {
    for (tp, devices) in [(1, vec![0, 1]), (2, vec![0, 1])] {
        let err = load(|c| {
            c.model_path = common::tiny_dir().to_path_buf();
            c.tp = tp;
            c.gpu = Some(GpuConfig {
                devices,
                ..GpuConfig::default()
            });
        })
        .to_string();
        assert!(
            err.contains("tensor parallelism supports llama-family models"),
            "{err}"
        );
    }
}

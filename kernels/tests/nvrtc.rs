//! The CUDA kernel sources compile through NVRTC to PTX for Hopper (sm_90) and Blackwell
//! (sm_120), with no GPU: libnvrtc only has to be loadable, e.g.
//! `LD_LIBRARY_PATH=$(scripts/ci/nvrtc-env) cargo nextest run --release -p pdmesh-kernels
//! --features nvrtc`.
#![cfg(feature = "nvrtc")]

use std::collections::BTreeSet;

use pdmesh_kernels::cuda_src::{COMMON_HEADER, sources};
use pdmesh_kernels::nvrtc::{
    NvrtcError, cache_key, compile_ptx, compile_ptx_cached, compile_source_ptx, nvrtc_version,
};

#[test]
fn every_source_compiles_for_sm_90_and_sm_120() {
    let (major, minor) = nvrtc_version().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("NVRTC {major}.{minor}");
    for arch in ["sm_90", "sm_120"] {
        let modules = compile_ptx(arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(modules.len(), sources().len());
        let mut all = BTreeSet::new();
        for m in &modules {
            assert!(!m.from_cache);
            assert!(
                m.ptx.contains(&format!(".target {arch}")),
                "{} for {arch}: {}",
                m.name,
                &m.ptx[..m.ptx.len().min(400)]
            );
            for k in m.kernels {
                assert!(
                    m.ptx.contains(&format!(".entry {k}(")),
                    "{arch}: {} has no entry {k}",
                    m.name
                );
                assert!(all.insert(*k), "{k} in two modules");
            }
        }
        // Every kernel the sources list (pinned to what the host code launches by
        // cuda_src's own test), each in one module.
        let listed: BTreeSet<&str> = sources()
            .iter()
            .flat_map(|s| s.kernels.iter().copied())
            .collect();
        assert_eq!(all, listed);
    }
}

#[test]
fn a_syntax_error_comes_back_with_the_compile_log() {
    let code = format!(
        "{COMMON_HEADER}\nextern \"C\" __global__ void broken(float* x) {{ x[0] = 1.0f }}\n"
    );
    let err = compile_source_ptx("broken", &code, "sm_90").unwrap_err();
    let NvrtcError::Compile { module, log, .. } = &err else {
        panic!("not a compile error: {err}");
    };
    assert_eq!(module, "broken");
    assert!(log.contains("broken.cu"), "{log}");
    assert!(log.contains("error") && log.contains("\";\""), "{log}");
    assert!(err.to_string().contains(log.as_str()));
    // An undefined name, too.
    let err = compile_source_ptx(
        "undefined",
        "extern \"C\" __global__ void f(float* x) { x[0] = no_such_function(1.0f); }",
        "sm_120",
    )
    .unwrap_err();
    assert!(err.to_string().contains("no_such_function"), "{err}");
}

#[test]
fn the_disk_cache_is_reused_and_a_damaged_file_is_compiled_again() {
    let dir = tempfile::tempdir().unwrap();
    let arch = "sm_90";
    let first = compile_ptx_cached(arch, Some(dir.path())).unwrap();
    assert!(first.iter().all(|m| !m.from_cache));
    let key = dir.path().join(cache_key(arch).unwrap());
    for m in &first {
        assert!(key.join(format!("{}.ptx", m.name)).is_file(), "{}", m.name);
    }
    // Nothing else in the folder: no temporary files left.
    assert_eq!(std::fs::read_dir(&key).unwrap().count(), first.len());

    let second = compile_ptx_cached(arch, Some(dir.path())).unwrap();
    for (a, b) in first.iter().zip(&second) {
        assert!(b.from_cache, "{} was compiled again", b.name);
        assert_eq!((a.name, &a.ptx, a.kernels), (b.name, &b.ptx, b.kernels));
    }

    // Truncate one file, empty another, flip a byte in a third: those three are compiled
    // again (and rewritten), the rest still come from the cache.
    let damaged = [first[0].name, first[1].name, first[2].name];
    let p = |n: &str| key.join(format!("{n}.ptx"));
    let text = std::fs::read(p(damaged[0])).unwrap();
    std::fs::write(p(damaged[0]), &text[..text.len() / 2]).unwrap();
    std::fs::write(p(damaged[1]), b"").unwrap();
    let mut text = std::fs::read(p(damaged[2])).unwrap();
    let mid = text.len() / 2;
    text[mid] ^= 0x01;
    std::fs::write(p(damaged[2]), &text).unwrap();
    let third = compile_ptx_cached(arch, Some(dir.path())).unwrap();
    for (a, c) in first.iter().zip(&third) {
        assert_eq!(c.from_cache, !damaged.contains(&c.name), "{}", c.name);
        assert_eq!(a.ptx, c.ptx, "{}", c.name);
    }
    let fourth = compile_ptx_cached(arch, Some(dir.path())).unwrap();
    assert!(fourth.iter().all(|m| m.from_cache));

    // Another architecture has its own key.
    assert_ne!(cache_key("sm_120").unwrap(), cache_key(arch).unwrap());
}

#[test]
fn a_bad_architecture_is_a_clear_error() {
    for bad in ["sm90", "compute_90", "sm_", "sm_9x", "", "90"] {
        let err = compile_ptx(bad).unwrap_err();
        assert!(matches!(err, NvrtcError::BadArch(_)), "{bad}: {err}");
        let msg = err.to_string();
        assert!(
            msg.contains("sm_90") && msg.contains(&format!("{bad:?}")),
            "{msg}"
        );
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            compile_ptx_cached(bad, Some(dir.path())),
            Err(NvrtcError::BadArch(_))
        ));
        assert!(matches!(
            compile_source_ptx("x", "", bad),
            Err(NvrtcError::BadArch(_))
        ));
    }
}

/// Without libnvrtc on the library path, compiling is an error that says which library and
/// what to set, not a panic. Runs itself in a child process whose LD_LIBRARY_PATH is empty.
#[test]
fn a_missing_library_is_an_error_not_a_panic() {
    if std::env::var_os("PDMESH_NVRTC_TEST_CHILD").is_some() {
        match compile_ptx("sm_90") {
            Err(NvrtcError::LibraryMissing(msg)) => {
                assert!(
                    msg.contains("libnvrtc") && msg.contains("LD_LIBRARY_PATH"),
                    "{msg}"
                );
                println!("child: missing library reported");
            }
            // A machine with libnvrtc on the default search path (a CUDA install).
            Ok(_) => println!("child: libnvrtc found without LD_LIBRARY_PATH"),
            Err(e) => panic!("unexpected error: {e}"),
        }
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_missing_library_is_an_error_not_a_panic",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("PDMESH_NVRTC_TEST_CHILD", "1")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("child: "),
        "the child did not run the check:\n{stdout}"
    );
}

#[test]
fn cubins_for_the_devices_own_architecture_are_elf_images() {
    let all =
        pdmesh_kernels::nvrtc::compile_cubins("sm_90").expect("every source builds as a CUBIN");
    assert_eq!(all.len(), sources().len());
    for (src, cubin) in &all {
        assert!(
            cubin.starts_with(b"\x7fELF"),
            "{}: not an ELF image",
            src.name
        );
        // Kernel names are unmangled symbols of the image.
        for k in src.kernels {
            assert!(
                cubin.windows(k.len()).any(|w| w == k.as_bytes()),
                "{}: kernel {k} missing from the CUBIN",
                src.name
            );
        }
    }
    let err = pdmesh_kernels::nvrtc::compile_source_cubin(
        "broken",
        "extern \"C\" __global__ void f() { nope; }",
        "sm_120",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("nope"), "the log names the error: {err}");
}

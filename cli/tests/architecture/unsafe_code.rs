//! Architecture Invariant: `unsafe` lives in few crates. Every crate of the workspace
//! whose sources hold no `unsafe` forbids it at its root (`#![forbid(unsafe_code)]`), so
//! none can start using it without that line going, in review.

use std::path::{Path, PathBuf};

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Whether a line of code (its comment removed) uses the keyword.
fn uses_unsafe(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or("");
    code.split(|c: char| !c.is_alphanumeric() && c != '_')
        .any(|w| w == "unsafe")
}

#[test]
fn every_crate_without_unsafe_code_forbids_it() {
    let root = super::root();
    let mut crates = Vec::new();
    for group in ["crates", "services"] {
        for entry in std::fs::read_dir(root.join(group)).unwrap() {
            crates.push(entry.unwrap().path());
        }
    }
    crates.extend([root.join("kernels"), root.join("proto"), root.join("cli")]);
    let mut missing = Vec::new();
    let mut checked = 0;
    for dir in crates {
        let src = dir.join("src");
        let Some(lib) = ["lib.rs", "main.rs"]
            .iter()
            .map(|f| src.join(f))
            .find(|p| p.exists())
        else {
            continue;
        };
        let mut files = Vec::new();
        sources(&src, &mut files);
        let unsafe_code = files
            .iter()
            .any(|f| std::fs::read_to_string(f).unwrap().lines().any(uses_unsafe));
        let forbids = std::fs::read_to_string(&lib)
            .unwrap()
            .contains("#![forbid(unsafe_code)]");
        checked += 1;
        if !unsafe_code && !forbids {
            missing.push(lib.display().to_string());
        }
    }
    assert!(checked >= 15, "only {checked} crates found");
    assert!(
        missing.is_empty(),
        "these crates hold no unsafe code but do not forbid it: {missing:?}"
    );
}

#[test]
fn the_scan_sees_the_keyword_only_in_code() {
    assert!(uses_unsafe("    unsafe { x.get_unchecked(0) }"));
    assert!(uses_unsafe("unsafe fn f() {}"));
    assert!(!uses_unsafe("// unsafe would be wrong here"));
    assert!(!uses_unsafe("let not_unsafe = 1;"));
}

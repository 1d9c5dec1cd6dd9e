//! Architecture Invariant: the crate graph is the layering ARCHITECTURE.md states, read
//! from `cargo metadata`. Libraries (`proto/`, `kernels/`, `crates/*`) depend on no
//! service; services (`services/*`) depend on no other service, not even for their tests;
//! only the binary (`cli/`) ties services together. The engine runs on no async runtime,
//! RPC stack or tokenizer, and the kernels read no file format.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Group {
    Library,
    Service,
    Binary,
}

/// One workspace package: its group and its dependencies with their kinds (`normal`,
/// `dev`, `build`).
struct Package {
    group: Group,
    deps: Vec<(String, String)>,
}

use super::root;

fn workspace() -> BTreeMap<String, Package> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let root = std::fs::canonicalize(root()).unwrap();
    let mut packages = BTreeMap::new();
    for p in meta["packages"].as_array().unwrap() {
        let manifest = Path::new(p["manifest_path"].as_str().unwrap());
        let dir = manifest.parent().unwrap().strip_prefix(&root).unwrap();
        let group = if dir.starts_with("services") {
            Group::Service
        } else if dir.starts_with("cli") {
            Group::Binary
        } else {
            Group::Library
        };
        let deps = p["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                let kind = d["kind"].as_str().unwrap_or("normal").to_owned();
                (d["name"].as_str().unwrap().to_owned(), kind)
            })
            .collect();
        packages.insert(
            p["name"].as_str().unwrap().to_owned(),
            Package { group, deps },
        );
    }
    packages
}

/// Every edge from a package of group `from` to one of group `to`, as `a -> b (kind)`.
fn edges(ws: &BTreeMap<String, Package>, from: Group, to: Group) -> Vec<String> {
    let mut out = Vec::new();
    for (name, p) in ws.iter().filter(|(_, p)| p.group == from) {
        for (dep, kind) in &p.deps {
            if ws.get(dep).is_some_and(|d| d.group == to) && dep != name {
                out.push(format!("{name} -> {dep} ({kind})"));
            }
        }
    }
    out
}

#[test]
fn the_workspace_is_read_whole() {
    let ws = workspace();
    let count = |g| ws.values().filter(|p| p.group == g).count();
    assert!(
        count(Group::Library) >= 12,
        "libraries: {}",
        count(Group::Library)
    );
    assert_eq!(count(Group::Service), 4);
    assert_eq!(count(Group::Binary), 1);
    // The binary is where the services meet: it depends on every one.
    let bin = ws.values().find(|p| p.group == Group::Binary).unwrap();
    for (name, _) in ws.iter().filter(|(_, p)| p.group == Group::Service) {
        assert!(
            bin.deps.iter().any(|(d, k)| d == name && k == "normal"),
            "the binary does not depend on {name}"
        );
    }
}

#[test]
fn no_library_depends_on_a_service_or_the_binary() {
    let ws = workspace();
    let mut bad = edges(&ws, Group::Library, Group::Service);
    bad.extend(edges(&ws, Group::Library, Group::Binary));
    assert!(bad.is_empty(), "libraries reaching up: {bad:?}");
}

#[test]
fn no_service_depends_on_another_service_or_the_binary() {
    let ws = workspace();
    let mut bad = edges(&ws, Group::Service, Group::Service);
    bad.extend(edges(&ws, Group::Service, Group::Binary));
    assert!(bad.is_empty(), "services depending on each other: {bad:?}");
}

/// The engine is computation over pages: the worker gives it work and reads its events.
#[test]
fn the_engine_uses_no_runtime_rpc_or_tokenizer() {
    let ws = workspace();
    let forbidden = [
        "tokio",
        "tonic",
        "prost",
        "pdmesh-proto",
        "pdmesh-cache-client",
        "tokenizers",
        "minijinja",
        "pdmesh-tokenize",
        "pdmesh-chat",
    ];
    let bad: Vec<&String> = ws["pdmesh-engine"]
        .deps
        .iter()
        .filter(|(d, k)| k != "dev" && forbidden.contains(&d.as_str()))
        .map(|(d, _)| d)
        .collect();
    assert!(bad.is_empty(), "the engine depends on {bad:?}");
}

/// Kernels compute on blocks: they know GGML's block formats, not the files they come in.
#[test]
fn the_kernels_read_no_file_format() {
    let ws = workspace();
    let bad: Vec<&String> = ws["pdmesh-kernels"]
        .deps
        .iter()
        .filter(|(d, k)| k != "dev" && d.starts_with("pdmesh-") && d != "pdmesh-ggml")
        .map(|(d, _)| d)
        .collect();
    assert!(bad.is_empty(), "the kernels depend on {bad:?}");
}

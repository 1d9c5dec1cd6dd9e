//! Architecture Invariant: a tool-call format's markup is spelled only in its own module
//! (`crates/chat/src/formats/<name>.rs`); all other code asks the format
//! ([`pdmesh_chat::ToolSyntax`]). This scans every Rust source of the workspace for every
//! marker the formats declare.
//!
//! Tests and their data may hold model-shaped output, so `tests/` folders, files named
//! `tests.rs` and the `#[cfg(test)]` module that ends a file are not scanned; nor are
//! comments, where prose may name a tag, nor the fuzz targets (a workspace of their own).

use std::path::{Path, PathBuf};

use pdmesh_chat::ToolFormat;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Rust sources under `dir` that are not tests.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(name.as_str(), "tests" | "target" | "fuzz") && !name.starts_with('.') {
                sources(&path, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            out.push(path);
        }
    }
}

/// The code of a source file: each line without its comment, up to the `#[cfg(test)]`
/// module that ends the file, with line numbers from 1.
fn code(text: &str) -> Vec<(usize, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let next = lines[i + 1..].iter().find(|l| !l.trim().is_empty());
        if line.trim() == "#[cfg(test)]" && next.is_some_and(|n| is_inline_module(n)) {
            break;
        }
        out.push((i + 1, without_comment(line).to_owned()));
    }
    out
}

/// `mod name {`, `pub(crate) mod name {`: a module whose body follows.
fn is_inline_module(line: &str) -> bool {
    let t = line.trim();
    t.ends_with('{') && t.split_whitespace().any(|w| w == "mod")
}

/// `line` up to a `//` that is not inside a string literal.
fn without_comment(line: &str) -> &str {
    let mut in_string = false;
    let mut escaped = false;
    let bytes = line.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if in_string => escaped = true,
            b'"' => in_string = !in_string,
            b'/' if !in_string && bytes.get(i + 1) == Some(&b'/') => return &line[..i],
            _ => {}
        }
    }
    line
}

/// The module of the format named `name`.
fn module_of(name: &str) -> PathBuf {
    root().join(format!("crates/chat/src/formats/{name}.rs"))
}

#[test]
fn no_code_outside_a_formats_module_spells_its_markup() {
    let mut files = Vec::new();
    for dir in ["crates", "services", "proto", "kernels"] {
        sources(&root().join(dir), &mut files);
    }
    assert!(files.len() > 100, "only {} sources found", files.len());
    let markers: Vec<(&str, Vec<PathBuf>)> = ToolFormat::ALL
        .into_iter()
        .flat_map(|f| f.syntax().markers().iter().copied())
        .map(|m| {
            // The modules of every format that declares the marker may spell it.
            let owners = ToolFormat::ALL
                .into_iter()
                .filter(|f| f.syntax().markers().contains(&m))
                .map(|f| module_of(f.name()).canonicalize().unwrap())
                .collect();
            (m, owners)
        })
        .collect();
    let mut found = Vec::new();
    let mut spelled_by_owner = vec![false; markers.len()];
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let canonical = file.canonicalize().unwrap();
        for (n, line) in code(&text) {
            for (k, (m, owners)) in markers.iter().enumerate() {
                if !line.contains(m) {
                    continue;
                }
                if owners.contains(&canonical) {
                    spelled_by_owner[k] = true;
                } else {
                    let shown = file.strip_prefix(root()).unwrap_or(file).display();
                    found.push(format!("{shown}:{n}: {m:?}"));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "tool-call markup outside its format's module (ask the format instead):\n{}",
        found.join("\n")
    );
    // The scan reads the code that matters: each marker is spelled in its own module.
    for ((m, _), seen) in markers.iter().zip(spelled_by_owner) {
        assert!(
            seen,
            "{m:?} appears in no module of a format that declares it"
        );
    }
}

#[test]
fn the_scan_sees_code_not_comments_or_trailing_tests() {
    let text = "let a = \"<x>\"; // \"<y>\"\n\
                /// <z>\n\
                let url = \"http://h\"; let b = \"<w>\";\n\
                #[cfg(test)]\n\
                mod tests {\n\
                let c = \"<v>\";\n\
                }\n";
    let kept: Vec<String> = code(text).into_iter().map(|(_, l)| l).collect();
    assert_eq!(
        kept,
        [
            "let a = \"<x>\"; ",
            "",
            "let url = \"http://h\"; let b = \"<w>\";"
        ]
    );
    // An out-of-line test module is a line like any other; its file is skipped by name.
    assert_eq!(code("#[cfg(test)]\nmod tests;\nlet d = 1;\n").len(), 3);
}

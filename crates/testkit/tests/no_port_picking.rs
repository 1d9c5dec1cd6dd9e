//! No test, script or service picks a port by binding it and letting it go: between the
//! release and the use, anything running beside it can take the port (a test suite on
//! two cores runs many at once). This scans the repository's Rust, Python and shell
//! sources for the pattern in the shapes it has had here, and fails naming each place.

use std::path::{Path, PathBuf};

use regex::Regex;

/// The shapes of bind-then-release, each with what to do instead.
fn rules() -> Vec<(Regex, &'static str)> {
    let r = |s: &str| Regex::new(s).unwrap();
    vec![
        (
            // A listener bound only to read its address, dropped at the end of the chain.
            r(r"TcpListener::bind\([^;]*?\)\s*(\.await)?\s*\.unwrap\(\)\s*\.local_addr\(\)"),
            "keep the listener and hand it over, or use pdmesh_testkit::Refusing",
        ),
        (
            r(
                r"with socket\.socket\([^)]*\) as (\w+):\s*\n\s*\w+\.bind\(\([^)]*,\s*0\)\)\s*\n\s*return",
            ),
            "start the program on port 0 and read its ports file (or tests/e2e/ports.py)",
        ),
        (
            r(
                r"\b(?:def|fn) (?:free_port|free_addr|dead_addr|pick_port|unused_port|get_free_port)\b",
            ),
            "no helper hands out \"free\" ports",
        ),
    ]
}

/// Every place in `text` that breaks a rule: (line, what to do instead).
fn offences(text: &str) -> Vec<(usize, &'static str)> {
    let line = |at: usize| text[..at].matches('\n').count() + 1;
    let mut out = Vec::new();
    for (re, fix) in rules() {
        for m in re.find_iter(text) {
            out.push((line(m.start()), fix));
        }
    }
    // A listener bound into a name that is dropped soon after.
    let bound = Regex::new(r"let (\w+) = (?:std::net::|tokio::net::)?TcpListener::bind\(").unwrap();
    for c in bound.captures_iter(text) {
        let (all, name) = (c.get(0).unwrap(), &c[1]);
        let after = &text[all.end()..];
        let near = &after[..after.floor_char_boundary(400)];
        if near.contains(&format!("drop({name})")) {
            out.push((line(all.start()), "keep the listener and hand it over"));
        }
    }
    out.sort();
    out
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if !matches!(
                name.as_ref(),
                "target" | ".git" | "__pycache__" | "node_modules"
            ) {
                sources(&path, out);
            }
        } else if name.ends_with(".rs")
            || name.ends_with(".py")
            || name.ends_with(".sh")
            || std::fs::read(&path).is_ok_and(|b| b.starts_with(b"#!"))
        {
            out.push(path);
        }
    }
}

#[test]
fn no_source_picks_a_port_by_binding_and_releasing_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let this = Path::new(file!()).file_name().unwrap();
    let mut files = Vec::new();
    for top in [
        "crates", "services", "kernels", "proto", "tests", "scripts", "deploy", ".ci",
    ] {
        sources(&root.join(top), &mut files);
    }
    assert!(files.len() > 100, "found only {} sources", files.len());
    let mut found = Vec::new();
    for f in files.iter().filter(|f| f.file_name() != Some(this)) {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        for (line, fix) in offences(&text) {
            let shown = f.strip_prefix(&root).unwrap_or(f).display();
            found.push(format!("{shown}:{line}: {fix}"));
        }
    }
    assert!(
        found.is_empty(),
        "ports picked by binding and releasing them:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_check_knows_each_shape_it_has_had_here() {
    let caught = [
        "let a = std::net::TcpListener::bind(\"127.0.0.1:0\")\n    .unwrap()\n    .local_addr()\n    .unwrap();",
        "let l = tokio::net::TcpListener::bind(\"127.0.0.1:0\").await.unwrap().local_addr();",
        "let free = std::net::TcpListener::bind(\"127.0.0.1:0\").unwrap();\nlet addr = free.local_addr().unwrap();\ndrop(free);",
        "def free_port() -> int:\n    with socket.socket() as s:\n        s.bind((\"127.0.0.1\", 0))\n        return s.getsockname()[1]\n",
        "    with socket.socket() as s:\n        s.bind((\"\", 0))\n        return s.getsockname()[1]\n",
        "fn free_addr() -> SocketAddr {",
    ];
    for text in caught {
        assert!(!offences(text).is_empty(), "not caught:\n{text}");
    }
    let fine = [
        // Bound, and the listener handed to the service.
        "let listener = TcpListener::bind(\"127.0.0.1:0\").await.unwrap();\nlet addr = listener.local_addr().unwrap();\ntokio::spawn(run(cfg, listener, token));",
        "let refusing = pdmesh_testkit::Refusing::new();",
        "port = server.add_insecure_port(\"127.0.0.1:0\")",
    ];
    for text in fine {
        assert_eq!(offences(text), vec![], "flagged:\n{text}");
    }
    // Lines are counted from 1.
    assert_eq!(offences("\n\nfn free_addr() {}")[0].0, 3);
}

//! Architecture Invariant: errors are typed at every internal boundary. Outside tests no
//! function returns `Result<_, String>` and no caller classifies a status by the words of
//! its message (`.message().contains(`): a failure's kind is a type or an
//! `error_kind` label, decided once near its cause.

use std::path::{Path, PathBuf};

use super::root;

/// The Rust sources the services and libraries run, without their tests: `tests/`
/// folders, `tests.rs` files and everything from a file's `#[cfg(test)]` on.
fn non_test_sources() -> Vec<(PathBuf, String)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                if name != "tests" && name != "target" {
                    walk(&path, out);
                }
            } else if name.ends_with(".rs") && name != "tests.rs" {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    for top in ["proto", "kernels", "crates", "services", "cli"] {
        walk(&root().join(top), &mut files);
    }
    files
        .into_iter()
        .map(|f| {
            let text = std::fs::read_to_string(&f).unwrap();
            let code = match text.find("#[cfg(test)]\nmod tests") {
                Some(i) => text[..i].to_owned(),
                None => text,
            };
            (f, code)
        })
        .collect()
}

/// Every `Result<…>` in `code` whose error type is `String`, as written.
fn string_results(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (start, _) in code.match_indices("Result<") {
        let body = &code[start + "Result<".len()..];
        let (mut depth, mut last_comma, mut end) = (0usize, None, None);
        for (i, c) in body.char_indices() {
            match c {
                '<' | '(' | '[' => depth += 1,
                '>' | ')' | ']' if depth == 0 => {
                    end = Some(i);
                    break;
                }
                '>' | ')' | ']' => depth -= 1,
                ',' if depth == 0 => last_comma = Some(i),
                _ => {}
            }
        }
        if let (Some(comma), Some(end)) = (last_comma, end)
            && body[comma + 1..end].trim() == "String"
        {
            found.push(format!("Result<{}>", &body[..end]));
        }
    }
    found
}

#[test]
fn no_result_carries_a_string_error() {
    let mut bad = Vec::new();
    for (file, code) in non_test_sources() {
        for r in string_results(&code) {
            bad.push(format!("{}: {r}", file.display()));
        }
    }
    assert!(bad.is_empty(), "string errors: {bad:#?}");
}

#[test]
fn no_status_is_classified_by_its_words() {
    let bad: Vec<String> = non_test_sources()
        .into_iter()
        .filter(|(_, code)| code.contains(".message().contains("))
        .map(|(f, _)| f.display().to_string())
        .collect();
    assert!(bad.is_empty(), "matching on message text: {bad:?}");
}

#[test]
fn the_scan_finds_string_errors_however_nested() {
    assert_eq!(
        string_results("fn f() -> Result<(Vec<u8>, Vec<u64>), String> {"),
        ["Result<(Vec<u8>, Vec<u64>), String>"]
    );
    assert_eq!(
        string_results("x: OnceLock<Result<Arc<F>, String>>,"),
        ["Result<Arc<F>, String>"]
    );
    assert!(string_results("fn f() -> Result<String, Error> {").is_empty());
    assert!(string_results("fn f() -> io::Result<String> {").is_empty());
}

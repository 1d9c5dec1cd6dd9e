//! Architecture Invariant: no import circles between a crate's modules. Where module `a`
//! names something of its sibling `b` (under the same parent) and `b`, however
//! indirectly, names something of `a`, neither can be read or moved alone. A module may
//! use its parent's and its children's items (a parent declares its children); the rule
//! is about siblings, at every level of the tree.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::root;

/// A module's path inside its crate (`["engine", "sched", "apply"]`).
type ModPath = Vec<String>;

/// One crate's source tree: each non-test module file and its code without tests.
struct Crate {
    name: String,
    modules: BTreeMap<ModPath, String>,
}

/// Every crate's `src` folder in the workspace.
fn crates() -> Vec<Crate> {
    let mut srcs = Vec::new();
    for top in ["proto", "kernels", "cli"] {
        srcs.push(root().join(top).join("src"));
    }
    for group in ["crates", "services"] {
        for entry in std::fs::read_dir(root().join(group)).unwrap() {
            srcs.push(entry.unwrap().path().join("src"));
        }
    }
    srcs.into_iter()
        .filter(|s| s.is_dir())
        .map(|src| {
            let name = src.parent().unwrap().strip_prefix(root()).unwrap();
            let mut modules = BTreeMap::new();
            read_tree(&src, &src, &mut modules);
            Crate {
                name: name.to_string_lossy().into_owned(),
                modules,
            }
        })
        .collect()
}

fn read_tree(src: &Path, dir: &Path, out: &mut BTreeMap<ModPath, String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "tests" && name != "bin" {
                read_tree(src, &path, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            out.insert(module_of(src, &path), without_tests(&path));
        }
    }
}

/// `src/a/b.rs` and `src/a/b/mod.rs` are `a::b`; `lib.rs` and `main.rs` the root.
fn module_of(src: &Path, file: &Path) -> ModPath {
    let rel: PathBuf = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: ModPath = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The file's code up to its test module.
fn without_tests(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => text[..i].to_owned(),
        None => text,
    }
}

/// `code` without its line comments (doc links name modules without using them).
fn without_comments(code: &str) -> String {
    code.lines()
        .map(|l| l.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module paths `code` (of module `at`) names with `crate::`, `super::` or `self::`,
/// brace groups included (`use super::{a::X, b}` names `a` and `b`).
fn references(at: &ModPath, code: &str) -> Vec<ModPath> {
    let code = &without_comments(code);
    let mut out = Vec::new();
    for (i, _) in code.match_indices("::") {
        let before = &code[..i];
        let word_start = before
            .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
            .map_or(0, |j| j + 1);
        let base = match &before[word_start..] {
            "crate" => ModPath::new(),
            "self" => at.clone(),
            "super" => {
                // Only the first `super` of a chain starts a path here.
                if before[..word_start].ends_with("::") {
                    continue;
                }
                at[..at.len().saturating_sub(1)].to_vec()
            }
            _ => continue,
        };
        if before[..word_start].ends_with("::") {
            continue; // a `crate`/`self` in the middle of another path
        }
        let mut rest = &code[i + 2..];
        let mut base = base;
        while let Some(r) = rest.strip_prefix("super::") {
            base.pop();
            rest = r;
        }
        for path in paths(rest) {
            let mut full = base.clone();
            full.extend(path);
            out.push(full);
        }
    }
    out
}

/// The leading identifiers of the path (or brace group of paths) at the start of `s`.
fn paths(s: &str) -> Vec<Vec<String>> {
    if let Some(group) = s.strip_prefix('{') {
        let mut depth = 0;
        let mut end = group.len();
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    end = i;
                    break;
                }
                '}' => depth -= 1,
                _ => {}
            }
        }
        let inner = &group[..end];
        let mut items = Vec::new();
        let (mut depth, mut start) = (0, 0);
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(&inner[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        items.push(&inner[start..]);
        return items
            .into_iter()
            .flat_map(|item| paths(item.trim_start()))
            .collect();
    }
    let mut path = Vec::new();
    let mut rest = s;
    loop {
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if end == 0 {
            break;
        }
        path.push(rest[..end].to_owned());
        match rest[end..].strip_prefix("::") {
            Some(r) if r.starts_with('{') => {
                return paths(r)
                    .into_iter()
                    .map(|p| path.iter().cloned().chain(p).collect())
                    .collect();
            }
            Some(r) => rest = r,
            None => break,
        }
    }
    vec![path]
}

/// The edges between siblings: (their parent, from, to).
fn sibling_edges(c: &Crate) -> BTreeSet<(ModPath, String, String)> {
    let mut edges = BTreeSet::new();
    for (at, code) in &c.modules {
        for named in references(at, code) {
            // The module it names: the longest prefix that is a module of this crate.
            let Some(target) = (0..=named.len())
                .rev()
                .map(|n| named[..n].to_vec())
                .find(|p| c.modules.contains_key(p))
            else {
                continue;
            };
            let common = at.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common == at.len() || common == target.len() {
                continue; // itself, an ancestor or a descendant
            }
            edges.insert((
                at[..common].to_vec(),
                at[common].clone(),
                target[common].clone(),
            ));
        }
    }
    edges
}

/// The circles among siblings: each as the sorted set of its members, under its parent.
fn circles(edges: &BTreeSet<(ModPath, String, String)>) -> Vec<String> {
    let mut by_parent: BTreeMap<&ModPath, BTreeMap<&str, BTreeSet<&str>>> = BTreeMap::new();
    for (parent, from, to) in edges {
        by_parent
            .entry(parent)
            .or_default()
            .entry(from)
            .or_default()
            .insert(to);
    }
    let mut found = BTreeSet::new();
    for (parent, graph) in &by_parent {
        let reach = |from: &str| {
            let mut seen = BTreeSet::new();
            let mut todo = vec![from];
            while let Some(m) = todo.pop() {
                for &n in graph.get(m).into_iter().flatten() {
                    if seen.insert(n) {
                        todo.push(n);
                    }
                }
            }
            seen
        };
        for &m in graph.keys() {
            let from_m = reach(m);
            if from_m.contains(m) {
                let members: BTreeSet<&str> = from_m
                    .iter()
                    .copied()
                    .filter(|&n| reach(n).contains(m))
                    .collect();
                let members: Vec<&str> = members.into_iter().collect();
                found.insert(format!("{}::{{{}}}", parent.join("::"), members.join(", ")));
            }
        }
    }
    found.into_iter().collect()
}

#[test]
fn no_crate_has_an_import_circle_between_sibling_modules() {
    let mut all = Vec::new();
    let crates = crates();
    assert!(crates.len() > 10, "the workspace's crates were found");
    for c in &crates {
        for circle in circles(&sibling_edges(c)) {
            all.push(format!("{}: {circle}", c.name));
        }
    }
    assert!(all.is_empty(), "import circles:\n{}", all.join("\n"));
}

#[test]
fn the_scan_sees_circles_through_groups_and_super_chains() {
    let code = |s: &str| s.to_owned();
    let c = Crate {
        name: "x".into(),
        modules: BTreeMap::from([
            (vec![], code("mod a; mod b; mod c;")),
            (vec!["a".into()], code("use super::{b::{f, g}, c};")),
            (vec!["b".into()], code("fn h() { crate::c::k() }")),
            (
                vec!["c".into()],
                code("use crate::a::Thing; // crate::b::not_code"),
            ),
            (
                vec!["a".into(), "inner".into()],
                code("use super::super::b::f; use super::Parent;"),
            ),
        ]),
    };
    let edges = sibling_edges(&c);
    let names: Vec<(String, String)> = edges
        .iter()
        .map(|(_, from, to)| (from.clone(), to.clone()))
        .collect();
    let pair = |a: &str, b: &str| (a.to_owned(), b.to_owned());
    assert_eq!(
        names,
        [
            pair("a", "b"),
            pair("a", "c"),
            pair("b", "c"),
            pair("c", "a")
        ]
    );
    assert_eq!(circles(&edges), ["::{a, b, c}"]);
    // Without the edge back from c there is no circle.
    let mut c = c;
    c.modules.insert(vec!["c".into()], code("fn k() {}"));
    assert!(circles(&sibling_edges(&c)).is_empty());
}

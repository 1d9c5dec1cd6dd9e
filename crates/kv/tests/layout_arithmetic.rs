//! The Architecture Invariant "no code outside pdmesh-kv computes a page size, a token
//! stride or a scale offset", checked over the sources: every `.rs` file of the workspace
//! outside `crates/kv` is scanned (comments and string literals aside) for the byte
//! arithmetic that belongs to `KvLayout`: products with a page or token size, the offset of
//! slot 1 or of the next layer (a stride derived from two offsets), a slot times a stride,
//! an element size times a head dimension, the offset within a page taken by hand.
//!
//! Code that truly cannot ask its layout says why, on the line or in the comment lines
//! right above it: `// layout-arithmetic: <the reason>`.

use std::path::{Path, PathBuf};

use regex::Regex;

/// The allow marker; a reason must follow it.
const ALLOW: &str = "layout-arithmetic:";

/// A whole page's size, asked of the layout: multiplied by a page or slot index it places
/// a page, which is `KvLayout::page_offset`'s (by a count of pages, it is a count of bytes).
const PAGE_BYTES: &str = r"(?:bytes_per_page|bpp\w*|page_bytes)";

/// Sizes and strides within a page, which only `KvLayout` combines.
const TOKEN_SIZE: &str = r"(?:layer_bytes_per_page|component_bytes_per_page|bytes_per_token|bytes_per_token_per_layer|value_bytes_per_token|scale_bytes_per_token|token_stride|scale_stride|slot_bytes|token_bytes|slot_stride)";

/// What names a page or a slot of a pool: `page`, `p`, `slot`, `x.slot`, `page_of(tk)`,
/// `pages[i]`.
const INDEX: &str = r"(?:\b(?:page|page_id|pid|p|pg|slot|sl)\b|\.slot\b|\bpage_of\([^()]*\)|\])";

/// A method-call or field path ending in a name (`pool.layout().bytes_per_page()`,
/// `DType::F16.size_bytes()`).
const PATH: &str = r"(?:[\w:]+(?:\([^()]*\))?\.)*";

/// A page size expression: `layout.page_size()`, `ps`, `psz`, `page_size`.
const PAGE_SIZE: &str = r"(?:ps|psz|page_size|(?:\w+(?:\(\))?\.)*page_size\(\))";

struct Rule {
    name: &'static str,
    re: Regex,
}

fn rules() -> Vec<Rule> {
    let r = |name, pat: String| Rule {
        name,
        re: Regex::new(&pat).expect("rule pattern"),
    };
    vec![
        // `page * bpp`, `page_of(tk) as usize * bpp`, `slot as usize * layout.bytes_per_page()`.
        r(
            "page placed by hand",
            format!(
                r"{INDEX}(?:\s+as\s+\w+)?\)?\s*\*\s*\(?\s*{PATH}{PAGE_BYTES}\b|\b{PAGE_BYTES}\b(?:\([^()]*\))?(?:\s+as\s+\w+)?\s*\*\s*\(?\s*(?:page|page_id|pid|p|pg|slot|sl)\b"
            ),
        ),
        // `n * layout.bytes_per_token()`, `slot * slot_bytes`, `token_stride(0) * s`.
        r(
            "product with a token or layer size",
            format!(
                r"[\w)\]]\s*\*\s*\(?\s*{PATH}{TOKEN_SIZE}\b|\b{TOKEN_SIZE}\b(?:\([^()]*\))?(?:\s+as\s+\w+)?\s*\*\s*[\w(]"
            ),
        ),
        // `value_offset(l, c, 1)`, `scale_offset(l, c, slot + 1)`, `region_offset(layer + 1, 0)`:
        // the offset of the next slot or layer, to subtract another from.
        r(
            "stride from two offsets",
            r"\b(?:value|scale)_offset\([^(),]*,[^(),]*,\s*(?:1|\w+\s*\+\s*1)\s*\)|\b(?:value|scale|region)_offset\(\s*\w+\s*\+\s*1\s*,"
                .into(),
        ),
        // `slot * stride`, `sl * row_elems`, `(pos % ps) * row_stride`.
        r(
            "slot times a stride",
            format!(
                r"\b(?:slot|sl)\b(?:\s+as\s+\w+)?\s*\*|[\w)\]]\s*\*\s*\(?\s*(?:slot|sl)\b(?:[^(\w]|$)|%\s*{PAGE_SIZE}\s*\)?(?:\s+as\s+\w+)?\s*\*\s*{PATH}\w*(?:stride|bytes)\b"
            ),
        ),
        // `hd * 2`, `kvd * 2`, `n * size_of::<f16>()`, `dtype.size_bytes() * n`.
        r(
            "element size by hand",
            format!(
                r"\b(?:hd|head_dim|kvd|kv_dim|kv_row\w*|\w*_elems)\s*\*\s*[24]\b|size_of::<(?:half::)?(?:f16|bf16|u16|f32)>\(\)\s*\*|\*\s*(?:std::mem::)?size_of::<(?:half::)?(?:f16|bf16|u16|f32)>|\.size_bytes\(\)\s*\*|\*\s*{PATH}size_bytes\(\)"
            ),
        ),
        // `at % bpp`, `off / page_bytes`: which page, and where in it, by hand.
        r(
            "page and offset by hand",
            format!(r"%\s*{PATH}{PAGE_BYTES}\b|\b(?:at|off\w*)\)?\s*/\s*{PATH}{PAGE_BYTES}\b"),
        ),
    ]
}

/// Blanks every unary `*` (a dereference or a raw pointer type) so that the rules only
/// see multiplications: a `*` is binary after an operand (a name, a number, `)` or `]`)
/// that is not a keyword.
fn drop_unary_stars(code: &str) -> String {
    const KEYWORDS: [&str; 10] = [
        "match", "return", "in", "if", "while", "let", "else", "break", "mut", "as",
    ];
    let b: Vec<char> = code.chars().collect();
    let mut out: Vec<char> = b.clone();
    for i in 0..b.len() {
        if b[i] != '*' {
            continue;
        }
        let mut j = i;
        while j > 0 && b[j - 1].is_whitespace() {
            j -= 1;
        }
        let binary = j > 0 && {
            let prev = b[j - 1];
            if prev == ')' || prev == ']' {
                true
            } else if prev.is_alphanumeric() || prev == '_' {
                let mut k = j;
                while k > 0 && (b[k - 1].is_alphanumeric() || b[k - 1] == '_') {
                    k -= 1;
                }
                let word: String = b[k..j].iter().collect();
                !KEYWORDS.contains(&word.as_str())
            } else {
                false
            }
        };
        if !binary {
            out[i] = ' ';
        }
    }
    out.into_iter().collect()
}

/// `src` with every comment and string or char literal blanked (newlines kept), and per
/// line the text of its comments.
fn split_code(src: &str) -> (String, Vec<String>) {
    let b: Vec<char> = src.chars().collect();
    let mut code = String::with_capacity(src.len());
    let mut comments = vec![String::new()];
    let mut i = 0;
    let put = |code: &mut String, comments: &mut Vec<String>, c: char| {
        code.push(if c == '\n' { '\n' } else { ' ' });
        if c == '\n' {
            comments.push(String::new());
        }
    };
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                comments.last_mut().unwrap().push(b[i]);
                code.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    code.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    code.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] != '\n' {
                        comments.last_mut().unwrap().push(b[i]);
                    }
                    put(&mut code, &mut comments, b[i]);
                    i += 1;
                }
            }
        } else if c == '"' || (c == 'r' && matches!(next, Some('"' | '#')) && is_raw(&b, i)) {
            // Plain or raw string: blank it to its end.
            let hashes = if c == 'r' {
                let h = b[i + 1..].iter().take_while(|&&x| x == '#').count();
                code.push_str(&" ".repeat(1 + h));
                i += 1 + h;
                Some(h)
            } else {
                None
            };
            code.push(' ');
            i += 1; // the opening quote
            while i < b.len() {
                let ch = b[i];
                if hashes.is_none() && ch == '\\' {
                    put(&mut code, &mut comments, ch);
                    if let Some(&e) = b.get(i + 1) {
                        put(&mut code, &mut comments, e);
                    }
                    i += 2;
                    continue;
                }
                if ch == '"' {
                    let h = hashes.unwrap_or(0);
                    if b[i + 1..].iter().take(h).filter(|&&x| x == '#').count() == h {
                        code.push_str(&" ".repeat(1 + h));
                        i += 1 + h;
                        break;
                    }
                }
                put(&mut code, &mut comments, ch);
                i += 1;
            }
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}'), or a lifetime / label (kept).
            let end = if next == Some('\\') {
                b[i + 2..]
                    .iter()
                    .position(|&x| x == '\'')
                    .map(|p| i + 2 + p)
            } else if b.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(e) => {
                    code.push_str(&" ".repeat(e + 1 - i));
                    i = e + 1;
                }
                None => {
                    code.push(c);
                    i += 1;
                }
            }
        } else {
            code.push(c);
            if c == '\n' {
                comments.push(String::new());
            }
            i += 1;
        }
    }
    (code, comments)
}

/// Whether the `r` at `i` starts a raw string (not the end of an identifier like `for`).
fn is_raw(b: &[char], i: usize) -> bool {
    let prev_ident = i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_');
    let h = b[i + 1..].iter().take_while(|&&x| x == '#').count();
    !prev_ident && b.get(i + 1 + h) == Some(&'"')
}

/// Whether `comment` carries the allow marker with a reason.
fn allows(comment: &str) -> bool {
    comment
        .split_once(ALLOW)
        .is_some_and(|(_, why)| why.trim().len() >= 10)
}

/// Every `(line, rule, code)` of `src` that computes layout bytes by hand and is not
/// allowed by a marker on the line or in the comment lines just above it.
fn offences(src: &str) -> Vec<(usize, &'static str, String)> {
    let (code, comments) = split_code(src);
    let code = drop_unary_stars(&code);
    let rules = rules();
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let Some(rule) = rules.iter().find(|r| r.re.is_match(line)) else {
            continue;
        };
        // The comment lines right above (no code, no blank line between).
        let above = (0..n)
            .rev()
            .take_while(|&p| lines[p].trim().is_empty() && !comments[p].trim().is_empty());
        if allows(&comments[n]) || above.into_iter().any(|p| allows(&comments[p])) {
            continue;
        }
        out.push((
            n + 1,
            rule.name,
            src.lines().nth(n).unwrap_or("").trim().to_owned(),
        ));
    }
    out
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file under `dir` but build output, hidden folders and pdmesh-kv itself.
fn sources(dir: &Path, kv: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() {
            let skip = name.starts_with('.') || name == "target" || name == "node_modules";
            if !skip && p.canonicalize().ok().as_deref() != Some(kv) {
                sources(&p, kv, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_code_outside_pdmesh_kv_computes_layout_bytes() {
    let root = workspace_root().canonicalize().expect("workspace root");
    let kv = Path::new(env!("CARGO_MANIFEST_DIR"))
        .canonicalize()
        .expect("crate dir");
    let mut files = Vec::new();
    sources(&root, &kv, &mut files);
    // The scan must see the backends it guards, and nothing of pdmesh-kv.
    for must in [
        "crates/engine/src/cuda/mod.rs",
        "crates/engine/src/model.rs",
    ] {
        assert!(files.contains(&root.join(must)), "{must} is not scanned");
    }
    assert!(!files.iter().any(|f| f.starts_with(&kv)));
    let mut found = Vec::new();
    for f in &files {
        let src = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        for (line, rule, text) in offences(&src) {
            let rel = f.strip_prefix(&root).unwrap_or(f).display();
            found.push(format!("{rel}:{line}: {rule}: {text}"));
        }
    }
    assert!(
        found.is_empty(),
        "layout arithmetic outside pdmesh-kv (ask KvLayout, or say why not with \
         `// {ALLOW} <reason>`):\n{}",
        found.join("\n")
    );
}

/// The code this check was written against: the CUDA backend's token stride from two
/// offsets, its `page·bpp + slot·stride`, its `hd·2` column bytes, and the rest of what
/// the backends and tests once computed by hand.
#[test]
fn the_old_offenders_are_caught() {
    let old = [
        (
            "let slot_bytes = layout.value_offset(0, 0, 1) - layout.value_offset(0, 0, 0);",
            "stride from two offsets",
        ),
        (
            ".map(|tk| (page_of(tk) as usize * bpp + (tk.pos % ps) * slot_bytes) as i64)",
            "page placed by hand",
        ),
        (
            "let (row_bytes, col_byte0) = (kv.len() * hd * 2, kv.start * hd * 2);",
            "element size by hand",
        ),
        (
            "let (page, off) = ((sp.at / bpp) as PageId, sp.at % bpp);",
            "page and offset by hand",
        ),
        ("tok_base.push((page * bpp) as i64);", "page placed by hand"),
        (
            "let v1 = l.value_offset(layer, comp, 1) as i64;",
            "stride from two offsets",
        ),
        (
            "layout.region_offset(layer + 1, 0)",
            "stride from two offsets",
        ),
        ("let off = p as usize * bpp;", "page placed by hand"),
        (
            ".map(|p| pages_of_seq[p / ps] as i64 * bpp as i64)",
            "page placed by hand",
        ),
        (
            "bytes[refs[6].slot as usize * layout().bytes_per_page() + 1234] ^= 0x10;",
            "page placed by hand",
        ),
        ("bytes[slot * page + 4321] ^= 0x04;", "slot times a stride"),
        (
            "assert_eq!(slot_bytes, row_elems * 2);",
            "element size by hand",
        ),
        (
            "&mut pool.values_mut::<u16>(p, layer, comp)[sl * row_elems..(sl + 1) * row_elems];",
            "slot times a stride",
        ),
        (
            "let at = |off: i64, st: i64| pg + (off + slot as i64 * st) as usize;",
            "slot times a stride",
        ),
    ];
    // Plausible variants of the same mistakes.
    let variants = [
        (
            "let stride = kv_heads * head_dim * std::mem::size_of::<half::f16>();",
            "element size by hand",
        ),
        (
            "let at = page as usize * layout.bytes_per_page() + 7;",
            "page placed by hand",
        ),
        (
            "let end = start + layout.bytes_per_token_per_layer() * ps;",
            "product with a token or layer size",
        ),
        (
            "let in_page = offset % page_bytes;",
            "page and offset by hand",
        ),
        (
            "let tail = base + ps * DType::F16.size_bytes();",
            "element size by hand",
        ),
        (
            "let next = layout.scale_offset(l, c, slot + 1).unwrap();",
            "stride from two offsets",
        ),
        (
            "let o = base + (pos % layout.page_size()) * row_stride;",
            "slot times a stride",
        ),
        ("let o = base + slot * stride;", "slot times a stride"),
        (
            "let o = layout.page_offset(p) + slot * layout.token_stride(0);",
            "product with a token or layer size",
        ),
        ("let cols = kvd * 2;", "element size by hand"),
    ];
    for (snippet, rule) in old.iter().chain(&variants) {
        let got = offences(snippet);
        assert_eq!(got.len(), 1, "not caught: {snippet}");
        assert_eq!(got[0].1, *rule, "{snippet}");
    }
    // In context: the old `CudaModel::forward` lines, among code that asks its layout.
    let old_forward = "
        let bpp = layout.bytes_per_page();
        let ps = layout.page_size();
        let slot_bytes = layout.value_offset(0, 0, 1) - layout.value_offset(0, 0, 0);
        let page_of = |tk: &BatchToken| seq_pages[tk.seq][tk.pos / ps];
        let tok_off: Vec<i64> = tokens
            .iter()
            .map(|tk| (page_of(tk) as usize * bpp + (tk.pos % ps) * slot_bytes) as i64)
            .collect();
    ";
    let lines: Vec<usize> = offences(old_forward).iter().map(|o| o.0).collect();
    assert_eq!(lines, [4, 8]);
}

/// Ordinary index arithmetic, the layout's own answers, comments and strings pass.
#[test]
fn ordinary_arithmetic_passes() {
    let fine = [
        "let at = ti * stride + h * hd;",
        "let (col0, cols) = (hd, 2 * hd);",
        "let stride = (heads + extra) * hd;",
        "let n = x.len() * 4;",
        "let at = layout.page_offset(p) + layout.value_offset(l, c, slot);",
        "let (page, off) = layout.locate(sp.at);",
        "let cols = layout.value_bytes(0, kv.start * hd..kv.end * hd);",
        "let stride = layout.token_stride(comp) as i64;",
        "let pages = budget as usize / page_bytes;",
        "let bytes = layout.bytes_per_pool(pages);",
        "let slot = tk.pos % ps;",
        "let page = pages[p / ps];",
        "let off = layout.value_offset(layer, comp, 0);",
        "for slot in 0..ps { let v = layout.value_offset(0, 0, slot); }",
        "let s = format!(\"page * bpp + slot * stride = {}\", x);",
        "let s = r#\"hd * 2 \"quoted\" bytes_per_page() * n\"#;",
        "let c = '*'; let d = b'*'; fn f<'a>(x: &'a [u8]) {}",
        "// page * bpp + slot * stride, as the kernel computes it",
        "/* (tk.pos % ps) * slot_bytes */ let x = 1;",
        "let w = self.spec.world() * 2;",
        "let mut slots = vec![0; n]; let s = *slot;",
        "match *slot { Some(l) => l, None => return *sl }",
        "let p = ptr as *const u8; let q = &mut *slot;",
        // Component 1 (V) at slot 0, and layer 1: no stride in sight.
        "let v_off = layout.value_offset(li, 1, 0) as i64;",
        "let at = layout.value_offset(1, 0, slot);",
        // A count of pages times the page size is a count of bytes (sizes of a mirror
        // file, bytes moved for a metric), not a placement.
        "let bytes = bpp * pages;",
        "written * pool.layout().bytes_per_page() as u64;",
        "st.load_bytes += (r.pages * self.pool.layout().bytes_per_page()) as u64;",
    ];
    for snippet in fine {
        assert_eq!(offences(snippet), [], "flagged: {snippet}");
    }
    // A multi-line string or block comment hides what is inside it.
    let hidden = "let doc = \"\n  page * bpp\n\";\n/*\n let x = slot * stride;\n*/\nlet y = 1;";
    assert_eq!(offences(hidden), []);
}

#[test]
fn the_allow_marker_needs_a_reason() {
    let same_line = "let x = p * bpp; // layout-arithmetic: the file format fixes 4 KiB records";
    assert_eq!(offences(same_line), []);
    let above = "// layout-arithmetic: a wire format older than KvLayout\nlet x = p * bpp;";
    assert_eq!(offences(above), []);
    let no_reason = "let x = p * bpp; // layout-arithmetic:";
    assert_eq!(offences(no_reason).len(), 1);
    let other_comment = "let x = p * bpp; // see KvLayout";
    assert_eq!(offences(other_comment).len(), 1);
    // A marker in the comment block right above counts; code or a blank line ends it.
    let block = "// layout-arithmetic: a wire format older than KvLayout,\n// kept for old files.\nlet x = p * bpp;";
    assert_eq!(offences(block), []);
    let blank = "// layout-arithmetic: a wire format older than KvLayout\n\nlet x = p * bpp;";
    assert_eq!(offences(blank).len(), 1);
    let two_below =
        "// layout-arithmetic: a wire format older than KvLayout\nlet a = 1;\nlet x = p * bpp;";
    assert_eq!(
        offences(two_below).iter().map(|o| o.0).collect::<Vec<_>>(),
        [3]
    );
}

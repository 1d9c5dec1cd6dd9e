//! A generated corpus of tool-call outputs in every format — well-formed with 0 to 3 calls
//! and every JSON value type, and malformed in each way a model gets it wrong — fed to the
//! parsers whole, split at every byte position, and in random chunkings. Properties: no
//! markup byte ever reaches content; every well-formed call parses exactly; every
//! malformed block yields an error, never content.

use pdmesh_chat::{Delta, OutputParser, ReasoningParser, ToolFormat, ToolParser, coalesce};
use proptest::prelude::*;
use serde_json::{Map, Value, json};

mod common;

use common::{D, Outcome, outcome};

fn run(format: ToolFormat, chunks: &[&[u8]], allowed: Option<Vec<String>>) -> Outcome {
    let mut p = ToolParser::new(format, allowed, "call_");
    let mut deltas = Vec::new();
    for c in chunks {
        deltas.extend(p.push(c));
    }
    deltas.extend(p.finish());
    outcome(deltas)
}

/// No markup of any format in `content`.
fn assert_clean(content: &str, what: &str) {
    for m in [
        "DSML",
        "<tool_call>",
        "</tool_call>",
        "tool▁",
        "function_calls",
        "<think>",
        "</think>",
    ] {
        assert!(
            !content.contains(m),
            "{what}: markup {m:?} leaked into content {content:?}"
        );
    }
}

fn values() -> Vec<Value> {
    vec![
        json!("Paris"),
        json!("with \"quotes\", <angle> & new\nlines, ünïcödé 🦀"),
        json!(""),
        json!(42),
        json!(-3.5e-2),
        json!(true),
        json!(false),
        json!(null),
        json!([1, "two", [3]]),
        json!({"nested": {"k": [true, null]}}),
    ]
}

/// Calls with 0..=3 invokes cycling through the value types.
fn call_sets() -> Vec<Vec<(String, Map<String, Value>)>> {
    let vals = values();
    let mut sets = Vec::new();
    for n in 0..=3usize {
        for start in 0..vals.len() {
            let calls = (0..n)
                .map(|i| {
                    let mut m = Map::new();
                    for j in 0..(i + start) % 3 + 1 {
                        m.insert(
                            format!("p{j}"),
                            vals[(start + i * 3 + j) % vals.len()].clone(),
                        );
                    }
                    (format!("tool_{}", (start + i) % 4), m)
                })
                .collect();
            sets.push(calls);
        }
    }
    sets
}

fn dsml_value(v: &Value) -> (String, bool) {
    match v {
        Value::String(s) => (s.clone(), true),
        other => (other.to_string(), false),
    }
}

/// A block in `format` for `calls` (None for formats that cannot write zero calls).
fn block(
    format: ToolFormat,
    calls: &[(String, Map<String, Value>)],
    variant: usize,
) -> Option<String> {
    match format {
        ToolFormat::Dsml => {
            let (wrapper, sp) = [
                ("function_calls", ""),
                ("tool_calls", ""),
                ("function_calls", " "),
            ][variant % 3];
            if calls.is_empty() {
                return None;
            }
            let invokes: Vec<String> = calls
                .iter()
                .map(|(name, args)| {
                    let params: Vec<String> = args
                        .iter()
                        .map(|(k, v)| {
                            let (text, s) = dsml_value(v);
                            format!("<{D}{sp}parameter name=\"{k}\" string=\"{s}\">{text}</{D}{sp}parameter>")
                        })
                        .collect();
                    format!("<{D}{sp}invoke name=\"{name}\">\n{}\n</{D}{sp}invoke>", params.join("\n"))
                })
                .collect();
            Some(format!(
                "<{D}{sp}{wrapper}>\n{}\n</{D}{sp}{wrapper}>",
                invokes.join("\n")
            ))
        }
        ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => {
            if calls.is_empty() {
                return None;
            }
            let body: String = calls
                .iter()
                .map(|(name, args)| {
                    let a = Value::Object(args.clone()).to_string();
                    if format == ToolFormat::DeepSeekV3 {
                        format!("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{a}\n```<｜tool▁call▁end｜>")
                    } else {
                        format!("<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{a}<｜tool▁call▁end｜>")
                    }
                })
                .collect();
            Some(format!("<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"))
        }
        ToolFormat::Hermes => {
            if calls.is_empty() {
                return None;
            }
            Some(
                calls
                    .iter()
                    .map(|(name, args)| {
                        format!(
                            "<tool_call>\n{}\n</tool_call>",
                            json!({"name": name, "arguments": args})
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
            )
        }
    }
}

const FORMATS: [ToolFormat; 4] = [
    ToolFormat::Dsml,
    ToolFormat::DeepSeekV3,
    ToolFormat::DeepSeekV31,
    ToolFormat::Hermes,
];
const PREFIXES: [&str; 3] = [
    "",
    "Let me check the weather — ünïcödé 🦀.",
    "a < b and c > d",
];

/// (format, full text, expected content, expected calls)
type Shape = (ToolFormat, String, String, Vec<(String, Value)>);

fn well_formed() -> Vec<Shape> {
    let mut out = Vec::new();
    for f in FORMATS {
        for (k, calls) in call_sets().iter().enumerate() {
            for (pi, prefix) in PREFIXES.iter().enumerate() {
                let k = k + pi;
                let want: Vec<(String, Value)> = calls
                    .iter()
                    .map(|(n, a)| (n.clone(), Value::Object(a.clone())))
                    .collect();
                let Some(b) = block(f, calls, k) else {
                    // No calls: the text is all content.
                    out.push((f, prefix.to_string(), prefix.to_string(), Vec::new()));
                    continue;
                };
                let trailer = ["", "\n", "<｜end▁of▁sentence｜>", "  \n"][k % 4];
                out.push((
                    f,
                    format!("{prefix}\n\n{b}{trailer}"),
                    prefix.to_string(),
                    want,
                ));
            }
        }
    }
    out
}

/// (format, full text, expected content, reason)
fn malformed() -> Vec<(ToolFormat, String, String, &'static str)> {
    let mut out = Vec::new();
    let one = |f: ToolFormat| {
        let mut m = Map::new();
        m.insert("city".into(), json!("Paris"));
        m.insert("days".into(), json!(2));
        block(f, &[("get_weather".into(), m)], 0).unwrap()
    };
    for prefix in PREFIXES {
        let p = |s: &str| format!("{prefix}\n\n{s}");
        for f in FORMATS {
            let b = one(f);
            // Cut short anywhere inside the block (past its opening marker's first chars).
            for cut in (4..b.len()).step_by(7).filter(|&c| b.is_char_boundary(c)) {
                out.push((f, p(&b[..cut]), prefix.into(), "unterminated"));
            }
            out.push((
                f,
                p(&format!("{b}\nand then some words")),
                prefix.into(),
                "trailing_text",
            ));
        }
        let dsml = [
            (
                format!("<{D}invoke name=\"f\">\n</{D}invoke>"),
                "bare_invoke",
            ),
            (
                format!(
                    "<{D}function_call>\n<{D}invoke name=\"f\">\n</{D}invoke>\n</{D}function_calls>"
                ),
                "wrong_wrapper",
            ),
            (
                format!(
                    "<{D}function_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"false\">{{bad</{D}parameter>\n</{D}invoke>\n</{D}function_calls>"
                ),
                "bad_json",
            ),
            (
                format!(
                    "<{D}function_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"true\">a</{D}parameter>\n<{D}parameter name=\"x\" string=\"true\">b</{D}parameter>\n</{D}invoke>\n</{D}function_calls>"
                ),
                "duplicate_parameter",
            ),
            (
                format!(
                    "<{D}function_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"maybe\">a</{D}parameter>\n</{D}invoke>\n</{D}function_calls>"
                ),
                "bad_string_attr",
            ),
            (
                format!("<{D}function_calls>\n</{D}function_calls>"),
                "empty_block",
            ),
            (
                format!(
                    "<{D}function_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"x\" string=\"true\">a\n</{D}invoke>\n</{D}function_calls>"
                ),
                "unterminated_parameter",
            ),
            (
                format!(
                    "<|DSML|function_calls>\n<{D}invoke name=\"f\">oops</{D}invoke>\n</|DSML|function_calls>"
                ),
                "malformed_tag",
            ),
        ];
        for (text, reason) in dsml {
            out.push((ToolFormat::Dsml, p(&text), prefix.into(), reason));
        }
        out.push((
            ToolFormat::Hermes,
            p("<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>"),
            prefix.into(),
            "bad_json",
        ));
        out.push((
            ToolFormat::Hermes,
            p("<tool_call>\nnot json\n</tool_call>"),
            prefix.into(),
            "bad_json",
        ));
        out.push((
            ToolFormat::Hermes,
            p("</tool_call>"),
            prefix.into(),
            "wrong_wrapper",
        ));
        out.push((
            ToolFormat::DeepSeekV31,
            p("<｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
            prefix.into(),
            "bare_invoke",
        ));
        out.push((ToolFormat::DeepSeekV31, p("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\":<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), prefix.into(), "bad_json"));
        out.push((ToolFormat::DeepSeekV3, p("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n[]\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), prefix.into(), "bad_json"));
    }
    out
}

fn check_well_formed(
    f: ToolFormat,
    chunks: &[&[u8]],
    content: &str,
    calls: &[(String, Value)],
    what: &str,
) {
    let o = run(f, chunks, None);
    assert_eq!(o.errors, Vec::<&str>::new(), "{what}");
    assert_eq!(o.content, content, "{what}");
    assert_eq!(o.calls, calls, "{what}");
}

fn check_malformed(f: ToolFormat, chunks: &[&[u8]], content: &str, reason: &str, what: &str) {
    let o = run(f, chunks, None);
    assert_eq!(o.errors, vec![reason], "{what}: {o:?}");
    assert_clean(&o.content, what);
    assert_eq!(o.content, content, "{what}");
    if reason != "trailing_text" {
        assert!(o.calls.is_empty(), "{what}: a failed block emits no call");
    }
}

#[test]
fn the_corpus_has_five_hundred_shapes_and_each_parses_whole_and_split_at_every_byte() {
    let good = well_formed();
    let bad = malformed();
    assert!(
        good.len() + bad.len() >= 500,
        "{} + {}",
        good.len(),
        bad.len()
    );
    eprintln!(
        "corpus: {} well-formed and {} malformed shapes",
        good.len(),
        bad.len()
    );
    for (f, text, content, calls) in &good {
        let b = text.as_bytes();
        for cut in 0..=b.len() {
            let what = format!("{f:?} split at {cut}: {text:?}");
            check_well_formed(*f, &[&b[..cut], &b[cut..]], content, calls, &what);
        }
    }
    for (f, text, content, reason) in &bad {
        let b = text.as_bytes();
        for cut in 0..=b.len() {
            let what = format!("{f:?} split at {cut}: {text:?}");
            check_malformed(*f, &[&b[..cut], &b[cut..]], content, reason, &what);
        }
    }
}

#[test]
fn a_call_to_a_tool_the_request_did_not_offer_is_an_error() {
    let text = format!(
        "<{D}function_calls>\n<{D}invoke name=\"rm_rf\">\n</{D}invoke>\n</{D}function_calls>"
    );
    let o = run(
        ToolFormat::Dsml,
        &[text.as_bytes()],
        Some(vec!["get_weather".into()]),
    );
    assert_eq!(
        (o.errors, o.calls.len(), o.content.as_str()),
        (vec!["unknown_tool"], 0, "")
    );
}

#[test]
fn leaked_and_doubled_sentinels_parse_as_the_real_one() {
    for s in ["|DSML|", "‖DSML‖", "｜｜DSML｜｜"] {
        let text = format!(
            "Hi\n\n<{s}function_calls>\n<{s}invoke name=\"f\">\n<{s}parameter name=\"n\" string=\"false\">1</{s}parameter>\n</{s}invoke>\n</{s}function_calls>"
        );
        let o = run(ToolFormat::Dsml, &[text.as_bytes()], None);
        assert_eq!(o.errors, Vec::<&str>::new(), "{s}");
        assert_eq!(
            (o.content.as_str(), o.calls),
            ("Hi", vec![("f".into(), json!({"n": 1}))]),
            "{s}"
        );
    }
}

#[test]
fn reasoning_then_tools_through_the_pipeline() {
    let text = format!(
        "I should look it up.</think>\n\nChecking.\n\n<{D}function_calls>\n<{D}invoke name=\"get_weather\">\n<{D}parameter name=\"city\" string=\"true\">Paris</{D}parameter>\n</{D}invoke>\n</{D}function_calls><｜end▁of▁sentence｜>"
    );
    let b = text.as_bytes();
    for cut in 0..=b.len() {
        let mut p = OutputParser::new(
            Some(ReasoningParser::new(true)),
            Some(ToolParser::new(
                ToolFormat::Dsml,
                Some(vec!["get_weather".into()]),
                "c",
            )),
        );
        let mut d = p.push(&b[..cut]);
        d.extend(p.push(&b[cut..]));
        d.extend(p.finish());
        let o = outcome(d);
        assert_eq!(o.reasoning, "I should look it up.", "cut {cut}");
        assert_eq!(o.content, "Checking.", "cut {cut}");
        assert_eq!(
            o.calls,
            vec![("get_weather".into(), json!({"city": "Paris"}))],
            "cut {cut}"
        );
        assert!(o.errors.is_empty(), "cut {cut}: {:?}", o.errors);
    }
    // Not in thinking mode, a model may open <think> itself; text before it keeps it as text.
    let mut r = ReasoningParser::new(false);
    let mut d = r.push(b"  <think>hmm</think>Answer");
    d.extend(r.finish());
    assert_eq!(
        coalesce(d),
        vec![
            Delta::Reasoning("hmm".into()),
            Delta::Content("Answer".into())
        ]
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Arbitrary text around a real block, in arbitrary chunks: content is exactly the
    /// text, the calls are exact, nothing leaks.
    #[test]
    fn arbitrary_chunkings_never_leak(
        prefix in "[a-zA-Z0-9 .,!?ü🦀<>/|]{0,40}",
        which in 0usize..40,
        cuts in proptest::collection::vec(0usize..400, 0..12),
    ) {
        let good = well_formed();
        let (f, text, content, calls) = &good[which * 7 % good.len()];
        // Only prefixes that cannot themselves start markup.
        prop_assume!(!prefix.contains('<'));
        let full = format!("{prefix}{text}");
        let want = format!("{prefix}{content}");
        let want = if calls.is_empty() { want } else { want.trim_end().to_owned() };
        let b = full.as_bytes();
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (b.len() + 1)).collect();
        cuts.sort_unstable();
        let mut chunks: Vec<&[u8]> = Vec::new();
        let mut at = 0;
        for c in cuts {
            chunks.push(&b[at..c]);
            at = c;
        }
        chunks.push(&b[at..]);
        let o = run(*f, &chunks, None);
        prop_assert_eq!(o.errors, Vec::<&str>::new());
        prop_assert_eq!(&o.content, &want);
        prop_assert_eq!(&o.calls, calls);
    }
}

#[test]
fn characters_split_across_chunks_survive_every_pipeline_shape() {
    let text = "ünïcödé 🦀 done";
    let b = text.as_bytes();
    for cut in 0..=b.len() {
        for (reasoning, tools) in [(false, false), (false, true), (true, false), (true, true)] {
            let mut p = OutputParser::new(
                reasoning.then(|| ReasoningParser::new(false)),
                tools.then(|| ToolParser::new(ToolFormat::Hermes, None, "c")),
            );
            let mut d = p.push(&b[..cut]);
            d.extend(p.push(&b[cut..]));
            d.extend(p.finish());
            assert_eq!(
                outcome(d).content,
                text,
                "cut {cut}, reasoning {reasoning}, tools {tools}"
            );
        }
    }
}

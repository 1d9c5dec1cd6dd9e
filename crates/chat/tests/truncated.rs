//! Generations cut off by their length limit: a two-call output in every format (and the
//! DSML spellings), cut at every character, parsed whole, a byte at a time and through the
//! reasoning pipeline. Cut, the calls that completed come back exactly, the unfinished one
//! not at all, nothing of its markup reaches content and nothing is an error. Ended there
//! by the model itself, the same text is an error wherever it stops inside markup.

use pdmesh_chat::{Delta, OutputParser, ReasoningParser, ToolFormat, ToolParser};
use serde_json::{Value, json};

mod common;

use common::{D, Outcome, outcome};

fn calls() -> Vec<(String, Value)> {
    vec![
        (
            "get_weather".into(),
            json!({"location": "Paris", "note": "<b> & \"q\" ü🦀"}),
        ),
        (
            "get_time".into(),
            json!({"timezone": "Europe/Paris", "24h": false}),
        ),
    ]
}

/// One output: `prefix`, a blank line, then the calls; with where each call's markup ends
/// and where each block ends (the model may stop there).
struct Case {
    format: ToolFormat,
    text: String,
    prefix: &'static str,
    call_ends: Vec<usize>,
    block_ends: Vec<usize>,
}

fn ends_of(text: &str, marker: &str) -> Vec<usize> {
    text.match_indices(marker)
        .map(|(i, m)| i + m.len())
        .collect()
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for prefix in ["", "Let me check — ünïcödé 🦀.", "a < b"] {
        let mut add =
            |format: ToolFormat, block: String, call_end: &str, block_end: Option<&str>| {
                let text = format!("{prefix}\n\n{block}");
                let call_ends = ends_of(&text, call_end);
                assert_eq!(call_ends.len(), 2, "{text}");
                let block_ends = block_end.map_or(call_ends.clone(), |e| ends_of(&text, e));
                out.push(Case {
                    format,
                    text,
                    prefix,
                    call_ends,
                    block_ends,
                });
            };
        let hermes: Vec<String> = calls()
            .iter()
            .map(|(n, a)| {
                format!(
                    "<tool_call>\n{}\n</tool_call>",
                    json!({"name": n, "arguments": a})
                )
            })
            .collect();
        add(ToolFormat::Hermes, hermes.join("\n"), "</tool_call>", None);

        for (s, wrapper) in [
            (D.to_owned(), "function_calls"),
            (D.to_owned(), "tool_calls"),
            (format!("{D} "), "function_calls"),
            ("|DSML|".to_owned(), "function_calls"),
        ] {
            let invokes: Vec<String> = calls()
                .iter()
                .map(|(n, a)| {
                    let params: Vec<String> = a
                        .as_object()
                        .unwrap()
                        .iter()
                        .map(|(k, v)| {
                            let (text, string) = match v {
                                Value::String(t) => (t.clone(), true),
                                other => (other.to_string(), false),
                            };
                            format!("<{s}parameter name=\"{k}\" string=\"{string}\">{text}</{s}parameter>")
                        })
                        .collect();
                    format!("<{s}invoke name=\"{n}\">\n{}\n</{s}invoke>", params.join("\n"))
                })
                .collect();
            let close = format!("</{s}{wrapper}>");
            add(
                ToolFormat::Dsml,
                format!("<{s}{wrapper}>\n{}\n{close}", invokes.join("\n")),
                &format!("</{s}invoke>"),
                Some(&close),
            );
        }

        for format in [ToolFormat::DeepSeekV3, ToolFormat::DeepSeekV31] {
            let body: String = calls()
                .iter()
                .map(|(n, a)| {
                    if format == ToolFormat::DeepSeekV3 {
                        format!("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{a}\n```<｜tool▁call▁end｜>")
                    } else {
                        format!("<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{a}<｜tool▁call▁end｜>")
                    }
                })
                .collect();
            add(
                format,
                format!("<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"),
                "<｜tool▁call▁end｜>",
                Some("<｜tool▁calls▁end｜>"),
            );
        }
    }
    out
}

/// The ways a generation's text reaches the parser, ended by `finish` or
/// `finish_truncated` (`cut`).
fn parse_all_ways(format: ToolFormat, text: &str, cut: bool) -> Vec<(&'static str, Outcome)> {
    let allowed = Some(vec!["get_weather".to_owned(), "get_time".to_owned()]);
    let b = text.as_bytes();
    let mut out = Vec::new();
    let outcome = |d| {
        let o = outcome(d);
        assert_eq!(o.reasoning, "", "reasoning from a text without any");
        o
    };

    let mut p = ToolParser::new(format, allowed.clone(), "call_");
    let mut d = p.push(b);
    d.extend(if cut {
        p.finish_truncated()
    } else {
        p.finish()
    });
    out.push(("whole", outcome(d)));

    let mut p = ToolParser::new(format, allowed.clone(), "call_");
    let mut d: Vec<Delta> = b.iter().flat_map(|byte| p.push(&[*byte])).collect();
    d.extend(if cut {
        p.finish_truncated()
    } else {
        p.finish()
    });
    out.push(("streamed a byte at a time", outcome(d)));

    let mut p = OutputParser::new(
        Some(ReasoningParser::new(false)),
        Some(ToolParser::new(format, allowed, "call_")),
    );
    let mut d: Vec<Delta> = b.chunks(3).flat_map(|c| p.push(c)).collect();
    d.extend(if cut {
        p.finish_truncated()
    } else {
        p.finish()
    });
    out.push(("through the reasoning pipeline", outcome(d)));
    out
}

/// No markup of any format in `content`.
fn assert_clean(content: &str, what: &str) {
    for m in ["DSML", "<tool", "tool▁", "function_calls", "tool_calls"] {
        assert!(
            !content.contains(m),
            "{what}: markup {m:?} leaked into content {content:?}"
        );
    }
}

/// Calls `check(case, c, block_start)` for every case cut at every character `c`;
/// `block_start` is where its markup begins.
fn every_cut(mut check: impl FnMut(&Case, usize, usize)) {
    for case in cases() {
        let block_start = case.prefix.len() + 2;
        let t = &case.text;
        for c in (0..=t.len()).filter(|&c| t.is_char_boundary(c)) {
            check(&case, c, block_start);
        }
    }
}

#[test]
fn cut_at_every_character_the_complete_calls_come_back_and_the_rest_is_dropped() {
    let want = calls();
    every_cut(|case, c, block_start| {
        let cut_text = &case.text[..c];
        let done = case.call_ends.iter().filter(|&&e| e <= c).count();
        let content = if c > block_start {
            case.prefix
        } else {
            // A tail that may begin a marker (`<`) goes, with the blank line before it.
            cut_text.strip_suffix('<').map_or(cut_text, str::trim_end)
        };
        for (how, o) in parse_all_ways(case.format, cut_text, true) {
            let what = format!("{:?} cut at {c} ({how}): {cut_text:?}", case.format);
            assert_eq!(o.errors, Vec::<&str>::new(), "{what}");
            assert_eq!(o.calls, want[..done], "{what}");
            assert_clean(&o.content, &what);
            assert_eq!(o.content, content, "{what}");
        }
    });
}

#[test]
fn ended_by_the_model_inside_markup_the_same_text_is_an_error() {
    let want = calls();
    every_cut(|case, c, block_start| {
        let t = &case.text;
        let cut_text = &t[..c];
        // Before a marker's second character, or after whole blocks and whitespace.
        let valid = c <= block_start + 1
            || case
                .block_ends
                .iter()
                .any(|&e| e <= c && t[e..c].trim().is_empty());
        let done = case.block_ends.iter().filter(|&&e| e <= c).count();
        let done = if case.format == ToolFormat::Hermes {
            done
        } else {
            // One block holds both calls.
            2 * done
        };
        for (how, o) in parse_all_ways(case.format, cut_text, false) {
            let what = format!("{:?} ended at {c} ({how}): {cut_text:?}", case.format);
            assert_clean(&o.content, &what);
            if valid {
                assert_eq!(o.errors, Vec::<&str>::new(), "{what}");
                assert_eq!(o.calls, want[..done], "{what}");
            } else {
                assert_eq!(o.errors.len(), 1, "{what}: {o:?}");
            }
        }
    });
}

#[test]
fn a_complete_call_that_is_malformed_is_an_error_even_when_cut() {
    let bad = [
        (
            ToolFormat::Hermes,
            "<tool_call>\nnot json\n</tool_call>\n<tool_call>\n{\"name\": \"get_ti".to_owned(),
            "bad_json",
        ),
        (
            ToolFormat::Dsml,
            format!(
                "<{D}function_calls>\n<{D}invoke name=\"get_time\">\n<{D}parameter name=\"24h\" string=\"false\">{{bad</{D}parameter>\n</{D}invoke>\n<{D}invoke name=\"get_weather\">\n<{D}para"
            ),
            "bad_json",
        ),
        (
            ToolFormat::Dsml,
            format!(
                "<{D}function_calls>\n<{D}invoke name=\"rm_rf\">\n</{D}invoke>\n<{D}invoke name=\"get_weather\">\n<{D}para"
            ),
            "unknown_tool",
        ),
        (
            ToolFormat::DeepSeekV31,
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"a\":<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_wea".to_owned(),
            "bad_json",
        ),
        (
            ToolFormat::DeepSeekV3,
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n[]\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>func".to_owned(),
            "bad_json",
        ),
    ];
    for (format, text, reason) in bad {
        for (how, o) in parse_all_ways(format, &text, true) {
            let what = format!("{format:?} ({how}): {text:?}");
            assert_eq!(o.errors, vec![reason], "{what}");
            assert!(o.calls.is_empty(), "{what}: {o:?}");
            assert_eq!(o.content, "", "{what}");
        }
    }
}

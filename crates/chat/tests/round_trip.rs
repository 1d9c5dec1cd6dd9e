//! Every tool-call format holds together: calls written as a model constrained by the
//! format's grammar writes them (`ToolSyntax::write_calls`) are text that grammar
//! accepts, and the streaming parser, fed it in small chunks, reads back the same calls.
//! A mismatch would fail every constrained request, or show markup as content.

use pdmesh_chat::{Call, Tool, ToolFormat, ToolParser};
use pdmesh_testkit::grammar::lark_follows;
use serde_json::{Value, json};

mod common;

use common::outcome;

/// The tools on offer: one with an optional parameter, one with a nested object.
fn tools() -> Vec<Tool> {
    vec![
        Tool {
            name: "get_weather".into(),
            parameters: json!({
                "type": "object",
                "properties": {"location": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["location"],
            }),
        },
        Tool {
            name: "search".into(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "filters": {"type": "object", "properties": {"lang": {"type": "string"}}},
                },
                "required": ["query", "filters"],
            }),
        },
    ]
}

fn call(name: &str, arguments: Value) -> Call {
    Call {
        name: name.into(),
        arguments: arguments.as_object().expect("an object").clone(),
    }
}

/// Calls a model may make, and whether the grammar must allow several.
fn cases() -> Vec<(Vec<Call>, bool)> {
    let paris = call("get_weather", json!({"location": "Paris", "days": 3}));
    let zurich = call("get_weather", json!({"location": "Zürich, ünïcödé 🦀"}));
    let search = call(
        "search",
        json!({"query": "rust \"quoted\"", "filters": {"lang": "en"}}),
    );
    vec![
        (vec![paris.clone()], false),
        (vec![zurich.clone()], false),
        (vec![search.clone()], true),
        (vec![paris, search, zurich], true),
    ]
}

/// The calls the streaming parser reads from `text` fed `chunk` bytes at a time; any
/// content or parse failure is a panic.
fn parse_back(format: ToolFormat, text: &str, chunk: usize) -> Vec<Call> {
    let names = tools().into_iter().map(|t| t.name).collect();
    let mut p = ToolParser::new(format, Some(names), "call_");
    let mut deltas = Vec::new();
    for c in text.as_bytes().chunks(chunk) {
        deltas.extend(p.push(c));
    }
    deltas.extend(p.finish());
    let o = outcome(deltas);
    assert_eq!(
        (o.content.as_str(), o.reasoning.as_str(), &o.errors[..]),
        ("", "", &[][..]),
        "{format:?}: only calls from {text:?}"
    );
    o.calls
        .into_iter()
        .map(|(name, args)| call(&name, args))
        .collect()
}

#[test]
fn every_format_writes_what_its_grammar_allows_and_its_parser_reads_back() {
    let tools = tools();
    let offered: Vec<&Tool> = tools.iter().collect();
    for format in ToolFormat::ALL {
        let syntax = format.syntax();
        for (calls, many) in cases() {
            let text = syntax.write_calls(&calls);
            let grammar = syntax.grammar(&offered, many).unwrap();
            if let Err(at) = lark_follows(&grammar, &text) {
                panic!(
                    "{format:?}: the grammar refuses {text:?} at byte {at} ({:?})\n{grammar}",
                    &text[at..]
                );
            }
            for chunk in [1, 3, text.len()] {
                assert_eq!(
                    parse_back(format, &text, chunk),
                    calls,
                    "{format:?}: {text:?}"
                );
            }
        }
    }
}

/// One call where the grammar wants one is all it takes: a second is refused.
#[test]
fn a_grammar_for_one_call_refuses_two() {
    let tools = tools();
    let offered: Vec<&Tool> = tools.iter().collect();
    let two = [
        call("get_weather", json!({"location": "Paris"})),
        call("get_weather", json!({"location": "Rome"})),
    ];
    for format in ToolFormat::ALL {
        let syntax = format.syntax();
        let text = syntax.write_calls(&two);
        assert!(
            lark_follows(&syntax.grammar(&offered, false).unwrap(), &text).is_err(),
            "{format:?}: {text:?}"
        );
        assert!(lark_follows(&syntax.grammar(&offered, true).unwrap(), &text).is_ok());
    }
}

/// A template that writes a format's calls asks the model for that format, and what a
/// format writes is made of its own markers.
#[test]
fn a_template_writing_a_formats_calls_is_detected_as_that_format() {
    let calls = [call("get_weather", json!({"location": "Paris"}))];
    for format in ToolFormat::ALL {
        let text = format.syntax().write_calls(&calls);
        let template = format!("{{% if tools %}}{text}{{% endif %}}");
        assert_eq!(ToolFormat::from_template(&template), format, "{text:?}");
        assert!(
            format.syntax().markers().iter().any(|m| text.contains(m)),
            "{format:?} writes none of its markers: {text:?}"
        );
    }
}

/// pdmesh's Hermes rendering for prompts writes JSON with Python's spacing, as chat
/// templates' `tojson` does; the parser reads that back too.
#[test]
fn hermes_prompt_rendering_parses_back() {
    let c = pdmesh_chat::ToolCall::new(
        "get_weather",
        json!({"location": "Paris", "days": 3})
            .as_object()
            .unwrap()
            .clone(),
    );
    let text = pdmesh_chat::formats::hermes::tool_call_block(&c);
    assert_eq!(
        parse_back(ToolFormat::Hermes, &text, 2),
        [Call::from(&c)],
        "{text:?}"
    );
}

//! Tests of the tool plans: the tools and tool choice read from a request, and the grammars
//! made from them.

use super::*;
use pdmesh_chat::ToolFormat;
use pdmesh_testkit::grammar::{END, byte_matcher, lark_accepts};

fn weather() -> Vec<Tool> {
    parse_tools(Some(&json!([{
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["location"],
            },
        },
    }])))
    .unwrap()
}

#[test]
fn bad_tools_are_400s_naming_the_field() {
    for (tools, param) in [
        (json!({"type": "function"}), "tools"),
        (json!([{"type": "retrieval"}]), "tools[0].type"),
        (json!([{"type": "function"}]), "tools[0].function"),
        (
            json!([{"type": "function", "function": {"name": "a b"}}]),
            "tools[0].function.name",
        ),
        (
            json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]),
            "tools[0].function.parameters",
        ),
        (
            json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]),
            "tools[1].function.name",
        ),
    ] {
        let e = parse_tools(Some(&tools)).unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.param.as_deref()),
            (400, Some(param)),
            "{tools}"
        );
    }
}

#[test]
fn tool_choice_forms() {
    let tools = weather();
    assert_eq!(parse_tool_choice(None, &tools).unwrap(), ToolChoice::Auto);
    assert_eq!(parse_tool_choice(None, &[]).unwrap(), ToolChoice::None);
    assert_eq!(
        parse_tool_choice(Some(&json!("required")), &tools).unwrap(),
        ToolChoice::Required
    );
    assert_eq!(
        parse_tool_choice(
            Some(&json!({"type": "function", "function": {"name": "get_weather"}})),
            &tools
        )
        .unwrap(),
        ToolChoice::Named("get_weather".into())
    );
    for bad in [
        json!("sometimes"),
        json!({"type": "function", "function": {"name": "nope"}}),
        json!({"type": "function"}),
        json!(3),
    ] {
        assert_eq!(
            parse_tool_choice(Some(&bad), &tools)
                .unwrap_err()
                .status
                .as_u16(),
            400,
            "{bad}"
        );
    }
    assert_eq!(
        parse_tool_choice(Some(&json!("required")), &[])
            .unwrap_err()
            .status
            .as_u16(),
        400
    );
}

/// A model writing `tools`' markup, and reasoning or not.
fn writing(tools: ToolFormat, reasoning: bool) -> OutputFormat {
    OutputFormat {
        tools: Some(tools),
        reasoning,
    }
}

/// The grammar `choice` forces on a model writing `out`, with no response format and no
/// thinking.
fn forced(tools: &[Tool], choice: &ToolChoice, parallel: bool, out: OutputFormat) -> String {
    plan(tools, None, choice, parallel, None, out, false)
        .unwrap()
        .grammar
        .unwrap()
}

#[test]
fn none_renders_no_tools_and_parses_none() {
    let tools = weather();
    let out = writing(ToolFormat::Hermes, false);
    let rendered = |choice| plan(&tools, Some("[..]".into()), &choice, true, None, out, false);
    assert_eq!(rendered(ToolChoice::None).unwrap(), Plan::default());
    let p = rendered(ToolChoice::Auto).unwrap();
    assert_eq!(p.render.as_deref(), Some("[..]"));
    assert_eq!(p.parse_tools, Some(vec!["get_weather".to_owned()]));
    assert_eq!(p.grammar, None, "auto leaves the model free");
}

#[test]
fn required_forces_the_models_own_markup() {
    let tools = weather();
    let hermes = writing(ToolFormat::Hermes, false);
    let g = forced(&tools, &ToolChoice::Required, false, hermes);
    assert!(
        g.starts_with("start: call\ncall: \"<tool_call>\\n\" (call0) \"\\n</tool_call>\"\n"),
        "{g}"
    );
    assert!(g.contains(r#""const":"get_weather""#), "{g}");
    assert!(g.contains(r#""whitespace_flexible":false"#), "{g}");
    let g = forced(&tools, &ToolChoice::Required, true, hermes);
    assert!(
        g.starts_with("start: call (\"\\n\" call)*\n"),
        "parallel calls: {g}"
    );

    let ds = writing(ToolFormat::Dsml, true);
    let g = forced(&tools, &ToolChoice::Named("get_weather".into()), true, ds);
    assert!(
        g.contains(r#""<｜DSML｜parameter name=\"location\" string=\"true\">" (/[^<]*/)"#),
        "{g}"
    );
    assert!(
        g.contains(
            r#"p0_1: "<｜DSML｜parameter name=\"days\" string=\"false\">" (%json{"type":"integer""#
        ),
        "{g}"
    );
    assert!(
        g.contains("call0: \"<｜DSML｜invoke name=\\\"get_weather\\\">\\n\" p0_0 p0_1? "),
        "{g}"
    );
    assert!(
        g.starts_with("start: \"<｜DSML｜function_calls>\\n\" call "),
        "one call when named: {g}"
    );
    let g = plan(&tools, None, &ToolChoice::Required, true, None, ds, true)
        .unwrap()
        .grammar
        .unwrap();
    assert!(
        g.starts_with("start: think_ answer_\nthink_[lazy]: "),
        "thinking first: {g}"
    );
}

/// Decodes `grammar` over a byte vocabulary, taking at each step the first allowed
/// byte of `prefer` (an order that closes strings and blocks soon in that format),
/// else the lowest: a short text of the grammar's shape.
fn shortest_text(grammar: &str, prefer: &[u8]) -> String {
    let mut m = byte_matcher(grammar);
    let mut out = Vec::new();
    for _ in 0..4000 {
        if m.is_stopped() {
            break;
        }
        let mask = m.compute_mask().unwrap();
        if mask.is_allowed(END) {
            break;
        }
        let tok = prefer
            .iter()
            .map(|&b| u32::from(b))
            .find(|&t| mask.is_allowed(t))
            .or_else(|| (0..256).find(|&t| mask.is_allowed(t)))
            .expect("the grammar allows something");
        m.consume_token(tok).unwrap();
        out.push(tok as u8);
    }
    String::from_utf8(out).unwrap()
}

/// The grammar for each format writes what pdmesh-chat's parser for that format reads
/// back as the forced call: a mismatch would fail every constrained request, or show
/// markup as content.
#[test]
fn every_formats_grammar_parses_back_into_the_call() {
    let tools = weather();
    for tf in ToolFormat::ALL {
        let out = writing(tf, false);
        let g = forced(&tools, &ToolChoice::Required, false, out);
        // A DSML string value ends at `<`; a JSON string at `"`.
        let prefer: &[u8] = if tf == ToolFormat::Dsml {
            b"<\"}]0f\n"
        } else {
            b"\"}]<0f\n"
        };
        let text = shortest_text(&g, prefer);
        let mut p = pdmesh_chat::ToolParser::new(tf, Some(vec!["get_weather".into()]), "c");
        let mut deltas = p.push_str(&text);
        deltas.extend(p.finish());
        let mut name = None;
        let mut args = String::new();
        for d in deltas {
            match d {
                pdmesh_chat::Delta::ToolCall {
                    name: n, arguments, ..
                } => {
                    name = name.or(n);
                    args.push_str(&arguments);
                }
                other => panic!("{tf:?}: {other:?} from {text:?}"),
            }
        }
        assert_eq!(name.as_deref(), Some("get_weather"), "{tf:?}: {text:?}");
        let args: Value = serde_json::from_str(&args).unwrap();
        assert!(args["location"].is_string(), "{tf:?}: {args}");
    }
}

#[test]
fn response_format_forms() {
    assert_eq!(response_schema(None).unwrap(), None);
    assert_eq!(
        response_schema(Some(&json!({"type": "text"}))).unwrap(),
        None
    );
    assert_eq!(
        response_schema(Some(&json!({"type": "json_object"}))).unwrap(),
        Some(json!({"type": "object"}))
    );
    let s = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    assert_eq!(
        response_schema(Some(
            &json!({"type": "json_schema", "json_schema": {"name": "x", "schema": s}})
        ))
        .unwrap(),
        Some(s.clone())
    );
    for bad in [
        json!({"type": "yaml"}),
        json!({"type": "json_schema"}),
        json!({"type": "json_schema", "json_schema": {"schema": {}}}),
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}),
    ] {
        assert_eq!(
            response_schema(Some(&bad)).unwrap_err().status.as_u16(),
            400,
            "{bad}"
        );
    }
    let out = writing(ToolFormat::Hermes, false);
    let g = plan(&[], None, &ToolChoice::None, true, Some(s), out, false)
        .unwrap()
        .grammar
        .unwrap();
    assert_eq!(
        g,
        "start: %json{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"additionalProperties\":false,\"x-guidance\":{\"whitespace_flexible\":false}}\n"
    );
    let e = plan(
        &weather(),
        None,
        &ToolChoice::Required,
        true,
        Some(json!({})),
        out,
        false,
    )
    .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("response_format"));
}

/// A schema silent on other properties gets only its own, in compact JSON; one that
/// allows others keeps them (the free-form `json_object` too).
#[test]
fn response_schemas_are_strict_and_compact() {
    let out = writing(ToolFormat::Hermes, false);
    let grammar = |schema: Value| {
        plan(&[], None, &ToolChoice::None, true, Some(schema), out, false)
            .unwrap()
            .grammar
            .unwrap()
    };
    let city: Value = pdmesh_testkit::fixture("city_schema.json");
    let answer = r#"{"name":"Cairo","country":"Egypt","population_millions":22"#;
    let g = grammar(city.clone());
    assert!(lark_accepts(&g, &format!("{answer}}}")), "{g}");
    assert!(
        !lark_accepts(&g, &format!(r#"{answer},"population_thousands":1}}"#)),
        "{g}"
    );
    assert!(!lark_accepts(&g, &format!("{answer} }}")), "compact: {g}");
    assert!(!lark_accepts(
        &g,
        r#"{"name": "Cairo","country":"Egypt","population_millions":22}"#
    ));

    let mut open = city;
    open["additionalProperties"] = json!(true);
    let g = grammar(open);
    assert!(
        lark_accepts(&g, &format!(r#"{answer},"population_thousands":1}}"#)),
        "{g}"
    );
    let g = grammar(
        response_schema(Some(&json!({"type": "json_object"})))
            .unwrap()
            .unwrap(),
    );
    assert!(lark_accepts(&g, r#"{"anything":[1,{"x":null}]}"#), "{g}");
}

/// A forced call's arguments hold only the declared parameters, nested ones too, and
/// `$ref`s into the parameters' `$defs` resolve in every format's grammar.
#[test]
fn forced_calls_take_only_declared_parameters() {
    let tools = parse_tools(Some(&json!([{
            "type": "function",
            "function": {
                "name": "book",
                "parameters": {
                    "type": "object",
                    "properties": {"who": {"$ref": "#/$defs/person"}},
                    "required": ["who"],
                    "$defs": {"person": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
                },
            },
        }])))
        .unwrap();
    let grammar = |tools_format| {
        let out = writing(tools_format, false);
        forced(&tools, &ToolChoice::Required, false, out)
    };
    let g = grammar(ToolFormat::Hermes);
    let call = |args: &str| {
        format!("<tool_call>\n{{\"name\":\"book\",\"arguments\":{args}}}\n</tool_call>")
    };
    assert!(lark_accepts(&g, &call(r#"{"who":{"name":"Ann"}}"#)), "{g}");
    assert!(
        !lark_accepts(&g, &call(r#"{"who":{"name":"Ann","age":3}}"#)),
        "{g}"
    );
    assert!(
        !lark_accepts(&g, &call(r#"{"who":{"name":"Ann"},"when":"now"}"#)),
        "{g}"
    );

    let g = grammar(ToolFormat::DeepSeekV31);
    let call = |args: &str| {
        format!(
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>book<｜tool▁sep｜>{args}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        )
    };
    assert!(lark_accepts(&g, &call(r#"{"who":{"name":"Ann"}}"#)), "{g}");
    assert!(
        !lark_accepts(&g, &call(r#"{"who":{"name":"Ann","age":3}}"#)),
        "{g}"
    );

    let g = grammar(ToolFormat::Dsml);
    let d = "｜DSML｜";
    let call = |who: &str| {
        format!(
            "<{d}function_calls>\n<{d}invoke name=\"book\">\n<{d}parameter name=\"who\" string=\"false\">{who}</{d}parameter>\n</{d}invoke>\n</{d}function_calls>"
        )
    };
    assert!(lark_accepts(&g, &call(r#"{"name":"Ann"}"#)), "{g}");
    assert!(!lark_accepts(&g, &call(r#"{"name":"Ann","age":3}"#)), "{g}");
}

//! Tools, `tool_choice` and `response_format`: the request's tool definitions validated,
//! what the prompt renders, how the output is parsed, and the grammar that constrains
//! decoding. A grammar always spells the model's own markup (Hermes `<tool_call>` JSON,
//! DeepSeek DSML or the V3/V3.1 tokens), so a constrained answer parses exactly like an
//! unconstrained one.

use serde_json::{Map, Value, json};

use pdmesh_chat::schema::{SchemaError, json_rule};

use crate::error::ApiError;

/// The tool-call markup a model writes (the tokenizer's `Info.tool_format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum ToolFormat {
    #[default]
    None,
    Dsml,
    DeepSeekV3,
    DeepSeekV31,
    Hermes,
}

/// The model's output conventions, from the tokenizer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct OutputFormat {
    pub tools: ToolFormat,
    /// The model writes `<think>…</think>` reasoning.
    pub reasoning: bool,
}

/// One function the request offers.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Tool {
    pub name: String,
    /// The arguments' JSON schema (`{"type": "object"}` when the tool gives none).
    pub parameters: Value,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// What the handler does with a chat request's tools and output format.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Plan {
    /// The tools JSON rendered into the prompt (absent: none, e.g. `tool_choice: "none"`).
    pub render: Option<String>,
    /// Parse tool calls from the output, allowing these names.
    pub parse_tools: Option<Vec<String>>,
    /// The Lark grammar decoding must follow.
    pub grammar: Option<String>,
}

/// The `tools` field: a list of `{"type": "function", "function": {name, parameters}}`.
pub(crate) fn parse_tools(tools: Option<&Value>) -> Result<Vec<Tool>, ApiError> {
    let list = match tools {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::invalid_param("tools", "tools must be a list")),
    };
    let mut out: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let bad =
            |what: &str, msg: String| ApiError::invalid_param(&format!("tools[{i}]{what}"), msg);
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(
                ".type",
                "only tools of type \"function\" are supported".into(),
            ));
        }
        let Some(f) = t.get("function").filter(|f| f.is_object()) else {
            return Err(bad(
                ".function",
                "a function tool needs a `function` object".into(),
            ));
        };
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        let valid = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !valid {
            return Err(bad(
                ".function.name",
                format!("function names are 1 to 64 of a-z, A-Z, 0-9, _ and -; got {name:?}"),
            ));
        }
        if out.iter().any(|o| o.name == name) {
            return Err(bad(
                ".function.name",
                format!("two tools are named {name:?}"),
            ));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(bad(
                    ".function.parameters",
                    "parameters must be a JSON schema object".into(),
                ));
            }
        };
        out.push(Tool {
            name: name.to_owned(),
            parameters,
        });
    }
    Ok(out)
}

/// The `tool_choice` field; `None` means the default (`auto` with tools, else `none`).
pub(crate) fn parse_tool_choice(v: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let choice = match v {
        None | Some(Value::Null) => {
            return Ok(if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            });
        }
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid_param(
                    "tool_choice",
                    format!(
                        "tool_choice must be \"none\", \"auto\", \"required\" or a named function, not {other:?}"
                    ),
                ));
            }
        },
        Some(obj @ Value::Object(_)) => {
            let name = obj
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (obj.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(n)) => ToolChoice::Named(n.to_owned()),
                _ => {
                    return Err(ApiError::invalid_param(
                        "tool_choice",
                        "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": …}}",
                    ));
                }
            }
        }
        Some(other) => {
            return Err(ApiError::invalid_param(
                "tool_choice",
                format!("tool_choice must be a string or an object, not {other}"),
            ));
        }
    };
    match &choice {
        ToolChoice::Required | ToolChoice::Named(_) if tools.is_empty() => {
            Err(ApiError::invalid_param(
                "tool_choice",
                "tool_choice requires a call but the request gives no tools",
            ))
        }
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => {
            Err(ApiError::invalid_param(
                "tool_choice",
                format!("tool_choice names {n:?}, which is not one of the request's tools"),
            ))
        }
        _ => Ok(choice),
    }
}

/// `response_format` → the JSON schema the output must match (`None` for text).
pub(crate) fn response_schema(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let bad = |msg: &str| ApiError::invalid_param("response_format", msg);
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "object"}))),
        Some("json_schema") => {
            let Some(js) = v.get("json_schema").filter(|j| j.is_object()) else {
                return Err(bad(
                    "response_format json_schema needs a `json_schema` object",
                ));
            };
            if !js.get("name").is_some_and(Value::is_string) {
                return Err(ApiError::invalid_param(
                    "response_format.json_schema.name",
                    "json_schema needs a `name`",
                ));
            }
            match js.get("schema") {
                None | Some(Value::Null) => Ok(Some(json!({"type": "object"}))),
                Some(s @ (Value::Object(_) | Value::Bool(true))) => Ok(Some(s.clone())),
                Some(_) => Err(ApiError::invalid_param(
                    "response_format.json_schema.schema",
                    "schema must be a JSON schema object",
                )),
            }
        }
        _ => Err(bad(
            "response_format.type must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// Decides rendering, parsing and the grammar for one chat request.
pub(crate) fn plan(
    tools: &[Tool],
    tools_json: Option<String>,
    choice: &ToolChoice,
    parallel: bool,
    schema: Option<Value>,
    out: OutputFormat,
    thinking: bool,
) -> Result<Plan, ApiError> {
    let names = || tools.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
    let mut plan = Plan::default();
    if !matches!(choice, ToolChoice::None) {
        plan.render = tools_json;
        if out.tools != ToolFormat::None {
            plan.parse_tools = Some(names());
        }
    }
    let forced: Vec<&Tool> = match choice {
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Named(n) => tools.iter().filter(|t| &t.name == n).collect(),
        ToolChoice::None | ToolChoice::Auto => Vec::new(),
    };
    let body = match (forced.is_empty(), schema) {
        (false, Some(_)) => {
            return Err(ApiError::invalid_param(
                "response_format",
                "response_format cannot be combined with a tool_choice that requires a call",
            ));
        }
        (false, None) => {
            if out.tools == ToolFormat::None {
                return Err(ApiError::unsupported(
                    "tool_choice",
                    "this model has no chat format for tool calls, so a call cannot be required",
                ));
            }
            let many = parallel && matches!(choice, ToolChoice::Required);
            Some(calls_grammar(out.tools, &forced, many).map_err(|e| too_complex("tools", e))?)
        }
        (true, Some(schema)) => Some(format!(
            "start: {}\n",
            json_rule(&schema).map_err(|e| too_complex("response_format.json_schema.schema", e))?
        )),
        (true, None) => None,
    };
    plan.grammar = body.map(|g| {
        if out.reasoning && thinking {
            // The prompt opened <think>: reasoning runs up to the first </think>, then the
            // constrained answer.
            g.replacen(
                "start: ",
                "start: think_ answer_\nthink_[lazy]: /(?s:.*)<\\/think>/\nanswer_: ",
                1,
            )
        } else {
            g
        }
    });
    Ok(plan)
}

/// `schema` (a part of the tool's `parameters`) made a document of its own: `$ref`s resolve
/// against the root, so the parameters' `$defs` and `definitions` move to it.
fn with_definitions(mut schema: Value, parameters: &Value) -> Value {
    if let Value::Object(m) = &mut schema {
        for key in ["$defs", "definitions"] {
            if let Some(d) = parameters.get(key)
                && !m.contains_key(key)
            {
                m.insert(key.into(), d.clone());
            }
        }
    }
    schema
}

/// How long a request's schemas may take to become its grammar.
pub(crate) const SCHEMA_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

/// The 400 for schemas that did not become a grammar within [`SCHEMA_DEADLINE`].
pub(crate) fn past_deadline() -> ApiError {
    ApiError::invalid_request(
        format!(
            "schema too complex: the request's schemas did not become a grammar within {} s",
            SCHEMA_DEADLINE.as_secs()
        ),
        None,
    )
}

/// A schema the grammar rewrite refused, as the 400 naming the field it came from.
fn too_complex(param: &str, e: SchemaError) -> ApiError {
    ApiError::invalid_param(param, e.to_string())
}

/// A Lark string literal.
fn lit(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}

/// The grammar of one or more calls (`many`) of `tools` in `format`.
fn calls_grammar(format: ToolFormat, tools: &[&Tool], many: bool) -> Result<String, SchemaError> {
    let rep = if many { "+" } else { "" };
    let mut g = String::new();
    let alts: Vec<String> = (0..tools.len()).map(|i| format!("call{i}")).collect();
    match format {
        ToolFormat::Hermes => {
            let tail = if many { " (\"\\n\" call)*" } else { "" };
            g.push_str(&format!(
                "start: call{tail}\ncall: \"<tool_call>\\n\" ({}) \"\\n</tool_call>\"\n",
                alts.join(" | ")
            ));
            for (i, t) in tools.iter().enumerate() {
                let mut arguments = t.parameters.clone();
                if let Value::Object(a) = &mut arguments {
                    a.remove("$defs");
                    a.remove("definitions");
                }
                let schema = with_definitions(
                    json!({
                        "type": "object",
                        "properties": {"name": {"const": t.name}, "arguments": arguments},
                        "required": ["name", "arguments"],
                        "additionalProperties": false,
                    }),
                    &t.parameters,
                );
                g.push_str(&format!("call{i}: {}\n", json_rule(&schema)?));
            }
        }
        ToolFormat::DeepSeekV3 | ToolFormat::DeepSeekV31 => {
            // V3 writes `function<｜tool▁sep｜>NAME` and fenced JSON; V3.1 `NAME<｜tool▁sep｜>ARGS`.
            let (before, between, after) = if format == ToolFormat::DeepSeekV3 {
                ("function<｜tool▁sep｜>", "\\n```json\\n", "\\n```")
            } else {
                ("", "<｜tool▁sep｜>", "")
            };
            g.push_str(&format!(
                "start: \"<｜tool▁calls▁begin｜>\" call{rep} \"<｜tool▁calls▁end｜>\"\ncall: {}\n",
                alts.join(" | ")
            ));
            for (i, t) in tools.iter().enumerate() {
                g.push_str(&format!(
                    "call{i}: \"<｜tool▁call▁begin｜>{before}\" {} \"{between}\" {} \"{after}<｜tool▁call▁end｜>\"\n",
                    lit(&t.name),
                    json_rule(&t.parameters)?
                ));
            }
        }
        ToolFormat::Dsml => {
            let d = "｜DSML｜";
            g.push_str(&format!(
                "start: \"<{d}function_calls>\\n\" call{rep} \"</{d}function_calls>\"\ncall: {}\n",
                alts.join(" | ")
            ));
            for (i, t) in tools.iter().enumerate() {
                let open = lit(&format!("<{d}invoke name=\"{}\">\n", t.name));
                let mut parts = Vec::new();
                let props = t.parameters.get("properties").and_then(Value::as_object);
                let required: Vec<&str> = t
                    .parameters
                    .get("required")
                    .and_then(Value::as_array)
                    .map(|r| r.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                for (j, (name, schema)) in props.into_iter().flat_map(Map::iter).enumerate() {
                    let rule = format!("p{i}_{j}");
                    let is_string = schema.get("type").and_then(Value::as_str) == Some("string");
                    let value = match schema.get("enum").and_then(Value::as_array) {
                        Some(e) if is_string => e
                            .iter()
                            .filter_map(Value::as_str)
                            .map(lit)
                            .collect::<Vec<_>>()
                            .join(" | "),
                        _ if is_string => "/[^<]*/".to_owned(),
                        _ => json_rule(&with_definitions(schema.clone(), &t.parameters))?,
                    };
                    g.push_str(&format!(
                        "{rule}: {} ({value}) {}\n",
                        lit(&format!(
                            "<{d}parameter name=\"{name}\" string=\"{is_string}\">"
                        )),
                        lit(&format!("</{d}parameter>\n")),
                    ));
                    let opt = if required.contains(&name.as_str()) {
                        ""
                    } else {
                        "?"
                    };
                    parts.push(format!("{rule}{opt}"));
                }
                g.push_str(&format!(
                    "call{i}: {open} {} {}\n",
                    parts.join(" "),
                    lit(&format!("</{d}invoke>\n"))
                ));
            }
        }
        ToolFormat::None => unreachable!("checked by plan"),
    }
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn none_renders_no_tools_and_parses_none() {
        let tools = weather();
        let out = OutputFormat {
            tools: ToolFormat::Hermes,
            reasoning: false,
        };
        let p = plan(
            &tools,
            Some("[..]".into()),
            &ToolChoice::None,
            true,
            None,
            out,
            false,
        )
        .unwrap();
        assert_eq!(p, Plan::default());
        let p = plan(
            &tools,
            Some("[..]".into()),
            &ToolChoice::Auto,
            true,
            None,
            out,
            false,
        )
        .unwrap();
        assert_eq!(p.render.as_deref(), Some("[..]"));
        assert_eq!(p.parse_tools, Some(vec!["get_weather".to_owned()]));
        assert_eq!(p.grammar, None, "auto leaves the model free");
    }

    #[test]
    fn required_forces_the_models_own_markup() {
        let tools = weather();
        let hermes = OutputFormat {
            tools: ToolFormat::Hermes,
            reasoning: false,
        };
        let g = plan(
            &tools,
            None,
            &ToolChoice::Required,
            false,
            None,
            hermes,
            false,
        )
        .unwrap()
        .grammar
        .unwrap();
        assert!(
            g.starts_with("start: call\ncall: \"<tool_call>\\n\" (call0) \"\\n</tool_call>\"\n"),
            "{g}"
        );
        assert!(g.contains(r#""const":"get_weather""#), "{g}");
        assert!(g.contains(r#""whitespace_flexible":false"#), "{g}");
        let g = plan(
            &tools,
            None,
            &ToolChoice::Required,
            true,
            None,
            hermes,
            false,
        )
        .unwrap()
        .grammar
        .unwrap();
        assert!(
            g.starts_with("start: call (\"\\n\" call)*\n"),
            "parallel calls: {g}"
        );

        let ds = OutputFormat {
            tools: ToolFormat::Dsml,
            reasoning: true,
        };
        let g = plan(
            &tools,
            None,
            &ToolChoice::Named("get_weather".into()),
            true,
            None,
            ds,
            false,
        )
        .unwrap()
        .grammar
        .unwrap();
        assert!(
            g.contains(r#""<｜DSML｜parameter name=\"location\" string=\"true\">" (/[^<]*/)"#),
            "{g}"
        );
        assert!(g.contains(r#"p0_1: "<｜DSML｜parameter name=\"days\" string=\"false\">" (%json{"type":"integer""#), "{g}");
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

    /// A matcher for `grammar` over a byte vocabulary: 256 one-byte tokens and an end
    /// token (256).
    fn byte_matcher(grammar: &str) -> llguidance::Matcher {
        use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
        let words: Vec<Vec<u8>> = (0..=255u8)
            .map(|b| vec![b])
            .chain([vec![0xff, b'E']])
            .collect();
        let trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, 256), &words);
        let env: TokEnv = std::sync::Arc::new(ApproximateTokEnv::new(trie));
        let factory = llguidance::ParserFactory::new_simple(&env).unwrap();
        let parser = factory
            .create_parser(llguidance::api::TopLevelGrammar::from_lark(grammar.into()))
            .unwrap_or_else(|e| panic!("{e}\n{grammar}"));
        llguidance::Matcher::new(Ok(parser))
    }

    /// Whether the Lark `grammar` accepts exactly `text`.
    fn lark_accepts(grammar: &str, text: &str) -> bool {
        let mut m = byte_matcher(grammar);
        for b in text.bytes() {
            // Stopped: the grammar is complete and allows nothing more.
            if m.is_stopped() || !m.compute_mask().unwrap().is_allowed(u32::from(b)) {
                return false;
            }
            m.consume_token(u32::from(b)).unwrap();
        }
        m.is_stopped() || m.is_accepting().unwrap()
    }

    /// Decodes `grammar` over a byte vocabulary, taking at each step the first allowed
    /// byte of `prefer` (an order that closes strings and blocks soon in that format),
    /// else the lowest: a short text of the grammar's shape.
    fn shortest_text(grammar: &str, prefer: &[u8]) -> String {
        let eos = 256;
        let mut m = byte_matcher(grammar);
        let mut out = Vec::new();
        for _ in 0..4000 {
            if m.is_stopped() {
                break;
            }
            let mask = m.compute_mask().unwrap();
            if mask.is_allowed(eos) {
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
        for (tf, cf) in [
            (ToolFormat::Hermes, pdmesh_chat::Format::Hermes),
            (ToolFormat::Dsml, pdmesh_chat::Format::Dsml),
            (ToolFormat::DeepSeekV3, pdmesh_chat::Format::DeepSeekV3),
            (ToolFormat::DeepSeekV31, pdmesh_chat::Format::DeepSeekV31),
        ] {
            let out = OutputFormat {
                tools: tf,
                reasoning: false,
            };
            let g = plan(&tools, None, &ToolChoice::Required, false, None, out, false)
                .unwrap()
                .grammar
                .unwrap();
            // A DSML string value ends at `<`; a JSON string at `"`.
            let prefer: &[u8] = if tf == ToolFormat::Dsml {
                b"<\"}]0f\n"
            } else {
                b"\"}]<0f\n"
            };
            let text = shortest_text(&g, prefer);
            let mut p = pdmesh_chat::ToolParser::new(cf, Some(vec!["get_weather".into()]), "c");
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
        let out = OutputFormat {
            tools: ToolFormat::Hermes,
            reasoning: false,
        };
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
        let out = OutputFormat {
            tools: ToolFormat::Hermes,
            reasoning: false,
        };
        let grammar = |schema: Value| {
            plan(&[], None, &ToolChoice::None, true, Some(schema), out, false)
                .unwrap()
                .grammar
                .unwrap()
        };
        let city = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "country": {"type": "string"},
                "population_millions": {"type": "number"},
            },
            "required": ["name", "country", "population_millions"],
        });
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
            let out = OutputFormat {
                tools: tools_format,
                reasoning: false,
            };
            plan(&tools, None, &ToolChoice::Required, false, None, out, false)
                .unwrap()
                .grammar
                .unwrap()
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
}

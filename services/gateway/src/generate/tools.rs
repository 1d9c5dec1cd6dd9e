//! Tools, `tool_choice` and `response_format`: the request's tool definitions validated,
//! what the prompt renders, how the output is parsed, and the grammar that constrains
//! decoding. A grammar always spells the model's own markup (Hermes `<tool_call>` JSON,
//! DeepSeek DSML or the V3/V3.1 tokens), so a constrained answer parses exactly like an
//! unconstrained one.

use serde_json::{Map, Value, json};

use pdmesh_chat::schema::{SchemaError, json_rule};

use crate::clients::{OutputFormat, ToolFormat};
use crate::error::ApiError;

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
mod tests;

//! Tools, `tool_choice` and `response_format`: the request's tool definitions validated,
//! what the prompt renders, how the output is parsed, and the grammar that constrains
//! decoding. A forced call's grammar comes from the model's tool-call format
//! ([`pdmesh_chat::ToolSyntax::grammar`]), so it spells the model's own markup and a
//! constrained answer parses exactly like an unconstrained one.

use serde_json::{Value, json};

pub(crate) use pdmesh_chat::Tool;
use pdmesh_chat::schema::{SchemaError, json_rule};

use crate::clients::OutputFormat;
use crate::error::ApiError;

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
        if out.tools.is_some() {
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
            let Some(format) = out.tools else {
                return Err(ApiError::unsupported(
                    "tool_choice",
                    "this model has no chat format for tool calls, so a call cannot be required",
                ));
            };
            let many = parallel && matches!(choice, ToolChoice::Required);
            let grammar = format.syntax().grammar(&forced, many);
            Some(grammar.map_err(|e| too_complex("tools", e))?)
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

#[cfg(test)]
mod tests;

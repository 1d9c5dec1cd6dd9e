//! DeepSeek DSML, the tool-call markup of DeepSeek V3.2 and V4: a `function_calls` (V4:
//! `tool_calls`) block of `invoke`s, each with `parameter`s whose `string` attribute says
//! whether the value is the text itself or JSON; every tag carries the `｜DSML｜`
//! sentinel. Models also leak it as ASCII (`|DSML|`), as `‖DSML‖`, doubled
//! (`｜｜DSML｜｜`) or, V4.1, with a space after it: all are read as the real one.
//!
//! pdmesh writes this markup itself for DeepSeek V3.2 prompts ([`crate::dsv32`]): the
//! tools block, an assistant turn's calls, and the tool results that answer them.

use serde_json::{Map, Value};

use super::{Cursor, Tool, ToolSyntax, call_alternatives, err, head, lit, with_definitions};
use crate::schema::{SchemaError, json_rule};
use crate::{Call, ChatError, ParseError};

/// The format's name.
pub const NAME: &str = "dsml";

/// The sentinel every tag carries.
const D: &str = "｜DSML｜";
/// Spellings of the sentinel read as [`D`].
const VARIANTS: [&str; 4] = ["｜｜DSML｜｜", "‖DSML‖", "|DSML|", "｜DSML｜ "];
/// The block of tool results that answers a turn's calls.
const RESULTS_OPEN: &str = "<function_results>";
const RESULTS_CLOSE: &str = "</function_results>";

/// DeepSeek DSML (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct Dsml;

impl ToolSyntax for Dsml {
    fn name(&self) -> &'static str {
        NAME
    }

    fn markers(&self) -> &'static [&'static str] {
        // The sentinel and its other spellings (the last variant, the sentinel and a
        // space, is found by the sentinel itself).
        &[
            D,
            VARIANTS[0],
            VARIANTS[1],
            VARIANTS[2],
            RESULTS_OPEN,
            RESULTS_CLOSE,
        ]
    }

    fn written_by(&self, template: &str) -> bool {
        template.contains(&format!("<{D}"))
    }

    fn starts(&self) -> &'static [&'static str] {
        &[
            "<｜DSML｜",
            "</｜DSML｜",
            "<|DSML|",
            "</|DSML|",
            "<‖DSML‖",
            "</‖DSML‖",
            "<｜｜DSML｜｜",
            "</｜｜DSML｜｜",
        ]
    }

    fn ends(&self) -> Vec<String> {
        let mut v = Vec::new();
        for s in [D, "｜DSML｜ ", "|DSML|", "‖DSML‖", "｜｜DSML｜｜"] {
            for w in ["function_calls>", "tool_calls>"] {
                v.push(format!("</{s}{w}"));
            }
        }
        v
    }

    fn normalize(&self, block: &str) -> String {
        let mut s = block.to_owned();
        for v in VARIANTS {
            s = s.replace(v, D);
        }
        s
    }

    fn opening(&self, block: &str) -> Option<Result<(), ParseError>> {
        let end = block.find('>')?;
        let tag = &block[..=end];
        if tag == format!("<{D}function_calls>") || tag == format!("<{D}tool_calls>") {
            return Some(Ok(()));
        }
        if tag.starts_with(&format!("<{D}invoke")) {
            return Some(Err(err(
                NAME,
                "bare_invoke",
                "an invoke outside a function_calls block",
            )));
        }
        Some(Err(err(
            NAME,
            "wrong_wrapper",
            format!("block opens with {tag:?}"),
        )))
    }

    fn closed_prefix(&self, block: &str) -> Option<String> {
        let wrapper = ["function_calls", "tool_calls"]
            .into_iter()
            .find(|w| block.starts_with(&format!("<{D}{w}>")))?;
        let call_end = format!("</{D}invoke>");
        let end = block.rfind(&call_end)? + call_end.len();
        Some(format!("{}\n</{D}{wrapper}>", &block[..end]))
    }

    fn parse(&self, block: &str) -> Result<Vec<Call>, ParseError> {
        parse(block)
    }

    fn grammar(&self, tools: &[&Tool], many: bool) -> Result<String, SchemaError> {
        let rep = if many { "+" } else { "" };
        let mut g = format!(
            "start: \"<{D}function_calls>\\n\" call{rep} \"</{D}function_calls>\"\ncall: {}\n",
            call_alternatives(tools)
        );
        for (i, t) in tools.iter().enumerate() {
            let open = lit(&format!("<{D}invoke name=\"{}\">\n", t.name));
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
                        "<{D}parameter name=\"{name}\" string=\"{is_string}\">"
                    )),
                    lit(&format!("</{D}parameter>\n")),
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
                lit(&format!("</{D}invoke>\n"))
            ));
        }
        Ok(g)
    }

    /// One `function_calls` block, an `invoke` per call and a `parameter` per argument: a
    /// string as itself with `string="true"`, any other value as JSON with
    /// `string="false"`. DeepSeek V3.2 prompts write an assistant turn's calls so too.
    fn write_calls(&self, calls: &[Call]) -> String {
        let invokes: Vec<String> = calls
            .iter()
            .map(|c| {
                let params: Vec<String> = c
                    .arguments
                    .iter()
                    .map(|(k, v)| {
                        let (text, is_string) = match v {
                            Value::String(s) => (s.clone(), true),
                            other => (other.to_string(), false),
                        };
                        format!("<{D}parameter name=\"{k}\" string=\"{is_string}\">{text}</{D}parameter>")
                    })
                    .collect();
                format!(
                    "<{D}invoke name=\"{}\">\n{}\n</{D}invoke>",
                    c.name,
                    params.join("\n")
                )
            })
            .collect();
        format!(
            "<{D}function_calls>\n{}\n</{D}function_calls>",
            invokes.join("\n")
        )
    }
}

/// The tools block of a DeepSeek V3.2 prompt: OpenAI tool definitions
/// (`{"type":"function","function":{…}}` or bare function objects), one JSON object per
/// line, after instructions in pdmesh's words that follow the model's structure.
pub fn tools_block(tools: &[Value]) -> Result<String, ChatError> {
    let mut lines = Vec::with_capacity(tools.len());
    for t in tools {
        let f = t.get("function").unwrap_or(t);
        if !f.get("name").is_some_and(Value::is_string) {
            return Err(ChatError::Template(format!(
                "a tool without a function name: {t}"
            )));
        }
        lines.push(f.to_string());
    }
    let d = D;
    Ok(format!(
        "## Tools\n\n\
         You can call the functions below. To call any, write a <{d}function_calls> block \
         at the end of your answer:\n\n\
         <{d}function_calls>\n\
         <{d}invoke name=\"$FUNCTION_NAME\">\n\
         <{d}parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</{d}parameter>\n\
         </{d}invoke>\n\
         </{d}function_calls>\n\n\
         Several calls go in one block, one invoke each. A parameter whose value is a \
         string is written as is with string=\"true\"; any other value (number, boolean, \
         array, object, null) is written as JSON with string=\"false\".\n\n\
         Here are the functions available in JSONSchema format:\n<functions>\n{}\n</functions>\n",
        lines.join("\n")
    ))
}

/// The tool results that answer a turn's calls, in order: one `function_results` block
/// (with the blank lines around it).
pub fn results_block<'a>(results: impl IntoIterator<Item = &'a str>) -> String {
    let mut out = format!("\n\n{RESULTS_OPEN}");
    for r in results {
        out.push_str("\n<result>");
        out.push_str(r);
        out.push_str("</result>");
    }
    out.push_str(&format!("\n{RESULTS_CLOSE}\n\n"));
    out
}

fn parse(block: &str) -> Result<Vec<Call>, ParseError> {
    let f = NAME;
    let mut c = Cursor::new(block, f);
    let wrapper = if c.eat(&format!("<{D}function_calls>")) {
        "function_calls"
    } else if c.eat(&format!("<{D}tool_calls>")) {
        "tool_calls"
    } else if c.rest().starts_with(&format!("<{D}invoke")) {
        return Err(err(
            f,
            "bare_invoke",
            "an invoke outside a function_calls block",
        ));
    } else {
        return Err(err(
            f,
            "wrong_wrapper",
            format!("block opens with {:?}", head(block)),
        ));
    };
    let close = format!("</{D}{wrapper}>");
    let mut calls = Vec::new();
    loop {
        c.skip_ws();
        if c.eat(&close) {
            break;
        }
        c.expect(&format!("<{D}invoke"), "malformed_tag")?;
        let name = c.attr("name")?.to_owned();
        c.expect(">", "malformed_tag")?;
        let mut args = Map::new();
        loop {
            c.skip_ws();
            if c.eat(&format!("</{D}invoke>")) {
                break;
            }
            c.expect(&format!("<{D}parameter"), "malformed_tag")?;
            let key = c.attr("name")?.to_owned();
            let is_string = match c.attr("string")? {
                "true" => true,
                "false" => false,
                other => {
                    return Err(err(
                        f,
                        "bad_string_attr",
                        format!("string=\"{other}\" on parameter {key:?}"),
                    ));
                }
            };
            c.expect(">", "malformed_tag")?;
            let raw = c.until(&format!("</{D}parameter>"), "unterminated_parameter")?;
            if raw.contains(D) {
                return Err(err(
                    f,
                    "malformed_tag",
                    format!("markup inside parameter {key:?}"),
                ));
            }
            let value = if is_string {
                Value::String(raw.to_owned())
            } else {
                serde_json::from_str(raw.trim()).map_err(|e| {
                    err(
                        f,
                        "bad_json",
                        format!("parameter {key:?} = {:?}: {e}", head(raw)),
                    )
                })?
            };
            if args.insert(key.clone(), value).is_some() {
                return Err(err(
                    f,
                    "duplicate_parameter",
                    format!("{key:?} twice in a call to {name:?}"),
                ));
            }
        }
        calls.push(Call {
            name,
            arguments: args,
        });
    }
    if calls.is_empty() {
        return Err(err(
            f,
            "empty_block",
            "a function_calls block without an invoke",
        ));
    }
    Ok(calls)
}

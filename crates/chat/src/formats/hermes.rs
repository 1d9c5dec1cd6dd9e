//! Hermes / Qwen tool calls: one JSON object with `name` and `arguments` per
//! `<tool_call>` block (arguments also as a JSON string, as some models send them).
//!
//! Templates that know nothing of tools (SmolLM2's plain ChatML loop over `role` and
//! `content`) get pdmesh's own rendering in this style, written into ordinary turns:
//!
//! - the tools block (one function's JSON per line inside `<tools></tools>`, and how to
//!   answer with a call) is appended to the first system message, or becomes a new
//!   system message at the start;
//! - an assistant turn's calls are appended to its content, one
//!   `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>` block each;
//! - tool results become a user turn, one `<tool_response>\n…\n</tool_response>` block
//!   per result (consecutive results share one turn).
//!
//! The wording is pdmesh's own. JSON is written as Python's `json.dumps` writes it
//! (`", "` and `": "` separators, non-ASCII as is), as Hugging Face templates' `tojson`
//! does, with object keys in the order they were given.

use serde_json::{Map, Value, json};

use super::{Cursor, Tool, ToolSyntax, call_alternatives, err, head, object, with_definitions};
use crate::schema::{SchemaError, json_rule};
use crate::{Call, ChatError, ChatMessage, ParseError, ToolCall};

/// The format's name.
pub const NAME: &str = "hermes";

const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const TOOLS_OPEN: &str = "<tools>";
const TOOLS_CLOSE: &str = "</tools>";
const RESPONSE_OPEN: &str = "<tool_response>";
const RESPONSE_CLOSE: &str = "</tool_response>";

/// Hermes / Qwen (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct Hermes;

impl ToolSyntax for Hermes {
    fn name(&self) -> &'static str {
        NAME
    }

    fn markers(&self) -> &'static [&'static str] {
        &[
            CALL_OPEN,
            CALL_CLOSE,
            TOOLS_OPEN,
            TOOLS_CLOSE,
            RESPONSE_OPEN,
            RESPONSE_CLOSE,
        ]
    }

    /// Any template: Qwen-style templates write these calls, and templates without tools
    /// get pdmesh's rendering in this style.
    fn written_by(&self, _template: &str) -> bool {
        true
    }

    fn starts(&self) -> &'static [&'static str] {
        &[CALL_OPEN, CALL_CLOSE]
    }

    fn ends(&self) -> Vec<String> {
        vec![CALL_CLOSE.to_owned()]
    }

    fn opening(&self, block: &str) -> Option<Result<(), ParseError>> {
        let end = block.find('>')?;
        let tag = &block[..=end];
        Some(if tag == CALL_OPEN {
            Ok(())
        } else {
            Err(err(
                NAME,
                "wrong_wrapper",
                format!("block opens with {tag:?}"),
            ))
        })
    }

    fn parse(&self, block: &str) -> Result<Vec<Call>, ParseError> {
        let f = NAME;
        let mut c = Cursor::new(block, f);
        if !c.eat(CALL_OPEN) {
            return Err(err(
                f,
                "wrong_wrapper",
                format!("block opens with {:?}", head(block)),
            ));
        }
        let body = c.until(CALL_CLOSE, "unterminated_call")?;
        let v: Value =
            serde_json::from_str(body.trim()).map_err(|e| err(f, "bad_json", e.to_string()))?;
        let name = v["name"]
            .as_str()
            .ok_or_else(|| err(f, "bad_json", "a tool call without a string \"name\""))?
            .to_owned();
        let arguments = match &v["arguments"] {
            Value::Object(m) => m.clone(),
            Value::Null => Map::new(),
            // Some models send the arguments as a JSON string.
            Value::String(s) => object(f, &name, s)?,
            other => {
                return Err(err(
                    f,
                    "bad_json",
                    format!("arguments of {name:?}: {other}"),
                ));
            }
        };
        Ok(vec![Call { name, arguments }])
    }

    fn grammar(&self, tools: &[&Tool], many: bool) -> Result<String, SchemaError> {
        let tail = if many { " (\"\\n\" call)*" } else { "" };
        let mut g = format!(
            "start: call{tail}\ncall: \"{CALL_OPEN}\\n\" ({}) \"\\n{CALL_CLOSE}\"\n",
            call_alternatives(tools)
        );
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
        Ok(g)
    }

    /// One block per call, a newline between them, each holding compact JSON (the
    /// grammar's spelling; prompts use [`tool_call_block`]'s Python spacing).
    fn write_calls(&self, calls: &[Call]) -> String {
        calls
            .iter()
            .map(|c| {
                let call = json!({"name": c.name, "arguments": Value::Object(c.arguments.clone())});
                format!("{CALL_OPEN}\n{call}\n{CALL_CLOSE}")
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Whether a conversation needs this rewriting: tools are offered or a turn made calls.
/// Without either, a template sees the conversation unchanged.
pub fn needed(messages: &[ChatMessage], tools: &[Value]) -> bool {
    !tools.is_empty() || messages.iter().any(|m| !m.tool_calls.is_empty())
}

/// The tools block for OpenAI tool definitions (`{"type": "function", "function": {…}}`
/// or bare function objects): each function's JSON on its own line.
pub fn tools_block(tools: &[Value]) -> Result<String, ChatError> {
    let mut lines = Vec::with_capacity(tools.len());
    for t in tools {
        let f = t.get("function").unwrap_or(t);
        if !f.get("name").is_some_and(Value::is_string) {
            return Err(ChatError::Template(format!(
                "a tool without a function name: {t}"
            )));
        }
        lines.push(py_json(f));
    }
    Ok(format!(
        "## Tools\n\n\
         You can call the functions below to help answer. Their definitions, one JSON \
         object per line, are inside <tools></tools>:\n\
         {TOOLS_OPEN}\n{}\n{TOOLS_CLOSE}\n\n\
         To call a function, end your answer with one block per call, each exactly in \
         this form:\n\
         <tool_call>\n\
         {{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n\
         </tool_call>\n\n\
         Each result comes back to you in a <tool_response></tool_response> block.",
        lines.join("\n")
    ))
}

/// One call as the model writes it: `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`.
pub fn tool_call_block(call: &ToolCall) -> String {
    format!(
        "<tool_call>\n{{\"name\": {}, \"arguments\": {}}}\n</tool_call>",
        py_json(&Value::String(call.name.clone())),
        py_json(&Value::Object(call.arguments.clone()))
    )
}

/// One tool result as the model reads it.
pub fn tool_response_block(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// `messages` with `tools`, tool calls and tool results written into plain turns (see
/// the module docs). The result has no tool calls and no `tool` turns.
pub fn rewrite(messages: &[ChatMessage], tools: &[Value]) -> Result<Vec<ChatMessage>, ChatError> {
    let block = if tools.is_empty() {
        None
    } else {
        Some(tools_block(tools)?)
    };
    let mut out = Vec::with_capacity(messages.len() + 1);
    let has_system = messages.first().is_some_and(|m| m.role == "system");
    if let (Some(b), false) = (&block, has_system) {
        out.push(ChatMessage::new("system", b.clone()));
    }
    let mut i = 0;
    while i < messages.len() {
        let m = &messages[i];
        if m.role == "tool" {
            let mut results = Vec::new();
            while i < messages.len() && messages[i].role == "tool" {
                results.push(tool_response_block(&messages[i].content));
                i += 1;
            }
            out.push(ChatMessage::new("user", results.join("\n")));
            continue;
        }
        let mut m = m.clone();
        if let (0, true, Some(b)) = (i, has_system, &block) {
            m.content = join_nonempty(&m.content, b, "\n\n");
        }
        if !m.tool_calls.is_empty() {
            let calls: Vec<String> = m.tool_calls.iter().map(tool_call_block).collect();
            m.content = join_nonempty(&m.content, &calls.join("\n"), "\n");
            m.tool_calls.clear();
        }
        out.push(m);
        i += 1;
    }
    Ok(out)
}

/// `a`, `sep`, `b`; just `b` when `a` is empty.
fn join_nonempty(a: &str, b: &str, sep: &str) -> String {
    if a.is_empty() {
        b.to_owned()
    } else {
        format!("{a}{sep}{b}")
    }
}

/// `json.dumps(v, ensure_ascii=False)`, as the templates' `tojson` writes it.
fn py_json(v: &Value) -> String {
    crate::pyjson::python_json(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(v: Value) -> serde_json::Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn json_is_written_like_python_json_dumps() {
        assert_eq!(
            py_json(&json!({"a": [1, 2.5, true, null], "b": {"c": "é<&>\n"}, "d": {}, "e": []})),
            "{\"a\": [1, 2.5, true, null], \"b\": {\"c\": \"é<&>\\n\"}, \"d\": {}, \"e\": []}"
        );
    }

    #[test]
    fn a_call_block_names_the_function_then_its_arguments() {
        let call = ToolCall::new("get_weather", args(json!({"units": "C", "city": "Paris"})));
        assert_eq!(
            tool_call_block(&call),
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"units\": \"C\", \"city\": \"Paris\"}}\n</tool_call>"
        );
    }

    #[test]
    fn tools_block_lists_one_function_per_line_and_needs_names() {
        let tools = [
            json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}),
            json!({"name": "g"}),
        ];
        let b = tools_block(&tools).unwrap();
        assert!(
            b.contains(
                "<tools>\n{\"name\": \"f\", \"parameters\": {\"type\": \"object\"}}\n{\"name\": \"g\"}\n</tools>"
            ),
            "{b}"
        );
        assert!(
            b.contains(
                "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
            ),
            "{b}"
        );
        let err = tools_block(&[json!({"type": "function"})]).unwrap_err();
        assert!(err.to_string().contains("without a function name"), "{err}");
    }

    #[test]
    fn rewrite_puts_tools_in_the_system_turn_calls_in_content_and_results_in_user_turns() {
        let tools = [json!({"type": "function", "function": {"name": "f"}})];
        let block = tools_block(&tools).unwrap();
        let call = ToolCall::new("f", args(json!({"x": 1}))).with_id("call_0");
        let msgs = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Go"),
            ChatMessage::new("assistant", "").with_tool_calls(vec![call.clone(), call]),
            ChatMessage::new("tool", "one").with_tool_call_id("call_0"),
            ChatMessage::new("tool", "two").with_tool_call_id("call_0"),
            ChatMessage::new("assistant", "Done."),
        ];
        let got = rewrite(&msgs, &tools).unwrap();
        let block_call = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        assert_eq!(
            got,
            [
                ChatMessage::new("system", format!("Be brief.\n\n{block}")),
                ChatMessage::new("user", "Go"),
                ChatMessage::new("assistant", format!("{block_call}\n{block_call}")),
                ChatMessage::new(
                    "user",
                    "<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>"
                ),
                ChatMessage::new("assistant", "Done."),
            ]
        );
        // No system turn: the tools block becomes one; content before a call stays first.
        let msgs = [
            ChatMessage::new("user", "Go"),
            ChatMessage::new("assistant", "Calling.")
                .with_tool_calls(vec![ToolCall::new("f", Default::default())]),
        ];
        let got = rewrite(&msgs, &tools).unwrap();
        assert_eq!(got[0], ChatMessage::new("system", block));
        assert_eq!(
            got[2].content,
            "Calling.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"
        );
        assert!(needed(&msgs, &[]) && needed(&msgs[..1], &tools));
        assert!(!needed(&msgs[..1], &[]));
    }
}

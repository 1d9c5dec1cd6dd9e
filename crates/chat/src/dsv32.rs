//! DeepSeek V3.2's chat encoding. The model ships no Jinja template: a conversation is
//! written by rules (facts in docs/deepseek-v32.md, section 8):
//!
//! - the prompt opens with BOS; a system message is written raw, followed by the tools
//!   block when tools are given;
//! - a user turn is `<｜User｜>…<｜Assistant｜>` followed by `<think>` (the last user turn,
//!   thinking mode) or `</think>`;
//! - an assistant turn is its reasoning and `</think>` (thinking mode, after the last user
//!   turn only), its content, its tool calls as a DSML `function_calls` block, then EOS;
//! - tool results follow the assistant's EOS in one `<function_results>` block per batch,
//!   then `<think>` or `</think>` opens the assistant's next turn.
//!
//! The tools block's wording is pdmesh's own; its structure (heading, call format, the
//! string/JSON parameter rule, one JSON schema per line inside `<functions>`) follows the
//! model's.

use serde_json::Value;

use crate::ChatError;

pub const BOS: &str = "<｜begin▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";
pub const USER: &str = "<｜User｜>";
pub const ASSISTANT: &str = "<｜Assistant｜>";
pub const THINK: &str = "<think>";
pub const END_THINK: &str = "</think>";
/// The DSML marker every tool-call tag carries.
pub const DSML: &str = "｜DSML｜";

/// One tool call in an assistant turn: the function and its arguments (a JSON object).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: serde_json::Map<String, Value>,
}

/// One turn of the conversation.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// Assistant turns: the reasoning before the answer.
    pub reasoning: Option<String>,
    /// Assistant turns: the calls it made.
    pub tool_calls: Vec<ToolCall>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Self::default()
        }
    }
}

impl From<&crate::ToolCall> for ToolCall {
    fn from(c: &crate::ToolCall) -> Self {
        Self {
            name: c.name.clone(),
            arguments: c.arguments.clone(),
        }
    }
}

impl From<&crate::ChatMessage> for Message {
    /// The turn with its reasoning and tool calls (call ids and `tool_call_id` have no
    /// place in this encoding).
    fn from(m: &crate::ChatMessage) -> Self {
        Self {
            role: m.role.clone(),
            content: m.content.clone(),
            reasoning: m.reasoning.clone(),
            tool_calls: m.tool_calls.iter().map(ToolCall::from).collect(),
        }
    }
}

/// Renders the tools block: OpenAI tool definitions (`{"type":"function","function":{…}}`
/// or bare function objects), one JSON object per line.
pub fn tools_block(tools: &[Value]) -> Result<String, ChatError> {
    let mut lines = Vec::with_capacity(tools.len());
    for t in tools {
        let f = t.get("function").unwrap_or(t);
        if !f.get("name").is_some_and(Value::is_string) {
            return Err(ChatError::Template(format!(
                "a tool without a function name: {t}"
            )));
        }
        lines.push(serde_json::to_string(f).map_err(|e| ChatError::Template(e.to_string()))?);
    }
    let d = DSML;
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

/// One `function_calls` block (with its leading blank line).
pub fn tool_calls_block(calls: &[ToolCall]) -> Result<String, ChatError> {
    let d = DSML;
    let mut invokes = Vec::with_capacity(calls.len());
    for c in calls {
        let mut params = Vec::with_capacity(c.arguments.len());
        for (k, v) in &c.arguments {
            let (text, is_string) = match v {
                Value::String(s) => (s.clone(), true),
                other => (
                    serde_json::to_string(other).map_err(|e| ChatError::Template(e.to_string()))?,
                    false,
                ),
            };
            params.push(format!(
                "<{d}parameter name=\"{k}\" string=\"{is_string}\">{text}</{d}parameter>"
            ));
        }
        invokes.push(format!(
            "<{d}invoke name=\"{}\">\n{}\n</{d}invoke>",
            c.name,
            params.join("\n")
        ));
    }
    Ok(format!(
        "\n\n<{d}function_calls>\n{}\n</{d}function_calls>",
        invokes.join("\n")
    ))
}

/// The prompt for `messages` (with `tools`, if any, after the system message; a system
/// message is added when there is none). `thinking`: the model reasons before answering.
/// The prompt always ends where the assistant's next turn begins.
pub fn encode(messages: &[Message], tools: &[Value], thinking: bool) -> Result<String, ChatError> {
    let last_user = messages
        .iter()
        .rposition(|m| m.role == "user" || m.role == "developer");
    let mut out = String::from(BOS);
    let has_system = messages.first().is_some_and(|m| m.role == "system");
    if !tools.is_empty() && !has_system {
        out.push_str(&tools_block(tools)?);
    }
    let open_next = |out: &mut String, i: usize| {
        let live = thinking && last_user.is_some_and(|u| i >= u);
        out.push_str(if live { THINK } else { END_THINK });
    };
    let mut i = 0;
    while i < messages.len() {
        let m = &messages[i];
        match m.role.as_str() {
            "system" => {
                out.push_str(&m.content);
                if i == 0 && !tools.is_empty() {
                    out.push_str("\n\n");
                    out.push_str(&tools_block(tools)?);
                }
            }
            "user" | "developer" => {
                out.push_str(USER);
                out.push_str(&m.content);
                out.push_str(ASSISTANT);
                open_next(&mut out, i);
            }
            "assistant" => {
                if thinking && last_user.is_some_and(|u| i > u) {
                    out.push_str(m.reasoning.as_deref().unwrap_or(""));
                    out.push_str(END_THINK);
                }
                out.push_str(&m.content);
                if !m.tool_calls.is_empty() {
                    out.push_str(&tool_calls_block(&m.tool_calls)?);
                }
                out.push_str(EOS);
            }
            "tool" => {
                out.push_str("\n\n<function_results>");
                while i < messages.len() && messages[i].role == "tool" {
                    out.push_str("\n<result>");
                    out.push_str(&messages[i].content);
                    out.push_str("</result>");
                    i += 1;
                }
                out.push_str("\n</function_results>\n\n");
                open_next(&mut out, i - 1);
                continue;
            }
            other => {
                return Err(ChatError::Template(format!(
                    "role {other:?} (DeepSeek V3.2 takes system, user, developer, assistant, tool)"
                )));
            }
        }
        i += 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chat_mode_turns_close_thinking_and_end_with_eos() {
        let msgs = [
            Message::new("system", "Be brief."),
            Message::new("user", "Hi"),
            Message::new("assistant", "Hello."),
            Message::new("user", "Bye"),
        ];
        assert_eq!(
            encode(&msgs, &[], false).unwrap(),
            "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello.\
             <｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜></think>"
        );
    }

    #[test]
    fn thinking_opens_only_at_the_last_user_turn_and_drops_old_reasoning() {
        let mut old = Message::new("assistant", "Paris.");
        old.reasoning = Some("It is Paris.".into());
        let msgs = [
            Message::new("user", "Capital of France?"),
            old,
            Message::new("user", "And Spain?"),
        ];
        assert_eq!(
            encode(&msgs, &[], true).unwrap(),
            "<｜begin▁of▁sentence｜><｜User｜>Capital of France?<｜Assistant｜></think>Paris.\
             <｜end▁of▁sentence｜><｜User｜>And Spain?<｜Assistant｜><think>"
        );
    }

    #[test]
    fn tool_calls_and_results_use_dsml_and_a_results_block() {
        let call = ToolCall {
            name: "get_weather".into(),
            arguments: json!({"city": "Paris", "days": 2, "units": null})
                .as_object()
                .unwrap()
                .clone(),
        };
        let mut a = Message::new("assistant", "Checking.");
        a.reasoning = Some("Need the weather.".into());
        a.tool_calls = vec![call];
        let msgs = [
            Message::new("user", "Weather?"),
            a,
            Message::new("tool", "{\"temp\": 21}"),
            Message::new("tool", "ok"),
        ];
        let got = encode(&msgs, &[], true).unwrap();
        assert_eq!(
            got,
            "<｜begin▁of▁sentence｜><｜User｜>Weather?<｜Assistant｜><think>Need the weather.</think>Checking.\n\n\
             <｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n\
             <｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n\
             <｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n\
             <｜DSML｜parameter name=\"units\" string=\"false\">null</｜DSML｜parameter>\n\
             </｜DSML｜invoke>\n</｜DSML｜function_calls><｜end▁of▁sentence｜>\n\n\
             <function_results>\n<result>{\"temp\": 21}</result>\n<result>ok</result>\n</function_results>\n\n<think>"
        );
    }

    #[test]
    fn tools_go_after_the_system_message_or_open_the_prompt() {
        let tools = [
            json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}),
        ];
        let with = encode(
            &[Message::new("system", "S"), Message::new("user", "U")],
            &tools,
            false,
        )
        .unwrap();
        assert!(
            with.starts_with("<｜begin▁of▁sentence｜>S\n\n## Tools\n"),
            "{with}"
        );
        assert!(with.contains("<functions>\n{\"name\":\"f\",\"parameters\":{\"type\":\"object\"}}\n</functions>\n<｜User｜>U"), "{with}");
        let without = encode(&[Message::new("user", "U")], &tools, false).unwrap();
        assert!(
            without.starts_with("<｜begin▁of▁sentence｜>## Tools\n"),
            "{without}"
        );
        let bad = encode(
            &[Message::new("user", "U")],
            &[json!({"type": "function"})],
            false,
        );
        assert!(bad.is_err());
        assert!(encode(&[Message::new("wizard", "x")], &[], false).is_err());
    }
}

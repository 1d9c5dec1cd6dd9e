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
//! The DSML parts (the tools block, the calls, the results) are the DSML format's to write
//! ([`crate::formats::dsml`]). The tools block's wording is pdmesh's own; its structure
//! (heading, call format, the string/JSON parameter rule, one JSON schema per line inside
//! `<functions>`) follows the model's.

use serde_json::Value;

use crate::formats::{ToolFormat, dsml};
use crate::{Call, ChatError};

pub const BOS: &str = "<｜begin▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";
pub const USER: &str = "<｜User｜>";
pub const ASSISTANT: &str = "<｜Assistant｜>";
pub const THINK: &str = "<think>";
pub const END_THINK: &str = "</think>";

/// One turn of the conversation.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// Assistant turns: the reasoning before the answer.
    pub reasoning: Option<String>,
    /// Assistant turns: the calls it made.
    pub tool_calls: Vec<Call>,
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

impl From<&crate::ChatMessage> for Message {
    /// The turn with its reasoning and tool calls (call ids and `tool_call_id` have no
    /// place in this encoding).
    fn from(m: &crate::ChatMessage) -> Self {
        Self {
            role: m.role.clone(),
            content: m.content.clone(),
            reasoning: m.reasoning.clone(),
            tool_calls: m.tool_calls.iter().map(Call::from).collect(),
        }
    }
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
        out.push_str(&dsml::tools_block(tools)?);
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
                    out.push_str(&dsml::tools_block(tools)?);
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
                    out.push_str("\n\n");
                    out.push_str(&ToolFormat::Dsml.syntax().write_calls(&m.tool_calls));
                }
                out.push_str(EOS);
            }
            "tool" => {
                let first = i;
                while i < messages.len() && messages[i].role == "tool" {
                    i += 1;
                }
                let results = messages[first..i].iter().map(|m| m.content.as_str());
                out.push_str(&dsml::results_block(results));
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
        let call = Call {
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

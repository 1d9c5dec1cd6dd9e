//! The conversation as clients send it and templates read it: chat turns and the tool
//! calls an assistant turn made, in OpenAI's shapes.

use serde::{Deserialize, Serialize};

/// One chat turn, as OpenAI's API and the templates see it. Serialized the way Hugging
/// Face templates read a message: `role`, `content`, then, only when present,
/// `tool_calls` (see [`ToolCall`]), `tool_call_id` and `reasoning_content`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// Assistant turns: the calls the assistant made, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// Tool turns: the id of the call this result answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Assistant turns: the reasoning before the answer.
    #[serde(
        default,
        rename = "reasoning_content",
        skip_serializing_if = "Option::is_none"
    )]
    pub reasoning: Option<String>,
}

impl ChatMessage {
    /// A plain turn: no tool calls, tool call id or reasoning.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            reasoning: None,
        }
    }

    /// This turn with `calls` as its tool calls.
    pub fn with_tool_calls(mut self, calls: Vec<ToolCall>) -> Self {
        self.tool_calls = calls;
        self
    }

    /// This turn answering the call `id`.
    pub fn with_tool_call_id(mut self, id: impl Into<String>) -> Self {
        self.tool_call_id = Some(id.into());
        self
    }

    /// This turn with `reasoning` before its content.
    pub fn with_reasoning(mut self, reasoning: impl Into<String>) -> Self {
        self.reasoning = Some(reasoning.into());
        self
    }
}

/// One tool call an assistant turn made. Serialized as OpenAI's shape with the arguments
/// as an object, which is what templates expect (`tool_call.function.arguments | tojson`):
/// `{"id": …, "type": "function", "function": {"name": …, "arguments": {…}}}` (no `id`
/// when it has none). Deserialized by [`ToolCall::from_openai`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "WireToolCall", try_from = "serde_json::Value")]
pub struct ToolCall {
    /// The call's id (OpenAI's `call_…`), if the client sent one.
    pub id: Option<String>,
    /// The function called; never empty.
    pub name: String,
    pub arguments: serde_json::Map<String, serde_json::Value>,
}

/// Why a JSON value is not an OpenAI tool call: `part` is the offending member's path
/// inside the call (`"function.arguments"`; empty for the call itself) and `problem`
/// what is wrong with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("tool call{sep}{part} {problem}", sep = if part.is_empty() { "" } else { " " })]
pub struct ToolCallError {
    pub part: &'static str,
    pub problem: &'static str,
}

impl ToolCall {
    /// A call of `name` with `arguments` and no id.
    pub fn new(
        name: impl Into<String>,
        arguments: serde_json::Map<String, serde_json::Value>,
    ) -> Self {
        Self {
            id: None,
            name: name.into(),
            arguments,
        }
    }

    /// This call with `id`.
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// One element of OpenAI's `tool_calls`: `{"id": …, "type": "function", "function":
    /// {"name": …, "arguments": …}}`. `id` (a string; empty or null is none) and `type`
    /// (`"function"`) may be left out; `name` must be a non-empty string; `arguments` a
    /// JSON object, or a string holding one (OpenAI's wire form).
    pub fn from_openai(value: serde_json::Value) -> Result<Self, ToolCallError> {
        use serde_json::Value;
        let err = |part, problem| ToolCallError { part, problem };
        let Value::Object(mut call) = value else {
            return Err(err("", "is not a JSON object"));
        };
        let id = match call.remove("id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s).filter(|s| !s.is_empty()),
            Some(_) => return Err(err("id", "is not a string")),
        };
        match call.get("type") {
            None | Some(Value::Null) => {}
            Some(t) if t == "function" => {}
            Some(_) => return Err(err("type", "is not \"function\"")),
        }
        let Some(Value::Object(mut function)) = call.remove("function") else {
            return Err(err("function", "is not a JSON object"));
        };
        let name = match function.remove("name") {
            Some(Value::String(s)) if !s.is_empty() => s,
            _ => return Err(err("function.name", "is not a non-empty string")),
        };
        let arguments = match function.remove("arguments") {
            Some(Value::Object(m)) => Some(m),
            Some(Value::String(s)) => match serde_json::from_str(&s) {
                Ok(Value::Object(m)) => Some(m),
                _ => None,
            },
            _ => None,
        };
        let arguments =
            arguments.ok_or_else(|| err("function.arguments", "is not a JSON object"))?;
        Ok(Self {
            id,
            name,
            arguments,
        })
    }
}

impl TryFrom<serde_json::Value> for ToolCall {
    type Error = ToolCallError;

    fn try_from(value: serde_json::Value) -> Result<Self, ToolCallError> {
        Self::from_openai(value)
    }
}

/// [`ToolCall`] as templates read it: OpenAI's nesting under `function`.
#[derive(Serialize)]
struct WireToolCall {
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    #[serde(rename = "type")]
    kind: &'static str,
    function: WireFunction,
}

#[derive(Serialize)]
struct WireFunction {
    name: String,
    arguments: serde_json::Value,
}

impl From<ToolCall> for WireToolCall {
    fn from(c: ToolCall) -> Self {
        Self {
            id: c.id,
            kind: "function",
            function: WireFunction {
                name: c.name,
                arguments: serde_json::Value::Object(c.arguments),
            },
        }
    }
}

/// The tool definitions in a request's `tools`: the items of a JSON array, a single
/// definition given alone, nothing for `None` or `null`.
pub fn tool_list(tools: Option<&serde_json::Value>) -> &[serde_json::Value] {
    use serde_json::Value;
    match tools {
        None | Some(Value::Null) => &[],
        Some(Value::Array(a)) => a,
        Some(one) => std::slice::from_ref(one),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paris_call() -> ToolCall {
        let args = serde_json::json!({"city": "Paris"});
        ToolCall::new("get_weather", args.as_object().unwrap().clone()).with_id("call_0")
    }

    #[test]
    fn messages_serialize_as_templates_expect_and_read_openai_arguments() {
        let m = ChatMessage::new("assistant", "x")
            .with_tool_calls(vec![paris_call()])
            .with_reasoning("r");
        assert_eq!(
            serde_json::to_value(&m).unwrap(),
            serde_json::json!({
                "role": "assistant",
                "content": "x",
                "tool_calls": [{"id": "call_0", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
                "reasoning_content": "r",
            })
        );
        assert_eq!(
            serde_json::to_value(ChatMessage::new("tool", "y").with_tool_call_id("c")).unwrap(),
            serde_json::json!({"role": "tool", "content": "y", "tool_call_id": "c"})
        );
        let back: ChatMessage = serde_json::from_value(serde_json::json!({
            "role": "assistant", "content": "x", "reasoning_content": "r",
            "tool_calls": [{"id": "call_0", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}],
        }))
        .unwrap();
        assert_eq!(back, m);
        let plain: ChatMessage =
            serde_json::from_value(serde_json::json!({"role": "user", "content": "hi"})).unwrap();
        assert_eq!(plain, ChatMessage::new("user", "hi"));
        let bad = serde_json::from_value::<ChatMessage>(serde_json::json!({
            "role": "assistant", "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
        }));
        assert!(bad.unwrap_err().to_string().contains("not a JSON object"));
    }

    #[test]
    fn openai_tool_calls_are_checked_part_by_part() {
        use serde_json::json;
        let call = |v| ToolCall::from_openai(v).map_err(|e| (e.part, e.to_string()));
        assert_eq!(
            call(json!({"function": {"name": "f", "arguments": "{}"}})),
            Ok(ToolCall::new("f", Default::default()))
        );
        assert_eq!(
            call(json!({"id": "", "type": "function", "function": {"name": "f", "arguments": {}}})),
            Ok(ToolCall::new("f", Default::default()))
        );
        assert_eq!(
            call(json!([])),
            Err(("", "tool call is not a JSON object".into()))
        );
        assert_eq!(
            call(json!({"id": 7, "function": {"name": "f", "arguments": {}}})),
            Err(("id", "tool call id is not a string".into()))
        );
        assert_eq!(
            call(json!({"type": "custom", "function": {"name": "f", "arguments": {}}})),
            Err(("type", "tool call type is not \"function\"".into()))
        );
        assert_eq!(
            call(json!({"name": "f"})),
            Err(("function", "tool call function is not a JSON object".into()))
        );
        assert_eq!(
            call(json!({"function": {"name": "", "arguments": {}}})),
            Err((
                "function.name",
                "tool call function.name is not a non-empty string".into()
            ))
        );
        for bad in [json!("[1]"), json!("{"), json!(3), json!(null)] {
            assert_eq!(
                call(json!({"function": {"name": "f", "arguments": bad}})),
                Err((
                    "function.arguments",
                    "tool call function.arguments is not a JSON object".into()
                ))
            );
        }
        let missing = call(json!({"function": {"name": "f"}}));
        assert_eq!(missing.unwrap_err().0, "function.arguments");
    }

    #[test]
    fn tool_list_takes_arrays_single_tools_and_nothing() {
        let one = serde_json::json!({"name": "f"});
        let list = serde_json::json!([{"name": "f"}]);
        assert_eq!(tool_list(Some(&list)), std::slice::from_ref(&one));
        assert_eq!(tool_list(Some(&one)), std::slice::from_ref(&one));
        assert!(tool_list(None).is_empty());
        assert!(tool_list(Some(&serde_json::Value::Null)).is_empty());
    }
}

//! The model's chat template (`tokenizer.chat_template`, Jinja) rendered with minijinja
//! under the settings Hugging Face transformers and llama.cpp use, so a conversation
//! becomes exactly the prompt the model was trained on.

use minijinja::{Environment, Error, ErrorKind, Value};

use crate::formats::hermes;
use crate::pyjson::tojson;
use crate::{ChatError, ChatMessage, ToolFormat, tool_list};

const NAME: &str = "chat_template";

/// A compiled chat template. Cheap to clone.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    /// The source mentions `tools`: it renders tools and tool calls itself.
    renders_tools: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the texts the template sees under
    /// those names. A syntax error is reported here, not at render time.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        // transformers' ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string())
            .map_err(ChatError::template)?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            renders_tools: source.contains("tools"),
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Every text the template can write of its own: its source and the BOS and EOS
    /// texts it is given.
    pub(crate) fn own_texts(&self) -> [&str; 3] {
        [&self.source, &self.bos_token, &self.eos_token]
    }

    /// Whether the template renders tools and tool calls itself (its source mentions
    /// `tools`). If not, [`Self::render`] writes them in the Hermes style
    /// ([`crate::formats::hermes`]).
    pub fn renders_tools(&self) -> bool {
        self.renders_tools
    }

    /// The tool-call markup the model is asked to write ([`ToolFormat::from_template`]).
    pub fn tool_format(&self) -> ToolFormat {
        ToolFormat::from_template(&self.source)
    }

    /// Whether the model reasons in `<think>…</think>` tags (the template mentions
    /// `<think>`).
    pub fn reasoning(&self) -> bool {
        self.source.contains("<think>")
    }

    /// Renders `messages` (and `tools`, a JSON list of tool definitions, when given) into
    /// a prompt; `add_generation_prompt` appends the header that opens the assistant's turn.
    ///
    /// A template that [renders tools](Self::renders_tools) gets the messages as they are
    /// (with `tool_calls`, `tool_call_id`, `reasoning_content`) and `tools`. Any other
    /// gets them rewritten by [`hermes::rewrite`] when tools are offered or a turn made
    /// calls; otherwise, unchanged.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let rewritten;
        let offered = tool_list(tools);
        let messages = if !self.renders_tools && hermes::needed(messages, offered) {
            rewritten = hermes::rewrite(messages, offered)?;
            &rewritten[..]
        } else {
            messages
        };
        let tmpl = self.env.get_template(NAME).map_err(ChatError::template)?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            tools => tools.map(Value::from_serialize).unwrap_or(Value::from(())),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        tmpl.render(ctx).map_err(ChatError::template)
    }
}

/// `raise_exception(msg)`: how HF templates reject a conversation they cannot format.
fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ToolCall;

    fn render_expr(expr: &str, value: serde_json::Value) -> String {
        let t = ChatTemplate::new(&format!("{{{{ {expr} }}}}"), "", "").unwrap();
        let tmpl = t.env.get_template(NAME).unwrap();
        tmpl.render(minijinja::context! { x => Value::from_serialize(&value) })
            .unwrap()
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let v = serde_json::json!({"name": "get_weather", "args": [1, 2.5, true, null, "<a&b>'é"]});
        // json.dumps(v, ensure_ascii=False) with keys in the order serde_json yields them.
        let keys_in_order: Vec<&String> = v.as_object().unwrap().keys().collect();
        let expected = if keys_in_order[0] == "name" {
            r#"{"name": "get_weather", "args": [1, 2.5, true, null, "<a&b>'é"]}"#
        } else {
            r#"{"args": [1, 2.5, true, null, "<a&b>'é"], "name": "get_weather"}"#
        };
        assert_eq!(render_expr("x | tojson", v.clone()), expected);
        assert_eq!(
            render_expr("x | tojson(indent=2, sort_keys=true)", v),
            "{\n  \"args\": [\n    1,\n    2.5,\n    true,\n    null,\n    \"<a&b>'é\"\n  ],\n  \"name\": \"get_weather\"\n}"
        );
        assert_eq!(render_expr("x | tojson", serde_json::json!([])), "[]");
        assert_eq!(render_expr("x | tojson", serde_json::json!(1.0)), "1.0");
    }

    #[test]
    fn python_string_methods_work() {
        let t = ChatTemplate::new("{{ messages[0]['content'].strip().upper() }}", "", "").unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "  hi  ")], None, false)
                .unwrap(),
            "HI"
        );
    }

    /// A plain ChatML loop over role and content, like SmolLM2-135M-Instruct's (which
    /// knows nothing of tools).
    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nDefault.<|im_end|>\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn weather_tools() -> serde_json::Value {
        serde_json::json!([{"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}
        }}])
    }

    fn paris_call() -> ToolCall {
        let args = serde_json::json!({"city": "Paris"});
        ToolCall::new("get_weather", args.as_object().unwrap().clone()).with_id("call_0")
    }

    #[test]
    fn a_template_without_tools_renders_the_same_prompt_when_none_are_used() {
        let t = ChatTemplate::new(CHATML, "", "").unwrap();
        assert!(!t.renders_tools());
        let conv = [
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello.").with_reasoning("Greet back."),
            ChatMessage::new("user", "Bye"),
        ];
        let want = "<|im_start|>system\nDefault.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
                    <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n\
                    <|im_start|>assistant\n";
        assert_eq!(t.render(&conv, None, true).unwrap(), want);
        let empty = serde_json::json!([]);
        assert_eq!(t.render(&conv, Some(&empty), true).unwrap(), want);
    }

    #[test]
    fn a_template_without_tools_gets_pdmesh_tools_block_calls_and_results() {
        let t = ChatTemplate::new(CHATML, "", "").unwrap();
        let tools = weather_tools();
        let block = crate::formats::hermes::tools_block(tools.as_array().unwrap()).unwrap();
        assert!(
            block.contains("<tools>\n{\"name\": \"get_weather\", \"description\": \"Weather in a city\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}\n</tools>"),
            "{block}"
        );

        // One user turn and the tools: a system turn carrying the tools block opens the
        // conversation (so the template's default system prompt is not added).
        let got = t
            .render(
                &[ChatMessage::new("user", "Weather in Paris?")],
                Some(&tools),
                true,
            )
            .unwrap();
        assert_eq!(
            got,
            format!(
                "<|im_start|>system\n{block}<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
            )
        );

        // A whole tool round trip after a system message.
        let conv = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Weather in Paris?"),
            ChatMessage::new("assistant", "").with_tool_calls(vec![paris_call()]),
            ChatMessage::new("tool", "{\"temp\": 21}").with_tool_call_id("call_0"),
        ];
        let got = t.render(&conv, Some(&tools), true).unwrap();
        assert_eq!(
            got,
            format!(
                "<|im_start|>system\nBe brief.\n\n{block}<|im_end|>\n\
                 <|im_start|>user\nWeather in Paris?<|im_end|>\n\
                 <|im_start|>assistant\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}}}\n</tool_call><|im_end|>\n\
                 <|im_start|>user\n<tool_response>\n{{\"temp\": 21}}\n</tool_response><|im_end|>\n\
                 <|im_start|>assistant\n"
            )
        );

        // Calls in the history without tools on offer: still written as <tool_call>.
        let got = t.render(&conv[1..], None, false).unwrap();
        assert!(
            got.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\""),
            "{got}"
        );
        assert!(!got.contains("<tools>"), "{got}");
    }

    #[test]
    fn a_template_that_mentions_tools_reads_calls_ids_and_reasoning_from_messages() {
        let src = "{% for m in messages %}{{ m.role }}:{{ m.content }}\
                   {% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.id }} {{ c.type }} {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}{% endif %}\
                   {% if m.tool_call_id is defined %}<{{ m.tool_call_id }}>{% endif %}\
                   {% if m.reasoning_content is defined %}({{ m.reasoning_content }}){% endif %}{{ '\n' }}{% endfor %}\
                   {% if tools %}tools={{ tools | length }} first={{ tools[0].function.name }}{% endif %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        assert!(t.renders_tools());
        let conv = [
            ChatMessage::new("user", "Weather?"),
            ChatMessage::new("assistant", "")
                .with_tool_calls(vec![paris_call()])
                .with_reasoning("Look it up."),
            ChatMessage::new("tool", "sunny").with_tool_call_id("call_0"),
        ];
        assert_eq!(
            t.render(&conv, Some(&weather_tools()), false).unwrap(),
            "user:Weather?\n\
             assistant:[call_0 function get_weather {\"city\": \"Paris\"}](Look it up.)\n\
             tool:sunny<call_0>\n\
             tools=1 first=get_weather"
        );
    }

    #[test]
    fn tool_format_and_reasoning_come_from_the_template_source() {
        let detect = |src: &str| {
            let t = ChatTemplate::new(src, "", "").unwrap();
            (t.tool_format(), t.reasoning())
        };
        assert_eq!(detect(CHATML), (ToolFormat::Hermes, false));
        assert_eq!(
            detect("{% if tools %}<tool_call>{% endif %}<think>{{ messages[0].content }}"),
            (ToolFormat::Hermes, true)
        );
        assert_eq!(
            detect("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ name }}"),
            (ToolFormat::DeepSeekV3, false)
        );
        assert_eq!(
            detect(
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ name }}<｜tool▁sep｜>{{ args }}<think>"
            ),
            (ToolFormat::DeepSeekV31, true)
        );
        assert_eq!(
            detect("<｜DSML｜function_calls>"),
            (ToolFormat::Dsml, false)
        );
    }

    #[test]
    fn syntax_error_is_reported_at_compile_time() {
        let err = ChatTemplate::new("{% for m in messages %}", "", "").unwrap_err();
        assert!(matches!(err, ChatError::Template(_)), "{err:?}");
        assert!(err.to_string().contains("chat template"), "{err}");
    }
}

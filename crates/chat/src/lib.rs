//! pdmesh-chat: everything between a conversation and the text a model writes. On the way
//! in, chat messages and tool calls in OpenAI's shapes ([`ChatMessage`], [`ToolCall`]),
//! the model's chat format ([`ChatTokenizer`]: its Jinja [`ChatTemplate`], or DeepSeek
//! V3.2's rules in [`dsv32`], with pdmesh's own Hermes-style tool rendering for templates
//! without tools), and prompts whose control tokens come only from that format's markup
//! ([`ChatPrompt`]). On the way out, streaming parsers for what a model writes, and the
//! strict JSON-schema grammars ([`schema`]) that constrain it. Each tool-call format is
//! one module of [`formats`] behind [`ToolSyntax`]: its markup, parser hooks, grammar and
//! rendering.
//!
//! Text arrives in chunks split anywhere — inside a tag, inside a multi-byte character —
//! and leaves as deltas: content, reasoning, tool calls (name first, then the arguments'
//! JSON), or a parse error. Every parser is a state machine that holds back any tail that
//! could still become markup, so no byte of markup is ever emitted as content, and
//! **fails closed**: a malformed block becomes a [`ParseError`] with a reason, never
//! content. A call is emitted only once its markup is complete, so a generation cut off
//! by its length limit ([`OutputParser::finish_truncated`]) keeps its complete calls and
//! drops the unfinished one whole: no client ever holds the arguments of a call that
//! never ended.

#![forbid(unsafe_code)]

mod chat_format;
pub mod dsv32;
pub mod formats;
mod message;
mod prompt;
mod pyjson;
mod reasoning;
pub mod schema;
mod stream;
mod template;
mod tools;
mod utf8;

pub use chat_format::{ChatFormat, ChatTokenizer};
pub use formats::{Tool, ToolFormat, ToolSyntax};
pub use message::{ChatMessage, ToolCall, ToolCallError, tool_list};
pub use prompt::ChatPrompt;
pub use reasoning::ReasoningParser;
pub use stream::TextStream;
pub use template::ChatTemplate;
pub use tools::ToolParser;

use pdmesh_tokenize::TokenizerError;

/// Everything that can go wrong turning a conversation into a prompt, or loading the
/// chat format that does it.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("chat template: {0}")]
    Template(String),
    #[error("this model has no chat template")]
    NoChatFormat,
}

impl ChatError {
    /// A minijinja error with its cause chain; its Display already names the template
    /// line and, for `raise_exception`, carries the template author's message.
    fn template(e: minijinja::Error) -> Self {
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            msg.push_str(": ");
            msg.push_str(&s.to_string());
            src = s.source();
        }
        Self::Template(msg)
    }
}

/// One piece of parsed output.
#[derive(Clone, Debug, PartialEq)]
pub enum Delta {
    /// Text for the assistant message's `content`.
    Content(String),
    /// Text for `reasoning_content`.
    Reasoning(String),
    /// A tool call's name (first delta of call `index`, with its id) or a fragment of its
    /// arguments' JSON (the fragments of one call concatenate to a JSON object).
    ToolCall {
        index: usize,
        id: Option<String>,
        name: Option<String>,
        arguments: String,
    },
    /// The output's markup could not be parsed; what it held is dropped.
    Error(ParseError),
}

/// Why markup failed to parse: `reason` is a short fixed label (for metrics), `detail`
/// says what was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    pub parser: &'static str,
    pub reason: &'static str,
    pub detail: String,
}

/// Every [`ParseError::parser`] (a closed set, for metric labels): each format's name,
/// in [`ToolFormat::ALL`]'s order.
pub const PARSERS: [&str; 4] = [
    formats::dsml::NAME,
    formats::deepseek_v3::NAME,
    formats::deepseek_v31::NAME,
    formats::hermes::NAME,
];

/// Every [`ParseError::reason`] (a closed set, for metric labels).
pub const FAILURE_REASONS: [&str; 12] = [
    "unterminated",
    "unterminated_call",
    "unterminated_parameter",
    "bare_invoke",
    "wrong_wrapper",
    "bad_json",
    "duplicate_parameter",
    "bad_string_attr",
    "empty_block",
    "malformed_tag",
    "unknown_tool",
    "trailing_text",
];

/// A whole tool call, as a block parser returns it.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub name: String,
    /// A JSON object.
    pub arguments: serde_json::Map<String, serde_json::Value>,
}

impl From<&ToolCall> for Call {
    fn from(c: &ToolCall) -> Self {
        Call {
            name: c.name.clone(),
            arguments: c.arguments.clone(),
        }
    }
}

/// Reasoning first (when the model has a thinking mode), then tool calls in what is left:
/// the pipeline the tokenizer service runs over a generation's text.
pub struct OutputParser {
    reasoning: Option<ReasoningParser>,
    tools: Option<ToolParser>,
    /// With neither parser: plain text, characters reassembled across chunks.
    utf8: utf8::Utf8Assembler,
}

impl OutputParser {
    pub fn new(reasoning: Option<ReasoningParser>, tools: Option<ToolParser>) -> Self {
        Self {
            reasoning,
            tools,
            utf8: utf8::Utf8Assembler::default(),
        }
    }

    /// The parser a generation asks for: tool calls in `format` (restricted to
    /// `tool_names` unless empty; ids start with `call_id_prefix`) and `<think>` reasoning
    /// (`thinking`: the prompt opened the block); none when it asks for neither.
    pub fn for_output(
        format: Option<ToolFormat>,
        reasoning: bool,
        thinking: bool,
        tool_names: &[String],
        call_id_prefix: &str,
    ) -> Option<Self> {
        if format.is_none() && !reasoning {
            return None;
        }
        let allowed = (!tool_names.is_empty()).then(|| tool_names.to_vec());
        Some(Self::new(
            reasoning.then(|| ReasoningParser::new(thinking)),
            format.map(|f| ToolParser::new(f, allowed, call_id_prefix)),
        ))
    }

    /// Parses one chunk of bytes.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Delta> {
        let first = match (&mut self.reasoning, &mut self.tools) {
            (Some(r), _) => r.push(chunk),
            // The tool parser reassembles characters split across chunks itself.
            (None, Some(t)) => return t.push(chunk),
            (None, None) => {
                let text = self.utf8.push(chunk);
                (!text.is_empty())
                    .then_some(Delta::Content(text))
                    .into_iter()
                    .collect()
            }
        };
        self.route(first, None)
    }

    /// The end of a generation the model ended itself: whatever was held back, and an
    /// error for unfinished markup.
    pub fn finish(&mut self) -> Vec<Delta> {
        self.end(false)
    }

    /// The end of a generation cut off by its length limit: whatever was held back, the
    /// calls completed so far, and no trace of the markup left unfinished (see
    /// [`ToolParser::finish_truncated`]).
    pub fn finish_truncated(&mut self) -> Vec<Delta> {
        self.end(true)
    }

    fn end(&mut self, cut: bool) -> Vec<Delta> {
        let first = match &mut self.reasoning {
            Some(r) => r.finish(),
            None => {
                let rest = self.utf8.finish();
                (!rest.is_empty())
                    .then_some(Delta::Content(rest))
                    .into_iter()
                    .collect()
            }
        };
        self.route(first, Some(cut))
    }

    /// `end`: the generation ended here (`Some(cut)`).
    fn route(&mut self, deltas: Vec<Delta>, end: Option<bool>) -> Vec<Delta> {
        let Some(tools) = &mut self.tools else {
            return deltas;
        };
        let mut out = Vec::new();
        for d in deltas {
            match d {
                Delta::Content(t) => out.extend(tools.push_str(&t)),
                other => out.push(other),
            }
        }
        match end {
            Some(false) => out.extend(tools.finish()),
            Some(true) => out.extend(tools.finish_truncated()),
            None => {}
        }
        out
    }
}

/// Merges adjacent deltas of the same kind (content with content, fragments of one call).
pub fn coalesce(deltas: impl IntoIterator<Item = Delta>) -> Vec<Delta> {
    let mut out: Vec<Delta> = Vec::new();
    for d in deltas {
        match (out.last_mut(), d) {
            (Some(Delta::Content(a)), Delta::Content(b)) => a.push_str(&b),
            (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) => a.push_str(&b),
            (_, Delta::Content(b)) if b.is_empty() => {}
            (_, Delta::Reasoning(b)) if b.is_empty() => {}
            (_, d) => out.push(d),
        }
    }
    out
}

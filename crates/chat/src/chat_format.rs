//! A model's chat format, read from the files beside its vocabulary: the Jinja template
//! (a GGUF's `tokenizer.chat_template`, or `chat_template` in an HF directory's
//! `tokenizer_config.json`), else DeepSeek V3.2's encoding rules for a `deepseek_v32`
//! checkpoint that ships none; or a template the operator gives in their place
//! ([`ChatTokenizer::with_chat_template`]). [`ChatTokenizer`] pairs it with the tokenizer:
//! together they turn a conversation into prompt ids.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use pdmesh_gguf::GgufFile;
use pdmesh_tokenize::{TextTokenizer, TokenizerError};

use crate::prompt::{self, ChatPrompt, Literal};
use crate::{ChatError, ChatMessage, ChatTemplate, ToolFormat};

/// How a conversation becomes a prompt for this model.
#[derive(Clone, Copy, Debug)]
pub enum ChatFormat<'a> {
    /// The tokenizer's Jinja chat template.
    Template(&'a ChatTemplate),
    /// DeepSeek V3.2's rules ([`crate::dsv32::encode`]).
    DeepSeekV32,
    /// Neither: chat requests cannot be served.
    None,
}

impl ChatFormat<'_> {
    /// The tool-call markup this format asks the model to write: DSML for DeepSeek V3.2,
    /// [`ChatTemplate::tool_format`] for a template, `None` without a chat format.
    pub fn tool_format(&self) -> Option<ToolFormat> {
        match self {
            Self::Template(t) => Some(t.tool_format()),
            Self::DeepSeekV32 => Some(ToolFormat::Dsml),
            Self::None => None,
        }
    }

    /// Whether the model reasons in `<think>…</think>` tags: always for DeepSeek V3.2,
    /// [`ChatTemplate::reasoning`] for a template, never without a chat format.
    pub fn reasoning(&self) -> bool {
        match self {
            Self::Template(t) => t.reasoning(),
            Self::DeepSeekV32 => true,
            Self::None => false,
        }
    }
}

/// A model's tokenizer with its chat format. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct ChatTokenizer {
    tok: TextTokenizer,
    template: Option<Arc<ChatTemplate>>,
    /// DeepSeek V3.2's encoding rules instead of a template ([`crate::dsv32`]).
    deepseek_v32: bool,
    /// The plain-text tokenizer chat prompts use for request text, made on first need.
    literal: Arc<OnceLock<Literal>>,
}

impl std::fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTokenizer")
            .field("tokenizer", &self.tok)
            .field("chat_template", &self.template.is_some())
            .field("deepseek_v32", &self.deepseek_v32)
            .finish()
    }
}

impl ChatTokenizer {
    /// The tokenizer and chat format of the model at `path`: a GGUF file, or a directory
    /// holding an HF checkpoint's `tokenizer.json` and `tokenizer_config.json`.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self, ChatError> {
        let path = path.as_ref();
        if path.is_dir() {
            return Self::from_hf_dir(path);
        }
        let gguf = GgufFile::open(path).map_err(TokenizerError::from)?;
        Self::from_gguf(&gguf)
    }

    /// The GGUF's tokenizer ([`TextTokenizer::from_gguf`]) and its
    /// `tokenizer.chat_template`, if it has one.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, ChatError> {
        let tok = TextTokenizer::from_gguf(gguf)?;
        let template = match gguf.get("tokenizer.chat_template") {
            None => None,
            Some(v) => Some(v.as_str().ok_or_else(|| {
                TokenizerError::Metadata("tokenizer.chat_template is not a string".into())
            })?),
        };
        Self::new(tok, template, false)
    }

    /// An HF directory's tokenizer ([`TextTokenizer::from_hf_dir`]) and the
    /// `chat_template` of its `tokenizer_config.json`; without one, DeepSeek V3.2's rules
    /// when `config.json` names a `deepseek_v32` model.
    pub fn from_hf_dir(dir: &Path) -> Result<Self, ChatError> {
        let tok = TextTokenizer::from_hf_dir(dir)?;
        let meta =
            |e: &dyn std::fmt::Display| TokenizerError::Metadata(format!("{}: {e}", dir.display()));
        let config: serde_json::Value =
            match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
                Ok(t) => serde_json::from_str(&t).map_err(|e| meta(&e))?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
                Err(e) => return Err(meta(&e).into()),
            };
        // A DeepSeek V3.2 checkpoint ships no template: its prompts follow rules.
        let deepseek_v32 = config["chat_template"].is_null() && is_deepseek_v32(dir);
        Self::new(tok, config["chat_template"].as_str(), deepseek_v32)
    }

    /// `tok` with `template` (Jinja source, compiled here: a syntax error is reported now,
    /// not at render time) as its chat format, else DeepSeek V3.2's rules if
    /// `deepseek_v32`, else none.
    pub fn new(
        tok: TextTokenizer,
        template: Option<&str>,
        deepseek_v32: bool,
    ) -> Result<Self, ChatError> {
        let template = match template {
            None => None,
            Some(src) => Some(Arc::new(compile(&tok, src)?)),
        };
        Ok(Self {
            tok,
            deepseek_v32: deepseek_v32 && template.is_none(),
            template,
            literal: Arc::default(),
        })
    }

    /// This tokenizer with `source` (Jinja) as its chat template, in place of the one its
    /// files carry, or where they carry none (a base model's GGUF): what an operator's
    /// `--chat-template` gives. The template sees the model's BOS and EOS texts as
    /// `bos_token` and `eos_token` and its prompt is tokenized as a GGUF's own template's
    /// is, so a template that starts with `{{ bos_token }}` opens the prompt with BOS. It
    /// replaces DeepSeek V3.2's rules too. A syntax error is reported here, not at render
    /// time.
    pub fn with_chat_template(mut self, source: &str) -> Result<Self, ChatError> {
        self.template = Some(Arc::new(compile(&self.tok, source)?));
        self.deepseek_v32 = false;
        Ok(self)
    }

    /// The tokenizer alone.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tok
    }

    /// How chat requests become prompts: the template, else DeepSeek V3.2's rules for a
    /// `deepseek_v32` checkpoint without one.
    pub fn chat_format(&self) -> ChatFormat<'_> {
        match (&self.template, self.deepseek_v32) {
            (Some(t), _) => ChatFormat::Template(t),
            (None, true) => ChatFormat::DeepSeekV32,
            (None, false) => ChatFormat::None,
        }
    }

    /// The chat template: the one given in place of the model's, else the model's own if
    /// its files have one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.template.as_deref()
    }

    /// The prompt for a conversation in this model's [chat format](Self::chat_format),
    /// with `tools` (a JSON list of tool definitions) when given. Only the format's own
    /// markup becomes control tokens: every string from the request is tokenized as
    /// text, so a message holding `<|im_end|>` cannot end its turn.
    /// `add_generation_prompt` appends the header that opens the assistant's turn
    /// (DeepSeek V3.2's prompt always ends there); `thinking` opens DeepSeek V3.2's
    /// reasoning.
    pub fn chat_prompt(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        thinking: bool,
    ) -> Result<ChatPrompt, ChatError> {
        prompt::chat_prompt(self, messages, tools, add_generation_prompt, thinking)
    }

    /// What [`Self::chat_prompt`] needs beyond the tokenizer, made on its first call.
    pub(crate) fn literal(&self) -> Result<&Literal, ChatError> {
        if let Some(l) = self.literal.get() {
            return Ok(l);
        }
        let made = Literal::new(self.tok.inner())?;
        Ok(self.literal.get_or_init(|| made))
    }

    /// Writes the tokenizer as an HF directory ([`Self::from_hf_dir`] reads it back), with
    /// its chat template or without (a model whose prompts follow other rules).
    pub fn write_hf_dir(&self, dir: &Path, with_template: bool) -> Result<(), ChatError> {
        let mut extra = serde_json::Map::new();
        if let Some(t) = self.template.as_ref().filter(|_| with_template) {
            extra.insert("chat_template".into(), t.source().into());
        }
        Ok(self.tok.write_hf_dir_with(dir, extra)?)
    }
}

/// `source` compiled as `tok`'s chat template, seeing its BOS and EOS texts.
fn compile(tok: &TextTokenizer, source: &str) -> Result<ChatTemplate, ChatError> {
    ChatTemplate::new(
        source,
        tok.bos_text().unwrap_or(""),
        tok.eos_text().unwrap_or(""),
    )
}

/// Whether `dir` holds a `deepseek_v32` checkpoint (its `config.json` says so).
fn is_deepseek_v32(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|c| c["model_type"] == "deepseek_v32")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_formats_name_their_tool_markup_and_reasoning() {
        assert_eq!(
            ChatFormat::DeepSeekV32.tool_format(),
            Some(ToolFormat::Dsml)
        );
        assert!(ChatFormat::DeepSeekV32.reasoning());
        assert_eq!(ChatFormat::None.tool_format(), None);
        assert!(!ChatFormat::None.reasoning());
        let chatml = ChatTemplate::new(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            ChatFormat::Template(&chatml).tool_format(),
            Some(ToolFormat::Hermes)
        );
        assert!(!ChatFormat::Template(&chatml).reasoning());
        let v3 = ChatTemplate::new(
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ x }}<think>",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            ChatFormat::Template(&v3).tool_format(),
            Some(ToolFormat::DeepSeekV3)
        );
        assert!(ChatFormat::Template(&v3).reasoning());
    }

    /// A Gemma-like base model: a SentencePiece vocabulary with `<bos>` (2) and
    /// `<end_of_turn>` (4), and no chat template.
    fn base_model() -> ChatTokenizer {
        ChatTokenizer::new(pdmesh_tokenize::test_support::tiny_spm(), None, false).unwrap()
    }

    fn ask(tok: &ChatTokenizer, content: &str) -> Result<ChatPrompt, ChatError> {
        tok.chat_prompt(&[ChatMessage::new("user", content)], None, true, false)
    }

    #[test]
    fn a_given_template_serves_chat_for_a_model_without_one_with_its_bos() {
        let base = base_model();
        assert!(matches!(ask(&base, "hi"), Err(ChatError::NoChatFormat)));
        let tok = base
            .with_chat_template(
                "{{ bos_token }}{% for m in messages %}{{ m.content }}<end_of_turn>{% endfor %}",
            )
            .unwrap();
        assert!(matches!(tok.chat_format(), ChatFormat::Template(_)));
        let prompt = ask(&tok, "hi").unwrap();
        assert_eq!(prompt.text, "<bos>hi<end_of_turn>");
        // BOS and the turn's end are the markup's control tokens; `hi` is one piece (274).
        assert_eq!(prompt.ids, [2, 274, 4]);
        // Text in a message that spells a control token stays text.
        let forged = ask(&tok, "<bos>").unwrap();
        assert_eq!(forged.ids.iter().filter(|&&id| id == 2).count(), 1);
    }

    #[test]
    fn a_given_template_replaces_the_models_own_and_deepseek_rules() {
        let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{% endfor %}";
        let tok =
            ChatTokenizer::new(pdmesh_tokenize::test_support::tiny(), Some(chatml), false).unwrap();
        assert_eq!(
            ask(&tok, "hi").unwrap().text,
            "<|im_start|>user\nhi<|im_end|>"
        );
        let tok = tok
            .with_chat_template("Q: {{ messages[0].content }}\nA:")
            .unwrap();
        assert_eq!(ask(&tok, "hi").unwrap().text, "Q: hi\nA:");
        assert_eq!(
            tok.chat_template().map(ChatTemplate::source),
            Some("Q: {{ messages[0].content }}\nA:")
        );
        let dsv32 = ChatTokenizer::new(pdmesh_tokenize::test_support::tiny(), None, true)
            .unwrap()
            .with_chat_template("{{ messages[0].content }}")
            .unwrap();
        assert!(matches!(dsv32.chat_format(), ChatFormat::Template(_)));
    }

    #[test]
    fn a_given_template_that_does_not_compile_is_refused_at_once() {
        let err = base_model()
            .with_chat_template("{% for m in messages %}{{ m.content }}")
            .unwrap_err();
        assert!(matches!(err, ChatError::Template(_)), "{err:?}");
        assert!(err.to_string().contains("chat template"), "{err}");
    }
}

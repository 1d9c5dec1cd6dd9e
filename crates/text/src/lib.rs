//! pdmesh-text: the model's text side, built only from the GGUF file. A real
//! `tokenizers::Tokenizer` made from the GGUF vocabulary (so ids match llama.cpp's), an
//! incremental detokenizer for streaming, and the model's Jinja chat template (with
//! pdmesh's own Hermes-style tool rendering, [`hermes`], for templates without tools).

#![forbid(unsafe_code)]

mod chat;
mod detok;
pub mod dsv32;
pub mod hermes;
mod prompt;
mod stream;
mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate, ToolCall, ToolCallError, ToolFormat};
pub use detok::IncrementalDetokenizer;
pub use prompt::ChatPrompt;
pub use stream::TextStream;
pub use tokenizer::{ChatFormat, PRE_TOKENIZER_SMOLLM, TextTokenizer};

/// Everything that can go wrong turning a GGUF into text machinery, or using it.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error(transparent)]
    Gguf(#[from] pdmesh_gguf::GgufError),
    #[error(
        "tokenizer model {0:?} is not supported (pdmesh-text supports \"gpt2\" byte-level BPE)"
    )]
    UnsupportedModel(String),
    #[error("pre-tokenizer {0:?} (tokenizer.ggml.pre) is not supported (supported: {supported})", supported = tokenizer::SUPPORTED_PRE.join(", "))]
    UnsupportedPreTokenizer(String),
    #[error("invalid tokenizer metadata in the GGUF file: {0}")]
    Metadata(String),
    #[error("tokenizer failed: {0}")]
    Tokenizer(String),
    #[error("token id {id} is out of range (vocabulary size {vocab_size})")]
    UnknownTokenId { id: u32, vocab_size: usize },
    #[error("chat template: {0}")]
    Template(String),
    #[error("this model has no chat template")]
    NoChatFormat,
}

impl TextError {
    fn tokenizer(e: tokenizers::Error) -> Self {
        Self::Tokenizer(e.to_string())
    }

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

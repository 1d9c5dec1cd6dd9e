//! pdmesh-tokenize: the model's vocabulary as code. A real `tokenizers::Tokenizer` made
//! from the GGUF vocabulary (byte-level or SentencePiece BPE, so ids match llama.cpp's)
//! or from an HF checkpoint's `tokenizer.json`, the bytes each id stands for, the ids that
//! end generation, and an incremental detokenizer for streaming. Chat templates, prompts
//! and the parsing of what a model writes are pdmesh-chat's: this crate knows nothing of
//! conversations.

#![forbid(unsafe_code)]

mod detok;
#[cfg(any(test, feature = "test-support"))]
pub mod test_support;
mod tokenizer;

pub use detok::IncrementalDetokenizer;
pub use tokenizer::{PRE_TOKENIZER_SMOLLM, TextTokenizer};

/// Everything that can go wrong turning a GGUF or an HF directory into a tokenizer, or
/// using it.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] pdmesh_gguf::GgufError),
    #[error(
        "tokenizer model {0:?} is not supported (pdmesh-tokenize supports \"gpt2\" byte-level BPE and \"llama\" SentencePiece BPE without add_space_prefix)"
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
}

impl TokenizerError {
    /// A `tokenizers` failure.
    pub fn tokenizer(e: tokenizers::Error) -> Self {
        Self::Tokenizer(e.to_string())
    }
}

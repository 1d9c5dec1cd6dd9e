//! Tokenizer built from GGUF metadata, chat templates and incremental detokenization.

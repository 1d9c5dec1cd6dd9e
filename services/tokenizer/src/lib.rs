//! Tokenizer service: tokenize, chat template, streaming detokenize over gRPC.

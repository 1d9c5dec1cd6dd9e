//! OpenAI-compatible HTTP gateway.

//! The protocols the gateway speaks, one module each (request and response types, their
//! translation to the chat request `generate` serves, streaming encoders), none using another.

pub(crate) mod anthropic;
pub(crate) mod handler;
pub(crate) mod openai;
pub(crate) mod responses;
pub(crate) mod schema;

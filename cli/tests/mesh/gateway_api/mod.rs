//! The gateway's HTTP API against the real tokenizer and worker services, started in
//! this process on loopback: here, because only the binary's crate depends on more than
//! one service.

mod common;
mod errors;
mod generate;

//! The pdmesh command: `up` (the whole mesh as child processes), `model fetch` /
//! `model verify`, and one subcommand per service. A library so its parts are tested
//! directly; `main.rs` only parses arguments and picks a runtime.

pub mod args;
pub mod fetch;
pub mod incident;
pub mod probe;
pub mod serve;
pub mod up;

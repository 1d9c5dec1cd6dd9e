//! `pdmesh bench`: drives an OpenAI-compatible endpoint (pdmesh's gateway, smg, llama.cpp's
//! server) with a workload, measures what users compare serving stacks by, and writes a
//! report a person can look at.

#![forbid(unsafe_code)]

pub mod chaos;
pub mod cli;
pub mod client;
mod drive;
mod error;
pub mod matrix;
pub mod mesh;
pub mod replay;
pub mod report;
pub mod run;
pub mod summary;
pub mod workload;

pub use cli::{BenchArgs, run};
pub use error::BenchError;

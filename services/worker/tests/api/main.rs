//! The worker's integration tests, one binary (each test binary links the whole server
//! again, which is most of the build's time on a small machine).

mod common;
mod service;
mod sglang;

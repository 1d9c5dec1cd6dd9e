//! The `pdmesh` binary's integration tests across real processes, one binary (each test
//! binary links the whole mesh again, which is most of the build's time on a small
//! machine).

mod cli;
mod host_cache;
mod watchdog;

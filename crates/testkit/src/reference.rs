//! The default model and llama.cpp's own answers for it (`tests/fixtures/reference.json`
//! and `tokenizer_ids.json`, made by scripts/reference/gen_reference.py).

use std::fmt::Display;
use std::path::PathBuf;

use serde::Deserialize;
use serde::de::DeserializeOwned;

/// What `load` makes of the default model (its path from pdmesh-gguf; a missing model
/// fails the test saying how to fetch it).
pub fn default_model<T, E: Display>(load: impl FnOnce(PathBuf) -> Result<T, E>) -> T {
    let path = pdmesh_gguf::models::require_default_model();
    load(path.clone()).unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
}

/// The committed [`fixture`](crate::fixture) `name`, after checking that its
/// `model_sha256` is the default model's: answers made from another model would be
/// compared with this one's.
pub fn model_fixture<T: DeserializeOwned>(name: &str) -> T {
    let v: serde_json::Value = crate::fixture(name);
    assert_eq!(
        v["model_sha256"].as_str(),
        Some(pdmesh_gguf::models::DEFAULT_MODEL.sha256),
        "{name}: fixture made from another model"
    );
    serde_json::from_value(v).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// `reference.json`: llama.cpp's prompts (plain and chat) for the default model, with
/// each chat prompt's messages as `M`.
#[derive(Debug, Deserialize)]
#[serde(bound(deserialize = "M: DeserializeOwned"))]
pub struct Reference<M = serde_json::Value> {
    pub prompts: Vec<ReferencePrompt<M>>,
}

#[derive(Debug, Deserialize)]
#[serde(bound(deserialize = "M: DeserializeOwned"))]
pub struct ReferencePrompt<M> {
    pub name: String,
    /// `chat` (rendered from `messages` by the model's template) or `raw`.
    pub kind: String,
    #[serde(default)]
    pub messages: Vec<M>,
    pub text: String,
    pub prompt_ids: Vec<u32>,
}

/// [`model_fixture`] `reference.json`.
pub fn reference<M: DeserializeOwned>() -> Reference<M> {
    model_fixture("reference.json")
}

/// Fails the test listing every one of `failures`, if there is any.
pub fn assert_no_failures(failures: &[String]) {
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

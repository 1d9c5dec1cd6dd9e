//! The engine struct: placeholder signatures, filled in by the forward-pass commit.

use std::path::PathBuf;

use crate::{EngineError, GenRequest, ModelInfo, StepEvent};

/// How to build an engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub model_path: PathBuf,
    /// Sequences decoded together at most.
    pub max_batch: usize,
    /// Tokens per KV page.
    pub page_size: usize,
    /// KV pages in the pool.
    pub kv_pages: usize,
    /// Prompt tokens processed per step, summed over all prefilling sequences.
    pub prefill_chunk: usize,
    /// Compute threads (0 = all cores).
    pub threads: usize,
    /// Cap on the model's context length.
    pub max_context: Option<usize>,
}

impl EngineConfig {
    pub fn new(model_path: impl Into<PathBuf>) -> Self {
        Self {
            model_path: model_path.into(),
            max_batch: 32,
            page_size: 16,
            kv_pages: 2048,
            prefill_chunk: 512,
            threads: 0,
            max_context: None,
        }
    }
}

/// The engine. See the crate docs.
pub struct Engine {
    _cfg: EngineConfig,
}

impl Engine {
    pub fn load(_cfg: EngineConfig) -> Result<Self, EngineError> {
        Err(EngineError::Unsupported("engine not built yet".into()))
    }
    pub fn info(&self) -> ModelInfo {
        unimplemented!()
    }
    pub fn free_pages(&self) -> usize {
        unimplemented!()
    }
    pub fn submit(&mut self, _req: GenRequest) -> Result<(), EngineError> {
        unimplemented!()
    }
    pub fn abort(&mut self, _id: &str) -> bool {
        unimplemented!()
    }
    pub fn step(&mut self) -> Vec<StepEvent> {
        unimplemented!()
    }
    pub fn has_work(&self) -> bool {
        unimplemented!()
    }
}

//! pdmesh-gguf: reads GGUF files (llama.cpp's model format): metadata and the tensor
//! index, each tensor typed by its GGML block format (pdmesh-ggml, re-exported here).
//! Tensors stay in the memory map, quantized; callers borrow their bytes.

pub mod models;
mod reader;
mod writer;

pub use pdmesh_ggml::{GgmlType, dequantize};
pub use reader::{GgufError, GgufFile, MetaValue, TensorInfo};
pub use writer::GgufWriter;

/// Control-token texts that end a turn; llama.cpp treats them as end-of-generation too.
/// The tokenizer's end-of-generation ids are the control tokens with these texts (and
/// the engine's for an HF checkpoint, its special tokens with them).
pub const END_OF_TURN_TEXTS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<EOT>",
];

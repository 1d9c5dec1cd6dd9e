//! pdmesh-gguf: reads GGUF files (llama.cpp's model format): metadata and the tensor
//! index, each tensor typed by its GGML block format (pdmesh-ggml, re-exported here).
//! Tensors stay in the memory map, quantized; callers borrow their bytes.

pub mod models;
mod reader;
mod writer;

pub use pdmesh_ggml::{GgmlType, dequantize};
pub use reader::{GgufError, GgufFile, MetaValue, TensorInfo};
pub use writer::GgufWriter;

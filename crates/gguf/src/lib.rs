//! pdmesh-gguf: reads GGUF files (llama.cpp's model format): metadata, the tensor index,
//! and the quantized block formats. Tensors stay in the memory map, quantized; callers
//! borrow their bytes.

pub mod models;
mod quant;
mod reader;
mod writer;

pub use quant::{GgmlType, dequantize};
pub use reader::{GgufError, GgufFile, MetaValue, TensorInfo};
pub use writer::GgufWriter;

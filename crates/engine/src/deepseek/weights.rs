//! The weights: safetensors tensors under the public checkpoint's names, fp8 block-scaled
//! ones dequantized at load, held as f32 matrices per layer.

use std::collections::HashMap;
use std::path::Path;

use half::bf16;
use pdmesh_gguf::GgmlType;
use pdmesh_kernels::{QMatrix, matmul, matmul_swiglu};
use pdmesh_kv::fp8;

use crate::EngineError;

/// A weight matrix dequantized to f32, used through the matmul kernels.
pub(crate) struct Lin {
    pub(crate) w: Vec<f32>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl Lin {
    pub(super) fn m(&self) -> QMatrix<'_> {
        QMatrix::new(
            GgmlType::F32,
            bytemuck::cast_slice(&self.w),
            self.rows,
            self.cols,
        )
    }
    pub(super) fn row(&self, r: usize) -> &[f32] {
        &self.w[r * self.cols..(r + 1) * self.cols]
    }
}

pub(crate) struct Mlp {
    pub(crate) gate: Lin,
    pub(crate) up: Lin,
    pub(crate) down: Lin,
}

pub(crate) enum Ffn {
    Dense(Mlp),
    Moe {
        /// Router: experts × hidden.
        gate: Lin,
        bias: Vec<f32>,
        experts: Vec<Mlp>,
        shared: Option<Mlp>,
    },
}

pub(crate) struct Indexer {
    pub(crate) wq_b: Lin,
    pub(crate) wk: Lin,
    pub(crate) k_norm_w: Vec<f32>,
    pub(crate) k_norm_b: Vec<f32>,
    pub(crate) weights_proj: Lin,
}

pub(crate) struct Layer {
    pub(crate) in_norm: Vec<f32>,
    pub(crate) post_norm: Vec<f32>,
    pub(crate) q_a: Lin,
    pub(crate) q_a_norm: Vec<f32>,
    pub(crate) q_b: Lin,
    pub(crate) kv_a: Lin,
    pub(crate) kv_a_norm: Vec<f32>,
    /// kv_b_proj: heads × (nope + v) rows of kv_lora_rank.
    pub(crate) kv_b: Lin,
    pub(crate) o: Lin,
    pub(crate) idx: Indexer,
    pub(crate) ffn: Ffn,
}

/// The tensors of a checkpoint: every safetensors file of the directory, read whole.
pub(super) struct Tensors {
    files: Vec<Vec<u8>>,
    /// name → (file, dtype, shape, byte range)
    index: HashMap<
        String,
        (
            usize,
            safetensors::Dtype,
            Vec<usize>,
            std::ops::Range<usize>,
        ),
    >,
}

impl Tensors {
    pub(super) fn open(dir: &Path) -> Result<Self, EngineError> {
        let err = |p: &Path, e: &dyn std::fmt::Display| {
            EngineError::Unsupported(format!("{}: {e}", p.display()))
        };
        let mut names: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| err(dir, &e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        names.sort();
        if names.is_empty() {
            return Err(EngineError::Unsupported(format!(
                "{}: no .safetensors files",
                dir.display()
            )));
        }
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for (fi, p) in names.iter().enumerate() {
            let bytes = std::fs::read(p).map_err(|e| err(p, &e))?;
            {
                let (n, meta) =
                    safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| err(p, &e))?;
                let start = 8 + n;
                for (name, info) in meta.tensors() {
                    let (a, b) = info.data_offsets;
                    index.insert(
                        name.clone(),
                        (fi, info.dtype, info.shape.clone(), start + a..start + b),
                    );
                }
            }
            files.push(bytes);
        }
        Ok(Self { files, index })
    }

    pub(super) fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// A tensor as f32 values (bf16, f16, f32 or fp8 e4m3 with its block scales).
    pub(super) fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, EngineError> {
        let (fi, dtype, got, range) = self
            .index
            .get(name)
            .ok_or_else(|| EngineError::Unsupported(format!("tensor {name} is missing")))?;
        if got.as_slice() != shape {
            return Err(EngineError::Unsupported(format!(
                "tensor {name} is {got:?}, expected {shape:?}"
            )));
        }
        let b = &self.files[*fi][range.clone()];
        use safetensors::Dtype as D;
        Ok(match dtype {
            D::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
            D::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            D::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            D::F8_E4M3 => {
                let (rows, cols) = match shape {
                    [r, c] => (*r, *c),
                    _ => {
                        return Err(EngineError::Unsupported(format!(
                            "fp8 tensor {name} is not a matrix"
                        )));
                    }
                };
                let grid = [rows.div_ceil(128), cols.div_ceil(128)];
                let scales = self.f32(&format!("{name}_scale_inv"), &grid)?;
                b.iter()
                    .enumerate()
                    .map(|(i, &q)| {
                        let (r, c) = (i / cols, i % cols);
                        fp8::e4m3_to_f32(q) * scales[(r / 128) * grid[1] + c / 128]
                    })
                    .collect()
            }
            other => {
                return Err(EngineError::Unsupported(format!(
                    "tensor {name} has dtype {other:?}"
                )));
            }
        })
    }

    pub(super) fn lin(&self, name: &str, rows: usize, cols: usize) -> Result<Lin, EngineError> {
        Ok(Lin {
            w: self.f32(name, &[rows, cols])?,
            rows,
            cols,
        })
    }
}

pub(super) fn swiglu(tp: &rayon::ThreadPool, m: &Mlp, x: &[f32], t: usize) -> Vec<f32> {
    let inter = m.gate.rows;
    let mut g = vec![0f32; t * inter];
    matmul_swiglu(tp, &m.gate.m(), &m.up.m(), x, t, &mut g);
    let mut out = vec![0f32; t * m.down.rows];
    matmul(tp, &m.down.m(), &g, t, &mut out);
    out
}

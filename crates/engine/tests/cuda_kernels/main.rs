#![cfg(feature = "cuda")]
//! Every kernel of `kernels/cuda` against the CPU code it mirrors, on seeded random inputs,
//! on a GPU machine only (the target is empty without the `cuda` feature):
//! `cargo nextest run --release -p pdmesh-engine --features cuda --test cuda_kernels`.
//! `PDMESH_TEST_GPU` picks the device (default 0).
//!
//! Each test states its tolerance next to its assertion; "exact" means the same bits.
//! Launch geometry and argument types follow the contract in each kernel's comment
//! (`int` = i32, `long long` = i64, `unsigned int` = u32, `unsigned long long` = u64).

mod attention;
mod checksum;
mod dsa;
mod fp8;
mod kv;
mod matmul;
mod norm;
#[path = "../kernel_refs/mod.rs"]
mod refs;
mod sampling;
mod support;

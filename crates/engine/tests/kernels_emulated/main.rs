//! The CUDA kernels in `kernels/cuda/`, run on the CPU and checked against the Rust code
//! they mirror, so that a logic error in a kernel fails CI on a machine without a GPU.
//!
//! Each test compiles the committed kernel sources, exactly the text the CUDA backend
//! hands NVRTC (`pdmesh_kernels::cuda_src::sources()`, `full_source()`: the common header
//! prepended), as host C++ together with `tests/emu/shim.h` (the CUDA built-ins) and
//! `tests/emu/launch.cpp` (a grid launcher: blocks one after another, the threads of a
//! block as real OS threads with a barrier), with the system C++ compiler, into a shared
//! library that it loads with `libloading`. The library is cached under Cargo's target
//! tmp dir, keyed by a hash of everything compiled, so the test processes share one
//! compile. See `tests/emu/shim.h` for what the emulation does and does not model: it
//! checks logic (indexing, reduction orders, rounding, barriers), not GPU behaviour.
//!
//! Where a kernel goes through expf / cosf / sinf, the emulation uses the host libm (as
//! the GPU uses its own), so those results are compared with a stated tolerance; every
//! other comparison is bit-exact.
//!
//! A C++ compiler (`c++`, else `g++`) is required: without one these tests fail (CI's
//! `.ci/run` installs g++).

mod attention;
mod checksum;
mod deepseek;
mod dsa;
mod emu;
mod fp8;
mod kv;
mod matmul;
mod norm;
#[path = "../kernel_refs/mod.rs"]
mod refs;
mod sampling;

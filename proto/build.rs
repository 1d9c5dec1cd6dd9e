//! Compiles every .proto under proto/ with the vendored protoc, so no system protoc is needed.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: set_var is unsafe only with other threads reading the environment; this
    // build script has no other threads. prost-build reads PROTOC to find the compiler.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let protos = [
        "pdmesh/tokenizer/v1/tokenizer.proto",
        "pdmesh/worker/v1/worker.proto",
        "pdmesh/cache/v1/cache.proto",
        // Compatibility packages: the SGLang scheduler protocol the smg gateway speaks.
        "smg/grpc/common/common.proto",
        "sglang/grpc/scheduler/scheduler.proto",
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    // The vendored protoc's own include folder holds google/protobuf/*.proto (Struct,
    // Timestamp); prost maps those to prost_types.
    let wkt = protoc_bin_vendored::include_path()?;
    let protos: Vec<PathBuf> = protos.iter().map(PathBuf::from).collect();
    let includes = [PathBuf::from("."), wkt];
    tonic_prost_build::configure().compile_protos(&protos, &includes)?;
    Ok(())
}

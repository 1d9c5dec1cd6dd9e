//! Compiles every .proto under proto/ with the vendored protoc, so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY-free: build scripts are single-threaded; setting PROTOC for prost-build.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let protos = [
        "pdmesh/tokenizer/v1/tokenizer.proto",
        "pdmesh/worker/v1/worker.proto",
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_prost_build::configure().compile_protos(&protos, &["."])?;
    Ok(())
}

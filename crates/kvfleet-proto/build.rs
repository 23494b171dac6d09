//! Generates the gRPC code for `proto/kvfleet/v1/*.proto`.
//!
//! The .proto files are parsed by protox (pure Rust) into a `FileDescriptorSet`, which
//! tonic-prost-build turns into messages, a client and a server. No system `protoc`
//! is run, so the workspace builds on machines without one.

use std::path::PathBuf;

const PROTO_ROOT: &str = "../../proto";
const PROTOS: &[&str] = &["kvfleet/v1/worker.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(PROTO_ROOT);
    for p in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(p).display());
    }
    println!("cargo:rerun-if-changed=build.rs");
    let fds = protox::compile(PROTOS, [PROTO_ROOT])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}

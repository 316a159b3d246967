//! The build script compiles nothing for the library. With the `grpc-example` feature (this
//! crate's own gRPC example, tests and benchmark) it compiles `proto/*.proto` with protox, a
//! protobuf compiler in pure Rust, and generates the tonic code with tonic-prost-build: no
//! system `protoc` is needed.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "grpc-example")]
    if let Err(error) = protos::compile() {
        panic!("compiling the example's .proto files failed: {error}");
    }
}

#[cfg(feature = "grpc-example")]
mod protos {
    const FILES: [&str; 2] = ["proto/orders.proto", "proto/conformance.proto"];

    pub fn compile() -> Result<(), Box<dyn std::error::Error>> {
        for file in FILES {
            println!("cargo:rerun-if-changed={file}");
        }
        let descriptors = protox::compile(FILES, ["proto"])?;
        tonic_prost_build::configure().compile_fds(descriptors)?;
        Ok(())
    }
}

//! Generates the protobuf messages and the tonic service from
//! `proto/starwire_grpc.proto` with `protoc` (Debian's `protobuf-compiler`,
//! or `PROTOC` pointing at one). Without protoc the copy checked in under
//! `generated/` is used, so the workspace builds anywhere; a test checks
//! that the copy matches the .proto whenever protoc is there.
#![deny(unsafe_code)]

use std::path::PathBuf;

const GENERATED: &str = "starwire.grpc.v1.rs";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/starwire_grpc.proto");
    println!("cargo:rerun-if-changed=generated/{GENERATED}");
    println!("cargo:rerun-if-env-changed=PROTOC");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let compiled = tonic_prost_build::configure()
        // `bytes` fields as `bytes::Bytes`: no copy out of the receive buffer.
        .bytes(".")
        .compile_protos(&["proto/starwire_grpc.proto"], &["proto"]);
    match compiled {
        Ok(()) => println!("cargo:rustc-env=STARWIRE_GRPC_PROTOC=1"),
        Err(e) => {
            println!(
                "cargo:warning=protoc failed ({e}); using the checked-in \
                 generated/{GENERATED} (apt-get install protobuf-compiler to regenerate)"
            );
            println!("cargo:rustc-env=STARWIRE_GRPC_PROTOC=0");
            std::fs::copy(format!("generated/{GENERATED}"), out.join(GENERATED))?;
        }
    }
    Ok(())
}

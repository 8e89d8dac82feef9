//! Generates the protobuf messages and the tonic service from
//! `proto/starwire_grpc.proto` (needs `protoc`: Debian's `protobuf-compiler`,
//! or `PROTOC` pointing at one).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/starwire_grpc.proto");
    tonic_prost_build::configure()
        // `bytes` fields as `bytes::Bytes`: no copy out of the receive buffer.
        .bytes(".")
        .compile_protos(&["proto/starwire_grpc.proto"], &["proto"])
        .map_err(|e| {
            format!(
                "compiling proto/starwire_grpc.proto: {e} \
                 (install protoc: apt-get install protobuf-compiler)"
            )
        })?;
    Ok(())
}

//! Compiles the .proto files with protox, so a fresh machine needs no `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/lockd/v1/lockd.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    // The encoded descriptors, for gRPC server reflection (`lockd_api::FILE_DESCRIPTOR_SET`).
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("lockd_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}

//! Compiles the internal replication protocol with protox, so a fresh machine needs no `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/lockd/raft/v1/raft.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}

//! Compiles the internal replication protocol with protox, so a fresh machine needs no `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/lockd/raft/v1/raft.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    // Forwarded calls carry the public API's messages (lockd-api's types, not copies).
    println!("cargo:rerun-if-changed=../api/proto/lockd/v1/lockd.proto");
    let descriptors = protox::compile(files, ["proto", "../api/proto"])?;
    tonic_prost_build::configure()
        .extern_path(".lockd.v1", "::lockd_api::v1")
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}

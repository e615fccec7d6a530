//! `lockctl keys list | export DIR | rotate`: the sequencer signing keys (admin operations).
//!
//! `export` writes the public keys as the files fence-proxy takes with `--verify-key FILE`; the
//! private keys never leave the cluster.

use std::path::Path;

use lockd_client::Client;
use lockd_fence::sequencer::PublicKey;
use serde_json::json;

use crate::cli::KeysCommand;
use crate::exit::{self, Failure};

pub async fn run(client: &Client, command: KeysCommand, json: bool) -> Result<u8, Failure> {
    match command {
        KeysCommand::List => {
            let keys = client.signing_keys().await?;
            if json {
                let listed: Vec<_> = keys
                    .iter()
                    .map(|k| {
                        json!({
                            "key_id": k.key_id, "active": k.active,
                            "created_unix_ms": k.created_unix_ms,
                            "retired_unix_ms": k.retired_unix_ms,
                            "public_key_pem": k.public_key_pem,
                        })
                    })
                    .collect();
                println!("{}", json!({ "keys": listed }));
            } else {
                println!(
                    "{:<16}  {:<7}  {:>15}  {:>15}",
                    "key_id", "state", "created_ms", "retired_ms"
                );
                for k in &keys {
                    println!(
                        "{:<16}  {:<7}  {:>15}  {:>15}",
                        k.key_id,
                        if k.active { "active" } else { "retired" },
                        k.created_unix_ms,
                        if k.active {
                            "-".to_owned()
                        } else {
                            k.retired_unix_ms.to_string()
                        }
                    );
                }
            }
            Ok(exit::OK)
        }
        KeysCommand::Export { dir } => {
            let keys = client.signing_keys().await?;
            std::fs::create_dir_all(&dir).map_err(|e| io_failure(&dir, e))?;
            let mut written = Vec::new();
            for k in &keys {
                check_key_id(&k.key_id)?;
                let path = dir.join(format!("{}.pub.pem", k.key_id));
                write_key(&path, &k.key_id, &k.public_key_pem)?;
                written.push(path.display().to_string());
            }
            if json {
                println!(
                    "{}",
                    json!({ "dir": dir.display().to_string(), "files": written })
                );
            } else {
                for f in &written {
                    println!("{f}");
                }
            }
            Ok(exit::OK)
        }
        KeysCommand::Rotate => {
            let rotated = client.rotate_signing_key().await?;
            if json {
                println!(
                    "{}",
                    json!({ "key_id": rotated.key_id, "retired_key_id": rotated.retired_key_id })
                );
            } else {
                println!("key_id          {}", rotated.key_id);
                println!(
                    "retired_key_id  {}",
                    if rotated.retired_key_id.is_empty() {
                        "-"
                    } else {
                        &rotated.retired_key_id
                    }
                );
            }
            Ok(exit::OK)
        }
    }
}

/// A listed key becomes a file name and a trusted key: its id must be 16 hex digits (no path
/// tricks from a bad reply).
fn check_key_id(key_id: &str) -> Result<(), Failure> {
    if key_id.len() != 16 || !key_id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(Failure::new(
            exit::INTERNAL,
            "bad_key",
            format!("lockd listed a key id {key_id:?} that is not 16 hex digits"),
        ));
    }
    Ok(())
}

/// Writes the key through a temporary file, reads it back as fence-proxy will (`--verify-key`),
/// checks it is the listed key, then renames it into place: a reader never sees half a key, and
/// a file that would not load is never left behind under a key's name.
fn write_key(path: &Path, key_id: &str, pem: &str) -> Result<(), Failure> {
    let tmp = path.with_extension("pem.tmp");
    std::fs::write(&tmp, pem.as_bytes()).map_err(|e| io_failure(&tmp, e))?;
    let loaded = PublicKey::from_pem_file(&tmp).map(|k| k.key_id().to_string());
    if loaded.as_deref() != Ok(key_id) {
        let _ = std::fs::remove_file(&tmp);
        return Err(Failure::new(
            exit::INTERNAL,
            "bad_key",
            match loaded {
                Ok(other) => format!("key {key_id}: the listed public key has id {other}"),
                Err(e) => format!("key {key_id}: the listed public key does not load: {e}"),
            },
        ));
    }
    std::fs::rename(&tmp, path).map_err(|e| io_failure(path, e))
}

fn io_failure(path: &Path, e: std::io::Error) -> Failure {
    Failure::new(exit::INTERNAL, "io", format!("{}: {e}", path.display()))
}

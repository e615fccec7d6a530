//! The audit key test clusters pass to lockd (`--audit-key-file`) and the request digest it
//! yields, so suites can match audit lines to the request ids they sent: lockd writes only the
//! digest.

use std::path::Path;

/// The key, in hex as the flag's file holds it: fixed, so digests are reproducible.
pub const AUDIT_KEY_HEX: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

/// Writes the key file into `dir` and returns its path.
pub fn write_key_file(dir: &Path) -> std::io::Result<std::path::PathBuf> {
    let path = dir.join("audit.key.hex");
    // Once, and whole: a cluster calls this for every node it starts, and rewriting the file in
    // place (truncate, then write) let a node started just before read it empty and exit.
    if !path.exists() {
        let partial = dir.join("audit.key.hex.partial");
        std::fs::write(&partial, AUDIT_KEY_HEX)?;
        std::fs::rename(&partial, &path)?;
    }
    Ok(path)
}

/// What lockd writes as `request_digest` for `request_id` under [`AUDIT_KEY_HEX`]: the first 16
/// bytes of HMAC-SHA256, in hex.
pub fn request_digest(request_id: &str) -> String {
    use hmac::{KeyInit, Mac};
    let key: Vec<u8> = (0..AUDIT_KEY_HEX.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&AUDIT_KEY_HEX[i..i + 2], 16).unwrap())
        .collect();
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).unwrap();
    mac.update(request_id.as_bytes());
    mac.finalize().into_bytes()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

//! Signed fencing tokens at fence-proxy: with `--verify-key` both front ends accept a
//! write only with a sequencer that verifies offline; a forged, altered or foreign one, or a plain
//! token where a sequencer is required, is refused and changes no recorded epoch.
//!
//! Keys and sequencers are made here with `lockd_fence::sequencer::SigningKey`, as lockd makes
//! them. Epochs are read straight from the stores (the HTTP proxy's Postgres store table, the
//! Postgres front end's fence table).

mod http;
mod postgres;

use std::path::{Path, PathBuf};

use lockd_fence::FencingToken;
use lockd_fence::sequencer::{SigningKey, encode_text};

/// Offsets in a sequencer (see `lockd_fence::sequencer`): token, resource, and the signature at
/// the end.
const TOKEN_AT: usize = 12;
const RESOURCE_AT: usize = 30;

const POISON: u64 = i64::MAX as u64;

fn write_public_key(dir: &Path, name: &str, key: &SigningKey) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, key.public_key().to_pem()).unwrap();
    path
}

fn seq(key: &SigningKey, resource: &str, token: u64) -> String {
    encode_text(&key.sign(resource, FencingToken(token), 1_700_000_000_000))
}

/// Sequencers that must not verify for `resource` with `ours` among the verify keys, each with
/// what it is.
fn bad_sequencers(ours: &SigningKey, resource: &str) -> Vec<(&'static str, String)> {
    let foreign = SigningKey::generate();
    let mut forged_sig = ours.sign(resource, FencingToken(POISON), 0);
    let last = forged_sig.len() - 1;
    forged_sig[last] ^= 0x01;
    let mut altered_token = ours.sign(resource, FencingToken(5), 0);
    altered_token[TOKEN_AT..TOKEN_AT + 8].copy_from_slice(&POISON.to_be_bytes());
    let mut altered_resource = ours.sign(resource, FencingToken(POISON), 0);
    altered_resource[RESOURCE_AT] ^= 0x01;
    vec![
        ("forged signature", encode_text(&forged_sig)),
        ("altered token", encode_text(&altered_token)),
        ("altered resource", encode_text(&altered_resource)),
        (
            "sequencer for another resource",
            seq(ours, &format!("{resource}-other"), POISON),
        ),
        ("unknown key", seq(&foreign, resource, POISON)),
        ("not base64", "!!!not-base64!!!".to_owned()),
        (
            "base64 of garbage",
            encode_text(b"LKS1 definitely not a sequencer"),
        ),
    ]
}

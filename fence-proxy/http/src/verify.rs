//! Signed sequencers on the HTTP front end: which tokens may raise a recorded epoch.
//!
//! A plain `Fencing-Token` proves nothing: any client can send `Fencing-Token:
//! 9223372036854775807` and lock a resource's real holder out for good. Given the cluster's public
//! keys (`--verify-key`), the proxy accepts a write only with a `Lock-Sequencer` that verifies
//! offline (`lockd_fence::sequencer`), unless `--allow-unsigned` also lets plain tokens through
//! while clients migrate.

use std::path::PathBuf;

use lockd_fence::sequencer::VerifyKeys;

/// What the proxy demands of a write's token once verify keys are given.
#[derive(Debug, Clone)]
pub struct Verification {
    /// The keys a `Lock-Sequencer` must verify with.
    pub keys: VerifyKeys,
    /// Plain `Fencing-Token` writes without a sequencer are still accepted (migration).
    pub allow_unsigned: bool,
}

impl Verification {
    /// Reads `--verify-key` files; `None` without any (plain tokens, as before). Logs loudly
    /// when tokens are not authenticated. A bad key file is an error naming the file.
    pub fn from_flags(
        verify_keys: &[PathBuf],
        allow_unsigned: bool,
        frontend: &str,
    ) -> anyhow::Result<Option<Verification>> {
        if verify_keys.is_empty() {
            tracing::warn!(
                frontend,
                "no --verify-key: fencing tokens are NOT authenticated; any client can present any \
                 token, including one that locks a resource's real holder out for good \
                 (e.g. 9223372036854775807). Give the cluster's public keys with --verify-key FILE"
            );
            if allow_unsigned {
                tracing::warn!(
                    frontend,
                    "--allow-unsigned has no effect without --verify-key: plain tokens are accepted anyway"
                );
            }
            return Ok(None);
        }
        let keys = VerifyKeys::from_pem_files(verify_keys)
            .map_err(|e| anyhow::anyhow!("--verify-key: {e}"))?;
        let ids: Vec<String> = keys.key_ids().map(|k| k.to_string()).collect();
        if allow_unsigned {
            tracing::warn!(
                frontend,
                key_ids = ?ids,
                "--allow-unsigned: writes with a plain token and no sequencer are still accepted; \
                 such tokens are not authenticated. Remove the flag once every client sends sequencers"
            );
        } else {
            tracing::info!(frontend, key_ids = ?ids, "every fenced write needs a verified sequencer");
        }
        Ok(Some(Verification {
            keys,
            allow_unsigned,
        }))
    }
}

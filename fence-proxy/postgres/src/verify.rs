//! Signed sequencers on the Postgres front end: which `lockd.fence` values may raise a recorded
//! epoch, and the proofs that tell the guard so.
//!
//! The guard reads the fence from the session (`current_setting`), whatever statement set it,
//! and Postgres cannot check an Ed25519 signature. So the proxy verifies each value it sees set
//! (`SET lockd.fence = ...`, the startup options) and hands the guard, with every call, a proof
//! per verified value: `<token>:<mac>`, the MAC keyed by the database's proof key
//! (`lockd_fence_proxy.proof_key`, written by `fence-proxy postgres init --require-verified`,
//! readable by the guard's owner and the proxy's `--upstream` role only). The guard recomputes
//! the MAC over the session's value and takes the token from the proof that matches; a value
//! without one (set by `set_config`, `ALTER ROLE ... SET`, or forged) records nothing. A proof
//! names one value: seeing it (in `pg_stat_activity`) or passing it to the guard directly gains a
//! client only what that verified value gives anyway.

use std::collections::VecDeque;
use std::path::PathBuf;

use lockd_fence::sequencer::{self, VerifyKeys};
use lockd_fence::{FencingToken, validate_resource};

use crate::error::{self, ProxyError};
use crate::fence_sql::MAX_RECORDABLE_TOKEN;
use crate::fence_value;

/// Proofs kept per session: a value set earlier may be current again after a rollback, so a few
/// recent ones stay valid; an older one is simply refused by the guard (fail closed).
pub const MAX_PROOFS: usize = 8;

/// The key the proxy and the guard share. NMAC-SHA256 with two independent 64-byte keys (one
/// SHA-256 block each): `sha256(kout || sha256(kin || message))`, which a plpgsql function can
/// compute with the built-in `sha256`.
#[derive(Clone)]
pub struct ProofKey {
    kin: Vec<u8>,
    kout: Vec<u8>,
}

impl std::fmt::Debug for ProofKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.write_str("ProofKey(..)")
    }
}

impl ProofKey {
    pub fn new(kin: Vec<u8>, kout: Vec<u8>) -> Result<ProofKey, String> {
        if kin.len() != 64 || kout.len() != 64 {
            return Err(format!(
                "the proof key has {} and {} bytes, expected 64 and 64",
                kin.len(),
                kout.len()
            ));
        }
        Ok(ProofKey { kin, kout })
    }

    /// `<token>:<hex mac>` for the session value `value` carrying `token`; the guard computes the
    /// same over `value || chr(10) || token`.
    pub fn proof(&self, value: &str, token: FencingToken) -> String {
        use ring::digest::{Context, SHA256};
        let digits = token.to_string();
        let mut inner = Context::new(&SHA256);
        inner.update(&self.kin);
        inner.update(value.as_bytes());
        inner.update(b"\n");
        inner.update(digits.as_bytes());
        let inner = inner.finish();
        let mut outer = Context::new(&SHA256);
        outer.update(&self.kout);
        outer.update(inner.as_ref());
        let mac = outer.finish();
        let mut out = digits;
        out.push(':');
        for b in mac.as_ref() {
            out.push_str(&format!("{b:02x}"));
        }
        out
    }
}

/// What the proxy demands of a fence once verify keys are given.
#[derive(Debug, Clone)]
pub struct Verification {
    pub keys: VerifyKeys,
    /// Plain `<resource>:<digits>` fences are still accepted (migration).
    pub allow_unsigned: bool,
    pub proof_key: ProofKey,
}

/// The verify-key flags, read and checked at start; the proof key comes later, from the database.
#[derive(Debug, Clone)]
pub struct VerifyFlags {
    pub keys: VerifyKeys,
    pub allow_unsigned: bool,
}

impl VerifyFlags {
    /// Reads `--verify-key` files; `None` without any (plain tokens, as before). Logs loudly
    /// when tokens are not authenticated. A bad key file is an error naming the file.
    pub fn from_flags(
        verify_keys: &[PathBuf],
        allow_unsigned: bool,
    ) -> anyhow::Result<Option<VerifyFlags>> {
        if verify_keys.is_empty() {
            tracing::warn!(
                "no --verify-key: fencing tokens in lockd.fence are NOT authenticated; any client \
                 can present any token, including one that locks a resource's real holder out for \
                 good (e.g. 9223372036854775807). Give the cluster's public keys with --verify-key FILE"
            );
            if allow_unsigned {
                tracing::warn!(
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
                key_ids = ?ids,
                "--allow-unsigned: plain lockd.fence tokens without a sequencer are still accepted; \
                 such tokens are not authenticated. Remove the flag once every client sends sequencers"
            );
        } else {
            tracing::info!(key_ids = ?ids, "every fence needs a verified sequencer");
        }
        Ok(Some(VerifyFlags {
            keys,
            allow_unsigned,
        }))
    }
}

/// A verified fence value and its proof for the guard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub value: String,
    pub token: FencingToken,
    pub proof: String,
}

impl Verification {
    /// Checks a `lockd.fence` value: `<resource>:<digits>` is a plain token (accepted only under
    /// `--allow-unsigned`: else 28000), anything else after the last `:` a sequencer that must
    /// verify for the resource (else 42501). Malformed values: 22023, as without keys.
    pub fn check(&self, value: &str) -> Result<Verified, ProxyError> {
        let (resource, rest) = match value.rsplit_once(':') {
            Some(split) => split,
            None => return Err(fence_value::parse(value).expect_err("no ':' never parses")),
        };
        let token = if !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()) {
            let fence = fence_value::parse(value)?;
            if !self.allow_unsigned {
                return Err(ProxyError::error(
                    error::SEQUENCER_REQUIRED,
                    format!(
                        "lockd.fence for {:?} is a plain token ({}) without a sequencer: this proxy accepts only tokens signed by lockd (--verify-key without --allow-unsigned)",
                        fence.resource, fence.token
                    ),
                )
                .with_hint("SET lockd.fence = '<resource>:<sequencer>', with the sequencer lockd returned with the lock (lockctl hold exports LOCKD_SEQUENCER)"));
            }
            fence.token
        } else {
            validate_resource(resource).map_err(|e| {
                ProxyError::error(
                    error::BAD_FENCE,
                    format!("invalid lockd.fence value {value:?}: {e}"),
                )
            })?;
            let seq = sequencer::decode_text(rest)
                .and_then(|bytes| self.keys.verify_for(&bytes, resource, None))
                .map_err(|e| {
                    ProxyError::error(
                        error::BAD_SEQUENCER,
                        format!("lockd.fence sequencer for {resource:?} refused: {e}"),
                    )
                    .with_hint("use the sequencer lockd returned with the lock, unchanged, with the resource it names")
                })?;
            if seq.token.0 > MAX_RECORDABLE_TOKEN {
                return Err(ProxyError::error(
                    error::BAD_FENCE,
                    format!(
                        "lockd.fence sequencer for {resource:?}: token {} exceeds {MAX_RECORDABLE_TOKEN}, the largest value of the bigint column lockd_fence.token",
                        seq.token
                    ),
                ));
            }
            seq.token
        };
        Ok(Verified {
            value: value.to_owned(),
            token,
            proof: self.proof_key.proof(value, token),
        })
    }
}

/// The proofs of one session, newest last, at most [`MAX_PROOFS`].
#[derive(Debug, Default)]
pub struct Proofs {
    verified: VecDeque<Verified>,
}

impl Proofs {
    pub fn add(&mut self, v: Verified) {
        self.verified.retain(|old| old.value != v.value);
        self.verified.push_back(v);
        while self.verified.len() > MAX_PROOFS {
            self.verified.pop_front();
        }
    }

    /// The guard's argument: `ARRAY['<token>:<mac>', ...]::text[]`. Proofs are digits, `:` and
    /// hex only, so they need no quoting beyond the quotes.
    pub fn sql_array(&self) -> String {
        let items: Vec<String> = self
            .verified
            .iter()
            .map(|v| format!("'{}'", v.proof))
            .collect();
        format!("ARRAY[{}]::pg_catalog.text[]", items.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockd_fence::sequencer::SigningKey;

    fn verification(k: &SigningKey, allow_unsigned: bool) -> Verification {
        Verification {
            keys: VerifyKeys::new([k.public_key()]),
            allow_unsigned,
            proof_key: ProofKey::new(vec![1; 64], vec![2; 64]).unwrap(),
        }
    }

    #[test]
    fn values_are_sorted_into_plain_and_signed() {
        let k = SigningKey::generate();
        let v = verification(&k, false);
        let seq = sequencer::encode_text(&k.sign("orders:eu", FencingToken(42), 0));
        let ok = v.check(&format!("orders:eu:{seq}")).unwrap();
        assert_eq!(ok.token, FencingToken(42));
        assert!(ok.proof.starts_with("42:"), "{}", ok.proof);
        assert_eq!(ok.proof.len(), 3 + 64);
        assert_eq!(v.check("orders:42").unwrap_err().code, "28000");
        assert_eq!(
            v.check("orders:9223372036854775807").unwrap_err().code,
            "28000"
        );
        assert_eq!(v.check(&format!("other:{seq}")).unwrap_err().code, "42501");
        let foreign =
            sequencer::encode_text(&SigningKey::generate().sign("orders:eu", FencingToken(42), 0));
        assert_eq!(
            v.check(&format!("orders:eu:{foreign}")).unwrap_err().code,
            "42501"
        );
        assert_eq!(v.check("orders:eu:AAAA").unwrap_err().code, "42501");
        assert_eq!(v.check("no-colon").unwrap_err().code, "22023");
        let v = verification(&k, true);
        assert_eq!(v.check("orders:42").unwrap().token, FencingToken(42));
        assert_eq!(
            v.check("orders:9223372036854775808").unwrap_err().code,
            "22023"
        );
    }

    /// The guard recomputes this in SQL; a fixed vector keeps the two in step (the SQL side is
    /// checked against the same value in tests/tests/sequencer/proxy/postgres.rs through real sessions).
    #[test]
    fn proof_binds_value_and_token() {
        let key = ProofKey::new(vec![1; 64], vec![2; 64]).unwrap();
        let a = key.proof("r:x", FencingToken(1));
        assert_ne!(a, key.proof("r:y", FencingToken(1)));
        assert_ne!(a[2..], key.proof("r:x", FencingToken(2))[2..]);
        let mut proofs = Proofs::default();
        for i in 0..20u64 {
            proofs.add(Verified {
                value: format!("r:{i}"),
                token: FencingToken(i),
                proof: key.proof(&format!("r:{i}"), FencingToken(i)),
            });
        }
        assert_eq!(proofs.verified.len(), MAX_PROOFS);
        assert!(proofs.sql_array().starts_with("ARRAY['12:"));
    }
}

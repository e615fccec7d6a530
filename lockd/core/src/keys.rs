//! The cluster's sequencer signing keys, as part of the replicated state.
//!
//! The leader makes a key (Ed25519, PKCS#8 DER) and proposes it in a
//! [`Command::InstallSigningKey`](crate::Command::InstallSigningKey); once applied, every replica
//! holds the same keys, so any later leader signs sequencers with the same key. The keys live in
//! the Raft log and in snapshots, on the disks lockd already trusts with every lease.
//!
//! At most one key is active (the one that signs); retired keys stay listed so that stores keep
//! verifying the sequencers they signed, at least [`crate::limits::RETIRED_KEY_KEEP_MS`] after
//! their retirement, within [`crate::limits::SIGNING_KEYS_MAX`] keys in all.
//!
//! A restore retires the backup's active key without a successor ([`SigningKeys::retire_active`]):
//! a cluster restored from a backup signs with a key of its own, made by its first leader, so
//! that the backed-up cluster (still running, or back) and a copy of it (a drill, staging) never
//! sign for each other.

use std::fmt;

use lockd_fence::sequencer::{KeyId, PublicKey, SigningKey};
use serde::{Deserialize, Serialize};

use crate::limits::{RETIRED_KEY_KEEP_MS, SIGNING_KEYS_MAX};

/// One signing key and its life.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// First 8 bytes of SHA-256 of the raw public key (the id a sequencer carries).
    pub key_id: [u8; 8],
    /// The raw Ed25519 public key, kept so listing keys needs no private-key parsing.
    pub public_key: [u8; 32],
    /// The private key, PKCS#8 DER, as the leader made it. Never printed.
    pub pkcs8: Vec<u8>,
    /// The table's clock when the key was installed (roughly Unix ms, informative).
    pub created_ms: i64,
    /// The table's clock when a newer key replaced it; `None` while it is the active key.
    pub retired_ms: Option<i64>,
}

impl fmt::Debug for KeyRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The private key never reaches a log line.
        f.debug_struct("KeyRecord")
            .field("key_id", &KeyId(self.key_id).to_string())
            .field("created_ms", &self.created_ms)
            .field("retired_ms", &self.retired_ms)
            .finish_non_exhaustive()
    }
}

impl KeyRecord {
    /// The key's id, which sequencers name to say which key signed them.
    pub fn id(&self) -> KeyId {
        KeyId(self.key_id)
    }

    /// The public half, which verifiers check signatures with.
    pub fn public(&self) -> PublicKey {
        PublicKey::from_raw(self.public_key)
    }

    /// Whether this is the key that signs (not yet retired).
    pub fn is_active(&self) -> bool {
        self.retired_ms.is_none()
    }

    /// The private key, parsed (for the leader, which signs with it).
    pub fn signing_key(&self) -> Result<SigningKey, String> {
        SigningKey::from_pkcs8_der(&self.pkcs8).map_err(|e| e.to_string())
    }
}

/// The active key and the retired ones, oldest first.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SigningKeys {
    keys: Vec<KeyRecord>,
}

impl SigningKeys {
    /// Every key, oldest first (the active one last).
    pub fn all(&self) -> &[KeyRecord] {
        &self.keys
    }

    /// The key that signs now; `None` before the first installation.
    pub fn active(&self) -> Option<&KeyRecord> {
        self.keys.iter().rev().find(|k| k.is_active())
    }

    /// Whether no key was ever installed.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Installs `pkcs8` as the active key if the active key is `replaces` (`None`: no key yet).
    /// The compare-and-set makes a retried or raced installation harmless: two leaders that both
    /// found no key install only the first, and a rotation retried after it applied does not
    /// rotate again. Returns the new key id, or why nothing changed.
    pub fn install(
        &mut self,
        pkcs8: &[u8],
        replaces: Option<[u8; 8]>,
        now_ms: i64,
    ) -> Result<KeyId, String> {
        let key = SigningKey::from_pkcs8_der(pkcs8)
            .map_err(|e| format!("signing key not installed: {e}"))?;
        let active = self.active().map(|k| k.key_id);
        if active != replaces {
            return Err(format!(
                "signing key {} not installed: the active key is {}, not {}",
                key.key_id(),
                show(active),
                show(replaces)
            ));
        }
        if self.keys.iter().any(|k| k.key_id == key.key_id().0) {
            return Err(format!(
                "signing key {} not installed: it is already known",
                key.key_id()
            ));
        }
        // Room for the new key: forget the oldest retired keys, but only those retired long
        // enough ago that every sequencer they signed has expired.
        while self.keys.len() >= SIGNING_KEYS_MAX {
            let oldest = self
                .keys
                .iter()
                .position(|k| k.retired_ms.is_some())
                .expect("at most one key is active and SIGNING_KEYS_MAX > 1");
            let retired = self.keys[oldest].retired_ms.expect("found as retired");
            if retired.saturating_add(RETIRED_KEY_KEEP_MS as i64) > now_ms {
                return Err(format!(
                    "signing key {} not installed: {SIGNING_KEYS_MAX} keys are kept and the \
                     oldest retired one ({}) was retired less than {} s ago; its sequencers may \
                     still be in use, rotate again later",
                    key.key_id(),
                    self.keys[oldest].id(),
                    RETIRED_KEY_KEEP_MS / 1000
                ));
            }
            self.keys.remove(oldest);
        }
        for k in &mut self.keys {
            if k.retired_ms.is_none() {
                k.retired_ms = Some(now_ms);
            }
        }
        self.keys.push(KeyRecord {
            key_id: key.key_id().0,
            public_key: *key.public_key().raw(),
            pkcs8: pkcs8.to_vec(),
            created_ms: now_ms,
            retired_ms: None,
        });
        Ok(key.key_id())
    }

    /// Retires the active key without a successor, at `now_ms`: a restore (see
    /// `LockTable::prepare_restore`), after which the restored cluster's first leader finds no
    /// active key and installs one of its own. The key stays listed, so sequencers it signed
    /// keep verifying. If the list is full, the oldest retired key is forgotten, so that the
    /// first leader's key fits at once (otherwise it would wait out the keep time of a key
    /// retired shortly before the backup, and the restored cluster could not sign meanwhile);
    /// stores that hold its file keep verifying with it. Returns the retired key and the
    /// forgotten one.
    pub fn retire_active(&mut self, now_ms: i64) -> (Option<KeyId>, Option<KeyId>) {
        let mut retired = None;
        for k in &mut self.keys {
            if k.retired_ms.is_none() {
                k.retired_ms = Some(now_ms);
                retired = Some(k.id());
            }
        }
        let forgotten = (self.keys.len() >= SIGNING_KEYS_MAX).then(|| self.keys.remove(0).id());
        (retired, forgotten)
    }

    /// Checks what a snapshot brought: bounded, at most one active key, ids and public keys that
    /// match the private keys.
    pub fn check(&self) -> Result<(), String> {
        if self.keys.len() > SIGNING_KEYS_MAX {
            return Err(format!(
                "{} signing keys, more than {SIGNING_KEYS_MAX}",
                self.keys.len()
            ));
        }
        let active = self.keys.iter().filter(|k| k.is_active()).count();
        if active > 1 {
            return Err(format!("{active} signing keys are active"));
        }
        for k in &self.keys {
            let parsed = k
                .signing_key()
                .map_err(|e| format!("signing key {}: {e}", k.id()))?;
            if parsed.key_id().0 != k.key_id || parsed.public_key().raw() != &k.public_key {
                return Err(format!(
                    "signing key {} does not match its private key",
                    k.id()
                ));
            }
        }
        Ok(())
    }
}

fn show(id: Option<[u8; 8]>) -> String {
    match id {
        Some(id) => KeyId(id).to_string(),
        None => "none".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Vec<u8> {
        SigningKey::generate().pkcs8_der().to_vec()
    }

    #[test]
    fn installs_only_over_the_expected_active_key() {
        let mut keys = SigningKeys::default();
        let first = keys.install(&key(), None, 1_000).unwrap();
        // A second leader that also found no key: refused, the first key stays.
        let raced = keys.install(&key(), None, 1_001).unwrap_err();
        assert!(raced.contains(&format!("active key is {first}")), "{raced}");
        assert_eq!(keys.active().unwrap().id(), first);
        let second = keys.install(&key(), Some(first.0), 2_000).unwrap();
        // A retry of that rotation does not rotate again.
        assert!(keys.install(&key(), Some(first.0), 2_001).is_err());
        assert_eq!(keys.all().len(), 2);
        assert_eq!(keys.all()[0].retired_ms, Some(2_000));
        assert_eq!(keys.active().unwrap().id(), second);
        keys.check().unwrap();
    }

    #[test]
    fn garbage_is_refused_not_installed() {
        let mut keys = SigningKeys::default();
        let err = keys.install(b"not a key", None, 1).unwrap_err();
        assert!(err.contains("PKCS#8"), "{err}");
        assert!(keys.is_empty());
    }

    /// Goal: the key list stays bounded but never forgets a key whose sequencers may still be in
    /// use. Method: rotate to the bound quickly (refused), then after the keep time (accepted,
    /// the oldest retired key goes).
    #[test]
    fn retired_keys_are_kept_for_the_longest_lease_within_the_bound() {
        let mut keys = SigningKeys::default();
        let mut active = None;
        for i in 0..SIGNING_KEYS_MAX as i64 {
            active = Some(keys.install(&key(), active.map(|k: KeyId| k.0), i).unwrap());
        }
        let early = keys
            .install(&key(), active.map(|k| k.0), 10_000)
            .unwrap_err();
        assert!(early.contains("rotate again later"), "{early}");
        assert_eq!(keys.all().len(), SIGNING_KEYS_MAX);
        let first = keys.all()[0].id();
        let later = 1 + RETIRED_KEY_KEEP_MS as i64;
        keys.install(&key(), active.map(|k| k.0), later).unwrap();
        assert_eq!(keys.all().len(), SIGNING_KEYS_MAX);
        assert!(keys.all().iter().all(|k| k.id() != first));
        keys.check().unwrap();
    }

    #[test]
    fn debug_never_shows_the_private_key() {
        let mut keys = SigningKeys::default();
        keys.install(&key(), None, 1).unwrap();
        let shown = format!("{keys:?}");
        assert!(!shown.contains("pkcs8"), "{shown}");
    }
}

//! Signing grants with the cluster's replicated sequencer key, and installing that key.
//!
//! The key is part of the replicated state ([`lockd_core::keys`]): the leader that finds none
//! makes one and commits it, and every later leader signs with the same key. Only the node that
//! answers an Acquire (the leader) signs; Ed25519 is deterministic, so a retried Acquire gets
//! identical bytes while the grant and the key are unchanged.

use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use lockd_core::{Command, KeyRecord, Outcome};
use lockd_fence::sequencer::{KeyId, SigningKey};

use crate::proposer::{ProposeError, Proposer};
use crate::storage::state_machine::SmState;

/// How long an Acquire granted before the cluster has a key waits for the key's commit. A new
/// cluster's first leader commits the key within one reaper round after its clock anchor, so
/// this is rarely felt; past it the call answers UNAVAILABLE (retry with the same request_id),
/// never an unsigned grant.
pub const KEY_WAIT: Duration = Duration::from_secs(2);
/// How often a call waiting for the key looks again.
const KEY_POLL: Duration = Duration::from_millis(10);

/// The active key, parsed once per key rather than once per grant.
#[derive(Default)]
pub struct Signer {
    cached: Mutex<Option<Arc<SigningKey>>>,
}

impl Signer {
    /// The active key of the applied state, if the cluster has one.
    pub fn active(&self, sm: &RwLock<SmState>) -> Option<Arc<SigningKey>> {
        let active_id = active_record(sm, |k| k.key_id)?;
        if let Some(key) = self
            .cached
            .lock()
            .expect("signer lock")
            .as_ref()
            .filter(|k| k.key_id().0 == active_id)
        {
            return Some(key.clone());
        }
        // The state machine checked the key when it was installed or loaded.
        let key = active_record(sm, |k| k.signing_key())?
            .unwrap_or_else(|e| panic!("lockd: the replicated signing key is invalid: {e}"));
        let key = Arc::new(key);
        *self.cached.lock().expect("signer lock") = Some(key.clone());
        Some(key)
    }

    /// The active key, waiting up to [`KEY_WAIT`] for a new cluster's first key to commit.
    pub async fn active_or_wait(&self, sm: &RwLock<SmState>) -> Option<Arc<SigningKey>> {
        let deadline = tokio::time::Instant::now() + KEY_WAIT;
        loop {
            if let Some(key) = self.active(sm) {
                return Some(key);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(KEY_POLL).await;
        }
    }
}

fn active_record<T>(sm: &RwLock<SmState>, f: impl FnOnce(&KeyRecord) -> T) -> Option<T> {
    let state = sm.read().expect("state lock");
    state.table.signing_keys().active().map(f)
}

/// On the leader: commits a new key if the applied state has none (a new cluster, or one
/// upgraded from a lockd without sequencers). The install is a compare-and-set on "no active
/// key", so two leaders racing install one key.
pub async fn ensure_key(sm: &RwLock<SmState>, proposer: &Proposer) -> Result<(), ProposeError> {
    if sm
        .read()
        .expect("state lock")
        .table
        .signing_keys()
        .active()
        .is_some()
    {
        return Ok(());
    }
    match install(proposer, None).await? {
        Outcome::SigningKeyInstalled { key_id } => {
            tracing::info!(key_id = %KeyId(key_id), "lockd: installed the cluster's sequencer signing key");
        }
        other => tracing::debug!(?other, "signing key not installed"),
    }
    Ok(())
}

/// Proposes a freshly made key to replace `replaces` (`None`: no active key).
pub async fn install(
    proposer: &Proposer,
    replaces: Option<[u8; 8]>,
) -> Result<Outcome, ProposeError> {
    let key = SigningKey::generate();
    proposer
        .propose(Command::InstallSigningKey {
            pkcs8: key.pkcs8_der().to_vec(),
            replaces,
        })
        .await
}

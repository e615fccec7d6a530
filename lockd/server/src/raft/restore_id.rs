//! The restore id on the peer protocol: members of a cluster restored from a backup exchange Raft
//! messages only with members restored alike (see `crate::backup::restore`).
//!
//! A node that has a restore id sends it on every Raft message ([`RESTORE_ID_HEADER`]) and in
//! every Raft reply, and in its `CurrentVote` replies (`CurrentVoteReply.restore_id`). A node
//! refuses a Raft message whose restore id is not its own (another id, or none where it has one,
//! or one where it has none), and discards a reply that does not carry its own: so neither a
//! member restored from another file or with another floor, nor a member of the old cluster
//! (never restored, or an older lockd that sends no id) can move a restored member's term or log,
//! whichever side sends. `CurrentVote` is answered whatever the asker's id (it is read-only, and
//! a wiped node asks before it knows the id); the asker counts only answers with its own id, or,
//! when it has none yet, the answers of one restore id that together prove what its lost disk
//! held, and then keeps that id (`raft::vote_gate`).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tonic::metadata::MetadataMap;

/// gRPC metadata of every Raft message and reply of a node that has a restore id.
pub(crate) const RESTORE_ID_HEADER: &str = "lockd-restore-id";

/// At most one mismatch per this interval reaches the log, per side.
const LOG_EVERY_MS: u64 = 10_000;

/// This node's restore id: set by `lockd restore`, or learned once by a wiped node.
#[derive(Debug)]
pub struct RestoreIdentity {
    id: OnceLock<String>,
    /// When a mismatch was last logged (ms since `started`, 0 = never).
    last_logged_ms: AtomicU64,
    started: Instant,
}

impl RestoreIdentity {
    /// The identity read from the data dir (`None`: never restored, or not learned yet).
    pub fn new(id: Option<String>) -> Self {
        let cell = OnceLock::new();
        if let Some(id) = id {
            let _ = cell.set(id);
        }
        RestoreIdentity {
            id: cell,
            last_logged_ms: AtomicU64::new(0),
            started: Instant::now(),
        }
    }

    /// The id, if this node has one.
    pub fn get(&self) -> Option<&str> {
        self.id.get().map(String::as_str)
    }

    /// Takes the id a wiped node learned from its peers (after it is on disk). The id never
    /// changes once set: a second, different one is refused with the reason.
    pub fn adopt(&self, id: &str) -> Result<(), String> {
        let now = self.id.get_or_init(|| id.to_owned());
        if now == id {
            Ok(())
        } else {
            Err(format!(
                "lockd: this node already has restore id {now}; not taking {id}"
            ))
        }
    }

    /// Adds the id, if any, to outgoing metadata.
    pub fn attach(&self, md: &mut MetadataMap) {
        if let Some(id) = self.get()
            && let Ok(value) = id.parse()
        {
            md.insert(RESTORE_ID_HEADER, value);
        }
    }

    /// Whether a peer's message or reply (`theirs`, from its metadata) may reach this node's
    /// Raft; the error names `peer` and both ids, and says what to do.
    pub fn check(&self, peer: &str, theirs: Option<&str>) -> Result<(), String> {
        let ours = self.get();
        if ours == theirs {
            return Ok(());
        }
        let what = if ours.is_some() && theirs.is_some() {
            "the two were restored from a different backup file, --token-floor or --peer list, \
             and never exchange Raft messages (they would disagree on the token counter or the \
             log). Do not restore the odd one again with the others' floor: those others may \
             already form a cluster that granted tokens above it. Stop EVERY member and restore \
             all of them again from one file with one floor: the highest floor used so far and \
             above every token granted since (`lockctl describe`, `fence-proxy epochs max`)"
        } else {
            "one side is a member of a cluster that was never restored (the old cluster, or an \
             older lockd) and the other a restored member; they never exchange Raft messages. \
             Stop the old cluster's member and start it with an empty data dir (it then learns \
             the restore id from the restored members), or restore it like the others"
        };
        Err(format!(
            "lockd: restore id mismatch: this node has {}, {peer} has {}: {what}",
            show(ours),
            show(theirs)
        ))
    }

    /// Logs a mismatch at most once per [`LOG_EVERY_MS`] (a peer retries at heartbeat pace).
    pub fn log_mismatch(&self, why: &str) {
        let now = self.started.elapsed().as_millis() as u64;
        let last = self.last_logged_ms.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= LOG_EVERY_MS)
            && self
                .last_logged_ms
                .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::error!(
                reason = why,
                "lockd: refused Raft traffic of another restore (further refusals in the next 10 s \
                 are not logged)"
            );
        }
    }
}

/// The restore id in a message's or reply's metadata.
pub fn from_metadata(md: &MetadataMap) -> Option<&str> {
    md.get(RESTORE_ID_HEADER).and_then(|v| v.to_str().ok())
}

fn show(id: Option<&str>) -> String {
    match id {
        Some(id) => format!("restore id {id}"),
        None => "no restore id (a node of a cluster that was never restored from a backup, or \
                 an older lockd)"
            .to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_same_restore_id_passes_and_the_error_names_both() {
        let restored = RestoreIdentity::new(Some("aaaa".into()));
        assert!(restored.check("node 2", Some("aaaa")).is_ok());
        let e = restored.check("node 3", Some("bbbb")).unwrap_err();
        assert!(
            e.contains("node 3") && e.contains("aaaa") && e.contains("bbbb"),
            "{e}"
        );
        assert!(
            e.contains("different backup file, --token-floor or --peer list")
                && e.contains("Stop EVERY member")
                && e.contains("highest floor"),
            "{e}"
        );
        let e = restored.check("node 3", None).unwrap_err();
        assert!(e.contains("no restore id") && e.contains("aaaa"), "{e}");
        assert!(
            e.contains("never restored") && e.contains("empty data dir"),
            "{e}"
        );
        let never = RestoreIdentity::new(None);
        assert!(never.check("node 2", None).is_ok());
        assert!(never.check("node 2", Some("aaaa")).is_err());
    }

    #[test]
    fn an_id_is_adopted_once_and_travels_in_metadata() {
        let id = RestoreIdentity::new(None);
        let mut md = MetadataMap::new();
        id.attach(&mut md);
        assert_eq!(from_metadata(&md), None);
        id.adopt("cafe").unwrap();
        id.adopt("cafe").unwrap();
        assert!(id.adopt("beef").unwrap_err().contains("cafe"));
        id.attach(&mut md);
        assert_eq!(from_metadata(&md), Some("cafe"));
    }
}

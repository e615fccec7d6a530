//! The restore id on the peer protocol, which is also the *cluster incarnation id*: members of a
//! cluster restored from a backup exchange Raft messages only with members restored alike (see
//! `crate::backup::restore`), and members of a cluster founded by this release only with members
//! of the same founding.
//!
//! Where an id comes from: `lockd restore` derives one from the backup, the floor and the
//! membership; a cluster founded by its `--peer` nodes gets a random one, drawn by the founder
//! with the lowest id and taken by the others from its `CurrentVote` answer (`raft::vote_gate`,
//! "Founding"); `lockd init` draws one for a single-node cluster ([`new_incarnation_id`]). Each
//! is written to the data dir before the node takes part in Raft. A wiped node or a joiner
//! (`--join`) takes, once, the id of the peers whose answers make its proof, and keeps it. A
//! cluster founded by an older lockd has none, and stays without one (an older node sends no
//! header): nothing changes for it, and its wiped nodes and joiners take "none" like any id.
//!
//! Why one id for both, under the wire names of the restore id (`lockd-restore-id`,
//! `CurrentVoteReply.restore_id`): both answer the same question, "is this message from my
//! cluster's history?", with the same rules, and a node needs one answer; a restored cluster is
//! a new incarnation of the old one. Keeping the names keeps the wire as it is for the nodes that
//! already send them. Internals keep the name `RestoreIdentity` for the same reason: one concept,
//! documented here.
//!
//! Without TLS this is what keeps a second cluster out: two clusters founded on the same
//! addresses, or a node added to the wrong cluster, have log ids that can collide with this
//! cluster's (both start at term 1, index 0), and Raft alone would take one's entries for the
//! other's.
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

/// Random bytes of an incarnation id drawn at founding (128 bits: two clusters never draw the
/// same one).
const INCARNATION_ID_BYTES: usize = 16;

/// A new random cluster incarnation id, in hex (`lockd init`, or the founder that draws it).
pub fn new_incarnation_id() -> String {
    let bytes: [u8; INCARNATION_ID_BYTES] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

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
        let what = if ours.is_some_and(is_incarnation) || theirs.is_some_and(is_incarnation) {
            "the two belong to different clusters (cluster incarnation ids differ: founded \
             separately, on the same addresses or node ids, or one was restored from a backup); \
             they never exchange Raft messages, or one would take the other's log for its own. \
             Check --peer and `lockctl member list` on both; a node that belongs to the other \
             cluster must be started with an empty data dir and added with --join and `lockctl \
             member add`"
        } else if ours.is_some() && theirs.is_some() {
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

    /// Whether a call that `peer` forwarded with restore id `theirs` may be served, where
    /// `announced` is the highest peer protocol version `peer` announced (on the call or on its
    /// Raft traffic). As [`RestoreIdentity::check`], except that a call without an id is taken
    /// from a sender of a version that did not always send one
    /// ([`super::peer_protocol::FORWARDS_RESTORE_ID`]): a member in a rolling upgrade.
    pub fn check_forwarded(
        &self,
        peer: &str,
        theirs: Option<&str>,
        announced: u32,
    ) -> Result<(), String> {
        if theirs.is_none() && announced < super::peer_protocol::FORWARDS_RESTORE_ID {
            return Ok(());
        }
        self.check(peer, theirs).map_err(|why| match theirs {
            None => format!(
                "{why}. {peer} announced peer protocol {announced}, whose nodes send their \
                 restore id on every call they forward: this one comes from a node without one"
            ),
            Some(_) => why,
        })
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
                "lockd: refused Raft traffic of another restore or cluster incarnation (further \
                 refusals in the next 10 s \
                 are not logged)"
            );
        }
    }
}

/// The restore id in a message's or reply's metadata.
pub fn from_metadata(md: &MetadataMap) -> Option<&str> {
    md.get(RESTORE_ID_HEADER).and_then(|v| v.to_str().ok())
}

/// Whether an id was drawn at founding ([`new_incarnation_id`]) rather than derived by a
/// restore (SHA-256, 64 hex digits): only for the advice in a mismatch.
fn is_incarnation(id: &str) -> bool {
    id.len() == 2 * INCARNATION_ID_BYTES
}

fn show(id: Option<&str>) -> String {
    match id {
        Some(id) => format!("restore id {id}"),
        None => "no restore id (a node of a cluster that was never restored from a backup and \
                 was founded by an older lockd, or an older lockd)"
            .to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: a forwarded call without a restore id is refused by a node that has one when the
    /// sender announced a version that always sends it (review of the restore, L2: every such
    /// call was taken, so a member of the old cluster forwarded client and admin calls to a
    /// restored leader), and still taken from an older sender (rolling upgrade) or by a node
    /// without an id.
    #[test]
    fn a_forwarded_call_without_the_id_is_refused_from_a_sender_that_sends_it() {
        use super::super::peer_protocol::FORWARDS_RESTORE_ID;
        let restored = RestoreIdentity::new(Some("aaaa".into()));
        let e = restored
            .check_forwarded("node 2", None, FORWARDS_RESTORE_ID)
            .unwrap_err();
        assert!(
            e.contains("node 2 has no restore id")
                && e.contains("aaaa")
                && e.contains(&format!("peer protocol {FORWARDS_RESTORE_ID}")),
            "{e}"
        );
        assert!(
            restored
                .check_forwarded("node 2", None, FORWARDS_RESTORE_ID - 1)
                .is_ok()
        );
        assert!(
            restored
                .check_forwarded("node 2", Some("aaaa"), FORWARDS_RESTORE_ID)
                .is_ok()
        );
        // Another id is refused whatever the version, as before.
        assert!(restored.check_forwarded("node 2", Some("bbbb"), 1).is_err());
        let never = RestoreIdentity::new(None);
        assert!(
            never
                .check_forwarded("node 2", None, FORWARDS_RESTORE_ID)
                .is_ok()
        );
    }

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
    fn incarnation_ids_are_random_and_their_mismatch_says_different_clusters() {
        let (a, b) = (new_incarnation_id(), new_incarnation_id());
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        let node = RestoreIdentity::new(Some(a.clone()));
        assert!(node.check("node 2", Some(&a)).is_ok());
        let e = node.check("node 2", Some(&b)).unwrap_err();
        assert!(e.contains("different clusters") && e.contains(&b), "{e}");
        let e = node.check("node 2", None).unwrap_err();
        assert!(e.contains("different clusters"), "{e}");
        let e = RestoreIdentity::new(None)
            .check("node 2", Some(&a))
            .unwrap_err();
        assert!(e.contains("different clusters"), "{e}");
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

//! Keeps a node that lost its disk from voting until it holds every committed entry again.
//!
//! Raft's election rule assumes a voter never forgets its log. A node restarted with an empty
//! data dir has forgotten it: with the entries of some commit held only by it and one other node,
//! its empty log would let a lagging candidate that lacks those entries win, and tokens would
//! repeat (issue 14, finding 7). So a node that starts empty is *rejoining*: it records that
//! durably and grants no vote until it has applied the commit index a leader reports in that
//! leader's own term. A commit in the leader's own term covers every entry committed before that
//! term (the leader holds them all), so applying it restores what the lost disk held.
//!
//! A first-ever bootstrap starts every node empty. There no entry beyond the initial membership
//! (log index 0, written by `initialize` on every node) can have committed before the first
//! leader, so a rejoining node votes for a candidate whose last log index is 0. The price of the
//! rule: with one node wiped and another lost, the third alone elects nobody until a node that
//! holds the log returns, which is the Raft answer to two failures out of three.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use openraft::ServerState;
use tokio_util::sync::CancellationToken;

use super::{LogId, Raft};
use crate::storage::log_store::LogStore;

/// How often a rejoining node looks whether it has caught up, besides on metric changes.
const CATCH_UP_POLL: Duration = Duration::from_millis(100);

/// Whether this node may vote; shared by the Raft service and the task that opens it.
pub struct VoteGate {
    /// True once the node may vote; read on every vote request without the lock.
    open: AtomicBool,
    /// The commit index to apply before voting, once a leader has reported one in its own term.
    target: Mutex<Option<u64>>,
    /// Where the rejoining flag is kept, to clear it once caught up.
    store: Option<LogStore>,
}

impl VoteGate {
    /// A gate that is open for good: the node kept its data dir.
    pub fn open() -> Self {
        VoteGate {
            open: AtomicBool::new(true),
            target: Mutex::new(None),
            store: None,
        }
    }

    /// A gate closed until [`VoteGate::watch`] sees the node caught up; `store` holds the
    /// durable rejoining flag it clears then.
    pub fn rejoining(store: LogStore) -> Self {
        VoteGate {
            open: AtomicBool::new(false),
            target: Mutex::new(None),
            store: Some(store),
        }
    }

    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Learns the leader's commit index from an AppendEntries this node accepted. Only a commit
    /// in the leader's own term counts (see the module docs); the first one is the target.
    pub fn observe_append(&self, leader_term: u64, leader_commit: Option<LogId>) {
        if self.is_open() {
            return;
        }
        if let Some(c) = leader_commit
            && c.leader_id.term == leader_term
        {
            let mut t = self.target.lock().expect("vote gate lock");
            t.get_or_insert(c.index);
        }
    }

    /// Whether a vote request from a candidate with `candidate_last_log` may reach Raft; the
    /// error says why not.
    pub fn admits(&self, candidate_last_log: Option<LogId>) -> Result<(), String> {
        if self.is_open() {
            return Ok(());
        }
        let target = *self.target.lock().expect("vote gate lock");
        admits_while_rejoining(candidate_last_log.map(|l| l.index), target)
    }

    /// Opens the gate once the node has caught up or leads, and clears the durable flag first.
    pub async fn watch(&self, raft: Raft, shutdown: CancellationToken) {
        let mut rx = raft.metrics();
        let mut poll = tokio::time::interval(CATCH_UP_POLL);
        while !self.is_open() {
            let (applied, state) = {
                let m = rx.borrow();
                (m.last_applied.map(|l| l.index), m.state)
            };
            let target = *self.target.lock().expect("vote gate lock");
            if caught_up(target, applied, state == ServerState::Leader) {
                if let Some(store) = &self.store
                    && let Err(e) = store.set_rejoining(false).await
                {
                    tracing::error!(error = %e, "lockd: clearing the rejoining flag; still not voting");
                } else {
                    tracing::info!(
                        ?target,
                        ?applied,
                        "caught up after starting with an empty data dir; voting again"
                    );
                    self.open.store(true, Ordering::Release);
                    return;
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                changed = rx.changed() => if changed.is_err() { return },
                _ = poll.tick() => {}
            }
        }
    }
}

/// A rejoining node votes only in a first-ever bootstrap: for a candidate that has nothing past
/// the initial membership entry at index 0.
fn admits_while_rejoining(
    candidate_last_index: Option<u64>,
    target: Option<u64>,
) -> Result<(), String> {
    match candidate_last_index {
        None | Some(0) => Ok(()),
        Some(i) => Err(format!(
            "lockd: node started with an empty data dir and has not caught up (commit index to \
             apply: {}); not voting for a candidate whose last log index is {i}",
            target.map_or_else(|| "not learned yet".to_owned(), |t| t.to_string())
        )),
    }
}

/// Caught up: applied the learned target, or leading (a leader holds every committed entry).
fn caught_up(target: Option<u64>, applied: Option<u64>, is_leader: bool) -> bool {
    is_leader || target.is_some_and(|t| applied.is_some_and(|a| a >= t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::CommittedLeaderId;

    fn log_id(term: u64, index: u64) -> LogId {
        LogId::new(CommittedLeaderId::new(term, 1), index)
    }

    #[test]
    fn a_rejoining_node_votes_only_in_a_first_bootstrap() {
        assert!(admits_while_rejoining(None, None).is_ok());
        assert!(admits_while_rejoining(Some(0), None).is_ok());
        let e = admits_while_rejoining(Some(7), Some(12)).unwrap_err();
        assert!(
            e.starts_with("lockd: ") && e.contains("12") && e.contains('7'),
            "{e}"
        );
        assert!(admits_while_rejoining(Some(7), None).is_err());
    }

    #[test]
    fn caught_up_needs_the_learned_commit_applied_or_leadership() {
        assert!(!caught_up(None, Some(100), false), "nothing learned yet");
        assert!(!caught_up(Some(50), Some(49), false));
        assert!(!caught_up(Some(50), None, false));
        assert!(caught_up(Some(50), Some(50), false));
        assert!(caught_up(None, None, true));
    }

    #[test]
    fn only_a_commit_in_the_leaders_own_term_sets_the_target() {
        let gate = VoteGate {
            open: AtomicBool::new(false),
            target: Mutex::new(None),
            store: None,
        };
        // A new leader of term 5 that has not committed in its term yet reports an older
        // commit, which may lag behind what was committed before: not a target.
        gate.observe_append(5, Some(log_id(4, 90)));
        assert_eq!(*gate.target.lock().unwrap(), None);
        gate.observe_append(5, Some(log_id(5, 101)));
        gate.observe_append(5, Some(log_id(5, 140)));
        assert_eq!(*gate.target.lock().unwrap(), Some(101));
        assert!(gate.admits(Some(log_id(5, 140))).is_err());
        assert!(gate.admits(Some(log_id(0, 0))).is_ok());
    }
}

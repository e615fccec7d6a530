//! Keeps a node that lost its disk from voting, leading or following a stale leader until it
//! holds every committed entry again.
//!
//! Raft's safety assumes a voter never forgets its log or its term. A node restarted with an empty
//! data dir has forgotten both, so it is *rejoining*: it records that durably and, until it has
//! applied the commit index a leader reports in that leader's own term (a commit in the leader's
//! own term covers every entry committed before that term: the leader holds them all), three
//! rules hold. Each closes one way a wiped node could let committed entries be lost, and tokens
//! repeat:
//!
//! 1. **No vote on a partial log** (issue 14, finding 7): it grants no vote to a candidate that
//!    has anything past the initial membership entry at index 0. Otherwise, with the entries of
//!    some commit held only by it and one other node, its vote would let a lagging candidate that
//!    lacks those entries win.
//! 2. **No candidacy on a partial log** (review of finding 7): once it holds entries past index 0
//!    it does not start elections. A node halfway through catching up could otherwise win with
//!    the vote of a node that lags further, and lead without the rest of the committed log.
//! 3. **No term below the cluster's** (review of finding 7): before it accepts any message it
//!    asks its peers for their current vote, and refuses appends, snapshots and vote requests of a
//!    term below the highest one reported. A leader of term T was elected by a majority, and
//!    every member of it other than this node still holds a term of at least T; answers from
//!    `n - majority + 1` peers always include one of them. Without this a deposed leader of an
//!    older term could replicate through the node that forgot the newer term, and commit entries
//!    that overwrite ones committed in that term.
//!
//! A first-ever bootstrap starts every node empty. No entry beyond the initial membership can have
//! committed before the first leader, so rule 1 admits candidates whose last log index is 0, rule
//! 2 lets a node with only that entry campaign, and rule 3 accepts the answers of a majority
//! (this node included) in which every peer is empty too. The price of the rules: with one node
//! wiped and another lost, the cluster elects nobody and the wiped node accepts nothing until a
//! node that holds the log returns, which is the Raft answer to two failures out of three.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use openraft::ServerState;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::{LogId, NodeId, Raft};
use crate::storage::log_store::LogStore;

/// How often a rejoining node looks whether it has caught up, besides on metric changes.
const CATCH_UP_POLL: Duration = Duration::from_millis(100);
/// Pause between two rounds of asking the peers for their vote while too few answered.
const TERM_ASK_RETRY: Duration = Duration::from_millis(200);
/// How often the node says, while it waits for peers, why it does not follow anyone yet.
const TERM_WAIT_LOG_EVERY: Duration = Duration::from_secs(5);

/// A peer's answer to `CurrentVote`: its vote (term and whom it follows) and its last log index.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VoteReport {
    pub vote: openraft::Vote<NodeId>,
    pub last_log_index: Option<u64>,
}

/// Whether this node may vote, campaign and follow; shared by the Raft service and the tasks that
/// open it.
pub struct VoteGate {
    /// True once the node has caught up; read on every Raft message without the lock.
    open: AtomicBool,
    /// What a rejoining node has learned so far.
    learned: Mutex<Learned>,
    /// Where the rejoining flag is kept, to clear it once caught up.
    store: Option<LogStore>,
}

#[derive(Default)]
struct Learned {
    /// The commit index to apply before opening, once a leader has reported one in its own term.
    target: Option<u64>,
    /// The lowest term accepted from a leader or candidate (rule 3), once enough peers answered.
    term_floor: Option<u64>,
}

impl VoteGate {
    /// A gate that is open for good: the node kept its data dir.
    pub fn open() -> Self {
        VoteGate {
            open: AtomicBool::new(true),
            learned: Mutex::new(Learned::default()),
            store: None,
        }
    }

    /// A gate closed until [`VoteGate::watch`] sees the node caught up; `store` holds the
    /// durable rejoining flag it clears then.
    pub fn rejoining(store: LogStore) -> Self {
        VoteGate {
            open: AtomicBool::new(false),
            learned: Mutex::new(Learned::default()),
            store: Some(store),
        }
    }

    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    fn learned(&self) -> std::sync::MutexGuard<'_, Learned> {
        // The lock guards two plain values; a panic while holding it leaves them consistent.
        self.learned.lock().unwrap_or_else(|e| e.into_inner())
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
            self.learned().target.get_or_insert(c.index);
        }
    }

    /// Whether an AppendEntries or InstallSnapshot of a leader in `term` may reach Raft (rule 3);
    /// the error says why not. When it may, and the node is rejoining, elections stop first
    /// (rule 2): what the message carries is a partial log until the gate opens.
    pub fn admits_leader(&self, term: u64, raft: &Raft) -> Result<(), String> {
        if self.is_open() {
            return Ok(());
        }
        admits_term(term, self.learned().term_floor)?;
        raft.runtime_config().elect(false);
        Ok(())
    }

    /// Whether a vote request of a candidate in `term` with `candidate_last_log` may reach Raft
    /// (rules 1 and 3); the error says why not.
    pub fn admits_candidate(
        &self,
        term: u64,
        candidate_last_log: Option<LogId>,
    ) -> Result<(), String> {
        if self.is_open() {
            return Ok(());
        }
        let learned = self.learned();
        admits_term(term, learned.term_floor)?;
        admits_while_rejoining(candidate_last_log.map(|l| l.index), learned.target)
    }

    /// Asks the peers for their vote until enough have answered to know the cluster's term (rule
    /// 3), then records the floor. `cluster_size` counts this node.
    pub async fn learn_term<F, Fut>(
        &self,
        cluster_size: usize,
        mut ask: F,
        shutdown: CancellationToken,
    ) where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Vec<VoteReport>>,
    {
        let mut last_log = tokio::time::Instant::now();
        while !self.is_open() {
            let reports = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = ask() => r,
            };
            match term_floor(cluster_size, &reports) {
                Some(floor) => {
                    tracing::info!(
                        floor,
                        answers = reports.len(),
                        "rejoining: learned the cluster's term from peers; accepting leaders of \
                         that term or newer"
                    );
                    self.learned().term_floor = Some(floor);
                    return;
                }
                None if last_log.elapsed() >= TERM_WAIT_LOG_EVERY => {
                    last_log = tokio::time::Instant::now();
                    tracing::warn!(
                        answers = reports.len(),
                        needed = answers_needed(cluster_size),
                        "rejoining after an empty data dir: too few peers answered to learn the \
                         cluster's term; following no leader until they do"
                    );
                }
                None => {}
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(TERM_ASK_RETRY) => {}
            }
        }
    }

    /// Opens the gate once the node has caught up or leads, clearing the durable flag first,
    /// and lets the node campaign again.
    pub async fn watch(&self, raft: Raft, shutdown: CancellationToken) {
        let mut rx = raft.metrics();
        let mut poll = tokio::time::interval(CATCH_UP_POLL);
        while !self.is_open() {
            let (applied, last_log, state) = {
                let m = rx.borrow();
                (m.last_applied.map(|l| l.index), m.last_log_index, m.state)
            };
            // Rule 2 for a node that restarted while catching up: it holds a partial log already.
            if !may_campaign(last_log) {
                raft.runtime_config().elect(false);
            }
            let target = self.learned().target;
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
                    raft.runtime_config().elect(true);
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

/// Rule 3: a leader or candidate below the learned floor is refused, and so is everyone while
/// the floor is unknown.
fn admits_term(term: u64, floor: Option<u64>) -> Result<(), String> {
    match floor {
        None => Err(format!(
            "lockd: node started with an empty data dir and has not yet learned the cluster's \
             term from its peers; refusing a message of term {term}"
        )),
        Some(f) if term < f => Err(format!(
            "lockd: node started with an empty data dir; term {term} is older than term {f} \
             its peers reported"
        )),
        Some(_) => Ok(()),
    }
}

/// Rule 1: a rejoining node votes only in a first-ever bootstrap: for a candidate that has
/// nothing past the initial membership entry at index 0.
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

/// Rule 2: a rejoining node campaigns only while it holds nothing past index 0.
fn may_campaign(last_log_index: Option<u64>) -> bool {
    last_log_index.is_none_or(|i| i == 0)
}

/// Peers whose answers always include a member of any electing majority but this node:
/// `n - majority + 1`, where the majority counts this node.
fn answers_needed(cluster_size: usize) -> usize {
    let majority = cluster_size / 2 + 1;
    cluster_size - majority + 1
}

/// The term floor the answers prove, if they prove one (rule 3 and the module docs).
fn term_floor(cluster_size: usize, reports: &[VoteReport]) -> Option<u64> {
    let max_term = reports
        .iter()
        .map(|r| r.vote.leader_id().term)
        .max()
        .unwrap_or(0);
    // A single node that lost its disk has nobody to ask: it is a new cluster.
    if cluster_size <= 1 || reports.len() >= answers_needed(cluster_size) {
        return Some(max_term);
    }
    // A first bootstrap: a majority, this node included, has nothing past index 0; that is
    // `cluster_size / 2` peers besides this node.
    let bootstrap = reports.len() >= cluster_size / 2
        && reports.iter().all(|r| may_campaign(r.last_log_index));
    bootstrap.then_some(max_term)
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
            learned: Mutex::new(Learned {
                target: None,
                term_floor: Some(5),
            }),
            store: None,
        };
        // A new leader of term 5 that has not committed in its term yet reports an older
        // commit, which may lag behind what was committed before: not a target.
        gate.observe_append(5, Some(log_id(4, 90)));
        assert_eq!(gate.learned().target, None);
        gate.observe_append(5, Some(log_id(5, 101)));
        gate.observe_append(5, Some(log_id(5, 140)));
        assert_eq!(gate.learned().target, Some(101));
        assert!(gate.admits_candidate(5, Some(log_id(5, 140))).is_err());
        assert!(gate.admits_candidate(5, Some(log_id(0, 0))).is_ok());
    }

    /// Review of issue 14, finding 7 (rule 2): a node halfway through catching up must not
    /// campaign; only one holding nothing past the initial membership may (first bootstrap).
    #[test]
    fn review14_a_rejoining_node_with_a_partial_log_does_not_campaign() {
        assert!(may_campaign(None));
        assert!(may_campaign(Some(0)));
        assert!(!may_campaign(Some(1)));
        assert!(!may_campaign(Some(5_000)));
    }

    fn report(term: u64, last_log_index: Option<u64>) -> VoteReport {
        VoteReport {
            vote: openraft::Vote::new(term, 1),
            last_log_index,
        }
    }

    /// Review of issue 14, finding 7 (rule 3): the floor needs answers that must include a
    /// member of the majority that elected the newest leader.
    #[test]
    fn review14_the_term_floor_needs_enough_peers_or_a_bootstrap() {
        assert_eq!(answers_needed(1), 1);
        assert_eq!(answers_needed(3), 2);
        assert_eq!(answers_needed(5), 3);
        // A single node that lost its disk is a new cluster.
        assert_eq!(term_floor(1, &[]), Some(0));
        // Three nodes: one answer from a peer with a log is not enough (the other may hold the
        // newer term), two are.
        assert_eq!(term_floor(3, &[report(4, Some(90))]), None);
        assert_eq!(
            term_floor(3, &[report(4, Some(90)), report(9, Some(70))]),
            Some(9)
        );
        // A first bootstrap: the one peer that answered is empty too.
        assert_eq!(term_floor(3, &[report(1, Some(0))]), Some(1));
        assert_eq!(term_floor(3, &[report(0, None)]), Some(0));
        assert_eq!(term_floor(3, &[]), None);
        // Five nodes: two empty peers and this node are a majority; one empty peer is not.
        assert_eq!(
            term_floor(5, &[report(1, Some(0)), report(1, None)]),
            Some(1)
        );
        assert_eq!(term_floor(5, &[report(1, Some(0))]), None);
        assert_eq!(
            term_floor(5, &[report(3, Some(0)), report(1, Some(8))]),
            None
        );
    }

    #[test]
    fn review14_a_rejoining_node_refuses_terms_below_the_floor_and_all_before_it() {
        let e = admits_term(7, None).unwrap_err();
        assert!(e.starts_with("lockd: ") && e.contains("term 7"), "{e}");
        let e = admits_term(7, Some(9)).unwrap_err();
        assert!(e.contains("term 7") && e.contains("term 9"), "{e}");
        assert!(admits_term(9, Some(9)).is_ok());
        assert!(admits_term(10, Some(9)).is_ok());

        let gate = VoteGate {
            open: AtomicBool::new(false),
            learned: Mutex::new(Learned::default()),
            store: None,
        };
        assert!(gate.admits_candidate(3, None).is_err(), "floor unknown");
        gate.learned().term_floor = Some(4);
        assert!(gate.admits_candidate(3, None).is_err(), "below the floor");
        assert!(gate.admits_candidate(4, None).is_ok());
        gate.open.store(true, Ordering::Release);
        assert!(
            gate.admits_candidate(1, Some(log_id(1, 50))).is_ok(),
            "open"
        );
    }
}

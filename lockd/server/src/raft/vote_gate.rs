//! Keeps a node that lost its disk from voting, campaigning or following a stale leader until it
//! holds every committed entry again.
//!
//! Raft's safety assumes a voter never forgets its log or its term. A node restarted with an empty
//! data dir has forgotten both, so it is *rejoining*: it records that durably and first asks its
//! peers (`CurrentVote`) for their vote and last log id. Answers from `n - majority + 1` peers
//! always include a member of every majority but this node, so their highest vote term is at
//! least the term of every leader this node may have helped elect, and their highest last log id
//! is at least the last entry of every commit this node may have been part of. Until it has that
//! *proof* the node accepts no Raft message and starts no election. With it, until it has applied
//! the commit index a leader reports in that leader's own term (a commit in the leader's own term
//! covers every entry committed before: the leader holds them all), three rules hold, each
//! closing one way a wiped node could let committed entries be lost and tokens repeat:
//!
//! 1. **Votes only for a complete log**: it grants a vote only to a
//!    candidate whose last log id is at least the proof's, in a term above the proof's. An empty
//!    log would otherwise let a lagging candidate win without entries committed while this node
//!    held them; the strict term keeps it from voting twice in a term it already voted in.
//! 2. **Campaigns only on a complete log**: elections stay off until its
//!    own last log id reaches the proof's. A node halfway through catching up could otherwise win
//!    with the vote of a node that lags further.
//! 3. **Follows no older term**: it refuses appends and snapshots of a term
//!    below the proof's. A deposed leader of an older term could otherwise replicate through the
//!    node that forgot the newer term and commit entries that overwrite ones committed in it.
//!
//! A first-ever bootstrap starts every node empty, and the same proof tells it apart: if no
//! answering peer holds anything past the initial membership entry, nothing was ever committed,
//! and the node proposes the initial membership (`initialize`) and campaigns. A lagging peer at
//! index 0 cannot fake this, because the answers always include a member of every commit quorum.
//! The price: a new cluster forms only once `n - majority + 1` peers of each node have started
//! (for three nodes: all three, once), and with one node wiped and another lost the wiped node
//! accepts nothing until a node that holds the log returns, which is the Raft answer to two
//! failures out of three.
//!
//! Known limit: the proof's term is the highest any peer reports, which can be a failed
//! candidate's. If a one-way partition lets a candidate's term climb past the live leader's, the
//! wiped node refuses that leader until the partition heals (safe, but with a second fault the
//! cluster waits).
//!
//! Known hole (five or more voters, two disks lost at once): an answer from a peer that is itself
//! rejoining counts toward the proof. With voters 1-5, an entry committed by {1,4,5}, and nodes 4
//! and 5 wiped, node 4 can form its proof from 2, 3 and the empty 5 and miss the entry. A fix
//! that counts only answers of peers that kept their log waits in `wip/vote-gate-rejoining.patch`
//! until its own liveness finding is fixed. Three-node clusters are not exposed: two wiped nodes
//! of three are beyond what the gate tolerates.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use openraft::storage::RaftLogStorage;
use openraft::{BasicNode, ServerState};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::{LogId, NodeId, Raft};
use crate::storage::log_store::LogStore;

/// How often a rejoining node looks whether it has caught up, besides on metric changes.
const CATCH_UP_POLL: Duration = Duration::from_millis(100);
/// Pause between two rounds of asking the peers while too few answered.
const ASK_RETRY: Duration = Duration::from_millis(200);
/// How often the node says, while it waits for peers, why it does not take part yet.
const WAIT_LOG_EVERY: Duration = Duration::from_secs(5);

/// A peer's answer to `CurrentVote`: its vote (term and whom it follows) and its last log id.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VoteReport {
    pub vote: openraft::Vote<NodeId>,
    pub last_log_id: Option<LogId>,
}

/// What enough peers' answers prove (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Proof {
    /// No leader this node may have helped elect has a higher term.
    term: u64,
    /// No entry this node may have helped commit lies past it.
    log: Option<LogId>,
}

impl Proof {
    /// Nothing past the initial membership entry was ever committed: a first bootstrap.
    fn fresh_cluster(&self) -> bool {
        self.log.is_none_or(|l| l.index == 0)
    }
}

/// Whether this node may vote, campaign and follow; shared by the Raft service and the task that
/// opens it.
pub struct VoteGate {
    /// True once the node has caught up; read on every Raft message without the lock.
    open: AtomicBool,
    /// What a rejoining node has learned so far.
    learned: Mutex<Learned>,
    /// Where the rejoining flag is kept, to clear it once caught up, and this node's log.
    store: Option<LogStore>,
}

#[derive(Default)]
struct Learned {
    /// The commit index to apply before opening, once a leader has reported one in its own term.
    target: Option<u64>,
    /// Once enough peers answered.
    proof: Option<Proof>,
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

    /// A gate closed until [`VoteGate::rejoin`] sees the node caught up; `store` holds the
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
    /// the error says why not.
    pub fn admits_leader(&self, term: u64) -> Result<(), String> {
        if self.is_open() {
            return Ok(());
        }
        admits_leader_while_rejoining(term, self.learned().proof)
    }

    /// Whether a vote request of a candidate in `term` with `candidate_last_log` may reach Raft
    /// (rule 1); the error says why not.
    pub fn admits_candidate(
        &self,
        term: u64,
        candidate_last_log: Option<LogId>,
    ) -> Result<(), String> {
        if self.is_open() {
            return Ok(());
        }
        admits_candidate_while_rejoining(term, candidate_last_log, self.learned().proof)
    }

    /// Runs a rejoining node until it has caught up: learns the proof from the peers, proposes
    /// the initial membership if the cluster is new, keeps elections off until the node's log is
    /// complete (rule 2), and opens the gate once caught up, clearing the durable flag first.
    /// `ask` asks every peer once; `members` is the initial membership.
    pub async fn rejoin<F, Fut>(
        &self,
        raft: Raft,
        members: BTreeMap<NodeId, BasicNode>,
        mut ask: F,
        shutdown: CancellationToken,
    ) where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Vec<VoteReport>>,
    {
        let Some(store) = self.store.clone() else {
            return;
        };
        raft.runtime_config().elect(false);
        let cluster_size = members.len();
        let mut last_log = tokio::time::Instant::now();
        let proof = loop {
            let reports = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = ask() => r,
            };
            if let Some(proof) = proof_from(cluster_size, &reports) {
                break proof;
            }
            if last_log.elapsed() >= WAIT_LOG_EVERY {
                last_log = tokio::time::Instant::now();
                tracing::warn!(
                    answers = reports.len(),
                    needed = answers_needed(cluster_size),
                    "rejoining after an empty data dir: too few peers answered to know what \
                     the lost disk held; taking no part in replication until they do"
                );
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(ASK_RETRY) => {}
            }
        };
        tracing::info!(
            term = proof.term,
            log = ?proof.log,
            "rejoining: learned the cluster's term and log end from peers"
        );
        self.learned().proof = Some(proof);
        if proof.fresh_cluster()
            && let Err(e) = raft.initialize(members).await
        {
            tracing::info!(error = %e, "initialize skipped");
        }

        let mut rx = raft.metrics();
        let mut poll = tokio::time::interval(CATCH_UP_POLL);
        let mut own = store.clone();
        while !self.is_open() {
            let (applied, state) = {
                let m = rx.borrow();
                (m.last_applied.map(|l| l.index), m.state)
            };
            match own.get_log_state().await {
                Ok(s) => raft
                    .runtime_config()
                    .elect(may_campaign(s.last_log_id, &proof)),
                Err(e) => tracing::error!(error = %e, "lockd: reading the log state"),
            }
            let target = self.learned().target;
            if caught_up(target, applied, state == ServerState::Leader) {
                if let Err(e) = store.set_rejoining(false).await {
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

/// Rule 3: nothing before the proof, and no leader of an older term after it.
fn admits_leader_while_rejoining(term: u64, proof: Option<Proof>) -> Result<(), String> {
    let p = proof.ok_or_else(|| not_yet_proven(term))?;
    if term < p.term {
        return Err(format!(
            "lockd: node started with an empty data dir; leader term {term} is older than term \
             {} its peers reported",
            p.term
        ));
    }
    Ok(())
}

/// Rule 1: nothing before the proof; after it, only a candidate in a newer term whose log is at
/// least as far as every commit this node may have been part of.
fn admits_candidate_while_rejoining(
    term: u64,
    candidate_last_log: Option<LogId>,
    proof: Option<Proof>,
) -> Result<(), String> {
    let p = proof.ok_or_else(|| not_yet_proven(term))?;
    if term <= p.term {
        return Err(format!(
            "lockd: node started with an empty data dir; not voting in term {term}, which is not \
             newer than term {} its peers reported (it may have voted in it before)",
            p.term
        ));
    }
    if candidate_last_log < p.log {
        return Err(format!(
            "lockd: node started with an empty data dir; not voting for a candidate whose last \
             log id {} is behind {} its peers hold",
            show(candidate_last_log),
            show(p.log)
        ));
    }
    Ok(())
}

fn not_yet_proven(term: u64) -> String {
    format!(
        "lockd: node started with an empty data dir and has not yet heard from enough peers to \
         know what its lost disk held; refusing a message of term {term}"
    )
}

fn show(l: Option<LogId>) -> String {
    l.map_or_else(
        || "none".to_owned(),
        |l| format!("{}-{}", l.leader_id.term, l.index),
    )
}

/// Rule 2: a rejoining node campaigns only once its log reaches the proof's.
fn may_campaign(own_last_log: Option<LogId>, proof: &Proof) -> bool {
    own_last_log >= proof.log
}

/// Peers whose answers always include a member of any majority other than this node:
/// `n - majority + 1`, where the majority counts this node.
fn answers_needed(cluster_size: usize) -> usize {
    let majority = cluster_size / 2 + 1;
    cluster_size - majority + 1
}

/// What the answers prove, if there are enough of them.
fn proof_from(cluster_size: usize, reports: &[VoteReport]) -> Option<Proof> {
    // A single node that lost its disk has nobody to ask: it is a new cluster.
    if cluster_size > 1 && reports.len() < answers_needed(cluster_size) {
        return None;
    }
    Some(Proof {
        term: reports
            .iter()
            .map(|r| r.vote.leader_id().term)
            .max()
            .unwrap_or(0),
        log: reports.iter().filter_map(|r| r.last_log_id).max(),
    })
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

    fn report(term: u64, last: Option<(u64, u64)>) -> VoteReport {
        VoteReport {
            vote: openraft::Vote::new(term, 1),
            last_log_id: last.map(|(t, i)| log_id(t, i)),
        }
    }

    fn closed_gate(proof: Option<Proof>) -> VoteGate {
        VoteGate {
            open: AtomicBool::new(false),
            learned: Mutex::new(Learned {
                target: None,
                proof,
            }),
            store: None,
        }
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
        let gate = closed_gate(None);
        // A new leader of term 5 that has not committed in its term yet reports an older
        // commit, which may lag behind what was committed before: not a target.
        gate.observe_append(5, Some(log_id(4, 90)));
        assert_eq!(gate.learned().target, None);
        gate.observe_append(5, Some(log_id(5, 101)));
        gate.observe_append(5, Some(log_id(5, 140)));
        assert_eq!(gate.learned().target, Some(101));
    }

    /// The proof needs answers that must include a member of every majority but this node.
    #[test]
    fn review14_the_proof_needs_n_minus_majority_plus_one_answers() {
        assert_eq!(answers_needed(1), 1);
        assert_eq!(answers_needed(3), 2);
        assert_eq!(answers_needed(5), 3);
        // A single node that lost its disk is a new cluster.
        assert!(proof_from(1, &[]).unwrap().fresh_cluster());
        // Three nodes: one answer is not enough, whatever it says: the silent peer may hold
        // the log (review: a peer lagging at index 0 looks like a new cluster).
        assert_eq!(proof_from(3, &[report(4, Some((4, 90)))]), None);
        assert_eq!(proof_from(3, &[report(1, Some((0, 0)))]), None);
        assert_eq!(proof_from(3, &[]), None);
        let p = proof_from(3, &[report(4, Some((4, 90))), report(9, Some((0, 0)))]).unwrap();
        assert_eq!(p.term, 9);
        assert_eq!(p.log, Some(log_id(4, 90)));
        assert!(!p.fresh_cluster());
        // Every answering peer holds at most the initial membership: a first bootstrap.
        let p = proof_from(3, &[report(1, Some((0, 0))), report(0, None)]).unwrap();
        assert!(p.fresh_cluster());
        // Five nodes: three answers.
        assert_eq!(
            proof_from(5, &[report(1, Some((1, 5))), report(1, None)]),
            None
        );
    }

    /// Rule 1: only a candidate in a newer term whose log reaches
    /// every commit this node may have been part of.
    #[test]
    fn review14_a_rejoining_node_votes_only_for_a_complete_log_in_a_newer_term() {
        let e = admits_candidate_while_rejoining(9, Some(log_id(8, 500)), None).unwrap_err();
        assert!(e.starts_with("lockd: ") && e.contains("term 9"), "{e}");
        let p = Some(Proof {
            term: 7,
            log: Some(log_id(6, 100)),
        });
        // A lagging candidate, even one at index 0 as in a first bootstrap, is refused.
        let e = admits_candidate_while_rejoining(8, Some(log_id(0, 0)), p).unwrap_err();
        assert!(e.contains("0-0") && e.contains("6-100"), "{e}");
        assert!(admits_candidate_while_rejoining(8, Some(log_id(6, 99)), p).is_err());
        assert!(admits_candidate_while_rejoining(8, None, p).is_err());
        // Not in the proof's term, where this node may have voted before its disk was lost.
        let e = admits_candidate_while_rejoining(7, Some(log_id(6, 100)), p).unwrap_err();
        assert!(e.contains("term 7"), "{e}");
        assert!(admits_candidate_while_rejoining(8, Some(log_id(6, 100)), p).is_ok());
        assert!(admits_candidate_while_rejoining(8, Some(log_id(7, 3)), p).is_ok());
        // A first bootstrap: any candidate in a newer term.
        let fresh = Some(Proof {
            term: 1,
            log: Some(log_id(0, 0)),
        });
        assert!(admits_candidate_while_rejoining(2, Some(log_id(0, 0)), fresh).is_ok());
    }

    /// Rule 2: a node halfway through catching up does not campaign.
    #[test]
    fn review14_a_rejoining_node_with_a_partial_log_does_not_campaign() {
        let p = Proof {
            term: 7,
            log: Some(log_id(6, 100)),
        };
        assert!(!may_campaign(None, &p));
        assert!(!may_campaign(Some(log_id(0, 0)), &p));
        assert!(!may_campaign(Some(log_id(6, 60)), &p));
        assert!(may_campaign(Some(log_id(6, 100)), &p));
        let fresh = Proof { term: 1, log: None };
        assert!(may_campaign(None, &fresh));
    }

    /// Rule 3: nothing before the proof, no older term after it.
    #[test]
    fn review14_a_rejoining_node_follows_no_older_term() {
        let e = admits_leader_while_rejoining(7, None).unwrap_err();
        assert!(e.starts_with("lockd: ") && e.contains("term 7"), "{e}");
        let p = Some(Proof {
            term: 9,
            log: Some(log_id(9, 10)),
        });
        let e = admits_leader_while_rejoining(7, p).unwrap_err();
        assert!(e.contains("term 7") && e.contains("term 9"), "{e}");
        assert!(admits_leader_while_rejoining(9, p).is_ok());
        assert!(admits_leader_while_rejoining(10, p).is_ok());

        let gate = closed_gate(None);
        assert!(gate.admits_leader(9).is_err(), "proof unknown");
        assert!(gate.admits_candidate(9, None).is_err(), "proof unknown");
        gate.learned().proof = p;
        assert!(gate.admits_leader(9).is_ok());
        gate.open.store(true, Ordering::Release);
        assert!(gate.admits_leader(1).is_ok(), "open");
        assert!(gate.admits_candidate(1, None).is_ok(), "open");
    }
}

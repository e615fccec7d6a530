//! Keeps a node that lost its disk from voting, campaigning or following a stale leader until it
//! holds every committed entry again.
//!
//! Raft's safety assumes a voter never forgets its log or its term. A node restarted with an empty
//! data dir has forgotten both, so it is *rejoining*: it records that durably and first asks its
//! peers (`CurrentVote`) for their vote and last log id, and whether they are rejoining
//! themselves. Answers from `n - majority + 1` peers that are *not* rejoining (that kept their
//! log) always include a member of every majority but this node, so their highest vote term is at
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
//! # Answers of rejoining peers
//!
//! A peer answers "rejoining" while its own gate is closed: before its proof, and after it while
//! it catches up. Its vote and log say nothing about what the cluster committed (it may have lost
//! exactly the commits in question), so such an answer never counts toward the proof of a cluster
//! with history; its term and log id still enter the bound (they come from real candidates and
//! leaders, so they can only raise it). If fewer than `n - majority + 1` answers come from peers
//! that kept their log, the node keeps asking, and says so every few seconds. Three cases:
//!
//! - **Five voters, two wiped.** Entry 100 is committed by {1, 4, 5}; 4 and 5 lose their disks
//!   (two failures of five: within tolerance). Node 4 hears from 2 and 3 (both at 99) and from 5.
//!   Counting 5 would make three answers and a proof that stops at 99; node 2 could then win with
//!   the votes of {2, 3, 4, 5} and overwrite entry 100, reusing its token. Without 5 there are
//!   two, so node 4 waits for node 1, whose answer brings the bound to 100.
//! - **Three voters, one wiped and then another.** If two nodes are empty at once, a commit the
//!   two made may exist nowhere else: beyond what Raft tolerates. Each wiped node has one answer
//!   from a node that kept its log and needs two, so it waits (for good, if both are wiped, until
//!   an operator restores a disk) rather than take the third node's log as the truth. If the
//!   first wiped node already had its proof and catches up from the third, its gate opens, its
//!   answer counts again, and the second proceeds: two failures one after the other, each
//!   within tolerance.
//! - **A rejoining node that caught up partially** holds a prefix of the log (and maybe entries
//!   of a deposed leader) but not necessarily every committed entry, so its answer does not
//!   count until it has applied a commit of its leader's own term, when its gate opens.
//!
//! Older nodes do not say whether they kept their log (`kept_log` is absent from their reply):
//! their answers count neither toward the proof nor toward a first bootstrap, so a wiped node
//! beside older peers waits until they are upgraded. Upgrade every node before re-provisioning a
//! disk.
//!
//! # Restored clusters
//!
//! Members of a cluster restored from a backup share a *restore id* (`raft::restore_id`,
//! `backup::restore`). Only answers that carry this node's restore id count, toward the proof
//! and toward a first bootstrap; an answer of a member of another restore, or of the old cluster,
//! says nothing about what this cluster committed. A wiped node has no restore id (it was on the
//! lost disk): it groups the answers by restore id, and if the answers of one id make a proof it
//! records that id durably, before the proof, and keeps it for good. At most one id can make a
//! proof: it takes `n - majority + 1` answers, and two such groups do not fit among `n - 1`
//! peers.
//!
//! # Restarts while rejoining
//!
//! The proof is kept in the data dir beside the rejoining flag, and a node restarted before it
//! caught up resumes with it instead of asking again. Asking again would be safe but can wait
//! for good: right after a first bootstrap every node but the leader is still rejoining, and if
//! all restart then, each finds only one peer that kept its log (the old leader) and its other
//! answers come from a rejoining peer that already holds entries, which is neither a proof nor a
//! first bootstrap. Reusing the proof is sound because it bounds what the *lost* disk held, which
//! no later event changes; what the node did since (votes, entries) is on its disk like any
//! node's. The proof is cleared with the flag once the node has caught up.
//!
//! # First bootstrap
//!
//! A first-ever bootstrap starts every node empty, so every node is rejoining and every answer is
//! a rejoining one. It is recognised when **every** peer answered, each rejoining and holding
//! nothing past the initial membership entry (or when `n - majority + 1` peers that kept their
//! log hold nothing past it); only then does the node propose the initial membership
//! (`initialize`) and campaign. Every peer, not only `n - majority + 1`: an empty, rejoining
//! answer does not mean a lost disk. Right after a first bootstrap a follower that has not yet
//! applied a commit of the leader's term, or a node that started late, answers exactly that
//! while the cluster has history; with five voters, answers of two such nodes and of one wiped
//! node would otherwise pass for a new cluster while the node that holds the commit is slow to
//! answer (review). When every node is empty, every node that held an entry lost its disk: a
//! majority at once, beyond what Raft tolerates. A peer that kept its log but lags at index 0
//! cannot fake a new cluster either: its answer only counts among `n - majority + 1` answers of
//! such peers, which include a member of every commit quorum. The price: a new cluster forms only
//! once every node has started, and with one node wiped and another lost the wiped node accepts
//! nothing until a node that holds the log returns, which is the Raft answer to two failures out
//! of three.
//!
//! Known limit: beyond tolerance the bootstrap test can be fooled. If every disk is lost (or all
//! but nodes that lag at the initial membership entry), the empty nodes form a new cluster and
//! issue tokens from the start again. Only an explicit bootstrap step would tell that apart from
//! a first start.
//!
//! Known limit: the proof's term is the highest any peer reports, which can be a failed
//! candidate's. If a one-way partition lets a candidate's term climb past the live leader's, the
//! wiped node refuses that leader until the partition heals (safe, but with a second fault the
//! cluster waits).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::storage::RaftLogStorage;
use openraft::{BasicNode, ServerState};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::restore_id::RestoreIdentity;
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
    /// Whether the answering node's log bounds what the cluster committed. Carried in
    /// `CurrentVoteReply.kept_log`, beside the postcard payload, so the payload stays what older
    /// nodes send and read.
    #[serde(skip)]
    pub standing: Standing,
    /// The answering node's restore id, carried in `CurrentVoteReply.restore_id`.
    #[serde(skip)]
    pub restore_id: Option<String>,
}

/// What a peer's `CurrentVote` answer says about its own log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Standing {
    /// It kept its log, or has caught up since it lost it (its gate is open).
    KeptLog,
    /// It is rejoining itself (its gate is closed): its log may lack the very commits in question.
    Rejoining,
    /// An older node, which does not say. Its answer counts neither way: it never vouches for
    /// what the cluster committed, nor for a first bootstrap (fail closed in a mixed cluster).
    #[default]
    Unknown,
}

impl Standing {
    /// Reads `CurrentVoteReply.kept_log` (absent in an older node's reply).
    pub fn from_kept_log(kept_log: Option<bool>) -> Self {
        match kept_log {
            Some(true) => Standing::KeptLog,
            Some(false) => Standing::Rejoining,
            None => Standing::Unknown,
        }
    }
}

/// What enough peers' answers prove (see the module docs). Kept in the data dir beside the
/// rejoining flag (`LogStore::set_rejoin_proof`) until the node has caught up
/// (`LogStore::finish_rejoining` clears both).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
    /// This node's restore id: only answers with it count; a wiped node learns it here.
    restore: Arc<RestoreIdentity>,
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
    pub fn open(restore: Arc<RestoreIdentity>) -> Self {
        VoteGate {
            open: AtomicBool::new(true),
            learned: Mutex::new(Learned::default()),
            store: None,
            restore,
        }
    }

    /// A gate closed until [`VoteGate::rejoin`] sees the node caught up; `store` holds the
    /// durable rejoining flag it clears then, and the proof if the node learned one before a
    /// restart (then it needs no new answers: see "Restarts while rejoining" in the module docs).
    pub fn rejoining(store: LogStore, restore: Arc<RestoreIdentity>) -> anyhow::Result<Self> {
        let proof = store.rejoin_proof::<Proof>()?;
        Ok(VoteGate {
            open: AtomicBool::new(false),
            learned: Mutex::new(Learned {
                target: None,
                proof,
            }),
            store: Some(store),
            restore,
        })
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
        let kept = self.learned().proof;
        let proof = match kept {
            Some(proof) => {
                tracing::info!(
                    term = proof.term,
                    log = ?proof.log,
                    "rejoining: resuming with the term and log end learned from peers before \
                     the restart"
                );
                proof
            }
            None => {
                let Some((proof, restore_id)) =
                    ask_until_proven(cluster_size, &mut ask, &self.restore, &shutdown).await
                else {
                    return;
                };
                if let Some(id) = restore_id
                    && self.restore.get().is_none()
                {
                    // On disk before anything depends on it: a restart must not forget which
                    // restored cluster vouched for this node.
                    while let Err(e) = store.set_restore_id(&id).await {
                        tracing::error!(
                            error = %e,
                            "lockd: recording the restore id learned from peers; taking no part \
                             in replication until it is on disk"
                        );
                        tokio::select! {
                            _ = shutdown.cancelled() => return,
                            _ = tokio::time::sleep(ASK_RETRY) => {}
                        }
                    }
                    if let Err(e) = self.restore.adopt(&id) {
                        tracing::error!(error = %e, "lockd: taking the restore id");
                        return;
                    }
                    tracing::info!(
                        restore_id = %id,
                        "rejoining: the peers that vouched were restored from a backup; this \
                         node keeps their restore id"
                    );
                }
                tracing::info!(
                    term = proof.term,
                    log = ?proof.log,
                    "rejoining: learned the cluster's term and log end from peers"
                );
                // Kept for a restart before catching up: by then the peers that vouched may be
                // rejoining too, and their answers would no longer count. Without it the node
                // asks again after a restart, which is safe but may wait for good.
                // Durable before use, like the flag: retried until it is, or until shutdown.
                while let Err(e) = store.set_rejoin_proof(&proof).await {
                    tracing::error!(
                        error = %e,
                        "lockd: recording the rejoin proof; taking no part in replication \
                         until it is on disk"
                    );
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(ASK_RETRY) => {}
                    }
                }
                self.learned().proof = Some(proof);
                proof
            }
        };
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
                if let Err(e) = store.finish_rejoining().await {
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

/// Asks the peers until their answers make a proof; `None` on shutdown. With the proof, the
/// restore id of the answers that made it.
async fn ask_until_proven<F, Fut>(
    cluster_size: usize,
    ask: &mut F,
    restore: &RestoreIdentity,
    shutdown: &CancellationToken,
) -> Option<(Proof, Option<String>)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Vec<VoteReport>>,
{
    let mut last_log = tokio::time::Instant::now();
    loop {
        let reports = tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = ask() => r,
        };
        if let Some(found) = proof_for(cluster_size, &reports, restore.get()) {
            return Some(found);
        }
        if last_log.elapsed() >= WAIT_LOG_EVERY {
            last_log = tokio::time::Instant::now();
            let kept = reports
                .iter()
                .filter(|r| r.standing == Standing::KeptLog)
                .count();
            let other_restore = reports
                .iter()
                .filter(|r| restore.get().is_some() && r.restore_id.as_deref() != restore.get())
                .count();
            tracing::warn!(
                answers = reports.len(),
                from_peers_that_kept_their_log = kept,
                from_peers_of_another_restore = other_restore,
                needed = answers_needed(cluster_size),
                "rejoining after an empty data dir: too few peers that kept their log \
                 answered to know what the lost disk held (answers of peers that are \
                 rejoining themselves count only when all are empty, as in a first \
                 bootstrap); taking no part in replication until they do"
            );
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(ASK_RETRY) => {}
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

/// What the answers of the peers with this node's restore id (`own`) prove; a node without one
/// (a wiped node) tries the answers of each restore id, and gets back the id whose answers
/// proved (see "Restored clusters" in the module docs).
fn proof_for(
    cluster_size: usize,
    reports: &[VoteReport],
    own: Option<&str>,
) -> Option<(Proof, Option<String>)> {
    let mut ids: Vec<Option<&str>> = vec![own];
    if own.is_none() {
        for r in reports {
            if !ids.contains(&r.restore_id.as_deref()) {
                ids.push(r.restore_id.as_deref());
            }
        }
    }
    ids.into_iter().find_map(|id| {
        let group: Vec<VoteReport> = reports
            .iter()
            .filter(|r| r.restore_id.as_deref() == id)
            .cloned()
            .collect();
        proof_from(cluster_size, &group).map(|p| (p, id.map(str::to_owned)))
    })
}

/// What the answers prove, if there are enough of them: `n - majority + 1` from peers that kept
/// their log, or, for a first bootstrap, answers of every peer, each rejoining and holding
/// nothing past the initial membership entry (see the module docs). Answers of older nodes,
/// which do not say, count for neither.
fn proof_from(cluster_size: usize, reports: &[VoteReport]) -> Option<Proof> {
    let needed = answers_needed(cluster_size);
    let holding = reports
        .iter()
        .filter(|r| r.standing == Standing::KeptLog)
        .count();
    let first_bootstrap = reports.len() >= cluster_size - 1
        && reports.iter().all(|r| {
            r.standing == Standing::Rejoining && r.last_log_id.is_none_or(|l| l.index == 0)
        });
    // A single node that lost its disk has nobody to ask: it is a new cluster.
    if cluster_size > 1 && holding < needed && !first_bootstrap {
        return None;
    }
    // The bound comes from the holding answers; a rejoining peer's vote and entries came from
    // real candidates and leaders, so counting them too can only raise it.
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
            standing: Standing::KeptLog,
            restore_id: None,
        }
    }

    /// The answer of a peer that is itself rejoining (gate closed).
    fn rejoining(term: u64, last: Option<(u64, u64)>) -> VoteReport {
        VoteReport {
            standing: Standing::Rejoining,
            ..report(term, last)
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
            restore: Arc::new(RestoreIdentity::new(None)),
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

    /// Five voters; entry 3-100 committed by {1, 4, 5}; nodes 4 and 5 lose their disks (two
    /// failures out of five: within tolerance). Node 4 hears from 2 and 3 (both at 3-99) and from
    /// 5, which is rejoining too: that is three answers, but only two from nodes that hold their
    /// log, so 4 must wait for node 1. Proving 3-99 instead would let node 2 win with the votes
    /// of {2, 3, 4, 5} and overwrite entry 100.
    #[test]
    fn five_nodes_two_wiped_wait_for_the_node_that_holds_the_commit() {
        let (n2, n3) = (report(3, Some((3, 99))), report(3, Some((3, 99))));
        let n1 = report(3, Some((3, 100)));
        // Node 5 empty, or partway through catching up: either way its answer does not count.
        for n5 in [rejoining(0, None), rejoining(3, Some((3, 60)))] {
            let early = [n2.clone(), n3.clone(), n5.clone()];
            assert_eq!(proof_from(5, &early), None, "node 5 answered {n5:?}");
            let p = proof_from(5, &[n2.clone(), n3.clone(), n5, n1.clone()]).unwrap();
            assert_eq!(p.log, Some(log_id(3, 100)));
            assert_eq!(p.term, 3);
            assert!(!p.fresh_cluster());
        }
        // Two peers lagging at the initial membership entry and a rejoining one: not a new
        // cluster, whatever they say (node 1 may hold commits they never saw).
        let lagging = [
            report(1, Some((0, 0))),
            report(1, Some((0, 0))),
            rejoining(0, None),
        ];
        assert_eq!(proof_from(5, &lagging), None);
    }

    /// Three voters: one wiped node and another wiped node is beyond what Raft tolerates (an
    /// entry committed by the two of them exists nowhere else), so the node waits: a rejoining
    /// peer's answer, empty or partial, never completes the proof. Once that peer has caught
    /// up (its gate open) its answer counts again.
    #[test]
    fn three_nodes_a_second_wiped_node_does_not_complete_the_proof() {
        let holder = report(4, Some((4, 90)));
        for other in [rejoining(0, None), rejoining(4, Some((4, 30)))] {
            assert_eq!(proof_from(3, &[other.clone(), holder.clone()]), None);
        }
        // Even if the only node that kept its log lags at the initial membership entry.
        assert_eq!(
            proof_from(3, &[rejoining(0, None), report(1, Some((0, 0)))]),
            None
        );
        let p = proof_from(3, &[report(4, Some((4, 90))), holder]).unwrap();
        assert_eq!(p.log, Some(log_id(4, 90)));
    }

    /// A first bootstrap: every node starts empty, so every answer is a rejoining one, and the
    /// cluster still forms once every peer answered, all empty.
    #[test]
    fn a_first_bootstrap_forms_on_rejoining_answers_that_are_all_empty() {
        let p = proof_from(3, &[rejoining(0, None), rejoining(1, Some((0, 0)))]).unwrap();
        assert!(p.fresh_cluster());
        assert_eq!(p.term, 1);
        assert_eq!(
            proof_from(3, &[rejoining(0, None)]),
            None,
            "too few answers"
        );
        // Five voters: every peer must answer, not only three. Review schedule: nodes 1-3
        // committed tokens while 4 and 5 had not caught up; nodes 1 and 2 lose their disks; node
        // 3, which holds the commits, is slow to answer. Node 2 hears only the empty nodes 1, 4
        // and 5, and must not take that for a new cluster.
        let empty = || rejoining(0, None);
        assert_eq!(proof_from(5, &[empty(), empty(), empty()]), None);
        let p = proof_from(5, &[empty(), empty(), empty(), empty()]);
        assert!(p.unwrap().fresh_cluster());
        assert_eq!(
            proof_from(5, &[empty(), empty(), empty(), rejoining(1, Some((1, 2)))]),
            None,
            "node 3 answers: the cluster has history"
        );
        // A rejoining peer that already holds entries: the cluster has history.
        assert_eq!(
            proof_from(3, &[rejoining(0, None), rejoining(2, Some((2, 7)))]),
            None
        );
    }

    /// The answer of an older node, which does not say whether it kept its log.
    fn older(term: u64, last: Option<(u64, u64)>) -> VoteReport {
        VoteReport {
            standing: Standing::Unknown,
            ..report(term, last)
        }
    }

    /// An older node's answer (no `kept_log`) vouches for nothing: not for what the cluster
    /// committed, and not for a first bootstrap. Read as "kept its log", it would reopen the
    /// five-voter hole in a mixed cluster; read as "rejoining", an older peer lagging at the
    /// initial membership entry would pass for a new cluster.
    #[test]
    fn an_older_nodes_answer_counts_for_neither_proof_nor_bootstrap() {
        assert_eq!(Standing::from_kept_log(None), Standing::Unknown);
        assert_eq!(Standing::from_kept_log(Some(true)), Standing::KeptLog);
        assert_eq!(Standing::from_kept_log(Some(false)), Standing::Rejoining);
        let (n2, n3) = (report(3, Some((3, 99))), report(3, Some((3, 99))));
        assert_eq!(
            proof_from(5, &[n2.clone(), n3.clone(), older(3, Some((3, 99)))]),
            None
        );
        assert!(proof_from(5, &[n2, n3, report(3, Some((3, 100)))]).is_some());
        assert_eq!(
            proof_from(
                5,
                &[
                    rejoining(0, None),
                    rejoining(0, None),
                    rejoining(0, None),
                    older(1, Some((0, 0)))
                ]
            ),
            None
        );
        assert_eq!(proof_from(3, &[older(0, None), older(0, None)]), None);
    }

    /// Goal: a node restarted while rejoining resumes with the proof it learned before, from its
    /// own data dir, instead of needing its peers to vouch again (right after a first bootstrap
    /// they may all be rejoining, and then no new proof can form: the cluster would wait for
    /// good). Cleared, the proof is gone after the next restart.
    #[tokio::test]
    async fn a_restart_while_rejoining_resumes_with_the_kept_proof() {
        use crate::storage::log_store::SnapshotGate;
        fn snapshots() -> SnapshotGate {
            tokio::sync::watch::channel(None).1
        }
        let dir = tempfile::tempdir().unwrap();
        let db = crate::storage::open(dir.path()).unwrap().log;
        let store = LogStore::new(db.clone(), snapshots());
        store.start_rejoining().await.unwrap();
        let gate =
            VoteGate::rejoining(store.clone(), Arc::new(RestoreIdentity::new(None))).unwrap();
        assert!(gate.admits_leader(3).is_err(), "nothing learned yet");
        let proof = Proof {
            term: 3,
            log: Some(log_id(3, 40)),
        };
        store.set_rejoin_proof(&proof).await.unwrap();
        drop((gate, store));

        let store = LogStore::new(db.clone(), snapshots());
        assert!(store.rejoining().unwrap());
        let gate =
            VoteGate::rejoining(store.clone(), Arc::new(RestoreIdentity::new(None))).unwrap();
        assert!(!gate.is_open());
        assert_eq!(gate.learned().proof, Some(proof));
        assert!(gate.admits_leader(3).is_ok());
        assert!(gate.admits_leader(2).is_err(), "rule 3 still holds");
        assert!(
            gate.admits_candidate(4, Some(log_id(3, 39))).is_err(),
            "rule 1 still holds"
        );
        assert!(gate.admits_candidate(4, Some(log_id(3, 40))).is_ok());

        // Another restart before catching up: the proof stays, also when the flag is set again.
        drop((gate, store));
        let store = LogStore::new(db.clone(), snapshots());
        store.start_rejoining().await.unwrap();
        assert_eq!(store.rejoin_proof::<Proof>().unwrap(), Some(proof));

        // Caught up: flag and proof go together, in one transaction.
        store.finish_rejoining().await.unwrap();
        drop(store);
        let store = LogStore::new(db, snapshots());
        assert!(!store.rejoining().unwrap());
        assert_eq!(store.rejoin_proof::<Proof>().unwrap(), None);
        assert_eq!(
            VoteGate::rejoining(store, Arc::new(RestoreIdentity::new(None)))
                .unwrap()
                .learned()
                .proof,
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

    /// Goal: only answers of this node's restore id count; a wiped node without one takes the
    /// id whose answers prove, never a mix, and an old member's answer (no id) does not make a
    /// proof beside restored members.
    #[test]
    fn answers_count_only_within_one_restore_id() {
        let with = |id: Option<&str>, r: VoteReport| VoteReport {
            restore_id: id.map(str::to_owned),
            ..r
        };
        let a1 = with(Some("a"), report(5, Some((5, 40))));
        let a2 = with(Some("a"), report(5, Some((5, 40))));
        let b = with(Some("b"), report(9, Some((9, 90))));
        let old = with(None, report(9, Some((9, 90))));
        // A restored node: its own id only.
        let (p, id) = proof_for(3, &[a1.clone(), a2.clone(), b.clone()], Some("a")).unwrap();
        assert_eq!((p.term, id.as_deref()), (5, Some("a")));
        assert_eq!(proof_for(3, &[a1.clone(), b.clone()], Some("a")), None);
        assert_eq!(proof_for(3, &[a1.clone(), old.clone()], Some("a")), None);
        // A wiped node: the id whose answers prove, with the bound of those answers only.
        let (p, id) = proof_for(3, &[old.clone(), a1.clone(), a2.clone()], None).unwrap();
        assert_eq!(
            (p.term, p.log, id.as_deref()),
            (5, Some(log_id(5, 40)), Some("a"))
        );
        assert_eq!(proof_for(3, &[a1.clone(), old.clone()], None), None);
        assert_eq!(proof_for(3, &[a1, b], None), None);
        // Never restored: as before.
        let (_, id) = proof_for(3, &[old.clone(), old], None).unwrap();
        assert_eq!(id, None);
    }
}

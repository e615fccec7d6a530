//! Keeps a node that lost its disk from voting, campaigning or following a stale leader until it
//! holds every committed entry again.
//!
//! Raft's safety assumes a voter never forgets its log or its term. A node restarted with an empty
//! data dir has forgotten both, so it is *rejoining*: it records that durably and first asks its
//! peers (`CurrentVote`) for their vote and last log id, and whether they are rejoining
//! themselves. For each voter configuration (see "Membership") it needs two things of one round
//! of answers:
//!
//! - **What was decided with the lost disk.** Answers from `n - majority + 1` peers that are
//!   *not* rejoining (that kept their log) include a member of every majority that formed, with
//!   this node in it, before they answered.
//! - **What may still be decided with it** (review H1). The lost disk's answers outlive it in the
//!   memory of the nodes it gave them to: a leader counts the entries this node acknowledged
//!   (openraft's `matching`) until this node answers with a conflict, which it does not while its
//!   gate refuses that leader, and a candidate counts this node's vote until it wins or its term
//!   ends. So a majority can form *after* the answers with an old acknowledgement or vote in it:
//!   with five nodes, an entry the leader had sent to the lost disk alone, three followers
//!   answering, then the leader committing the entry with one of them and the old
//!   acknowledgement, and this node voting for a candidate without it (the reviewer's run: one
//!   token issued twice). So every other voter of each configuration this node is a voter of
//!   must answer too, rejoining or not, and every other node of each membership (both halves of
//!   a joint one, and its learners) one of whose configurations counts this node. Learners,
//!   because a leader or candidate may be a voter only in the new half of a joint configuration
//!   that no answer reports yet (review of H1: during `member promote 6` from voters 1..5, the
//!   joint entry reached only 6, 6 won term 2 and had the lost disk acknowledge its entries, and
//!   2, 3, 4 and 5 reported {1..5} with 6 a learner; 6 could then commit with the old
//!   acknowledgement in both halves). Openraft's `is_voter` accepts a voter of either half, and
//!   such a node is named in an answer: openraft makes a learner a joint voter only by an entry
//!   appended after its add-learner entry, and refuses a membership change while the previous
//!   one is uncommitted, so the add-learner entry was committed by a majority of this node's
//!   configuration, and the answers include a member of that majority, which reports the
//!   learner (or a later membership: see the known limit below). Such a leader or candidate had
//!   this node's answer before
//!   the disk was lost, so its own answer comes after: a leader's shows a last log id at or past
//!   every entry it can still commit with an old acknowledgement (it held them then, and its log
//!   only grows while it leads), and a candidate's shows a term at or above the one it can still
//!   win with an old vote (its term is on its disk before it asks, and never goes down). A
//!   configuration that does not count this node never counted its answers, so a joiner needs
//!   only the first. In a three-voter cluster without learners the first already takes both
//!   other voters; with four voters or more, in a joint configuration, or beside a learner, the
//!   second makes a wiped node wait while any of them is silent (a learner that is gone for good
//!   holds a wiped voter back until it is removed).
//!
//!   A wiped peer that has no restore id yet answers as rejoining without one, so it would be
//!   silent in the group of this node's id (see "Restored clusters"), and two wiped voters of
//!   five would each wait for the other for good. Its answer counts as that node's answer here
//!   (never toward the first requirement nor the bound): a wiped node records the id before its
//!   proof, so without an id it has no proof, and until then it grants no vote, accepts no
//!   leader's message and starts no election (`admits_candidate`, `admits_leader`, elections
//!   off from the start); what it counted of this node's answers before was lost with its disk.
//!   (Or it proved with answers that carry no id: then it belongs to another cluster
//!   incarnation, whose Raft messages the members of this id, and this node once it has the id,
//!   refuse.)
//!
//! So the highest vote term of the answers is at least the term of every leader this node helped
//! elect or may still help elect, and their highest last log id at least the last entry of every
//! commit it was part of or may still count toward. (A candidate whose last log id is at or past
//! a leader's, which is in that leader's own term, holds what that leader held then: its log ends
//! in that term with the same leader's entries, or in a later term whose leader held them.) Until
//! it has that *proof* the node accepts no Raft message and starts no election. With it, until it
//! has applied the commit index a leader reports in that leader's own term (a commit in the
//! leader's own term covers every entry committed before: the leader holds them all), three rules
//! hold, each closing one way a wiped node could let committed entries be lost and tokens repeat
//! (rules 1 and 3 need both parts of the proof: with only the first, an old vote lets a candidate
//! win a term above the proof's after the answers, and then a vote in that term, or following a
//! leader of an older one whose commits the winner lacks, repeats tokens too):
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
//! with history; the term and log id of one with the group's restore id still enter the bound
//! (they come from real candidates and leaders, so they can only raise it; a wiped peer without
//! an id, which counts only as answered, is blank), and it is the answer every voter must give
//! (see above).
//! If fewer than `n - majority + 1` answers come from peers that kept their log, or a node that
//! must answer is silent, the node keeps asking, and says so every few seconds (the reason of
//! the restore-id group with the most answers of peers that kept their log). Three cases:
//!
//! - **Five voters, two wiped.** Entry 100 is committed by {1, 4, 5}; 4 and 5 lose their disks
//!   (two failures of five: within tolerance). Node 4 hears from 2 and 3 (both at 99) and from 5.
//!   Counting 5 would make three answers and a proof that stops at 99; node 2 could then win with
//!   the votes of {2, 3, 4, 5} and overwrite entry 100, reusing its token. Without 5 there are
//!   two, so node 4 waits for node 1, whose answer brings the bound to 100. Node 5's answer
//!   (rejoining, no restore id yet) is still the answer every voter must give, so once 1, 2 and
//!   3 answered both wiped nodes prove, whatever their restore id.
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
//! `backup::restore`), as the members of a cluster founded by this release share an incarnation
//! id (the same field and the same rules; see "Founding" above). Only answers that carry this node's restore id count, toward the proof
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
//! no later event changes, and what other nodes may still count of it, which no later event
//! raises (the lost disk gives no new answers); what the node did since (votes, entries) is on
//! its disk like any node's. The proof is cleared with the flag once the node has caught up. (A
//! proof kept by an older lockd, made without the answers of silent voters, is used as it is:
//! let a rejoining node catch up before upgrading it.)
//!
//! # Founding a new cluster
//!
//! A first-ever start also finds every node empty, and an empty node cannot tell a first start
//! from a lost disk by itself. It founds a new cluster (`initialize` with its `--peer` list, then
//! campaigns) only when *every* other node of its `--peer` list has answered, and each one is
//! either **new** (rejoining, no log, no vote, started without `--join`, with the same `--peer`
//! list (a SHA-256 digest of it is in the answer), and quiet for two maximum election timeouts:
//! no leader's AppendEntries or InstallSnapshot reached it, which a running cluster that counts
//! it as a member sends within that time) or **founded** (rejoining, holding nothing past the
//! initial membership entry, whose membership is exactly the `--peer` list, with a cluster
//! incarnation id), and this node is new itself. Anything else (a peer with history, a joiner,
//! another list, a silent peer, an older lockd that does not say) means no founding: the node
//! waits as a rejoiner and says why every few seconds, with what the operator should do. Every
//! peer, not only `n - majority + 1`: an empty answer does not mean a lost disk (a node that
//! started late, or a follower that has not caught up, answers alike while the cluster has
//! history). When every other node is new or founded and this one is empty, every node that
//! held an entry past the initial membership lost its disk: a majority at once, beyond what Raft
//! tolerates. So neither the word of joiners nor `--peer` flags older than the membership can
//! make a node found a second cluster, whose tokens would start again from 1; a peer that holds
//! the log always stops it. A `--peer` list of one node has nobody to ask: such a cluster is
//! founded only explicitly, with `lockd init` (see `node::init`).
//!
//! **The incarnation id.** A founded cluster gets a random *cluster incarnation id* (the restore
//! id of `raft::restore_id`, which a restore sets too), written to the data dir before the node
//! proposes the membership, and carried on every Raft message: so a second cluster founded on
//! the same addresses, or a node added to the wrong cluster, can never move this one's term or
//! log, even without TLS, whatever their log ids. The founders agree on one id without a round
//! of their own: the node with the lowest id of the `--peer` list draws it once every other node
//! answered new; every other node founds only once a founded peer shows the id, and takes it.
//! A founder keeps its elections off, and grants no vote, until every other `--peer` node has
//! answered with the id once (or a leader is known): openraft campaigns right after
//! `initialize`, and without the refusal two founders elected a leader before the third took the
//! id, which then could never found, so losing that leader left two nodes without a quorum.
//! A wiped node or a joiner takes the id of the answers that make its proof ("Restored
//! clusters" below).
//!
//! # Membership
//!
//! Which peers to ask, and how many answers are enough, come from the Raft membership, not from
//! `--peer`: members are added, promoted and removed at runtime (see `service::membership`), and
//! the flags of a node may be years old. Every `CurrentVote` answer carries the answering peer's
//! effective membership (both configurations while a joint change is in progress). The node asks
//! everyone it has heard of (its `--peer` list, plus every node of every reported membership) and
//! needs, for *every* voter configuration any answer reported (and its own, if its log holds
//! one), `n - majority + 1` answers from that configuration's voters other than itself that kept
//! their log. Why the reported configurations suffice, even when the answering peers lag: an
//! entry or an election this node took part in was made under some configuration `C` it knew.
//! If the cluster has moved on from `C` since, it did so by committing the joint configuration
//! `(C, C')`, which needs a majority of `C`; the answers from `C` include a member of that
//! majority, which then reports `C'` (or later), so `C'` is checked too, and so on to the current
//! configuration. Checking a configuration that is no longer current only asks for more answers,
//! never fewer. The `--peer` list stands for a configuration only in the answers of a lockd that
//! predates runtime membership (it has a log but reports no membership; its membership is its
//! flags). A configuration whose only voter is this node is never proven: its lost disk held the
//! only copy of the commits, and a restore from backup is the way back.
//!
//! **Joining.** A node added at runtime (`lockd --join`, then `lockctl member add`) starts with
//! an empty data dir like a wiped node and goes through the same gate: it never was a voter, so
//! the gate costs it nothing but the `CurrentVote` round (no reported configuration counts it, so
//! a silent voter or learner does not hold it back), and a joiner that is wiped again after
//! its promotion is then protected like any other voter. With `--join` the node never proposes
//! an initial membership, and says so in its `CurrentVote` answers, which then never count
//! towards founding: it only ever waits for the leader to add it, so a mistyped `--peer` cannot
//! make it form a cluster of its own, nor help another node form one.
//!
//! Known limit: beyond tolerance the founding test can be fooled. If every disk is lost (or all
//! but nodes that never got past the initial membership entry), the empty nodes form a new
//! cluster and issue tokens from the start again; its new incarnation id at least keeps any
//! surviving member of the old one out of it. Only a restore from backup brings the old state
//! back.
//!
//! Known limit (review H1, not argued): every other node must answer only in the memberships
//! some answer or this node's log reports. A leader or candidate cut off while the cluster removed
//! it by a membership change, whose configuration nobody reports any more, is not asked; whether
//! it can still count an old answer of this node toward a majority of that configuration is not
//! shown either way.
//!
//! Known limit: the proof's term is the highest any peer reports, which can be a failed
//! candidate's. If a one-way partition lets a candidate's term climb past the live leader's, the
//! wiped node refuses that leader until the partition heals (safe, but with a second fault the
//! cluster waits).
//!
//! Known limit, the same one from another side (review finding on the membership patch, not
//! fixed): a removed member that missed its removal keeps campaigning in ever higher terms (the
//! members refuse its votes while their leader lease runs, so their own terms stay). A wiped node
//! whose `--peer` list names it asks it, and the proof takes the highest term of the answers, so
//! rule 3 refuses the real leader until the cluster's term passes that one, which may be never.
//! It founds nothing and loses nothing; it waits. Not fixed because dropping such answers is not
//! shown safe: the membership that shows the node removed may be uncommitted when a peer reports
//! it, and a removed node's term may be the term of a vote this node cast before its disk was
//! lost, which rule 1 keeps it from casting twice. Bounding the term by the voters of the newest
//! committed configuration alone would need each answer's membership log id and commit state and
//! an argument that no vote for a removed candidate can still elect it; the usual answer, pre-vote
//! so that a removed node cannot raise anyone's term (etcd, openraft 0.10), is not in openraft
//! 0.9. The runbook stops a removed node and takes it out of every `--peer` list
//! (docs/operations.md, "What the checks cannot catch").

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// The peer's effective membership (its latest, committed or not); `None` from a lockd that
    /// predates runtime membership. Appended after the fields older nodes read, so they still
    /// decode the rest (postcard ignores trailing bytes), and [`VoteReport::decode`] reads their
    /// shorter answers.
    pub membership: Option<openraft::Membership<NodeId, BasicNode>>,
    /// The peer was started with `--join`: it waits to be added and never founds.
    pub joining: bool,
    /// The digest of the peer's `--peer` list if it is new and would found a cluster now (see
    /// [`Founding`]); `None` if it holds or has seen anything, or is a joiner.
    pub founding: Option<[u8; 32]>,
}

/// The answer of a lockd that predates runtime membership.
#[derive(Deserialize)]
struct VoteReportWithoutMembership {
    vote: openraft::Vote<NodeId>,
    last_log_id: Option<LogId>,
}

impl VoteReport {
    /// Decodes the postcard payload of an answer of this release or of one before runtime
    /// membership (`standing` and `restore_id` travel beside it and are set by the caller).
    pub fn decode(bytes: &[u8]) -> Result<Self, postcard::Error> {
        postcard::from_bytes::<VoteReport>(bytes).or_else(|e| {
            postcard::from_bytes::<VoteReportWithoutMembership>(bytes)
                .map(|old| VoteReport {
                    vote: old.vote,
                    last_log_id: old.last_log_id,
                    standing: Standing::default(),
                    restore_id: None,
                    membership: None,
                    joining: false,
                    founding: None,
                })
                .map_err(|_| e)
        })
    }
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

/// What decides whether this node founds a new cluster, or tells a peer that it would (see
/// "Founding" in the module docs).
pub struct Founding {
    /// `--join`: never founds.
    join: bool,
    /// SHA-256 of the sorted `--peer` list (`id=address` lines).
    digest: [u8; 32],
    /// Before this, a running cluster may not have reached this node yet.
    quiet_until: Instant,
    /// A leader's AppendEntries or InstallSnapshot reached this node (or an answer showed a
    /// cluster with history): some cluster runs, whatever the flags say.
    seen_traffic: AtomicBool,
}

impl Founding {
    /// `quiet` is how long a running cluster may take to reach a member (two maximum election
    /// timeouts: heartbeats come far more often).
    pub fn new(join: bool, peers: &BTreeMap<NodeId, String>, quiet: Duration) -> Self {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for (id, addr) in peers {
            h.update(format!("{id}={addr}\n").as_bytes());
        }
        Founding {
            join,
            digest: h.finalize().into(),
            quiet_until: Instant::now() + quiet,
            seen_traffic: AtomicBool::new(false),
        }
    }

    /// What this node says about founding in `CurrentVote`, given its own log and vote: the
    /// digest if it holds nothing, has seen nothing, is no joiner and has been quiet long enough.
    fn answer(&self, last_log: Option<LogId>, vote_term: u64) -> Option<[u8; 32]> {
        (!self.join
            && last_log.is_none()
            && vote_term == 0
            && !self.seen_traffic.load(Ordering::Acquire)
            && Instant::now() >= self.quiet_until)
            .then_some(self.digest)
    }
}

/// Which incarnation id a founding node takes (see "Founding" in the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
enum FoundingId {
    /// This node has the lowest id of the `--peer` list and no peer founded yet: draw a new one.
    Draw,
    /// A founded peer shows it.
    Adopt(String),
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
    /// Whether this node founds a new cluster or tells its peers it would.
    founding: Founding,
    /// Set from this node's founding until every other `--peer` node has founded too: it
    /// grants no vote meanwhile. openraft campaigns at once after `initialize`, so without
    /// this the first founders could elect a leader before the last one took the incarnation
    /// id; that one would then refuse the leader's messages, and, once it saw a peer with
    /// history, could not found any more: a founder lost right after the start would leave the
    /// other two without a quorum for good.
    cofounding: AtomicBool,
}

#[derive(Default)]
struct Learned {
    /// The commit index to apply before opening, once a leader has reported one in its own term.
    target: Option<u64>,
    /// Once enough peers answered.
    proof: Option<Proof>,
}

impl VoteGate {
    /// A gate that is open for good: the node kept its data dir (or founds as `lockd init`
    /// prepared it).
    pub fn open(restore: Arc<RestoreIdentity>, founding: Founding) -> Self {
        VoteGate {
            open: AtomicBool::new(true),
            learned: Mutex::new(Learned::default()),
            store: None,
            restore,
            founding,
            cofounding: AtomicBool::new(false),
        }
    }

    /// A gate closed until [`VoteGate::rejoin`] sees the node caught up; `store` holds the
    /// durable rejoining flag it clears then, and the proof if the node learned one before a
    /// restart (then it needs no new answers: see "Restarts while rejoining" in the module docs).
    pub fn rejoining(
        store: LogStore,
        restore: Arc<RestoreIdentity>,
        founding: Founding,
    ) -> anyhow::Result<Self> {
        let proof = store.rejoin_proof::<Proof>()?;
        Ok(VoteGate {
            open: AtomicBool::new(false),
            learned: Mutex::new(Learned {
                target: None,
                proof,
            }),
            store: Some(store),
            restore,
            founding,
            cofounding: AtomicBool::new(false),
        })
    }

    /// Records that a leader's message reached this node, which then never founds a cluster
    /// nor tells a peer it would.
    pub fn note_traffic(&self) {
        self.founding.seen_traffic.store(true, Ordering::Release);
    }

    /// This node's `CurrentVote` answer (`standing` and `restore_id` are set by the caller,
    /// in fields of their own beside the payload).
    pub fn report(
        &self,
        vote: openraft::Vote<NodeId>,
        last_log_id: Option<LogId>,
        membership: openraft::Membership<NodeId, BasicNode>,
    ) -> VoteReport {
        VoteReport {
            founding: self.founding_answer(last_log_id, vote.leader_id().term),
            vote,
            last_log_id,
            standing: Standing::default(),
            restore_id: None,
            membership: Some(membership),
            joining: self.founding.join,
        }
    }

    /// [`Founding::answer`], and never for a node that has an incarnation or restore id: it
    /// belongs to a cluster already (restored, prepared by `lockd init`, or learned from the
    /// peers that vouched for it), even before its log holds anything.
    fn founding_answer(&self, last_log: Option<LogId>, vote_term: u64) -> Option<[u8; 32]> {
        if self.restore.get().is_some() {
            return None;
        }
        self.founding.answer(last_log, vote_term)
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
        if self.cofounding.load(Ordering::Acquire) {
            return Err(
                "lockd: founding a new cluster; not voting until every --peer node has founded it"
                    .to_owned(),
            );
        }
        if self.is_open() {
            return Ok(());
        }
        admits_candidate_while_rejoining(term, candidate_last_log, self.learned().proof)
    }

    /// Runs a rejoining node until it has caught up: learns the proof from the peers, or founds
    /// a new cluster when every peer shows it is new (see the module docs), keeps elections off
    /// until the node's log is complete (rule 2), and opens the gate once caught up, clearing
    /// the durable flag first. `ask` asks the given peers once and returns who answered what;
    /// `members` is the `--peer` list (this node included), the initial membership.
    pub async fn rejoin<F, Fut>(
        &self,
        raft: Raft,
        me: NodeId,
        members: BTreeMap<NodeId, BasicNode>,
        mut ask: F,
        shutdown: CancellationToken,
    ) where
        F: FnMut(Vec<(NodeId, String)>) -> Fut,
        Fut: std::future::Future<Output = Vec<(NodeId, VoteReport)>>,
    {
        let Some(store) = self.store.clone() else {
            return;
        };
        raft.runtime_config().elect(false);
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
                let Some(learned) = self
                    .ask_until_proven(&raft, me, &members, &mut ask, &shutdown)
                    .await
                else {
                    return;
                };
                let (proof, restore_id, found) = match learned {
                    Answers::Proof(proof, id) => (proof, id, false),
                    Answers::Found(proof, FoundingId::Adopt(id)) => (proof, Some(id), true),
                    Answers::Found(proof, FoundingId::Draw) => {
                        (proof, Some(super::restore_id::new_incarnation_id()), true)
                    }
                };
                if let Some(id) = restore_id
                    && self.restore.get().is_none()
                {
                    // On disk before anything depends on it: a restart must not forget which
                    // cluster incarnation vouched for this node (or which one it founded).
                    while let Err(e) = store.set_restore_id(&id).await {
                        tracing::error!(
                            error = %e,
                            "lockd: recording the cluster incarnation id; taking no part in \
                             replication until it is on disk"
                        );
                        tokio::select! {
                            _ = shutdown.cancelled() => return,
                            _ = tokio::time::sleep(ASK_RETRY) => {}
                        }
                    }
                    if let Err(e) = self.restore.adopt(&id) {
                        tracing::error!(error = %e, "lockd: taking the cluster incarnation id");
                        return;
                    }
                    tracing::info!(
                        restore_id = %id,
                        "rejoining: this node keeps the cluster incarnation id of the peers that \
                         vouched for it (or the one it founded with)"
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
                if found {
                    tracing::info!(
                        peers = ?members.keys().collect::<Vec<_>>(),
                        "lockd: every --peer node answered new (or founded with the same --peer \
                         list): founding a new cluster"
                    );
                    self.cofounding.store(true, Ordering::Release);
                    if let Err(e) = raft.initialize(members.clone()).await {
                        tracing::info!(error = %e, "initialize skipped");
                    }
                    let all_founded = self
                        .wait_for_cofounders(&raft, me, &members, &mut ask, &shutdown)
                        .await;
                    self.cofounding.store(false, Ordering::Release);
                    if !all_founded {
                        return;
                    }
                }
                proof
            }
        };
        if self.founding.join {
            tracing::info!(
                "lockd: --join: waiting for the leader to add this node (lockctl member add)"
            );
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

    /// After founding, keeps elections off until every other `--peer` node has founded too
    /// (answers with this node's incarnation id and nothing past the initial membership entry),
    /// or a leader is known; `false` on shutdown. Without it the first founders could elect a
    /// leader before the last one took the id: its own leader's heartbeats would then keep it
    /// from founding, and it would need two peers that caught up to vouch for it, so one founder
    /// lost right after the start would leave it waiting (seen in the membership suite).
    async fn wait_for_cofounders<F, Fut>(
        &self,
        raft: &Raft,
        me: NodeId,
        flags: &BTreeMap<NodeId, BasicNode>,
        ask: &mut F,
        shutdown: &CancellationToken,
    ) -> bool
    where
        F: FnMut(Vec<(NodeId, String)>) -> Fut,
        Fut: std::future::Future<Output = Vec<(NodeId, VoteReport)>>,
    {
        let mut last_log = tokio::time::Instant::now();
        // A peer seen founded counts for good: one lost after it founded does not hold the
        // others back (it has the id; it comes back as a member).
        let mut founded: BTreeSet<NodeId> = BTreeSet::new();
        loop {
            if raft.metrics().borrow().current_leader.is_some() {
                return true;
            }
            let reports = tokio::select! {
                _ = shutdown.cancelled() => return false,
                r = ask(whom_to_ask(me, flags, &[])) => r,
            };
            for (p, r) in &reports {
                if r.restore_id.as_deref() == self.restore.get() && r.last_log_id.is_some() {
                    founded.insert(*p);
                }
            }
            let waiting: Vec<NodeId> = flags
                .keys()
                .filter(|id| **id != me && !founded.contains(id))
                .copied()
                .collect();
            if waiting.is_empty() {
                return true;
            }
            if last_log.elapsed() >= WAIT_LOG_EVERY {
                last_log = tokio::time::Instant::now();
                tracing::warn!(
                    ?waiting,
                    "lockd: founded a new cluster; not campaigning until every --peer node has \
                     founded it too"
                );
            }
            tokio::select! {
                _ = shutdown.cancelled() => return false,
                _ = tokio::time::sleep(ASK_RETRY) => {}
            }
        }
    }

    /// Asks the peers until their answers make a proof, or show a new cluster to found; `None`
    /// on shutdown.
    async fn ask_until_proven<F, Fut>(
        &self,
        raft: &Raft,
        me: NodeId,
        flags: &BTreeMap<NodeId, BasicNode>,
        ask: &mut F,
        shutdown: &CancellationToken,
    ) -> Option<Answers>
    where
        F: FnMut(Vec<(NodeId, String)>) -> Fut,
        Fut: std::future::Future<Output = Vec<(NodeId, VoteReport)>>,
    {
        let mut last_log = tokio::time::Instant::now();
        let mut reports: Vec<(NodeId, VoteReport)> = Vec::new();
        // Everyone heard of so far: the flags and every node of every reported membership (kept
        // across rounds, so a peer that does not answer once is not forgotten).
        let mut known: BTreeMap<NodeId, String> = BTreeMap::new();
        let mut own_log = self.store.clone()?;
        loop {
            known.extend(whom_to_ask(me, flags, &reports));
            reports = tokio::select! {
                _ = shutdown.cancelled() => return None,
                r = ask(known.clone().into_iter().collect()) => r,
            };
            // A membership in this node's own log (it caught up partly before a crash) is a
            // configuration it was part of, like a reported one.
            let (own, vote_term) = {
                let m = raft.metrics().borrow().clone();
                (
                    m.membership_config.membership().clone(),
                    m.vote.leader_id().term,
                )
            };
            if reports
                .iter()
                .any(|(_, r)| r.last_log_id.is_some_and(|l| l.index > 0))
            {
                // A cluster with history exists: this node tells its peers it is not new.
                self.note_traffic();
            }
            let not_proven = match proof_for(me, flags, &own, &reports, self.restore.get()) {
                Ok((proof, id)) => return Some(Answers::Proof(proof, id)),
                Err(why) => why,
            };
            let own_answer = match own_log.get_log_state().await {
                Ok(s) => self.founding_answer(s.last_log_id, vote_term),
                Err(e) => {
                    tracing::error!(error = %e, "lockd: reading the log state");
                    None
                }
            };
            let not_founding = match may_found(me, flags, &self.founding, own_answer, &reports) {
                Ok(id) => {
                    let proof = Proof {
                        term: reports
                            .iter()
                            .map(|(_, r)| r.vote.leader_id().term)
                            .max()
                            .unwrap_or(0),
                        log: None,
                    };
                    return Some(Answers::Found(proof, id));
                }
                Err(why) => why,
            };
            if last_log.elapsed() >= WAIT_LOG_EVERY {
                last_log = tokio::time::Instant::now();
                let kept = reports
                    .iter()
                    .filter(|(_, r)| r.standing == Standing::KeptLog)
                    .count();
                tracing::warn!(
                    answered = ?reports.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
                    from_peers_that_kept_their_log = kept,
                    "lockd: rejoining after an empty data dir: too few peers answered to know \
                     what the lost disk held or what they may still count of it ({not_proven}); \
                     not founding a new cluster either ({not_founding}); taking no part in \
                     replication until then"
                );
                if self.founding.join {
                    tracing::warn!(
                        "lockd: --join: no member of a running cluster has vouched yet; check \
                         that --peer names current members"
                    );
                } else if let Some(nodes) = not_a_member(me, &reports) {
                    tracing::warn!(
                        "lockd: this node ({me}) is not in the membership its peers report \
                         (nodes {nodes:?}): `lockctl member add {me}=HOST:PORT` it and restart \
                         it with --join"
                    );
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                _ = tokio::time::sleep(ASK_RETRY) => {}
            }
        }
    }
}

/// What a rejoining node learned from its peers' answers.
enum Answers {
    /// The proof, and the restore id of the answers that made it.
    Proof(Proof, Option<String>),
    /// A new cluster to found, with the incarnation id to take.
    Found(Proof, FoundingId),
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

/// Peers whose answers always include a member of any majority that formed before they
/// answered, other than this node: `n - majority + 1` of a configuration of `n` voters, where the
/// majority counts this node.
fn answers_needed(cluster_size: usize) -> usize {
    let majority = cluster_size / 2 + 1;
    cluster_size - majority + 1
}

/// What the answers of the peers with this node's restore id (`own_id`) prove; a node without
/// one (a wiped node, a joiner) tries the answers of each restore id, and gets back the id whose
/// answers proved (see "Restored clusters" in the module docs). The error says what is missing,
/// for the log.
fn proof_for(
    me: NodeId,
    flags: &BTreeMap<NodeId, BasicNode>,
    own: &openraft::Membership<NodeId, BasicNode>,
    reports: &[(NodeId, VoteReport)],
    own_id: Option<&str>,
) -> Result<(Proof, Option<String>), String> {
    let mut ids: Vec<Option<&str>> = vec![own_id];
    if own_id.is_none() {
        for (_, r) in reports {
            if !ids.contains(&r.restore_id.as_deref()) {
                ids.push(r.restore_id.as_deref());
            }
        }
    }
    // The error of the group with the most answers of peers that kept their log says what is
    // really missing (an id-less group of wiped peers would only say it holds no membership).
    let mut best_error: Option<(usize, String)> = None;
    for id in ids {
        let group: Vec<(NodeId, VoteReport)> = reports
            .iter()
            .filter(|(_, r)| r.restore_id.as_deref() == id)
            .cloned()
            .collect();
        // A wiped node's own "no id" group is empty beside restored or founded peers: its error
        // ("no answer holds a membership") would hide the one that says what is missing.
        if group.is_empty() && own_id.is_none() && !reports.is_empty() {
            continue;
        }
        match proof_in(me, flags, own, &group, reports) {
            Ok(p) => return Ok((p, id.map(str::to_owned))),
            Err(e) => {
                let kept = group
                    .iter()
                    .filter(|(_, r)| r.standing == Standing::KeptLog)
                    .count();
                if best_error.as_ref().is_none_or(|(k, _)| kept > *k) {
                    best_error = Some((kept, e));
                }
            }
        }
    }
    Err(best_error.map_or_else(|| "no answer".to_owned(), |(_, e)| e))
}

/// What the answers prove, if there are enough of them for every configuration this node's log
/// and the answers hold: `n - majority + 1` answers of its voters other than this node, from
/// peers that kept their log, and an answer of every other node (voter or learner) of a
/// membership that counts this node as a voter (see the module docs). Answers of rejoining peers and of older
/// nodes, which do not say, never count; their terms and log ids still enter the bound (they
/// come from real candidates and leaders, so they can only raise it). Otherwise which
/// configuration lacks answers, for the log.
#[cfg(test)]
fn proof_from(
    me: NodeId,
    flags: &BTreeMap<NodeId, BasicNode>,
    own: &openraft::Membership<NodeId, BasicNode>,
    reports: &[(NodeId, VoteReport)],
) -> Result<Proof, String> {
    proof_in(me, flags, own, reports, reports)
}

/// [`proof_from`] for the answers of one restore id (`reports`); `all` holds every answer, of
/// any id, for the answers of wiped peers that have no id yet (see [`answered`]).
fn proof_in(
    me: NodeId,
    flags: &BTreeMap<NodeId, BasicNode>,
    own: &openraft::Membership<NodeId, BasicNode>,
    reports: &[(NodeId, VoteReport)],
    all: &[(NodeId, VoteReport)],
) -> Result<Proof, String> {
    let configs = configurations(flags, own, reports);
    if configs.is_empty() {
        return Err("no answer holds a membership".to_owned());
    }
    for config in &configs {
        if config.len() == 1 && config.contains(&me) {
            return Err(format!(
                "node {me} was the only voter and lost its disk, so the only copy of what was \
                 committed is gone; restore the cluster from a backup"
            ));
        }
        let answered = reports
            .iter()
            .filter(|(id, r)| *id != me && config.contains(id) && r.standing == Standing::KeptLog)
            .count();
        let needed = answers_needed(config.len());
        if answered < needed {
            return Err(format!(
                "{needed} of voters {:?} (other than node {me}) that kept their log, {answered} \
                 answered",
                config.iter().collect::<Vec<_>>()
            ));
        }
    }
    // A silent node may be a leader still counting the lost disk's acknowledgements, or a
    // candidate still counting its vote (review H1): any voter of a configuration that counts
    // this node, and any other node of a membership that does, a learner included, which may be
    // a voter of a joint configuration no answer reports yet (see the module docs). A joiner (no
    // configuration counts it) is not held back.
    let everyone = everyone_to_hear(me, own, reports, &configs);
    let silent: Vec<NodeId> = everyone
        .iter()
        .filter(|id| !answered(**id, reports, all))
        .copied()
        .collect();
    if !silent.is_empty() {
        return Err(format!(
            "every other node of a membership that counts node {me} as a voter, learners and \
             rejoining nodes included (one may be a leader or candidate still counting what the \
             lost disk acknowledged or voted): {:?}, not yet {silent:?}",
            everyone.iter().collect::<Vec<_>>()
        ));
    }
    Ok(Proof {
        term: reports
            .iter()
            .map(|(_, r)| r.vote.leader_id().term)
            .max()
            .unwrap_or(0),
        log: reports.iter().filter_map(|(_, r)| r.last_log_id).max(),
    })
}

/// Every node other than `me` that must answer before a proof: each voter of a configuration in
/// `configs` that counts `me`, and each node (voter or learner) of a membership, reported or in
/// this node's log, one of whose configurations counts `me`.
fn everyone_to_hear(
    me: NodeId,
    own: &openraft::Membership<NodeId, BasicNode>,
    reports: &[(NodeId, VoteReport)],
    configs: &BTreeSet<BTreeSet<NodeId>>,
) -> BTreeSet<NodeId> {
    let mut everyone: BTreeSet<NodeId> = configs
        .iter()
        .filter(|c| c.contains(&me))
        .flatten()
        .copied()
        .collect();
    for m in reports
        .iter()
        .filter_map(|(_, r)| r.membership.as_ref())
        .chain(std::iter::once(own))
    {
        if m.get_joint_config().iter().any(|c| c.contains(&me)) {
            everyone.extend(m.voter_ids());
            everyone.extend(m.nodes().map(|(id, _)| *id));
        }
    }
    everyone.remove(&me);
    everyone
}

/// Whether node `id` answered: in this restore id's answers (`reports`), or among `all` as a
/// wiped peer without a restore id (rejoining, no id). Such a peer has no proof yet (a wiped
/// node records the id of the answers that prove before the proof), so it has accepted no
/// leader's message, granted no vote and started no election since it lost its disk, and what it
/// had counted of this node's answers was lost with its disk. (Or it proved with answers that
/// carry no id: then it belongs to a cluster incarnation whose Raft messages the members of this
/// restore id, and this node once it takes the id, refuse.)
///
/// Only a blank one counts (no vote, no log, no voters), which a peer without a proof always is:
/// so that an answer under that id from another process (a second process of the same id started
/// empty at another address, a node of another cluster that reuses the ids) never stands in for
/// a member that may still count this node's old acknowledgement (review of 7118a43).
fn answered(id: NodeId, reports: &[(NodeId, VoteReport)], all: &[(NodeId, VoteReport)]) -> bool {
    reports.iter().any(|(p, _)| *p == id)
        || all.iter().any(|(p, r)| {
            *p == id && r.standing == Standing::Rejoining && r.restore_id.is_none() && is_blank(r)
        })
}

/// Whether an answer shows nothing of a cluster: vote of term 0, no log, no voter.
fn is_blank(r: &VoteReport) -> bool {
    r.vote.leader_id().term == 0
        && r.last_log_id.is_none()
        && r.membership
            .as_ref()
            .is_none_or(|m| m.voter_ids().next().is_none())
}

/// Every voter configuration this node's log and the answers hold (both halves of a joint one).
/// A lockd before runtime membership reports none: its configuration is the `--peer` list, which
/// it could never change.
fn configurations(
    flags: &BTreeMap<NodeId, BasicNode>,
    own: &openraft::Membership<NodeId, BasicNode>,
    reports: &[(NodeId, VoteReport)],
) -> BTreeSet<BTreeSet<NodeId>> {
    let mut configs: BTreeSet<BTreeSet<NodeId>> = reports
        .iter()
        .filter_map(|(_, r)| r.membership.as_ref())
        .chain(std::iter::once(own))
        .flat_map(|m| m.get_joint_config().iter().cloned())
        .filter(|c| !c.is_empty())
        .collect();
    if reports
        .iter()
        .any(|(_, r)| r.membership.is_none() && r.last_log_id.is_some())
    {
        configs.insert(flags.keys().copied().collect());
    }
    configs
}

/// Whether this node may found a new cluster now, and with which incarnation id: it is new
/// itself (`own_answer`), its `--peer` list names another node, and every other node of it
/// answered new with the same list or founded with exactly that membership (see "Founding" in
/// the module docs). The error says why not and what the operator should do, for the log.
fn may_found(
    me: NodeId,
    flags: &BTreeMap<NodeId, BasicNode>,
    founding: &Founding,
    own_answer: Option<[u8; 32]>,
    reports: &[(NodeId, VoteReport)],
) -> Result<FoundingId, String> {
    const ADVICE: &str = "if this node is a member of a running cluster that lost its disk, \
        restart it with the current members in --peer (`lockctl member list`); if it is not a \
        member, `lockctl member add` it and restart it with --join";
    if founding.join {
        return Err("--join never founds".to_owned());
    }
    if flags.keys().all(|id| *id == me) {
        return Err(format!(
            "--peer names this node alone, and a single-node cluster is founded only by `lockd \
             init` on its data dir before its first start; {ADVICE}"
        ));
    }
    if own_answer.is_none() {
        return Err(format!(
            "this node has seen a leader's messages or a peer with history (or is still waiting \
             out its quiet period); {ADVICE}"
        ));
    }
    let mut silent = Vec::new();
    let mut founded_ids = BTreeSet::new();
    for id in flags.keys().filter(|id| **id != me) {
        let Some((_, r)) = reports.iter().find(|(p, _)| p == id) else {
            silent.push(*id);
            continue;
        };
        if r.joining {
            return Err(format!(
                "--peer node {id} was started with --join, so a cluster exists that this node's \
                 --peer list does not name; {ADVICE}"
            ));
        }
        if r.standing != Standing::Rejoining {
            return Err(format!(
                "--peer node {id} kept a log (or is an older lockd that does not say); {ADVICE}"
            ));
        }
        if r.last_log_id.is_none() {
            match r.founding {
                Some(d) if d == founding.digest && r.vote.leader_id().term == 0 => {}
                Some(d) if d != founding.digest => {
                    return Err(format!(
                        "--peer node {id} was started with another --peer list; give every node \
                         of a new cluster the same list"
                    ));
                }
                _ => {
                    return Err(format!(
                        "--peer node {id} is not new (it has seen a leader's messages or a peer \
                         with history, or is still waiting out its quiet period); {ADVICE}"
                    ));
                }
            }
            continue;
        }
        // A founder: nothing past the initial membership entry, which is exactly our list.
        let founded = r.last_log_id.is_some_and(|l| l.index == 0)
            && r.membership
                .as_ref()
                .is_some_and(|m| same_as_flags(m, flags));
        match (&r.restore_id, founded) {
            (Some(x), true) => {
                founded_ids.insert(x.clone());
            }
            _ => {
                return Err(format!(
                    "--peer node {id} holds a log that is not the founding of this --peer list; \
                     {ADVICE}"
                ));
            }
        }
    }
    if !silent.is_empty() {
        return Err(format!(
            "waiting for every --peer node to answer before founding a new cluster (not yet: \
             {silent:?}); a node holding the cluster's log would show this one is rejoining"
        ));
    }
    let mut ids = founded_ids.into_iter();
    match (ids.next(), ids.next()) {
        (Some(x), None) => Ok(FoundingId::Adopt(x)),
        (Some(x), Some(y)) => Err(format!(
            "the founders answered with two cluster incarnation ids ({x} and {y}): two clusters \
             were founded on these addresses; stop them, wipe the data dirs of the one to drop \
             and start its nodes again"
        )),
        (None, _) => {
            let first = flags.keys().next().copied().unwrap_or(me);
            if first == me {
                Ok(FoundingId::Draw)
            } else {
                Err(format!(
                    "every --peer node answered new; node {first}, the lowest id of the list, \
                     founds first and draws the cluster incarnation id, and this node then takes it"
                ))
            }
        }
    }
}

/// Whether a reported membership is exactly the `--peer` list: one configuration of all its
/// nodes as voters, at the same addresses (the initial membership a founder proposed).
fn same_as_flags(
    m: &openraft::Membership<NodeId, BasicNode>,
    flags: &BTreeMap<NodeId, BasicNode>,
) -> bool {
    let voters: BTreeSet<NodeId> = flags.keys().copied().collect();
    m.get_joint_config().len() == 1
        && m.get_joint_config()[0] == voters
        && m.nodes().count() == flags.len()
        && m.nodes()
            .all(|(id, n)| flags.get(id).is_some_and(|f| f.addr == n.addr))
}

/// The nodes of the memberships the answers report, if this node is in none of them (it was
/// removed, or its flags predate the cluster it talks to).
fn not_a_member(me: NodeId, reports: &[(NodeId, VoteReport)]) -> Option<Vec<NodeId>> {
    let memberships: Vec<_> = reports
        .iter()
        .filter_map(|(_, r)| r.membership.as_ref())
        .filter(|m| m.nodes().next().is_some())
        .collect();
    if memberships.is_empty()
        || memberships
            .iter()
            .any(|m| m.nodes().any(|(id, _)| *id == me))
    {
        return None;
    }
    let nodes: BTreeSet<NodeId> = memberships
        .iter()
        .flat_map(|m| m.nodes().map(|(id, _)| *id))
        .collect();
    Some(nodes.into_iter().collect())
}

/// The peers to ask: the `--peer` list and every node of every reported membership (its address
/// there, which is the cluster's, before the flag's).
fn whom_to_ask(
    me: NodeId,
    flags: &BTreeMap<NodeId, BasicNode>,
    reports: &[(NodeId, VoteReport)],
) -> Vec<(NodeId, String)> {
    let mut targets: BTreeMap<NodeId, String> =
        flags.iter().map(|(id, n)| (*id, n.addr.clone())).collect();
    for (_, r) in reports {
        if let Some(m) = &r.membership {
            for (id, node) in m.nodes().filter(|(_, n)| !n.addr.is_empty()) {
                targets.insert(*id, node.addr.clone());
            }
        }
    }
    targets.remove(&me);
    targets.into_iter().collect()
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

    /// The answer of a peer that kept its log, without a membership (set one with
    /// [`with_membership`]; [`prove`] gives every answer the membership of the `--peer` list).
    fn report(term: u64, last: Option<(u64, u64)>) -> VoteReport {
        VoteReport {
            vote: openraft::Vote::new(term, 1),
            last_log_id: last.map(|(t, i)| log_id(t, i)),
            standing: Standing::KeptLog,
            restore_id: None,
            membership: None,
            joining: false,
            founding: None,
        }
    }

    /// The answer of a peer that is itself rejoining (gate closed).
    fn rejoining(term: u64, last: Option<(u64, u64)>) -> VoteReport {
        VoteReport {
            standing: Standing::Rejoining,
            ..report(term, last)
        }
    }

    /// No membership in this node's own log.
    fn none() -> openraft::Membership<NodeId, BasicNode> {
        openraft::Membership::new(vec![BTreeSet::new()], ())
    }

    /// A `--peer` list of nodes `ids`.
    fn flags(ids: &[NodeId]) -> BTreeMap<NodeId, BasicNode> {
        ids.iter()
            .map(|id| (*id, BasicNode::new(format!("node{id}:7000"))))
            .collect()
    }

    fn founding(ids: &[NodeId], join: bool) -> Founding {
        let peers: BTreeMap<NodeId, String> =
            flags(ids).into_iter().map(|(id, n)| (id, n.addr)).collect();
        Founding::new(join, &peers, Duration::ZERO)
    }

    /// The answer of an empty node with `--peer` list `ids` (a new one if `join` is false).
    fn empty(ids: &[NodeId], join: bool) -> VoteReport {
        let f = founding(ids, join);
        VoteReport {
            vote: openraft::Vote::default(),
            last_log_id: None,
            standing: Standing::Rejoining,
            restore_id: None,
            membership: Some(none()),
            joining: join,
            founding: f.answer(None, 0),
        }
    }

    /// The answer of a node that founded a cluster of `ids` with incarnation id `id` and has not
    /// caught up yet.
    fn founded(ids: &[NodeId], id: &str) -> VoteReport {
        VoteReport {
            restore_id: Some(id.to_owned()),
            ..with_membership(rejoining(1, Some((0, 0))), &[ids], &[])
        }
    }

    /// Answers from `ids`, all alike.
    fn from(ids: &[NodeId], r: VoteReport) -> Vec<(NodeId, VoteReport)> {
        ids.iter().map(|id| (*id, r.clone())).collect()
    }

    fn with_membership(
        mut r: VoteReport,
        configs: &[&[NodeId]],
        learners: &[NodeId],
    ) -> VoteReport {
        let joint: Vec<BTreeSet<NodeId>> = configs
            .iter()
            .map(|c| c.iter().copied().collect())
            .collect();
        let nodes: BTreeMap<NodeId, BasicNode> = joint
            .iter()
            .flatten()
            .chain(learners)
            .map(|id| (*id, BasicNode::new(format!("node{id}:7000"))))
            .collect();
        r.membership = Some(openraft::Membership::new(joint, nodes));
        r
    }

    /// Node 1 of `n` voters (1..=n) asks; the answers come from nodes 2, 3, ... in order, each
    /// with the membership of all `n` (as a peer of this release reports it).
    fn prove(n: u64, answers: &[VoteReport]) -> Option<Proof> {
        let ids: Vec<NodeId> = (1..=n).collect();
        let answers: Vec<(NodeId, VoteReport)> = answers
            .iter()
            .zip(2..)
            .map(|(r, id)| (id, with_membership(r.clone(), &[&ids], &[])))
            .collect();
        proof_from(1, &flags(&ids), &none(), &answers).ok()
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
            founding: founding(&[1, 2, 3], false),
            cofounding: AtomicBool::new(false),
        }
    }

    #[test]
    fn a_founder_grants_no_vote_until_every_peer_has_founded() {
        let gate = closed_gate(None);
        gate.cofounding.store(true, Ordering::Release);
        let e = gate.admits_candidate(1, None).unwrap_err();
        assert!(
            e.contains("not voting until every --peer node has founded"),
            "{e}"
        );
        gate.open.store(true, Ordering::Release);
        assert!(
            gate.admits_candidate(1, None).is_err(),
            "open or not, founding refuses"
        );
        gate.cofounding.store(false, Ordering::Release);
        assert!(gate.admits_candidate(1, None).is_ok());
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
        // A single node that lost its disk has nobody to ask: nothing is proven.
        assert!(proof_from(1, &flags(&[1]), &none(), &[]).is_err());
        // Three nodes: one answer is not enough, whatever it says: the silent peer may hold
        // the log (review: a peer lagging at index 0 looks like a new cluster).
        assert_eq!(prove(3, &[report(4, Some((4, 90)))]), None);
        assert_eq!(prove(3, &[report(1, Some((0, 0)))]), None);
        assert_eq!(prove(3, &[]), None);
        let p = prove(3, &[report(4, Some((4, 90))), report(9, Some((0, 0)))]).unwrap();
        assert_eq!(p.term, 9);
        assert_eq!(p.log, Some(log_id(4, 90)));
        // Five nodes: three answers of peers that kept their log, and (review H1) an answer of
        // the fourth voter too, which may be rejoining.
        let kept = [
            report(1, Some((1, 5))),
            report(1, None),
            report(1, Some((1, 4))),
        ];
        assert_eq!(prove(5, &kept[..2]), None);
        assert_eq!(prove(5, &kept), None);
        let p = prove(5, &[&kept[..], &[rejoining(2, Some((2, 6)))]].concat()).unwrap();
        assert_eq!((p.term, p.log), (2, Some(log_id(2, 6))));
        let two_kept = [&kept[..2], &[rejoining(1, None), rejoining(1, None)]].concat();
        assert_eq!(prove(5, &two_kept), None);
        // (Answers of a lockd before runtime membership: its configuration is the --peer list.)
        let three = flags(&[1, 2, 3]);
        let old = vec![(2, report(4, Some((4, 90)))), (3, report(9, Some((0, 0))))];
        assert_eq!(
            proof_from(1, &three, &none(), &old).unwrap().log,
            Some(log_id(4, 90))
        );
        assert!(proof_from(1, &three, &none(), &old[..1]).is_err());
        // Answers of empty nodes carry no membership: they prove nothing, however many.
        let answers = vec![(2, empty(&[1, 2, 3], false)), (3, empty(&[1, 2, 3], false))];
        assert!(proof_from(1, &three, &none(), &answers).is_err());
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
            assert_eq!(prove(5, &early), None, "node 5 answered {n5:?}");
            let p = prove(5, &[n2.clone(), n3.clone(), n5, n1.clone()]).unwrap();
            assert_eq!(p.log, Some(log_id(3, 100)));
            assert_eq!(p.term, 3);
        }
    }

    /// Goal (review H1, the reviewer's run): an acknowledgement the lost disk gave before it was
    /// lost, which a leader still counts, must not let the wiped node vote for a log without the
    /// entry it helps commit. Method: five voters; leader 5 (term 2) replicated entry 2-4 to node
    /// 1 alone, then 1 lost its disk. Nodes 2, 3 and 4 (at 2-3) answer, 5 is cut off: three
    /// answers of peers that kept their log, enough before the fix, and a proof ending at 2-3.
    /// Leader 5 then commits 2-4 with node 2 and the lost disk's old acknowledgement, and
    /// candidate 3 (at 2-3) wins term 3 with the votes of 3, 4 and 1, overwriting 2-4. So the
    /// proof waits for the leader's answer, which brings its bound to 2-4.
    #[test]
    fn review_h1_a_leader_that_may_count_the_lost_disks_acknowledgement_must_answer() {
        let follower = report(2, Some((2, 3)));
        let without_leader = [follower.clone(), follower.clone(), follower.clone()];
        let early = prove(5, &without_leader);
        assert!(
            admits_candidate_while_rejoining(3, Some(log_id(2, 3)), early).is_err(),
            "node 1 voted for a candidate at 2-3 with proof {early:?}, though leader 5 (not \
             asked) may still commit 2-4 with node 1's old acknowledgement"
        );
        let ids: Vec<NodeId> = (1..=5).collect();
        let answers: Vec<(NodeId, VoteReport)> = (2..=4)
            .map(|id| (id, with_membership(follower.clone(), &[&ids], &[])))
            .collect();
        let e = proof_from(1, &flags(&ids), &none(), &answers).unwrap_err();
        assert!(e.contains("[5]"), "{e}");
        let leader = report(2, Some((2, 4)));
        let p = prove(5, &[follower.clone(), follower.clone(), follower, leader]).unwrap();
        assert_eq!((p.term, p.log), (2, Some(log_id(2, 4))));
        assert!(admits_candidate_while_rejoining(3, Some(log_id(2, 3)), Some(p)).is_err());
        assert!(admits_candidate_while_rejoining(3, Some(log_id(2, 4)), Some(p)).is_ok());
    }

    /// Goal (review H1, the variant for votes): a vote the lost disk cast before it was lost,
    /// which a candidate still counts, must not let the wiped node vote again in that term, nor
    /// follow a leader of an older one. Method: five voters; node 1 voted for candidate 5 in term
    /// 7, then lost its disk; 2, 3 and 4 (term 6, leader 2) answer, and only afterwards does 4's
    /// vote for 5 arrive, so 5 wins term 7 with the votes of 5, 4 and the lost disk. Before the
    /// fix the three answers made a proof of term 6: node 1 then followed leader 2 of term 6,
    /// whose commits with 3 and node 1 the leader of term 7 lacks, and could vote for another
    /// candidate in term 7 (two leaders in one term). So the proof waits for candidate 5's answer
    /// (a candidate's term is on its disk before it asks for votes), which brings its term to 7.
    #[test]
    fn review_h1_a_candidate_that_may_count_the_lost_disks_vote_must_answer() {
        let before_the_vote = report(6, Some((6, 50)));
        let early = prove(
            5,
            &[
                before_the_vote.clone(),
                before_the_vote.clone(),
                before_the_vote.clone(),
            ],
        );
        assert!(
            admits_leader_while_rejoining(6, early).is_err(),
            "node 1 follows leader 2 of term 6 with proof {early:?}, though candidate 5 (not \
             asked) may still win term 7 with node 1's old vote"
        );
        assert!(admits_candidate_while_rejoining(7, Some(log_id(6, 50)), early).is_err());
        let candidate = report(7, Some((6, 50)));
        let p = prove(
            5,
            &[
                before_the_vote.clone(),
                before_the_vote.clone(),
                before_the_vote,
                candidate,
            ],
        )
        .unwrap();
        assert_eq!(p.term, 7);
        assert!(admits_leader_while_rejoining(6, Some(p)).is_err());
        assert!(admits_leader_while_rejoining(7, Some(p)).is_ok());
        assert!(admits_candidate_while_rejoining(7, Some(log_id(6, 50)), Some(p)).is_err());
        assert!(admits_candidate_while_rejoining(8, Some(log_id(6, 50)), Some(p)).is_ok());
    }

    /// Goal (review of H1, finding 1): a leader or candidate that is a voter only in the new half
    /// of a joint configuration must answer too. Method: voters 1..5, learner 6, all at 1-9;
    /// leader 1 appends the joint configuration ({1..5}, {1..6}) at 1-10, reaching only 6; 6 wins
    /// term 2 (votes of 2, 3, 4), appends 2-11 and a grant at 2-12 reaching only node 1, which
    /// acknowledges and loses its disk. 2, 3, 4 (term 2) and 5 (term 1) answer at 1-9 and report
    /// {1..5} with learner 6; 6 is silent. Before the fix that made a proof of term 2 ending at
    /// 1-9; 6 then commits 2-12 with node 1's old acknowledgement in both halves, and 5 wins term
    /// 3 with the votes of 4 and node 1, truncating 2-12: one token issued twice. So every node
    /// of a membership that counts this node as a voter, learners included, must answer.
    #[test]
    fn review_h1b_a_learner_that_may_lead_a_joint_configuration_must_answer() {
        let ids: Vec<NodeId> = (1..=5).collect();
        let m = |r| with_membership(r, &[&ids], &[6]);
        let a = vec![
            (2, m(report(2, Some((1, 9))))),
            (3, m(report(2, Some((1, 9))))),
            (4, m(report(2, Some((1, 9))))),
            (5, m(report(1, Some((1, 9))))),
        ];
        let p = proof_from(1, &flags(&ids), &none(), &a).ok();
        assert!(
            admits_candidate_while_rejoining(3, Some(log_id(1, 9)), p).is_err(),
            "node 1 voted for candidate 5 at 1-9 in term 3 with proof {p:?}, though node 6 (not \
             asked) may lead the joint configuration and commit 2-12 with node 1's old \
             acknowledgement"
        );
        let e = proof_from(1, &flags(&ids), &none(), &a).unwrap_err();
        assert!(e.contains("[6]"), "{e}");
        // With 6's answer the bound reaches its log and term.
        let mut all = a.clone();
        all.push((
            6,
            with_membership(report(2, Some((2, 12))), &[&ids, &[1, 2, 3, 4, 5, 6]], &[]),
        ));
        let p = proof_from(1, &flags(&ids), &none(), &all).unwrap();
        assert_eq!((p.term, p.log), (2, Some(log_id(2, 12))));
        assert!(admits_candidate_while_rejoining(3, Some(log_id(1, 9)), Some(p)).is_err());
        // A joiner (a learner of the membership, no voter anywhere) is not held back by it.
        let joiner = a[..3].to_vec();
        assert!(proof_from(6, &flags(&[6, 1]), &none(), &joiner).is_ok());
    }

    /// Goal (review of H1, finding 2): two wiped voters of five both prove, as before H1. Method:
    /// nodes 4 and 5 lost their disks; a wiped node answers without a restore id until it has
    /// its proof, so in the group of the restore id "x" the other wiped node was silent and each
    /// waited for the other for good. Such an answer (rejoining, no restore id) now counts as the
    /// answer of that voter: the peer has no proof, so it neither campaigns nor accepts a leader
    /// or a candidate, and it lost what it had counted. And the error named is the one of the
    /// group with the most answers of peers that kept their log, not the id-less group's.
    #[test]
    fn review_h1b_two_wiped_voters_of_five_both_prove() {
        let ids: Vec<NodeId> = (1..=5).collect();
        let x = |r| VoteReport {
            restore_id: Some("x".to_owned()),
            ..with_membership(r, &[&ids], &[])
        };
        let wiped = VoteReport {
            membership: Some(none()),
            ..rejoining(0, None)
        };
        let mut a: Vec<(NodeId, VoteReport)> = (2..=4)
            .map(|id| (id, x(report(3, Some((3, 100))))))
            .collect();
        a.push((5, wiped.clone()));
        let (p, id) = proof_for(1, &flags(&ids), &none(), &a, None).unwrap();
        assert_eq!(
            (p.term, p.log, id.as_deref()),
            (3, Some(log_id(3, 100)), Some("x"))
        );
        // Two answers of "x" and the wiped node's: the error says what "x" lacks.
        let a = vec![
            (2, x(report(3, Some((3, 100))))),
            (3, x(report(3, Some((3, 100))))),
            (5, wiped.clone()),
        ];
        let e = proof_for(1, &flags(&ids), &none(), &a, None).unwrap_err();
        assert!(e.contains("2 answered"), "{e}");
        // A rejoining peer with the group's id (it has its proof) is counted as before, and an
        // id-less answer of a peer that kept its log (the old cluster) is not.
        let a: Vec<(NodeId, VoteReport)> = (2..=4)
            .map(|id| (id, x(report(3, Some((3, 100))))))
            .chain(std::iter::once((
                5,
                with_membership(report(3, Some((3, 100))), &[&ids], &[]),
            )))
            .collect();
        let e = proof_for(1, &flags(&ids), &none(), &a, None).unwrap_err();
        assert!(e.contains("[5]"), "{e}");
        // Review of 7118a43: an id-less rejoining answer that is not blank (a second process of
        // node 5, or a node of another cluster under that id, that holds a vote, a log or
        // voters) does not stand in for node 5.
        for not_blank in [
            VoteReport {
                membership: Some(none()),
                ..rejoining(3, None)
            },
            VoteReport {
                membership: Some(none()),
                ..rejoining(0, Some((3, 100)))
            },
            with_membership(rejoining(0, None), &[&ids], &[]),
        ] {
            let a: Vec<(NodeId, VoteReport)> = (2..=4)
                .map(|id| (id, x(report(3, Some((3, 100))))))
                .chain(std::iter::once((5, not_blank)))
                .collect();
            let e = proof_for(1, &flags(&ids), &none(), &a, None).unwrap_err();
            assert!(e.contains("[5]"), "{e}");
        }
    }

    /// Three voters: one wiped node and another wiped node is beyond what Raft tolerates (an
    /// entry committed by the two of them exists nowhere else), so the node waits: a rejoining
    /// peer's answer, empty or partial, never completes the proof. Once that peer has caught
    /// up (its gate open) its answer counts again.
    #[test]
    fn three_nodes_a_second_wiped_node_does_not_complete_the_proof() {
        let holder = report(4, Some((4, 90)));
        for other in [rejoining(0, None), rejoining(4, Some((4, 30)))] {
            assert_eq!(prove(3, &[other.clone(), holder.clone()]), None);
        }
        assert_eq!(
            prove(3, &[rejoining(0, None), report(1, Some((0, 0)))]),
            None
        );
        let p = prove(3, &[report(4, Some((4, 90))), holder]).unwrap();
        assert_eq!(p.log, Some(log_id(4, 90)));
    }

    /// An older node's answer (no `kept_log`) vouches for nothing: not for what the cluster
    /// committed, and not for founding.
    #[test]
    fn an_older_nodes_answer_counts_for_neither_proof_nor_founding() {
        let older = |term, last| VoteReport {
            standing: Standing::Unknown,
            ..report(term, last)
        };
        assert_eq!(Standing::from_kept_log(None), Standing::Unknown);
        assert_eq!(Standing::from_kept_log(Some(true)), Standing::KeptLog);
        assert_eq!(Standing::from_kept_log(Some(false)), Standing::Rejoining);
        let (n2, n3) = (report(3, Some((3, 99))), report(3, Some((3, 99))));
        assert_eq!(
            prove(5, &[n2.clone(), n3.clone(), older(3, Some((3, 99)))]),
            None
        );
        // It still answers for the bound, as every other voter must (review H1).
        assert_eq!(
            prove(5, &[n2.clone(), n3.clone(), report(3, Some((3, 100)))]),
            None
        );
        let p = prove(
            5,
            &[n2, n3, report(3, Some((3, 100))), older(4, Some((3, 99)))],
        )
        .unwrap();
        assert_eq!((p.term, p.log), (4, Some(log_id(3, 100))));
        let ids = [1, 2, 3];
        let me = founding(&ids, false);
        let own = me.answer(None, 0);
        let answers = vec![(2, empty(&ids, false)), (3, older(0, None))];
        assert!(may_found(1, &flags(&ids), &me, own, &answers).is_err());
    }

    /// With runtime membership the configuration comes from the answers, not from `--peer`.
    #[test]
    fn the_reported_membership_decides_whom_to_ask_and_how_many_must_answer() {
        // Node 4 joins with `--peer 4=.. --peer 1=..`; the cluster is {1, 2, 3}.
        let joiner = flags(&[4, 1]);
        let c123 = with_membership(report(5, Some((5, 700))), &[&[1, 2, 3]], &[]);
        // Node 1 alone reports {1, 2, 3}: two of them must answer, and 2 and 3 are asked next.
        let answers = from(&[1], c123.clone());
        let e = proof_from(4, &joiner, &none(), &answers).unwrap_err();
        assert!(e.contains("[1, 2, 3]") && e.contains("1 answered"), "{e}");
        let asked: Vec<NodeId> = whom_to_ask(4, &joiner, &answers)
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        assert_eq!(asked, [1, 2, 3]);
        let p = proof_from(4, &joiner, &none(), &from(&[1, 3], c123.clone())).unwrap();
        assert_eq!(p.log, Some(log_id(5, 700)));
        // A rejoining member's answer does not count.
        let c123_rejoining = VoteReport {
            standing: Standing::Rejoining,
            ..c123.clone()
        };
        let answers = vec![(1, c123.clone()), (3, c123_rejoining)];
        assert!(proof_from(4, &joiner, &none(), &answers).is_err());
        // A joint change reported by one peer needs answers from both halves.
        let joint = with_membership(report(6, Some((6, 800))), &[&[1, 2, 3], &[1, 2, 4]], &[]);
        let answers = vec![(1, joint.clone()), (3, c123.clone())];
        let e = proof_from(5, &flags(&[5, 1]), &none(), &answers).unwrap_err();
        assert!(e.contains("[1, 2, 4]"), "{e}");
        let answers = vec![(1, joint.clone()), (2, joint), (3, c123)];
        assert!(proof_from(5, &flags(&[5, 1]), &none(), &answers).is_ok());
        // Learners are asked but not counted: only voters hold commits.
        let with_learner = with_membership(report(6, Some((6, 900))), &[&[1, 2, 3]], &[7]);
        let answers = vec![(1, with_learner.clone()), (7, with_learner)];
        assert!(proof_from(4, &joiner, &none(), &answers).is_err());
        assert!(
            whom_to_ask(4, &joiner, &answers)
                .iter()
                .any(|(id, addr)| *id == 7 && addr == "node7:7000")
        );
    }

    /// Founding needs every other `--peer` node to answer new with the same list, or founded
    /// with exactly that membership; the word of a joiner, a peer with a log, a vote or another
    /// list, a silent peer or a lone flag never founds (the HIGH finding on the membership
    /// patch). The lowest id draws the incarnation id; the others take it from a founder.
    #[test]
    fn a_new_cluster_is_founded_only_when_every_peer_answers_new_with_the_same_list() {
        let ids = [1, 2, 3];
        let me = founding(&ids, false);
        let own = me.answer(None, 0);
        assert!(own.is_some());
        let new = |id| (id, empty(&ids, false));
        assert_eq!(
            may_found(1, &flags(&ids), &me, own, &[new(2), new(3)]),
            Ok(FoundingId::Draw)
        );
        // Not the lowest id: wait for node 1 to found, then take its id.
        let e = may_found(2, &flags(&ids), &me, own, &[new(1), new(3)]).unwrap_err();
        assert!(e.contains("node 1"), "{e}");
        assert_eq!(
            may_found(
                2,
                &flags(&ids),
                &me,
                own,
                &[(1, founded(&ids, "x1")), new(3)]
            ),
            Ok(FoundingId::Adopt("x1".into()))
        );
        // Two founders with different ids: refused.
        let two = [(1, founded(&ids, "x1")), (3, founded(&ids, "x3"))];
        assert!(may_found(2, &flags(&ids), &me, own, &two).is_err());
        // A founder of another list, or one that kept its log, or one past index 0: refused.
        let other = (1, founded(&[1, 2, 3, 4], "x1"));
        assert!(may_found(2, &flags(&ids), &me, own, &[other, new(3)]).is_err());
        let kept = VoteReport {
            standing: Standing::KeptLog,
            ..founded(&ids, "x1")
        };
        assert!(may_found(2, &flags(&ids), &me, own, &[(1, kept), new(3)]).is_err());
        let past = VoteReport {
            last_log_id: Some(log_id(1, 1)),
            ..founded(&ids, "x1")
        };
        assert!(may_found(2, &flags(&ids), &me, own, &[(1, past), new(3)]).is_err());
        // A silent peer: wait (it may hold the log).
        let e = may_found(1, &flags(&ids), &me, own, &[new(2)]).unwrap_err();
        assert!(e.contains("[3]"), "{e}");
        // A joiner's answer never counts.
        let e = may_found(1, &flags(&ids), &me, own, &[new(2), (3, empty(&ids, true))]);
        assert!(e.unwrap_err().contains("--join"));
        // A peer with a log or a vote.
        let with_log = (3, rejoining(0, Some((0, 0))));
        assert!(may_found(1, &flags(&ids), &me, own, &[new(2), with_log]).is_err());
        let mut voted = empty(&ids, false);
        voted.vote = openraft::Vote::new(4, 2);
        voted.founding = None;
        assert!(may_found(1, &flags(&ids), &me, own, &[new(2), (3, voted)]).is_err());
        // Another --peer list.
        let other = (3, empty(&[1, 2, 3, 4], false));
        let e = may_found(1, &flags(&ids), &me, own, &[new(2), other]).unwrap_err();
        assert!(e.contains("another"), "{e}");
        // A peer that says it is not new (it saw a leader's messages).
        let mut seen = empty(&ids, false);
        seen.founding = None;
        assert!(may_found(1, &flags(&ids), &me, own, &[new(2), (3, seen)]).is_err());
        // This node saw a leader's messages, or is itself a joiner.
        me.seen_traffic.store(true, Ordering::Release);
        assert_eq!(me.answer(None, 0), None);
        assert!(may_found(1, &flags(&ids), &me, None, &[new(2), new(3)]).is_err());
        let joiner = founding(&ids, true);
        assert_eq!(joiner.answer(None, 0), None);
        assert!(may_found(1, &flags(&ids), &joiner, None, &[new(2), new(3)]).is_err());
        // A node with a log, a vote, or within its quiet period does not offer to found.
        let f = founding(&ids, false);
        assert_eq!(f.answer(Some(log_id(0, 0)), 0), None);
        assert_eq!(f.answer(None, 1), None);
        let quiet = Founding::new(false, &BTreeMap::new(), Duration::from_secs(60));
        assert_eq!(quiet.answer(None, 0), None);
        // One node alone founds only by `lockd init`.
        let alone = founding(&[1], false);
        let e = may_found(1, &flags(&[1]), &alone, alone.answer(None, 0), &[]).unwrap_err();
        assert!(e.contains("lockd init"), "{e}");
    }

    /// A node that has an incarnation (or restore) id belongs to a cluster: it never offers to
    /// found, even with an empty log (a wiped node that learned the id before any entry).
    #[test]
    fn a_node_with_an_incarnation_id_never_offers_to_found() {
        let gate = closed_gate(None);
        let empty = openraft::Vote::default();
        assert!(gate.report(empty, None, none()).founding.is_some());
        gate.restore.adopt("x1").unwrap();
        assert!(gate.report(empty, None, none()).founding.is_none());
        assert_eq!(gate.founding_answer(None, 0), None);
    }

    /// A configuration whose only voter is this node is never proven; a membership that names
    /// this node nowhere is reported.
    #[test]
    fn a_lost_sole_voter_is_never_proven() {
        let sole = with_membership(report(3, Some((3, 50))), &[&[1]], &[2]);
        let e = proof_from(1, &flags(&[1]), &none(), &[(2, sole)]).unwrap_err();
        assert!(e.contains("only voter"), "{e}");
        let c245 = with_membership(report(3, Some((3, 50))), &[&[2, 4, 5]], &[]);
        assert_eq!(not_a_member(1, &[(2, c245.clone())]), Some(vec![2, 4, 5]));
        assert_eq!(not_a_member(4, &[(2, c245)]), None);
    }

    /// An answer of a lockd before runtime membership still decodes, and a new answer's leading
    /// fields decode as the old type.
    #[test]
    fn vote_reports_decode_across_releases() {
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct Old {
            vote: openraft::Vote<NodeId>,
            last_log_id: Option<LogId>,
        }
        let old = Old {
            vote: openraft::Vote::new(3, 2),
            last_log_id: Some(log_id(3, 40)),
        };
        let decoded = VoteReport::decode(&postcard::to_allocvec(&old).unwrap()).unwrap();
        assert_eq!(decoded.vote, old.vote);
        assert_eq!(decoded.membership, None);
        let new = with_membership(report(3, Some((3, 40))), &[&[1, 2, 3]], &[]);
        let bytes = postcard::to_allocvec(&new).unwrap();
        let back = VoteReport::decode(&bytes).unwrap();
        assert_eq!(back.membership, new.membership);
        assert_eq!(back.last_log_id, new.last_log_id);
        let as_old: Old = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(as_old.last_log_id, new.last_log_id);
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
        let gate = VoteGate::rejoining(
            store.clone(),
            Arc::new(RestoreIdentity::new(None)),
            founding(&[1, 2, 3], false),
        )
        .unwrap();
        assert!(gate.admits_leader(3).is_err(), "nothing learned yet");
        let proof = Proof {
            term: 3,
            log: Some(log_id(3, 40)),
        };
        store.set_rejoin_proof(&proof).await.unwrap();
        drop((gate, store));

        let store = LogStore::new(db.clone(), snapshots());
        assert!(store.rejoining().unwrap());
        let gate = VoteGate::rejoining(
            store.clone(),
            Arc::new(RestoreIdentity::new(None)),
            founding(&[1, 2, 3], false),
        )
        .unwrap();
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
            VoteGate::rejoining(
                store,
                Arc::new(RestoreIdentity::new(None)),
                founding(&[1, 2, 3], false)
            )
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
        let ids = [1, 2, 3];
        let with = |id: Option<&str>, r: VoteReport| VoteReport {
            restore_id: id.map(str::to_owned),
            ..with_membership(r, &[&ids], &[])
        };
        let a1 = (2, with(Some("a"), report(5, Some((5, 40)))));
        let a2 = (3, with(Some("a"), report(5, Some((5, 40)))));
        let b = (3, with(Some("b"), report(9, Some((9, 90)))));
        let old = (2, with(None, report(9, Some((9, 90)))));
        let old3 = (3, with(None, report(9, Some((9, 90)))));
        let p = |answers: &[(NodeId, VoteReport)], own: Option<&str>| {
            proof_for(1, &flags(&ids), &none(), answers, own).ok()
        };
        // A restored node (or one of a founded incarnation): its own id only.
        let (pr, id) = p(&[a1.clone(), a2.clone(), b.clone()], Some("a")).unwrap();
        assert_eq!((pr.term, id.as_deref()), (5, Some("a")));
        assert_eq!(p(&[a1.clone(), b.clone()], Some("a")), None);
        assert_eq!(p(&[a1.clone(), old3.clone()], Some("a")), None);
        // A wiped node: the id whose answers prove, with the bound of those answers only.
        let (pr, id) = p(&[old.clone(), a1.clone(), a2.clone()], None).unwrap();
        assert_eq!(
            (pr.term, pr.log, id.as_deref()),
            (5, Some(log_id(5, 40)), Some("a"))
        );
        assert_eq!(p(&[a1.clone(), old3.clone()], None), None);
        assert_eq!(p(&[a1, b], None), None);
        // Never restored nor founded by this release: as before.
        let (_, id) = p(&[old, old3], None).unwrap();
        assert_eq!(id, None);
    }
}

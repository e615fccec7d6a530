//! The membership admin calls of `lockd.v1.Cluster` (`ListMembers`, `AddMember`,
//! `PromoteMember`, `RemoveMember`, `TransferLeader`), answered by the leader.
//!
//! - **Add** puts a node in the membership as a learner (`AddNodes`): the leader replicates to
//!   it, by snapshot when it is far behind, and it never votes. The node is started first with
//!   `--join` (it never forms a cluster of its own).
//! - **Promote** makes a learner a voter by openraft's joint consensus, only once it is caught up
//!   (its matched log within [`CAUGHT_UP_ENTRIES_MAX`] of the leader's, and it answered the
//!   leader within one maximum election timeout), so a promotion never adds a voter that would
//!   hold up commits while it fetches a snapshot.
//! - **Remove** takes a node out. As etcd does with its strict reconfiguration check, it refuses
//!   a change that would leave no up-to-date majority among the voters left (counting the leader
//!   and caught-up voters; caught up includes an answer within one maximum election timeout,
//!   since on an idle cluster a dead voter's matched log equals the leader's too), and it
//!   refuses removing the last voter. Removing a node that is not a member succeeds (a retry
//!   after a lost reply). The leader removes itself only after handing leadership to another
//!   voter, so the cluster never waits out an election timeout.
//! - **One at a time**: the leader holds a lock from a call's checks to the end of its change
//!   (or transfer), so two concurrent calls never both pass checks that only one may pass.
//! - **Joint configurations** are never left behind for good: each change runs in a task of its
//!   own (a caller's timeout never drops it between its two steps), and a leader that finds a
//!   committed joint configuration as its newest completes it ([`finish_joint_changes`]).
//! - **Transfer** moves leadership. openraft 0.9 has no transfer call, and its followers refuse
//!   votes while their leader lease runs (`election_timeout_max` after the last heartbeat). So
//!   the leader waits until the target's matched log equals its own last log id, then hands its
//!   *own* Raft a vote request for the target in the next term: a leader's lease is the time it
//!   was elected, so after that long it grants the vote and steps down, having voted for the
//!   target, which is what a real vote request of the target would have done. Then it asks the
//!   target (`lockd.raft.v1.Raft/Elect`) to campaign: the old leader's vote for it is not a
//!   committed one, so it is granted with no lease wait, and with three voters that vote and
//!   the target's own are a majority at once. With more voters the other followers must vote
//!   too, and they refuse until their lease from the old leader's last heartbeat ends, so the
//!   leader asks the target only then (`election_timeout_max` after stepping down). The old
//!   leader keeps its own elections off meanwhile, so it does not compete. Every vote still
//!   passes openraft's log check, so a transfer cannot elect a node that lacks a committed entry.
//!
//! All of them are `admin` under an authorization policy. Without a policy the four that
//! change something are refused unless the node runs with `--allow-membership-without-policy`
//! ([`may_change`]); `ListMembers` answers anyone.

use std::collections::BTreeSet;
use std::time::Duration;

use lockd_api::v1::{
    AddMemberRequest, AddMemberResponse, ListMembersRequest, ListMembersResponse, MemberInfo,
    PromoteMemberRequest, PromoteMemberResponse, RemoveMemberRequest, RemoveMemberResponse,
    TransferLeaderRequest, TransferLeaderResponse,
};
use openraft::{BasicNode, ChangeMembers, ServerState};
use tonic::{Request, Response, Status};

use super::cluster::{ClusterService, Route};
use super::errors;
use crate::raft::NodeId;
use crate::service::raft::ElectRequest;

/// A learner whose matched log is at most this many entries behind the leader's last one is
/// caught up: a few AppendEntries (16 entries each) of a busy leader, so a promotion does not
/// wait for a moment of silence, while a learner still fetching a snapshot is far outside it.
pub const CAUGHT_UP_ENTRIES_MAX: u64 = 64;
/// Budget of a membership call forwarded to the leader: removing the leader includes a transfer.
const MEMBERSHIP_FORWARD_TIMEOUT: Duration = Duration::from_secs(12);
/// How long a transfer may take in all: catching the target up, the step-down, the election.
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a membership change may take to commit (two entries: joint, then uniform).
const CHANGE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a membership call waits for another one on the leader to end before refusing: one
/// change may take [`CHANGE_TIMEOUT`], a removal of the leader a transfer too.
const LOCK_WAIT: Duration = Duration::from_secs(6);
/// How long a removal waits for the leader to see an up-to-date majority among the voters left
/// before refusing: a leader elected a moment ago has not heard from every follower yet.
const REMOVE_SETTLE: Duration = Duration::from_secs(1);
/// Past the followers' leader lease before the target of a transfer among more than three voters
/// campaigns: heartbeats in flight when the leader stepped down may still renew it a little.
const LEASE_MARGIN: Duration = Duration::from_millis(50);
/// Pause after this leader refused to step down (its lease since its election still runs).
const VOTE_RETRY: Duration = Duration::from_millis(20);
/// How long, in all, a transfer may hold new proposals while its target catches up the last
/// entries: a few replication round trips.
const TRANSFER_HOLD_MAX: Duration = Duration::from_millis(250);
/// Pause between two looks at the target's progress during a transfer.
const TRANSFER_POLL: Duration = Duration::from_millis(2);

/// How long a committed joint configuration must stay the newest before the leader completes
/// it itself: the leader that proposed it proposes the uniform one within milliseconds.
pub const JOINT_GRACE: Duration = Duration::from_secs(1);
/// How often the leader looks for a joint configuration left behind.
const JOINT_POLL: Duration = Duration::from_millis(250);

/// The voters to complete a joint configuration with, and the joint entry's index: `Some` when
/// this node leads and its newest membership is a committed joint one (a leader that crashed
/// between the two steps of a change, or a change whose second step was never proposed, left
/// it; openraft does not complete it by itself). While the second step is in flight the newest
/// membership is already the uniform one.
pub fn joint_to_complete(
    m: &openraft::RaftMetrics<NodeId, BasicNode>,
) -> Option<(u64, BTreeSet<NodeId>)> {
    if m.state != ServerState::Leader {
        return None;
    }
    let joint = m.membership_config.membership().get_joint_config();
    let index = m.membership_config.log_id().map(|l| l.index)?;
    let applied = m.last_applied.map(|l| l.index)?;
    (joint.len() > 1 && index <= applied)
        .then(|| (index, joint.last().cloned().unwrap_or_default()))
}

/// Runs for the node's life: a leader that finds a committed joint configuration left behind
/// for [`JOINT_GRACE`] completes it (its last configuration, as `change_membership`'s second
/// step would have), so membership changes are not refused forever.
pub async fn finish_joint_changes(
    raft: crate::raft::Raft,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let mut seen: Option<(u64, tokio::time::Instant)> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(JOINT_POLL) => {}
        }
        let found = joint_to_complete(&raft.metrics().borrow());
        let Some((index, voters)) = found else {
            seen = None;
            continue;
        };
        match seen {
            Some((i, since)) if i == index && since.elapsed() >= JOINT_GRACE => {}
            Some((i, _)) if i == index => continue,
            _ => {
                seen = Some((index, tokio::time::Instant::now()));
                continue;
            }
        }
        tracing::warn!(
            index,
            ?voters,
            "lockd: completing a joint membership change left behind"
        );
        match raft
            .change_membership(ChangeMembers::ReplaceAllVoters(voters), false)
            .await
        {
            Ok(_) => tracing::info!("lockd: joint membership change completed"),
            Err(e) => {
                tracing::warn!(error = %e, "lockd: completing a joint membership change failed")
            }
        }
        seen = None;
    }
}

/// Who may call `AddMember`, `PromoteMember`, `RemoveMember` or `TransferLeader` besides the
/// policy's `admin` (checked by the caller first). Without a policy nobody is identified, and
/// these calls shrink a cluster to one voter or keep it leaderless in a transfer loop, so open
/// mode (no `--auth-policy`) answers them only for a call forwarded by a member authenticated by
/// its node certificate (the member it came to checked its caller), or for anyone with
/// `--allow-membership-without-policy`. No exemption for loopback callers, for the reason
/// `service::snapshot::may_save` gives. PERMISSION_DENIED names the call, the caller's address
/// and the two ways out.
pub fn may_change(
    call: &str,
    has_policy: bool,
    allow_without_policy: bool,
    forwarded_by_member: bool,
    remote: Option<std::net::SocketAddr>,
) -> Result<(), Status> {
    if has_policy || allow_without_policy || forwarded_by_member {
        return Ok(());
    }
    Err(errors::open_mode_refused(
        call,
        "a membership change or leader transfer can take the cluster's quorum away",
        "these calls are",
        "--allow-membership-without-policy",
        "change the membership",
        remote,
    ))
}

/// Keeps this node's elections off while it lives: a transfer's hand-over holds one, so the old
/// leader does not compete with the target, and elections come back on however the hand-over
/// ends, a dropped call included.
struct ElectionsOff(crate::raft::Raft);

impl ElectionsOff {
    fn new(raft: crate::raft::Raft) -> Self {
        raft.runtime_config().elect(false);
        ElectionsOff(raft)
    }
}

impl Drop for ElectionsOff {
    fn drop(&mut self) {
        self.0.runtime_config().elect(true);
    }
}

/// What the leader knows of one node.
struct Known {
    info: MemberInfo,
    voter: bool,
}

impl ClusterService {
    /// The membership as the leader sees it; `Err` when this node is not the leader.
    fn members_local(&self) -> Result<ListMembersResponse, Status> {
        let m = self.ctx().raft.metrics().borrow().clone();
        let me = self.ctx().id;
        if m.state != ServerState::Leader {
            return Err(errors::no_quorum(format!(
                "node {me} is no longer the leader; retry"
            )));
        }
        let membership = m.membership_config.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let last = m.last_log_index.unwrap_or(0);
        let replication = m.replication.clone().unwrap_or_default();
        let fresh = Duration::from_millis(self.ctx().election_timeout_max_ms);
        let acks = self
            .ctx()
            .acks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let alive = |id: &NodeId| *id == me || acks.get(id).is_some_and(|t| t.elapsed() <= fresh);
        let members = membership
            .nodes()
            .map(|(id, node)| {
                let matched = if *id == me {
                    Some(last)
                } else {
                    replication.get(id).and_then(|l| l.map(|l| l.index))
                };
                let lag = matched.map_or(last, |i| last.saturating_sub(i));
                MemberInfo {
                    id: *id,
                    address: node.addr.clone(),
                    role: if voters.contains(id) {
                        "voter"
                    } else {
                        "learner"
                    }
                    .into(),
                    leader: *id == me,
                    matched_index: matched.unwrap_or(0),
                    lag,
                    caught_up: matched.is_some() && lag <= CAUGHT_UP_ENTRIES_MAX && alive(id),
                }
            })
            .collect();
        Ok(ListMembersResponse {
            leader_id: me,
            term: m.current_term,
            last_log_index: last,
            members,
            joint: membership.get_joint_config().len() > 1,
        })
    }

    fn known(&self, id: NodeId) -> Result<(ListMembersResponse, Option<Known>), Status> {
        let list = self.members_local()?;
        let found = list.members.iter().find(|i| i.id == id).map(|i| Known {
            voter: i.role == "voter",
            info: i.clone(),
        });
        Ok((list, found))
    }

    fn refuse_during_joint(list: &ListMembersResponse) -> Result<(), Status> {
        if list.joint {
            return Err(errors::no_quorum(
                "a membership change is in progress (joint consensus; the leader completes it); \
                 retry in a moment",
            ));
        }
        Ok(())
    }

    async fn change(
        &self,
        what: String,
        change: ChangeMembers<NodeId, BasicNode>,
    ) -> Result<(), Status> {
        let raft = self.ctx().raft.clone();
        // A task of its own: dropping `change_membership` between its two steps (joint, then
        // uniform) would leave the joint configuration in place; only the wait is bounded.
        let task = tokio::spawn(async move { raft.change_membership(change, false).await });
        match tokio::time::timeout(CHANGE_TIMEOUT, task).await {
            Ok(Ok(Ok(_))) => {
                tracing::info!(change = %what, "lockd: membership changed");
                Ok(())
            }
            Ok(Ok(Err(e))) => Err(errors::outcome_unknown(format!(
                "{what} failed: {e}; `lockctl member list` shows whether it applied"
            ))),
            Ok(Err(e)) => Err(errors::outcome_unknown(format!(
                "{what} stopped: {e}; `lockctl member list` shows whether it applied"
            ))),
            Err(_) => Err(errors::outcome_unknown(format!(
                "{what} did not commit within {} ms (it goes on); `lockctl member list` shows \
                 whether it applied",
                CHANGE_TIMEOUT.as_millis()
            ))),
        }
    }

    async fn add_local(&self, req: AddMemberRequest) -> Result<AddMemberResponse, Status> {
        if req.id == 0 {
            return Err(errors::invalid_field(
                "id",
                "member id 0 is not valid; ids start at 1",
            ));
        }
        crate::config::check_host_port(&req.address).map_err(|why| {
            errors::invalid_field("address", format!("address {:?} {why}", req.address))
        })?;
        let (list, known) = self.known(req.id)?;
        if let Some(k) = known {
            if k.info.address == req.address {
                return Ok(AddMemberResponse {
                    members: list.members,
                });
            }
            return Err(errors::precondition(
                "address",
                format!(
                    "node {} is already a member at {:?}, not {:?}; a member keeps its address \
                     (give it a DNS name to move it), or remove it first",
                    req.id, k.info.address, req.address
                ),
            ));
        }
        // Two members at one address would make the leader replicate to one node twice, and
        // the node there refuse the messages meant for the other (its certificate names one).
        if let Some(other) = list.members.iter().find(|i| i.address == req.address) {
            return Err(errors::precondition(
                "address",
                format!(
                    "node {} already uses address {:?}; a new member needs an address of its \
                     own (remove node {} first if it moved)",
                    other.id, req.address, other.id
                ),
            ));
        }
        Self::refuse_during_joint(&list)?;
        let node = BasicNode::new(req.address.clone());
        let raft = self.ctx().raft.clone();
        // Not blocking: catching up may take a snapshot; `member list` shows the progress.
        match tokio::time::timeout(CHANGE_TIMEOUT, raft.add_learner(req.id, node, false)).await {
            Ok(Ok(_)) => {
                tracing::info!(id = req.id, address = %req.address, "lockd: learner added");
            }
            Ok(Err(e)) => {
                return Err(errors::outcome_unknown(format!(
                    "adding node {} failed: {e}",
                    req.id
                )));
            }
            Err(_) => {
                return Err(errors::outcome_unknown(format!(
                    "adding node {} did not commit within {} ms; retry",
                    req.id,
                    CHANGE_TIMEOUT.as_millis()
                )));
            }
        }
        Ok(AddMemberResponse {
            members: self.members_local()?.members,
        })
    }

    async fn promote_local(
        &self,
        req: PromoteMemberRequest,
    ) -> Result<PromoteMemberResponse, Status> {
        let (list, known) = self.known(req.id)?;
        let Some(k) = known else {
            return Err(not_a_member(req.id, &list));
        };
        if !k.voter {
            Self::refuse_during_joint(&list)?;
            if !k.info.caught_up {
                return Err(errors::precondition(
                    "id",
                    format!(
                        "learner {} is not caught up: its log matches to index {} of {} ({} \
                         behind, at most {CAUGHT_UP_ENTRIES_MAX} allowed), or it has not \
                         answered the leader lately; wait and retry",
                        req.id, k.info.matched_index, list.last_log_index, k.info.lag
                    ),
                ));
            }
            self.change(
                format!("promoting node {} to voter", req.id),
                ChangeMembers::AddVoterIds(BTreeSet::from([req.id])),
            )
            .await?;
        }
        Ok(PromoteMemberResponse {
            members: self.members_local()?.members,
        })
    }

    /// Removes a member; `Ok(None)` when this node is the one to remove and has handed over
    /// leadership: the caller forwards the call to the new leader.
    async fn remove_local(&self, id: NodeId) -> Result<Option<RemoveMemberResponse>, Status> {
        let settle = tokio::time::Instant::now() + REMOVE_SETTLE;
        loop {
            let (list, known) = self.known(id)?;
            // Already gone: the retry of a removal whose reply was lost succeeds.
            let Some(k) = known else {
                return Ok(Some(RemoveMemberResponse {
                    members: list.members,
                }));
            };
            Self::refuse_during_joint(&list)?;
            if !k.voter {
                self.change(
                    format!("removing learner {id}"),
                    ChangeMembers::RemoveNodes(BTreeSet::from([id])),
                )
                .await?;
                return Ok(Some(RemoveMemberResponse {
                    members: self.members_local()?.members,
                }));
            }
            let left: Vec<&MemberInfo> = list
                .members
                .iter()
                .filter(|i| i.role == "voter" && i.id != id)
                .collect();
            if left.is_empty() {
                return Err(errors::precondition(
                    "id",
                    format!("node {id} is the last voter; a cluster needs one"),
                ));
            }
            let healthy: Vec<NodeId> = left
                .iter()
                .filter(|i| i.leader || i.caught_up)
                .map(|i| i.id)
                .collect();
            let majority = left.len() / 2 + 1;
            if healthy.len() < majority {
                // A leader elected a moment ago may not have heard from every follower yet.
                if tokio::time::Instant::now() < settle {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                return Err(errors::precondition(
                    "id",
                    format!(
                        "removing node {id} would leave voters {:?} of which only {healthy:?} \
                         are up to date, fewer than their majority of {majority}: the cluster \
                         could not commit; bring the lagging voters back first",
                        left.iter().map(|i| i.id).collect::<Vec<_>>()
                    ),
                ));
            }
            if k.info.leader {
                let to = self.transfer_local(None).await?;
                tracing::info!(
                    new_leader = to.leader_id,
                    "lockd: handed leadership over before removing this node"
                );
                return Ok(None);
            }
            self.change(
                format!("removing voter {id}"),
                ChangeMembers::RemoveVoters(BTreeSet::from([id])),
            )
            .await?;
            return Ok(Some(RemoveMemberResponse {
                members: self.members_local()?.members,
            }));
        }
    }

    /// Moves leadership to `target` (or the furthest other voter); see the module docs.
    async fn transfer_local(
        &self,
        target: Option<NodeId>,
    ) -> Result<TransferLeaderResponse, Status> {
        let started = tokio::time::Instant::now();
        let deadline = started + TRANSFER_TIMEOUT;
        let me = self.ctx().id;
        let list = self.members_local()?;
        Self::refuse_during_joint(&list)?;
        let voters: Vec<&MemberInfo> = list.members.iter().filter(|i| i.role == "voter").collect();
        let target = match target {
            Some(t) if t == me => {
                return Ok(TransferLeaderResponse {
                    leader_id: me,
                    elapsed_ms: 0,
                });
            }
            Some(t) => {
                if !voters.iter().any(|i| i.id == t) {
                    return Err(errors::precondition(
                        "id",
                        format!(
                            "node {t} is not a voter (voters: {:?}); only a voter can lead",
                            voters.iter().map(|i| i.id).collect::<Vec<_>>()
                        ),
                    ));
                }
                t
            }
            None => voters
                .iter()
                .filter(|i| i.id != me)
                .max_by_key(|i| (i.matched_index, std::cmp::Reverse(i.id)))
                .map(|i| i.id)
                .ok_or_else(|| {
                    errors::precondition("id", format!("node {me} is the only voter"))
                })?,
        };
        let raft = self.ctx().raft.clone();
        let mut rx = raft.metrics();
        // New batches wait while the target is within a few entries of this log: under steady
        // load the log never stands still, and the target's could take seconds to match it.
        // Dropped when the transfer ends, whichever way; it lets go by itself after
        // [`TRANSFER_HOLD_MAX`] in all (a target that does not keep up, or a step-down vote that
        // waits on a slow disk, then does not stall the clients).
        let mut hold = None;
        let mut held_since = None;
        // Step down in favour of the target once its log matches ours.
        let term = loop {
            let (state, term, last, matched) = {
                let m = rx.borrow_and_update();
                let matched = m
                    .replication
                    .as_ref()
                    .and_then(|r| r.get(&target).copied().flatten());
                (m.state, m.current_term, m.last_log_index, matched)
            };
            if state != ServerState::Leader {
                return Err(errors::no_quorum(format!(
                    "node {me} lost leadership while handing it to node {target}; retry"
                )));
            }
            let behind = last
                .unwrap_or(0)
                .saturating_sub(matched.map_or(0, |l| l.index));
            if matched.is_some() && behind <= CAUGHT_UP_ENTRIES_MAX && hold.is_none() {
                let until =
                    *held_since.get_or_insert_with(tokio::time::Instant::now) + TRANSFER_HOLD_MAX;
                if tokio::time::Instant::now() < until {
                    hold = Some(self.ctx().proposer.hold(until));
                }
            }
            if matched.is_some() && matched.map(|l| l.index) == last {
                let vote = openraft::Vote::new(term + 1, target);
                let granted = raft
                    .vote(openraft::raft::VoteRequest::new(vote, matched))
                    .await
                    .map_err(|e| errors::internal(format!("stepping down for node {target}: {e}")))?
                    .vote_granted;
                if granted {
                    break term;
                }
                // Refused: this leader's lease from its election has not run yet, or an entry
                // was appended meanwhile. Asking again at once would only load the Raft core,
                // and clients need not wait for the lease: proposing resumes meanwhile.
                hold = None;
                tokio::time::sleep(VOTE_RETRY).await;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(errors::no_quorum(format!(
                    "node {target}'s log did not match the leader's within {} ms (matched \
                     {matched:?}, leader at {last:?}), or this leader's lease has not run yet; \
                     leadership stays with node {me}; retry",
                    TRANSFER_TIMEOUT.as_millis()
                )));
            }
            tokio::time::sleep(TRANSFER_POLL).await;
        };
        // Nothing more is proposed here: this node is a follower now, and batches proposed
        // after the step-down fail and their callers retry at the new leader.
        drop(hold);
        let stepped_down = tokio::time::Instant::now();
        tracing::info!(
            target,
            term,
            waited_ms = (stepped_down - started).as_millis() as u64,
            "lockd: node {target}'s log matches; stepped down"
        );
        // This node must not compete with the target while it campaigns. The guard turns its
        // elections back on also when this future is dropped (the caller gave up, a
        // grpc-timeout ran out): otherwise the old leader would never campaign again.
        let elections_off = ElectionsOff::new(raft.clone());
        let voters = voters.len();
        let result = self
            .hand_over(me, target, term, voters, stepped_down, deadline)
            .await;
        drop(elections_off);
        result.map(|()| {
            let elapsed_ms = started.elapsed().as_millis() as u64;
            tracing::info!(target, elapsed_ms, "lockd: leadership transferred");
            TransferLeaderResponse {
                leader_id: target,
                elapsed_ms,
            }
        })
    }

    /// After stepping down: tells the target to campaign, once the followers would grant it a
    /// vote, and waits until it leads.
    #[allow(
        clippy::too_many_arguments,
        reason = "one call site, the transfer's own state"
    )]
    async fn hand_over(
        &self,
        me: NodeId,
        target: NodeId,
        term: u64,
        voters: usize,
        stepped_down: tokio::time::Instant,
        deadline: tokio::time::Instant,
    ) -> Result<(), Status> {
        let mut rx = self.ctx().raft.metrics();
        // The target's own vote and this node's make a majority of at most three voters. With
        // more, followers must vote too, and they refuse while their lease from this node's
        // last heartbeat runs: campaigning before it ends would only cost the target a term.
        if voters / 2 + 1 > 2 {
            let lease = Duration::from_millis(self.ctx().election_timeout_max_ms);
            tokio::time::sleep_until(stepped_down + lease + LEASE_MARGIN).await;
        }
        tracing::info!(
            target,
            term,
            "lockd: stepped down; asking node {target} to campaign"
        );
        let addr = self.ctx().members.addr(target).unwrap_or_default();
        let asked = async {
            let mut client = self
                .ctx()
                .members
                .dial()
                .raft_client(target, &addr)
                .map_err(|e| format!("address {addr:?}: {e}"))?;
            let data = postcard::to_allocvec(&ElectRequest { leader: me, term })
                .map_err(|e| e.to_string())?;
            let mut request = self.ctx().members.dial().raft_request(data);
            request.set_timeout(deadline.saturating_duration_since(tokio::time::Instant::now()));
            client
                .elect(request)
                .await
                .map_err(|s| s.message().to_owned())
        }
        .await;
        if let Err(e) = asked {
            // The cluster elects a leader by itself after an election timeout.
            return Err(errors::no_quorum(format!(
                "node {me} stepped down but node {target} was not told to campaign ({e}); an \
                 election follows within an election timeout"
            )));
        }
        loop {
            let leader = rx.borrow_and_update().current_leader;
            if leader == Some(target) {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return Err(errors::no_quorum(format!(
                    "node {target} was asked to campaign but is not known as leader after {} \
                     ms (leader: {leader:?}); `lockctl status` shows who leads",
                    TRANSFER_TIMEOUT.as_millis()
                )));
            }
        }
    }

    /// Takes the leader's membership lock ([`NodeCtx::membership_lock`]); the checks of the
    /// call run after it, so they see the membership the previous call left.
    ///
    /// [`NodeCtx::membership_lock`]: crate::node::NodeCtx::membership_lock
    async fn lock_membership(&self) -> Result<tokio::sync::MutexGuard<'_, ()>, Status> {
        tokio::time::timeout(LOCK_WAIT, self.ctx().membership_lock.lock())
            .await
            .map_err(|_| {
                errors::no_quorum(format!(
                    "another membership change or leader transfer on node {} did not end \
                     within {} ms; nothing was done, retry",
                    self.ctx().id,
                    LOCK_WAIT.as_millis()
                ))
            })
    }

    /// [`may_change`] for this node and this call.
    fn may_change<T>(
        &self,
        call: &str,
        req: &Request<T>,
        caller: &crate::auth::Caller,
    ) -> Result<(), Status> {
        let ctx = self.ctx();
        may_change(
            call,
            ctx.auth.has_policy(),
            ctx.allow_membership_without_policy,
            ctx.auth.authenticates_nodes() && caller.forwarded,
            req.remote_addr(),
        )
    }

    /// A membership call as forwarded to the leader.
    fn forward_membership<T>(&self, msg: T, caller: &crate::auth::Caller) -> Request<T> {
        let mut req = self.forward_request(msg, caller);
        req.set_timeout(MEMBERSHIP_FORWARD_TIMEOUT);
        req
    }

    fn leader_client(
        &self,
        leader: NodeId,
    ) -> Result<lockd_api::v1::cluster_client::ClusterClient<tonic::transport::Channel>, Status>
    {
        self.ctx()
            .members
            .cluster_client(leader)
            .map(|(_, c)| c)
            .ok_or_else(|| {
                errors::no_quorum(format!("leader {leader} is no longer a member; retry"))
            })
    }

    pub(super) async fn list_members_rpc(
        &self,
        req: Request<ListMembersRequest>,
    ) -> Result<Response<ListMembersResponse>, Status> {
        let caller = self
            .ctx()
            .auth
            .authorize(&req, crate::auth::Operation::Admin, None)?;
        match self.route(&req).await? {
            Route::Local => self.members_local().map(Response::new),
            Route::Forward(leader) => self
                .leader_client(leader)?
                .list_members(self.forward_membership(req.into_inner(), &caller))
                .await
                .map_err(|s| self.forward_error(leader, s)),
        }
    }

    pub(super) async fn add_member_rpc(
        &self,
        req: Request<AddMemberRequest>,
    ) -> Result<Response<AddMemberResponse>, Status> {
        let caller = self
            .ctx()
            .auth
            .authorize(&req, crate::auth::Operation::Admin, None)?;
        self.may_change("AddMember", &req, &caller)?;
        match self.route(&req).await? {
            Route::Local => {
                let _changing = self.lock_membership().await?;
                self.add_local(req.into_inner()).await.map(Response::new)
            }
            Route::Forward(leader) => self
                .leader_client(leader)?
                .add_member(self.forward_membership(req.into_inner(), &caller))
                .await
                .map_err(|s| self.forward_error(leader, s)),
        }
    }

    pub(super) async fn promote_member_rpc(
        &self,
        req: Request<PromoteMemberRequest>,
    ) -> Result<Response<PromoteMemberResponse>, Status> {
        let caller = self
            .ctx()
            .auth
            .authorize(&req, crate::auth::Operation::Admin, None)?;
        self.may_change("PromoteMember", &req, &caller)?;
        match self.route(&req).await? {
            Route::Local => {
                let _changing = self.lock_membership().await?;
                self.promote_local(req.into_inner())
                    .await
                    .map(Response::new)
            }
            Route::Forward(leader) => self
                .leader_client(leader)?
                .promote_member(self.forward_membership(req.into_inner(), &caller))
                .await
                .map_err(|s| self.forward_error(leader, s)),
        }
    }

    pub(super) async fn remove_member_rpc(
        &self,
        req: Request<RemoveMemberRequest>,
    ) -> Result<Response<RemoveMemberResponse>, Status> {
        let caller = self
            .ctx()
            .auth
            .authorize(&req, crate::auth::Operation::Admin, None)?;
        self.may_change("RemoveMember", &req, &caller)?;
        let forwarded = req.metadata().contains_key(lockd_api::FORWARDED_HEADER);
        let msg = match self.route(&req).await? {
            Route::Local => {
                let msg = req.into_inner();
                // Released before the call goes on to the new leader below.
                let changing = self.lock_membership().await?;
                if let Some(done) = self.remove_local(msg.id).await? {
                    return Ok(Response::new(done));
                }
                drop(changing);
                msg
            }
            Route::Forward(leader) => {
                return self
                    .leader_client(leader)?
                    .remove_member(self.forward_membership(req.into_inner(), &caller))
                    .await
                    .map_err(|s| self.forward_error(leader, s));
            }
        };
        // This leader handed over leadership to remove itself: the new leader removes it. A call
        // forwarded here is not forwarded again; its sender retries.
        let leader = self.ctx().raft.metrics().borrow().current_leader;
        match leader {
            Some(l) if l != self.ctx().id && !forwarded => self
                .leader_client(l)?
                .remove_member(self.forward_membership(msg, &caller))
                .await
                .map_err(|s| self.forward_error(l, s)),
            _ => Err(errors::no_quorum(format!(
                "node {} handed leadership over to be removed; retry the removal",
                msg.id
            ))),
        }
    }

    pub(super) async fn transfer_leader_rpc(
        &self,
        req: Request<TransferLeaderRequest>,
    ) -> Result<Response<TransferLeaderResponse>, Status> {
        let caller = self
            .ctx()
            .auth
            .authorize(&req, crate::auth::Operation::Admin, None)?;
        self.may_change("TransferLeader", &req, &caller)?;
        match self.route(&req).await? {
            Route::Local => {
                let id = req.into_inner().id;
                let _changing = self.lock_membership().await?;
                self.transfer_local((id != 0).then_some(id))
                    .await
                    .map(Response::new)
            }
            Route::Forward(leader) => self
                .leader_client(leader)?
                .transfer_leader(self.forward_membership(req.into_inner(), &caller))
                .await
                .map_err(|s| self.forward_error(leader, s)),
        }
    }
}

fn not_a_member(id: NodeId, list: &ListMembersResponse) -> Status {
    errors::precondition(
        "id",
        format!(
            "node {id} is not a member (members: {:?})",
            list.members.iter().map(|i| i.id).collect::<Vec<_>>()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, LogId, Membership, RaftMetrics, StoredMembership};
    use std::sync::Arc;

    fn metrics(
        state: ServerState,
        configs: Vec<BTreeSet<NodeId>>,
        at: u64,
        applied: u64,
    ) -> RaftMetrics<NodeId, BasicNode> {
        let nodes: BTreeSet<NodeId> = configs.iter().flatten().copied().collect();
        let log_id = |i| Some(LogId::new(CommittedLeaderId::new(2, 1), i));
        let mut m = RaftMetrics::new_initial(1);
        m.state = state;
        m.membership_config = Arc::new(StoredMembership::new(
            log_id(at),
            Membership::new(configs, nodes),
        ));
        m.last_applied = log_id(applied);
        m
    }

    /// Goal (review of the membership branch, M-C): open mode refuses the calls that change the
    /// membership or move leadership to every caller, loopback included, unless the node runs
    /// with --allow-membership-without-policy or a TLS-authenticated member forwarded the call;
    /// the refusal is PERMISSION_DENIED naming the call, the caller and both ways out.
    #[test]
    fn open_mode_membership_changes_only_forwarded_by_a_member_or_with_the_flag() {
        let remote: std::net::SocketAddr = "192.0.2.7:5000".parse().unwrap();
        for caller in ["127.3.4.5:5000", "[::1]:9", "192.0.2.7:5000"] {
            let addr: std::net::SocketAddr = caller.parse().unwrap();
            let e = may_change("RemoveMember", false, false, false, Some(addr)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied);
            assert!(
                e.message().contains("RemoveMember")
                    && e.message().contains(&addr.to_string())
                    && e.message().contains("--allow-membership-without-policy")
                    && e.message().contains("--auth-policy"),
                "{e:?}"
            );
        }
        assert!(may_change("TransferLeader", false, false, false, None).is_err());
        assert!(may_change("AddMember", false, true, false, Some(remote)).is_ok());
        assert!(may_change("AddMember", false, false, true, Some(remote)).is_ok());
        assert!(may_change("AddMember", true, false, false, Some(remote)).is_ok());
    }

    /// M1 of the membership review: a committed joint configuration left as the newest one is
    /// completed by the leader, with the joint's last configuration; an uncommitted one (its
    /// second step may be on the way), a uniform one, or one on a follower is left alone.
    #[test]
    fn a_leader_completes_a_committed_joint_configuration_left_behind() {
        let (old, new) = (BTreeSet::from([1, 2, 3]), BTreeSet::from([1, 2]));
        let joint = vec![old.clone(), new.clone()];
        let m = metrics(ServerState::Leader, joint.clone(), 7, 9);
        assert_eq!(joint_to_complete(&m), Some((7, new.clone())));
        assert_eq!(
            joint_to_complete(&metrics(ServerState::Leader, joint.clone(), 7, 6)),
            None
        );
        assert_eq!(
            joint_to_complete(&metrics(ServerState::Follower, joint, 7, 9)),
            None
        );
        assert_eq!(
            joint_to_complete(&metrics(ServerState::Leader, vec![new], 7, 9)),
            None
        );
    }
}

//! `lockd.v1.Cluster`: this node's view of the cluster (`Status`, answered locally, never
//! forwarded, so an operator can ask every node what it sees; under a policy its hot lists name
//! only the resources the caller may describe), and the admin calls on the
//! sequencer signing keys (`SigningKeys`, `RotateSigningKey`), which the leader answers.
//!
//! `SaveSnapshot` (admin) streams a backup from the leader (`service/snapshot.rs`).
//! The membership calls (`ListMembers`, `AddMember`, `PromoteMember`, `RemoveMember`,
//! `TransferLeader`) are in `service::membership`.
//!
//! The signing-key calls are admin operations: an authorization policy must allow them only to
//! operators (the policy's `admin` operation, README "Authorization"), never to every client.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use std::time::Duration;

use lockd_api::FORWARDED_HEADER;
use lockd_api::v1::{
    HotResource, Member, RotateSigningKeyRequest, RotateSigningKeyResponse, SaveSnapshotRequest,
    SigningKeyInfo, SigningKeysRequest, SigningKeysResponse, StatusRequest, StatusResponse,
    cluster_server::Cluster,
};
use lockd_core::Outcome;
use lockd_fence::sequencer::KeyId;
use openraft::ServerState;
use tonic::{Request, Response, Status};

use super::errors;
use crate::node::NodeCtx;
use crate::observe::hot::{HOT_ACQUIRES_TRACKED, HOT_QUEUES_TRACKED};
use crate::raft::NodeId;

/// How long an admin call waits for a leader to be known, as Lock calls do.
const ADMIN_LEADER_WAIT: Duration = Duration::from_secs(2);
/// Budget of an admin call forwarded to the leader (the 5 s bound of docs/api.md, less room for the
/// network).
const ADMIN_FORWARD_TIMEOUT: Duration = Duration::from_millis(4_000);
/// Deadline of the linearizable read behind SigningKeys.
const ADMIN_READ_TIMEOUT: Duration = Duration::from_secs(3);

/// Hot resources listed by Status: enough to spot a hot spot, bounded so the reply stays small.
pub const HOT_RESOURCES_LISTED: usize = 10;

pub struct ClusterService {
    ctx: Arc<NodeCtx>,
}

impl ClusterService {
    pub fn new(ctx: Arc<NodeCtx>) -> Self {
        ClusterService { ctx }
    }
}

/// Where an admin call is served.
pub(super) enum Route {
    Local,
    Forward(NodeId),
}

impl ClusterService {
    pub(super) fn ctx(&self) -> &NodeCtx {
        &self.ctx
    }

    /// The leader, waiting up to [`ADMIN_LEADER_WAIT`]; a forwarded call is never forwarded again.
    pub(super) async fn route<T>(&self, req: &Request<T>) -> Result<Route, Status> {
        let forwarded = req.metadata().contains_key(FORWARDED_HEADER);
        let deadline = tokio::time::Instant::now() + ADMIN_LEADER_WAIT;
        let mut rx = self.ctx.raft.metrics();
        loop {
            let (state, leader, term) = {
                let m = rx.borrow_and_update();
                (m.state, m.current_leader, m.current_term)
            };
            match leader {
                Some(l) if l == self.ctx.id && state == ServerState::Leader => {
                    return Ok(Route::Local);
                }
                Some(l) if l != self.ctx.id && !forwarded && self.ctx.members.contains(l) => {
                    return Ok(Route::Forward(l));
                }
                Some(l) if l != self.ctx.id && forwarded => {
                    return Err(errors::no_quorum(format!(
                        "node {} received a forwarded call but the leader is node {l} (term {term}); retry",
                        self.ctx.id
                    )));
                }
                _ => {}
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return Err(errors::no_quorum(format!(
                    "node {} knows no leader after {} ms (term {term}): no quorum; nothing was done, retry",
                    self.ctx.id,
                    ADMIN_LEADER_WAIT.as_millis()
                )));
            }
        }
    }

    /// The call as forwarded to the leader: marked as forwarded by this node, for `caller`, whom
    /// the leader authorizes again.
    pub(super) fn forward_request<T>(&self, msg: T, caller: &crate::auth::Caller) -> Request<T> {
        let mut req = Request::new(msg);
        self.ctx.auth.mark_forwarded(self.ctx.id, caller, &mut req);
        req.set_timeout(ADMIN_FORWARD_TIMEOUT);
        req
    }

    pub(super) fn forward_error(&self, leader: NodeId, status: Status) -> Status {
        // Statuses from the leader are its answer; transport failures are not.
        if errors::is_from_lockd(&status) {
            return status;
        }
        let addr = self.ctx.members.addr(leader).unwrap_or_default();
        let msg = format!(
            "forwarding from node {} to leader {leader} at {addr} failed ({}: {})",
            self.ctx.id,
            status.code(),
            status.message()
        );
        errors::forward_failed(msg, &status)
    }

    /// The leader's Cluster service; it may have left the membership since `route` saw it.
    fn leader_cluster_client(
        &self,
        leader: NodeId,
    ) -> Result<lockd_api::v1::cluster_client::ClusterClient<tonic::transport::Channel>, Status>
    {
        self.ctx
            .members
            .cluster_client(leader)
            .map(|(_, c)| c)
            .ok_or_else(|| {
                errors::no_quorum(format!("leader {leader} is no longer a member; retry"))
            })
    }

    async fn signing_keys_local(&self) -> Result<SigningKeysResponse, Status> {
        // Linearizable, so a listing right after a rotation shows the new key.
        match tokio::time::timeout(ADMIN_READ_TIMEOUT, self.ctx.reads.confirm()).await {
            Ok(Ok(_)) => {}
            Ok(Err(e @ crate::read_barrier::ReadRefused::Overloaded)) => {
                return Err(errors::overloaded(format!(
                    "node {}: {e}; nothing was done, retry later",
                    self.ctx.id
                )));
            }
            Ok(Err(e)) => {
                return Err(errors::no_quorum(format!(
                    "node {} cannot serve a linearizable read: {e}",
                    self.ctx.id
                )));
            }
            Err(_) => {
                return Err(errors::no_quorum(format!(
                    "node {} could not confirm leadership with a quorum within {} ms",
                    self.ctx.id,
                    ADMIN_READ_TIMEOUT.as_millis()
                )));
            }
        }
        let sm = self.ctx.sm.read().expect("state lock");
        let keys = sm
            .table
            .signing_keys()
            .all()
            .iter()
            .map(|k| SigningKeyInfo {
                key_id: k.id().to_string(),
                public_key_pem: k.public().to_pem(),
                active: k.is_active(),
                created_unix_ms: k.created_ms,
                retired_unix_ms: k.retired_ms.unwrap_or(0),
            })
            .collect();
        Ok(SigningKeysResponse { keys })
    }

    async fn rotate_local(
        &self,
        req: RotateSigningKeyRequest,
    ) -> Result<RotateSigningKeyResponse, Status> {
        let wanted = match req.replaces_key_id.as_str() {
            "" => None,
            hex => Some(parse_key_id(hex)?),
        };
        let (active, known) = {
            let sm = self.ctx.sm.read().expect("state lock");
            let keys = sm.table.signing_keys();
            let known = wanted.is_some_and(|w| keys.all().iter().any(|k| k.key_id == w));
            (keys.active().map(|k| k.key_id), known)
        };
        if let Some(w) = wanted
            && Some(w) != active
        {
            // Already rotated (e.g. this is a retry of a rotation that applied): say what is
            // active now instead of rotating again.
            return match (known, active) {
                (true, Some(now)) => Ok(RotateSigningKeyResponse {
                    key_id: KeyId(now).to_string(),
                    retired_key_id: KeyId(w).to_string(),
                }),
                _ => Err(errors::invalid_field(
                    "replaces_key_id",
                    format!(
                        "replaces_key_id {:?} is not a signing key of this cluster",
                        req.replaces_key_id
                    ),
                )),
            };
        }
        let outcome = crate::signing::install(&self.ctx.proposer, active)
            .await
            .map_err(|e| errors::propose_failed(self.ctx.id, e))?;
        match outcome {
            Outcome::SigningKeyInstalled { key_id } => {
                tracing::info!(
                    key_id = %KeyId(key_id),
                    retired = %active.map(|a| KeyId(a).to_string()).unwrap_or_default(),
                    "lockd: rotated the sequencer signing key"
                );
                Ok(RotateSigningKeyResponse {
                    key_id: KeyId(key_id).to_string(),
                    retired_key_id: active.map(|a| KeyId(a).to_string()).unwrap_or_default(),
                })
            }
            Outcome::SigningKeyRefused(why) => Err(errors::precondition("replaces_key_id", why)),
            other => Err(errors::internal(format!(
                "unexpected outcome {other:?} for RotateSigningKey"
            ))),
        }
    }
}

/// A key id as SigningKeys lists it: 16 hex digits.
fn parse_key_id(hex: &str) -> Result<[u8; 8], Status> {
    let bad = || {
        errors::invalid_field(
            "replaces_key_id",
            format!("key id {hex:?} is not 16 hex digits"),
        )
    };
    if hex.len() != 16 || !hex.is_ascii() {
        return Err(bad());
    }
    let mut id = [0u8; 8];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(id)
}

#[tonic::async_trait]
impl Cluster for ClusterService {
    type SaveSnapshotStream = super::snapshot::SnapshotStream;

    // Admin operations: the policy's "admin" (open without a policy).
    async fn signing_keys(
        &self,
        req: Request<SigningKeysRequest>,
    ) -> Result<Response<SigningKeysResponse>, Status> {
        let caller = self
            .ctx
            .auth
            .authorize(&req, crate::auth::Operation::Admin, None)?;
        match self.route(&req).await? {
            Route::Local => self.signing_keys_local().await.map(Response::new),
            Route::Forward(leader) => {
                let mut client = self.leader_cluster_client(leader)?;
                client
                    .signing_keys(self.forward_request(req.into_inner(), &caller))
                    .await
                    .map_err(|s| self.forward_error(leader, s))
            }
        }
    }

    async fn rotate_signing_key(
        &self,
        req: Request<RotateSigningKeyRequest>,
    ) -> Result<Response<RotateSigningKeyResponse>, Status> {
        let caller = self
            .ctx
            .auth
            .authorize(&req, crate::auth::Operation::Admin, None)?;
        match self.route(&req).await? {
            Route::Local => self.rotate_local(req.into_inner()).await.map(Response::new),
            Route::Forward(leader) => {
                let mut client = self.leader_cluster_client(leader)?;
                client
                    .rotate_signing_key(self.forward_request(req.into_inner(), &caller))
                    .await
                    .map_err(|s| self.forward_error(leader, s))
            }
        }
    }

    // Admin: a backup of the state machine, from the leader (service/snapshot.rs).
    async fn save_snapshot(
        &self,
        req: Request<SaveSnapshotRequest>,
    ) -> Result<Response<Self::SaveSnapshotStream>, Status> {
        let caller = self
            .ctx
            .auth
            .authorize(&req, crate::auth::Operation::Admin, None)?;
        super::snapshot::may_save(
            self.ctx.auth.has_policy(),
            self.ctx.allow_backup_without_policy,
            self.ctx.auth.authenticates_nodes() && caller.forwarded,
            req.remote_addr(),
        )?;
        match self.route(&req).await? {
            Route::Local => super::snapshot::save_local(&self.ctx)
                .await
                .map(Response::new),
            Route::Forward(leader) => {
                let mut client = self.leader_cluster_client(leader)?;
                let mut forwarded = self.forward_request(req.into_inner(), &caller);
                forwarded.set_timeout(super::snapshot::FORWARD_TIMEOUT);
                let stream = client
                    .save_snapshot(forwarded)
                    .await
                    .map_err(|s| self.forward_error(leader, s))?
                    .into_inner();
                // Relayed as it comes; an error mid-stream is the leader's (or the transport's)
                // and ends the caller's stream too.
                let stream: super::snapshot::SnapshotStream = Box::pin(stream);
                Ok(Response::new(stream))
            }
        }
    }

    async fn status(
        &self,
        req: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        let caller = self
            .ctx
            .auth
            .authorize(&req, crate::auth::Operation::Status, None)?;
        let m = self.ctx.raft.metrics().borrow().clone();
        // Only O(1) counters under the state lock; the hot lists come from their own tracker,
        // O(k), so Status never scans the table or holds a lock that apply waits for.
        let stats = self.ctx.sm.read().expect("state lock").table.stats();
        let hot = &self.ctx.hub.hot;
        // Under a policy the lists name only what the caller may describe (admins see all):
        // from every tracked entry, so that a caller still gets its own top ten when other
        // tenants' resources are hotter. Open mode lists the top ten as they are.
        let auth = &self.ctx.auth;
        let listed = |r: &str| auth.may_list(&caller, r);
        let (acquires_scanned, queues_scanned) = if auth.has_policy() {
            (HOT_ACQUIRES_TRACKED, HOT_QUEUES_TRACKED)
        } else {
            (HOT_RESOURCES_LISTED, HOT_RESOURCES_LISTED)
        };
        let applied = m.last_applied.map(|l| l.index).unwrap_or(0);
        let commit = self.ctx.committed.load(Ordering::Relaxed).max(applied);
        let members = m
            .membership_config
            .membership()
            .nodes()
            .map(|(id, node)| Member {
                id: *id,
                address: node.addr.clone(),
            })
            .collect();
        let role = match m.state {
            ServerState::Leader => "leader",
            ServerState::Follower => "follower",
            ServerState::Candidate => "candidate",
            ServerState::Learner => "learner",
            ServerState::Shutdown => "shutdown",
        };
        Ok(Response::new(StatusResponse {
            node_id: self.ctx.id,
            leader_id: m.current_leader.unwrap_or(0),
            term: m.current_term,
            commit_index: commit,
            applied_index: applied,
            members,
            active_locks: stats.active_locks,
            waiters: stats.waiters,
            role: role.into(),
            lag: commit.saturating_sub(applied),
            hot_by_acquires: hot
                .top_by_acquires(acquires_scanned)
                .into_iter()
                .filter(|(resource, ..)| listed(resource))
                .take(HOT_RESOURCES_LISTED)
                .map(|(resource, acquires, waiters)| HotResource {
                    resource,
                    acquires,
                    waiters,
                })
                .collect(),
            hot_by_waiters: hot
                .top_by_waiters(queues_scanned)
                .into_iter()
                .filter(|(resource, _)| listed(resource))
                .take(HOT_RESOURCES_LISTED)
                .map(|(resource, waiters)| HotResource {
                    resource,
                    acquires: 0,
                    waiters,
                })
                .collect(),
        }))
    }

    // Membership (admin; `service::membership`).
    async fn list_members(
        &self,
        req: Request<lockd_api::v1::ListMembersRequest>,
    ) -> Result<Response<lockd_api::v1::ListMembersResponse>, Status> {
        self.list_members_rpc(req).await
    }

    async fn add_member(
        &self,
        req: Request<lockd_api::v1::AddMemberRequest>,
    ) -> Result<Response<lockd_api::v1::AddMemberResponse>, Status> {
        self.add_member_rpc(req).await
    }

    async fn promote_member(
        &self,
        req: Request<lockd_api::v1::PromoteMemberRequest>,
    ) -> Result<Response<lockd_api::v1::PromoteMemberResponse>, Status> {
        self.promote_member_rpc(req).await
    }

    async fn remove_member(
        &self,
        req: Request<lockd_api::v1::RemoveMemberRequest>,
    ) -> Result<Response<lockd_api::v1::RemoveMemberResponse>, Status> {
        self.remove_member_rpc(req).await
    }

    async fn transfer_leader(
        &self,
        req: Request<lockd_api::v1::TransferLeaderRequest>,
    ) -> Result<Response<lockd_api::v1::TransferLeaderResponse>, Status> {
        self.transfer_leader_rpc(req).await
    }
}

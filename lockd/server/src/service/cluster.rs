//! `lockd.v1.Cluster`: this node's view of the cluster. Answered locally, never forwarded, so
//! an operator can ask every node what it sees.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use lockd_api::v1::{HotResource, Member, StatusRequest, StatusResponse, cluster_server::Cluster};
use openraft::ServerState;
use tonic::{Request, Response, Status};

use crate::node::NodeCtx;

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

#[tonic::async_trait]
impl Cluster for ClusterService {
    async fn status(
        &self,
        req: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        self.ctx
            .auth
            .authorize(&req, crate::auth::Operation::Status, None)?;
        let m = self.ctx.raft.metrics().borrow().clone();
        // Only O(1) counters under the state lock; the hot lists come from their own tracker,
        // O(k), so Status never scans the table or holds a lock that apply waits for.
        let stats = self.ctx.sm.read().expect("state lock").table.stats();
        let hot = &self.ctx.hub.hot;
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
                .top_by_acquires(HOT_RESOURCES_LISTED)
                .into_iter()
                .map(|(resource, acquires, waiters)| HotResource {
                    resource,
                    acquires,
                    waiters,
                })
                .collect(),
            hot_by_waiters: hot
                .top_by_waiters(HOT_RESOURCES_LISTED)
                .into_iter()
                .map(|(resource, waiters)| HotResource {
                    resource,
                    acquires: 0,
                    waiters,
                })
                .collect(),
        }))
    }
}

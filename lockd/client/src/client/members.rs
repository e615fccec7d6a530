//! Membership admin calls of [`Client`]: list, add, promote and remove members, transfer
//! leadership. Each is answered by the leader (any node forwards). Most are safe to retry:
//! adding a member that exists at the same address, promoting a voter and transferring to the
//! node that already leads change nothing. Two are not: a transfer without a target id moves
//! leadership again on every retry (to whichever other voter is most up to date), and
//! `remove N` retried after node N was added again removes the new node N. Retry those only
//! after `list_members` shows the first call did not apply.

use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::{
    AddMemberRequest, ListMembersRequest, ListMembersResponse, MemberInfo, PromoteMemberRequest,
    RemoveMemberRequest, TransferLeaderRequest, TransferLeaderResponse,
};
use tokio::time::Instant;

use super::{CallCtx, Client};
use crate::error::{Error, Op};

impl Client {
    /// A context for a membership call: one attempt may take the whole call timeout, since a
    /// change commits two entries and a transfer waits for an election.
    fn membership_ctx(&self, op: Op) -> CallCtx<'static> {
        CallCtx {
            op,
            resource: None,
            request_id: None,
            deadline: Instant::now() + self.inner.config.call_timeout,
            attempt_timeout: self.inner.config.call_timeout,
            sent_before: false,
        }
    }

    /// Admin: every member with its role and how far its log matches the leader's.
    pub async fn list_members(&self) -> Result<ListMembersResponse, Error> {
        let ctx = self.membership_ctx(Op::ListMembers);
        self.call(&ctx, |channel| {
            let request = self.authed(ListMembersRequest {});
            async move { ClusterClient::new(channel).list_members(request).await }
        })
        .await
        .map(|a| a.value)
        .map_err(|f| self.failed(f, &ctx, None, std::time::Duration::ZERO))
    }

    /// Admin: adds node `id` at `address` as a learner; the membership after the change.
    pub async fn add_member(&self, id: u64, address: &str) -> Result<Vec<MemberInfo>, Error> {
        let ctx = self.membership_ctx(Op::ChangeMembers);
        let request = AddMemberRequest {
            id,
            address: address.to_owned(),
        };
        self.call(&ctx, |channel| {
            let request = self.authed(request.clone());
            async move { ClusterClient::new(channel).add_member(request).await }
        })
        .await
        .map(|a| a.value.members)
        .map_err(|f| self.failed(f, &ctx, None, std::time::Duration::ZERO))
    }

    /// Admin: makes learner `id` a voter (refused while it lags).
    pub async fn promote_member(&self, id: u64) -> Result<Vec<MemberInfo>, Error> {
        let ctx = self.membership_ctx(Op::ChangeMembers);
        self.call(&ctx, |channel| {
            let request = self.authed(PromoteMemberRequest { id });
            async move { ClusterClient::new(channel).promote_member(request).await }
        })
        .await
        .map(|a| a.value.members)
        .map_err(|f| self.failed(f, &ctx, None, std::time::Duration::ZERO))
    }

    /// Admin: removes node `id` from the membership.
    pub async fn remove_member(&self, id: u64) -> Result<Vec<MemberInfo>, Error> {
        let ctx = self.membership_ctx(Op::ChangeMembers);
        self.call(&ctx, |channel| {
            let request = self.authed(RemoveMemberRequest { id });
            async move { ClusterClient::new(channel).remove_member(request).await }
        })
        .await
        .map(|a| a.value.members)
        .map_err(|f| self.failed(f, &ctx, None, std::time::Duration::ZERO))
    }

    /// Admin: moves leadership to voter `id` (`None`: the most up-to-date other voter).
    pub async fn transfer_leader(&self, id: Option<u64>) -> Result<TransferLeaderResponse, Error> {
        let ctx = self.membership_ctx(Op::TransferLeader);
        let id = id.unwrap_or(0);
        self.call(&ctx, |channel| {
            let request = self.authed(TransferLeaderRequest { id });
            async move { ClusterClient::new(channel).transfer_leader(request).await }
        })
        .await
        .map(|a| a.value)
        .map_err(|f| self.failed(f, &ctx, None, std::time::Duration::ZERO))
    }
}

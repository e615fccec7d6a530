//! Receiving side of replication: decodes openraft messages and hands them to the local Raft.

use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::{Request, Response, Status};

use std::sync::Arc;

use crate::raft::vote_gate::{VoteGate, VoteReport};
use crate::raft::{Raft, TypeConfig};
use crate::storage::log_store::LogStore;
use openraft::storage::RaftLogStorage;

pub mod pb {
    tonic::include_proto!("lockd.raft.v1");
}

use pb::RaftMessage;
use pb::raft_server::RaftServer;

pub struct RaftService {
    raft: Raft,
    /// Set when this node started with an empty data dir: it may have voted in the current term
    /// before its disk was lost, so it grants no vote until every election of that term has
    /// ended (two maximum election timeouts). Otherwise it could vote twice in one term.
    refuse_votes_until: Option<std::time::Instant>,
    /// Closed while this node rejoins with an empty data dir and has not caught up.
    gate: Arc<VoteGate>,
    /// This node's log, for `CurrentVote`.
    log: LogStore,
}

impl RaftService {
    pub fn server(
        raft: Raft,
        refuse_votes_until: Option<std::time::Instant>,
        gate: Arc<VoteGate>,
        log: LogStore,
    ) -> RaftServer<Self> {
        RaftServer::new(RaftService {
            raft,
            refuse_votes_until,
            gate,
            log,
        })
        .max_decoding_message_size(crate::raft::network::RAFT_MESSAGE_MAX_BYTES)
        .max_encoding_message_size(crate::raft::network::RAFT_MESSAGE_MAX_BYTES)
    }
}

fn decode<T: DeserializeOwned>(req: Request<RaftMessage>) -> Result<T, Status> {
    postcard::from_bytes(&req.into_inner().data)
        .map_err(|e| Status::invalid_argument(format!("lockd: undecodable raft message: {e}")))
}

fn encode<T: Serialize>(v: &T) -> Result<Response<RaftMessage>, Status> {
    postcard::to_allocvec(v)
        .map(|data| Response::new(RaftMessage { data }))
        .map_err(|e| Status::internal(format!("lockd: encoding raft reply: {e}")))
}

#[tonic::async_trait]
impl pb::raft_server::Raft for RaftService {
    async fn append_entries(
        &self,
        req: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        let rpc: openraft::raft::AppendEntriesRequest<TypeConfig> = decode(req)?;
        let (term, commit) = (rpc.vote.leader_id.term, rpc.leader_commit);
        self.gate.admits_leader(term).map_err(Status::unavailable)?;
        let reply = self.raft.append_entries(rpc).await;
        if matches!(
            reply,
            Ok(openraft::raft::AppendEntriesResponse::Success
                | openraft::raft::AppendEntriesResponse::PartialSuccess(_))
        ) {
            self.gate.observe_append(term, commit);
        }
        encode(&reply)
    }

    async fn vote(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        if self
            .refuse_votes_until
            .is_some_and(|t| std::time::Instant::now() < t)
        {
            return Err(Status::unavailable(
                "lockd: node started with an empty data dir; not voting yet",
            ));
        }
        let rpc: openraft::raft::VoteRequest<u64> = decode(req)?;
        self.gate
            .admits_candidate(rpc.vote.leader_id.term, rpc.last_log_id)
            .map_err(Status::unavailable)?;
        encode(&self.raft.vote(rpc).await)
    }

    async fn install_snapshot(
        &self,
        req: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        let rpc: openraft::raft::InstallSnapshotRequest<TypeConfig> = decode(req)?;
        self.gate
            .admits_leader(rpc.vote.leader_id.term)
            .map_err(Status::unavailable)?;
        encode(&self.raft.install_snapshot(rpc).await)
    }

    /// Read-only: what a peer that rejoins with an empty data dir needs to relearn the term.
    async fn current_vote(
        &self,
        _req: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        let vote = self.raft.metrics().borrow().vote;
        // The log id, not only the index: a rejoining peer compares candidates' logs with it.
        let last_log_id = self
            .log
            .clone()
            .get_log_state()
            .await
            .map_err(|e| Status::unavailable(format!("lockd: reading the log state: {e}")))?
            .last_log_id;
        let report = VoteReport { vote, last_log_id };
        encode(&report)
    }
}

//! Receiving side of replication: decodes openraft messages and hands them to the local Raft.

use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::{Request, Response, Status};

use std::sync::Arc;

use crate::raft::NodeId;
use crate::raft::vote_gate::{VoteGate, VoteReport};
use crate::raft::{Raft, TypeConfig};
use crate::storage::log_store::LogStore;
use crate::tls::{CLUSTER_ID_HEADER, NodeTls};
use openraft::storage::RaftLogStorage;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

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
    /// Who may send Raft messages.
    auth: PeerAuth,
}

/// Decides whether a Raft message comes from a member of this cluster (see `crate::tls`).
pub struct PeerAuth {
    cluster_id: String,
    members: Vec<NodeId>,
    tls: Option<Arc<NodeTls>>,
    /// Node certificates already verified, by SHA-256 of the leaf: the node they name and when
    /// verified. A connection presents the same certificate on every message, and a chain check
    /// per AppendEntries would cost a signature verification each.
    verified: Mutex<HashMap<[u8; 32], (NodeId, Instant)>>,
}

/// How long a verified certificate is trusted without checking it again (expiry, mostly).
const VERIFIED_FOR: Duration = Duration::from_secs(60);
/// Verified certificates remembered at most; the cache is cleared when full.
const VERIFIED_MAX: usize = 256;

impl PeerAuth {
    pub fn new(config: &crate::config::NodeConfig, tls: Option<Arc<NodeTls>>) -> Self {
        PeerAuth {
            cluster_id: config.cluster_id.clone(),
            members: config.peers.keys().copied().collect(),
            tls,
            verified: Mutex::new(HashMap::new()),
        }
    }

    /// The node that sent `req`: its cluster id must be this one's, and with TLS its certificate
    /// must be a node certificate of the peer CA naming a member. `None` without TLS (the
    /// sender is unknown). Every refusal is UNAUTHENTICATED and says why.
    fn identify<T>(&self, req: &Request<T>) -> Result<Option<NodeId>, Status> {
        let refuse =
            |why: String| Status::unauthenticated(format!("lockd: raft message refused: {why}"));
        match req.metadata().get(CLUSTER_ID_HEADER).map(|v| v.to_str()) {
            Some(Ok(id)) if id == self.cluster_id => {}
            Some(Ok(id)) => {
                return Err(refuse(format!(
                    "it is for cluster {id:?}, this node is in cluster {:?}",
                    self.cluster_id
                )));
            }
            _ => return Err(refuse(format!("no {CLUSTER_ID_HEADER} header"))),
        }
        let Some(tls) = &self.tls else {
            return Ok(None);
        };
        let chain = req.peer_certs().ok_or_else(|| {
            refuse("replication needs a node certificate; the caller sent none".into())
        })?;
        let leaf = chain
            .first()
            .ok_or_else(|| refuse("the caller sent an empty certificate chain".into()))?;
        let key: [u8; 32] = Sha256::digest(leaf.as_ref()).into();
        let mut verified = self.verified.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((id, at)) = verified.get(&key)
            && at.elapsed() < VERIFIED_FOR
        {
            return Ok(Some(*id));
        }
        let mut last_err = String::new();
        for id in &self.members {
            match tls.verify_peer(&chain, *id) {
                Ok(()) => {
                    if verified.len() >= VERIFIED_MAX {
                        verified.clear();
                    }
                    verified.insert(key, (*id, Instant::now()));
                    return Ok(Some(*id));
                }
                Err(e) => last_err = e,
            }
        }
        Err(refuse(format!("caller certificate: {last_err}")))
    }

    /// With TLS, the message must claim to come from the node the certificate names.
    fn matches(cert: Option<NodeId>, claimed: Option<NodeId>) -> Result<(), Status> {
        match (cert, claimed) {
            (Some(cert), Some(c)) if cert != c => Err(Status::unauthenticated(format!(
                "lockd: raft message refused: it claims to come from node {c}, the caller's \
                 certificate names node {cert}"
            ))),
            (Some(_), None) => Err(Status::unauthenticated(
                "lockd: raft message refused: it names no sending node",
            )),
            _ => Ok(()),
        }
    }
}

impl RaftService {
    /// Authenticates the caller before decoding anything, then checks that the decoded message
    /// claims to come from it (`claimed`: the leader or candidate it names).
    fn authorized<T: DeserializeOwned>(
        &self,
        req: Request<RaftMessage>,
        claimed: impl FnOnce(&T) -> Option<NodeId>,
    ) -> Result<T, Status> {
        let cert = self.auth.identify(&req)?;
        let rpc: T = decode(req)?;
        PeerAuth::matches(cert, claimed(&rpc))?;
        Ok(rpc)
    }
}

impl RaftService {
    pub fn server(
        raft: Raft,
        refuse_votes_until: Option<std::time::Instant>,
        gate: Arc<VoteGate>,
        log: LogStore,
        auth: PeerAuth,
    ) -> RaftServer<Self> {
        RaftServer::new(RaftService {
            raft,
            refuse_votes_until,
            gate,
            log,
            auth,
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
        let rpc = self.authorized(
            req,
            |r: &openraft::raft::AppendEntriesRequest<TypeConfig>| r.vote.leader_id.voted_for(),
        )?;
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
        let rpc = self.authorized(req, |r: &openraft::raft::VoteRequest<NodeId>| {
            r.vote.leader_id.voted_for()
        })?;
        self.gate
            .admits_candidate(rpc.vote.leader_id.term, rpc.last_log_id)
            .map_err(Status::unavailable)?;
        encode(&self.raft.vote(rpc).await)
    }

    async fn install_snapshot(
        &self,
        req: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        let rpc = self.authorized(
            req,
            |r: &openraft::raft::InstallSnapshotRequest<TypeConfig>| r.vote.leader_id.voted_for(),
        )?;
        self.gate
            .admits_leader(rpc.vote.leader_id.term)
            .map_err(Status::unavailable)?;
        encode(&self.raft.install_snapshot(rpc).await)
    }

    /// Read-only: what a peer that rejoins with an empty data dir needs to relearn the term.
    async fn current_vote(
        &self,
        req: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        self.auth.identify(&req)?;
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

//! Raft messages between nodes over the node's gRPC port (`lockd.raft.v1.Raft`), postcard-encoded.

use std::time::Duration;

use openraft::BasicNode;
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::transport::{Channel, Endpoint};

use std::collections::HashMap;
use std::sync::Arc;

use tonic::metadata::{Ascii, MetadataValue};

use super::peer_protocol::{self, PeerProtocols};
use super::restore_id::{self, RestoreIdentity};
use super::vote_gate::{Standing, VoteReport};
use super::{NodeId, TypeConfig};
use crate::service::raft::pb::{RaftMessage, raft_client::RaftClient};
use crate::tls::{CLUSTER_ID_HEADER, TlsHandle};

/// Largest replication message either side accepts: appends carry up to `max_payload_entries`
/// batches and snapshots come in chunks of `snapshot_max_chunk_size`.
pub const RAFT_MESSAGE_MAX_BYTES: usize = 64 * 1024 * 1024;
/// How long a connection attempt to a peer may take before openraft counts it unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// How long a rejoining node waits for one peer's `CurrentVote` answer.
const VOTE_ASK_TIMEOUT: Duration = Duration::from_secs(1);

/// Creates one lazily connecting channel per peer.
#[derive(Clone)]
pub struct Network {
    pub dial: PeerDial,
}

/// How this node dials its peers: from which address, over TLS or not, for which cluster.
#[derive(Clone)]
pub struct PeerDial {
    /// Source address of connections to peers: the node's listen IP, so peers (and fault-injection
    /// relays in tests) see which node is calling. `None` when listening on a wildcard address.
    pub local_ip: Option<std::net::IpAddr>,
    /// On a plaintext loopback cluster, the uid every member's port must belong to
    /// ([`crate::local_peer::check_listener`]); `None` otherwise.
    pub same_user: Option<u32>,
    /// Mutual TLS with the peers; `None` dials plaintext.
    pub tls: Option<Arc<TlsHandle>>,
    /// Sent on every Raft message ([`CLUSTER_ID_HEADER`]).
    pub cluster_id: MetadataValue<Ascii>,
    /// This node's restore id: sent on every Raft message, and required on every reply.
    pub restore: Arc<RestoreIdentity>,
    /// What each peer announced on its replies (see `peer_protocol`).
    pub protocols: Arc<PeerProtocols>,
    /// One Raft channel per peer address, with the TLS generation it was made in. openraft asks
    /// for a new client for every vote round and every linearizable read; without this each
    /// would be a new TCP and TLS handshake (a client calling Describe in a loop could make the
    /// leader run out of ephemeral ports).
    raft_channels: Arc<std::sync::Mutex<RaftChannels>>,
    /// Replies to this node's AppendEntries and InstallSnapshot, by peer.
    pub acks: PeerAcks,
}

/// When each peer last answered an AppendEntries or InstallSnapshot of this node: a leader's
/// evidence that a follower is alive (openraft 0.9 reports matched log indexes only, and on an
/// idle cluster a dead follower's index matches too).
pub type PeerAcks = Arc<std::sync::Mutex<HashMap<NodeId, std::time::Instant>>>;

/// Raft channels by (peer id, address): the TLS generation each was made in, and the channel.
type RaftChannels = HashMap<(NodeId, String), (u64, Channel)>;

impl PeerDial {
    pub fn new(
        local_ip: Option<std::net::IpAddr>,
        tls: Option<Arc<TlsHandle>>,
        cluster_id: &str,
        restore: Arc<RestoreIdentity>,
        protocols: Arc<PeerProtocols>,
    ) -> anyhow::Result<Self> {
        Ok(PeerDial {
            local_ip,
            same_user: None,
            tls,
            restore,
            protocols,
            raft_channels: Arc::default(),
            acks: Arc::default(),
            cluster_id: cluster_id
                .parse()
                .map_err(|e| anyhow::anyhow!("cluster id {cluster_id:?}: {e}"))?,
        })
    }

    /// A lazily connecting channel to peer `target` at `addr`: TLS with the peer's node name
    /// checked when this node has certificates.
    pub fn channel(&self, target: NodeId, addr: &str) -> Result<Channel, tonic::transport::Error> {
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))?
            .connect_timeout(CONNECT_TIMEOUT)
            .local_address(self.local_ip)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(5));
        Ok(match &self.tls {
            // Our own connector rather than tonic's TLS: it takes the certificates current at
            // each connect, so a reload on SIGHUP reaches the peers' next connections.
            Some(tls) => endpoint.connect_with_connector_lazy(crate::tls::peer_connector(
                tls.clone(),
                target,
                self.local_ip,
            )),
            // Our own connector here too, so that every name lookup of the node goes through
            // `crate::resolve` (one at a time).
            None => endpoint.connect_with_connector_lazy(crate::tls::plain_peer_connector(
                self.local_ip,
                self.same_user,
            )),
        })
    }

    /// The TLS generation (see `TlsHandle`); 0 without TLS.
    pub fn tls_generation(&self) -> u64 {
        self.tls.as_ref().map_or(0, |t| t.generation())
    }

    /// A Raft client of peer `target`, on the channel shared by all its clients. After a
    /// certificate reload a new channel is made, so that no connection keeps presenting a
    /// certificate that may expire.
    pub fn raft_client(
        &self,
        target: NodeId,
        addr: &str,
    ) -> Result<RaftClient<Channel>, tonic::transport::Error> {
        let generation = self.tls_generation();
        let key = (target, addr.to_owned());
        let cached = {
            let channels = self.raft_channels.lock().unwrap_or_else(|e| e.into_inner());
            channels
                .get(&key)
                .filter(|(made_in, _)| *made_in == generation)
                .map(|(_, c)| c.clone())
        };
        let channel = match cached {
            Some(c) => c,
            None => {
                let c = self.channel(target, addr)?;
                self.raft_channels
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key, (generation, c.clone()));
                c
            }
        };
        Ok(RaftClient::new(channel)
            .max_decoding_message_size(RAFT_MESSAGE_MAX_BYTES)
            .max_encoding_message_size(RAFT_MESSAGE_MAX_BYTES))
    }

    /// A Raft message for sending to a peer: with the cluster id, the restore id and this
    /// node's peer protocol version.
    pub fn raft_request(&self, data: Vec<u8>) -> tonic::Request<RaftMessage> {
        self.request(data)
    }

    /// Wraps a Raft message for sending: with the cluster id, the restore id and this node's
    /// peer protocol version.
    fn request(&self, data: Vec<u8>) -> tonic::Request<RaftMessage> {
        let mut request = tonic::Request::new(RaftMessage { data });
        request
            .metadata_mut()
            .insert(CLUSTER_ID_HEADER, self.cluster_id.clone());
        self.restore.attach(request.metadata_mut());
        peer_protocol::attach(request.metadata_mut());
        request
    }

    /// Checks and records the peer protocol version a reply of `peer` announced.
    fn accept_protocol(
        &self,
        peer: NodeId,
        md: &tonic::metadata::MetadataMap,
    ) -> Result<(), String> {
        let version = peer_protocol::announced(md)
            .and_then(|v| peer_protocol::check(&format!("node {peer}"), v).map(|()| v))?;
        self.protocols.record(peer, version);
        Ok(())
    }
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> PeerClient {
        PeerClient {
            target,
            addr: node.addr.clone(),
            generation: self.dial.tls_generation(),
            client: self
                .dial
                .raft_client(target, &node.addr)
                .map_err(|e| format!("peer {target} address {:?}: {e}", node.addr)),
            dial: self.dial.clone(),
        }
    }
}

/// Asks every peer at once for its current vote; returns who answered what within
/// `VOTE_ASK_TIMEOUT`. Used by a node that rejoins with an empty data dir (see `vote_gate`).
/// Addresses may be DNS names: each connect resolves them again.
pub async fn ask_votes(dial: &PeerDial, peers: Vec<(NodeId, String)>) -> Vec<(NodeId, VoteReport)> {
    let asks = peers.into_iter().map(|(id, addr)| {
        let client = dial.raft_client(id, &addr);
        async move {
            let mut client = match client {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(peer = id, address = %addr, error = %e, "lockd: bad peer address");
                    return None;
                }
            };
            let mut request = dial.request(Vec::new());
            request.set_timeout(VOTE_ASK_TIMEOUT);
            let reply = tokio::time::timeout(VOTE_ASK_TIMEOUT, client.current_vote(request)).await;
            match reply {
                Ok(Ok(r)) => {
                    if let Err(why) = dial.accept_protocol(id, r.metadata()) {
                        tracing::warn!(peer = id, "CurrentVote answer does not count: {why}");
                        return None;
                    }
                    let r = r.into_inner();
                    if let Some(answered) = r.node_id
                        && answered != id
                    {
                        tracing::warn!(
                            peer = id,
                            answered,
                            "CurrentVote answered by node {answered}, not by peer {id}: check \
                             the --peer addresses; the answer does not count"
                        );
                        return None;
                    }
                    match VoteReport::decode(&r.data) {
                        // The flag travels beside the payload: an older node's reply has none,
                        // and then counts for nothing (see vote_gate).
                        Ok(report) => Some((
                            id,
                            VoteReport {
                                standing: Standing::from_kept_log(r.kept_log),
                                restore_id: r.restore_id,
                                ..report
                            },
                        )),
                        Err(e) => {
                            tracing::warn!(peer = id, error = %e, "undecodable CurrentVote reply");
                            None
                        }
                    }
                }
                Ok(Err(status)) if status.code() == tonic::Code::Unimplemented => {
                    tracing::warn!(
                        peer = id,
                        "peer runs a lockd without CurrentVote: upgrade every node before a node \
                         rejoins with an empty data dir"
                    );
                    None
                }
                Ok(Err(status)) => {
                    tracing::debug!(peer = id, %status, "CurrentVote failed");
                    None
                }
                Err(_) => None,
            }
        }
    });
    futures::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .collect()
}

pub struct PeerClient {
    target: NodeId,
    addr: String,
    /// The TLS generation `client` was made in; a reload makes the next call take a new one.
    generation: u64,
    client: Result<RaftClient<Channel>, String>,
    dial: PeerDial,
}

type RpcErr<E> = RPCError<NodeId, BasicNode, RaftError<NodeId, E>>;

impl PeerClient {
    async fn call<Req, Resp, E>(
        &mut self,
        method: Method,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RpcErr<E>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let generation = self.dial.tls_generation();
        if generation != self.generation {
            self.generation = generation;
            self.client = self
                .dial
                .raft_client(self.target, &self.addr)
                .map_err(|e| format!("peer {} address {:?}: {e}", self.target, self.addr));
        }
        let client = match &mut self.client {
            Ok(c) => c,
            Err(e) => {
                return Err(RPCError::Unreachable(Unreachable::new(
                    &std::io::Error::other(e.clone()),
                )));
            }
        };
        let data =
            postcard::to_allocvec(req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let mut request = self.dial.request(data);
        request.set_timeout(option.hard_ttl());
        let result = match method {
            Method::Append => client.append_entries(request).await,
            Method::Vote => client.vote(request).await,
            Method::Snapshot => client.install_snapshot(request).await,
        };
        let reply = match result {
            Ok(r) => {
                // A reply of another restore (or of a node without the id) must not reach
                // openraft: a higher term in it would make this node step down.
                let peer = format!("node {}", self.target);
                if let Err(why) = self
                    .dial
                    .restore
                    .check(&peer, restore_id::from_metadata(r.metadata()))
                {
                    self.dial.restore.log_mismatch(&why);
                    return Err(RPCError::Network(NetworkError::new(
                        &std::io::Error::other(why),
                    )));
                }
                if let Err(why) = self.dial.accept_protocol(self.target, r.metadata()) {
                    self.dial.protocols.log_refusal(&why);
                    return Err(RPCError::Network(NetworkError::new(
                        &std::io::Error::other(why),
                    )));
                }
                if matches!(method, Method::Append | Method::Snapshot) {
                    self.dial
                        .acks
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(self.target, std::time::Instant::now());
                }
                r.into_inner()
            }
            Err(status) if status.code() == tonic::Code::Unavailable => {
                tracing::debug!(peer = self.target, %status, "peer unreachable");
                return Err(RPCError::Unreachable(Unreachable::new(&status)));
            }
            Err(status) => {
                if status.code() == tonic::Code::FailedPrecondition
                    && status.message().contains("peer protocol mismatch")
                {
                    self.dial.protocols.log_refusal(&format!(
                        "node {} refused this node's message: {}",
                        self.target,
                        status.message()
                    ));
                }
                if status.code() == tonic::Code::FailedPrecondition
                    && status.message().contains("restore id mismatch")
                {
                    self.dial.restore.log_mismatch(&format!(
                        "node {} refused this node's message: {}",
                        self.target,
                        status.message()
                    ));
                }
                return Err(RPCError::Network(NetworkError::new(&status)));
            }
        };
        let decoded: Result<Resp, RaftError<NodeId, E>> = postcard::from_bytes(&reply.data)
            .map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        decoded
            .map_err(|e| RPCError::RemoteError(openraft::error::RemoteError::new(self.target, e)))
    }
}

#[derive(Clone, Copy)]
enum Method {
    Append,
    Vote,
    Snapshot,
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcErr<openraft::error::Infallible>> {
        self.call(Method::Append, &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RpcErr<InstallSnapshotError>> {
        self.call(Method::Snapshot, &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RpcErr<openraft::error::Infallible>> {
        self.call(Method::Vote, &rpc, &option).await
    }
}

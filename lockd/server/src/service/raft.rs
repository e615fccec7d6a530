//! Receiving side of replication: decodes openraft messages and hands them to the local Raft.

use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::{Request, Response, Status};

use std::sync::Arc;

use crate::local_peer::{LocalPeers, PeerOwner};
use crate::raft::NodeId;
use crate::raft::peer_protocol::{self, PeerProtocols};
use crate::raft::restore_id::{self, RestoreIdentity};
use crate::raft::vote_gate::VoteGate;
use crate::raft::{Raft, TypeConfig};
use crate::service::errors;
use crate::storage::log_store::LogStore;
use crate::tls::{CLUSTER_ID_HEADER, TlsHandle};
use openraft::storage::RaftLogStorage;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tonic::service::interceptor::InterceptedService;

/// The generated messages, client and server of the internal `lockd.raft.v1` service.
#[allow(
    missing_docs,
    reason = "generated from proto/lockd/raft/v1/raft.proto, which documents it"
)]
pub mod pb {
    tonic::include_proto!("lockd.raft.v1");
}

use pb::RaftMessage;
use pb::raft_server::RaftServer;

pub(crate) struct RaftService {
    raft: Raft,
    /// Set when this node started with an empty data dir: it may have voted in the current term
    /// before its disk was lost, so it grants no vote until every election of that term has
    /// ended (two maximum election timeouts). Otherwise it could vote twice in one term.
    refuse_votes_until: Option<std::time::Instant>,
    /// Closed while this node rejoins with an empty data dir and has not caught up.
    gate: Arc<VoteGate>,
    /// This node's log, for `CurrentVote`.
    log: LogStore,
    /// Raft messages are accepted only from peers with this node's restore id.
    restore: Arc<RestoreIdentity>,
    /// What each member announced (see `raft::peer_protocol`).
    protocols: Arc<PeerProtocols>,
}

/// Decides whether a Raft message comes from a member of this cluster (see `crate::tls`). It
/// runs as an interceptor, on the request's headers, before tonic reads the body: an
/// unauthenticated caller cannot make the node buffer a 64 MiB message.
pub(crate) struct PeerAuth {
    cluster_id: String,
    /// The other members, from the Raft membership (`crate::members`): a message never comes
    /// from this node itself, nor from a node that was removed.
    members: Arc<crate::members::Members>,
    tls: Option<Arc<TlsHandle>>,
    /// Without TLS on loopback: only connections of this node's user (`crate::local_peer`).
    local: LocalPeers,
    /// Outcomes of certificate checks, by SHA-256 of the leaf, with when they were made. A
    /// connection presents the same certificate on every message, so a peer's messages cost one
    /// hash, and a refused caller's too (failures are remembered as well).
    checked: Mutex<HashMap<[u8; 32], CheckedCert>>,
    /// When a refusal was last logged (ms since `started`), to log at most one per interval.
    last_logged_ms: AtomicU64,
    started: Instant,
}

/// Who sent a Raft message: the node it names, and the restore id in its metadata.
struct Sender {
    node: Option<NodeId>,
    restore_id: Option<String>,
}

/// A certificate check's outcome (the member, or why not), when it was made, and the TLS
/// generation and membership generation it was made with (a reload on SIGHUP may change the
/// peer CA; a member added or removed changes who counts).
type CheckedCert = (Result<NodeId, String>, Instant, (u64, u64));

/// The node a request's certificate authenticates (`None` without TLS), put in the request's
/// extensions by [`PeerAuth::intercept`].
#[derive(Clone, Copy)]
struct Caller(Option<NodeId>);

/// Put in a request's extensions by [`PeerAuth::intercept`] instead of [`Caller`] when the
/// sender is not a member in this node's view but holds a node certificate of the peer CA and
/// names this cluster: a node of a running cluster whose membership this node does not know
/// yet. A node that replays the log from its start (a joiner, a wiped node), installs an older
/// snapshot, or was down while a member was added, takes older memberships on the way, and the
/// leader may be a node added after them (review of the membership branch, M-A). So its
/// AppendEntries and InstallSnapshot are accepted when the certificate names the leader the
/// message claims to come from ([`RaftService::authorized`]); the restore id check, the vote gate
/// and Raft's term and log rules still apply, and a stale sender is refused by them. Its Vote,
/// CurrentVote and Elect are refused: only known members take part in elections. AppendEntries,
/// Vote and InstallSnapshot first count as Raft traffic, so this node never founds a cluster
/// beside the running one (`raft::vote_gate`); CurrentVote does not count: wiped nodes ask one
/// another that. Such a sender's body is read before any refusal, which only holders of a node
/// certificate can cause.
#[derive(Clone)]
struct Outsider {
    /// Whether the caller's certificate names node `id` of this cluster (`None` in unit tests).
    names: Option<Arc<dyn Fn(NodeId) -> bool + Send + Sync>>,
}

/// How long a certificate check is trusted without checking again (expiry, mostly); a change of
/// membership or of certificates drops it at once.
const CHECKED_FOR: Duration = Duration::from_secs(60);
/// Checks remembered at most; the cache is cleared when full.
const CHECKED_MAX: usize = 256;
/// At most one refusal per this interval reaches the log.
const REFUSAL_LOG_EVERY_MS: u64 = 10_000;

/// What an unauthenticated caller is told; the reason goes to this node's log only.
fn refused() -> Status {
    errors::unauthenticated(
        "raft message refused: the caller is not authenticated as a member of this cluster",
    )
}

impl PeerAuth {
    pub fn new(
        config: &crate::config::NodeConfig,
        tls: Option<Arc<TlsHandle>>,
        local: LocalPeers,
        members: Arc<crate::members::Members>,
    ) -> Arc<Self> {
        Arc::new(PeerAuth {
            cluster_id: config.cluster_id.clone(),
            members,
            tls,
            local,
            checked: Mutex::new(HashMap::new()),
            last_logged_ms: AtomicU64::new(0),
            started: Instant::now(),
        })
    }

    /// The interceptor: authenticates the caller and records who it is, or refuses.
    pub fn intercept(&self, mut req: Request<()>) -> Result<Request<()>, Status> {
        // First the connection's owner on a plaintext loopback port: nothing else there tells a
        // member from any local process. The message names both users (the caller is local).
        if let Some(why) = self
            .local
            .refusal(req.extensions().get::<PeerOwner>(), "raft message refused")
        {
            self.log_refusal(&req, &why);
            return Err(errors::unauthenticated(why));
        }
        match self.identify(&req) {
            Ok(caller) => {
                req.extensions_mut().insert(Caller(caller));
                Ok(req)
            }
            Err(why) => {
                self.log_refusal(&req, &why);
                if self.certified_outsider(&req) {
                    let names = self.tls.as_ref().zip(req.peer_certs()).map(|(tls, chain)| {
                        let material = tls.current();
                        // With a second id, so that a certificate naming several nodes is
                        // refused, as it is among members (a wildcard is refused anyway).
                        Arc::new(move |id: NodeId| {
                            let other = id.checked_add(1).unwrap_or(id - 1);
                            material.identify_member(&chain, &[id, other]) == Ok(id)
                        }) as Arc<dyn Fn(NodeId) -> bool + Send + Sync>
                    });
                    req.extensions_mut().insert(Outsider { names });
                    return Ok(req);
                }
                Err(refused())
            }
        }
    }

    /// Whether a refused request names this cluster and comes with a node certificate of the
    /// peer CA (see [`Outsider`]).
    fn certified_outsider(&self, req: &Request<()>) -> bool {
        let Some(tls) = &self.tls else {
            return false;
        };
        let names_cluster = req
            .metadata()
            .get(CLUSTER_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            == Some(self.cluster_id.as_str());
        names_cluster
            && req
                .peer_certs()
                .is_some_and(|chain| tls.current().is_node_certificate(&chain))
    }

    fn log_refusal(&self, req: &Request<()>, why: &str) {
        let now = self.started.elapsed().as_millis() as u64;
        let last = self.last_logged_ms.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= REFUSAL_LOG_EVERY_MS)
            && self
                .last_logged_ms
                .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                remote = ?req.remote_addr(),
                reason = why,
                "lockd: refused a raft message (further refusals in the next 10 s are not logged)"
            );
        }
    }

    /// The node that sent `req`: its cluster id must be this one's, and with TLS its
    /// certificate must be a node certificate of the peer CA naming one other member. `None`
    /// without TLS (the sender is unknown). The error is the reason, for the log.
    fn identify<T>(&self, req: &Request<T>) -> Result<Option<NodeId>, String> {
        let cluster_id = req
            .metadata()
            .get(CLUSTER_ID_HEADER)
            .map(|v| v.to_str().map_err(|_| ()));
        let chain = req.peer_certs();
        self.identify_parts(cluster_id, chain.as_deref().map(|c| (c.as_slice(), None)))
    }

    /// [`PeerAuth::identify`] on credentials taken from a request earlier: a forward stream is
    /// checked again on every message, with the membership and certificates current then.
    pub(crate) fn identify_credentials(
        &self,
        credentials: &PeerCredentials,
    ) -> Result<Option<NodeId>, String> {
        let cluster_id = credentials
            .cluster_id
            .as_ref()
            .map(|r| r.as_deref().map_err(|_| ()));
        let chain = credentials
            .chain
            .as_deref()
            .map(|c| (c.as_slice(), credentials.leaf_key));
        self.identify_parts(cluster_id, chain)
    }

    /// The check itself: the cluster id header's value, and the certificate chain with the
    /// SHA-256 of its leaf if already known.
    fn identify_parts(
        &self,
        cluster_id: Option<Result<&str, ()>>,
        chain: Option<(
            &[rustls_pki_types::CertificateDer<'static>],
            Option<[u8; 32]>,
        )>,
    ) -> Result<Option<NodeId>, String> {
        match cluster_id {
            Some(Ok(id)) if id == self.cluster_id => {}
            Some(Ok(id)) => return Err(format!("it is for cluster {id:?}")),
            _ => return Err(format!("no {CLUSTER_ID_HEADER} header")),
        }
        let Some(tls) = &self.tls else {
            return Ok(None);
        };
        let (chain, leaf_key) = chain.ok_or_else(|| "the caller sent no certificate".to_owned())?;
        let leaf = chain
            .first()
            .ok_or_else(|| "the caller sent an empty certificate chain".to_owned())?;
        let key = leaf_key.unwrap_or_else(|| leaf_hash(leaf));
        let generation = (tls.generation(), self.members.generation());
        {
            let checked = self.checked.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((outcome, at, made_with)) = checked.get(&key)
                && at.elapsed() < CHECKED_FOR
                && *made_with == generation
            {
                return outcome.clone().map(Some);
            }
        }
        // Outside the lock: one chain check, however many members.
        let outcome = tls.current().identify_member(chain, &self.members.others());
        let mut checked = self.checked.lock().unwrap_or_else(|e| e.into_inner());
        if checked.len() >= CHECKED_MAX {
            checked.clear();
        }
        checked.insert(key, (outcome.clone(), Instant::now(), generation));
        outcome.map(Some)
    }

    /// With TLS, the message must claim to come from the node the certificate names.
    fn matches(cert: Option<NodeId>, claimed: Option<NodeId>) -> Result<(), Status> {
        match (cert, claimed) {
            (Some(cert), Some(c)) if cert != c => Err(errors::unauthenticated(format!(
                "raft message refused: it claims to come from node {c}, the caller's \
                 certificate names node {cert}"
            ))),
            (Some(_), None) => Err(errors::unauthenticated(
                "raft message refused: it names no sending node",
            )),
            _ => Ok(()),
        }
    }
}

impl RaftService {
    /// Authenticates the caller before decoding anything, then checks that the decoded message
    /// claims to come from it (`claimed`: the leader or candidate it names). Returns the message
    /// and who sent it, for [`RaftService::same_restore`]. `traffic`: whether the message, from
    /// an [`Outsider`] too, shows that a cluster runs (a leader's AppendEntries or
    /// InstallSnapshot).
    fn authorized<T: DeserializeOwned>(
        &self,
        req: Request<RaftMessage>,
        traffic: bool,
        claimed: impl FnOnce(&T) -> Option<NodeId>,
    ) -> Result<(T, Sender), Status> {
        let (cert, outsider) = match admitted(req.extensions(), &self.gate, traffic) {
            Ok(Caller(cert)) => (cert, None),
            // A leader this node does not know as a member yet (see `Outsider`).
            Err(refusal) => match req.extensions().get::<Outsider>() {
                Some(Outsider { names: Some(names) }) if traffic => (None, Some(names.clone())),
                _ => return Err(refusal),
            },
        };
        let restore_id = restore_id::from_metadata(req.metadata()).map(str::to_owned);
        // A member's message of a protocol this build does not read is not parsed; a
        // non-member's is judged once the leader it claims to be is checked, so it learns
        // nothing before that.
        let protocol = peer_protocol::announced(req.metadata());
        if outsider.is_none() {
            let sender = cert.map_or_else(|| "the sender".to_owned(), |id| format!("node {id}"));
            self.supported_protocol(&sender, protocol.clone())?;
        }
        // A non-member learns nothing from the answer, not even that its body was read.
        let rpc: T = match (decode(req), &outsider) {
            (Ok(rpc), _) => rpc,
            (Err(_), Some(_)) => return Err(refused()),
            (Err(e), None) => return Err(e),
        };
        let node = claimed(&rpc);
        match outsider {
            Some(names) => match node {
                Some(id) if names(id) => {}
                _ => return Err(refused()),
            },
            None => PeerAuth::matches(cert, node)?,
        }
        let peer = node.map_or_else(|| "the sender".to_owned(), |id| format!("node {id}"));
        let protocol = self.supported_protocol(&peer, protocol)?;
        if let Some(node) = node {
            self.protocols.record(node, protocol);
        }
        Ok((rpc, Sender { node, restore_id }))
    }

    /// The peer protocol version a message announced, if this build works with it
    /// (FAILED_PRECONDITION naming both versions otherwise; see `raft::peer_protocol`).
    fn supported_protocol(
        &self,
        sender: &str,
        announced: Result<u32, String>,
    ) -> Result<u32, Status> {
        let version = announced.map_err(|why| errors::precondition("peer_protocol", why))?;
        peer_protocol::check(sender, version).map_err(|why| {
            self.protocols.log_refusal(&why);
            errors::precondition("peer_protocol", why)
        })?;
        Ok(version)
    }

    /// The sender must have this node's restore id (FAILED_PRECONDITION naming both ids
    /// otherwise). Checked after the vote gate, right before the message reaches openraft: a
    /// wiped node that has not learned the id yet refuses everything at its gate anyway, and
    /// saying "not proven yet" there is the truth, not a mismatch.
    fn same_restore(&self, sender: &Sender) -> Result<(), Status> {
        let peer = sender
            .node
            .map_or_else(|| "the sender".to_owned(), |id| format!("node {id}"));
        self.restore
            .check(&peer, sender.restore_id.as_deref())
            .map_err(|why| {
                self.restore.log_mismatch(&why);
                errors::precondition("restore_id", why)
            })
    }

    /// A reply, with this node's restore id and peer protocol version (the sender checks both).
    fn reply<T: Serialize>(&self, v: &T) -> Result<Response<RaftMessage>, Status> {
        let mut response = encode(v)?;
        self.restore.attach(response.metadata_mut());
        peer_protocol::attach(response.metadata_mut());
        Ok(response)
    }
}

/// The caller the interceptor admitted; an [`Outsider`] is refused, after counting as traffic
/// when `traffic`. No mark at all means the service was built without the interceptor: refuse.
fn admitted(
    extensions: &tonic::Extensions,
    gate: &VoteGate,
    traffic: bool,
) -> Result<Caller, Status> {
    if let Some(caller) = extensions.get::<Caller>() {
        return Ok(*caller);
    }
    if traffic && extensions.get::<Outsider>().is_some() {
        gate.note_traffic();
    }
    Err(refused())
}

/// What a request presented to [`PeerAuth`]: its cluster id header and its certificate chain.
#[derive(Clone)]
pub(crate) struct PeerCredentials {
    /// The header's value; `Err` when it is not visible ASCII.
    cluster_id: Option<Result<String, ()>>,
    chain: Option<Arc<Vec<rustls_pki_types::CertificateDer<'static>>>>,
    /// SHA-256 of the chain's leaf, the key of [`PeerAuth`]'s cache, computed once.
    leaf_key: Option<[u8; 32]>,
}

impl PeerCredentials {
    pub(crate) fn of<T>(req: &Request<T>) -> Self {
        let chain = req.peer_certs();
        PeerCredentials {
            cluster_id: req
                .metadata()
                .get(CLUSTER_ID_HEADER)
                .map(|v| v.to_str().map(str::to_owned).map_err(|_| ())),
            leaf_key: chain.as_ref().and_then(|c| c.first()).map(leaf_hash),
            chain,
        }
    }
}

/// SHA-256 of a certificate: the key certificate checks are cached under.
fn leaf_hash(leaf: &rustls_pki_types::CertificateDer<'static>) -> [u8; 32] {
    Sha256::digest(leaf.as_ref()).into()
}

/// The member that sent `req`, for the other internal services behind [`PeerAuth`] (the forward
/// stream): `Ok(None)` without TLS (any caller naming this cluster), refused for a caller that is
/// not a member in this node's view (an [`Outsider`] may replicate, nothing else).
pub(crate) fn authenticated_member<T>(req: &Request<T>) -> Result<Option<NodeId>, Status> {
    match req.extensions().get::<Caller>() {
        Some(Caller(node)) => Ok(*node),
        None => Err(refused()),
    }
}

impl RaftService {
    pub fn server(
        raft: Raft,
        refuse_votes_until: Option<std::time::Instant>,
        gate: Arc<VoteGate>,
        log: LogStore,
        auth: Arc<PeerAuth>,
        restore: Arc<RestoreIdentity>,
        protocols: Arc<PeerProtocols>,
    ) -> InterceptedService<RaftServer<Self>, impl tonic::service::Interceptor + Clone> {
        let server = RaftServer::new(RaftService {
            raft,
            refuse_votes_until,
            gate,
            log,
            restore,
            protocols,
        })
        .max_decoding_message_size(crate::raft::network::RAFT_MESSAGE_MAX_BYTES)
        .max_encoding_message_size(crate::raft::network::RAFT_MESSAGE_MAX_BYTES);
        InterceptedService::new(server, move |req| auth.intercept(req))
    }
}

fn decode<T: DeserializeOwned>(req: Request<RaftMessage>) -> Result<T, Status> {
    postcard::from_bytes(&req.into_inner().data)
        .map_err(|e| errors::invalid_field("payload", format!("undecodable raft message: {e}")))
}

fn encode<T: Serialize>(v: &T) -> Result<Response<RaftMessage>, Status> {
    postcard::to_allocvec(v)
        .map(|data| Response::new(RaftMessage { data }))
        .map_err(|e| errors::internal(format!("encoding raft reply: {e}")))
}

#[tonic::async_trait]
impl pb::raft_server::Raft for RaftService {
    async fn append_entries(
        &self,
        req: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        let (rpc, sender) = self.authorized(
            req,
            true,
            |r: &openraft::raft::AppendEntriesRequest<TypeConfig>| r.vote.leader_id.voted_for(),
        )?;
        let (term, commit) = (rpc.vote.leader_id.term, rpc.leader_commit);
        self.gate.note_traffic();
        self.gate.admits_leader(term).map_err(errors::no_quorum)?;
        self.same_restore(&sender)?;
        let reply = self.raft.append_entries(rpc).await;
        if matches!(
            reply,
            Ok(openraft::raft::AppendEntriesResponse::Success
                | openraft::raft::AppendEntriesResponse::PartialSuccess(_))
        ) {
            self.gate.observe_append(term, commit);
        }
        self.reply(&reply)
    }

    async fn vote(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        // A candidate is no sign of a running cluster: the founders of a new one campaign
        // before any of them leads (see `raft::vote_gate`, founding).
        let (rpc, sender) =
            self.authorized(req, false, |r: &openraft::raft::VoteRequest<NodeId>| {
                r.vote.leader_id.voted_for()
            })?;
        if self
            .refuse_votes_until
            .is_some_and(|t| std::time::Instant::now() < t)
        {
            return Err(errors::no_quorum(
                "node started with an empty data dir; not voting yet",
            ));
        }
        self.gate
            .admits_candidate(rpc.vote.leader_id.term, rpc.last_log_id)
            .map_err(errors::no_quorum)?;
        self.same_restore(&sender)?;
        self.reply(&self.raft.vote(rpc).await)
    }

    async fn install_snapshot(
        &self,
        req: Request<RaftMessage>,
    ) -> Result<Response<RaftMessage>, Status> {
        let (rpc, sender) = self.authorized(
            req,
            true,
            |r: &openraft::raft::InstallSnapshotRequest<TypeConfig>| r.vote.leader_id.voted_for(),
        )?;
        self.gate.note_traffic();
        self.gate
            .admits_leader(rpc.vote.leader_id.term)
            .map_err(errors::no_quorum)?;
        self.same_restore(&sender)?;
        self.reply(&self.raft.install_snapshot(rpc).await)
    }

    /// Read-only: what a peer that rejoins with an empty data dir needs to relearn the term, and
    /// whether this node is rejoining itself (then the peer does not count this answer toward
    /// its proof; see `vote_gate`).
    async fn current_vote(
        &self,
        req: Request<RaftMessage>,
    ) -> Result<Response<pb::CurrentVoteReply>, Status> {
        admitted(req.extensions(), &self.gate, false)?;
        // Read before the vote and log: the gate only ever opens, so a vote and log read after
        // it reported open are those of a node that caught up. Read after, a gate opening in
        // between would vouch for a log read while still partial.
        let rejoining = !self.gate.is_open();
        let (vote, node_id, membership) = {
            let m = self.raft.metrics();
            let m = m.borrow();
            (m.vote, m.id, m.membership_config.membership().clone())
        };
        // The log id, not only the index: a rejoining peer compares candidates' logs with it.
        let last_log_id = self
            .log
            .clone()
            .get_log_state()
            .await
            .map_err(|e| errors::no_quorum(format!("reading the log state: {e}")))?
            .last_log_id;
        // Standing and restore id are not in the postcard payload (older nodes read it): they
        // travel in `kept_log` and `restore_id`.
        let report = self.gate.report(vote, last_log_id, membership);
        let data = postcard::to_allocvec(&report)
            .map_err(|e| errors::internal(format!("encoding raft reply: {e}")))?;
        // Answered whatever the asker's restore id: read-only, and a wiped node asks before it
        // knows one. The asker decides which answers count (see `raft::vote_gate`).
        let mut response = Response::new(pb::CurrentVoteReply {
            data,
            kept_log: Some(!rejoining),
            node_id: Some(node_id),
            restore_id: self.restore.get().map(str::to_owned),
        });
        peer_protocol::attach(response.metadata_mut());
        Ok(response)
    }

    /// Campaigns now, when the leader of this node's current term asks (leadership transfer,
    /// `service::membership`). The leader has already voted for this node in the next term.
    async fn elect(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let (ask, sender): (ElectRequest, _) =
            self.authorized(req, false, |r: &ElectRequest| Some(r.leader))?;
        self.same_restore(&sender)?;
        if !self.gate.is_open() {
            return Err(errors::no_quorum(
                "lockd: node is still catching up after an empty data dir; not campaigning",
            ));
        }
        let (term, leader) = {
            let m = self.raft.metrics().borrow().clone();
            (m.current_term, m.current_leader)
        };
        if ask.term != term || leader != Some(ask.leader) {
            return Err(errors::precondition(
                "term",
                format!(
                    "lockd: asked to campaign by node {} of term {}, but this node is in term \
                     {term} with leader {leader:?}",
                    ask.leader, ask.term
                ),
            ));
        }
        self.raft
            .trigger()
            .elect()
            .await
            .map_err(|e| errors::internal(format!("lockd: starting an election: {e}")))?;
        self.reply(&())
    }
}

/// The payload of `Elect`: who asks, in which term.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct ElectRequest {
    /// The leader that asks (it stepped down in favour of the receiver).
    pub leader: NodeId,
    /// The term it led in; the receiver campaigns only if it is still in that term.
    pub term: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raft::vote_gate::Founding;
    use std::collections::BTreeMap;

    /// H3 of the membership review: a Raft message from a sender outside this node's member
    /// view but with a node certificate of the peer CA is refused, yet counts as traffic of a
    /// running cluster (so the node never offers to found); its `CurrentVote` does not count.
    #[test]
    fn an_outsiders_raft_message_is_refused_but_counts_as_traffic() {
        let peers: BTreeMap<NodeId, String> =
            (1..=3).map(|i| (i, format!("127.0.0.1:{i}"))).collect();
        let gate = VoteGate::open(
            Arc::new(RestoreIdentity::new(None)),
            Founding::new(false, &peers, Duration::ZERO),
        );
        assert!(
            gate.report(Default::default(), None, Default::default())
                .founding
                .is_some()
        );

        let mut outsider = tonic::Extensions::new();
        outsider.insert(Outsider { names: None });
        // CurrentVote and Elect: refused, not traffic.
        assert!(admitted(&outsider, &gate, false).is_err());
        assert!(
            gate.report(Default::default(), None, Default::default())
                .founding
                .is_some()
        );
        // AppendEntries and InstallSnapshot: refused, and traffic (Vote is admitted with
        // `traffic` false, like CurrentVote).
        let e = admitted(&outsider, &gate, true).err().unwrap();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(
            gate.report(Default::default(), None, Default::default())
                .founding
                .is_none()
        );

        // A member passes; no mark at all is refused.
        let mut member = tonic::Extensions::new();
        member.insert(Caller(Some(2)));
        assert!(matches!(
            admitted(&member, &gate, true),
            Ok(Caller(Some(2)))
        ));
        assert!(admitted(&tonic::Extensions::new(), &gate, true).is_err());
    }
}

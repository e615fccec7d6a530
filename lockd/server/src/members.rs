//! The members this node knows of and client channels to them, kept current from the Raft
//! membership.
//!
//! Members are added, promoted and removed at runtime (`service::membership`), so nothing that
//! needs "the other nodes" may read the `--peer` flags once Raft knows a membership: forwarding a
//! call to the leader (which may be a node added last week), trusting a forwarded identity or a
//! replication message from a member's certificate. The view is the `--peer` list until this node
//! holds a membership (a new or wiped node), then every node of its effective membership: both
//! configurations of a joint change and the learners, so that a node being added or removed is
//! still a member while the change is in progress. A removed node drops out of the view, so its
//! certificate no longer counts as a member's.
//!
//! Addresses are kept as written (DNS names included) and resolved on every connect by
//! [`PeerDial`], so a member that moves to another IP under the same name needs no change here;
//! [`Members::trust`] also resolves them every few seconds for the accept loops' exemption.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::lock_client::LockClient;
use openraft::{BasicNode, Membership};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::node::CLIENT_MESSAGE_MAX_BYTES;
use crate::raft::network::PeerDial;
use crate::raft::{NodeId, Raft};
use crate::service::raft::pb::forward_client::ForwardClient;

/// One other member: its address and its client stubs (`None` if the address cannot be dialled,
/// which [`crate::config::check_host_port`] rules out for flags and `AddMember`).
#[derive(Clone)]
struct Peer {
    addr: String,
    clients: Option<Clients>,
}

/// The stubs of one member, each kind of call on connections of its own, so that no kind can
/// fill the 1,024 streams (`node::STREAMS_PER_CONNECTION_MAX`) another kind needs: the Lock
/// service's calls that do not wait for a lock (Describe, and every call to a leader of peer
/// protocol 2 or older), the Cluster service's admin calls, the forward stream, and waiting
/// Acquires, which park for up to 5 minutes each, on a pool that grows with them.
#[derive(Clone)]
struct Clients {
    lock: LockClient<Channel>,
    cluster: ClusterClient<Channel>,
    forward: ForwardClient<Channel>,
    waits: Arc<WaitPool>,
}

/// Waiting Acquires one connection to a member carries at once: under the 1,024 streams a node
/// allows a connection, with room for the streams of calls that just ended (a reset stream is
/// released a moment after its call returns).
pub(crate) const WAITS_PER_CONNECTION: usize = 1_000;

/// The connections that carry this node's waiting Acquires to one member (the leader): a new one
/// is opened when every one has [`WAITS_PER_CONNECTION`] in flight, up to `connections_max`,
/// derived from the node's bound on parked waits (`--waits-max`), which every forwarded wait holds
/// a place of first; so the pool is never full unless that bound is, and beyond it a call is
/// refused at once rather than queued behind the others for its whole wait. Connections are
/// opened lazily and kept for the member's life in the view.
struct WaitPool {
    id: NodeId,
    addr: String,
    dial: PeerDial,
    per_connection: usize,
    connections_max: usize,
    /// Each connection's client and its waits in flight.
    connections: Mutex<Vec<(LockClient<Channel>, Arc<AtomicUsize>)>>,
}

/// A waiting Acquire's place on one of a [`WaitPool`]'s connections, given back when dropped.
#[must_use = "the place is given back when this is dropped"]
pub(crate) struct WaitConnection {
    pub client: LockClient<Channel>,
    in_flight: Arc<AtomicUsize>,
}

impl Drop for WaitConnection {
    fn drop(&mut self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why a waiting Acquire found no place in a [`WaitPool`].
#[derive(Debug)]
pub(crate) enum WaitPoolRefused {
    /// Every connection carries its share.
    Full {
        connections: usize,
        per_connection: usize,
    },
    /// A new connection could not be made (the address cannot be dialled).
    Dial(String),
}

impl WaitPool {
    fn new(
        id: NodeId,
        addr: String,
        dial: PeerDial,
        per_connection: usize,
        connections_max: usize,
    ) -> Self {
        WaitPool {
            id,
            addr,
            dial,
            per_connection,
            connections_max,
            connections: Mutex::new(Vec::new()),
        }
    }

    /// A place on the first connection with room, on a new one if none has any.
    fn take(&self) -> Result<WaitConnection, WaitPoolRefused> {
        let mut connections = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        let with_room = connections
            .iter()
            .find(|(_, n)| n.load(Ordering::Acquire) < self.per_connection);
        let (client, in_flight) = match with_room {
            Some((client, n)) => (client.clone(), n.clone()),
            None if connections.len() < self.connections_max => {
                let channel = self
                    .dial
                    .channel(self.id, &self.addr)
                    .map_err(|e| WaitPoolRefused::Dial(e.to_string()))?;
                let client = lock_client(channel);
                let n = Arc::new(AtomicUsize::new(0));
                connections.push((client.clone(), n.clone()));
                (client, n)
            }
            None => {
                return Err(WaitPoolRefused::Full {
                    connections: connections.len(),
                    per_connection: self.per_connection,
                });
            }
        };
        // Under the lock: two calls never both take a connection's last place.
        in_flight.fetch_add(1, Ordering::AcqRel);
        Ok(WaitConnection { client, in_flight })
    }
}

/// The connections a follower may open to the leader for `waits_max` waiting Acquires.
pub(crate) fn wait_connections_max(waits_max: usize) -> usize {
    waits_max.div_ceil(WAITS_PER_CONNECTION).max(1)
}

fn lock_client(channel: Channel) -> LockClient<Channel> {
    LockClient::new(channel)
        .max_decoding_message_size(CLIENT_MESSAGE_MAX_BYTES)
        .max_encoding_message_size(CLIENT_MESSAGE_MAX_BYTES)
}

/// See the module docs.
pub struct Members {
    /// This node, never in the view.
    id: NodeId,
    /// `--peer`, this node excluded: the view until Raft knows a membership.
    flags: BTreeMap<NodeId, String>,
    /// Nodes of the memberships peers reported to this node while it had none of its own (a
    /// wiped or joining node asking `CurrentVote`): a member added since its flags were written
    /// may be the leader it must accept replication from.
    reported: Mutex<BTreeMap<NodeId, String>>,
    /// The other members with channels to them, replaced whole on every change; a forwarded
    /// call costs one read lock and a clone.
    view: RwLock<Arc<BTreeMap<NodeId, Peer>>>,
    /// Whether the view comes from Raft's membership (then `reported` no longer counts).
    from_raft: std::sync::atomic::AtomicBool,
    /// How peers are dialled (TLS, source address, cluster id).
    dial: PeerDial,
    /// Connections each member's [`WaitPool`] may open.
    wait_connections_max: usize,
    /// Bumped on every change of the view, so caches of "is this caller a member" (the peer
    /// certificate checks of `service::raft`) are dropped when a member is added or removed.
    generation: std::sync::atomic::AtomicU64,
    /// Woken on every change of the view ([`Members::trust`] resolves the new addresses).
    changed: tokio::sync::Notify,
}

impl Members {
    /// The members of `flags` (this node's `--peer`) until Raft knows a membership; waiting
    /// Acquires to each go on up to `wait_connections_max` connections.
    pub fn new(
        id: NodeId,
        flags: &BTreeMap<NodeId, String>,
        dial: PeerDial,
        wait_connections_max: usize,
    ) -> Arc<Self> {
        let flags: BTreeMap<NodeId, String> = flags
            .iter()
            .filter(|(p, _)| **p != id)
            .map(|(p, a)| (*p, a.clone()))
            .collect();
        let members = Arc::new(Members {
            id,
            flags: flags.clone(),
            reported: Mutex::new(BTreeMap::new()),
            view: RwLock::new(Arc::new(BTreeMap::new())),
            from_raft: std::sync::atomic::AtomicBool::new(false),
            dial,
            wait_connections_max,
            generation: std::sync::atomic::AtomicU64::new(0),
            changed: tokio::sync::Notify::new(),
        });
        members.set(flags);
        members
    }

    fn view(&self) -> Arc<BTreeMap<NodeId, Peer>> {
        self.view.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Changes whenever the view does.
    pub fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The other members' ids.
    pub fn others(&self) -> Vec<NodeId> {
        self.view().keys().copied().collect()
    }

    pub fn contains(&self, id: NodeId) -> bool {
        self.view().contains_key(&id)
    }

    /// The address of member `id` as the membership names it.
    pub fn addr(&self, id: NodeId) -> Option<String> {
        self.view().get(&id).map(|p| p.addr.clone())
    }

    /// How this node dials its peers.
    pub fn dial(&self) -> &PeerDial {
        &self.dial
    }

    /// The address of member `id` and the stub `pick` chooses (one clone, on a hot path);
    /// `None` if it is not a member or cannot be dialled.
    fn client<C: Clone>(&self, id: NodeId, pick: impl Fn(&Clients) -> &C) -> Option<(String, C)> {
        let view = self.view();
        let p = view.get(&id)?;
        p.clients
            .as_ref()
            .map(|c| (p.addr.clone(), pick(c).clone()))
    }

    /// The Lock service of member `id`, for forwarding calls that do not wait for a lock, with
    /// its address (for messages).
    pub fn lock_client(&self, id: NodeId) -> Option<(String, LockClient<Channel>)> {
        self.client(id, |c| &c.lock)
    }

    /// A place for a waiting Acquire on the connections to member `id` (see [`WaitPool`]), with
    /// its address; `None` if it is not a member or cannot be dialled.
    pub fn wait_client(
        &self,
        id: NodeId,
    ) -> Option<(String, Result<WaitConnection, WaitPoolRefused>)> {
        let view = self.view();
        let p = view.get(&id)?;
        let pool = p.clients.as_ref()?.waits.clone();
        drop(view);
        Some((pool.addr.clone(), pool.take()))
    }

    /// The forward stream service of member `id` (see `crate::forwarder`), with its address.
    pub fn forward_client(&self, id: NodeId) -> Option<(String, ForwardClient<Channel>)> {
        self.client(id, |c| &c.forward)
    }

    /// The Cluster service of member `id`, for forwarding admin calls, with its address.
    pub fn cluster_client(&self, id: NodeId) -> Option<(String, ClusterClient<Channel>)> {
        self.client(id, |c| &c.cluster)
    }

    /// Replaces the view with `wanted`, keeping the channels of members whose address is the
    /// same.
    fn set(&self, wanted: BTreeMap<NodeId, String>) {
        let current = self.view();
        let same = current.len() == wanted.len()
            && current
                .iter()
                .zip(&wanted)
                .all(|((a, p), (b, addr))| a == b && p.addr == *addr);
        if same {
            return;
        }
        let view: BTreeMap<NodeId, Peer> = wanted
            .into_iter()
            .map(|(id, addr)| {
                let peer = match current.get(&id) {
                    Some(p) if p.addr == addr => p.clone(),
                    _ => self.connect(id, addr),
                };
                (id, peer)
            })
            .collect();
        tracing::info!(
            members = ?view.iter().map(|(id, p)| (*id, p.addr.as_str())).collect::<Vec<_>>(),
            "lockd: members"
        );
        *self.view.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(view);
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.changed.notify_one();
    }

    fn connect(&self, id: NodeId, addr: String) -> Peer {
        // Channels are lazy: a connection is opened at its first call. The forward stream gets
        // one of its own: a stream the leader stops reading (its calls in flight at the bound)
        // would otherwise hold the connection's flow-control window, and the unary forwards
        // beside it would wait. Admin calls get another, so that a flood of Describes (each a
        // quorum round on the leader, 4.5 s at most) cannot hold them up either.
        let channels = (
            self.dial.channel(id, &addr),
            self.dial.channel(id, &addr),
            self.dial.channel(id, &addr),
        );
        let clients = match channels {
            (Ok(calls), Ok(admin), Ok(stream)) => Some(Clients {
                lock: lock_client(calls),
                cluster: ClusterClient::new(admin),
                forward: ForwardClient::new(stream),
                waits: Arc::new(WaitPool::new(
                    id,
                    addr.clone(),
                    self.dial.clone(),
                    WAITS_PER_CONNECTION,
                    self.wait_connections_max,
                )),
            }),
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                tracing::warn!(peer = id, address = %addr, error = %e, "lockd: cannot dial member");
                None
            }
        };
        Peer { addr, clients }
    }

    /// Takes the view from `membership`; while it has no node (this node has not joined yet),
    /// the flags and the reported nodes.
    pub fn update(&self, membership: &Membership<NodeId, BasicNode>) {
        let from_raft = membership.nodes().next().is_some();
        self.from_raft
            .store(from_raft, std::sync::atomic::Ordering::Release);
        let wanted = if from_raft {
            membership
                .nodes()
                .filter(|(id, _)| **id != self.id)
                .map(|(id, n)| (*id, n.addr.clone()))
                .collect()
        } else {
            self.before_raft()
        };
        self.set(wanted);
    }

    /// Learns the nodes of a membership a peer reported (`CurrentVote`); they count only while
    /// Raft has no membership here.
    pub fn learn(&self, membership: &Membership<NodeId, BasicNode>) {
        {
            let mut reported = self.reported.lock().unwrap_or_else(|e| e.into_inner());
            for (id, n) in membership.nodes() {
                if *id != self.id && !n.addr.is_empty() {
                    reported.insert(*id, n.addr.clone());
                }
            }
        }
        if !self.from_raft.load(std::sync::atomic::Ordering::Acquire) {
            self.set(self.before_raft());
        }
    }

    /// The flags, with the reported nodes added (a reported address wins: it is the cluster's).
    fn before_raft(&self) -> BTreeMap<NodeId, String> {
        let mut wanted = self.flags.clone();
        let reported = self.reported.lock().unwrap_or_else(|e| e.into_inner());
        wanted.extend(reported.iter().map(|(id, a)| (*id, a.clone())));
        wanted
    }

    /// Keeps the view current with Raft's effective membership until `shutdown`.
    pub async fn follow(self: Arc<Self>, raft: Raft, shutdown: CancellationToken) {
        let mut rx = raft.metrics();
        // Metrics change on every commit; the membership only with its log id.
        let mut seen = None;
        let mut first = true;
        loop {
            let changed = {
                let m = rx.borrow_and_update();
                let log_id = *m.membership_config.log_id();
                (first || log_id != seen).then(|| {
                    seen = log_id;
                    m.membership_config.membership().clone()
                })
            };
            first = false;
            if let Some(membership) = changed {
                self.update(&membership);
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                changed = rx.changed() => if changed.is_err() { return },
            }
        }
    }
}

impl Members {
    /// Keeps `trusted` (the sources the accept loops never refuse for their number of
    /// connections or handshakes: `connections.rs`, `tls.rs`, the metrics listener) at the IP
    /// addresses of the members in this node's view, under the address the view names and under
    /// their `--peer` flag if it differs, and of `own` (this node's `--peer` address), until
    /// `shutdown`: resolved again at once when the view changes (a member added or removed at
    /// runtime) and every [`crate::connections::TRUST_REFRESH`] (a member back on another IP
    /// under its name). The names of one pass are resolved side by side, so a slow name delays
    /// the others by [`crate::resolve::NAME_LOOKUP_TIMEOUT`] at most. A name whose lookup fails keeps the
    /// addresses it last resolved to for [`TRUST_KEPT_PASSES`] passes, so a resolver's hiccup
    /// does not make a member count like a client in the middle of a flood; an answer with no
    /// address drops them at once.
    pub async fn trust(
        self: Arc<Self>,
        own: Option<String>,
        trusted: lockd_service_kit::admission::TrustedSources,
        shutdown: CancellationToken,
    ) {
        // Per address: what it last resolved to, and the failed passes since.
        let mut last: BTreeMap<String, (Vec<std::net::IpAddr>, u32)> = BTreeMap::new();
        loop {
            let mut addrs: Vec<String> = {
                let view = self.view();
                view.iter()
                    .flat_map(|(id, p)| {
                        let flag = self.flags.get(id).filter(|f| **f != p.addr);
                        std::iter::once(p.addr.clone()).chain(flag.cloned())
                    })
                    .collect()
            };
            addrs.extend(own.clone());
            addrs.sort_unstable();
            addrs.dedup();
            let lookups = futures::future::join_all(addrs.iter().map(|a| resolve(a)));
            let answers = tokio::select! {
                _ = shutdown.cancelled() => return,
                answers = lookups => answers,
            };
            let mut resolved = BTreeMap::new();
            for (addr, answer) in addrs.into_iter().zip(answers) {
                let kept = match answer {
                    Ok(ips) => Some((ips, 0)),
                    Err(_) => last
                        .get(&addr)
                        .filter(|(_, misses)| *misses < TRUST_KEPT_PASSES)
                        .map(|(ips, misses)| (ips.clone(), misses + 1)),
                };
                if let Some(kept) = kept {
                    resolved.insert(addr, kept);
                }
            }
            let ips: Vec<std::net::IpAddr> = resolved
                .values()
                .flat_map(|(ips, _)| ips)
                .copied()
                .collect();
            if trusted.set(ips) {
                tracing::info!(addresses = ?trusted.get(), "lockd: members' addresses (never refused for their number of connections)");
            }
            last = resolved;
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = self.changed.notified() => {}
                _ = tokio::time::sleep(crate::connections::TRUST_REFRESH) => {}
            }
        }
    }
}

/// Failed passes for which [`Members::trust`] keeps a name's last addresses (a minute).
pub const TRUST_KEPT_PASSES: u32 = 6;

/// The IP addresses of `addr` (`ip:port` or `name:port`), or why there are none.
pub async fn resolve(addr: &str) -> Result<Vec<std::net::IpAddr>, String> {
    crate::resolve::lookup(addr)
        .await
        .map(|found| found.into_iter().map(|a| a.ip()).collect())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn dial() -> PeerDial {
        PeerDial::new(
            None,
            None,
            "test",
            Arc::new(crate::raft::restore_id::RestoreIdentity::new(None)),
            Arc::default(),
        )
        .unwrap()
    }

    #[tokio::test]
    async fn the_view_follows_the_raft_membership_once_there_is_one() {
        let flags: BTreeMap<NodeId, String> = [(1, "a:1"), (2, "b:2"), (3, "c:3")]
            .into_iter()
            .map(|(i, a)| (i, a.to_owned()))
            .collect();
        let m = Members::new(1, &flags, dial(), 1);
        assert_eq!(m.others(), [2, 3]);
        assert!(m.cluster_client(2).is_some());
        // An empty membership (a node that has not joined yet) keeps the flags.
        m.update(&Membership::new(vec![BTreeSet::new()], ()));
        assert_eq!(m.others(), [2, 3]);
        // Node 3 replaced by node 4 under a name; learner 5 counts as a member.
        let nodes: BTreeMap<NodeId, BasicNode> =
            [(1, "a:1"), (2, "b:2"), (4, "d.example:4"), (5, "e:5")]
                .into_iter()
                .map(|(i, a)| (i, BasicNode::new(a)))
                .collect();
        let before = m.generation();
        m.update(&Membership::new(
            vec![BTreeSet::from([1, 2, 4])],
            nodes.clone(),
        ));
        assert_eq!(m.others(), [2, 4, 5]);
        assert_ne!(
            m.generation(),
            before,
            "a change is seen by the certificate cache"
        );
        let after = m.generation();
        m.update(&Membership::new(vec![BTreeSet::from([1, 2, 4])], nodes));
        assert_eq!(m.generation(), after, "no change, no new generation");
        assert!(!m.contains(3), "a removed node is no member");
        assert_eq!(m.addr(4).as_deref(), Some("d.example:4"));
        assert!(m.lock_client(3).is_none());
        assert!(m.lock_client(4).is_some());
    }

    /// A wiped node whose flags predate a replacement learns the new member from its peers'
    /// answers, so it accepts the new leader's messages; once Raft has a membership, that rules.
    #[tokio::test]
    async fn reported_members_count_only_until_raft_has_a_membership() {
        let flags: BTreeMap<NodeId, String> = [(1, "a:1"), (2, "b:2"), (3, "c:3")]
            .into_iter()
            .map(|(i, a)| (i, a.to_owned()))
            .collect();
        let m = Members::new(1, &flags, dial(), 1);
        let nodes: BTreeMap<NodeId, BasicNode> = [(1, "a:1"), (2, "b:2"), (4, "d:4")]
            .into_iter()
            .map(|(i, a)| (i, BasicNode::new(a)))
            .collect();
        let reported = Membership::new(vec![BTreeSet::from([1, 2, 4])], nodes);
        m.learn(&reported);
        assert_eq!(m.others(), [2, 3, 4]);
        m.update(&reported);
        assert_eq!(m.others(), [2, 4]);
        m.learn(&Membership::new(vec![BTreeSet::from([1, 2, 5])], ()));
        assert_eq!(m.others(), [2, 4], "reports no longer count");
    }

    /// Goal (review of waiting calls, MEDIUM 1): waiting Acquires to the leader go on a pool of
    /// connections that grows when every connection carries its share, up to a bound, beyond
    /// which a call is refused rather than queued; places come back when calls end. Method: a
    /// pool of 3 places per connection and 2 connections (lazy channels: nothing is dialled).
    #[tokio::test]
    async fn the_wait_pool_grows_by_connection_up_to_its_bound() {
        let pool = WaitPool::new(2, "127.0.0.1:1".to_owned(), dial(), 3, 2);
        let mut held: Vec<_> = (0..6).map(|_| pool.take().unwrap()).collect();
        {
            let connections = pool.connections.lock().unwrap();
            assert_eq!(connections.len(), 2);
            assert!(
                connections
                    .iter()
                    .all(|(_, n)| n.load(Ordering::Acquire) == 3)
            );
        }
        match pool.take() {
            Err(WaitPoolRefused::Full {
                connections: 2,
                per_connection: 3,
            }) => {}
            other => panic!("{:?}", other.map(|_| ())),
        }
        drop(held.remove(4));
        assert!(pool.take().is_ok(), "a place came back");
        assert_eq!(pool.connections.lock().unwrap().len(), 2);
        assert_eq!(wait_connections_max(65_536), 66);
        assert_eq!(wait_connections_max(1), 1);
        assert_eq!(wait_connections_max(1_000_000), 1_000);
    }
}

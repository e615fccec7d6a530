//! One lockd node: storage, Raft, the proposer, the reaper and the gRPC server, wired together.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use lockd_api::v1::cluster_server::ClusterServer;
use lockd_api::v1::lock_server::LockServer;
use lockd_core::{Command, Event, EventKind, ResourceName};
use openraft::{BasicNode, ServerState};
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;

use crate::clock::Clock;
use crate::config::NodeConfig;
use crate::local_peer::{LocalPeers, Lookup};
use crate::members::Members;
use crate::observe::audit::{AuditKey, AuditLog};
use crate::observe::hot::{HotEvent, HotTracker};
use crate::observe::metrics::NodeMetrics;
use crate::proposer::Proposer;
use crate::raft::network::Network;
use crate::raft::network::PeerDial;
use crate::raft::peer_protocol::PeerProtocols;
use crate::raft::restore_id::RestoreIdentity;
use crate::raft::vote_gate::{Founding, VoteGate};
use crate::raft::{NodeId, Raft};
use crate::service::cluster::ClusterService;
use crate::service::lock::LockService;
use crate::service::raft::RaftService;
use crate::storage::state_machine::{AppliedSink, SmState, StateMachine};
use crate::storage::{self, log_store::LogStore};
use crate::waiters::{WaitEnd, WaitRegistry};

/// How often the leader looks for leases and waits that are due.
const REAP_INTERVAL: Duration = Duration::from_millis(50);
/// Resources reaped per round; the rest follow in the next round.
const REAP_BATCH_MAX: usize = 2_000;
/// Largest client message: requests are a few hundred bytes.
pub(crate) const CLIENT_MESSAGE_MAX_BYTES: usize = 64 * 1024;

/// Everything the RPC handlers and background tasks of one node share.
pub(crate) struct NodeCtx {
    pub id: NodeId,
    pub raft: Raft,
    pub sm: Arc<RwLock<SmState>>,
    pub proposer: Proposer,
    pub waits: Arc<WaitRegistry>,
    pub clock: Clock,
    pub metrics: Arc<NodeMetrics>,
    pub committed: Arc<AtomicU64>,
    /// The other members and channels to them (forwarding to the leader), kept current from
    /// the Raft membership.
    pub members: Arc<Members>,
    pub election_timeout_max_ms: u64,
    /// When each peer last answered this node's replication (`member remove` counts only
    /// voters that answered within `election_timeout_max_ms`).
    pub acks: crate::raft::network::PeerAcks,
    pub hub: Arc<Hub>,
    /// True while this node is the leader; changes only on a change of role.
    pub is_leader: tokio::sync::watch::Sender<bool>,
    /// The replicated sequencer key, parsed, for signing grants.
    pub signer: crate::signing::Signer,
    /// Who calls and what they may do (`--auth-policy`).
    pub auth: Arc<crate::auth::Auth>,
    /// This node's data dir, for the disk and log-size gauges.
    pub data_dir: std::path::PathBuf,
    /// `--allow-backup-without-policy` (see `service::snapshot::may_save`).
    pub allow_backup_without_policy: bool,
    /// The peer protocol version each member announced (see `raft::peer_protocol`).
    pub protocols: Arc<PeerProtocols>,
    /// `--allow-membership-without-policy` (see `service::membership::may_change`).
    pub allow_membership_without_policy: bool,
    /// Held by the leader from a membership call's check to the end of its change, so two
    /// concurrent calls cannot both pass a check that only one of them may pass (two removals
    /// each leaving a majority, together not). Async: it is held across the change.
    pub membership_lock: tokio::sync::Mutex<()>,
    /// A follower's link to the leader for forwarded calls (see `crate::forwarder`).
    pub forwarder: crate::forwarder::Forwarder,
    /// Linearizable reads, many per leadership check (see `crate::read_barrier`).
    pub reads: crate::read_barrier::ReadBarrier,
    /// The places of waiting Acquires parked here for their clients (see `crate::parked`).
    pub parked: crate::parked::ParkedWaits,
}

impl NodeCtx {
    /// Ready = this node is part of a quorum with a known leader.
    pub fn readiness(&self) -> Result<String, String> {
        let m = self.raft.metrics().borrow().clone();
        match (m.state, m.current_leader) {
            (ServerState::Leader, _) => match m.millis_since_quorum_ack {
                Some(ms) if ms <= self.election_timeout_max_ms => {
                    Ok(format!("leader of term {}", m.current_term))
                }
                other => Err(format!(
                    "leader of term {} without a quorum acknowledgement for {other:?} ms",
                    m.current_term
                )),
            },
            (_, Some(leader)) => Ok(format!(
                "follower of leader {leader} in term {}",
                m.current_term
            )),
            (state, None) => Err(format!(
                "{state:?} in term {} with no known leader",
                m.current_term
            )),
        }
    }

    pub fn refresh_gauges(&self) {
        let stats = self.sm.read().expect("state lock").table.stats();
        let m = self.raft.metrics().borrow().clone();
        self.metrics.with(|| {
            metrics::gauge!("lockd_active_locks").set(stats.active_locks as f64);
            metrics::gauge!("lockd_waiters").set(stats.waiters as f64);
            metrics::gauge!("lockd_is_leader").set(if m.state == ServerState::Leader {
                1.0
            } else {
                0.0
            });
            metrics::gauge!("lockd_raft_commit_index")
                .set(self.committed.load(Ordering::Relaxed) as f64);
            metrics::gauge!("lockd_raft_term").set(m.current_term as f64);
            let members = m.membership_config.membership().nodes().map(|(id, _)| *id);
            metrics::gauge!("lockd_cluster_peer_protocol")
                .set(f64::from(self.protocols.cluster(self.id, members)));
            // Only the leader knows how far each member is; the others report 0, so a former
            // leader's last figures do not linger (alerts read the leader's series).
            for peer in m.membership_config.membership().nodes().map(|(id, _)| *id) {
                if peer == self.id {
                    continue;
                }
                if let Some(version) = self.protocols.of(peer) {
                    metrics::gauge!("lockd_peer_protocol", "peer" => peer.to_string())
                        .set(f64::from(version));
                }
                let lag = match (m.last_log_index, &m.replication) {
                    (Some(last), Some(replication)) => {
                        replication.get(&peer).map_or(last, |matched| {
                            last.saturating_sub(matched.map_or(0, |l| l.index))
                        })
                    }
                    _ => 0,
                };
                metrics::gauge!("lockd_replication_lag_entries", "peer" => peer.to_string())
                    .set(lag as f64);
            }
            if let Some(offset_ms) = self.hub.clock_offset_ms() {
                metrics::gauge!("lockd_clock_offset_seconds").set(offset_ms as f64 / 1000.0);
            }
            match std::fs::metadata(self.data_dir.join(storage::LOG_FILE)) {
                Ok(meta) => metrics::gauge!("lockd_log_size_bytes").set(meta.len() as f64),
                Err(e) => tracing::warn!(error = %e, "reading the log database's size"),
            }
            match nix::sys::statvfs::statvfs(&self.data_dir) {
                Ok(fs) => {
                    let block = fs.fragment_size() as f64;
                    metrics::gauge!("lockd_data_dir_free_bytes")
                        .set(fs.blocks_available() as f64 * block);
                    metrics::gauge!("lockd_data_dir_capacity_bytes")
                        .set(fs.blocks() as f64 * block);
                }
                Err(e) => tracing::warn!(error = %e, "statvfs of the data dir"),
            }
        });
    }
}

/// Wakes waiting calls, counts state changes, writes the audit log and feeds the hot lists as
/// entries apply.
pub(crate) struct Hub {
    waits: Arc<WaitRegistry>,
    metrics: Arc<NodeMetrics>,
    audit: Option<AuditLog>,
    /// Hot resources for Status, kept off the apply path (see `observe::hot`).
    pub hot: HotTracker,
    /// This node's wall clock minus the stamp of the last applied entry, in ms; `i64::MIN`
    /// until an entry applied.
    clock_offset_ms: std::sync::atomic::AtomicI64,
}

impl Hub {
    /// See `lockd_clock_offset_seconds`.
    pub fn clock_offset_ms(&self) -> Option<i64> {
        Some(self.clock_offset_ms.load(Ordering::Relaxed)).filter(|v| *v != i64::MIN)
    }
}

impl AppliedSink for Hub {
    fn on_applied(
        &self,
        log_index: u64,
        unix_ms: i64,
        events: &[Event],
        queue_lens: &[Option<u32>],
    ) {
        // The stamp is the leader's wall clock when it proposed the entry (never going back).
        if let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            self.clock_offset_ms
                .store(now.as_millis() as i64 - unix_ms, Ordering::Relaxed);
        }
        if events.is_empty() {
            return;
        }
        if let Some(audit) = &self.audit {
            audit.record(log_index, unix_ms, events);
        }
        for (e, queue_len) in events.iter().zip(queue_lens) {
            match e.kind {
                EventKind::Granted {
                    to_waiter: Some(_),
                    grant,
                } => self
                    .waits
                    .notify(&e.request_id, WaitEnd::Granted(e.resource.clone(), grant)),
                EventKind::TimedOut { .. } => self
                    .waits
                    .notify(&e.request_id, WaitEnd::TimedOut(e.resource.clone())),
                EventKind::Expired => self
                    .metrics
                    .with(|| metrics::counter!("lockd_lease_expirations_total").increment(1)),
                _ => {}
            }
            if matches!(
                e.kind,
                EventKind::Granted {
                    to_waiter: None,
                    ..
                } | EventKind::Queued
            ) {
                self.hot.report(HotEvent::Acquire(e.resource.to_string()));
            }
            if let Some(n) = queue_len {
                self.hot.report(HotEvent::Queue(e.resource.to_string(), *n));
            }
        }
    }

    fn on_table_replaced(&self, longest_queues: Vec<(ResourceName, u32)>) {
        self.hot.report(HotEvent::ResetQueues(
            longest_queues
                .into_iter()
                .map(|(r, n)| (r.to_string(), n))
                .collect(),
        ));
    }

    fn on_snapshot_stored(&self, installed: bool, took: Duration, bytes: u64) {
        self.metrics.snapshot_stored(installed, took, bytes);
    }

    fn on_snapshot_installed(&self, log_index: u64, unix_ms: i64) {
        if let Some(audit) = &self.audit {
            audit.snapshot_installed(log_index, unix_ms);
        }
    }
}

/// A started node. Dropping it does not stop it: cancel the token given to [`start`].
pub struct RunningNode {
    /// Held, not read: the node's shared state lives at least as long as this handle, as it
    /// did when callers could reach it.
    _ctx: Arc<NodeCtx>,
    /// The node's main task; it ends when the node stops, with the error that stopped it.
    pub done: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// Whether this node's log holds neither a vote nor an entry.
async fn log_is_empty(log_store: &mut LogStore) -> anyhow::Result<bool> {
    use openraft::storage::RaftLogStorage;
    Ok(log_store.read_vote().await?.is_none()
        && log_store.get_log_state().await?.last_log_id.is_none())
}

/// `lockd init`: prepares an empty data dir to found a new single-node cluster of `peers` (this
/// node alone) on its next start; the only way to found a single-node cluster, which then grows
/// with `lockd --join` and `lockctl member add`. Refused on a data dir that holds state or was
/// prepared already. The founding is recorded in the data dir, not given as a flag of the
/// running node: a flag left in a service file would found a second cluster the day the node
/// lost its disk. The new cluster's incarnation id (`raft::restore_id`) is drawn here and
/// written before anything else, so the node never takes part in Raft without it.
///
/// Several nodes are refused: nodes started with the same `--peer` list found a multi-node
/// cluster by themselves, agreeing on one incarnation id (`raft::vote_gate`, founding); a
/// prepared node among them would lead alone at index 0 with an id of its own.
pub async fn init(
    data_dir: &std::path::Path,
    id: NodeId,
    peers: &BTreeMap<NodeId, String>,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        peers.contains_key(&id),
        "lockd init: --peer must name this node ({id}) too"
    );
    let dbs = storage::open(data_dir)?;
    let mut log_store = LogStore::observed(
        dbs.log.clone(),
        dbs.snapshots.durable(),
        Arc::new(NodeMetrics::new()),
    );
    if !log_is_empty(&mut log_store).await? || log_store.founding()?.is_some() {
        anyhow::bail!(
            "lockd init: {} already holds this node's state (or was initialized already); a \
             node keeps its cluster across restarts, and `lockd init` is for a new cluster only",
            data_dir.display()
        );
    }
    anyhow::ensure!(
        peers.len() == 1,
        "lockd init: --peer names nodes {:?}; `lockd init` founds a single-node cluster (this \
         node alone), which then grows with `lockd --join` and `lockctl member add`. Nodes \
         started with the same --peer list found a multi-node cluster by themselves, without \
         `lockd init`",
        peers.keys().collect::<Vec<_>>()
    );
    let incarnation = crate::raft::restore_id::new_incarnation_id();
    log_store.set_restore_id(&incarnation).await?;
    log_store
        .set_founding(peers.iter().map(|(id, a)| (*id, a.clone())).collect())
        .await?;
    Ok(())
}

/// Starts a node and returns once its ports are bound; it runs until `shutdown` is cancelled.
pub async fn start(config: NodeConfig, shutdown: CancellationToken) -> anyhow::Result<RunningNode> {
    let t = &config.tuning;
    let raft_config = openraft::Config {
        cluster_name: "lockd".into(),
        heartbeat_interval: millis(t.heartbeat),
        election_timeout_min: millis(t.election_timeout),
        election_timeout_max: millis(t.election_timeout) * 2,
        install_snapshot_timeout: 10_000,
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(staggered_snapshot_every(
            t.snapshot_every,
            config.id,
        )),
        max_in_snapshot_log_to_keep: t.logs_kept_after_snapshot,
        snapshot_max_chunk_size: 4 * 1024 * 1024,
        // Entries per AppendEntries: with up to 512 commands each this keeps one call to about a
        // megabyte, well inside the heartbeat-long timeout openraft 0.9 gives it.
        max_payload_entries: 16,
        ..Default::default()
    }
    .validate()
    .map_err(|e| anyhow::anyhow!("raft configuration: {e}"))?;

    let dbs = storage::open(&config.data_dir)?;
    let metrics = Arc::new(NodeMetrics::new());
    let mut log_store =
        LogStore::observed(dbs.log.clone(), dbs.snapshots.durable(), metrics.clone());
    let started_empty = log_is_empty(&mut log_store).await?;
    // Founding alone is never a flag of the running node: `lockd init` records it in the data
    // dir, so a node that loses its disk loses it too and waits for its cluster instead of
    // founding a second one whose tokens would start again from 1.
    let founding_members = if started_empty {
        log_store.founding()?
    } else {
        None
    };
    if config.join && founding_members.is_some() {
        anyhow::bail!(
            "lockd: {} was prepared by `lockd init` to found a new cluster, and --join joins a \
             running one: give one",
            config.data_dir.display()
        );
    }
    let rejoin = started_empty && founding_members.is_none();
    let refuse_votes_until = rejoin.then(|| std::time::Instant::now() + 4 * t.election_timeout);
    // Recorded before Raft starts, so a crash while catching up keeps the node from voting on a
    // partial log after its restart (see raft::vote_gate).
    if rejoin {
        log_store.start_rejoining().await.map_err(|e| {
            anyhow::anyhow!(
                "lockd: recording the rejoining flag in {}: {e}",
                config.data_dir.display()
            )
        })?;
    }
    // The cluster incarnation id (see `raft::restore_id`): kept for good once set; peers of
    // another incarnation never mix.
    let restore = Arc::new(RestoreIdentity::new(log_store.restore_id()?));
    if let Some(id) = restore.get() {
        tracing::info!(
            restore_id = id,
            "cluster incarnation id: Raft traffic only with members of this id"
        );
    }
    // A running cluster that counts this node as a member sends it heartbeats well within one
    // maximum election timeout (2 x --election-timeout); two of them leave room for a slow
    // start. It runs alongside refuse_votes_until, so a first formation takes no longer.
    let founding = Founding::new(config.join, &config.peers, 4 * t.election_timeout);
    let vote_gate = Arc::new(if log_store.rejoining()? {
        VoteGate::rejoining(log_store.clone(), restore.clone(), founding)?
    } else {
        VoteGate::open(restore.clone(), founding)
    });
    let committed = log_store.committed_index();
    let waits = Arc::new(WaitRegistry::default());
    tokio::spawn(metrics.clone().upkeep(shutdown.clone()));
    let audit = match &config.audit {
        Some(target) => Some(
            AuditLog::open(
                target.clone(),
                config.id,
                AuditKey::load(config.tuning.audit_key_file.as_deref(), &config.data_dir)?,
            )?
            // With a policy every proposed request id carries its caller's identity.
            .naming_identities(config.auth.is_some()),
        ),
        None => None,
    };
    let hub = Arc::new(Hub {
        waits: waits.clone(),
        metrics: metrics.clone(),
        audit,
        hot: HotTracker::start(),
        clock_offset_ms: std::sync::atomic::AtomicI64::new(i64::MIN),
    });
    let sink: Arc<dyn AppliedSink> = hub.clone();
    let state_machine = StateMachine::open(dbs, sink).await?;
    let sm = state_machine.shared();
    let tls = match &config.tls {
        Some(files) => Some(crate::tls::TlsHandle::load(
            files,
            config.id,
            &config.cluster_id,
        )?),
        None if config.insecure_plaintext => {
            tracing::warn!(
                "lockd: TLS is off (no --tls-cert, --tls-key, --peer-ca) and --insecure-plaintext \
                 is given: replication is unauthenticated, and anyone who reaches --listen can \
                 send Raft messages; use only on a trusted network"
            );
            None
        }
        None => {
            tracing::warn!(
                "lockd: TLS is off (no --tls-cert, --tls-key, --peer-ca): replication is \
                 unauthenticated; on this loopback --listen only processes of this user may send \
                 Raft messages (any local process with --insecure-plaintext)"
            );
            None
        }
    };
    let protocols = Arc::new(PeerProtocols::default());
    let dial = PeerDial::new(
        source_ip(&config),
        tls.clone(),
        &config.cluster_id,
        restore.clone(),
        protocols.clone(),
    )?;
    // The members' addresses as the flags name them, trusted by the accept loops from the
    // start; `Members::trust` keeps the set current once Raft knows the membership.
    let member_ips = lockd_service_kit::admission::TrustedSources::new(peer_ips(&config).await);
    // Without TLS and without --insecure-plaintext (so on loopback), the internal services are
    // served to this user's processes only, and the members' ports must be this user's too
    // (`crate::local_peer`).
    let local_peers = LocalPeers::of(
        tls.is_some(),
        config.insecure_plaintext,
        config.admin_own_user_only,
    );
    let mut dial = dial;
    if let LocalPeers::SameUser(uid) = local_peers {
        dial.same_user = Some(uid);
    }
    let members = Members::new(
        config.id,
        &config.peers,
        dial.clone(),
        crate::members::wait_connections_max(config.tuning.waits_max),
    );
    let auth = crate::auth::Auth::load(
        config.auth.as_ref(),
        tls.clone(),
        local_peers,
        members.clone(),
        metrics.clone(),
    )?;
    // After the checks of the files (so their errors come first): a node that lost its disk and
    // names itself alone has nobody to learn its cluster from.
    if rejoin && config.peers.keys().all(|id| *id == config.id) {
        anyhow::bail!(
            "lockd: --data-dir {} is empty and --peer names this node alone: to found a new \
             single-node cluster run `lockd init` on its data dir once before its first start; \
             to bring back a member that \
             lost its disk, list the current members in --peer (`lockctl member list`)",
            config.data_dir.display()
        );
    }
    let raft_log = log_store.clone();
    // A rejoining node starts with elections off; VoteGate::rejoin turns them on (rule 2).
    let raft_config = openraft::Config {
        enable_elect: vote_gate.is_open(),
        ..raft_config
    };
    let raft = Raft::new(
        config.id,
        Arc::new(raft_config),
        Network { dial: dial.clone() },
        log_store,
        state_machine,
    )
    .await
    .map_err(|e| anyhow::anyhow!("starting raft: {e}"))?;

    // Nodes started with the same --peer list form the cluster with no separate init step: a
    // node that started empty proposes the initial membership only once every peer shows the
    // cluster is new (vote_gate), and a node started with --join never does. A data dir that
    // `lockd init` prepared proposes the membership it recorded at once.
    let initial: BTreeMap<NodeId, BasicNode> = config
        .peers
        .iter()
        .map(|(id, addr)| (*id, BasicNode { addr: addr.clone() }))
        .collect();
    if let Some(members) = founding_members
        && !raft.is_initialized().await?
    {
        let founded: BTreeMap<NodeId, BasicNode> = members
            .into_iter()
            .map(|(id, addr)| (id, BasicNode { addr }))
            .collect();
        tracing::info!(members = ?founded.keys().collect::<Vec<_>>(), "lockd: founding the cluster `lockd init` prepared");
        if let Err(e) = raft.initialize(founded).await {
            tracing::info!(error = %e, "initialize skipped");
        }
    }

    let clock = Clock::new();
    let proposer = Proposer::start(raft.clone(), clock.clone(), t.policy(), metrics.clone());
    tokio::spawn(members.clone().follow(raft.clone(), shutdown.clone()));
    tokio::spawn(members.clone().trust(
        config.peers.get(&config.id).cloned(),
        member_ips.clone(),
        shutdown.clone(),
    ));
    tokio::spawn(crate::service::membership::finish_joint_changes(
        raft.clone(),
        shutdown.clone(),
    ));
    let ctx = Arc::new(NodeCtx {
        id: config.id,
        raft: raft.clone(),
        sm,
        proposer,
        waits,
        clock,
        metrics,
        committed,
        members: members.clone(),
        election_timeout_max_ms: millis(t.election_timeout) * 2,
        acks: dial.acks.clone(),
        hub,
        is_leader: tokio::sync::watch::Sender::new(false),
        signer: Default::default(),
        auth: auth.clone(),
        data_dir: config.data_dir.clone(),
        allow_backup_without_policy: config.allow_backup_without_policy,
        protocols: protocols.clone(),
        allow_membership_without_policy: config.allow_membership_without_policy,
        membership_lock: tokio::sync::Mutex::new(()),
        forwarder: crate::forwarder::Forwarder::new(
            members.clone(),
            protocols.clone(),
            shutdown.clone(),
        ),
        reads: {
            let raft = raft.clone();
            crate::read_barrier::ReadBarrier::start(crate::read_barrier::ROUND_TIMEOUT, move || {
                let raft = raft.clone();
                async move {
                    raft.ensure_linearizable()
                        .await
                        .map(drop)
                        .map_err(|e| e.to_string())
                }
            })
        },
        parked: crate::parked::ParkedWaits::new(
            config.tuning.waits_per_source_max,
            config.tuning.waits_max,
            member_ips.clone(),
            tls.is_some(),
        ),
    });

    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| anyhow::anyhow!("binding --listen {}: {e}", config.listen))?;
    if let Some(uid) = local_peers.uid() {
        // The owners of connecting sockets must be readable, or no peer would ever be served:
        // a plaintext loopback node refuses to start without them. `lockd dev --tls` starts
        // anyway (its replicas are certificates' business) and refuses the admin calls, as
        // every call whose owner is not known.
        let bound = listener.local_addr()?;
        let available =
            tokio::task::spawn_blocking(move || crate::local_peer::check_available(bound, uid))
                .await?;
        match (local_peers, available) {
            (LocalPeers::SameUser(_), Err(e)) => anyhow::bail!(e),
            (LocalPeers::SameUser(_), Ok(())) => tracing::info!(
                uid,
                "lockd: plaintext loopback port: the internal services (Raft, forwarding) are \
                 served only to processes of this user"
            ),
            (_, Ok(())) => tracing::info!(
                uid,
                "lockd: admin calls (membership, leader transfer, key rotation, backup) are \
                 served only to processes of this user"
            ),
            (_, Err(e)) => tracing::warn!(
                uid,
                "lockd: admin calls (membership, leader transfer, key rotation, backup) will be \
                 refused to every caller: they are served only to processes of this user, and \
                 the owner of a connection cannot be found here: {e}"
            ),
        }
    }
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    tokio::spawn(watch_leadership(
        ctx.clone(),
        health_reporter,
        shutdown.clone(),
    ));
    tokio::spawn(reap(ctx.clone(), shutdown.clone()));
    if !vote_gate.is_open() {
        let (gate, r, s, d, m) = (
            vote_gate.clone(),
            raft.clone(),
            shutdown.clone(),
            dial.clone(),
            members.clone(),
        );
        let me = config.id;
        tokio::spawn(async move {
            // The memberships the peers report also tell `members` whom to accept replication
            // from before this node has a membership of its own.
            let ask = |targets: Vec<(NodeId, String)>| {
                let (d, m) = (d.clone(), m.clone());
                async move {
                    let reports = crate::raft::network::ask_votes(&d, targets).await;
                    for (_, r) in &reports {
                        if let Some(membership) = &r.membership {
                            m.learn(membership);
                        }
                    }
                    reports
                }
            };
            gate.rejoin(r, me, initial, ask, s).await
        });
    }
    if let Some(addr) = config.metrics_listen {
        let std_listener = std::net::TcpListener::bind(addr)
            .map_err(|e| anyhow::anyhow!("binding --metrics-listen {addr}: {e}"))?;
        drop(std_listener);
        let (c, t, s, p) = (
            ctx.clone(),
            tls.clone(),
            shutdown.clone(),
            member_ips.clone(),
        );
        tokio::spawn(async move {
            if let Err(e) = crate::observe::http::serve(c, addr, t, p, s).await {
                tracing::error!(error = %e, "metrics listener stopped");
            }
        });
    }

    if let Some(tls) = &tls {
        tokio::spawn(reload_on_sighup(config.id, tls.clone(), shutdown.clone()));
    }
    let (reflection_v1, reflection_v1alpha) = reflection()?;
    // One for the internal services (Raft, Forward): one cache of peer certificate checks.
    let peer_auth =
        crate::service::raft::PeerAuth::new(&config, tls.clone(), local_peers, members.clone());
    // What calls to the client-facing services may hold while they arrive (each of them decodes
    // messages of CLIENT_MESSAGE_MAX_BYTES at most, which the budget relies on). With TLS, the
    // internal services (Raft, Forward) refuse a caller that is not a member before reading its
    // body; without TLS on loopback, one whose socket is not this user's; with
    // --insecure-plaintext, anyone who sends the cluster id is read (a trusted-network mode).
    let receiving = crate::receiving::ReceiveBudget::new(member_ips.clone());
    let router = tonic::transport::Server::builder()
        // Bounds what one connection can make this node hold at once.
        .max_concurrent_streams(STREAMS_PER_CONNECTION_MAX)
        // A peer that stops answering (gone, or paused) frees its connection.
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        // Anyone may call these, before any check: their requests are a few bytes, so they get
        // the clients' bound instead of tonic's default of 4 MiB per message.
        .add_service(
            receiving.health(health_service.max_decoding_message_size(CLIENT_MESSAGE_MAX_BYTES)),
        )
        .add_service(
            receiving.reflection(reflection_v1.max_decoding_message_size(CLIENT_MESSAGE_MAX_BYTES)),
        )
        .add_service(
            receiving
                .reflection(reflection_v1alpha.max_decoding_message_size(CLIENT_MESSAGE_MAX_BYTES)),
        )
        // `Lookup`: on a plaintext loopback port, who owns the caller's socket, for the calls
        // only members may make (`crate::local_peer`); the interceptors refuse the others.
        .add_service({
            let auth = auth.clone();
            receiving.unary(Lookup::forwarding_headers(
                local_peers,
                InterceptedService::new(
                    LockServer::new(LockService::new(ctx.clone()))
                        .max_decoding_message_size(CLIENT_MESSAGE_MAX_BYTES),
                    move |req| auth.intercept(req),
                ),
            ))
        })
        .add_service({
            let auth = auth.clone();
            receiving.unary(Lookup::forwarding_headers(
                local_peers,
                InterceptedService::new(
                    ClusterServer::new(ClusterService::new(ctx.clone()))
                        .max_decoding_message_size(CLIENT_MESSAGE_MAX_BYTES),
                    move |req| auth.intercept(req),
                ),
            ))
        })
        .add_service(Lookup::internal(
            local_peers,
            crate::service::forward::ForwardService::server(
                ctx.clone(),
                peer_auth.clone(),
                shutdown.clone(),
            ),
        ))
        .add_service(Lookup::internal(
            local_peers,
            RaftService::server(
                raft.clone(),
                refuse_votes_until,
                vote_gate.clone(),
                raft_log,
                peer_auth,
                restore.clone(),
                protocols.clone(),
            ),
        ));
    let stop = shutdown.clone().cancelled_owned();
    let server: futures::future::BoxFuture<'static, Result<(), tonic::transport::Error>> =
        match &tls {
            // Our own accept loop rather than tonic's TLS: it takes the certificates current at
            // each accept, so a reload on SIGHUP needs no restart.
            Some(tls) => Box::pin(router.serve_with_incoming_shutdown(
                crate::tls::incoming(
                    listener,
                    tls.clone(),
                    crate::tls::NodeTls::grpc_server,
                    crate::connections::slots(member_ips.clone()),
                    member_ips.clone(),
                    shutdown.clone(),
                ),
                stop,
            )),
            // Our own accept loop too: it bounds connections in all and per source, and sets
            // Nagle off (the builder's tcp_nodelay does not reach sockets it did not accept).
            None => Box::pin(router.serve_with_incoming_shutdown(
                crate::connections::plain_incoming(
                    listener,
                    crate::connections::slots(member_ips.clone()),
                    shutdown.clone(),
                ),
                stop,
            )),
        };
    tracing::info!(id = config.id, listen = %config.listen, data_dir = %config.data_dir.display(), "lockd node started");
    let mut raft_metrics = raft.metrics();
    let stop_server = shutdown.clone();
    let done = tokio::spawn(async move {
        // openraft stops its core for good on a storage error (a failed fsync, a full disk):
        // the node can then neither commit nor recover by itself. Exit with the error rather
        // than stay up unable to serve, so a supervisor restarts it from what is durable.
        let core_failed = async move {
            loop {
                if let Err(fatal) = &raft_metrics.borrow().running_state {
                    return fatal.to_string();
                }
                if raft_metrics.changed().await.is_err() {
                    return "the Raft core stopped".to_owned();
                }
            }
        };
        let mut server = server;
        tokio::select! {
            result = &mut server => {
                let _ = raft.shutdown().await;
                result.map_err(|e| anyhow::anyhow!("grpc server: {e}"))
            }
            fatal = core_failed => {
                stop_server.cancel();
                let _ = server.await;
                let _ = raft.shutdown().await;
                Err(anyhow::anyhow!(
                    "Raft stopped on a fatal error: {fatal}; exiting: restart the node once the cause (disk full, I/O errors) is fixed"
                ))
            }
        }
    });
    Ok(RunningNode { _ctx: ctx, done })
}

/// Concurrent gRPC calls one connection may have open (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS).
/// A client needs a few hundred at most (lockd-bench uses 256 per connection); without a bound
/// one connection could open streams until the node runs out of memory.
const STREAMS_PER_CONNECTION_MAX: u32 = 1024;
/// HTTP/2 pings on a connection that has been quiet this long...
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// ...and the connection is closed when a ping is not answered within this.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// Loads the certificates again on every SIGHUP (see `TlsHandle`). lockd dev's three nodes in one
/// process each reload their own.
async fn reload_on_sighup(
    id: NodeId,
    tls: Arc<crate::tls::TlsHandle>,
    shutdown: CancellationToken,
) {
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "lockd: cannot listen for SIGHUP; certificates will not reload");
            return;
        }
    };
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            got = hup.recv() => if got.is_none() { return },
        }
        match tls.reload() {
            Ok(()) => tracing::info!(
                id,
                "lockd: certificates reloaded (SIGHUP); new connections use them"
            ),
            Err(e) => {
                tracing::error!(id, error = %e, "lockd: certificate reload failed; the previous certificates stay in use")
            }
        }
    }
}

/// A duration in whole milliseconds, as openraft's config takes them (saturating: no flag
/// value comes near the limit).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Replicas that snapshot at the same log index encode and write at the same moment, and the
/// commit path feels all of them at once. Each node waits `(id - 1) mod 8` eighths of the
/// interval longer, so their snapshots drift apart.
fn staggered_snapshot_every(every: u64, id: NodeId) -> u64 {
    every + every * ((id.saturating_sub(1)) % 8) / 8
}

/// The `--peer` addresses' IPs, resolved one name at a time: what the accept loops trust (never
/// turn away for their number of connections or handshakes: `connections.rs`, `tls.rs`) until
/// [`crate::members::Members::trust`] keeps that set at the current members' addresses. A name
/// that does not resolve yet is only warned about (its node may not exist yet, as with a
/// StatefulSet's pods), since every connect to it, and `trust` every few seconds, resolve it
/// again. A member that reaches this node through NAT counts like any client: replication
/// works, unless a flood from many addresses fills every place (16,384 connections) while it
/// reconnects.
async fn peer_ips(config: &NodeConfig) -> Vec<std::net::IpAddr> {
    let mut ips = Vec::new();
    for (id, addr) in &config.peers {
        match crate::members::resolve(addr).await {
            Ok(found) if found.is_empty() => {
                tracing::warn!(peer = id, address = %addr, "--peer {id}={addr} resolves to no address yet; retrying on every connect");
            }
            Ok(found) => ips.extend(found),
            Err(e) => {
                tracing::warn!(peer = id, address = %addr, error = %e, "--peer {id}={addr} does not resolve yet; retrying on every connect")
            }
        }
    }
    ips
}

/// The listen IP as the source of connections to peers, unless it is a wildcard.
fn source_ip(config: &NodeConfig) -> Option<std::net::IpAddr> {
    let ip = config.listen.ip();
    (!ip.is_unspecified()).then_some(ip)
}

/// gRPC server reflection (both protocol versions: grpcurl asks for v1, older tools for v1alpha)
/// of the public services, `lockd.v1` and `grpc.health.v1`. The internal Raft service is not
/// listed: it is for members only. Reflection reveals only the schema, which is public, so it
/// is served without authorization, like health.
#[allow(
    clippy::type_complexity,
    reason = "the two generated server types, named once here"
)]
fn reflection() -> anyhow::Result<(
    tonic_reflection::server::v1::ServerReflectionServer<
        impl tonic_reflection::server::v1::ServerReflection,
    >,
    tonic_reflection::server::v1alpha::ServerReflectionServer<
        impl tonic_reflection::server::v1alpha::ServerReflection,
    >,
)> {
    let builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(lockd_api::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    Ok((
        builder()
            .build_v1()
            .map_err(|e| anyhow::anyhow!("lockd: building gRPC reflection: {e}"))?,
        builder()
            .build_v1alpha()
            .map_err(|e| anyhow::anyhow!("lockd: building gRPC reflection: {e}"))?,
    ))
}

/// Keeps leader gauges, the leader-change counter and the gRPC health status current.
async fn watch_leadership(
    ctx: Arc<NodeCtx>,
    health: tonic_health::server::HealthReporter,
    shutdown: CancellationToken,
) {
    let mut rx = ctx.raft.metrics();
    let mut last_leader = None;
    let mut ticker = tokio::time::interval(Duration::from_millis(250));
    loop {
        // Role changes are handled at once; gauges and health, which cost a lock and an await,
        // only on the ticker rather than on every commit.
        let tick = tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = rx.changed() => if changed.is_err() { return } else { false },
            _ = ticker.tick() => true,
        };
        let (leader, state) = {
            let m = rx.borrow();
            (m.current_leader, m.state)
        };
        ctx.is_leader.send_if_modified(|v| {
            let now = state == ServerState::Leader;
            std::mem::replace(v, now) != now
        });
        if leader != last_leader {
            if leader.is_some() {
                ctx.metrics
                    .with(|| metrics::counter!("lockd_leader_changes_total").increment(1));
                tracing::info!(leader = ?leader, "leader changed");
            }
            last_leader = leader;
        }
        if !tick {
            continue;
        }
        ctx.refresh_gauges();
        let status = if ctx.readiness().is_ok() {
            tonic_health::ServingStatus::Serving
        } else {
            tonic_health::ServingStatus::NotServing
        };
        health.set_service_status("lockd.v1.Lock", status).await;
        health.set_service_status("", status).await;
    }
}

/// On the leader, commits the sequencer signing key if the cluster has none, and proposes `Reap` for every resource whose lease or waiter is due by the
/// table's clock as this leader computes it (the anchor plus its own monotonic time since). Expiry
/// is thus decided by the leader and committed through the log; apply checks the time again
/// against the batch stamp. A leader whose stamps do not drive the table's clock yet (just
/// elected, or restarted in the same term) first commits an empty batch, so expiry never waits for
/// client traffic.
async fn reap(ctx: Arc<NodeCtx>, shutdown: CancellationToken) {
    let mut ticker = tokio::time::interval(REAP_INTERVAL);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        if ctx.raft.metrics().borrow().state != ServerState::Leader {
            continue;
        }
        let due = {
            let sm = ctx.sm.read().expect("state lock");
            sm.table
                .clock_now(ctx.clock.session(), ctx.clock.mono_ms())
                .map(|now| sm.table.due(now, REAP_BATCH_MAX))
        };
        let Some(due) = due else {
            if let Err(e) = ctx.proposer.anchor_clock().await {
                tracing::debug!(error = %e, "clock anchor proposal failed");
            }
            continue;
        };
        // Right after the clock anchor, a leader of a cluster without a sequencer key commits
        // one (see `signing`); Acquires granted meanwhile wait for it.
        if let Err(e) = crate::signing::ensure_key(&ctx.sm, &ctx.proposer).await {
            tracing::debug!(error = %e, "signing key proposal failed");
        }
        if due.is_empty() {
            continue;
        }
        let unique: BTreeSet<_> = due.into_iter().collect();
        let proposals = unique
            .into_iter()
            .map(|resource| ctx.proposer.propose(Command::Reap { resource }));
        for result in futures::future::join_all(proposals).await {
            if let Err(e) = result {
                tracing::debug!(error = %e, "reap proposal failed");
            }
        }
    }
}

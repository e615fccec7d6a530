//! Three `lockd` processes wired through fault-injecting relays, plus the processes and targets a
//! chaos run needs around them.
//!
//! Addresses, on one random `127.A.B.0/24` per run:
//! - node i listens on `127.A.B.(10+i):7001` (clients and replication) and binds its outgoing peer
//!   connections to that IP, so relays can tell callers apart;
//! - its peers reach it through the relay `127.A.B.(20+i):7001` (its `--peer` address), which can
//!   blackhole chosen callers: that is how partitions are made;
//! - clients may reach it through `127.A.B.(30+i):7001`, a relay that can drop replies after the
//!   node received (and committed) the request.
//!
//! With `--netns` ([`super::netns`]) node i runs in a network namespace of its own and listens on
//! `10.213.S.(10+i):7001`; peers reach it there directly (no peer relay: partitions are made in
//! the kernel), and the client relays on `127.A.B.(30+i)` forward to that address.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockd_api::v1::StatusRequest;
use lockd_api::v1::cluster_client::ClusterClient;
use nix::sys::signal::Signal;
use tonic::transport::Channel;

use super::clock::{FakeClocks, remove_shm_of};
use super::history::History;
use super::netem::NetemSpec;
use super::netns::Netns;
use super::relay::Relay;
use crate::process::{ChildGuard, bin_path, command, random_loopback_ip};

pub const NODES: u64 = 3;
const PORT: u16 = 7001;
/// Where each node serves /metrics, on its own namespace address.
pub const METRICS_PORT: u16 = 9101;
/// How long a node may take to stop after SIGTERM before it is killed.
const STOP_WAIT: Duration = Duration::from_secs(5);
/// Audit files are never rotated during a run (the checker reads one file per node).
const AUDIT_MAX_BYTES: u64 = 1 << 30;
/// How many `127.A.B` networks a start tries when a relay cannot bind (its address is taken by
/// another process's run).
const NET_ATTEMPTS: usize = 8;

/// The `127.A.B` networks of the clusters running in this process: runs going on at once
/// (`chaos --jobs`) never draw the same one. Every address and fixed port of a run (nodes, relays,
/// metrics, the proxies, the register) is on its own network, so this is what keeps them apart.
static NETS_IN_USE: Mutex<BTreeSet<[u8; 3]>> = Mutex::new(BTreeSet::new());

/// A network no other cluster of this process uses, reserved until [`release_net`].
fn reserve_net() -> [u8; 3] {
    let mut used = NETS_IN_USE.lock().unwrap();
    loop {
        let base = random_loopback_ip().octets();
        let net = [127, base[1], base[2]];
        if used.insert(net) {
            return net;
        }
    }
}

fn release_net(net: [u8; 3]) {
    NETS_IN_USE.lock().unwrap().remove(&net);
}

/// Raft timings of a chaos cluster.
#[derive(Clone, Debug)]
pub struct Timings {
    pub heartbeat_ms: u64,
    pub election_timeout_ms: u64,
    /// Small, so snapshots and log purges happen during a run.
    pub snapshot_every: u64,
    pub logs_kept_after_snapshot: u64,
}

impl Default for Timings {
    fn default() -> Self {
        Timings {
            heartbeat_ms: 100,
            election_timeout_ms: 600,
            snapshot_every: 500,
            logs_kept_after_snapshot: 100,
        }
    }
}

impl Timings {
    /// For runs with composed faults: a snapshot every 50 log entries with 20 kept behind it, so
    /// that a node that was down or wiped for a second needs a snapshot to catch up.
    pub fn frequent_snapshots() -> Timings {
        Timings {
            snapshot_every: 50,
            logs_kept_after_snapshot: 20,
            ..Timings::default()
        }
    }
}

pub struct ChaosCluster {
    /// The `127.A.B` prefix of this run.
    pub net: [u8; 3],
    pub timings: Timings,
    pub dir: PathBuf,
    nodes: Vec<Option<ChildGuard>>,
    /// Clock offset each node was last started with (`LOCKD_TEST_CLOCK_OFFSET_MS`).
    pub clock_offsets_ms: Vec<i64>,
    /// Nodes currently stopped with SIGSTOP.
    paused: Vec<bool>,
    /// Nodes currently cut off from their peers by the relays.
    isolated: Vec<bool>,
    /// Nodes whose data dir was deleted and that may not have caught up yet (they cannot vote
    /// until they have); counted out of any quorum until the fault is healed, conservatively.
    wiped: Vec<bool>,
    /// A network fault is in place under which this harness does not claim that Raft can make
    /// progress (one-way and bridge cuts, see [`ChaosCluster::set_quorum_uncertain`]): counted as
    /// a no-quorum window, conservatively.
    quorum_uncertain: bool,
    /// Since when (history ms) two or more nodes have been out (down, paused, isolated, wiped):
    /// with three nodes, no quorum can exist then.
    no_quorum_since: Option<u64>,
    /// Off while the cluster starts (nodes come up one by one), on from then on.
    tracking: bool,
    /// The closed windows (history ms, start and end) in which no quorum could exist.
    pub no_quorum: Vec<(u64, u64)>,
    /// With clock faults: the nodes' faked clocks.
    clocks: Option<Arc<FakeClocks>>,
    /// Where the cluster notes what it did to clocks and quorum (the run's history).
    history: History,
    peer_relays: Vec<Relay>,
    client_relays: Vec<Relay>,
    /// With `--tls`: the peer CA (PEM) clients trust, and each node's certificate files.
    tls: Option<(Vec<u8>, PathBuf, Vec<crate::tls::Issued>)>,
    /// With `--netns`: the nodes' namespaces, where partitions and impairments are made.
    netns: Option<Netns>,
}

/// A lazily connecting client channel: plaintext, or TLS trusting `ca` (PEM).
pub fn client_channel(addr: SocketAddr, ca: Option<&[u8]>) -> Channel {
    let Some(ca) = ca else {
        return Channel::from_shared(format!("http://{addr}"))
            .expect("valid uri")
            .connect_timeout(Duration::from_millis(500))
            .connect_lazy();
    };
    Channel::from_shared(format!("https://{addr}"))
        .expect("valid uri")
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(ca)),
        )
        .expect("TLS settings")
        .connect_timeout(Duration::from_millis(500))
        .connect_lazy()
}

/// TLS runs also enforce an authorization policy, so that the paths it adds run under the faults:
/// every Acquire's request id is scoped to the caller's identity in the dedup window, and a
/// follower forwards the identity, which the leader accepts only from a node certificate and
/// authorizes again. The workload calls without a client certificate, as `anonymous`.
const TLS_POLICY: &str = r#"
[[grant]]
identities = ["anonymous"]
resources = ["*"]
operations = ["acquire", "renew", "release", "describe", "status"]
"#;
const POLICY_FILE: &str = "policy.toml";

/// The `--cluster-id` of TLS runs (also in the node certificates' names).
const TLS_CLUSTER_ID: &str = "chaos";

fn ip(net: [u8; 3], last: u8) -> Ipv4Addr {
    Ipv4Addr::new(net[0], net[1], net[2], last)
}

impl ChaosCluster {
    /// Starts relays and nodes in `dir` (kept by the caller) and waits for a leader; with `tls`,
    /// the nodes run with certificates of a CA made for the run (naming each node's own, peer
    /// relay and client relay addresses).
    ///
    /// With `clocks`, every node runs with libfaketime preloaded (see [`super::clock`]); quorum
    /// windows and clock draws are noted in `history`. With `netns`, each node runs in a network
    /// namespace of its own (see [`super::netns`]).
    pub async fn start(
        dir: PathBuf,
        timings: Timings,
        tls: bool,
        clocks: Option<Arc<FakeClocks>>,
        history: History,
        netns: bool,
    ) -> anyhow::Result<ChaosCluster> {
        anyhow::ensure!(
            !(netns && clocks.is_some()),
            "--netns does not go with clock faults (libfaketime would be preloaded into `ip` too)"
        );
        if netns {
            super::netns::available().map_err(|e| anyhow::anyhow!("--netns: {e}"))?;
        }
        let mut attempt = 0;
        let mut c = loop {
            attempt += 1;
            let mut c = ChaosCluster {
                net: reserve_net(),
                timings: timings.clone(),
                dir: dir.clone(),
                nodes: (0..NODES).map(|_| None).collect(),
                clock_offsets_ms: vec![0; NODES as usize],
                paused: vec![false; NODES as usize],
                isolated: vec![false; NODES as usize],
                wiped: vec![false; NODES as usize],
                quorum_uncertain: false,
                no_quorum_since: None,
                tracking: false,
                no_quorum: Vec::new(),
                clocks: clocks.clone(),
                history: history.clone(),
                peer_relays: Vec::new(),
                client_relays: Vec::new(),
                tls: None,
                netns: None,
            };
            if netns {
                // Dropping `c` on error removes what was made.
                c.netns = Some(Netns::create(NODES)?);
            }
            match c.start_relays().await {
                Ok(()) => break c,
                // Dropping `c` releases its network and closes the relays it did bind.
                Err(e) if attempt >= NET_ATTEMPTS => return Err(e),
                Err(_) => continue,
            }
        };
        if tls {
            let ca = crate::tls::TestCa::new(&c.dir, "peer")?;
            let mut nodes = Vec::new();
            for id in 1..=NODES {
                let ips = [
                    c.addr(id).ip(),
                    c.peer_addr(id).ip(),
                    c.client_relay_addr(id).ip(),
                ];
                nodes.push(ca.issue(
                    &format!("node{id}"),
                    &[format!("node-{id}.{TLS_CLUSTER_ID}.lockd")],
                    &ips,
                )?);
            }
            c.tls = Some((std::fs::read(&ca.cert_path)?, ca.cert_path.clone(), nodes));
            std::fs::write(c.dir.join(POLICY_FILE), TLS_POLICY)?;
        }
        for id in 1..=NODES {
            c.start_node(id, 0)?;
        }
        c.tracking = true;
        c.wait_for_leader(Duration::from_secs(30)).await?;
        Ok(c)
    }

    async fn start_relays(&mut self) -> anyhow::Result<()> {
        for id in 1..=NODES {
            if self.netns.is_none() {
                self.peer_relays
                    .push(Relay::start(self.peer_addr(id), self.addr(id)).await?);
            }
            self.client_relays
                .push(Relay::start(self.client_relay_addr(id), self.addr(id)).await?);
        }
        Ok(())
    }

    pub fn node_ip(&self, id: u64) -> Ipv4Addr {
        match &self.netns {
            Some(n) => n.host_ip(id),
            None => ip(self.net, 10 + id as u8),
        }
    }

    /// The node's own listen address (clients connect here directly).
    pub fn addr(&self, id: u64) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(self.node_ip(id)), PORT)
    }

    /// The address peers use for node `id`: its partition relay (with `--netns`, its own address).
    pub fn peer_addr(&self, id: u64) -> SocketAddr {
        if self.netns.is_some() {
            return self.addr(id);
        }
        SocketAddr::new(IpAddr::V4(ip(self.net, 20 + id as u8)), PORT)
    }

    /// The reply-dropping relay in front of node `id`, for clients.
    pub fn client_relay_addr(&self, id: u64) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(ip(self.net, 30 + id as u8)), PORT)
    }

    /// An address on this run's network for the harness's own servers.
    pub fn harness_ip(&self) -> IpAddr {
        IpAddr::V4(ip(self.net, 50))
    }

    pub fn audit_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("node{id}.audit.log"))
    }

    /// Starts (or restarts) node `id` with its data dir as it is and the given clock offset.
    pub fn start_node(&mut self, id: u64, clock_offset_ms: i64) -> anyhow::Result<()> {
        let t = &self.timings;
        let mut cmd: Command = match &self.netns {
            Some(n) => n.command(id, &bin_path("lockd")),
            None => command("lockd"),
        };
        cmd.arg("--id")
            .arg(id.to_string())
            .arg("--listen")
            .arg(self.addr(id).to_string())
            .arg("--data-dir")
            .arg(self.dir.join(format!("node{id}")))
            .arg("--metrics-listen")
            .arg(SocketAddr::new(IpAddr::V4(self.node_ip(id)), METRICS_PORT).to_string())
            .arg("--heartbeat")
            .arg(format!("{}ms", t.heartbeat_ms))
            .arg("--election-timeout")
            .arg(format!("{}ms", t.election_timeout_ms))
            .arg("--snapshot-every")
            .arg(t.snapshot_every.to_string())
            .arg("--logs-kept-after-snapshot")
            .arg(t.logs_kept_after_snapshot.to_string())
            .arg("--audit-log")
            .arg(self.audit_path(id))
            .arg("--audit-log-max-bytes")
            .arg(AUDIT_MAX_BYTES.to_string())
            .arg("--audit-key-file")
            .arg(crate::audit::write_key_file(&self.dir)?);
        for peer in 1..=NODES {
            cmd.arg("--peer")
                .arg(format!("{peer}={}", self.peer_addr(peer)));
        }
        if self.netns.is_some() && self.tls.is_none() {
            // lockd refuses plaintext on a non-loopback address unless told; the namespaces'
            // subnet is private to this run (only the harness reaches it).
            cmd.arg("--insecure-plaintext");
        }
        if let Some((_, ca, nodes)) = &self.tls {
            let node = &nodes[id as usize - 1];
            cmd.arg("--cluster-id")
                .arg(TLS_CLUSTER_ID)
                .arg("--tls-cert")
                .arg(&node.cert)
                .arg("--tls-key")
                .arg(&node.key)
                .arg("--peer-ca")
                .arg(ca)
                .arg("--auth-policy")
                .arg(self.dir.join(POLICY_FILE));
        }
        cmd.env("LOCKD_TEST_CLOCK_OFFSET_MS", clock_offset_ms.to_string());
        if let Some(clocks) = &self.clocks
            && let Some(rate) = clocks.before_start(id, &mut cmd)?
        {
            self.history.note(
                "nemesis",
                format!(
                    "node {id} starts with its clocks at {}.{:02} % of real time",
                    rate / 100,
                    rate % 100
                ),
            );
        }
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "error,openraft=off");
        }
        // One log per node in the artifacts (runs going on at once would interleave on stderr).
        let log = log_file(&self.dir, &format!("node{id}.log"))?;
        cmd.stdout(log.try_clone()?).stderr(log);
        self.clock_offsets_ms[id as usize - 1] = clock_offset_ms;
        self.paused[id as usize - 1] = false;
        self.nodes[id as usize - 1] = Some(ChildGuard::spawn(format!("lockd-{id}"), cmd)?);
        self.track_quorum();
        Ok(())
    }

    /// Whether node `id` counts towards a quorum now.
    fn counts(&self, id: u64) -> bool {
        let i = id as usize - 1;
        self.is_up(id) && !self.paused[i] && !self.isolated[i] && !self.wiped[i]
    }

    /// Marks (or unmarks) a network fault under which a quorum is connected but Raft may still
    /// make no progress, so the availability check is not told a quorum could work. Two such
    /// faults exist. A one-way cut: over TCP it becomes a cut of the pair for every new
    /// connection (a handshake needs both directions), but bytes on connections opened before it
    /// still arrive one way, so a leader that no longer hears its followers can go on resetting
    /// their election timers with heartbeats it never gets acknowledged, and nobody commits
    /// until those connections die. A bridge partition: the connected pairs include a quorum, but
    /// openraft 0.9 has no pre-vote; whether the node cut from the leader disrupts it with ever
    /// higher terms depends on the leader lease the bridge node holds, timing we do not claim.
    /// Safety is checked under both as under any fault; only liveness is not claimed.
    pub fn set_quorum_uncertain(&mut self, on: bool) {
        self.quorum_uncertain = on;
        self.track_quorum();
    }

    /// Opens or closes a no-quorum window after a change of some node's state.
    fn track_quorum(&mut self) {
        if !self.tracking {
            return;
        }
        let out = (1..=NODES).filter(|id| !self.counts(*id)).count() as u64;
        let now = self.history.now_ms();
        match (
            out * 2 >= NODES || self.quorum_uncertain,
            self.no_quorum_since,
        ) {
            (true, None) => {
                self.no_quorum_since = Some(now);
                let why = if out * 2 >= NODES {
                    format!("{out} nodes out")
                } else {
                    "a one-way or bridge cut: progress not claimed".into()
                };
                self.history
                    .note("nemesis", format!("no quorum possible ({why})"));
            }
            (false, Some(since)) => {
                self.no_quorum.push((since, now));
                self.no_quorum_since = None;
                self.history.note("nemesis", "a quorum is possible again");
            }
            _ => {}
        }
    }

    /// The no-quorum windows, the one still open (if any) closed at `now`.
    pub fn no_quorum_windows(&self) -> Vec<(u64, u64)> {
        let mut w = self.no_quorum.clone();
        if let Some(since) = self.no_quorum_since {
            w.push((since, self.history.now_ms()));
        }
        w
    }

    /// Kills a node's process (SIGKILL, reaped) and removes what libfaketime left behind for it.
    fn kill_process(&mut self, id: u64) {
        if let Some(mut n) = self.nodes[id as usize - 1].take() {
            let pid = n.pid();
            n.kill();
            if let (Some(pid), Some(_)) = (pid, &self.clocks) {
                remove_shm_of(pid);
            }
        }
    }

    /// Kills node `id` and deletes its data dir (its audit log, outside it, stays for the
    /// checker): the next start is empty, as after a lost disk.
    pub fn wipe(&mut self, id: u64) -> anyhow::Result<()> {
        self.wiped[id as usize - 1] = true;
        self.kill(id);
        let dir = self.dir.join(format!("node{id}"));
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .map_err(|e| anyhow::anyhow!("wiping {}: {e}", dir.display()))?;
        }
        Ok(())
    }

    /// kill -9.
    pub fn kill(&mut self, id: u64) {
        self.kill_process(id);
        self.paused[id as usize - 1] = false;
        self.track_quorum();
    }

    pub fn is_up(&self, id: u64) -> bool {
        self.nodes[id as usize - 1].is_some()
    }

    pub fn pause(&mut self, id: u64) {
        if let Some(n) = &self.nodes[id as usize - 1] {
            n.signal(Signal::SIGSTOP);
            self.paused[id as usize - 1] = true;
        }
        self.track_quorum();
    }

    pub fn resume(&mut self, id: u64) {
        if let Some(n) = &self.nodes[id as usize - 1] {
            n.signal(Signal::SIGCONT);
        }
        self.paused[id as usize - 1] = false;
        self.track_quorum();
    }

    /// Cuts node `id` off from both peers, both directions.
    pub fn isolate(&mut self, id: u64) -> anyhow::Result<()> {
        if let Some(n) = &mut self.netns {
            n.isolate(id)?;
            self.isolated[id as usize - 1] = true;
            self.track_quorum();
            return Ok(());
        }
        for other in 1..=NODES {
            if other != id {
                self.peer_relays[other as usize - 1].block(IpAddr::V4(self.node_ip(id)));
                self.peer_relays[id as usize - 1].block(IpAddr::V4(self.node_ip(other)));
            }
        }
        self.isolated[id as usize - 1] = true;
        self.track_quorum();
        Ok(())
    }

    /// The namespaces, for the faults only they can make (`None` without `--netns`).
    fn netns_mut(&mut self) -> anyhow::Result<&mut Netns> {
        self.netns
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("this fault needs --netns"))
    }

    /// Packets from node `from` no longer arrive at node `to` (the other way they still do).
    pub fn cut_one_way(&mut self, from: u64, to: u64) -> anyhow::Result<()> {
        self.netns_mut()?.cut(from, to)?;
        self.set_quorum_uncertain(true);
        Ok(())
    }

    /// The two nodes other than `bridge` stop hearing each other; `bridge` hears both.
    pub fn bridge_partition(&mut self, bridge: u64) -> anyhow::Result<()> {
        let (a, b) = match bridge {
            1 => (2, 3),
            2 => (1, 3),
            _ => (1, 2),
        };
        let n = self.netns_mut()?;
        n.cut(a, b)?;
        n.cut(b, a)?;
        self.set_quorum_uncertain(true);
        Ok(())
    }

    /// The harness's packets no longer arrive at node `id`; its peers still reach it (a quorum
    /// stays: clients go to the other nodes).
    pub fn cut_client(&mut self, id: u64) -> anyhow::Result<()> {
        self.netns_mut()?.cut(0, id)
    }

    /// Loss, delay and reordering on node `id`'s link, both directions. Its peers still form a
    /// quorum without it, so this is not a no-quorum window.
    pub fn impair(&mut self, id: u64, spec: NetemSpec) -> anyhow::Result<()> {
        self.netns_mut()?.impair(id, spec)
    }

    pub fn drop_replies(&self, id: u64, on: bool) {
        self.client_relays[id as usize - 1].set_drop_replies(on);
    }

    pub fn heal_network(&mut self) -> anyhow::Result<()> {
        for r in self.peer_relays.iter().chain(&self.client_relays) {
            r.heal();
        }
        let healed = match &mut self.netns {
            Some(n) => n.heal(),
            None => Ok(()),
        };
        self.isolated.iter_mut().for_each(|i| *i = false);
        self.quorum_uncertain = false;
        self.track_quorum();
        healed
    }

    /// Lifts every fault: network healed, paused nodes resumed, stopped nodes restarted with the
    /// clock offset they last had; wiped nodes count again (they have had the fault's time to
    /// catch up).
    pub fn heal_all(&mut self) -> anyhow::Result<()> {
        self.wiped.iter_mut().for_each(|w| *w = false);
        self.heal_network()?;
        for id in 1..=NODES {
            if self.paused[id as usize - 1] {
                self.resume(id);
            }
            if !self.is_up(id) {
                self.start_node(id, self.clock_offsets_ms[id as usize - 1])?;
            }
        }
        Ok(())
    }

    /// The CA clients trust, with `--tls`.
    pub fn client_ca(&self) -> Option<Vec<u8>> {
        self.tls.as_ref().map(|(pem, _, _)| pem.clone())
    }

    pub async fn status(&self, id: u64) -> anyhow::Result<lockd_api::v1::StatusResponse> {
        let ch = client_channel(
            self.addr(id),
            self.tls.as_ref().map(|(pem, _, _)| pem.as_slice()),
        );
        let mut c = ClusterClient::new(ch);
        let r = tokio::time::timeout(Duration::from_secs(1), c.status(StatusRequest {})).await??;
        Ok(r.into_inner())
    }

    /// The node that says it is leader, among running, unpaused nodes (`None` if none does).
    pub async fn current_leader(&self) -> Option<u64> {
        for id in 1..=NODES {
            if !self.is_up(id) || self.paused[id as usize - 1] {
                continue;
            }
            if let Ok(s) = self.status(id).await
                && s.role == "leader"
                && s.leader_id == id
            {
                return Some(id);
            }
        }
        None
    }

    /// Waits until every running node names the same running leader.
    pub async fn wait_for_leader(&self, within: Duration) -> anyhow::Result<u64> {
        let deadline = Instant::now() + within;
        loop {
            let mut seen = Vec::new();
            for id in 1..=NODES {
                if self.is_up(id) {
                    seen.push(self.status(id).await.map(|s| s.leader_id).unwrap_or(0));
                }
            }
            if !seen.is_empty() && seen[0] != 0 && seen.iter().all(|l| *l == seen[0]) {
                return Ok(seen[0]);
            }
            if Instant::now() > deadline {
                anyhow::bail!("no agreed leader within {within:?} (nodes name {seen:?})");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every node has applied the leader's commit index.
    pub async fn wait_converged(&self, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let mut applied = Vec::new();
            let mut commit = 0;
            for id in 1..=NODES {
                match self.status(id).await {
                    Ok(s) => {
                        commit = commit.max(s.commit_index);
                        applied.push(s.applied_index);
                    }
                    Err(_) => applied.push(0),
                }
            }
            if commit > 0 && applied.iter().all(|a| *a >= commit) {
                return Ok(());
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "nodes did not converge within {within:?}: applied {applied:?}, commit {commit}"
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops every node with SIGTERM (so audit lines are flushed), SIGKILL after a grace period.
    pub fn stop_all(&mut self) {
        for id in 1..=NODES {
            if let Some(n) = &self.nodes[id as usize - 1] {
                n.signal(Signal::SIGCONT);
                n.signal(Signal::SIGTERM);
            }
        }
        let deadline = Instant::now() + STOP_WAIT;
        for id in 1..=NODES {
            if let Some(n) = &mut self.nodes[id as usize - 1] {
                while n.try_wait().is_none() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            self.kill_process(id);
        }
    }
}

impl Drop for ChaosCluster {
    fn drop(&mut self) {
        // The nodes (ChildGuard) and relays stop themselves when dropped; the network is free
        // once they have.
        for id in 1..=NODES {
            self.kill_process(id);
        }
        self.peer_relays.clear();
        self.client_relays.clear();
        // After the nodes: a namespace lives on while a process is in it.
        self.netns = None;
        release_net(self.net);
    }
}

/// A log file in `dir`, appended to (a restarted node continues its log).
fn log_file(dir: &std::path::Path, name: &str) -> anyhow::Result<std::fs::File> {
    let path = dir.join(name);
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| anyhow::anyhow!("opening {}: {e}", path.display()))
}

/// `fence-proxy http` in front of `upstream`, with its redb epoch store in `dir`.
pub fn start_http_proxy(
    listen: SocketAddr,
    upstream: SocketAddr,
    dir: &std::path::Path,
) -> anyhow::Result<ChildGuard> {
    let mut cmd = command("fence-proxy");
    cmd.arg("http")
        .arg("--listen")
        .arg(listen.to_string())
        .arg("--upstream")
        .arg(format!("http://{upstream}"))
        .arg("--store")
        .arg(format!("redb:{}", dir.join("epochs.redb").display()))
        .arg("--upstream-timeout")
        .arg("3s");
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "error");
    }
    let log = log_file(dir, "fence-proxy-http.log")?;
    cmd.stdout(log.try_clone()?).stderr(log);
    let guard = ChildGuard::spawn("fence-proxy-http", cmd)?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect_timeout(&listen, Duration::from_millis(200)).is_err() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "fence-proxy http did not listen on {listen} within 20 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(guard)
}

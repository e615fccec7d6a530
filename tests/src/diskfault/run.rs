//! One disk-fault run: three lockd nodes, each on its own [`DiskFaultMount`], a lock workload
//! that records every grant a client saw acknowledged, a seeded schedule of one scenario's fault,
//! then recovery and the checks.
//!
//! The property: after a node loses power (kill -9, then every unsynced write dropped), it either
//! recovers with every acknowledged entry or refuses to start with a clear error; the cluster
//! never forgets an acknowledged grant. A failed fsync stops the node (it must not go on as if
//! the write were durable); a full disk gives a clear error and corrupts nothing.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{AcquireRequest, ReleaseRequest, StatusRequest, StatusResponse};
use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tonic::Code;
use tonic::transport::Channel;

use super::{DiskFaultMount, PowerLoss, Stats};
use crate::chaos::checker::{AuditLine, merge_audit};
use crate::process::{ChildGuard, command, random_loopback_ip};

const NODES: u64 = 3;
/// Client port of node i is `PORT_BASE + i` on the run's loopback address.
const PORT_BASE: u16 = 7600;
/// Lease ttl of the workload: long enough that a grant is not lost to expiry mid-round.
const TTL_MS: u64 = 2_000;
/// One attempt of a call; then the same request id goes to the next node.
const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(1_500);
/// How long a worker retries one acquire before its outcome counts as unknown.
const ACQUIRE_DEADLINE: Duration = Duration::from_secs(6);
/// How long recovery may take: leader election after restarts, catch-up, final grants.
const RECOVERY_BOUND: Duration = Duration::from_secs(40);
/// How long a node that lost power may take to start serving again or exit (refuse).
const RESTART_BOUND: Duration = Duration::from_secs(15);
/// After an injected fsync failure: how long the node has to stop committing.
const FSYNC_STOP_BOUND: Duration = Duration::from_secs(4);
/// Snapshots every few hundred entries, so snapshot files, renames and directory fsyncs
/// happen within a short run.
const SNAPSHOT_EVERY: u64 = 300;

/// The fault a run injects (each run repeats it `cycles` times).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Scenario {
    /// A follower loses power under load.
    FollowerPowerLoss,
    /// The leader loses power under load.
    LeaderPowerLoss,
    /// Two nodes (drawn at random, the leader among them or not) lose power at once.
    TwoNodesPowerLoss,
    /// The leader's next fsync of its log fails with EIO; then it loses power and restarts.
    LeaderFsyncEio,
    /// A follower's disk is full for a while (ENOSPC); then it is killed and restarted.
    FollowerEnospc,
}

impl Scenario {
    pub const ALL: [Scenario; 5] = [
        Scenario::FollowerPowerLoss,
        Scenario::LeaderPowerLoss,
        Scenario::TwoNodesPowerLoss,
        Scenario::LeaderFsyncEio,
        Scenario::FollowerEnospc,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::FollowerPowerLoss => "follower-power-loss",
            Scenario::LeaderPowerLoss => "leader-power-loss",
            Scenario::TwoNodesPowerLoss => "two-nodes-power-loss",
            Scenario::LeaderFsyncEio => "leader-fsync-eio",
            Scenario::FollowerEnospc => "follower-enospc",
        }
    }

    pub fn parse(s: &str) -> anyhow::Result<Scenario> {
        Scenario::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "unknown scenario {s:?}: expected one of {}",
                    Scenario::ALL.map(|k| k.name()).join(", ")
                )
            })
    }
}

#[derive(Clone, Debug)]
pub struct Options {
    pub seed: u64,
    pub scenario: Scenario,
    /// How many times the fault is injected in the run.
    pub cycles: u32,
    /// Concurrent workers of the lock workload.
    pub workers: usize,
    pub resources: usize,
    /// The chance that a power loss tears the last unsynced write of a file.
    pub tear: f64,
    /// Deliberately broken disk: from the first fault cycle on, fsync persists nothing.
    pub broken_no_fsync: bool,
    /// The run's folder: mounts, backing dirs, node logs, audit logs.
    pub dir: PathBuf,
}

impl Options {
    pub fn new(seed: u64, scenario: Scenario, dir: PathBuf) -> Options {
        Options {
            seed,
            scenario,
            cycles: 2,
            workers: 4,
            resources: 3,
            tear: 0.5,
            broken_no_fsync: false,
            dir,
        }
    }
}

/// What a run saw; `violations` empty means it kept the property.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Report {
    pub seed: u64,
    pub scenario: String,
    pub broken_no_fsync: bool,
    pub grants_acked: usize,
    pub acquires_unknown: usize,
    pub power_losses: Vec<(u64, PowerLoss)>,
    /// Nodes that refused to start after a fault, with the end of their log.
    pub refused: Vec<(u64, String)>,
    /// What the run observed, in order (faults, how nodes reacted).
    pub notes: Vec<String>,
    pub violations: Vec<String>,
    pub disk_stats: Vec<(u64, Stats)>,
    pub elapsed_ms: u64,
}

/// An acquire a client saw granted.
#[derive(Clone, Debug)]
struct Grant {
    resource: String,
    request_id: String,
    token: u64,
    invoke_ms: u64,
    ack_ms: u64,
}

/// The three lockd processes, each with its data dir on a FUSE mount.
struct Nodes {
    ip: Ipv4Addr,
    dir: PathBuf,
    procs: Vec<Option<ChildGuard>>,
    mounts: Vec<DiskFaultMount>,
    channels: Vec<Channel>,
    audit_key: PathBuf,
}

impl Nodes {
    fn addr(&self, id: u64) -> String {
        format!("{}:{}", self.ip, PORT_BASE + id as u16)
    }

    fn data_dir(&self, id: u64) -> PathBuf {
        self.dir.join(format!("node{id}"))
    }

    fn log_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("node{id}.log"))
    }

    fn audit_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("node{id}.audit.log"))
    }

    fn mount(&mut self, id: u64) -> &mut DiskFaultMount {
        &mut self.mounts[id as usize - 1]
    }

    fn start(&mut self, id: u64) -> anyhow::Result<()> {
        let mut cmd: Command = command("lockd");
        cmd.arg("--id")
            .arg(id.to_string())
            .arg("--listen")
            .arg(self.addr(id))
            .arg("--data-dir")
            .arg(self.data_dir(id))
            .arg("--heartbeat")
            .arg("100ms")
            .arg("--election-timeout")
            .arg("600ms")
            .arg("--snapshot-every")
            .arg(SNAPSHOT_EVERY.to_string())
            .arg("--logs-kept-after-snapshot")
            .arg("100")
            .arg("--audit-log")
            .arg(self.audit_path(id))
            .arg("--audit-key-file")
            .arg(&self.audit_key);
        for peer in 1..=NODES {
            cmd.arg("--peer").arg(format!("{peer}={}", self.addr(peer)));
        }
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn,openraft=error");
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(id))?;
        cmd.stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log));
        self.procs[id as usize - 1] = Some(ChildGuard::spawn(format!("lockd-{id}"), cmd)?);
        Ok(())
    }

    fn kill(&mut self, id: u64) {
        if let Some(mut p) = self.procs[id as usize - 1].take() {
            p.kill();
        }
    }

    /// `Some(status)` once the node has exited (it stays recorded as exited).
    fn exited(&mut self, id: u64) -> Option<std::process::ExitStatus> {
        self.procs[id as usize - 1]
            .as_mut()
            .and_then(|p| p.try_wait())
    }

    fn running(&mut self, id: u64) -> bool {
        self.procs[id as usize - 1]
            .as_mut()
            .is_some_and(|p| p.is_running())
    }

    async fn status(&self, id: u64) -> anyhow::Result<StatusResponse> {
        let mut c = ClusterClient::new(self.channels[id as usize - 1].clone());
        let mut req = tonic::Request::new(StatusRequest {});
        req.set_timeout(Duration::from_secs(1));
        Ok(c.status(req).await?.into_inner())
    }

    /// The leader every running node agrees on.
    async fn leader(&mut self, within: Duration) -> anyhow::Result<u64> {
        let deadline = Instant::now() + within;
        loop {
            let mut seen = Vec::new();
            let mut running = 0;
            for id in 1..=NODES {
                if !self.running(id) {
                    continue;
                }
                running += 1;
                if let Ok(s) = self.status(id).await
                    && s.leader_id != 0
                {
                    seen.push(s.leader_id);
                }
            }
            if running > 0
                && seen.len() == running
                && seen.iter().all(|l| *l == seen[0])
                && self.running(seen[0])
            {
                return Ok(seen[0]);
            }
            if Instant::now() > deadline {
                anyhow::bail!("no agreed leader within {within:?} (saw {seen:?})");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn log_tail(&self, id: u64) -> String {
        let text = std::fs::read_to_string(self.log_path(id)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(6)..].join("\n")
    }
}

/// Grants seen by the workload, and how many acquires ended unknown.
#[derive(Default)]
struct Seen {
    grants: Vec<Grant>,
    unknown: usize,
}

enum Acquired {
    Granted { token: u64, lease_id: String },
    Refused,
    Unknown,
}

/// Sends one acquire, retrying with the same request id on the next node after a timeout or an
/// unavailable node, so a grant is counted once whichever attempt carried it.
async fn acquire(channels: &[Channel], first: usize, resource: &str, request_id: &str) -> Acquired {
    let deadline = Instant::now() + ACQUIRE_DEADLINE;
    let mut node = first;
    while Instant::now() < deadline {
        let mut client = LockClient::new(channels[node % channels.len()].clone());
        let req = AcquireRequest {
            resource: resource.to_owned(),
            request_id: request_id.to_owned(),
            lease_ttl_ms: TTL_MS,
            wait_timeout_ms: 0,
            holder: "diskfault".into(),
        };
        match tokio::time::timeout(ATTEMPT_TIMEOUT, client.acquire(req)).await {
            Ok(Ok(r)) => {
                let r = r.into_inner();
                return Acquired::Granted {
                    token: r.fencing_token,
                    lease_id: r.lease_id,
                };
            }
            Ok(Err(s))
                if matches!(
                    s.code(),
                    Code::Aborted
                        | Code::ResourceExhausted
                        | Code::InvalidArgument
                        | Code::PermissionDenied
                        | Code::FailedPrecondition
                ) =>
            {
                return Acquired::Refused;
            }
            _ => {
                node += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    Acquired::Unknown
}

async fn worker(
    w: usize,
    seed: u64,
    resources: usize,
    channels: Vec<Channel>,
    start: Instant,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ (0x5EED_0000 + w as u64));
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let resource = format!("diskfault/r{}", rng.random_range(0..resources));
        let request_id = format!("df-{seed}-w{w}-{n}");
        let first = rng.random_range(0..channels.len());
        let invoke_ms = start.elapsed().as_millis() as u64;
        match acquire(&channels, first, &resource, &request_id).await {
            Acquired::Granted { token, lease_id } => {
                let ack_ms = start.elapsed().as_millis() as u64 + 1;
                seen.lock().expect("seen").grants.push(Grant {
                    resource: resource.clone(),
                    request_id,
                    token,
                    invoke_ms,
                    ack_ms,
                });
                tokio::time::sleep(Duration::from_millis(rng.random_range(5..40))).await;
                let mut client = LockClient::new(channels[first].clone());
                let _ = tokio::time::timeout(
                    ATTEMPT_TIMEOUT,
                    client.release(ReleaseRequest { resource, lease_id }),
                )
                .await;
            }
            Acquired::Refused => {
                tokio::time::sleep(Duration::from_millis(rng.random_range(5..30))).await;
            }
            Acquired::Unknown => seen.lock().expect("seen").unknown += 1,
        }
    }
}

/// Runs one seeded history of `o.scenario` and checks it.
pub async fn run(o: &Options) -> anyhow::Result<Report> {
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(o.seed);
    let mut report = Report {
        seed: o.seed,
        scenario: o.scenario.name().into(),
        broken_no_fsync: o.broken_no_fsync,
        ..Report::default()
    };
    std::fs::create_dir_all(&o.dir)?;
    let audit_key = crate::audit::write_key_file(&o.dir)?;
    let ip = random_loopback_ip();
    let mut mounts = Vec::new();
    for id in 1..=NODES {
        let mnt = o.dir.join(format!("node{id}"));
        let backing = o.dir.join(format!("node{id}.backing"));
        mounts.push(DiskFaultMount::mount(&mnt, &backing)?);
    }
    let channels = (1..=NODES)
        .map(|id| {
            Ok(
                Channel::from_shared(format!("http://{ip}:{}", PORT_BASE + id as u16))?
                    .connect_timeout(Duration::from_secs(1))
                    .connect_lazy(),
            )
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut nodes = Nodes {
        ip,
        dir: o.dir.clone(),
        procs: (0..NODES).map(|_| None).collect(),
        mounts,
        channels: channels.clone(),
        audit_key,
    };
    for id in 1..=NODES {
        nodes.start(id)?;
    }
    nodes.leader(Duration::from_secs(20)).await?;

    let clock = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let workers: Vec<_> = (0..o.workers)
        .map(|w| {
            tokio::spawn(worker(
                w,
                o.seed,
                o.resources,
                channels.clone(),
                clock,
                stop.clone(),
                seen.clone(),
            ))
        })
        .collect();

    let faults = inject(o, &mut rng, &mut nodes, &mut report).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    if let Err(e) = faults {
        report.violations.push(format!("[harness] {e:#}"));
    }

    let final_tokens = recover(o, &mut nodes, &mut report).await;
    for id in 1..=NODES {
        if let Some(p) = &nodes.procs[id as usize - 1] {
            p.signal(Signal::SIGTERM);
        }
    }
    for id in 1..=NODES {
        for _ in 0..50 {
            if !nodes.running(id) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        nodes.kill(id);
        report.disk_stats.push((id, nodes.mount(id).stats()));
    }
    let mut audit = Vec::new();
    for id in 1..=NODES {
        let text = std::fs::read_to_string(nodes.audit_path(id)).unwrap_or_default();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            match serde_json::from_str::<AuditLine>(line) {
                Ok(l) => audit.push(l),
                // A line cut by kill -9 (the audit log is outside the FUSE layer).
                Err(e) => report
                    .notes
                    .push(format!("node {id}: unreadable audit line ({e}): {line}")),
            }
        }
    }
    let seen = std::mem::take(&mut *seen.lock().expect("seen"));
    report.grants_acked = seen.grants.len();
    report.acquires_unknown = seen.unknown;
    report
        .violations
        .extend(check(&seen.grants, &final_tokens, &audit));
    drop(nodes);
    report.elapsed_ms = started.elapsed().as_millis() as u64;
    Ok(report)
}

fn millis(rng: &mut StdRng, lo: u64, hi: u64) -> Duration {
    Duration::from_millis(rng.random_range(lo..=hi))
}

/// The fault schedule: warm-up, then `cycles` times the scenario's fault under load.
async fn inject(
    o: &Options,
    rng: &mut StdRng,
    nodes: &mut Nodes,
    report: &mut Report,
) -> anyhow::Result<()> {
    for cycle in 0..o.cycles {
        tokio::time::sleep(millis(rng, 1_500, 3_000)).await;
        if o.broken_no_fsync && cycle == 0 {
            for id in 1..=NODES {
                nodes.mount(id).set_faults(|f| f.no_fsync = true);
            }
            report
                .notes
                .push("broken: fsync persists nothing from now on, on every node".into());
            tokio::time::sleep(millis(rng, 1_500, 2_500)).await;
        }
        let leader = nodes.leader(Duration::from_secs(20)).await?;
        let followers: Vec<u64> = (1..=NODES).filter(|i| *i != leader).collect();
        let follower = followers[rng.random_range(0..followers.len())];
        match o.scenario {
            Scenario::FollowerPowerLoss => power_loss(o, rng, nodes, report, &[follower]).await?,
            Scenario::LeaderPowerLoss => power_loss(o, rng, nodes, report, &[leader]).await?,
            Scenario::TwoNodesPowerLoss => {
                // The leader and a follower; the spared node is paused while they restart, so
                // one of them must be elected: it must be one that kept every acknowledged entry.
                let spared = followers
                    .iter()
                    .copied()
                    .find(|f| *f != follower)
                    .unwrap_or(follower);
                let victims = [leader, follower];
                if let Some(p) = &nodes.procs[spared as usize - 1] {
                    p.signal(Signal::SIGSTOP);
                }
                let result = power_loss(o, rng, nodes, report, &victims).await;
                for _ in 0..50 {
                    let mut leaders = Vec::new();
                    for v in victims {
                        if let Ok(s) = nodes.status(v).await
                            && s.role == "leader"
                        {
                            leaders.push(v);
                        }
                    }
                    if !leaders.is_empty() {
                        report.notes.push(format!(
                            "node {} elected while node {spared} was paused",
                            leaders[0]
                        ));
                        tokio::time::sleep(millis(rng, 500, 1_500)).await;
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                if let Some(p) = &nodes.procs[spared as usize - 1] {
                    p.signal(Signal::SIGCONT);
                }
                result?
            }
            Scenario::LeaderFsyncEio => fsync_eio(o, rng, nodes, report, leader).await?,
            Scenario::FollowerEnospc => enospc(rng, nodes, report, follower).await?,
        }
        tokio::time::sleep(millis(rng, 1_000, 2_000)).await;
    }
    Ok(())
}

/// kill -9 of `victims`, a power loss of each one's disk, a restart after a short while; then
/// each must serve again or exit (refuse) within [`RESTART_BOUND`].
async fn power_loss(
    o: &Options,
    rng: &mut StdRng,
    nodes: &mut Nodes,
    report: &mut Report,
    victims: &[u64],
) -> anyhow::Result<()> {
    for id in victims {
        nodes.kill(*id);
    }
    for id in victims {
        let unsynced = nodes.mount(*id).unsynced();
        let loss = nodes.mount(*id).power_loss(rng, o.tear)?;
        report.notes.push(format!(
            "node {id}: power loss ({unsynced} unsynced writes dropped, torn: {:?})",
            loss.torn
        ));
        report.power_losses.push((*id, loss));
    }
    tokio::time::sleep(millis(rng, 300, 1_500)).await;
    for id in victims {
        nodes.start(*id)?;
    }
    for id in victims {
        await_restart(nodes, report, *id).await;
    }
    Ok(())
}

/// Waits until a restarted node answers Status or exits; an exit is a refusal, recorded with the
/// end of its log, and must say why.
async fn await_restart(nodes: &mut Nodes, report: &mut Report, id: u64) {
    let deadline = Instant::now() + RESTART_BOUND;
    while Instant::now() < deadline {
        if let Some(status) = nodes.exited(id) {
            let tail = nodes.log_tail(id);
            report
                .notes
                .push(format!("node {id}: refused to start ({status}): {tail}"));
            if tail.trim().is_empty() {
                report.violations.push(format!(
                    "[clear-error] node {id} exited ({status}) after a power loss without saying why"
                ));
            }
            report.refused.push((id, tail));
            nodes.procs[id as usize - 1] = None;
            return;
        }
        if nodes.status(id).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    report.violations.push(format!(
        "[restart] node {id} neither served nor exited within {RESTART_BOUND:?} after a restart"
    ));
}

/// The applied index of `id`, if it answers.
async fn applied(nodes: &Nodes, id: u64) -> Option<u64> {
    nodes.status(id).await.ok().map(|s| s.applied_index)
}

/// The leader's next fsync of `lockd.redb` fails. The node must stop committing within
/// [`FSYNC_STOP_BOUND`] (exit, or stop its log); then it loses power and restarts.
async fn fsync_eio(
    o: &Options,
    rng: &mut StdRng,
    nodes: &mut Nodes,
    report: &mut Report,
    leader: u64,
) -> anyhow::Result<()> {
    nodes.mount(leader).set_faults(|f| {
        f.fail_fsyncs = 1;
        f.fail_fsync_name = "lockd.redb".into();
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while nodes.mount(leader).stats().fsyncs_failed == 0 {
        if Instant::now() > deadline {
            anyhow::bail!("node {leader} made no fsync of lockd.redb within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    report.notes.push(format!(
        "node {leader}: an fsync of lockd.redb failed (EIO)"
    ));
    tokio::time::sleep(FSYNC_STOP_BOUND).await;
    // Stopped means: exited, or its applied index stands still while the others go on.
    if let Some(status) = nodes.exited(leader) {
        report.notes.push(format!(
            "node {leader}: exited after the failed fsync ({status}): {}",
            nodes.log_tail(leader)
        ));
    } else {
        let others: Vec<u64> = (1..=NODES).filter(|i| *i != leader).collect();
        let before = applied(nodes, leader).await;
        let before_others = applied(nodes, others[0]).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after = applied(nodes, leader).await;
        let after_others = applied(nodes, others[0]).await;
        let status = nodes.status(leader).await;
        match (before, after) {
            (Some(b), Some(a)) if a > b => report.violations.push(format!(
                "[fsync-failure-ignored] node {leader} kept applying after its log fsync failed \
                 (applied {b} -> {a} over 2 s, {} s after the failure; role {:?})",
                FSYNC_STOP_BOUND.as_secs(),
                status.as_ref().map(|s| s.role.clone()).ok()
            )),
            _ => report.notes.push(format!(
                "node {leader}: stayed up but stopped applying after the failed fsync \
                 (applied {before:?} -> {after:?}; node {} went {before_others:?} -> {after_others:?}); \
                 status: {:?}; log: {}",
                others[0],
                status.map(|s| (s.role, s.leader_id)).map_err(|e| e.to_string()),
                nodes.log_tail(leader)
            )),
        }
    }
    power_loss(o, rng, nodes, report, &[leader]).await
}

/// A follower's disk reports ENOSPC for a while. It must say so clearly if it stops, and its
/// data must still open after a kill -9 and restart.
async fn enospc(
    rng: &mut StdRng,
    nodes: &mut Nodes,
    report: &mut Report,
    follower: u64,
) -> anyhow::Result<()> {
    nodes.mount(follower).set_faults(|f| f.disk_full = true);
    let deadline = Instant::now() + Duration::from_secs(10);
    while nodes.mount(follower).stats().enospc == 0 {
        if Instant::now() > deadline {
            anyhow::bail!("node {follower} wrote nothing within 10 s of its disk filling up");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(millis(rng, 1_000, 3_000)).await;
    let exited = nodes.exited(follower);
    let tail = nodes.log_tail(follower);
    let clear = tail.contains("No space left on device") || tail.contains("os error 28");
    report.notes.push(format!(
        "node {follower}: disk full; {}; log: {tail}",
        match exited {
            Some(s) => format!("exited ({s})"),
            None => "still running".into(),
        }
    ));
    if exited.is_some() && !clear {
        report.violations.push(format!(
            "[clear-error] node {follower} exited on a full disk without naming it: {tail}"
        ));
    }
    nodes.mount(follower).set_faults(|f| f.disk_full = false);
    tokio::time::sleep(millis(rng, 500, 1_500)).await;
    let a = applied(nodes, follower).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let b = applied(nodes, follower).await;
    report.notes.push(format!(
        "node {follower}: space back; applied {a:?} -> {b:?} over 1 s; restarting it (kill -9, no power loss)"
    ));
    nodes.kill(follower);
    nodes.start(follower)?;
    await_restart(nodes, report, follower).await;
    Ok(())
}

/// After the faults: every node that did not refuse runs, a leader is agreed, every resource is
/// granted once more (its token must be above every acknowledged one), and the nodes converge.
/// Returns the final grants' tokens by resource.
async fn recover(o: &Options, nodes: &mut Nodes, report: &mut Report) -> BTreeMap<String, u64> {
    let refused: Vec<u64> = report.refused.iter().map(|(id, _)| *id).collect();
    for id in 1..=NODES {
        if !refused.contains(&id) && !nodes.running(id) {
            if let Err(e) = nodes.start(id) {
                report
                    .violations
                    .push(format!("[harness] restarting node {id}: {e:#}"));
            }
            await_restart(nodes, report, id).await;
        }
    }
    let deadline = Instant::now() + RECOVERY_BOUND;
    let mut finals = BTreeMap::new();
    if let Err(e) = nodes.leader(RECOVERY_BOUND).await {
        let why = if refused.is_empty() {
            String::new()
        } else {
            format!(" ({} node(s) refused to start)", refused.len())
        };
        report
            .violations
            .push(format!("[recovery] no leader after the faults{why}: {e:#}"));
        return finals;
    }
    for r in 0..o.resources {
        let resource = format!("diskfault/r{r}");
        let mut n = 0;
        loop {
            n += 1;
            let id = format!("df-{}-final-{r}-{n}", o.seed);
            match acquire(&nodes.channels, r, &resource, &id).await {
                Acquired::Granted { token, .. } => {
                    finals.insert(resource, token);
                    break;
                }
                _ if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                _ => {
                    report.violations.push(format!(
                        "[recovery] {resource} could not be acquired within {RECOVERY_BOUND:?} after the faults"
                    ));
                    break;
                }
            }
        }
    }
    // Convergence: every running node applies the last final grant.
    let target = finals.values().copied().max().unwrap_or(0);
    loop {
        let mut behind = Vec::new();
        for id in 1..=NODES {
            if refused.contains(&id) {
                continue;
            }
            match applied(nodes, id).await {
                Some(a) if a >= target => {}
                other => behind.push((id, other)),
            }
        }
        if behind.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            report.violations.push(format!(
                "[converge] nodes {behind:?} did not apply index {target} within {RECOVERY_BOUND:?}"
            ));
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    finals
}

/// The checks. `grants`: every grant a client saw acknowledged; `finals`: the grant made per
/// resource after recovery; `audit`: every node's audit lines.
fn check(grants: &[Grant], finals: &BTreeMap<String, u64>, audit: &[AuditLine]) -> Vec<String> {
    let mut v = Vec::new();
    // 1. A token names one grant: a token acknowledged to two requests means an acknowledged
    // entry was lost and its log index reused.
    let mut by_token: HashMap<u64, &Grant> = HashMap::new();
    for g in grants {
        if let Some(other) = by_token.insert(g.token, g)
            && other.request_id != g.request_id
        {
            v.push(format!(
                "[token-unique] token {} acknowledged to {} ({}) and to {} ({})",
                g.token, other.request_id, other.resource, g.request_id, g.resource
            ));
        }
    }
    // 2. Per resource, a grant acknowledged before another was asked for has the lower token.
    let mut per_resource: BTreeMap<&str, Vec<&Grant>> = BTreeMap::new();
    for g in grants {
        per_resource.entry(&g.resource).or_default().push(g);
    }
    for (resource, gs) in &per_resource {
        let mut by_ack = gs.clone();
        by_ack.sort_by_key(|g| g.ack_ms);
        let mut max_acked: Option<&Grant> = None;
        let mut by_invoke = gs.clone();
        by_invoke.sort_by_key(|g| g.invoke_ms);
        let mut i = 0;
        for g in by_invoke {
            while i < by_ack.len() && by_ack[i].ack_ms < g.invoke_ms {
                if max_acked.is_none_or(|m| by_ack[i].token > m.token) {
                    max_acked = Some(by_ack[i]);
                }
                i += 1;
            }
            if let Some(m) = max_acked
                && g.token <= m.token
                && g.request_id != m.request_id
            {
                v.push(format!(
                    "[token-order] {resource}: {} got token {} at {} ms, after {} was acknowledged token {} at {} ms",
                    g.request_id, g.token, g.ack_ms, m.request_id, m.token, m.ack_ms
                ));
            }
        }
        // 3. After recovery the resource is granted above every acknowledged token.
        if let (Some(final_token), Some(top)) =
            (finals.get(*resource), gs.iter().map(|g| g.token).max())
            && *final_token <= top
        {
            v.push(format!(
                "[acked-survives] {resource}: granted token {final_token} after recovery, not above the acknowledged token {top}"
            ));
        }
    }
    // 4. Replicas agree on every log index; 5. every acknowledged grant is in some node's log.
    let (merged, divergence) = merge_audit(audit);
    v.extend(divergence.into_iter().map(|d| d.to_string()));
    let logged: HashMap<(String, u64), ()> = merged
        .values()
        .flatten()
        .filter(|l| l.outcome == "granted")
        .map(|l| ((l.request_digest.clone(), l.fencing_token), ()))
        .collect();
    let mut missing = 0;
    for g in grants {
        let digest = crate::audit::request_digest(&g.request_id);
        if !logged.contains_key(&(digest, g.token)) {
            missing += 1;
            if missing <= 5 {
                v.push(format!(
                    "[acked-in-log] {} granted token {} on {} is in no node's audit log",
                    g.request_id, g.token, g.resource
                ));
            }
        }
    }
    if missing > 5 {
        v.push(format!(
            "[acked-in-log] {} more acknowledged grants missing",
            missing - 5
        ));
    }
    v
}

/// The default folder of a run: under the system's temporary folder.
pub fn default_dir(seed: u64, scenario: Scenario) -> PathBuf {
    let unique = format!(
        "lockd-diskfault-{seed}-{}-{}",
        scenario.name(),
        std::process::id()
    );
    std::env::temp_dir().join(unique)
}

/// Removes a run's folder (the mounts are gone by then).
pub fn remove_dir(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
}

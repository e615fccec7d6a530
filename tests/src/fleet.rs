//! A lockd cluster whose members are named, not numbered by IP: node `i` is
//! `node<i>.<run>.lockd.test:<7000 + i>` in every `--peer` flag and in the Raft membership, and
//! each node listens on an IP of its own. The names resolve through a hosts file of this run
//! only, read by nss_wrapper (`LD_PRELOAD=libnss_wrapper.so`, `NSS_WRAPPER_HOSTS`) in the lockd
//! processes: nothing global such as /etc/hosts changes, and a name can be moved to another IP
//! while the other nodes run (nss_wrapper reads the file again when it changes). Nodes can be
//! added with `--join`, killed, wiped, restarted (also with other flags) and moved; membership
//! commands run through `lockctl`. Each node's output goes to `node<i>.log` in the run's
//! directory ([`Fleet::log`]), so a test can check what a node said.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use lockd_api::v1::StatusRequest;
use lockd_api::v1::StatusResponse;
use lockd_api::v1::cluster_client::ClusterClient;
use tonic::transport::Channel;

use crate::process::{ChildGuard, command, random_loopback_ip};

/// Where Debian's libnss-wrapper puts its library.
const NSS_WRAPPER_PATHS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu/libnss_wrapper.so",
    "/usr/lib/aarch64-linux-gnu/libnss_wrapper.so",
    "/usr/lib64/libnss_wrapper.so",
    "/usr/lib/libnss_wrapper.so",
];

/// Client port of node `id` on its own IP.
pub fn port(id: u64) -> u16 {
    7000 + id as u16
}

/// The nss_wrapper library; the suite cannot run without it.
pub fn nss_wrapper() -> anyhow::Result<PathBuf> {
    NSS_WRAPPER_PATHS
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "libnss_wrapper.so not found in {NSS_WRAPPER_PATHS:?}: install it \
                 (apt-get install libnss-wrapper); the membership suite resolves test names \
                 with it"
            )
        })
}

/// One node: where it listens and its process.
struct FleetNode {
    ip: Ipv4Addr,
    /// The ids in its `--peer` list (itself included).
    peers: Vec<u64>,
    join: bool,
    process: Option<ChildGuard>,
}

pub struct Fleet {
    dir: tempfile::TempDir,
    /// `<run>.lockd.test`: unique per fleet, so concurrent runs never share a name.
    domain: String,
    hosts: PathBuf,
    nss_wrapper: PathBuf,
    nodes: BTreeMap<u64, FleetNode>,
    /// Extra flags of every node (timings).
    pub args: Vec<String>,
    /// Whether nodes run with `--allow-membership-without-policy`: a fleet has no policy, so
    /// without it `lockctl member add/promote/remove` and `leader transfer` are refused.
    allow_membership: bool,
    /// With TLS: the peer CA that issues every node a certificate (naming
    /// `node-<id>.lockd.lockd` and its IP) when it starts; clients trust it.
    tls: Option<crate::tls::TestCa>,
}

impl Fleet {
    /// Starts nodes `1..=n` as one cluster and waits for a leader. A single node's data dir is
    /// prepared with `lockd init` first (it has nobody to ask). The nodes run with
    /// `--allow-membership-without-policy`, so membership commands work without a policy.
    pub async fn start(n: u64, args: &[&str]) -> anyhow::Result<Fleet> {
        Fleet::start_with(n, args, true).await
    }

    /// [`Fleet::start`], with `--allow-membership-without-policy` on every node only if
    /// `allow_membership`.
    pub async fn start_with(
        n: u64,
        args: &[&str],
        allow_membership: bool,
    ) -> anyhow::Result<Fleet> {
        Fleet::start_inner(n, args, allow_membership, false).await
    }

    /// [`Fleet::start`] with TLS: node certificates of one peer CA, which the test's clients
    /// and lockctl trust; no client certificates, no policy.
    pub async fn start_tls(n: u64, args: &[&str]) -> anyhow::Result<Fleet> {
        Fleet::start_inner(n, args, true, true).await
    }

    async fn start_inner(
        n: u64,
        args: &[&str],
        allow_membership: bool,
        tls: bool,
    ) -> anyhow::Result<Fleet> {
        let dir = tempfile::tempdir()?;
        let tls = if tls {
            Some(crate::tls::TestCa::new(dir.path(), "peer")?)
        } else {
            None
        };
        let run: u32 = {
            use rand::RngExt;
            rand::rng().random()
        };
        let mut fleet = Fleet {
            hosts: dir.path().join("hosts"),
            dir,
            domain: format!("r{run:08x}.lockd.test"),
            nss_wrapper: nss_wrapper()?,
            nodes: BTreeMap::new(),
            args: args.iter().map(|a| a.to_string()).collect(),
            allow_membership,
            tls,
        };
        let ids: Vec<u64> = (1..=n).collect();
        for id in &ids {
            fleet.nodes.insert(
                *id,
                FleetNode {
                    ip: random_loopback_ip(),
                    peers: ids.clone(),
                    join: false,
                    process: None,
                },
            );
        }
        fleet.write_hosts()?;
        if n == 1 {
            let out = fleet.init(1)?;
            anyhow::ensure!(out.status.success(), "lockd init: {out:?}");
        }
        for id in ids.clone() {
            fleet.spawn(id)?;
        }
        // Every node, not only those that already list themselves: a node that has not caught
        // up yet would otherwise be a test's first casualty.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let leader = fleet.wait_for_leader(Duration::from_secs(30)).await?;
            let mut following = 0;
            for id in &ids {
                if fleet.status(*id).await.is_ok_and(|s| s.leader_id == leader) {
                    following += 1;
                }
            }
            if following == ids.len() {
                return Ok(fleet);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{following} of {} nodes follow leader {leader} after 30 s",
                ids.len()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn name(&self, id: u64) -> String {
        format!("node{id}.{}", self.domain)
    }

    /// `name:port`, the address in `--peer` and in the membership.
    pub fn member_addr(&self, id: u64) -> String {
        format!("{}:{}", self.name(id), port(id))
    }

    /// `ip:port`, what the test itself dials (it does not resolve test names).
    pub fn ip_addr(&self, id: u64) -> String {
        format!("{}:{}", self.nodes[&id].ip, port(id))
    }

    pub fn data_dir(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("node{id}"))
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Endpoints of the given nodes, as lockctl and the client take them.
    pub fn endpoints(&self, ids: &[u64]) -> Vec<String> {
        ids.iter().map(|id| self.ip_addr(*id)).collect()
    }

    /// Rewrites the hosts file in place and moves its mtime forward by at least a second, so
    /// every node's nss_wrapper reloads it (it compares whole seconds). Never by rename:
    /// nss_wrapper 1.1.12 reopens a replaced file (`st_nlink == 0`) without a lock, and two
    /// threads resolving at that moment crash the node in `fclose(NULL)`. A reader that catches
    /// the file half written reloads it once the final mtime, which no earlier write had, shows.
    fn write_hosts(&self) -> anyhow::Result<()> {
        use std::io::Write;
        let text: String = self
            .nodes
            .iter()
            .map(|(id, n)| format!("{} {}\n", n.ip, self.name(*id)))
            .collect();
        let before = std::fs::metadata(&self.hosts)
            .and_then(|m| m.modified())
            .ok();
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&self.hosts)?;
        file.write_all(text.as_bytes())?;
        let now = std::time::SystemTime::now();
        let later = before.map_or(now, |b| now.max(b + Duration::from_secs(1)));
        file.set_modified(later + Duration::from_secs(1))?;
        Ok(())
    }

    /// Where node `id` writes its output (appended across restarts).
    pub fn log_path(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("node{id}.log"))
    }

    /// Everything node `id` has written so far.
    pub fn log(&self, id: u64) -> String {
        std::fs::read_to_string(self.log_path(id)).unwrap_or_default()
    }

    fn spawn(&mut self, id: u64) -> anyhow::Result<()> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path(id))?;
        let node = &self.nodes[&id];
        let mut cmd: Command = command("lockd");
        cmd.arg("--id")
            .arg(id.to_string())
            .arg("--listen")
            .arg(format!("{}:{}", node.ip, port(id)))
            .arg("--data-dir")
            .arg(self.data_dir(id));
        for p in &node.peers {
            cmd.arg("--peer")
                .arg(format!("{p}={}", self.member_addr(*p)));
        }
        if node.join {
            cmd.arg("--join");
        }
        if self.allow_membership {
            cmd.arg("--allow-membership-without-policy");
        }
        if let Some(ca) = &self.tls {
            let issued = ca.issue_node("lockd", id, std::net::IpAddr::V4(node.ip))?;
            cmd.arg("--tls-cert")
                .arg(&issued.cert)
                .arg("--tls-key")
                .arg(&issued.key)
                .arg("--peer-ca")
                .arg(&ca.cert_path);
        }
        cmd.stdout(out.try_clone()?).stderr(out);
        cmd.args(&self.args)
            .env("LD_PRELOAD", &self.nss_wrapper)
            .env("NSS_WRAPPER_HOSTS", &self.hosts);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn,openraft=off");
        }
        let guard = ChildGuard::spawn(format!("lockd-{id}"), cmd)?;
        self.nodes.get_mut(&id).expect("node").process = Some(guard);
        Ok(())
    }

    /// Starts a new node `id` with an empty data dir and `--join`, its `--peer` list being itself
    /// and `peers`; it waits to be added with `member add`.
    pub fn start_joining(&mut self, id: u64, peers: &[u64]) -> anyhow::Result<()> {
        anyhow::ensure!(!self.nodes.contains_key(&id), "node {id} exists");
        let mut list = vec![id];
        list.extend_from_slice(peers);
        self.nodes.insert(
            id,
            FleetNode {
                ip: random_loopback_ip(),
                peers: list,
                join: true,
                process: None,
            },
        );
        self.write_hosts()?;
        self.spawn(id)
    }

    /// kill -9.
    pub fn kill(&mut self, id: u64) {
        if let Some(mut p) = self.nodes.get_mut(&id).and_then(|n| n.process.take()) {
            p.kill();
        }
    }

    /// Sends `sig` (SIGSTOP, SIGCONT...) to node `id`'s process.
    pub fn signal(&self, id: u64, sig: nix::sys::signal::Signal) {
        if let Some(p) = self.nodes.get(&id).and_then(|n| n.process.as_ref()) {
            p.signal(sig);
        }
    }

    /// Restarts a stopped node with its data dir.
    pub fn restart(&mut self, id: u64) -> anyhow::Result<()> {
        self.spawn(id)
    }

    /// Deletes a stopped node's data dir: the disk is lost.
    pub fn wipe(&mut self, id: u64) -> anyhow::Result<()> {
        anyhow::ensure!(!self.is_running(id), "node {id} is running");
        match std::fs::remove_dir_all(self.data_dir(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }

    /// Changes the flags node `id` is started with next: its `--peer` list (itself and
    /// `peers`) and `--join`.
    pub fn set_flags(&mut self, id: u64, peers: &[u64], join: bool) {
        let node = self.nodes.get_mut(&id).expect("node");
        node.peers = std::iter::once(id)
            .chain(peers.iter().copied().filter(|p| *p != id))
            .collect();
        node.join = join;
    }

    /// Runs `lockd init` on node `id`'s data dir with its `--peer` list; its output.
    pub fn init(&self, id: u64) -> anyhow::Result<std::process::Output> {
        let node = &self.nodes[&id];
        let mut cmd: Command = command("lockd");
        cmd.args(["init", "--id", &id.to_string(), "--data-dir"])
            .arg(self.data_dir(id));
        for p in &node.peers {
            cmd.arg("--peer")
                .arg(format!("{p}={}", self.member_addr(*p)));
        }
        Ok(cmd.output()?)
    }

    /// The exit status of node `id` if its process has ended.
    pub fn exited(&mut self, id: u64) -> Option<std::process::ExitStatus> {
        self.nodes
            .get_mut(&id)
            .and_then(|n| n.process.as_mut())
            .and_then(|p| p.try_wait())
    }

    /// Moves a stopped node's name to a new IP (the hosts file changes at once for every node);
    /// returns the new IP.
    pub fn move_to_new_ip(&mut self, id: u64) -> anyhow::Result<Ipv4Addr> {
        let old = self.nodes[&id].ip;
        let mut ip = random_loopback_ip();
        while ip == old {
            ip = random_loopback_ip();
        }
        self.nodes.get_mut(&id).expect("node").ip = ip;
        self.write_hosts()?;
        Ok(ip)
    }

    pub fn is_running(&mut self, id: u64) -> bool {
        self.nodes
            .get_mut(&id)
            .and_then(|n| n.process.as_mut())
            .is_some_and(|p| p.is_running())
    }

    pub fn running(&mut self) -> Vec<u64> {
        let ids: Vec<u64> = self.nodes.keys().copied().collect();
        ids.into_iter().filter(|id| self.is_running(*id)).collect()
    }

    /// A client channel to node `id`, over TLS trusting the peer CA when the fleet has TLS.
    pub fn channel(&self, id: u64) -> anyhow::Result<Channel> {
        let Some(ca) = &self.tls else {
            return Ok(
                Channel::from_shared(format!("http://{}", self.ip_addr(id)))?
                    .connect_timeout(Duration::from_secs(1))
                    .connect_lazy(),
            );
        };
        let pem = std::fs::read(&ca.cert_path)?;
        Ok(
            Channel::from_shared(format!("https://{}", self.ip_addr(id)))?
                .tls_config(
                    tonic::transport::ClientTlsConfig::new()
                        .ca_certificate(tonic::transport::Certificate::from_pem(pem)),
                )?
                .connect_timeout(Duration::from_secs(1))
                .connect_lazy(),
        )
    }

    pub async fn status(&self, id: u64) -> anyhow::Result<StatusResponse> {
        let channel = self.channel(id)?;
        let mut req = tonic::Request::new(StatusRequest {});
        req.set_timeout(Duration::from_secs(2));
        Ok(ClusterClient::new(channel).status(req).await?.into_inner())
    }

    /// Waits until a running node leads and every running member agrees (nodes that are not
    /// members yet, or no longer, are not asked).
    pub async fn wait_for_leader(&mut self, within: Duration) -> anyhow::Result<u64> {
        let deadline = Instant::now() + within;
        loop {
            let running = self.running();
            let mut seen = Vec::new();
            for id in &running {
                if let Ok(s) = self.status(*id).await
                    && s.members.iter().any(|m| m.id == *id)
                    && s.role != "learner"
                {
                    seen.push((*id, s.leader_id, s.role == "leader"));
                }
            }
            if let Some((leader, _, _)) = seen.iter().find(|(_, _, is)| *is).copied()
                && seen.iter().all(|(_, l, _)| *l == leader)
            {
                return Ok(leader);
            }
            if Instant::now() > deadline {
                // Nodes that should run but exited, with how they ended and their last lines.
                let all: Vec<u64> = self.nodes.keys().copied().collect();
                let mut ended = String::new();
                for id in all {
                    if let Some(status) = self.exited(id) {
                        let log = self.log(id);
                        let lines: Vec<&str> = log.lines().collect();
                        let tail = &lines[lines.len().saturating_sub(20)..];
                        ended.push_str(&format!(
                            "\n--- node {id} exited ({status}), last lines:\n{}",
                            tail.join("\n")
                        ));
                    }
                }
                // What each running node said about elections, so a failure can be read.
                let said: String = running
                    .iter()
                    .map(|id| {
                        let log = self.log(*id);
                        let lines: Vec<&str> = log
                            .lines()
                            .filter(|l| {
                                ["vote", "elect", "leader", "term", "WARN", "ERROR"]
                                    .iter()
                                    .any(|w| l.contains(w))
                            })
                            .collect();
                        let tail = &lines[lines.len().saturating_sub(40)..];
                        format!("\n--- node {id}, last election lines:\n{}", tail.join("\n"))
                    })
                    .collect();
                anyhow::bail!(
                    "no agreed leader within {within:?}: (node, leader, leads) {seen:?}{said}{ended}"
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Acquires a fresh resource through the nodes `via` only, as a client with those endpoints
    /// would, within `within`; returns the fencing token. Each try takes the next of
    /// `<prefix>/1`, `<prefix>/2`, ... (5-s leases), so a grant whose answer was lost, or one of
    /// an earlier call still running, never makes a later try find its resource held.
    pub async fn acquire_fresh(
        &self,
        via: &[u64],
        prefix: &str,
        within: Duration,
    ) -> anyhow::Result<u64> {
        let client = lockd_client::Client::new(self.endpoints(via))?;
        let deadline = Instant::now() + within;
        let mut n = 0;
        loop {
            n += 1;
            let resource = format!("{prefix}/{n}");
            let opts = lockd_client::AcquireOptions::default().ttl(Duration::from_secs(5));
            match client.acquire(&resource, opts).await {
                Ok(lease) => return Ok(lease.fencing_token.0),
                Err(e) if Instant::now() < deadline => {
                    eprintln!("acquire {resource} via nodes {via:?}: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => {
                    // The nodes' own last words (a node that exited says why here).
                    let said: String = via
                        .iter()
                        .map(|id| {
                            let log = self.log(*id);
                            let lines: Vec<&str> = log.lines().collect();
                            let tail = &lines[lines.len().saturating_sub(25)..];
                            format!("\n--- node {id}, last lines:\n{}", tail.join("\n"))
                        })
                        .collect();
                    anyhow::bail!("no grant via nodes {via:?} within {within:?}: {e}{said}")
                }
            }
        }
    }

    /// Runs lockctl against the given endpoints; returns stdout, or the error with stderr.
    pub fn lockctl(&self, endpoints: &[u64], args: &[&str]) -> anyhow::Result<String> {
        let mut cmd = command("lockctl");
        cmd.arg("--endpoints")
            .arg(self.endpoints(endpoints).join(","));
        if let Some(ca) = &self.tls {
            cmd.arg("--cacert").arg(&ca.cert_path);
        }
        let out = cmd.args(args).output()?;
        anyhow::ensure!(
            out.status.success(),
            "lockctl {args:?} exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `lockctl --json member list`, parsed.
    pub fn members(&self, endpoints: &[u64]) -> anyhow::Result<serde_json::Value> {
        Ok(serde_json::from_str(
            &self.lockctl(endpoints, &["--json", "member", "list"])?,
        )?)
    }
}

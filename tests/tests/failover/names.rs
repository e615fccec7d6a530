//! Members named by DNS names: `--peer ID=NAME:PORT`, resolved again on every connect, so a member
//! that comes back on another IP under its name (a replaced VM, a rescheduled pod) needs no change
//! in the Raft membership.
//!
//! The names resolve through a hosts file of the test's own, read by `nss_wrapper`
//! (`LD_PRELOAD=libnss_wrapper.so NSS_WRAPPER_HOSTS=FILE`, Debian package `libnss-wrapper`), so
//! nothing on the machine changes. Each node listens on a loopback IP of its own.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{StatusRequest, StatusResponse};
use lockd_tests::process::{ChildGuard, command, random_loopback_ip};
use tonic::Code;

const PORT: u16 = 7001;

/// Where Debian and others put `nss_wrapper`; `None` when it is not installed.
fn nss_wrapper() -> Option<PathBuf> {
    [
        "/usr/lib/x86_64-linux-gnu/libnss_wrapper.so",
        "/usr/lib/aarch64-linux-gnu/libnss_wrapper.so",
        "/usr/lib64/libnss_wrapper.so",
        "/usr/lib/libnss_wrapper.so",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
}

/// Replaces the hosts file in one rename: nss_wrapper reads a file again when it is a new one.
fn write_hosts(path: &Path, entries: &[(Ipv4Addr, String)]) {
    let text: String = entries
        .iter()
        .map(|(ip, name)| format!("{ip} {name}\n"))
        .collect();
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

struct NamedCluster {
    dir: tempfile::TempDir,
    hosts: PathBuf,
    nss: PathBuf,
    names: Vec<String>,
    /// The IP each node listens on now.
    ips: Vec<Ipv4Addr>,
    nodes: Vec<Option<ChildGuard>>,
}

impl NamedCluster {
    fn start(nss: PathBuf) -> NamedCluster {
        let base = random_loopback_ip().octets();
        let dir = tempfile::tempdir().unwrap();
        let suffix = dir
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .to_ascii_lowercase()
            .replace(|c: char| !c.is_ascii_alphanumeric(), "");
        let mut cluster = NamedCluster {
            hosts: dir.path().join("hosts"),
            dir,
            nss,
            names: (1..=3)
                .map(|i| format!("n{i}.c{suffix}.lockd.test"))
                .collect(),
            ips: (1..=3)
                .map(|i| Ipv4Addr::new(127, base[1], base[2], 10 + i))
                .collect(),
            nodes: Vec::new(),
        };
        cluster.write_hosts();
        for id in 1..=3 {
            cluster.nodes.push(None);
            cluster.start_node(id);
        }
        cluster
    }

    fn write_hosts(&self) {
        let entries: Vec<(Ipv4Addr, String)> = self
            .ips
            .iter()
            .copied()
            .zip(self.names.iter().cloned())
            .collect();
        write_hosts(&self.hosts, &entries);
    }

    fn addr(&self, id: u64) -> String {
        format!("{}:{PORT}", self.ips[id as usize - 1])
    }

    fn start_node(&mut self, id: u64) {
        let mut cmd = command("lockd");
        cmd.args(["--id", &id.to_string(), "--listen", &self.addr(id)])
            .arg("--data-dir")
            .arg(self.dir.path().join(format!("node{id}")))
            .args(["--heartbeat", "100ms", "--election-timeout", "600ms"]);
        for (i, name) in self.names.iter().enumerate() {
            cmd.arg("--peer").arg(format!("{}={name}:{PORT}", i + 1));
        }
        cmd.env("LD_PRELOAD", &self.nss)
            .env("NSS_WRAPPER_HOSTS", &self.hosts)
            .env("RUST_LOG", "warn,openraft=off");
        self.nodes[id as usize - 1] = Some(ChildGuard::spawn(format!("lockd-{id}"), cmd).unwrap());
    }

    fn kill(&mut self, id: u64) {
        if let Some(mut node) = self.nodes[id as usize - 1].take() {
            node.kill();
        }
    }

    async fn status(&self, id: u64) -> Result<StatusResponse, String> {
        let mut c = ClusterClient::connect(format!("http://{}", self.addr(id)))
            .await
            .map_err(|e| e.to_string())?;
        let mut req = tonic::Request::new(StatusRequest {});
        req.set_timeout(Duration::from_secs(2));
        Ok(c.status(req).await.map_err(|e| e.to_string())?.into_inner())
    }

    /// The leader every running node agrees on.
    async fn leader(&self) -> u64 {
        let running: Vec<u64> = (1..=3)
            .filter(|i| self.nodes[*i as usize - 1].is_some())
            .collect();
        lockd_tests::poll::until_async("an agreed leader", Duration::from_secs(30), || async {
            let mut seen = Vec::new();
            for id in &running {
                seen.push(self.status(*id).await.map(|s| s.leader_id).unwrap_or(0));
            }
            match seen.first() {
                Some(&l) if l != 0 && running.contains(&l) && seen.iter().all(|x| *x == l) => Ok(l),
                _ => Err(format!("leaders seen by {running:?}: {seen:?}")),
            }
        })
        .await
    }

    /// Acquires `resource` through node `via`, retrying UNAVAILABLE with the same request id;
    /// returns the fencing token.
    async fn acquire(&self, via: u64, resource: &str) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let attempt = async {
                let mut c = LockClient::connect(format!("http://{}", self.addr(via))).await?;
                let mut req = tonic::Request::new(lockd_api::v1::AcquireRequest {
                    resource: resource.into(),
                    request_id: format!("names-{resource}"),
                    lease_ttl_ms: 30_000,
                    wait_timeout_ms: 0,
                    holder: "names-test".into(),
                });
                req.set_timeout(Duration::from_secs(5));
                Ok::<_, Box<dyn std::error::Error>>(c.acquire(req).await)
            };
            match attempt.await {
                Ok(Ok(r)) => return r.into_inner().fencing_token,
                Ok(Err(s)) if s.code() != Code::Unavailable => {
                    panic!("acquire {resource} via node {via}: {s:?}")
                }
                other if Instant::now() > deadline => {
                    panic!("acquire {resource} via node {via}: still failing: {other:?}")
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
}

/// Goal: a member killed and started again on another IP under the same DNS name rejoins, the
/// leader replicates to it at its new address, and it takes part in a quorum there, with no change
/// to the membership (which keeps the names).
/// Method: three `lockd` processes, each on a loopback IP of its own, `--peer` given as names that
/// a test hosts file resolves (nss_wrapper). A follower is killed, its name moved to a new IP in
/// the hosts file, and it is restarted there on its data dir; after new grants it must reach the
/// leader's commit index, and then, with the old leader killed, it and the third node must elect a
/// leader and grant again. Status lists the members by name throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_back_on_another_ip_under_its_name_keeps_replicating() {
    let Some(nss) = nss_wrapper() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the DNS-name test: install libnss-wrapper (.ci/run does)"
        );
        lockd_tests::skip::report(
            "libnss-wrapper is not installed (apt-get install libnss-wrapper)",
        );
        return;
    };
    let mut cluster = NamedCluster::start(nss);
    let leader = cluster.leader().await;
    let members = cluster.status(leader).await.unwrap().members;
    let addresses: Vec<&str> = members.iter().map(|m| m.address.as_str()).collect();
    for name in &cluster.names {
        assert!(
            addresses.contains(&format!("{name}:{PORT}").as_str()),
            "the membership keeps the names as written: {addresses:?}"
        );
    }
    let mut last_token = 0;
    for i in 0..5 {
        let token = cluster.acquire(leader, &format!("names/before-{i}")).await;
        assert!(token > last_token);
        last_token = token;
    }

    // A follower moves: killed, its name pointed at a new IP, started there on its data dir.
    let moved = (1..=3).find(|i| *i != leader).unwrap();
    let third = (1..=3).find(|i| *i != leader && *i != moved).unwrap();
    cluster.kill(moved);
    let old_addr = cluster.addr(moved);
    let old = cluster.ips[moved as usize - 1];
    cluster.ips[moved as usize - 1] =
        Ipv4Addr::new(127, old.octets()[1], old.octets()[2], 20 + moved as u8);
    cluster.write_hosts();
    cluster.start_node(moved);
    assert_ne!(old_addr, cluster.addr(moved));

    for i in 0..5 {
        let token = cluster.acquire(leader, &format!("names/after-{i}")).await;
        assert!(
            token > last_token,
            "tokens grow: {token} after {last_token}"
        );
        last_token = token;
    }
    // Only the leader sends entries: the moved node reaching its commit index means the leader
    // dialled the name and found the new IP.
    let commit = cluster.status(leader).await.unwrap().commit_index;
    lockd_tests::poll::until_async(
        "the moved node applies the leader's commits",
        Duration::from_secs(30),
        || async {
            match cluster.status(moved).await {
                Ok(s) if s.applied_index >= commit => Ok(()),
                Ok(s) => Err(format!("applied {} of {commit}", s.applied_index)),
                Err(e) => Err(e),
            }
        },
    )
    .await;

    // The old leader goes: the moved node and the third one are the only quorum left.
    cluster.kill(leader);
    let new_leader = cluster.leader().await;
    assert!([moved, third].contains(&new_leader));
    let token = cluster.acquire(moved, "names/two-left").await;
    assert!(
        token > last_token,
        "tokens grow: {token} after {last_token}"
    );
    let status = cluster.status(moved).await.unwrap();
    assert!(
        status.members.iter().any(|m| m.id == moved
            && m.address == format!("{}:{PORT}", cluster.names[moved as usize - 1])),
        "the moved member is still listed by its name: {:?}",
        status.members
    );
}

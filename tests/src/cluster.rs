//! A real three-node lockd cluster of separate `lockd` processes on a random loopback address,
//! with data dirs in a temporary folder. Nodes can be killed, restarted, paused and wiped.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{StatusRequest, StatusResponse};
use nix::sys::signal::Signal;
use tonic::transport::Channel;

use crate::process::{ChildGuard, command, random_loopback_ip};

/// Client gRPC port of node i (1-based) is `BASE_PORT + i`; metrics `METRICS_BASE_PORT + i`.
pub const BASE_PORT: u16 = 7000;
pub const METRICS_BASE_PORT: u16 = 9100;

/// Timings used by test clusters: quick elections so failover tests stay short.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    pub nodes: u64,
    pub heartbeat_ms: u64,
    pub election_timeout_ms: u64,
    pub snapshot_every: u64,
    pub logs_kept_after_snapshot: u64,
    /// Each node writes its audit log to `<data dir>.audit.log` (see [`Cluster::audit_path`]).
    pub audit: bool,
    pub extra_args: Vec<String>,
    /// Wall-clock offset of node i+1 in ms (`LOCKD_TEST_CLOCK_OFFSET_MS`); missing = 0.
    pub clock_offsets_ms: Vec<i64>,
    /// Run the nodes with TLS: certificates made by [`Cluster::start`] under a peer CA.
    pub tls: bool,
    /// Give each node its id, addresses, peers, data dir and timings in a TOML file
    /// (`--config <dir>/node<id>.toml`) instead of flags.
    pub config_file: bool,
    /// Append each node's stderr to `<dir>/node<id>.stderr` (across restarts) instead of the
    /// test's, for tests that read what a node logged ([`Cluster::stderr`]).
    pub stderr_files: bool,
    /// The `lockd` executable every node runs (another build, for the upgrade test); `None`:
    /// this build's.
    pub binary: Option<PathBuf>,
}

/// The certificates of a TLS test cluster (see [`ClusterOptions::tls`]).
pub struct ClusterTls {
    pub cluster_id: String,
    pub peer_ca: crate::tls::TestCa,
    /// Node i+1's certificate.
    pub nodes: Vec<crate::tls::Issued>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            nodes: 3,
            heartbeat_ms: 100,
            election_timeout_ms: 600,
            snapshot_every: 5_000,
            logs_kept_after_snapshot: 1_000,
            audit: false,
            extra_args: Vec::new(),
            clock_offsets_ms: Vec::new(),
            tls: false,
            config_file: false,
            stderr_files: false,
            binary: None,
        }
    }
}

pub struct Cluster {
    pub ip: Ipv4Addr,
    pub options: ClusterOptions,
    dir: tempfile::TempDir,
    nodes: Vec<Option<ChildGuard>>,
    /// Nodes that run another `lockd` than this build's (see [`Cluster::set_binary`]).
    binaries: std::collections::HashMap<u64, PathBuf>,
    /// Set when the options ask for TLS.
    pub tls: Option<ClusterTls>,
}

impl Cluster {
    /// Starts the nodes and waits until one of them is leader with a quorum.
    pub async fn start(options: ClusterOptions) -> anyhow::Result<Cluster> {
        let mut cluster = Self::launch(options)?;
        cluster.wait_for_leader(Duration::from_secs(20)).await?;
        Ok(cluster)
    }

    /// Starts the nodes and returns at once, for tests of what happens while the cluster forms.
    pub fn launch(options: ClusterOptions) -> anyhow::Result<Cluster> {
        let mut cluster = Cluster {
            ip: random_loopback_ip(),
            options,
            dir: tempfile::tempdir()?,
            nodes: Vec::new(),
            binaries: std::collections::HashMap::new(),
            tls: None,
        };
        if cluster.options.tls {
            let cluster_id = "test".to_owned();
            let peer_ca = crate::tls::TestCa::new(cluster.dir.path(), "peer")?;
            let nodes = (1..=cluster.options.nodes)
                .map(|id| peer_ca.issue_node(&cluster_id, id, cluster.ip.into()))
                .collect::<anyhow::Result<Vec<_>>>()?;
            cluster.tls = Some(ClusterTls {
                cluster_id,
                peer_ca,
                nodes,
            });
        }
        for id in 1..=cluster.options.nodes {
            cluster.nodes.push(None);
            cluster.start_node(id)?;
        }
        Ok(cluster)
    }

    pub async fn start_default() -> anyhow::Result<Cluster> {
        Self::start(ClusterOptions::default()).await
    }

    pub fn addr(&self, id: u64) -> String {
        format!("{}:{}", self.ip, BASE_PORT + id as u16)
    }

    pub fn metrics_addr(&self, id: u64) -> String {
        format!("{}:{}", self.ip, METRICS_BASE_PORT + id as u16)
    }

    /// All client endpoints, comma separated, as `lockctl --endpoints` takes them.
    pub fn endpoints(&self) -> String {
        (1..=self.options.nodes)
            .map(|i| self.addr(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn data_dir(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("node{id}"))
    }

    /// The audit log of node `id` (kept outside its data dir, so wiping the node keeps it).
    pub fn audit_path(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("node{id}.audit.log"))
    }

    /// The `lockd` executable node `id` runs from its next start on, instead of
    /// [`ClusterOptions::binary`] or this build's.
    pub fn set_binary(&mut self, id: u64, binary: PathBuf) {
        self.binaries.insert(id, binary);
    }

    /// Starts (or restarts) node `id` with its data dir as it is.
    pub fn start_node(&mut self, id: u64) -> anyhow::Result<()> {
        let o = &self.options;
        let mut cmd: Command = match self.binaries.get(&id).or(o.binary.as_ref()) {
            Some(path) => Command::new(path),
            None => command("lockd"),
        };
        // The settings every node has, as (flag, values).
        let mut settings: Vec<(&str, Vec<String>)> = vec![
            ("id", vec![id.to_string()]),
            ("listen", vec![self.addr(id)]),
            ("data-dir", vec![self.data_dir(id).display().to_string()]),
            ("metrics-listen", vec![self.metrics_addr(id)]),
            ("heartbeat", vec![format!("{}ms", o.heartbeat_ms)]),
            (
                "election-timeout",
                vec![format!("{}ms", o.election_timeout_ms)],
            ),
            ("snapshot-every", vec![o.snapshot_every.to_string()]),
            (
                "logs-kept-after-snapshot",
                vec![o.logs_kept_after_snapshot.to_string()],
            ),
        ];
        settings.push((
            "peer",
            (1..=o.nodes)
                .map(|peer| format!("{peer}={}", self.addr(peer)))
                .collect(),
        ));
        if o.config_file {
            let file = self.dir.path().join(format!("node{id}.toml"));
            std::fs::write(&file, toml_text(&settings))?;
            cmd.arg("--config").arg(file);
        } else {
            for (flag, values) in &settings {
                for value in values {
                    cmd.arg(format!("--{flag}")).arg(value);
                }
            }
        }
        if o.audit {
            cmd.arg("--audit-log")
                .arg(self.audit_path(id))
                .arg("--audit-key-file")
                .arg(crate::audit::write_key_file(self.dir.path())?);
        }
        if let Some(tls) = &self.tls {
            let node = &tls.nodes[id as usize - 1];
            cmd.arg("--cluster-id")
                .arg(&tls.cluster_id)
                .arg("--tls-cert")
                .arg(&node.cert)
                .arg("--tls-key")
                .arg(&node.key)
                .arg("--peer-ca")
                .arg(&tls.peer_ca.cert_path);
        }
        cmd.args(&o.extra_args);
        if let Some(offset) = o.clock_offsets_ms.get(id as usize - 1) {
            cmd.env("LOCKD_TEST_CLOCK_OFFSET_MS", offset.to_string());
        }
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn,openraft=off");
        }
        if o.stderr_files {
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.stderr_path(id))?;
            cmd.stderr(log);
        }
        let guard = ChildGuard::spawn(format!("lockd-{id}"), cmd)?;
        self.nodes[id as usize - 1] = Some(guard);
        Ok(())
    }

    /// Where node `id`'s stderr goes with [`ClusterOptions::stderr_files`].
    pub fn stderr_path(&self, id: u64) -> PathBuf {
        self.dir.path().join(format!("node{id}.stderr"))
    }

    /// What node `id` wrote to stderr so far (with [`ClusterOptions::stderr_files`]; empty
    /// before it started).
    pub fn stderr(&self, id: u64) -> String {
        std::fs::read_to_string(self.stderr_path(id)).unwrap_or_default()
    }

    /// SIGTERM, as a service manager stops a node, and waits up to `within` for it to exit;
    /// kill -9 after that. Returns whether it exited on its own.
    pub async fn stop(&mut self, id: u64, within: Duration) -> bool {
        let Some(mut node) = self.nodes[id as usize - 1].take() else {
            return true;
        };
        node.signal(Signal::SIGTERM);
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if !node.is_running() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        node.kill();
        false
    }

    /// kill -9.
    pub fn kill(&mut self, id: u64) {
        if let Some(mut node) = self.nodes[id as usize - 1].take() {
            node.kill();
        }
    }

    pub fn pause(&self, id: u64) {
        if let Some(node) = &self.nodes[id as usize - 1] {
            node.signal(Signal::SIGSTOP);
        }
    }

    pub fn resume(&self, id: u64) {
        if let Some(node) = &self.nodes[id as usize - 1] {
            node.signal(Signal::SIGCONT);
        }
    }

    pub fn pid(&self, id: u64) -> Option<u32> {
        self.nodes[id as usize - 1].as_ref().and_then(|n| n.pid())
    }

    /// Kills node `id` and deletes its data dir: it comes back empty and must catch up.
    pub fn wipe(&mut self, id: u64) -> anyhow::Result<()> {
        self.kill(id);
        let dir = self.data_dir(id);
        if dir.exists() {
            std::fs::remove_dir_all(&dir)?;
        }
        Ok(())
    }

    pub fn is_running(&mut self, id: u64) -> bool {
        self.nodes[id as usize - 1]
            .as_mut()
            .is_some_and(|n| n.is_running())
    }

    /// A client channel to node `id`; over TLS (trusting the peer CA, no client certificate)
    /// when the cluster runs with it.
    pub async fn channel(&self, id: u64) -> anyhow::Result<Channel> {
        let Some(tls) = &self.tls else {
            return Ok(Channel::from_shared(format!("http://{}", self.addr(id)))?
                .connect_timeout(Duration::from_secs(1))
                .connect_lazy());
        };
        let ca = std::fs::read(&tls.peer_ca.cert_path)?;
        Ok(Channel::from_shared(format!("https://{}", self.addr(id)))?
            .tls_config(
                tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(ca)),
            )?
            .connect_timeout(Duration::from_secs(1))
            .connect_lazy())
    }

    pub async fn lock_client(&self, id: u64) -> anyhow::Result<LockClient<Channel>> {
        Ok(LockClient::new(self.channel(id).await?))
    }

    pub async fn cluster_client(&self, id: u64) -> anyhow::Result<ClusterClient<Channel>> {
        Ok(ClusterClient::new(self.channel(id).await?))
    }

    pub async fn status(&self, id: u64) -> anyhow::Result<StatusResponse> {
        let mut c = self.cluster_client(id).await?;
        let mut req = tonic::Request::new(StatusRequest {});
        req.set_timeout(Duration::from_secs(2));
        Ok(c.status(req).await?.into_inner())
    }

    /// Waits until a running node reports itself leader and every running node agrees.
    pub async fn wait_for_leader(&mut self, within: Duration) -> anyhow::Result<u64> {
        let deadline = Instant::now() + within;
        loop {
            let mut leaders = Vec::new();
            let mut running = 0;
            for id in 1..=self.options.nodes {
                if !self.is_running(id) {
                    continue;
                }
                running += 1;
                if let Ok(s) = self.status(id).await
                    && s.leader_id != 0
                    && (s.role == "leader") == (s.leader_id == id)
                {
                    leaders.push(s.leader_id);
                }
            }
            let agreed =
                running > 0 && leaders.len() == running && leaders.iter().all(|l| *l == leaders[0]);
            // Followers keep naming a killed leader until their election timeout: require the
            // leader itself to be running.
            if agreed && self.is_running(leaders[0]) {
                return Ok(leaders[0]);
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "no agreed leader within {within:?} (saw {leaders:?} from {running} running nodes)"
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The current leader, as seen by any running node.
    pub async fn leader(&mut self) -> anyhow::Result<u64> {
        self.wait_for_leader(Duration::from_secs(20)).await
    }

    /// Waits until every running node has applied at least `index`.
    pub async fn wait_applied(&mut self, index: u64, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let mut behind = Vec::new();
            for id in 1..=self.options.nodes {
                if !self.is_running(id) {
                    continue;
                }
                match self.status(id).await {
                    Ok(s) if s.applied_index >= index => {}
                    Ok(s) => behind.push((id, s.applied_index)),
                    Err(_) => behind.push((id, 0)),
                }
            }
            if behind.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                anyhow::bail!("nodes {behind:?} did not apply index {index} within {within:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Fetches `/metrics` of node `id`.
    /// With TLS the metrics listener speaks TLS with the node certificate: trust the peer CA.
    pub async fn metrics_text(&self, id: u64) -> anyhow::Result<String> {
        let addr = self.metrics_addr(id);
        match &self.tls {
            Some(tls) => https_get(&addr, "/metrics", &tls.peer_ca.cert_path).await,
            None => http_get(&addr, "/metrics").await,
        }
        .map(|(_, body)| body)
    }
}

/// [`http_get`] over TLS, trusting the CA in `ca` (PEM); the server is named by its IP.
pub async fn https_get(
    addr: &str,
    path: &str,
    ca: &std::path::Path,
) -> anyhow::Result<(u16, String)> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_file_iter(ca)? {
        roots.add(c?)?;
    }
    let config = rustls::ClientConfig::builder_with_provider(
        rustls::crypto::ring::default_provider().into(),
    )
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr))
        .await??;
    let ip: std::net::SocketAddr = addr.parse()?;
    let stream = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(
            rustls::pki_types::ServerName::IpAddress(ip.ip().into()),
            tcp,
        )
        .await?;
    get_over(stream, addr, path).await
}

/// A minimal HTTP/1.0 GET over loopback (no client library needed for two endpoints).
pub async fn http_get(addr: &str, path: &str) -> anyhow::Result<(u16, String)> {
    let s = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr))
        .await??;
    get_over(s, addr, path).await
}

async fn get_over<S>(mut s: S, addr: &str, path: &str) -> anyhow::Result<(u16, String)>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut buf = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut buf)).await??;
    let status: u16 = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("malformed HTTP reply from {addr}{path}: {buf:?}"))?;
    let body = buf
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// `settings` as a lockd config file: one key per flag, a list for a repeated flag.
fn toml_text(settings: &[(&str, Vec<String>)]) -> String {
    let quote = |v: &String| format!("{v:?}");
    settings
        .iter()
        .map(|(flag, values)| match values.as_slice() {
            [one] => format!("{flag} = {}\n", quote(one)),
            many => format!(
                "{flag} = [{}]\n",
                many.iter().map(quote).collect::<Vec<_>>().join(", ")
            ),
        })
        .collect()
}

//! Connections to the cluster and the choice of node for each call.
//!
//! With `--target any` (the default) calls go to every endpoint in turn and followers forward
//! theirs to the leader, as for clients spread over the cluster. With `--target leader` they go
//! straight to the leader, as a leader-following client would send them, so the figures do not
//! include a forwarding hop. Either way a background task asks `Cluster.Status` once a second and
//! follows a leader change (`--target leader` needs it; the report names the leader).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use lockd_api::v1::StatusRequest;
use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::lock_client::LockClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::cli::Target;

/// How long one connection attempt may take before the node counts as down.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a `Cluster.Status` call may take during leader discovery.
const STATUS_TIMEOUT: Duration = Duration::from_millis(800);
/// How often the leader is looked up again during a run.
const LEADER_REFRESH: Duration = Duration::from_secs(1);
/// Sentinel in `leader` while no leader is known among the endpoints: calls go round-robin.
const NO_LEADER: usize = usize::MAX;

/// `connections` channels per endpoint and the index of the endpoint that is the leader.
pub struct Pool {
    endpoints: Vec<String>,
    /// `channels[e]` are the connections to `endpoints[e]`; each is one HTTP/2 connection.
    channels: Vec<Vec<Channel>>,
    /// TLS towards the nodes (`--cacert`); `None` speaks plaintext.
    tls: Option<ClientTlsConfig>,
    target: Target,
    /// Index into `endpoints` of the leader, or `NO_LEADER`.
    leader: AtomicUsize,
    /// Round-robin counter shared by all calls.
    next: AtomicUsize,
}

impl Pool {
    /// Opens the channels (lazily: a node that is down does not stop the run) and finds the
    /// leader; fails when no endpoint names a leader within a few seconds.
    pub async fn connect(
        endpoints: &[String],
        connections: usize,
        target: Target,
        tls: Option<ClientTlsConfig>,
    ) -> anyhow::Result<Arc<Pool>> {
        if endpoints.is_empty() || endpoints.iter().any(|e| e.trim().is_empty()) {
            anyhow::bail!("--endpoints {:?} must list host:port values", endpoints);
        }
        if connections == 0 {
            anyhow::bail!("--connections 0 must be at least 1");
        }
        let mut channels = Vec::new();
        for addr in endpoints {
            channels.push(
                (0..connections)
                    .map(|_| lazy_channel(addr, tls.as_ref()))
                    .collect::<anyhow::Result<Vec<_>>>()?,
            );
        }
        let pool = Arc::new(Pool {
            endpoints: endpoints.to_vec(),
            channels,
            tls,
            target,
            leader: AtomicUsize::new(NO_LEADER),
            next: AtomicUsize::new(0),
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            match pool.find_leader().await {
                Ok(()) => break,
                Err(e) if tokio::time::Instant::now() > deadline => {
                    return Err(e.context(format!(
                        "no leader found at {} within 10s",
                        endpoints.join(",")
                    )));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
        let weak = Arc::downgrade(&pool);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(LEADER_REFRESH).await;
                let Some(pool) = weak.upgrade() else { return };
                // A failed lookup keeps the last known leader: the calls' errors tell the story.
                let _ = pool.find_leader().await;
            }
        });
        Ok(pool)
    }

    /// Asks every endpoint for its view and records the leader's endpoint index.
    async fn find_leader(&self) -> anyhow::Result<()> {
        let mut last_err = None;
        for (i, addr) in self.endpoints.iter().enumerate() {
            let mut client = ClusterClient::new(self.channels[i][0].clone());
            let reply = tokio::time::timeout(STATUS_TIMEOUT, client.status(StatusRequest {})).await;
            let status = match reply {
                Ok(Ok(s)) => s.into_inner(),
                Ok(Err(e)) => {
                    last_err = Some(anyhow::anyhow!("{addr}: {}", e.message()));
                    continue;
                }
                Err(_) => {
                    last_err = Some(anyhow::anyhow!(
                        "{addr}: no Status reply in {STATUS_TIMEOUT:?}"
                    ));
                    continue;
                }
            };
            if status.leader_id == 0 {
                last_err = Some(anyhow::anyhow!("{addr}: knows no leader"));
                continue;
            }
            let leader_addr = status
                .members
                .iter()
                .find(|m| m.id == status.leader_id)
                .map(|m| m.address.clone());
            let index = leader_addr
                .as_ref()
                .and_then(|a| self.endpoints.iter().position(|e| e == a));
            // A leader outside the endpoint list is reached through forwarding.
            self.leader
                .store(index.unwrap_or(NO_LEADER), Ordering::Relaxed);
            return Ok(());
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("no endpoints")))
    }

    /// A new lazily opened connection to `addr`, with the pool's TLS settings.
    pub fn channel_to(&self, addr: &str) -> anyhow::Result<Channel> {
        lazy_channel(addr, self.tls.as_ref())
    }

    /// The endpoints as given, in order.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The leader's address as last seen, for the report.
    pub fn leader_endpoint(&self) -> Option<&str> {
        let i = self.leader.load(Ordering::Relaxed);
        self.endpoints.get(i).map(String::as_str)
    }

    /// A client on the next channel of the node chosen by `--target`.
    pub fn lock_client(&self) -> LockClient<Channel> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let leader = self.leader.load(Ordering::Relaxed);
        let channel = if self.target == Target::Leader && leader != NO_LEADER {
            let conns = &self.channels[leader];
            &conns[n % conns.len()]
        } else {
            let per = self.channels[0].len();
            &self.channels[(n / per) % self.channels.len()][n % per]
        };
        LockClient::new(channel.clone())
    }
}

/// One HTTP/2 connection to `addr`, opened on first use: a node that is down does not stop the
/// run.
pub fn lazy_channel(addr: &str, tls: Option<&ClientTlsConfig>) -> anyhow::Result<Channel> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .with_context(|| format!("endpoint {addr:?} is not host:port"))?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true);
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls.clone())?;
    }
    Ok(endpoint.connect_lazy())
}

/// TLS that trusts the CA in `cacert` (PEM), as lockctl's `--cacert`.
pub fn client_tls(cacert: &std::path::Path) -> anyhow::Result<ClientTlsConfig> {
    let pem = std::fs::read(cacert).with_context(|| format!("--cacert {}", cacert.display()))?;
    Ok(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)))
}

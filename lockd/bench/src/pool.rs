//! Connections to the cluster and the choice of node for each call.
//!
//! With `--target any` (the default) calls go to every endpoint in turn and followers forward
//! theirs to the leader, as for clients spread over the cluster. With `--target leader` they go
//! straight to the leader, as a leader-following client would send them, so the figures do not
//! include a forwarding hop. Either way a background task asks every endpoint for
//! `Cluster.Status` once a second: it follows a leader change (`--target leader` needs it; the
//! report names the leader), and `--target any` leaves out the endpoints that did not answer, as
//! a client with health checks would, so a stopped node costs calls only until the next round.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
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
/// Endpoints the pool can track (one bit each in `up`).
const ENDPOINTS_MAX: usize = 64;

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
    /// Bit `e` set: `endpoints[e]` answered the last Status round. `--target any` sends only to
    /// these (to all while none answered).
    up: AtomicU64,
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
        if endpoints.len() > ENDPOINTS_MAX {
            anyhow::bail!(
                "--endpoints lists {} nodes; lockd-bench takes at most {ENDPOINTS_MAX}",
                endpoints.len()
            );
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
            up: AtomicU64::new(0),
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

    /// Asks every endpoint for its view; records which answered and the leader's endpoint index.
    async fn find_leader(&self) -> anyhow::Result<()> {
        let mut last_err = None;
        let mut up = 0u64;
        let mut leader = None;
        for (i, addr) in self.endpoints.iter().enumerate() {
            let mut client = ClusterClient::new(self.channels[i][0].clone());
            let reply = tokio::time::timeout(STATUS_TIMEOUT, client.status(StatusRequest {})).await;
            let status = match reply {
                Ok(Ok(s)) => {
                    up |= 1 << i;
                    s.into_inner()
                }
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
            if leader.is_some() {
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
            leader = Some(index.unwrap_or(NO_LEADER));
        }
        self.up.store(up, Ordering::Relaxed);
        match leader {
            Some(leader) => {
                self.leader.store(leader, Ordering::Relaxed);
                Ok(())
            }
            None => Err(last_err.unwrap_or_else(|| anyhow::anyhow!("no endpoints"))),
        }
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
            let endpoint = nth_up(
                self.up.load(Ordering::Relaxed),
                n / per,
                self.channels.len(),
            );
            &self.channels[endpoint][n % per]
        };
        LockClient::new(channel.clone())
    }
}

/// The `n`-th endpoint (round-robin) among those whose bit is set in `up`; among all `count`
/// while none is.
fn nth_up(up: u64, n: usize, count: usize) -> usize {
    let answered = up.count_ones() as usize;
    if answered == 0 {
        return n % count;
    }
    let mut skip = n % answered;
    for e in 0..count {
        if up & (1 << e) != 0 {
            if skip == 0 {
                return e;
            }
            skip -= 1;
        }
    }
    // Only bits below `count` are ever set.
    n % count
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

#[cfg(test)]
mod tests {
    use super::nth_up;

    #[test]
    fn calls_skip_the_endpoints_that_did_not_answer() {
        // Node 2 of three is down: nodes 1 and 3 take turns.
        let picks: Vec<usize> = (0..6).map(|n| nth_up(0b101, n, 3)).collect();
        assert_eq!(picks, [0, 2, 0, 2, 0, 2]);
        // All up: every node in turn.
        let picks: Vec<usize> = (0..6).map(|n| nth_up(0b111, n, 3)).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        // None answered yet: every node in turn rather than none.
        let picks: Vec<usize> = (0..4).map(|n| nth_up(0, n, 3)).collect();
        assert_eq!(picks, [0, 1, 2, 0]);
    }
}

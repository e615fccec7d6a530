//! lockd through failures of real node processes: leader loss, lost replies, quorum loss, full
//! restarts, log compaction with lagging and wiped nodes, and wall clocks an hour wrong.
//!
//! # Layout
//! - `leader`: leader loss, lost replies and quorum loss.
//! - `restart`: full restarts, log compaction, lagging and wiped nodes.
//! - `backup_restore`: a backup under load, every member restored with a token floor, members of
//!   another restore or of the old cluster refused.
//! - `clock`: nodes whose wall clocks are an hour ahead or behind take turns as leader.
//! - `names`: members named by DNS names; one comes back on another IP under its name.
//! - `upgrade`: a rolling upgrade from the previous format's lockd (built from git history) to
//!   this build, one node at a time under load.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test, with its message"
)]

mod backup_restore;
mod clock;
mod leader;
mod names;
mod restart;
mod upgrade;

use std::time::{Duration, Instant};

use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{AcquireRequest, AcquireResponse, DescribeRequest};
use lockd_tests::cluster::Cluster;
use tonic::Code;
use tonic::transport::Channel;

/// docs/api.md: a node without quorum answers UNAVAILABLE within 5 s. Allow scheduling slack.
const UNAVAILABLE_BOUND: Duration = Duration::from_millis(5_500);

fn req(resource: &str, request_id: &str, ttl_ms: u64) -> AcquireRequest {
    AcquireRequest {
        resource: resource.into(),
        request_id: request_id.into(),
        lease_ttl_ms: ttl_ms,
        wait_timeout_ms: 0,
        holder: "failover-test".into(),
    }
}

async fn acquire(
    c: &mut LockClient<Channel>,
    resource: &str,
    request_id: &str,
    ttl_ms: u64,
) -> Result<AcquireResponse, tonic::Status> {
    c.acquire(req(resource, request_id, ttl_ms))
        .await
        .map(|r| r.into_inner())
}

/// Retries UNAVAILABLE (no leader yet, outcome unknown) with the same request_id, as a client must.
async fn acquire_retrying(
    cluster: &Cluster,
    nodes: &[u64],
    resource: &str,
    request_id: &str,
    ttl_ms: u64,
) -> AcquireResponse {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut i = 0;
    loop {
        let node = nodes[i % nodes.len()];
        i += 1;
        let mut c = cluster.lock_client(node).await.unwrap();
        match acquire(&mut c, resource, request_id, ttl_ms).await {
            Ok(r) => return r,
            Err(s) if s.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => panic!("acquire {resource} {request_id} on node {node}: {s:?}"),
        }
    }
}

async fn describe(cluster: &Cluster, node: u64, resource: &str) -> lockd_api::v1::DescribeResponse {
    let mut c = cluster.lock_client(node).await.unwrap();
    c.describe(DescribeRequest {
        resource: resource.into(),
    })
    .await
    .unwrap()
    .into_inner()
}

fn others(leader: u64) -> Vec<u64> {
    (1..=3).filter(|i| *i != leader).collect()
}

//! The audit log: each change once, in log order, across a leader change, and never a request id.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::req;
use lockd_api::v1::{DescribeRequest, ReleaseRequest, RenewRequest};
use lockd_tests::cluster::{Cluster, ClusterOptions};
use lockd_tests::poll;
use tonic::Code;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct AuditKey {
    log_index: u64,
    op: String,
    outcome: String,
    resource: String,
    fencing_token: u64,
    request_digest: String,
}

fn read_audit(path: &std::path::Path) -> Vec<(AuditKey, serde_json::Value)> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .map(|l| {
            let v: serde_json::Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("bad audit line {l:?}: {e}"));
            let key = AuditKey {
                log_index: v["log_index"].as_u64().unwrap(),
                op: v["op"].as_str().unwrap().into(),
                outcome: v["outcome"].as_str().unwrap().into(),
                resource: v["resource"].as_str().unwrap_or("").into(),
                fencing_token: v["fencing_token"].as_u64().unwrap_or(0),
                request_digest: v["request_digest"].as_str().unwrap_or("").into(),
            };
            (key, v)
        })
        .collect()
}

/// Goal: the audit log holds each change exactly once, in log order, across a leader change and
/// a restart. Method: a workload of grants, renewals, releases, a queued waiter, an expiry; kill
/// the leader; more workload; restart it (it replays its log); check every node's file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_log_has_each_change_once_in_log_order_across_leader_change() {
    let mut cluster = Cluster::start(ClusterOptions {
        audit: true,
        ..ClusterOptions::default()
    })
    .await
    .unwrap();
    let leader = cluster.leader().await.unwrap();
    let mut granted_tokens = HashSet::new();
    let mut c = cluster.lock_client(leader).await.unwrap();
    for i in 0..10 {
        let g = c
            .acquire(req(&format!("a/{i}"), &format!("a{i}"), 60_000, 0))
            .await
            .unwrap()
            .into_inner();
        granted_tokens.insert(g.fencing_token);
        c.renew(RenewRequest {
            resource: format!("a/{i}"),
            lease_id: g.lease_id.clone(),
            lease_ttl_ms: 0,
        })
        .await
        .unwrap();
        if i % 2 == 0 {
            c.release(ReleaseRequest {
                resource: format!("a/{i}"),
                lease_id: g.lease_id,
            })
            .await
            .unwrap();
        }
    }
    let short = c
        .acquire(req("a/short", "short", 1_000, 0))
        .await
        .unwrap()
        .into_inner();
    granted_tokens.insert(short.fencing_token);
    let err = c
        .acquire(req("a/1", "waiter", 60_000, 500))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    // a/short expires before the leader changes.
    poll::until_async("a/short expired", Duration::from_secs(10), || {
        let mut d = c.clone();
        async move {
            let held = d
                .describe(DescribeRequest {
                    resource: "a/short".into(),
                })
                .await
                .map_err(|e| format!("{e:?}"))?
                .into_inner()
                .held;
            if held {
                Err("still held".to_owned())
            } else {
                Ok(())
            }
        }
    })
    .await;

    cluster.kill(leader);
    cluster
        .wait_for_leader(Duration::from_secs(20))
        .await
        .unwrap();
    let survivor = (1..=3).find(|i| *i != leader).unwrap();
    let mut c = cluster.lock_client(survivor).await.unwrap();
    for i in 0..5 {
        let deadline = Instant::now() + Duration::from_secs(10);
        let g = loop {
            match c
                .acquire(req(&format!("b/{i}"), &format!("b{i}"), 60_000, 0))
                .await
            {
                Ok(g) => break g.into_inner(),
                Err(s) if s.code() == Code::Unavailable && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(s) => panic!("{s:?}"),
            }
        };
        granted_tokens.insert(g.fencing_token);
    }
    cluster.start_node(leader).unwrap();
    let target = cluster.status(survivor).await.unwrap().applied_index;
    cluster
        .wait_applied(target, Duration::from_secs(20))
        .await
        .unwrap();
    // The audit writer is a thread of its own: wait until every node wrote the last grants.
    poll::until(
        "every node's audit log holds every grant",
        Duration::from_secs(10),
        || {
            for id in 1..=3 {
                let grants: HashSet<u64> = read_audit(&cluster.audit_path(id))
                    .iter()
                    .filter(|(k, _)| k.outcome == "granted")
                    .map(|(k, _)| k.fencing_token)
                    .collect();
                if !granted_tokens.is_subset(&grants) {
                    return Err(format!("node {id} has {grants:?} of {granted_tokens:?}"));
                }
            }
            Ok(())
        },
    )
    .await;

    for id in 1..=3 {
        let lines = read_audit(&cluster.audit_path(id));
        let indexes: Vec<u64> = lines.iter().map(|(k, _)| k.log_index).collect();
        assert!(
            indexes.windows(2).all(|w| w[0] <= w[1]),
            "node {id}: not in log order: {indexes:?}"
        );
        let mut seen = HashSet::new();
        for (k, _) in &lines {
            assert!(seen.insert(k.clone()), "node {id}: {k:?} written twice");
        }
        let grants: HashSet<u64> = lines
            .iter()
            .filter(|(k, _)| k.outcome == "granted")
            .map(|(k, _)| k.fencing_token)
            .collect();
        assert_eq!(
            grants, granted_tokens,
            "node {id}: grants in the audit log differ from those clients got"
        );
        let count = |op: &str, outcome: &str| {
            lines
                .iter()
                .filter(|(k, _)| k.op == op && k.outcome == outcome)
                .count()
        };
        assert_eq!(count("renew", "renewed"), 10, "node {id}");
        assert_eq!(count("release", "released"), 5, "node {id}");
        assert_eq!(count("expire", "expired"), 1, "node {id}");
        assert_eq!(count("acquire", "queued"), 1, "node {id}");
        assert_eq!(count("wait", "timed_out"), 1, "node {id}");
        // No payload: lease ids never appear.
        assert!(lines.iter().all(|(_, v)| v.get("lease_id").is_none()));
    }
}

/// Goal: no audit log carries a request id in clear, since a retry with it
/// returns the lease id. Method: acquire with a known id through a follower (forwarded) and the
/// leader, read every replica's audit file, look for the ids and for their keyed digests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue14_finding3_audit_log_never_shows_request_ids() {
    let mut cluster = Cluster::start(ClusterOptions {
        audit: true,
        ..ClusterOptions::default()
    })
    .await
    .unwrap();
    let leader = cluster.leader().await.unwrap();
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let ids = [
        "f3-bearer-0f1e2d3c4b5a69788796a5b4",
        "f3-bearer-waiter-1234",
    ];
    let mut c = cluster.lock_client(follower).await.unwrap();
    c.acquire(req("f3/r", ids[0], 60_000, 0)).await.unwrap();
    let mut c = cluster.lock_client(leader).await.unwrap();
    let err = c
        .acquire(req("f3/r", ids[1], 60_000, 300))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
    let target = cluster.status(leader).await.unwrap().applied_index;
    cluster
        .wait_applied(target, Duration::from_secs(10))
        .await
        .unwrap();
    // The audit writer is a thread of its own: wait until every node wrote both requests.
    let digests = ids.map(lockd_tests::audit::request_digest);
    poll::until(
        "every node's audit log names both requests",
        Duration::from_secs(10),
        || {
            for id in 1..=3 {
                let text = std::fs::read_to_string(cluster.audit_path(id)).unwrap_or_default();
                if !digests.iter().all(|d| text.contains(d)) {
                    return Err(format!("node {id}:\n{text}"));
                }
            }
            Ok(())
        },
    )
    .await;
    for id in 1..=3 {
        let text = std::fs::read_to_string(cluster.audit_path(id)).unwrap();
        for rid in ids {
            assert!(
                !text.contains(rid),
                "node {id}: request id {rid} in clear:\n{text}"
            );
            let digest = lockd_tests::audit::request_digest(rid);
            assert!(
                text.contains(&digest),
                "node {id}: no digest of {rid}:\n{text}"
            );
        }
    }
}

//! Readiness and status: `/readyz` follows quorum, `lockctl status` shows each node and the hot
//! resources.

use std::time::{Duration, Instant};

use crate::req;
use lockd_tests::cluster::{Cluster, http_get};

/// Goal: /readyz turns unready when the node loses its quorum and ready again after; /healthz
/// stays up. Method: kill two nodes, poll the survivor, restart them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_quorum() {
    let mut cluster = Cluster::start_default().await.unwrap();
    let addr = cluster.metrics_addr(1);
    assert_eq!(http_get(&addr, "/readyz").await.unwrap().0, 200);
    cluster.kill(2);
    cluster.kill(3);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, body) = http_get(&addr, "/readyz").await.unwrap();
        if code == 503 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still ready without quorum: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(http_get(&addr, "/healthz").await.unwrap().0, 200);
    cluster.start_node(2).unwrap();
    cluster.start_node(3).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (code, body) = http_get(&addr, "/readyz").await.unwrap();
        if code == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not ready after quorum came back: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Goal: `lockctl status` shows every node's role, term, indexes and lag, and the hot resources.
/// Method: a held resource with two waiters; `lockctl --json status`; parse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockctl_status_shows_each_node_and_hot_resources() {
    let cluster = Cluster::start_default().await.unwrap();
    let mut c = cluster.lock_client(1).await.unwrap();
    c.acquire(req("hot/r", "h0", 60_000, 0)).await.unwrap();
    let mut waiting = Vec::new();
    for i in 0..2 {
        let mut w = cluster.lock_client(1).await.unwrap();
        waiting.push(tokio::spawn(async move {
            w.acquire(req("hot/r", &format!("hw{i}"), 60_000, 30_000))
                .await
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while cluster.status(1).await.unwrap().waiters < 2 {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = std::process::Command::new(lockd_tests::process::bin_path("lockctl"))
        .args(["--endpoints", &cluster.endpoints(), "--json", "status"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let nodes = v["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 3, "{v}");
    assert_eq!(
        nodes.iter().filter(|n| n["role"] == "leader").count(),
        1,
        "{v}"
    );
    for n in nodes {
        assert!(
            n["term"].as_u64().unwrap() >= 1
                && n["applied_index"].as_u64().is_some()
                && n["lag"].as_u64().is_some(),
            "{n}"
        );
        assert_eq!(n["active_locks"], 1);
        assert_eq!(n["waiters"], 2);
    }
    let hot = v["hot_by_waiters"].as_array().unwrap();
    assert_eq!(hot[0]["resource"], "hot/r");
    assert_eq!(hot[0]["waiters"], 2);
    for w in waiting {
        w.abort();
    }
}

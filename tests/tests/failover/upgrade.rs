//! Rolling upgrade: a cluster of the previous format's lockd, built from this repository's
//! history (`lockd_tests::previous`), is upgraded to this build one node at a time while clients
//! acquire, renew and release through every node.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockd_client::{AcquireOptions, Client};
use lockd_tests::cluster::{Cluster, ClusterOptions};
use lockd_tests::process::bin_path;

/// What the load saw: every grant's token per resource in order, and every failed call.
#[derive(Default)]
struct Seen {
    tokens: HashMap<String, Vec<u64>>,
    failures: Vec<String>,
    cycles: u64,
}

/// Goal: an upgrade of one node at a time, from the previous peer protocol to this build, under
/// a mixed load through all nodes, fails no call (the client retries UNAVAILABLE with the same
/// request id, as docs/api.md asks), repeats no token and keeps every token rising per
/// resource; nodes of both versions replicate to each other in both directions, snapshots
/// included, and the upgraded cluster serves on. Method: three nodes of commit
/// `previous::PREVIOUS_FORMAT_COMMIT`, snapshots every 200 entries; four clients in a loop of
/// acquire, renew, release through all nodes. The two followers in turn: stopped with SIGTERM,
/// left down until the log moved 300 entries on (so they come back by snapshot from the old
/// leader), started from their data dir with this build. Then the old leader: stopped, so a new
/// node leads; started again with the *previous* build after 300 entries (a new leader's
/// snapshot and entries reach an old node); stopped once more and started with this build.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_upgrade_from_the_previous_format_under_load_fails_no_call() {
    let previous = lockd_tests::previous::lockd_binary().unwrap();
    let current = bin_path("lockd");
    let mut cluster = Cluster::start(ClusterOptions {
        binary: Some(previous.clone()),
        snapshot_every: 200,
        logs_kept_after_snapshot: 20,
        ..ClusterOptions::default()
    })
    .await
    .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut workers = Vec::new();
    for w in 0..4 {
        // Each client lists the nodes in another order, so calls land on every node.
        let mut endpoints: Vec<String> = (1..=3).map(|id| cluster.addr(id)).collect();
        endpoints.rotate_left(w % 3);
        let client = Client::new(endpoints).unwrap();
        workers.push(tokio::spawn(load(client, w, stop.clone(), seen.clone())));
    }

    let old_leader = cluster.leader().await.unwrap();
    let mut steps: Vec<(u64, &std::path::Path)> = (1..=3)
        .filter(|id| *id != old_leader)
        .map(|id| (id, current.as_path()))
        .collect();
    steps.push((old_leader, previous.as_path()));
    steps.push((old_leader, current.as_path()));
    for (id, binary) in steps {
        assert!(
            cluster.stop(id, Duration::from_secs(10)).await,
            "node {id} did not stop within 10 s of SIGTERM"
        );
        let leader = cluster
            .wait_for_leader(Duration::from_secs(30))
            .await
            .unwrap();
        // Down while the log moves on past the next snapshot and its purge.
        let from = cluster.status(leader).await.unwrap().commit_index;
        let deadline = Instant::now() + Duration::from_secs(60);
        while cluster.status(leader).await.unwrap().commit_index < from + 300 {
            assert!(
                Instant::now() < deadline,
                "the log did not move on while node {id} was down"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        cluster.set_binary(id, binary.to_path_buf());
        cluster.start_node(id).unwrap();
        let leader = cluster
            .wait_for_leader(Duration::from_secs(30))
            .await
            .unwrap();
        let commit = cluster.status(leader).await.unwrap().commit_index;
        cluster
            .wait_applied(commit, Duration::from_secs(30))
            .await
            .unwrap();
        assert!(
            snapshot_installs(&cluster, id).await > 0,
            "node {id} caught up without a snapshot: the test did not cover snapshots"
        );
        // The mixed cluster serves on after the catch-up.
        let cycles = seen.lock().unwrap().cycles;
        let deadline = Instant::now() + Duration::from_secs(30);
        while seen.lock().unwrap().cycles < cycles + 40 {
            assert!(
                Instant::now() < deadline,
                "no progress of the load after node {id} came back"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.await.unwrap();
    }

    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert!(
        seen.failures.is_empty(),
        "{} failed calls during the rolling upgrade (first ones): {:?}",
        seen.failures.len(),
        &seen.failures[..seen.failures.len().min(10)]
    );
    let mut all = HashSet::new();
    for (resource, tokens) in &seen.tokens {
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "{resource}: tokens did not rise: {tokens:?}"
        );
        for t in tokens {
            assert!(all.insert(*t), "token {t} was granted twice");
        }
    }
    // Every node now runs this build, announces it, and follows the one leader.
    let leader = cluster.leader().await.unwrap();
    for id in 1..=3 {
        let status = cluster.status(id).await.unwrap();
        assert_eq!(status.leader_id, leader, "node {id}: {status:?}");
    }
    let metrics = cluster.metrics_text(leader).await.unwrap();
    assert!(
        metrics.contains("lockd_cluster_peer_protocol 4"),
        "the upgraded cluster's leader does not report protocol 4 for every member:\n{}",
        metrics
            .lines()
            .filter(|l| l.contains("peer_protocol"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// How many snapshots node `id` installed from a leader since it (re)started
/// (`lockd_snapshot_duration_seconds{kind="install"}`); 0 when it cannot be read.
async fn snapshot_installs(cluster: &Cluster, id: u64) -> u64 {
    let Ok(text) = cluster.metrics_text(id).await else {
        return 0;
    };
    text.lines()
        .find(|l| l.starts_with("lockd_snapshot_duration_seconds_count{kind=\"install\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// One client's loop of acquire, renew, release over its own two resources, recording tokens
/// and every call that failed (a call fails only after the client's own retries).
async fn load(client: Client, worker: usize, stop: Arc<AtomicBool>, seen: Arc<Mutex<Seen>>) {
    let mut i = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let resource = format!("upgrade/{worker}/{}", i % 2);
        i += 1;
        let lease = match client
            .acquire(
                &resource,
                AcquireOptions::default().ttl(Duration::from_secs(30)),
            )
            .await
        {
            Ok(lease) => lease,
            Err(e) => {
                seen.lock()
                    .unwrap()
                    .failures
                    .push(format!("acquire {resource}: {e}"));
                continue;
            }
        };
        seen.lock()
            .unwrap()
            .tokens
            .entry(resource.clone())
            .or_default()
            .push(lease.fencing_token.0);
        if let Err(e) = client.renew(&resource, &lease.lease_id, None).await {
            seen.lock()
                .unwrap()
                .failures
                .push(format!("renew {resource}: {e}"));
        }
        // `false` only if an earlier attempt of this call already released it, after a
        // lost reply: the lease is gone either way, which is what counts.
        if let Err(e) = client.release(&resource, &lease.lease_id).await {
            seen.lock()
                .unwrap()
                .failures
                .push(format!("release {resource}: {e}"));
        }
        seen.lock().unwrap().cycles += 1;
    }
}

//! Full restarts and log compaction, with lagging and wiped nodes: leases, tokens and dedup
//! records survive, and a node that lost its disk cannot help an older leader.

use std::time::{Duration, Instant};

use crate::{acquire, acquire_retrying, describe, others};
use lockd_api::v1::ReleaseRequest;
use lockd_tests::cluster::{Cluster, ClusterOptions};

/// Goal: a full restart from the data dirs keeps leases, tokens and dedup records, and the next
/// token is larger than every earlier one. Method: grants, kill -9 all, restart all, compare.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_restart_keeps_leases_tokens_and_dedup() {
    let mut cluster = Cluster::start_default().await.unwrap();
    let mut c = cluster.lock_client(1).await.unwrap();
    let mut grants = Vec::new();
    for i in 0..20 {
        grants.push(
            acquire(&mut c, &format!("restart/{i}"), &format!("rs-{i}"), 120_000)
                .await
                .unwrap(),
        );
    }
    // Some released, so the table holds both live and gone leases.
    for (i, g) in grants.iter().enumerate().take(5) {
        c.release(ReleaseRequest {
            resource: format!("restart/{i}"),
            lease_id: g.lease_id.clone(),
        })
        .await
        .unwrap();
    }
    let max = grants.iter().map(|g| g.fencing_token).max().unwrap();
    for id in 1..=3 {
        cluster.kill(id);
    }
    for id in 1..=3 {
        cluster.start_node(id).unwrap();
    }
    cluster
        .wait_for_leader(Duration::from_secs(30))
        .await
        .unwrap();
    for (i, g) in grants.iter().enumerate() {
        let d = describe(&cluster, 2, &format!("restart/{i}")).await;
        assert_eq!(d.held, i >= 5, "restart/{i}: {d:?}");
        if i >= 5 {
            assert_eq!(d.fencing_token, g.fencing_token);
        }
        // The dedup record survived: the retry answers with the original lease.
        let retry = acquire_retrying(
            &cluster,
            &[3],
            &format!("restart/{i}"),
            &format!("rs-{i}"),
            120_000,
        )
        .await;
        assert_eq!(retry.lease_id, g.lease_id);
        assert_eq!(retry.fencing_token, g.fencing_token);
    }
    let next = acquire_retrying(&cluster, &[1], "restart/new", "rs-new", 10_000).await;
    assert!(
        next.fencing_token > max,
        "token {} after restart, max before {max}",
        next.fencing_token
    );
}

/// Goal: snapshots compact the log; a restarted node and a node with an empty data dir both catch
/// up (by snapshot) and agree on the state. Method: snapshot every 20 entries, keep 5; run many
/// commands while node 3 is down; restart it; wipe node 2; compare Status of all nodes; then make
/// a caught-up node leader and read through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_then_lagging_and_wiped_nodes_catch_up() {
    let mut cluster = Cluster::start(ClusterOptions {
        snapshot_every: 20,
        logs_kept_after_snapshot: 5,
        ..ClusterOptions::default()
    })
    .await
    .unwrap();
    let leader = cluster.leader().await.unwrap();
    let lagging = others(leader)[1];
    let wiped = others(leader)[0];
    let mut c = cluster.lock_client(leader).await.unwrap();
    for i in 0..40 {
        acquire(
            &mut c,
            &format!("compact/a{i}"),
            &format!("ca-{i}"),
            120_000,
        )
        .await
        .unwrap();
    }
    cluster.kill(lagging);
    let mut held = Vec::new();
    for i in 0..120 {
        let r = format!("compact/b{i}");
        let g = acquire(&mut c, &r, &format!("cb-{i}"), 120_000)
            .await
            .unwrap();
        if i % 3 == 0 {
            c.release(ReleaseRequest {
                resource: r,
                lease_id: g.lease_id,
            })
            .await
            .unwrap();
        } else {
            held.push((r, g.fencing_token));
        }
    }
    cluster.start_node(lagging).unwrap();
    cluster.wipe(wiped).unwrap();
    cluster.start_node(wiped).unwrap();
    let target = cluster.status(leader).await.unwrap().applied_index;
    cluster
        .wait_applied(target, Duration::from_secs(30))
        .await
        .unwrap();
    let statuses: Vec<_> = futures_join(&cluster).await;
    for s in &statuses {
        assert_eq!(s.active_locks, statuses[0].active_locks, "{statuses:?}");
        assert_eq!(s.active_locks, 40 + held.len() as u64);
    }
    // Hand leadership to a caught-up node by stopping the leader, then read through it.
    cluster.kill(leader);
    cluster
        .wait_for_leader(Duration::from_secs(30))
        .await
        .unwrap();
    for (r, token) in held.iter().step_by(7) {
        let d = describe(&cluster, wiped, r).await;
        assert!(d.held && d.fencing_token == *token, "{r}: {d:?}");
    }
}

async fn futures_join(cluster: &Cluster) -> Vec<lockd_api::v1::StatusResponse> {
    let mut out = Vec::new();
    for id in 1..=3 {
        out.push(cluster.status(id).await.unwrap());
    }
    out
}

/// Goal: a node that lost its disk does not help elect a leader that lacks
/// entries committed while it held them; tokens never repeat. Method: this schedule. X
/// leads; Y is stopped while grants commit on {X, W}; then X dies and W is wiped; W and Y start.
/// No leader may appear among them (on main, W votes with its empty log after its four election
/// timeouts and Y wins). X returns; the grants are still held and the next token is larger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue14_finding7_wiped_node_does_not_elect_a_leader_without_committed_entries() {
    let mut cluster = Cluster::start_default().await.unwrap();
    let x = cluster.leader().await.unwrap();
    let (w, y) = (others(x)[0], others(x)[1]);
    let mut c = cluster.lock_client(x).await.unwrap();
    for i in 0..5 {
        acquire(
            &mut c,
            &format!("f7/all{i}"),
            &format!("f7-all-{i}"),
            120_000,
        )
        .await
        .unwrap();
    }
    let applied = cluster.status(x).await.unwrap().applied_index;
    cluster
        .wait_applied(applied, Duration::from_secs(10))
        .await
        .unwrap();

    // Phase 1: Y lags; grants commit on {X, W} only.
    cluster.kill(y);
    let mut held = Vec::new();
    for i in 0..20 {
        let r = format!("f7/xw{i}");
        let g = acquire(&mut c, &r, &format!("f7-xw-{i}"), 120_000)
            .await
            .unwrap();
        held.push((r, g.fencing_token));
    }
    let max_token = held.iter().map(|(_, t)| *t).max().unwrap();

    // Phase 2: X dies, W loses its disk; W and Y come back.
    cluster.kill(x);
    cluster.wipe(w).unwrap();
    cluster.start_node(w).unwrap();
    cluster.start_node(y).unwrap();
    let window = Duration::from_millis(12 * cluster.options.election_timeout_ms);
    let until = Instant::now() + window;
    while Instant::now() < until {
        for id in [w, y] {
            if let Ok(s) = cluster.status(id).await {
                assert!(
                    s.role != "leader",
                    "node {id} became leader of term {} without the entries committed on \
                     {{{x}, {w}}} (its applied index {})",
                    s.term,
                    s.applied_index
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Phase 3: X returns; nothing committed is lost and tokens keep growing.
    cluster.start_node(x).unwrap();
    cluster
        .wait_for_leader(Duration::from_secs(30))
        .await
        .unwrap();
    let g = acquire_retrying(&cluster, &[x, w, y], "f7/after", "f7-after", 120_000).await;
    assert!(
        g.fencing_token > max_token,
        "token {} repeats: {max_token} was issued before",
        g.fencing_token
    );
    for (r, token) in &held {
        let d = describe(&cluster, y, r).await;
        assert!(d.held && d.fencing_token == *token, "{r}: {d:?}");
    }
}

/// Goal: two wiped nodes of three (beyond what Raft tolerates) do not complete each other's
/// proof: an answer from a peer that is itself rejoining does not count, so neither wiped node
/// takes the lagging third node's log as the truth, and no leader without the committed entries
/// appears. Method: X leads; Y is stopped while grants commit on {X, W}; X and W both lose their
/// disks; all three start. No node may become leader within twelve election timeouts (before
/// the fix each wiped node counted the other's empty answer, voted for Y, and Y led without the
/// grants, so their tokens would be issued again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_wiped_node_does_not_complete_the_proof() {
    let mut cluster = Cluster::start_default().await.unwrap();
    let x = cluster.leader().await.unwrap();
    let (w, y) = (others(x)[0], others(x)[1]);
    let mut c = cluster.lock_client(x).await.unwrap();
    acquire(&mut c, "g2/all", "g2-all", 120_000).await.unwrap();
    let applied = cluster.status(x).await.unwrap().applied_index;
    cluster
        .wait_applied(applied, Duration::from_secs(10))
        .await
        .unwrap();

    // Phase 1: Y lags; grants commit on {X, W} only.
    cluster.kill(y);
    for i in 0..10 {
        acquire(&mut c, &format!("g2/xw{i}"), &format!("g2-xw-{i}"), 120_000)
            .await
            .unwrap();
    }

    // Phase 2: X and W lose their disks; all three start.
    cluster.kill(x);
    cluster.kill(w);
    cluster.wipe(x).unwrap();
    cluster.wipe(w).unwrap();
    for id in [x, w, y] {
        cluster.start_node(id).unwrap();
    }
    let window = Duration::from_millis(12 * cluster.options.election_timeout_ms);
    let until = Instant::now() + window;
    // Every node must keep answering: a node that stopped answering proves nothing.
    let mut answers = [0u32; 3];
    while Instant::now() < until {
        for (k, id) in [x, w, y].into_iter().enumerate() {
            if let Ok(s) = cluster.status(id).await {
                answers[k] += 1;
                assert!(
                    s.role != "leader",
                    "node {id} became leader of term {} although the entries committed on \
                     {{{x}, {w}}} were lost with their disks (its applied index {})",
                    s.term,
                    s.applied_index
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (k, id) in [x, w, y].into_iter().enumerate() {
        assert!(cluster.is_running(id), "node {id} exited during the window");
        assert!(
            answers[k] >= 10,
            "node {id} answered Status only {} times in {window:?}",
            answers[k]
        );
    }
}

/// Goal: all three nodes restarted right after a first bootstrap, while the followers may still
/// be rejoining (not yet past a commit of the new leader's own term), form the cluster again.
/// Before the proof was kept on disk, each follower restarted with its rejoining flag and asked
/// its peers again, found only one peer that kept its log (the old leader) and one rejoining
/// peer that already held entries, which is neither a proof nor a first bootstrap: the cluster
/// waited for good. Method: launch three empty nodes, kill all of them the moment any reports
/// itself leader, restart them; several rounds, since the window is short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_nodes_restarted_right_after_the_first_bootstrap_form_the_cluster_again() {
    for round in 1..=4 {
        let mut cluster = Cluster::launch(ClusterOptions::default()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        'formed: loop {
            assert!(
                Instant::now() < deadline,
                "round {round}: no leader at first"
            );
            for id in 1..=3 {
                if cluster.status(id).await.is_ok_and(|s| s.role == "leader") {
                    break 'formed;
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for id in 1..=3 {
            cluster.kill(id);
        }
        for id in 1..=3 {
            cluster.start_node(id).unwrap();
        }
        let leader = cluster
            .wait_for_leader(Duration::from_secs(20))
            .await
            .unwrap_or_else(|e| panic!("round {round}: after the restart: {e}"));
        // Served, not only elected (UNAVAILABLE retried for up to 20 s).
        acquire_retrying(
            &cluster,
            &[leader],
            "boot/r",
            &format!("boot-{round}"),
            10_000,
        )
        .await;
    }
}

/// Polls `nodes` until one of them reports itself leader in a term above `above`.
async fn leader_among(
    cluster: &Cluster,
    nodes: &[u64],
    above: u64,
    within: Duration,
) -> (u64, u64) {
    let deadline = Instant::now() + within;
    loop {
        for id in nodes {
            if let Ok(s) = cluster.status(*id).await
                && s.role == "leader"
                && s.term > above
            {
                return (*id, s.term);
            }
        }
        assert!(
            Instant::now() < deadline,
            "no leader among {nodes:?} in a term above {above} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Goal (a wiped node forgets its term): a deposed leader of an
/// older term cannot commit through a node that lost its disk. Method: A leads in term t and is
/// paused; B and C elect a leader in a newer term that grants on {B, C}; C loses its disk and
/// restarts, the new leader dies, and A resumes believing it still leads in term t. On main, C
/// (back at term 1) followed A, and A granted the held resources again with repeating tokens.
/// Now C refuses every message until peers that must include a member of the newer term's
/// majority have told it that term; once the new leader returns, nothing committed is lost and
/// tokens keep growing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review14_a_wiped_node_does_not_follow_a_deposed_leader_of_an_older_term() {
    let mut cluster = Cluster::start_default().await.unwrap();
    // A few leader changes, so A's term is well above the term a restarted empty node begins at.
    for _ in 0..3 {
        let l = cluster.leader().await.unwrap();
        cluster.kill(l);
        cluster
            .wait_for_leader(Duration::from_secs(20))
            .await
            .unwrap();
        cluster.start_node(l).unwrap();
    }
    let a = cluster.leader().await.unwrap();
    let t = cluster.status(a).await.unwrap().term;
    let applied = cluster.status(a).await.unwrap().applied_index;
    cluster
        .wait_applied(applied, Duration::from_secs(10))
        .await
        .unwrap();

    // A is paused; B and C elect a newer leader, which grants on {B, C}.
    cluster.pause(a);
    let (l2, t2) = leader_among(&cluster, &others(a), t, Duration::from_secs(20)).await;
    let c = others(a).into_iter().find(|id| *id != l2).unwrap();
    let mut client = cluster.lock_client(l2).await.unwrap();
    let mut held = Vec::new();
    for i in 0..10 {
        let r = format!("r14/held{i}");
        let g = acquire(&mut client, &r, &format!("r14-held-{i}"), 120_000)
            .await
            .unwrap();
        held.push((r, g.fencing_token));
    }
    let max_token = held.iter().map(|(_, t)| *t).max().unwrap();
    let applied = cluster.status(l2).await.unwrap().applied_index;
    let until = Instant::now() + Duration::from_secs(10);
    while cluster.status(c).await.unwrap().applied_index < applied {
        assert!(Instant::now() < until, "node {c} did not apply {applied}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // C loses its disk, the new leader dies, A wakes up still leading in term t.
    cluster.wipe(c).unwrap();
    cluster.start_node(c).unwrap();
    cluster.kill(l2);
    cluster.resume(a);
    let until = Instant::now() + Duration::from_millis(8 * cluster.options.election_timeout_ms);
    let mut attempt = 0;
    while Instant::now() < until {
        attempt += 1;
        let (r, _) = &held[attempt % held.len()];
        for node in [a, c] {
            let Ok(mut cl) = cluster.lock_client(node).await else {
                continue;
            };
            let id = format!("r14-stale-{node}-{attempt}");
            let call = acquire(&mut cl, r, &id, 120_000);
            if let Ok(Ok(g)) = tokio::time::timeout(Duration::from_secs(1), call).await {
                panic!(
                    "node {node} granted {r}, held since term {t2}, with token {} (highest \
                     token issued: {max_token}); A's term was {t}",
                    g.fencing_token
                );
            }
        }
    }

    // The newer leader's node returns: what it committed is all there, tokens keep growing.
    cluster.start_node(l2).unwrap();
    cluster
        .wait_for_leader(Duration::from_secs(30))
        .await
        .unwrap();
    let leader = cluster.leader().await.unwrap();
    for (r, token) in &held {
        let d = describe(&cluster, leader, r).await;
        assert!(d.held && d.fencing_token == *token, "{r}: {d:?}");
    }
    let g = acquire_retrying(&cluster, &[a, l2, c], "r14/after", "r14-after", 120_000).await;
    assert!(
        g.fencing_token > max_token,
        "token {} repeats: {max_token} was issued before",
        g.fencing_token
    );
}

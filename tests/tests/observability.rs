//! Metrics, the audit log and readiness of real lockd nodes.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use lockd_api::v1::{AcquireRequest, ReleaseRequest, RenewRequest};
use lockd_tests::cluster::{Cluster, ClusterOptions, http_get};
use lockd_tests::poll;
use tonic::Code;

fn req(resource: &str, request_id: &str, ttl_ms: u64, wait_ms: u64) -> AcquireRequest {
    AcquireRequest {
        resource: resource.into(),
        request_id: request_id.into(),
        lease_ttl_ms: ttl_ms,
        wait_timeout_ms: wait_ms,
        holder: "obs".into(),
    }
}

/// The value of one sample line (`name{labels} value`) in Prometheus text, 0 if absent.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Goal: after a scripted workload, /metrics shows exactly its counts. Method: on one node,
/// 10 grants (2 of them with 1 s ttl, left to expire), 3 held answers, 1 renew of an expired
/// lease; read the node's /metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_a_scripted_workload_exactly() {
    let cluster = Cluster::start_default().await.unwrap();
    let node = 2;
    let mut c = cluster.lock_client(node).await.unwrap();
    let mut short = Vec::new();
    for i in 0..10 {
        let ttl = if i < 2 { 1_000 } else { 60_000 };
        let g = c
            .acquire(req(&format!("m/{i}"), &format!("m{i}"), ttl, 0))
            .await
            .unwrap()
            .into_inner();
        if i < 2 {
            short.push(g);
        }
    }
    for i in 0..3 {
        let e = c
            .acquire(req("m/5", &format!("held{i}"), 60_000, 0))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Aborted);
    }
    tokio::time::sleep(Duration::from_millis(1_800)).await;
    let e = c
        .renew(RenewRequest {
            resource: "m/0".into(),
            lease_id: short[0].lease_id.clone(),
            lease_ttl_ms: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let text = cluster.metrics_text(node).await.unwrap();
    assert_eq!(
        sample(&text, r#"lockd_requests_total{op="acquire",outcome="ok"}"#),
        10.0,
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            r#"lockd_requests_total{op="acquire",outcome="held"}"#
        ),
        3.0
    );
    assert_eq!(
        sample(
            &text,
            r#"lockd_requests_total{op="renew",outcome="not_found"}"#
        ),
        1.0
    );
    assert_eq!(sample(&text, "lockd_renew_failures_total"), 1.0);
    assert_eq!(sample(&text, "lockd_lease_expirations_total"), 2.0);
    assert_eq!(sample(&text, "lockd_active_locks"), 8.0);
    assert!(
        sample(
            &text,
            r#"lockd_request_duration_seconds_bucket{op="acquire",le="0.001"}"#
        ) >= 0.0
    );
    assert!(
        text.contains(r#"lockd_request_duration_seconds_bucket{op="acquire",le="10"}"#),
        "buckets up to 10 s"
    );
    assert_eq!(
        sample(
            &text,
            r#"lockd_request_duration_seconds_count{op="acquire"}"#
        ),
        13.0
    );
    // Other nodes did not count these calls, but applied the same expirations.
    let other = cluster.metrics_text(3).await.unwrap();
    assert_eq!(
        sample(&other, r#"lockd_requests_total{op="acquire",outcome="ok"}"#),
        0.0
    );
    assert_eq!(sample(&other, "lockd_lease_expirations_total"), 2.0);
    // Exactly one node says it leads; it timed the commits.
    let mut leaders = Vec::new();
    for id in 1..=3 {
        let text = cluster.metrics_text(id).await.unwrap();
        if sample(&text, "lockd_is_leader") == 1.0 {
            assert!(
                sample(&text, "lockd_raft_commit_duration_seconds_count") >= 1.0,
                "{text}"
            );
            leaders.push(id);
        }
    }
    assert_eq!(leaders.len(), 1, "{leaders:?}");
}

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
    tokio::time::sleep(Duration::from_millis(1_500)).await; // a/short expires

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

/// The value of a sample whose name and labels contain every part of `parts` (labels in any
/// order), if any.
fn sample_with(text: &str, name: &str, parts: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            let series = l.rsplit_once(' ').map_or("", |(s, _)| s);
            (series == name || series.starts_with(&format!("{name}{{")))
                && parts.iter().all(|p| series.contains(p))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Goal: what operators watch is exported, with sane values: build info, log fsync and
/// snapshot durations (built, and installed on a wiped member), snapshot and log sizes, disk
/// space of the data dir, replication lag on the leader and the clock offset. Method: a cluster
/// that snapshots every 20 entries; 60 grants while node 3 is down; node 3 wiped and restarted
/// catches up by snapshot; scrape every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_metrics_show_storage_snapshots_disk_and_lag() {
    let mut cluster = Cluster::start(ClusterOptions {
        snapshot_every: 20,
        logs_kept_after_snapshot: 0,
        ..ClusterOptions::default()
    })
    .await
    .unwrap();
    let leader = cluster.leader().await.unwrap();
    let lagging = (1..=3).find(|i| *i != leader).unwrap();
    cluster.kill(lagging);
    let mut c = cluster.lock_client(leader).await.unwrap();
    for i in 0..60 {
        c.acquire(req(&format!("ops/{i}"), &format!("ops{i}"), 60_000, 0))
            .await
            .unwrap();
    }
    let text = cluster.metrics_text(leader).await.unwrap();
    assert_eq!(
        sample_with(&text, "lockd_build_info", &[env!("CARGO_PKG_VERSION")]),
        Some(1.0),
        "{text}"
    );
    let syncs = sample_with(&text, "lockd_log_fsync_duration_seconds_count", &[]).unwrap_or(0.0);
    assert!(syncs >= 1.0, "no log fsync recorded:\n{text}");
    let built = sample_with(
        &text,
        "lockd_snapshot_duration_seconds_count",
        &["kind=\"build\""],
    );
    assert!(built.unwrap_or(0.0) >= 1.0, "no snapshot built:\n{text}");
    assert!(sample_with(&text, "lockd_snapshot_size_bytes", &[]).unwrap_or(0.0) > 0.0);
    assert!(sample_with(&text, "lockd_log_size_bytes", &[]).unwrap_or(0.0) > 0.0);
    let free = sample_with(&text, "lockd_data_dir_free_bytes", &[]).unwrap_or(0.0);
    let capacity = sample_with(&text, "lockd_data_dir_capacity_bytes", &[]).unwrap_or(0.0);
    assert!(free > 0.0 && capacity >= free, "free {free} of {capacity}");
    // The leader sees the killed member fall behind by at least the 60 grants.
    let peer = format!("peer=\"{lagging}\"");
    let lag = sample_with(&text, "lockd_replication_lag_entries", &[&peer]).unwrap_or(0.0);
    assert!(lag >= 60.0, "lag of node {lagging}: {lag}\n{text}");
    let offset = sample_with(&text, "lockd_clock_offset_seconds", &[]).expect("clock offset");
    assert!(offset.abs() < 5.0, "clock offset {offset} s on one machine");

    // Wiped, the member catches up from the leader's snapshot (its log was purged).
    cluster.wipe(lagging).unwrap();
    cluster.start_node(lagging).unwrap();
    let target = cluster.status(leader).await.unwrap().applied_index;
    cluster
        .wait_applied(target, Duration::from_secs(30))
        .await
        .unwrap();
    let text = cluster.metrics_text(lagging).await.unwrap();
    let installed = sample_with(
        &text,
        "lockd_snapshot_duration_seconds_count",
        &["kind=\"install\""],
    );
    assert!(
        installed.unwrap_or(0.0) >= 1.0,
        "no snapshot installed:\n{text}"
    );
    poll::until_async(
        "the leader sees the wiped member caught up",
        Duration::from_secs(10),
        || async {
            let text = cluster
                .metrics_text(leader)
                .await
                .map_err(|e| e.to_string())?;
            match sample_with(&text, "lockd_replication_lag_entries", &[&peer]) {
                Some(lag) if lag < 5.0 => Ok(()),
                other => Err(format!("lag {other:?}")),
            }
        },
    )
    .await;
}

/// Goal: the shipped alert rules load, their unit tests pass, and every lockd metric they name
/// is one a node exports. Method: `promtool check rules` and `promtool test rules` on
/// docs/prometheus; the metric names in alerts.yml against a live node's /metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alert_rules_load_pass_their_tests_and_name_real_metrics() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/prometheus");
    let promtool = |args: &[&str]| {
        std::process::Command::new("promtool")
            .args(args)
            .current_dir(&dir)
            .output()
    };
    match promtool(&["--version"]) {
        Ok(out) if out.status.success() => {}
        _ => {
            println!(
                "SKIPPED alert_rules_load_pass_their_tests_and_name_real_metrics: no promtool on PATH \
                 (apt-get install prometheus; .ci/run does)"
            );
            return;
        }
    }
    for args in [
        &["check", "rules", "alerts.yml"][..],
        &["test", "rules", "alerts_test.yml"],
    ] {
        let out = promtool(args).unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    let rules = std::fs::read_to_string(dir.join("alerts.yml")).unwrap();
    let mut named: Vec<&str> = rules
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("lockd_"))
        .collect();
    named.sort();
    named.dedup();
    assert!(named.len() >= 6, "{named:?}");
    let mut cluster = Cluster::start_default().await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let mut c = cluster.lock_client(leader).await.unwrap();
    c.acquire(req("alerts/r", "alerts", 60_000, 0))
        .await
        .unwrap();
    let text = cluster.metrics_text(leader).await.unwrap();
    for name in named {
        assert!(
            text.lines()
                .any(|l| !l.starts_with('#') && l.starts_with(name)),
            "alerts.yml names {name}, which lockd does not export:\n{text}"
        );
    }
}

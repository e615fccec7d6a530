//! Metrics: a scripted workload is counted exactly, what operators watch is exported with sane
//! values, and the Prometheus alert rules load, pass their tests and name real metrics.

use std::time::Duration;

use crate::{req, sample};
use lockd_api::v1::RenewRequest;
use lockd_tests::cluster::{Cluster, ClusterOptions};
use lockd_tests::poll;
use tonic::Code;

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
    // The two 1 s leases expire: wait until the node counted both.
    poll::until_async(
        "both 1 s leases expired",
        Duration::from_secs(10),
        || async {
            let text = cluster
                .metrics_text(node)
                .await
                .map_err(|e| format!("{e:#}"))?;
            match sample(&text, "lockd_lease_expirations_total") {
                2.0 => Ok(()),
                n => Err(format!("{n} expirations counted")),
            }
        },
    )
    .await;
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
            lockd_tests::skip::report(
                "no promtool on PATH (apt-get install prometheus; .ci/run does)",
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

//! Goal: prove that `lockd-bench` works end to end against a real three-process cluster, as CI's
//! only benchmark step. Benchmarks are programs, not tests: this checks that each mode runs,
//! reaches the cluster and reports, never how fast it is.
//!
//! Method: start the default test cluster, run `mixed`, `max` and `handoff` with `--smoke` (a few
//! seconds each, a few hundred ops/s), and read the JSON line each prints last on stdout.

use std::process::Output;

use lockd_tests::cluster::Cluster;
use lockd_tests::process::bin_path;
use serde_json::Value;

/// Runs lockd-bench with `args` against `endpoints` and returns its JSON report.
async fn run_bench(endpoints: &str, args: &[&str]) -> Value {
    let mut cmd = std::process::Command::new(bin_path("lockd-bench"));
    cmd.args(args)
        .arg("--endpoints")
        .arg(endpoints)
        .arg("--no-progress");
    let what = format!("lockd-bench {}", args.join(" "));
    let out: Output = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("join")
        .expect("run lockd-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{what} failed ({}): {stderr}",
        out.status
    );
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("{what}: last stdout line is not JSON ({e}): {stdout:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_smoke_runs_every_mode() {
    let cluster = Cluster::start_default().await.expect("cluster");
    let endpoints = cluster.endpoints();

    // Phase 1: mixed, every op succeeds at least once and nothing fails.
    let mixed = run_bench(&endpoints, &["mixed", "--smoke"]).await;
    assert_eq!(mixed["bench"], "mixed");
    for op in ["acquire", "renew", "release"] {
        assert!(
            mixed["ops"][op]["ok"].as_u64().unwrap_or(0) > 0,
            "no successful {op}: {mixed}"
        );
    }
    assert_eq!(mixed["errors"], 0, "{mixed}");
    assert!(
        mixed["ops"]["acquire"]["p99_ms"].as_f64().is_some(),
        "{mixed}"
    );

    // Phase 2: max completes cycles.
    let max = run_bench(&endpoints, &["max", "--smoke"]).await;
    assert!(max["ops_per_s"].as_f64().unwrap_or(0.0) > 0.0, "{max}");
    assert_eq!(max["errors"], 0, "{max}");

    // Phase 3: handoff measures handoffs between queued waiters.
    let handoff = run_bench(&endpoints, &["handoff", "--smoke"]).await;
    assert!(handoff["handoffs"].as_u64().unwrap_or(0) > 0, "{handoff}");
    assert_eq!(handoff["errors"], 0, "{handoff}");
}

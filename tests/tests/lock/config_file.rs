//! lockd started from TOML config files (`--config FILE`) instead of flags.

use std::time::Duration;

use lockd_api::v1::AcquireRequest;
use lockd_tests::cluster::{Cluster, ClusterOptions};
use lockd_tests::process::bin_path;

/// Goal: a cluster whose nodes get id, addresses, peers, data dir and timings only from
/// `--config` files forms, grants locks, and a node restarted from its file rejoins.
/// Method: the test harness writes one file per node; a grant, a kill and restart of the
/// leader, a grant after it with a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_configured_by_files_serves_locks() {
    let mut cluster = Cluster::start(ClusterOptions {
        config_file: true,
        ..ClusterOptions::default()
    })
    .await
    .unwrap();
    let leader = cluster.leader().await.unwrap();
    let request = |id: &str| AcquireRequest {
        resource: format!("config/{id}"),
        request_id: id.into(),
        lease_ttl_ms: 10_000,
        wait_timeout_ms: 0,
        holder: "config-file-test".into(),
    };
    let first = cluster
        .lock_client(leader)
        .await
        .unwrap()
        .acquire(request("a"))
        .await
        .unwrap()
        .into_inner();

    cluster.kill(leader);
    cluster.start_node(leader).unwrap();
    let leader = cluster
        .wait_for_leader(Duration::from_secs(20))
        .await
        .unwrap();
    let second = cluster
        .lock_client(leader)
        .await
        .unwrap()
        .acquire(request("b"))
        .await
        .unwrap()
        .into_inner();
    assert!(
        second.fencing_token > first.fencing_token,
        "{second:?} after {first:?}"
    );
}

/// `lockd ARGS` with `env` set; (exit code, stderr).
fn lockd(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let out = std::process::Command::new(bin_path("lockd"))
        .args(args)
        .env_remove("LOCKD_CONFIG")
        .env_remove("LOCKD_HEARTBEAT")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Goal: the file only supplies defaults (a flag wins, then its environment variable, then the
/// file), and a bad file is refused with one line naming the file and the key.
/// Method: `lockd dev` with timings whose check fails (an election timeout under three
/// heartbeats), so each run stops at once with an error that shows the values it got.
#[test]
fn flags_and_environment_win_over_the_file_and_bad_keys_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("lockd.toml");
    let path = file.display().to_string();
    std::fs::write(
        &file,
        "[dev]\nheartbeat = \"500ms\"\nelection-timeout = \"1s\"\n",
    )
    .unwrap();

    // The file's values reach the check.
    let (code, err) = lockd(&["dev", "--config", &path], &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--election-timeout 1s") && err.contains("--heartbeat 500ms"),
        "{err}"
    );

    // A flag beats the file; so does the environment, and the flag beats the environment.
    let (_, err) = lockd(
        &["dev", "--config", &path, "--election-timeout", "1200ms"],
        &[],
    );
    assert!(err.contains("--election-timeout 1.2s"), "{err}");
    let (_, err) = lockd(&["dev", "--config", &path], &[("LOCKD_HEARTBEAT", "400ms")]);
    assert!(err.contains("--heartbeat 400ms"), "{err}");
    let (_, err) = lockd(
        &["dev", "--config", &path, "--heartbeat", "450ms"],
        &[("LOCKD_HEARTBEAT", "400ms")],
    );
    assert!(err.contains("--heartbeat 450ms"), "{err}");
    // `--config` before the subcommand works too.
    let (_, err) = lockd(&["--config", &path, "dev"], &[]);
    assert!(err.contains("--heartbeat 500ms"), "{err}");
    // LOCKD_CONFIG names the file as well.
    let (_, err) = lockd(&["dev"], &[("LOCKD_CONFIG", &path)]);
    assert!(err.contains("--heartbeat 500ms"), "{err}");

    // Bad files: one line naming the file and what is wrong, exit code 2.
    for (text, expected) in [
        ("[dev]\nhartbeat = \"1s\"\n", "unknown key \"dev.hartbeat\""),
        ("[dev]\nheartbeat = \"soon\"\n", "dev.heartbeat = \"soon\""),
        ("[prod]\nid = 1\n", "unknown table [prod]"),
        ("heartbeat = \n", "not TOML"),
    ] {
        std::fs::write(&file, text).unwrap();
        let (code, err) = lockd(&["dev", "--config", &path], &[]);
        assert_eq!(code, Some(2), "{text}: {err}");
        assert!(
            err.starts_with("lockd: --config ") && err.contains(&path),
            "{err}"
        );
        assert!(err.contains(expected), "{text}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
    let (code, err) = lockd(&["dev", "--config", "/nonexistent/lockd.toml"], &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("/nonexistent/lockd.toml"), "{err}");

    // A renamed environment variable is refused with its new name, not silently ignored.
    let (code, err) = lockd(&["dev"], &[("LOCKD_HEARTBEAT_MS", "100")]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("LOCKD_HEARTBEAT_MS was renamed LOCKD_HEARTBEAT"),
        "{err}"
    );
}

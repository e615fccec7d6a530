//! `lockctl`: `hold` runs a command under a lease and stops it when the lease is lost; the other
//! commands, their errors and JSON output.

use std::time::Duration;

use crate::{
    PROMPTLY, Run, TTL, client, describe, lockctl, process_exists, read_when_written, run_lockctl,
    serial, stalls, temp_file,
};
use lockd_client::AcquireOptions;
use lockd_tests::cluster::Cluster;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::AsyncReadExt;
use tokio::time::Instant;

/// Test 2 (lockctl). Goal: a `lockctl hold` paused past its ttl (SIGSTOP) loses the lease to B, and
/// once resumed stops its command instead of continuing as holder. Method: SIGSTOP lockctl, let B
/// acquire with waiting, SIGCONT, expect exit code 10, the command gone, B still the holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_lockctl_hold_does_not_continue_after_resume() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = temp_file(&dir, "held");
    let script = format!(
        "echo \"$$ $LOCKD_FENCING_TOKEN\" > {0}.tmp && mv {0}.tmp {0}; exec sleep 600",
        out.display()
    );
    let mut holder = lockctl(
        &cluster.endpoints(),
        &["hold", "pause/1", "--ttl", "2s", "--", "sh", "-c", &script],
    )
    .spawn()
    .unwrap();
    let written = read_when_written(&out).await;
    let (pid, token_a) = written.split_once(' ').unwrap();
    let (pid, token_a): (i32, u64) = (pid.parse().unwrap(), token_a.parse().unwrap());
    let b = client(&cluster);
    assert_eq!(describe(&b, "pause/1").await.fencing_token, token_a);

    let lockctl_pid = Pid::from_raw(holder.id().unwrap() as i32);
    kill(lockctl_pid, Signal::SIGSTOP).unwrap();
    let lease_b = b
        .acquire(
            "pause/1",
            AcquireOptions::default()
                .ttl(Duration::from_secs(10))
                .wait(Duration::from_secs(10)),
        )
        .await;
    kill(lockctl_pid, Signal::SIGCONT).unwrap();
    let lease_b = lease_b.unwrap();
    assert!(lease_b.fencing_token.0 > token_a);

    let status = tokio::time::timeout(PROMPTLY, holder.wait())
        .await
        .expect("lockctl hold kept running after resume")
        .unwrap();
    let mut stderr = String::new();
    holder
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .await
        .unwrap();
    assert_eq!(status.code(), Some(10), "stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
    assert!(
        stderr.contains("lost") && stderr.contains("pause/1"),
        "{stderr}"
    );
    assert!(
        !process_exists(pid),
        "command {pid} still running after lease loss"
    );
    let d = describe(&b, "pause/1").await;
    assert_eq!(
        d.fencing_token, lease_b.fencing_token.0,
        "the resumed holder disturbed B"
    );
}

/// Test 3a. Goal: `lockctl hold` gives COMMAND its resource and token, keeps the lease while it
/// runs (longer than the ttl), releases when it exits and exits with its status. Method: a shell
/// that writes its environment, sleeps past the ttl and exits 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_passes_the_token_and_exits_with_the_command_status() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = temp_file(&dir, "env");
    let script = format!(
        "echo \"$LOCKD_RESOURCE $LOCKD_FENCING_TOKEN\" > {0}.tmp && mv {0}.tmp {0}; sleep 3; exit 3",
        out.display()
    );
    let holder = lockctl(
        &cluster.endpoints(),
        &[
            "--json", "hold", "hold/1", "--ttl", "2s", "--", "sh", "-c", &script,
        ],
    )
    .spawn()
    .unwrap();
    let written = read_when_written(&out).await;
    let c = client(&cluster);
    let d = describe(&c, "hold/1").await;
    assert!(d.held);
    assert_eq!(written, format!("hold/1 {}", d.fencing_token));

    let output = tokio::time::timeout(PROMPTLY, holder.wait_with_output())
        .await
        .expect("lockctl hold did not exit")
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(3), "stderr: {stderr}");
    let run = Run {
        code: Some(3),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: stderr.into_owned(),
    };
    let v = run.json();
    assert_eq!(v["exit_code"], 3);
    assert_eq!(v["fencing_token"], d.fencing_token);
    assert_eq!(v["lease_lost"], false);
    assert_eq!(v["released"], true);
    assert!(
        !describe(&c, "hold/1").await.held,
        "not released after COMMAND exited"
    );
}

/// Test 3b. Goal: `lockctl hold` kills COMMAND when the lease is lost, escalating to SIGKILL when
/// COMMAND ignores SIGTERM. Method: lockctl talks through freezable forwarders; COMMAND ignores
/// SIGTERM; freeze and expect exit code 10 within ttl + margin + slack, COMMAND gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_kills_the_command_when_the_lease_is_lost() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let (stalls, stalled) = stalls(&cluster).await;
    let dir = tempfile::tempdir().unwrap();
    let out = temp_file(&dir, "pid");
    let script = format!(
        "trap '' TERM; echo $$ > {0}.tmp && mv {0}.tmp {0}; while :; do sleep 0.1; done",
        out.display()
    );
    let mut holder = lockctl(
        &stalled.join(","),
        &["hold", "kill/1", "--ttl", "2s", "--", "sh", "-c", &script],
    )
    .spawn()
    .unwrap();
    let pid: i32 = read_when_written(&out).await.parse().unwrap();
    assert!(process_exists(pid));

    for s in &stalls {
        s.freeze(true);
    }
    let frozen_at = Instant::now();
    let status = tokio::time::timeout(PROMPTLY, holder.wait())
        .await
        .expect("lockctl hold did not stop after its lease was lost")
        .unwrap();
    let stopped_after = frozen_at.elapsed();
    let mut stderr = String::new();
    holder
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .await
        .unwrap();
    assert_eq!(status.code(), Some(10), "stderr: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
    assert!(
        stderr.contains("SIGKILL") && stderr.contains("kill/1"),
        "{stderr}"
    );
    assert!(!process_exists(pid), "command {pid} survived");
    // Loss at most one ttl after the stall, plus the margin as SIGTERM grace, plus slack.
    assert!(
        stopped_after < TTL + Duration::from_secs(2),
        "{stopped_after:?}"
    );
}

/// Test 5. Goal: lockctl's commands against a live cluster: `--json` output parses, errors are one
/// line with their documented codes (held 3, wait timed out 4, unknown lease 5, unreachable 9,
/// bad endpoint 2), a dead endpoint in the list is skipped. Method: run each case.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockctl_commands_errors_and_json() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    // A dead first endpoint is skipped.
    let eps = format!("{dead},{}", cluster.endpoints());

    let acquired = run_lockctl(&eps, &["--json", "acquire", "cli/1", "--ttl", "30s"]).await;
    let v = acquired.ok().json();
    let lease_id = v["lease_id"].as_str().unwrap().to_owned();
    let token = v["fencing_token"].as_u64().unwrap();
    assert!(lease_id.len() >= 16, "{v}");
    assert_eq!(v["lease_ttl_ms"], 30_000);
    assert_eq!(v["resource"], "cli/1");

    run_lockctl(&eps, &["acquire", "cli/1"])
        .await
        .fails(3, &["\"cli/1\"", "held"]);
    run_lockctl(&eps, &["acquire", "cli/1", "--wait", "1s"])
        .await
        .fails(4, &["\"cli/1\"", "1s"]);
    let renewed = run_lockctl(&eps, &["--json", "renew", "cli/1", &lease_id]).await;
    assert_eq!(renewed.ok().json()["lease_ttl_ms"], 30_000);
    // Well-formed (32 hex digits, as lockd issues them) but not the current lease.
    let unknown = "0123456789abcdef0123456789abcdef";
    run_lockctl(&eps, &["renew", "cli/1", unknown])
        .await
        .fails(5, &["\"cli/1\"", "not current"]);
    run_lockctl(&eps, &["release", "cli/1", unknown])
        .await
        .fails(5, &["\"cli/1\"", "not current"]);
    run_lockctl(&eps, &["renew", "cli/1", "no-such-lease"])
        .await
        .fails(7, &["no-such-lease"]);

    let d = run_lockctl(&eps, &["--json", "describe", "cli/1"]).await;
    let dv = d.ok().json();
    assert_eq!(dv["held"], true);
    assert_eq!(dv["fencing_token"], token);
    assert!(
        !d.stdout.contains(&lease_id),
        "describe leaked the lease id"
    );
    let text = run_lockctl(&eps, &["describe", "cli/1"]).await;
    assert!(
        text.ok()
            .stdout
            .contains(&format!("fencing_token  {token}")),
        "{}",
        text.stdout
    );

    let s = run_lockctl(&cluster.endpoints(), &["--json", "status"]).await;
    let sv = s.ok().json();
    assert!(sv["leader_id"].as_u64().unwrap() > 0, "{sv}");
    assert_eq!(sv["members"].as_array().unwrap().len(), 3, "{sv}");
    assert!(sv["active_locks"].as_u64().unwrap() >= 1, "{sv}");
    let st = run_lockctl(&cluster.endpoints(), &["status"]).await;
    for key in [
        "node",
        "role",
        "leader",
        "term",
        "commit_index",
        "applied_index",
        "members",
        "active_locks",
        "waiters",
    ] {
        assert!(
            st.ok().stdout.lines().any(|l| l.starts_with(key)),
            "{key} missing: {}",
            st.stdout
        );
    }

    let released = run_lockctl(&eps, &["--json", "release", "cli/1", &lease_id]).await;
    assert_eq!(released.ok().json()["released"], true);

    // The same --request-id twice is one lease.
    let first = run_lockctl(
        &eps,
        &["--json", "acquire", "cli/2", "--request-id", "cli-2-once"],
    )
    .await;
    let second = run_lockctl(
        &eps,
        &["--json", "acquire", "cli/2", "--request-id", "cli-2-once"],
    )
    .await;
    assert_eq!(
        first.ok().json()["lease_id"],
        second.ok().json()["lease_id"]
    );

    run_lockctl("nonsense", &["describe", "cli/1"])
        .await
        .fails(2, &["\"nonsense\""]);
    run_lockctl(&dead, &["--timeout", "1s", "describe", "cli/1"])
        .await
        .fails(9, &[&dead]);
    let json_err = run_lockctl(&eps, &["--json", "acquire", "cli/2"]).await;
    json_err.fails(3, &["\"cli/2\""]);
    assert_eq!(json_err.json()["error"]["kind"], "held");
}

//! The `lockd` binary from the outside: flag errors are one line with a non-zero exit, and
//! `lockd dev` starts a working three-replica cluster.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test, with its message"
)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lockd_api::v1::AcquireRequest;
use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::lock_client::LockClient;

fn lockd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lockd"))
}

fn one_line_error(args: &[&str], expect: &str) {
    let out = lockd().args(args).output().unwrap();
    assert!(!out.status.success(), "{args:?} succeeded");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{args:?}: not one line: {err}"
    );
    assert!(
        err.starts_with("lockd: ") && err.contains(expect),
        "{args:?}: {err}"
    );
}

#[test]
fn bad_flags_fail_with_one_line() {
    one_line_error(&["--bogus"], "--bogus");
    one_line_error(&["--id", "x"], "x");
    one_line_error(&["--id", "1", "--listen", "127.0.0.1:1"], "--data-dir");
    one_line_error(
        &[
            "--id",
            "1",
            "--listen",
            "127.0.0.1:1",
            "--data-dir",
            "/tmp/x",
            "--peer",
            "2=127.0.0.1:2",
        ],
        "--id 1",
    );
    one_line_error(
        &[
            "--id",
            "1",
            "--listen",
            "127.0.0.1:1",
            "--data-dir",
            "/tmp/x",
            "--peer",
            "1=nohost",
        ],
        "nohost",
    );
    one_line_error(
        &[
            "dev",
            "--heartbeat-ms",
            "500",
            "--election-timeout-ms",
            "600",
        ],
        "--election-timeout",
    );
    assert!(lockd().arg("--help").output().unwrap().status.success());
}

/// Goal: the README's first command works. Method: start `lockd dev` on a private loopback
/// address, read the endpoints it prints, wait for a leader, take a lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockd_dev_serves_three_replicas() {
    dev_serves_three_replicas(false, 9).await;
}

/// Goal: `lockd dev --tls` is TLS in one command. Method: as above, over TLS with
/// the CA it prints for --cacert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockd_dev_tls_serves_three_replicas_over_tls() {
    dev_serves_three_replicas(true, 10).await;
}

async fn channel(tls: Option<&std::path::Path>, addr: &str) -> tonic::transport::Channel {
    let Some(ca) = tls else {
        return tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
    };
    let ca = tonic::transport::Certificate::from_pem(std::fs::read(ca).unwrap());
    tonic::transport::Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tonic::transport::ClientTlsConfig::new().ca_certificate(ca))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

async fn dev_serves_three_replicas(tls: bool, last_octet: u8) {
    let dir = tempfile::tempdir().unwrap();
    let host = format!(
        "127.{}.{}.{}",
        std::process::id() % 200 + 20,
        77,
        last_octet
    );
    let mut cmd = lockd();
    cmd.args(["dev", "--host", &host, "--data-dir"])
        .arg(dir.path());
    if tls {
        cmd.arg("--tls");
    }
    let mut child = cmd
        .env("RUST_LOG", "warn,openraft=off")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stdout = child.stdout.take().unwrap();
    let _guard = Kill(child);
    // Read the banner, then keep draining stdout so the server never writes into a closed pipe.
    let mut lines = BufReader::new(stdout).lines();
    let mut printed = String::new();
    for line in lines.by_ref().take(4) {
        printed.push_str(&line.unwrap());
        printed.push('\n');
    }
    std::thread::spawn(move || lines.for_each(drop));
    let endpoint = format!("{host}:7001");
    assert!(printed.contains(&endpoint), "{printed}");
    let ca = dir.path().join("tls").join("ca.pem");
    let ca = tls.then_some(ca.as_path());
    if let Some(ca) = ca {
        assert!(
            printed.contains(&format!("--cacert {}", ca.display())),
            "{printed}"
        );
    }
    let mut status = ClusterClient::new(channel(ca, &endpoint).await);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = status
            .status(lockd_api::v1::StatusRequest {})
            .await
            .unwrap()
            .into_inner();
        if s.leader_id != 0 {
            assert_eq!(s.members.len(), 3);
            break;
        }
        assert!(Instant::now() < deadline, "no leader: {s:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut lock = LockClient::new(channel(ca, &format!("{host}:7002")).await);
    // Node 1 knowing the leader does not mean node 2 does yet (an election of the first start
    // may still be settling): retry UNAVAILABLE with the same request id, as a client does.
    let lease = loop {
        let reply = lock
            .acquire(AcquireRequest {
                resource: "dev/smoke".into(),
                request_id: "dev-smoke-1".into(),
                lease_ttl_ms: 0,
                wait_timeout_ms: 0,
                holder: "cli-test".into(),
            })
            .await;
        match reply {
            Ok(r) => break r.into_inner(),
            Err(s) if s.code() == tonic::Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => panic!("acquire through node 2: {s:?}"),
        }
    };
    assert_eq!(lease.lease_ttl_ms, 30_000);
    assert!(dir.path().join("1").join("lockd.redb").exists());
}

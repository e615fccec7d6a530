//! Who may take a backup (`Cluster.SaveSnapshot`): it holds every lease id and the private
//! signing keys. Under a policy it is the `admin` operation; without one, no caller at all (a
//! loopback address proves nothing: sidecars, TLS terminators, tunnels and port-forwards make
//! every remote client local), unless the node runs with `--allow-backup-without-policy`.

use std::time::Duration;

use lockd_api::v1::SaveSnapshotRequest;
use lockd_api::v1::cluster_client::ClusterClient;
use lockd_tests::process::{ChildGuard, command};
use sha2::Digest;
use tonic::Code;
use tonic::transport::Channel;

use super::{channel, leader_and_follower, setup, with_headers};

/// Reads a backup stream to its summary; returns the bytes and checks size and digest.
async fn read_backup(mut stream: tonic::Streaming<lockd_api::v1::SaveSnapshotResponse>) -> Vec<u8> {
    let mut bytes = Vec::new();
    let summary = loop {
        let m = stream
            .message()
            .await
            .unwrap()
            .expect("a summary at the end");
        bytes.extend_from_slice(&m.data);
        if let Some(summary) = m.summary {
            break summary;
        }
    };
    assert_eq!(summary.size_bytes, bytes.len() as u64);
    assert!(bytes.starts_with(b"LKDBACK1"));
    let digest = sha2::Sha256::digest(&bytes[..bytes.len() - 32]);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(summary.sha256, hex);
    bytes
}

/// Goal: under a policy a backup is the `admin` operation: a tenant and an anonymous caller are
/// refused on the leader and through a follower, before any byte of state leaves the cluster;
/// the operator gets the whole file through a follower (which forwards the identity and relays
/// the leader's stream). Method: the policy cluster; the stream read to its summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_is_the_policys_admin_operation() {
    let mut s = setup().await;
    let (leader, follower) = leader_and_follower(&mut s.cluster).await;
    for node in [leader, follower] {
        for who in [Some(&s.alice), None] {
            let st = ClusterClient::new(channel(&s.cluster, node, who))
                .save_snapshot(with_headers(SaveSnapshotRequest {}, &[]))
                .await
                .unwrap_err();
            assert_eq!(st.code(), Code::PermissionDenied, "node {node}: {st:?}");
            assert!(st.message().contains("admin"), "{st:?}");
        }
    }
    let stream = ClusterClient::new(channel(&s.cluster, follower, Some(&s.ops)))
        .save_snapshot(with_headers(SaveSnapshotRequest {}, &[]))
        .await
        .expect("the operator takes a backup through a follower")
        .into_inner();
    read_backup(stream).await;
}

/// A one-node lockd on `ip` without TLS or policy, plus `extra`.
fn single_node(
    ip: std::net::IpAddr,
    port: u16,
    dir: &std::path::Path,
    extra: &[&str],
) -> ChildGuard {
    let addr = format!("{ip}:{port}");
    // A single-node cluster is founded by `lockd init` on its empty data dir (a lone --peer
    // never founds one by itself: see docs/operations.md, "Forming a cluster").
    if !dir.exists() {
        let out = command("lockd")
            .args(["init", "--id", "1", "--data-dir"])
            .arg(dir)
            .arg("--peer")
            .arg(format!("1={addr}"))
            .output()
            .unwrap();
        assert!(out.status.success(), "lockd init: {out:?}");
    }
    let mut cmd = command("lockd");
    cmd.args(["--id", "1", "--listen", &addr, "--peer"])
        .arg(format!("1={addr}"))
        .arg("--data-dir")
        .arg(dir)
        .args([
            "--insecure-plaintext",
            "--heartbeat",
            "100ms",
            "--election-timeout",
            "600ms",
        ])
        .args(extra);
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "warn,openraft=off");
    }
    ChildGuard::spawn("lockd-1", cmd).unwrap()
}

/// `SaveSnapshot` on `addr`, retried while the node starts (UNAVAILABLE, connection refused).
async fn save_snapshot(
    addr: &str,
) -> Result<tonic::Streaming<lockd_api::v1::SaveSnapshotResponse>, tonic::Status> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_lazy();
        match ClusterClient::new(channel)
            .save_snapshot(SaveSnapshotRequest {})
            .await
        {
            Err(s) if s.code() == Code::Unavailable && std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => return other.map(|r| r.into_inner()),
        }
    }
}

/// Goal: without a policy a backup is refused to every caller, one on a loopback address too
/// (regression: the review of the backup feature found that a loopback exemption hands the
/// signing keys to every client behind a sidecar or a port-forward), with PERMISSION_DENIED
/// naming its address and the ways out; `--allow-backup-without-policy` lifts that. Method: one
/// node on a loopback address, called from that address, first without, then with the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_mode_refuses_backups_even_on_loopback_unless_allowed() {
    let ip = std::net::IpAddr::V4(lockd_tests::process::random_loopback_ip());
    let dir = tempfile::tempdir().unwrap();
    let port = lockd_tests::pg::free_port();
    let addr = std::net::SocketAddr::new(ip, port).to_string();
    let mut node = single_node(ip, port, &dir.path().join("n1"), &[]);
    let st = save_snapshot(&addr).await.unwrap_err();
    assert_eq!(st.code(), Code::PermissionDenied, "{st:?}");
    assert!(
        // The caller's address: a loopback one (the kernel picks 127.0.0.1 as the source).
        st.message().contains("caller (127.")
            && st.message().contains("--allow-backup-without-policy")
            && st.message().contains("--auth-policy"),
        "{st:?}"
    );
    node.kill();
    let _node = single_node(
        ip,
        port,
        &dir.path().join("n1"),
        &["--allow-backup-without-policy"],
    );
    let stream = save_snapshot(&addr)
        .await
        .expect("allowed with --allow-backup-without-policy");
    read_backup(stream).await;
}

//! `lockd dev`: a cluster for one developer's machine. It runs without a policy and answers
//! membership changes and leader transfers (`--allow-membership-without-policy`), so it must stay
//! on loopback and keep those calls to its own user, with TLS (`--tls`) as without.
//!
//! The other user is this test binary itself, run again as uid 65534 (as in `loopback`): with
//! [`DEV_PROBE_ENV`] set it runs [`foreign_user_dev_tls_probe`].

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{
    AcquireRequest, AddMemberRequest, ListMembersRequest, RotateSigningKeyRequest,
    SaveSnapshotRequest, StatusRequest, TransferLeaderRequest,
};
use lockd_tests::poll;
use lockd_tests::process::{ChildGuard, bin_path};
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

use super::loopback::{
    FOREIGN_UID, can_run_as_another_user, report, run_probe_as_another_user, skip_outside_ci,
};

/// Set in the environment of the probe process: `<host> <leader id> <ca.pem> <node key>`.
const DEV_PROBE_ENV: &str = "LOCKD_TEST_DEV_TLS_PROBE";
/// The probe's full test name, as `--exact` takes it.
const DEV_PROBE_TEST: &str = "dev::foreign_user_dev_tls_probe";
/// The calls of another user that must be refused (or fail, for the key file).
const ADMIN: &[&str] = &[
    "transfer_leader",
    "add_member",
    "rotate_signing_key",
    "save_snapshot",
];
/// Calls any local user may make on a dev cluster; each must keep working.
const CLIENT: &[&str] = &["client_acquire", "client_status"];
/// The dev cluster's gRPC ports (fixed: `lockd dev` has no flag for them).
const DEV_PORTS: [u16; 3] = [7001, 7002, 7003];

/// A TLS channel to `host:port` trusting `ca` (PEM), without a client certificate.
fn tls_channel(host: &str, port: u16, ca: &[u8]) -> Channel {
    Channel::from_shared(format!("https://{host}:{port}"))
        .unwrap()
        .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)))
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .connect_lazy()
}

/// Not a test by itself: what a process of another user tries against `lockd dev --tls`,
/// started by [`review3_dev_tls_keeps_admin_calls_to_its_own_user`] with [`DEV_PROBE_ENV`] set.
/// Without the variable (an ordinary run) it returns at once.
#[tokio::test(flavor = "current_thread")]
async fn foreign_user_dev_tls_probe() {
    let Ok(spec) = std::env::var(DEV_PROBE_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split(' ').collect();
    let (host, leader, ca, key) = (
        parts[0],
        parts[1].parse::<u64>().unwrap(),
        parts[2],
        parts[3],
    );
    let ca = std::fs::read(ca).unwrap();
    let port = |id: u64| DEV_PORTS[id as usize - 1];
    let follower = if leader == 1 { 2 } else { 1 };
    let cluster = |id: u64| ClusterClient::new(tls_channel(host, port(id), &ca));

    // A node's private key: whoever reads it is a member to the others.
    let read = std::fs::read(key).map_err(|e| tonic::Status::permission_denied(e.to_string()));
    report("node_key", read, |k| format!("read {} bytes", k.len()));

    // Ordinary client calls (a dev cluster has no policy): open to every local user.
    let acquired = LockClient::new(tls_channel(host, port(follower), &ca))
        .acquire(AcquireRequest {
            resource: "foreign/client".into(),
            request_id: "foreign-client".into(),
            lease_ttl_ms: 30_000,
            wait_timeout_ms: 0,
            holder: "foreign".into(),
        })
        .await;
    report("client_acquire", acquired, |r| {
        format!("token {}", r.into_inner().fencing_token)
    });
    let status = cluster(follower).status(StatusRequest {}).await;
    report("client_status", status, |r| {
        format!("leader {}", r.into_inner().leader_id)
    });

    // Admin calls: each hands the cluster (or its keys) to whoever makes it.
    let transfer = cluster(follower)
        .transfer_leader(TransferLeaderRequest { id: 0 })
        .await;
    report("transfer_leader", transfer, |r| {
        format!("leader {}", r.into_inner().leader_id)
    });
    let add = cluster(leader)
        .add_member(AddMemberRequest {
            id: 9,
            address: format!("{host}:1"),
        })
        .await;
    report("add_member", add, |_| "added".to_owned());
    let rotate = cluster(follower)
        .rotate_signing_key(RotateSigningKeyRequest::default())
        .await;
    report("rotate_signing_key", rotate, |_| "rotated".to_owned());
    let backup = async {
        let mut stream = cluster(follower)
            .save_snapshot(SaveSnapshotRequest {})
            .await?
            .into_inner();
        let mut bytes = 0;
        while let Some(m) = stream.message().await? {
            bytes += m.data.len();
        }
        Ok(bytes)
    }
    .await;
    report("save_snapshot", backup, |n| format!("{n} bytes of backup"));
}

/// Stops `lockd dev` by PID when dropped, and keeps its output for a failure message.
struct Dev {
    child: ChildGuard,
    log: PathBuf,
}

impl Dev {
    fn start(host: &str, data_dir: &Path, extra: &[&str]) -> Dev {
        let log = data_dir.with_extension("log");
        let out = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(bin_path("lockd"));
        cmd.args(["dev", "--host", host, "--data-dir"])
            .arg(data_dir)
            .args(extra)
            .env_remove("LOCKD_CONFIG")
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        Dev {
            child: ChildGuard::spawn("lockd dev", cmd).unwrap(),
            log,
        }
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// A loopback address of its own for this run (`127.x.y.z`), so that the fixed dev ports do not
/// meet another dev cluster's.
fn own_loopback_host() -> String {
    let n = std::process::id() ^ (Instant::now().elapsed().subsec_nanos());
    format!(
        "127.{}.{}.{}",
        1 + (n % 250),
        1 + ((n >> 8) % 250),
        1 + ((n >> 16) % 250)
    )
}

/// Goal (review of 2026-12-05, third round, finding 2): `lockd dev --tls` answers admin calls
/// without a policy, and with TLS on the check that keeps them to the node's own user (the
/// plaintext loopback mode's, `local_peer.rs`) did not run: another local user with nothing but
/// `ca.pem` moved the leader (reproduced by the review as uid 65534). The node keys were also
/// written readable by every user. Method: `lockd dev --tls --allow-backup-without-policy` in a
/// folder other users can enter (as a checkout under a readable home is); this binary run again
/// as uid 65534 ([`foreign_user_dev_tls_probe`]) reads a node key and makes every admin call
/// once, without a client certificate: each must be refused, the admin calls with
/// UNAUTHENTICATED naming both uids; its client calls must work. Control: the nodes' own user
/// (this process) transfers the leadership, and the membership is still the three nodes.
/// Skipped when not root (fails instead under CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review3_dev_tls_keeps_admin_calls_to_its_own_user() {
    use std::os::unix::fs::PermissionsExt;
    if !can_run_as_another_user() {
        return;
    }
    let own_uid = nix::unistd::geteuid().as_raw();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let data = dir.path().join("lockd-dev-data");
    let host = own_loopback_host();
    let dev = Dev::start(&host, &data, &["--tls", "--allow-backup-without-policy"]);
    let ca_path = data.join("tls").join("ca.pem");
    let ca = poll::until("lockd dev wrote its CA", Duration::from_secs(20), || {
        std::fs::read(&ca_path).map_err(|e| format!("{e}; output: {}", dev.output()))
    })
    .await;
    let cluster = |id: u64| ClusterClient::new(tls_channel(&host, DEV_PORTS[id as usize - 1], &ca));
    let leader = poll::until_async("a dev leader", Duration::from_secs(30), || async {
        match cluster(1).status(StatusRequest {}).await {
            Ok(s) if s.get_ref().leader_id != 0 => Ok(s.into_inner().leader_id),
            other => Err(format!("{other:?}; output: {}", dev.output())),
        }
    })
    .await;

    // The CA certificate is public (every client needs it) but `lockd dev` keeps its folder to
    // its own user: the other user gets a copy, as a developer would hand it over.
    let public_ca = dir.path().join("ca.pem");
    std::fs::write(&public_ca, &ca).unwrap();
    std::fs::set_permissions(&public_ca, std::fs::Permissions::from_mode(0o644)).unwrap();
    let spec = format!(
        "{host} {leader} {} {}",
        public_ca.display(),
        data.join("tls").join("node1-key.pem").display()
    );
    let outcomes = match run_probe_as_another_user(
        DEV_PROBE_TEST,
        DEV_PROBE_ENV,
        &spec,
        1 + ADMIN.len() + CLIENT.len(),
    )
    .await
    {
        Ok(o) => o,
        Err(why) => {
            skip_outside_ci(&why);
            return;
        }
    };
    let mut answered = Vec::new();
    let (code, message) = &outcomes["node_key"];
    if code == "Ok" {
        answered.push(format!("node_key: {message}"));
    }
    for name in ADMIN {
        let (code, message) = &outcomes[*name];
        if code != "Unauthenticated" {
            answered.push(format!("{name}: {code} {message}"));
            continue;
        }
        assert!(
            message.contains(&format!("uid {own_uid}"))
                && message.contains(&format!("uid {FOREIGN_UID}")),
            "{name}: the refusal names both users: {message}"
        );
    }
    assert!(
        answered.is_empty(),
        "a process of uid {FOREIGN_UID} with only ca.pem got from `lockd dev --tls` of uid \
         {own_uid}:\n  {}",
        answered.join("\n  ")
    );
    for name in CLIENT {
        let (code, message) = &outcomes[*name];
        assert_eq!(code, "Ok", "{name} from uid {FOREIGN_UID}: {message}");
    }

    // Control: the nodes' own user may, through a follower, and nothing was added.
    let follower = if leader == 1 { 2 } else { 1 };
    let moved = cluster(follower)
        .transfer_leader(TransferLeaderRequest { id: 0 })
        .await
        .expect("the nodes' own user transfers the leadership")
        .into_inner();
    assert_ne!(moved.leader_id, leader, "{moved:?}");
    let members = cluster(1)
        .list_members(ListMembersRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(members.members.len(), 3, "{members:?}");
    drop(dev);
}

/// Goal (review of 2026-12-05, third round, finding 2): `lockd dev --host` takes only a loopback
/// address; before, `--host 0.0.0.0` (or any address of the machine) served the cluster, with
/// membership changes open to every caller, to the network. Method: `lockd dev --host` with a
/// wildcard, a documentation address and a private one: each run must stop at once with exit
/// code 2 and one line naming the value and saying it must be loopback. Control: a loopback
/// address other than 127.0.0.1 starts.
#[test]
fn review3_dev_refuses_a_host_that_is_not_loopback() {
    let dir = tempfile::tempdir().unwrap();
    for host in ["0.0.0.0", "192.0.2.2", "10.1.2.3"] {
        let data = dir.path().join(format!("data-{host}"));
        let mut dev = Dev::start(host, &data, &[]);
        let started = Instant::now();
        let status = loop {
            if let Some(status) = dev.child.try_wait() {
                break Some(status);
            }
            if started.elapsed() > Duration::from_secs(10) {
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let out = dev.output();
        let Some(status) = status else {
            dev.child.kill();
            panic!("lockd dev --host {host} still runs after 10 s: {out}");
        };
        assert_eq!(status.code(), Some(2), "--host {host}: {out}");
        assert!(
            out.starts_with("lockd: ")
                && out.trim_end().lines().count() == 1
                && out.contains(host)
                && out.contains("loopback"),
            "--host {host}: one line naming the value: {out:?}"
        );
        assert!(!data.exists(), "--host {host} made {}", data.display());
    }
    // Control: another loopback address is fine (it starts; stopped by PID at once).
    let data = dir.path().join("data-loopback");
    let host = own_loopback_host();
    let mut dev = Dev::start(&host, &data, &[]);
    let started = Instant::now();
    while !dev.output().contains("3 replicas running") {
        assert!(
            dev.child.try_wait().is_none() && started.elapsed() < Duration::from_secs(20),
            "lockd dev --host {host} did not start: {}",
            dev.output()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

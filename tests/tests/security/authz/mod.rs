//! Identity and authorization: tenants cannot touch each other's resources, a
//! request_id is worth nothing to another identity, bearer tokens identify callers, clients
//! cannot pose as forwarding nodes, and the start-up checks of the policy name the problem.
//!
//! Every suite runs a TLS cluster with a client CA, a policy and a tokens file:
//! - `cert:alice (client)`: tenant `tenant-a/` and the shared prefix `shared/`;
//! - `cert:bob (client)` and `token:ci`: tenant `tenant-b/` and `shared/`;
//! - `cert:ops (client)`: status and admin only;
//! - `cert:b-monitor (client)`: status, and describe of tenant `tenant-b/` only;
//! - `anonymous`: status only (the harness waits for a leader with anonymous status calls).

mod backup;
mod hot;
mod identity;
mod tenants;

use std::path::PathBuf;
use std::time::Duration;

use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{AcquireRequest, AcquireResponse};
use lockd_tests::cluster::{Cluster, ClusterOptions};
use lockd_tests::tls::{Issued, TestCa};
use sha2::Digest;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const ALICE: &str = "cert:alice (client)";
const BOB: &str = "cert:bob (client)";
/// The secret of `token:ci`: random and long, as the tokens file's docs ask.
const CI_SECRET: &str = "9c1f0e4b7a2d4e8f8b3a6c5d2e1f0a9b8c7d6e5f4a3b2c1d";

const POLICY: &str = r#"
# Tenant A.
[[grant]]
identities = ["cert:alice (client)"]
resources = ["tenant-a/", "shared/"]
operations = ["acquire", "renew", "release", "describe"]

# Tenant B: a certificate and a token.
[[grant]]
identities = ["cert:bob (client)", "token:ci"]
resources = ["tenant-b/", "shared/"]
operations = ["acquire", "renew", "release", "describe"]

[[grant]]
identities = ["cert:ops (client)"]
operations = ["status", "admin"]

# Tenant B's monitoring: the cluster status, and its own tenant's locks.
[[grant]]
identities = ["cert:b-monitor (client)"]
resources = ["tenant-b/"]
operations = ["describe", "status"]

[[grant]]
identities = ["anonymous"]
operations = ["status"]
"#;

/// A policy cluster and its client identities.
struct Setup {
    cluster: Cluster,
    _dir: tempfile::TempDir,
    client_ca: TestCa,
    alice: Issued,
    bob: Issued,
    ops: Issued,
    tokens: PathBuf,
}

fn sha256_hex(s: &str) -> String {
    sha2::Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

async fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let client_ca = TestCa::new(dir.path(), "client").unwrap();
    let alice = client_ca.issue("alice", &[], &[]).unwrap();
    let bob = client_ca.issue("bob", &[], &[]).unwrap();
    let ops = client_ca.issue("ops", &[], &[]).unwrap();
    let policy = dir.path().join("policy.toml");
    std::fs::write(&policy, POLICY).unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(
        &tokens,
        format!("# name  sha256(secret)\nci {}\n", sha256_hex(CI_SECRET)),
    )
    .unwrap();
    let cluster = Cluster::start(ClusterOptions {
        tls: true,
        audit: true,
        extra_args: vec![
            "--tls-client-ca".into(),
            client_ca.cert_path.display().to_string(),
            "--auth-policy".into(),
            policy.display().to_string(),
            "--auth-tokens".into(),
            tokens.display().to_string(),
        ],
        ..Default::default()
    })
    .await
    .unwrap();
    Setup {
        cluster,
        _dir: dir,
        client_ca,
        alice,
        bob,
        ops,
        tokens,
    }
}

/// A TLS channel to node `id`, presenting `identity` if given.
fn channel(cluster: &Cluster, id: u64, identity: Option<&Issued>) -> Channel {
    let tls = cluster.tls.as_ref().unwrap();
    let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(
        std::fs::read(&tls.peer_ca.cert_path).unwrap(),
    ));
    if let Some(i) = identity {
        config = config.identity(Identity::from_pem(
            std::fs::read(&i.cert).unwrap(),
            std::fs::read(&i.key).unwrap(),
        ));
    }
    Channel::from_shared(format!("https://{}", cluster.addr(id)))
        .unwrap()
        .tls_config(config)
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy()
}

fn lock(cluster: &Cluster, id: u64, identity: Option<&Issued>) -> LockClient<Channel> {
    LockClient::new(channel(cluster, id, identity))
}

/// `msg` with extra metadata (ASCII and binary keys alike).
fn with_headers<T>(msg: T, headers: &[(&str, &str)]) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    for (k, v) in headers {
        if k.ends_with("-bin") {
            req.metadata_mut().insert_bin(
                tonic::metadata::BinaryMetadataKey::from_bytes(k.as_bytes()).unwrap(),
                tonic::metadata::MetadataValue::from_bytes(v.as_bytes()),
            );
        } else {
            req.metadata_mut().insert(
                tonic::metadata::AsciiMetadataKey::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
    }
    req.set_timeout(Duration::from_secs(5));
    req
}

fn acquire_req(resource: &str, request_id: &str) -> AcquireRequest {
    AcquireRequest {
        resource: resource.into(),
        request_id: request_id.into(),
        lease_ttl_ms: 30_000,
        wait_timeout_ms: 0,
        holder: "authz-test".into(),
    }
}

async fn acquire(
    c: &mut LockClient<Channel>,
    resource: &str,
    request_id: &str,
) -> Result<AcquireResponse, tonic::Status> {
    c.acquire(with_headers(acquire_req(resource, request_id), &[]))
        .await
        .map(|r| r.into_inner())
}

fn assert_denied(r: Result<impl std::fmt::Debug, tonic::Status>, identity: &str, what: &str) {
    let s = r.expect_err("allowed");
    assert_eq!(s.code(), Code::PermissionDenied, "{s:?}");
    assert!(
        s.message().starts_with("lockd: ")
            && s.message().contains(identity)
            && s.message().contains(what),
        "the refusal names {identity} and {what}: {s:?}"
    );
}

/// The node ids of the leader and one follower.
async fn leader_and_follower(cluster: &mut Cluster) -> (u64, u64) {
    let leader = cluster.leader().await.unwrap();
    (leader, if leader == 1 { 2 } else { 1 })
}

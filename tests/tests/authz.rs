//! Identity and authorization: tenants cannot touch each other's resources, a
//! request_id is worth nothing to another identity, bearer tokens identify callers, clients
//! cannot pose as forwarding nodes, and the start-up checks of the policy name the problem.
//!
//! Every suite runs a TLS cluster with a client CA, a policy and a tokens file:
//! - `cert:alice (client)`: tenant `tenant-a/` and the shared prefix `shared/`;
//! - `cert:bob (client)` and `token:ci`: tenant `tenant-b/` and `shared/`;
//! - `cert:ops (client)`: status and admin only;
//! - `anonymous`: status only (the harness waits for a leader with anonymous status calls).

use std::path::PathBuf;
use std::time::Duration;

use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{
    AcquireRequest, AcquireResponse, DescribeRequest, ReleaseRequest, RenewRequest, StatusRequest,
};
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

/// Goal: tenant A cannot acquire, renew, release or describe under tenant B's
/// prefix, neither on the leader nor through a follower (which forwards), and the refusal names
/// A and the resource. Method: B holds `tenant-b/job`; A, knowing B's lease id, tries all four
/// operations on both nodes; B's lease is untouched afterwards. Control: A works under its own
/// prefix on both nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue15_tenant_a_cannot_touch_tenant_b() {
    let mut s = setup().await;
    let (leader, follower) = leader_and_follower(&mut s.cluster).await;
    let mut bob = lock(&s.cluster, leader, Some(&s.bob));
    let held = acquire(&mut bob, "tenant-b/job", "b-1").await.unwrap();
    for node in [leader, follower] {
        let mut alice = lock(&s.cluster, node, Some(&s.alice));
        assert_denied(
            acquire(&mut alice, "tenant-b/job", &format!("a-{node}")).await,
            ALICE,
            "acquire \"tenant-b/job\"",
        );
        assert_denied(
            alice
                .renew(with_headers(
                    RenewRequest {
                        resource: "tenant-b/job".into(),
                        lease_id: held.lease_id.clone(),
                        lease_ttl_ms: 0,
                    },
                    &[],
                ))
                .await,
            ALICE,
            "renew \"tenant-b/job\"",
        );
        assert_denied(
            alice
                .release(with_headers(
                    ReleaseRequest {
                        resource: "tenant-b/job".into(),
                        lease_id: held.lease_id.clone(),
                    },
                    &[],
                ))
                .await,
            ALICE,
            "release \"tenant-b/job\"",
        );
        assert_denied(
            alice
                .describe(with_headers(
                    DescribeRequest {
                        resource: "tenant-b/job".into(),
                    },
                    &[],
                ))
                .await,
            ALICE,
            "describe \"tenant-b/job\"",
        );
        // A prefix is a prefix of whole segments: "tenant-a/" does not cover "tenant-ab/".
        assert_denied(
            acquire(&mut alice, "tenant-ab/x", &format!("ab-{node}")).await,
            ALICE,
            "\"tenant-ab/x\"",
        );
        // Control: A's own tenant.
        let own = acquire(
            &mut alice,
            &format!("tenant-a/own-{node}"),
            &format!("own-{node}"),
        )
        .await
        .unwrap();
        assert!(own.fencing_token > held.fencing_token);
    }
    // B's lease is still B's: renewing it works, and it is still held.
    bob.renew(with_headers(
        RenewRequest {
            resource: "tenant-b/job".into(),
            lease_id: held.lease_id.clone(),
            lease_ttl_ms: 0,
        },
        &[],
    ))
    .await
    .unwrap();
    let d = bob
        .describe(with_headers(
            DescribeRequest {
                resource: "tenant-b/job".into(),
            },
            &[],
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(d.held && d.fencing_token == held.fencing_token, "{d:?}");
    // Denials are counted per identity; identities outside the policy as "other".
    let mallory = s.client_ca.issue("mallory", &[], &[]).unwrap();
    assert_denied(
        acquire(
            &mut lock(&s.cluster, leader, Some(&mallory)),
            "tenant-a/x",
            "m-1",
        )
        .await,
        "cert:mallory (client)",
        "\"tenant-a/x\"",
    );
    let metrics = s.cluster.metrics_text(leader).await.unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("lockd_auth_denied_total")
                && l.contains("identity=\"cert:alice (client)\"")
                && l.contains("op=\"renew\"")),
        "{metrics}"
    );
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("lockd_auth_denied_total") && l.contains("identity=\"other\"")),
        "{metrics}"
    );
    assert!(!metrics.contains("mallory"), "unbounded label: {metrics}");
}

/// Goal: A's request_id replayed by B returns nothing of A's. Method: A
/// acquires `shared/r` (a prefix both may use) with request id `rid-1`; B sends the very same
/// request (same resource, id, ttl and holder), on the leader and through a follower; before
/// the dedup window was keyed per identity, B got A's lease id and token. Now B gets its own
/// answer: ABORTED, the resource is held (by A), recorded as B's own outcome for `rid-1` (a retry
/// of it gets ABORTED again; reusing it on another resource is INVALID_ARGUMENT, not A's lease),
/// and B's next request id on another resource is B's own fresh lease. Control: A's own retry still returns A's lease (dedup works per identity), and the
/// audit log names the identity of each grant, with the digest of the client's own request id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue15_a_request_id_replayed_by_another_identity_returns_nothing_of_theirs() {
    let mut s = setup().await;
    let (leader, follower) = leader_and_follower(&mut s.cluster).await;
    let mut alice = lock(&s.cluster, follower, Some(&s.alice));
    let a = acquire(&mut alice, "shared/r", "rid-1").await.unwrap();
    for node in [leader, follower] {
        let mut bob = lock(&s.cluster, node, Some(&s.bob));
        match acquire(&mut bob, "shared/r", "rid-1").await {
            Ok(reply) => {
                panic!("B replaying A's request id on node {node} got {reply:?} (A's: {a:?})")
            }
            Err(st) => {
                assert_eq!(st.code(), Code::Aborted, "{st:?}");
                assert!(!st.message().contains(&a.lease_id), "{st:?}");
            }
        }
    }
    let mut bob = lock(&s.cluster, leader, Some(&s.bob));
    let st = acquire(&mut bob, "shared/other", "rid-1")
        .await
        .unwrap_err();
    assert_eq!(st.code(), Code::InvalidArgument, "{st:?}");
    let b = acquire(&mut bob, "shared/other", "rid-2").await.unwrap();
    assert_ne!(b.lease_id, a.lease_id);
    // A's retry, through the other node: A's original outcome.
    let again = acquire(
        &mut lock(&s.cluster, leader, Some(&s.alice)),
        "shared/r",
        "rid-1",
    )
    .await
    .unwrap();
    assert_eq!(
        (again.lease_id.as_str(), again.fencing_token),
        (a.lease_id.as_str(), a.fencing_token)
    );
    // The same id with other arguments names the client's id, not the scoped one.
    let st = acquire(&mut alice, "shared/r2", "rid-1").await.unwrap_err();
    assert_eq!(st.code(), Code::InvalidArgument, "{st:?}");
    assert!(
        st.message().contains("\"rid-1\"") && !st.message().contains("\\u{1}"),
        "{st:?}"
    );

    // The audit log (every replica's) names who acquired.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let audit = std::fs::read_to_string(s.cluster.audit_path(leader)).unwrap();
    let digest = lockd_tests::audit::request_digest("rid-1");
    let line = |resource: &str| -> serde_json::Value {
        audit
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .find(|v| v["resource"] == resource && v["op"] == "acquire")
            .unwrap_or_else(|| panic!("no acquire of {resource} in {audit}"))
    };
    let (ra, rb) = (line("shared/r"), line("shared/other"));
    assert_eq!(ra["identity"], ALICE, "{ra}");
    assert_eq!(rb["identity"], BOB, "{rb}");
    assert_eq!(ra["request_digest"], digest.as_str(), "{ra}");
    assert!(!audit.contains("rid-1"), "a request id in clear: {audit}");
}

/// Goal: a bearer token from `--auth-tokens` identifies a caller; a wrong token is
/// UNAUTHENTICATED (not anonymous), and so is another scheme. lockctl takes the token from
/// `--auth-token-file` and prints PERMISSION_DENIED and UNAUTHENTICATED as one line each with
/// their own exit codes (11, 12). Method: a raw gRPC client with the header, then lockctl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue15_bearer_tokens_identify_and_wrong_tokens_are_unauthenticated() {
    let mut s = setup().await;
    let (leader, follower) = leader_and_follower(&mut s.cluster).await;
    for node in [leader, follower] {
        let mut c = lock(&s.cluster, node, None);
        let bearer = format!("Bearer {CI_SECRET}");
        c.acquire(with_headers(
            acquire_req(&format!("tenant-b/tok-{node}"), &format!("t-{node}")),
            &[("authorization", &bearer)],
        ))
        .await
        .unwrap();
        assert_denied(
            c.acquire(with_headers(
                acquire_req("tenant-a/tok", &format!("t2-{node}")),
                &[("authorization", &bearer)],
            ))
            .await,
            "token:ci",
            "\"tenant-a/tok\"",
        );
        for bad in [
            format!("Bearer {}x", CI_SECRET),
            "Bearer short".to_owned(),
            format!("Basic {CI_SECRET}"),
        ] {
            let st = c
                .acquire(with_headers(
                    acquire_req("tenant-b/bad", "bad"),
                    &[("authorization", &bad)],
                ))
                .await
                .unwrap_err();
            assert_eq!(st.code(), Code::Unauthenticated, "{bad}: {st:?}");
            assert!(!st.message().contains(CI_SECRET), "{st:?}");
        }
        // A wrong token with a good certificate is still refused: the token was asked for.
        let st = lock(&s.cluster, node, Some(&s.bob))
            .acquire(with_headers(
                acquire_req("tenant-b/bad2", "bad2"),
                &[("authorization", "Bearer 0000000000000000000000000000")],
            ))
            .await
            .unwrap_err();
        assert_eq!(st.code(), Code::Unauthenticated, "{st:?}");
    }

    // lockctl.
    let ca = s.cluster.tls.as_ref().unwrap().peer_ca.cert_path.clone();
    let token_file = s.tokens.with_file_name("ci.token");
    std::fs::write(&token_file, format!("{CI_SECRET}\n")).unwrap();
    let bad_file = s.tokens.with_file_name("bad.token");
    std::fs::write(&bad_file, "not-the-secret-0000000000000000\n").unwrap();
    let eps = s.cluster.endpoints();
    let run = |extra: &[&str]| {
        let out = lockd_tests::process::command("lockctl")
            .args([
                "--endpoints",
                eps.as_str(),
                "--cacert",
                ca.to_str().unwrap(),
                "--timeout",
                "5s",
            ])
            .args(extra)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let tf = token_file.to_str().unwrap();
    let (code, out, err) = run(&["--auth-token-file", tf, "acquire", "tenant-b/ctl"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("fencing_token"), "{out}");
    let (code, out, err) = run(&["--auth-token-file", tf, "acquire", "tenant-a/ctl"]);
    assert_eq!(code, 11, "{out}{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.starts_with("lockctl: ")
            && err.contains("permission denied")
            && err.contains("token:ci")
            && err.contains("\"tenant-a/ctl\""),
        "{err}"
    );
    let (code, out, err) = run(&["--auth-token-file", bad_file.to_str().unwrap(), "status"]);
    assert_eq!(code, 12, "{out}{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("bearer token is not valid"), "{err}");
    // The environment variable works as the flag does.
    let out = lockd_tests::process::command("lockctl")
        .args([
            "--endpoints",
            eps.as_str(),
            "--cacert",
            ca.to_str().unwrap(),
        ])
        .args(["describe", "tenant-b/ctl"])
        .env("LOCKCTL_AUTH_TOKEN_FILE", tf)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    // Certificates work through lockctl too, and a denial is one line.
    let (code, _, err) = run(&[
        "--cert",
        s.alice.cert.to_str().unwrap(),
        "--key",
        s.alice.key.to_str().unwrap(),
        "describe",
        "tenant-b/ctl",
    ]);
    assert_eq!(code, 11, "{err}");
    assert!(err.contains(ALICE), "{err}");
}

/// Goal: a client that sets the forwarding headers itself gains nothing: it can claim
/// neither another identity nor forwarded status. Method: with alice's certificate, with no
/// certificate, and with a client certificate naming node 2 (issued by the client CA, not the
/// peer CA), send calls carrying `lockd-forwarded-by` and/or `lockd-forwarded-identity-bin`
/// naming bob, to the leader and to a follower. Every one is UNAUTHENTICATED, and nothing was
/// acquired. Control: the same calls without the headers are judged as the caller itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue15_clients_cannot_claim_forwarded_identities() {
    let mut s = setup().await;
    let (leader, follower) = leader_and_follower(&mut s.cluster).await;
    let fake_node = s
        .client_ca
        .issue("fake-node2", &["node-2.test.lockd".to_owned()], &[])
        .unwrap();
    let by = lockd_api::FORWARDED_HEADER;
    let ident = lockd_server::auth::FORWARDED_IDENTITY_HEADER;
    let header_sets: Vec<Vec<(&str, &str)>> = vec![
        vec![(by, "2"), (ident, BOB)],
        vec![(ident, BOB)],
        vec![(by, "2")],
    ];
    for who in [Some(&s.alice), None, Some(&fake_node)] {
        for node in [leader, follower] {
            for headers in &header_sets {
                let mut c = lock(&s.cluster, node, who);
                let st = c
                    .acquire(with_headers(
                        acquire_req("tenant-b/forged", "forged"),
                        headers,
                    ))
                    .await
                    .unwrap_err();
                assert_eq!(st.code(), Code::Unauthenticated, "{headers:?}: {st:?}");
                assert!(st.message().starts_with("lockd: "), "{st:?}");
                let st = ClusterClient::new(channel(&s.cluster, node, who))
                    .status(with_headers(StatusRequest {}, headers))
                    .await
                    .unwrap_err();
                assert_eq!(st.code(), Code::Unauthenticated, "{headers:?}: {st:?}");
            }
        }
    }
    // Control: without the headers, alice is alice.
    assert_denied(
        acquire(
            &mut lock(&s.cluster, follower, Some(&s.alice)),
            "tenant-b/forged",
            "f2",
        )
        .await,
        ALICE,
        "\"tenant-b/forged\"",
    );
    let d = lock(&s.cluster, leader, Some(&s.bob))
        .describe(with_headers(
            DescribeRequest {
                resource: "tenant-b/forged".into(),
            },
            &[],
        ))
        .await
        .unwrap()
        .into_inner();
    assert!(!d.held, "{d:?}");
}

/// Goal: status (and admin) follow the policy. Method: `cert:ops` and `anonymous`
/// are granted status, alice is not: alice gets PERMISSION_DENIED naming her and the operation,
/// on every node (status is answered locally, never forwarded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue15_status_follows_the_policy() {
    let s = setup().await;
    for node in 1..=3 {
        let st = ClusterClient::new(channel(&s.cluster, node, Some(&s.alice)))
            .status(with_headers(StatusRequest {}, &[]))
            .await
            .unwrap_err();
        assert_eq!(st.code(), Code::PermissionDenied, "{st:?}");
        assert!(
            st.message().contains(ALICE) && st.message().contains("status"),
            "{st:?}"
        );
        ClusterClient::new(channel(&s.cluster, node, Some(&s.ops)))
            .status(with_headers(StatusRequest {}, &[]))
            .await
            .unwrap();
        ClusterClient::new(channel(&s.cluster, node, None))
            .status(with_headers(StatusRequest {}, &[]))
            .await
            .unwrap();
        // ops may not lock anything, anonymous neither.
        for who in [Some(&s.ops), None] {
            let st = acquire(&mut lock(&s.cluster, node, who), "tenant-a/x", "o-1")
                .await
                .unwrap_err();
            assert_eq!(st.code(), Code::PermissionDenied, "{st:?}");
        }
    }
}

/// Goal: the signing key's admin RPCs follow the
/// policy's `admin`: a tenant may neither list nor rotate the key, on the leader or through a
/// follower, and the operator (`cert:ops`, granted `admin`) may, through a follower as well
/// (the follower forwards the operator's identity, which the leader authorizes again). Method:
/// the policy cluster; SigningKeys and RotateSigningKey from alice, anonymous and ops, on every
/// node; the active key id before and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue15_signing_key_admin_calls_follow_the_policy() {
    use lockd_api::v1::{RotateSigningKeyRequest, SigningKeysRequest};
    let mut s = setup().await;
    let (leader, follower) = leader_and_follower(&mut s.cluster).await;
    // The key is installed right after the first leader's first commit.
    let mut active = None;
    for _ in 0..50 {
        let keys = ClusterClient::new(channel(&s.cluster, leader, Some(&s.ops)))
            .signing_keys(with_headers(SigningKeysRequest {}, &[]))
            .await
            .unwrap()
            .into_inner();
        active = keys
            .keys
            .iter()
            .find(|k| k.active)
            .map(|k| k.key_id.clone());
        if active.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let active = active.expect("an active signing key");
    for node in [leader, follower] {
        for who in [Some(&s.alice), None] {
            let st = ClusterClient::new(channel(&s.cluster, node, who))
                .rotate_signing_key(with_headers(
                    RotateSigningKeyRequest {
                        replaces_key_id: active.clone(),
                    },
                    &[],
                ))
                .await
                .unwrap_err();
            assert_eq!(st.code(), Code::PermissionDenied, "node {node}: {st:?}");
            assert!(st.message().contains("admin"), "{st:?}");
            let st = ClusterClient::new(channel(&s.cluster, node, who))
                .signing_keys(with_headers(SigningKeysRequest {}, &[]))
                .await
                .unwrap_err();
            assert_eq!(st.code(), Code::PermissionDenied, "node {node}: {st:?}");
        }
    }
    let keys = ClusterClient::new(channel(&s.cluster, follower, Some(&s.ops)))
        .signing_keys(with_headers(SigningKeysRequest {}, &[]))
        .await
        .unwrap()
        .into_inner();
    let still = keys.keys.iter().find(|k| k.active).unwrap();
    assert_eq!(still.key_id, active, "refused calls rotated nothing");
    let rotated = ClusterClient::new(channel(&s.cluster, follower, Some(&s.ops)))
        .rotate_signing_key(with_headers(
            RotateSigningKeyRequest {
                replaces_key_id: active.clone(),
            },
            &[],
        ))
        .await
        .expect("the operator rotates through a follower")
        .into_inner();
    assert_ne!(rotated.key_id, active);
}

/// Goal: start-up refuses a bad policy, tokens file or combination with one line
/// that names the problem. Method: `lockd` with each bad input exits non-zero; its stderr is one
/// line naming the flag, the file and the line or value.
#[test]
fn issue15_bad_policies_fail_at_start_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "peer").unwrap();
    let node = ca
        .issue_node("lockd", 1, std::net::Ipv4Addr::LOCALHOST.into())
        .unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let good = write("good.toml", POLICY);
    let typo = write(
        "typo.toml",
        "[[grant]]\nidentities = [\"cert:a\"]\nresources = [\"a/\"]\noperations = [\"aquire\"]\n",
    );
    let prefix = write(
        "prefix.toml",
        "[[grant]]\nidentities = [\"cert:a\"]\n\nresources = [\"a/*\"]\noperations = [\"acquire\"]\n",
    );
    let tokens = write("tokens", "ci not-hex\n");
    let port = 7000 + (std::process::id() % 1000) as u16;
    let tls: Vec<String> = vec![
        "--tls-cert".into(),
        node.cert.display().to_string(),
        "--tls-key".into(),
        node.key.display().to_string(),
        "--peer-ca".into(),
        ca.cert_path.display().to_string(),
    ];
    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        (
            [tls.clone(), vec!["--auth-policy".into(), typo.clone()]].concat(),
            vec!["--auth-policy", "typo.toml", "line 4", "\"aquire\""],
        ),
        (
            [tls.clone(), vec!["--auth-policy".into(), prefix.clone()]].concat(),
            vec!["prefix.toml", "line 4", "\"a/*\""],
        ),
        (
            [
                tls.clone(),
                vec![
                    "--auth-policy".into(),
                    good.clone(),
                    "--auth-tokens".into(),
                    tokens.clone(),
                ],
            ]
            .concat(),
            vec!["--auth-tokens", "line 1", "64 hex digits"],
        ),
        (
            [
                tls.clone(),
                vec!["--auth-policy".into(), "/nonexistent/p.toml".into()],
            ]
            .concat(),
            vec!["--auth-policy", "/nonexistent/p.toml"],
        ),
        (
            vec!["--auth-policy".into(), good.clone()],
            vec!["--auth-policy", "needs TLS", "--tls-cert"],
        ),
        (
            [tls.clone(), vec!["--auth-tokens".into(), tokens.clone()]].concat(),
            vec!["--auth-tokens", "needs --auth-policy"],
        ),
    ];
    for (i, (args, expect)) in cases.into_iter().enumerate() {
        let out = lockd_tests::process::command("lockd")
            .args(["--id", "1", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .arg("--data-dir")
            .arg(dir.path().join(format!("d{i}")))
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.trim_end().lines().last().unwrap_or_default().to_owned();
        assert!(!out.status.success(), "{args:?} started");
        for e in expect {
            assert!(
                last.contains(e),
                "{args:?}: {e:?} not in {last:?} (stderr {err})"
            );
        }
        assert!(last.starts_with("lockd: "), "{err}");
    }
}

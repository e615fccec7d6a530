//! Tenants cannot touch each other's resources, and a request id is worth nothing to another
//! identity.

use std::time::Duration;

use super::{ALICE, BOB, acquire, assert_denied, leader_and_follower, lock, setup, with_headers};
use lockd_api::v1::{DescribeRequest, ReleaseRequest, RenewRequest};
use lockd_tests::poll;
use tonic::Code;

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

    // The audit log (every replica's) names who acquired. Its writer is a thread of its own:
    // wait until it wrote both grants.
    let audit = poll::until(
        "the audit log holds both grants",
        Duration::from_secs(10),
        || {
            let audit = std::fs::read_to_string(s.cluster.audit_path(leader)).unwrap_or_default();
            let acquired = |resource: &str| {
                audit
                    .lines()
                    .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                    .any(|v| v["resource"] == resource && v["op"] == "acquire")
            };
            if acquired("shared/r") && acquired("shared/other") {
                Ok(audit)
            } else {
                Err(audit)
            }
        },
    )
    .await;
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

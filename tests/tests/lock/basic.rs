//! The lock API against a real three-node cluster: grants, renewals, releases, held resources,
//! expiry, validation and the order of fencing tokens.

use std::time::Duration;

use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{
    AcquireRequest, AcquireResponse, DescribeRequest, ReleaseRequest, RenewRequest,
};
use lockd_tests::cluster::Cluster;
use lockd_tests::poll;
use tonic::Code;
use tonic::transport::Channel;

fn acquire_req(resource: &str, request_id: &str, ttl_ms: u64) -> AcquireRequest {
    AcquireRequest {
        resource: resource.into(),
        request_id: request_id.into(),
        lease_ttl_ms: ttl_ms,
        wait_timeout_ms: 0,
        holder: format!("test-{request_id}"),
    }
}

async fn acquire(
    c: &mut LockClient<Channel>,
    resource: &str,
    request_id: &str,
    ttl_ms: u64,
) -> Result<AcquireResponse, tonic::Status> {
    c.acquire(acquire_req(resource, request_id, ttl_ms))
        .await
        .map(|r| r.into_inner())
}

/// Goal: the basic lifecycle works from any node. Method: acquire on a follower, see ABORTED
/// for a second acquirer, renew, release with a wrong and the right lease, re-acquire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_renew_release_from_any_node() {
    let mut cluster = Cluster::start_default().await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let mut a = cluster.lock_client(follower).await.unwrap();
    let mut b = cluster.lock_client(leader).await.unwrap();

    // Phase 1: uncontended acquire through a follower (forwarded to the leader).
    let lease = acquire(&mut a, "orders/42", "req-a", 10_000).await.unwrap();
    assert_eq!(lease.lease_id.len(), 32);
    assert!(lease.fencing_token > 0);
    assert_eq!(lease.lease_ttl_ms, 10_000);

    // Phase 2: a second holder is refused with ABORTED naming the resource and holder.
    let err = acquire(&mut b, "orders/42", "req-b", 10_000)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Aborted, "{err:?}");
    assert!(
        err.message().starts_with("lockd: ") && err.message().contains("orders/42"),
        "{}",
        err.message()
    );

    // Phase 3: renew, and Describe shows the holder without the lease id.
    let renewed = a
        .renew(RenewRequest {
            resource: "orders/42".into(),
            lease_id: lease.lease_id.clone(),
            lease_ttl_ms: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(renewed.expires_at_unix_ms >= lease.expires_at_unix_ms);
    let d = b
        .describe(DescribeRequest {
            resource: "orders/42".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(d.held);
    assert_eq!(d.holder, "test-req-a");
    assert_eq!(d.fencing_token, lease.fencing_token);

    // Phase 4: release with a made-up lease: false, holder keeps it. Then the real one.
    let wrong = b
        .release(ReleaseRequest {
            resource: "orders/42".into(),
            lease_id: "0".repeat(32),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!wrong.released);
    assert!(
        b.describe(DescribeRequest {
            resource: "orders/42".into()
        })
        .await
        .unwrap()
        .into_inner()
        .held
    );
    let ok = a
        .release(ReleaseRequest {
            resource: "orders/42".into(),
            lease_id: lease.lease_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(ok.released);

    // Phase 5: B gets it now, with a larger token; A's old lease cannot release B.
    let lease_b = acquire(&mut b, "orders/42", "req-b2", 10_000)
        .await
        .unwrap();
    assert!(lease_b.fencing_token > lease.fencing_token);
    let stale = a
        .release(ReleaseRequest {
            resource: "orders/42".into(),
            lease_id: lease.lease_id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!stale.released);
    let d = a
        .describe(DescribeRequest {
            resource: "orders/42".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(d.held && d.fencing_token == lease_b.fencing_token);
}

/// Goal: a lease nobody renews expires by the leader's clock; the next grant gets a larger token
/// and the old lease can no longer renew. Method: 1.5 s ttl, wait, acquire again, renew old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unrenewed_lease_expires_and_old_lease_is_not_found() {
    let cluster = Cluster::start_default().await.unwrap();
    let mut c = cluster.lock_client(1).await.unwrap();
    let first = acquire(&mut c, "jobs/expire", "e1", 1_500).await.unwrap();
    assert_eq!(
        acquire(&mut c, "jobs/expire", "e2", 1_500)
            .await
            .unwrap_err()
            .code(),
        Code::Aborted
    );
    // Within 2 s of the grant, as the test always allowed, the reaper must have ended it.
    poll::until_async(
        "the reaper expired the lease",
        Duration::from_millis(2_000),
        || {
            let mut c = c.clone();
            async move {
                let d = c
                    .describe(DescribeRequest {
                        resource: "jobs/expire".into(),
                    })
                    .await
                    .map_err(|e| format!("{e:?}"))?
                    .into_inner();
                if d.held {
                    Err(format!("{d:?}"))
                } else {
                    Ok(())
                }
            }
        },
    )
    .await;
    let second = acquire(&mut c, "jobs/expire", "e3", 1_500).await.unwrap();
    assert!(second.fencing_token > first.fencing_token);
    let err = c
        .renew(RenewRequest {
            resource: "jobs/expire".into(),
            lease_id: first.lease_id,
            lease_ttl_ms: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert!(err.message().contains("jobs/expire"));
}

/// Goal: tokens strictly increase over many grants on mixed resources. Method: 1,000 acquires
/// over 50 resources (released as we go), from 8 concurrent tasks on all nodes; sort by token in
/// completion order per task and check global uniqueness and per-resource monotonicity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_grants_have_strictly_increasing_tokens() {
    let cluster = Cluster::start_default().await.unwrap();
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let mut c = cluster.lock_client(t % 3 + 1).await.unwrap();
        tasks.push(tokio::spawn(async move {
            let mut tokens = Vec::new();
            for i in 0..125u64 {
                let resource = format!("mixed/{}", (t * 125 + i) % 50 + t * 1000);
                let lease = acquire(&mut c, &resource, &format!("t{t}-{i}"), 5_000)
                    .await
                    .unwrap();
                tokens.push(lease.fencing_token);
                c.release(ReleaseRequest {
                    resource,
                    lease_id: lease.lease_id,
                })
                .await
                .unwrap();
            }
            tokens
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        let tokens = t.await.unwrap();
        // Each task's grants happen one after another: its tokens increase.
        assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
        all.extend(tokens);
    }
    let n = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), n, "a token was issued twice");
    assert_eq!(n, 1_000);
}

/// Goal: bad input is INVALID_ARGUMENT naming the field, before anything is proposed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_invalid_argument_naming_the_field() {
    let cluster = Cluster::start_default().await.unwrap();
    let mut c = cluster.lock_client(2).await.unwrap();
    let cases: Vec<(AcquireRequest, &str)> = vec![
        (acquire_req("", "r1", 0), "resource"),
        (acquire_req(&"x".repeat(257), "r2", 0), "resource"),
        (acquire_req("bad\nname", "r3", 0), "resource"),
        (acquire_req("ok", "", 0), "request_id"),
        (acquire_req("ok", &"i".repeat(129), 0), "request_id"),
        (acquire_req("ok", "r4", 999), "lease_ttl_ms"),
        (acquire_req("ok", "r5", 300_001), "lease_ttl_ms"),
        (
            AcquireRequest {
                wait_timeout_ms: 300_001,
                ..acquire_req("ok", "r6", 0)
            },
            "wait_timeout_ms",
        ),
    ];
    for (req, field) in cases {
        let err = c.acquire(req.clone()).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{req:?}: {err:?}");
        assert!(
            err.message().starts_with("lockd: ") && err.message().contains(field),
            "{req:?}: {}",
            err.message()
        );
    }
    // The same request_id with other arguments.
    acquire(&mut c, "reuse/a", "same-id", 5_000).await.unwrap();
    let err = acquire(&mut c, "reuse/b", "same-id", 5_000)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("request_id") && err.message().contains("same-id"),
        "{}",
        err.message()
    );
    // Malformed lease id on Renew.
    let err = c
        .renew(RenewRequest {
            resource: "reuse/a".into(),
            lease_id: "nope".into(),
            lease_ttl_ms: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("lease_id"));
}

//! What `Cluster.Status` shows of the resources: its hot lists (most acquired, longest queues)
//! name resources, and a resource's name is the tenant's business (`customer-4711/payroll-run`).

use std::time::Duration;

use lockd_api::v1::cluster_client::ClusterClient;
use lockd_api::v1::{AcquireRequest, DescribeRequest, StatusRequest, StatusResponse};
use lockd_tests::poll;
use lockd_tests::tls::Issued;

use super::{acquire, assert_denied, channel, lock, setup, with_headers};

/// The resource names in both hot lists of a Status reply.
fn hot_names(s: &StatusResponse) -> Vec<String> {
    s.hot_by_acquires
        .iter()
        .chain(&s.hot_by_waiters)
        .map(|h| h.resource.clone())
        .collect()
}

async fn status(
    cluster: &lockd_tests::cluster::Cluster,
    node: u64,
    who: Option<&Issued>,
) -> StatusResponse {
    ClusterClient::new(channel(cluster, node, who))
        .status(with_headers(StatusRequest {}, &[]))
        .await
        .unwrap()
        .into_inner()
}

/// Goal (review of 2026-12-05, third round, finding 1): under a policy, Status's hot lists name
/// only the resources the caller may describe; an admin sees them all. Before the fix, a caller
/// granted `status` (tenant B's monitor, or anonymous, as the README's example policy grants)
/// read tenant A's resource names there, though Describe of them was refused.
/// Method: alice (tenant A) acquires `tenant-a/customer-4711/payroll-run` and queues a waiter
/// behind it; bob (tenant B) acquires `tenant-b/nightly`; alice then acquires twelve more
/// resources twice each, so that the top ten by acquires are all A's. On every node, once the
/// operator (`admin`) sees that: B's monitor sees `tenant-b/nightly` (from beyond the top ten)
/// and no `tenant-a/` name (it is refused a Describe of A's); anonymous (status only) sees no
/// name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review3_status_hot_lists_show_only_what_the_caller_may_describe() {
    let s = setup().await;
    let monitor = s.client_ca.issue("b-monitor", &[], &[]).unwrap();
    const SECRET: &str = "tenant-a/customer-4711/payroll-run";
    let mut alice = lock(&s.cluster, 1, Some(&s.alice));
    for i in 0..3 {
        let held = acquire(&mut alice, SECRET, &format!("pay-{i}"))
            .await
            .unwrap();
        alice
            .release(with_headers(
                lockd_api::v1::ReleaseRequest {
                    resource: SECRET.into(),
                    lease_id: held.lease_id,
                },
                &[],
            ))
            .await
            .unwrap();
    }
    acquire(&mut alice, SECRET, "pay-held").await.unwrap();
    // A waiter behind it puts the name in the longest queues as well.
    let mut waiter = lock(&s.cluster, 1, Some(&s.alice));
    let waiting = tokio::spawn(async move {
        let mut req = with_headers(
            AcquireRequest {
                resource: SECRET.into(),
                request_id: "pay-wait".into(),
                lease_ttl_ms: 30_000,
                wait_timeout_ms: 60_000,
                holder: "authz-test".into(),
            },
            &[],
        );
        req.set_timeout(Duration::from_secs(90));
        waiter.acquire(req).await
    });
    let mut bob = lock(&s.cluster, 1, Some(&s.bob));
    acquire(&mut bob, "tenant-b/nightly", "n-1").await.unwrap();
    // Twelve resources of A's, each acquired twice, push B's (acquired once) out of the top ten:
    // B's monitor must still find its own there (the lists are chosen from every tracked
    // resource, not from the top ten after the cut).
    for k in 0..12 {
        let resource = format!("tenant-a/hot-{k}");
        for i in 0..2 {
            let held = acquire(&mut alice, &resource, &format!("hot-{k}-{i}"))
                .await
                .unwrap();
            alice
                .release(with_headers(
                    lockd_api::v1::ReleaseRequest {
                        resource: resource.clone(),
                        lease_id: held.lease_id,
                    },
                    &[],
                ))
                .await
                .unwrap();
        }
    }

    for node in 1..=3 {
        poll::until_async(
            "the operator sees A's resources fill the top ten, A's waiter among the queues",
            Duration::from_secs(20),
            || async {
                let st = status(&s.cluster, node, Some(&s.ops)).await;
                let names = hot_names(&st);
                let queued = st.hot_by_waiters.iter().any(|h| h.resource == SECRET);
                let top_is_a = st.hot_by_acquires.len() == 10
                    && st
                        .hot_by_acquires
                        .iter()
                        .all(|h| h.resource.starts_with("tenant-a/"));
                if names.iter().any(|n| n == SECRET) && top_is_a && queued {
                    Ok(())
                } else {
                    Err(format!("{st:?}"))
                }
            },
        )
        .await;
        // B's monitor may not describe A's resource...
        assert_denied(
            lock(&s.cluster, node, Some(&monitor))
                .describe(with_headers(
                    DescribeRequest {
                        resource: SECRET.into(),
                    },
                    &[],
                ))
                .await,
            "cert:b-monitor (client)",
            "describe",
        );
        // ... so Status does not name it either; B's own resource it does name.
        let st = status(&s.cluster, node, Some(&monitor)).await;
        let names = hot_names(&st);
        assert!(
            names.iter().all(|n| n.starts_with("tenant-b/"))
                && names.contains(&"tenant-b/nightly".to_owned()),
            "node {node}: tenant B's monitor sees {names:?}"
        );
        // Anonymous may describe nothing: no names at all; the counters stay.
        let st = status(&s.cluster, node, None).await;
        assert!(
            hot_names(&st).is_empty(),
            "node {node}: anonymous sees {:?}",
            hot_names(&st)
        );
        assert!(st.active_locks >= 2 && st.waiters >= 1, "{st:?}");
    }
    waiting.abort();
}

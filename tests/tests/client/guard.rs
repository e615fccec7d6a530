//! The client library: a guard keeps its lease, learns of its loss before the lease can move,
//! and acquires ride out leader kills and dead endpoints.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{PROMPTLY, TTL, client, describe, eventually, serial, stalls};
use lockd_client::{AcquireOptions, Client, Error, LossReason, RequestId};
use lockd_tests::cluster::Cluster;
use tokio::time::{Instant, sleep};

/// Test 1. Goal: a guard keeps its lease across more than three ttls by renewing on its own.
/// Method: lock with a 2 s ttl, idle 3.5 ttls, then check the guard is not lost, it renewed, the
/// cluster still shows its token, and another client is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_keeps_its_lease_across_three_ttls() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let a = client(&cluster);
    let guard = a
        .lock("keep/1", AcquireOptions::default().ttl(TTL))
        .await
        .unwrap();
    assert_eq!(guard.resource(), "keep/1");
    assert_eq!(guard.ttl(), TTL);
    let lost = guard.lost();

    sleep(TTL * 3 + TTL / 2).await;

    assert!(!lost.is_lost(), "lost: {:?}", lost.reason());
    // Due every ttl/3 (minus jitter): about ten in 3.5 ttls; six leaves room for a slow machine.
    assert!(guard.renewals() >= 6, "only {} renewals", guard.renewals());
    let d = describe(&a, "keep/1").await;
    assert!(d.held);
    assert_eq!(d.fencing_token, guard.fencing_token().0);
    let b = client(&cluster);
    let err = b
        .acquire("keep/1", AcquireOptions::default().ttl(TTL))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Held { .. }), "{err:?}");

    assert!(guard.release().await.unwrap());
    assert_eq!(lost.reason(), Some(LossReason::Released));
    assert!(!describe(&a, "keep/1").await.held);
}

/// Test 2 (guard). Goal: when a holder's renewals stall, its lost signal fires before the lease can
/// be granted to anyone else; the next holder gets a larger token; the old holder, its network
/// back, does not continue. Method: the holder talks through freezable forwarders; freeze them,
/// record when the signal fires, poll Acquire from a second client until granted, and compare
/// the signal's instant with the send time of the granting Acquire on the same monotonic clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_holder_is_told_before_the_lease_can_move() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let (stalls, stalled_endpoints) = stalls(&cluster).await;
    let a = Client::new(stalled_endpoints).unwrap();
    let guard = a
        .lock("stall/1", AcquireOptions::default().ttl(TTL))
        .await
        .unwrap();
    let token_a = guard.fencing_token();
    let lost = guard.lost();
    let fired_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    {
        let lost = lost.clone();
        let fired_at = fired_at.clone();
        tokio::spawn(async move {
            lost.fired().await;
            *fired_at.lock().unwrap() = Some(Instant::now());
        });
    }
    // Let at least one renewal happen through the forwarders first.
    eventually("a first renewal", PROMPTLY, || async {
        guard.renewals() >= 1
    })
    .await;

    // Phase 1: stall A, then poll from B until the lease is free.
    for s in &stalls {
        s.freeze(true);
    }
    let frozen_at = Instant::now();
    let b = client(&cluster);
    let lease_b = loop {
        match b
            .acquire(
                "stall/1",
                AcquireOptions::default().ttl(Duration::from_secs(10)),
            )
            .await
        {
            Ok(lease) => break lease,
            Err(Error::Held { .. }) => {
                assert!(frozen_at.elapsed() < PROMPTLY, "lease never became free");
                sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("B acquire: {e}"),
        }
    };
    let fired = fired_at
        .lock()
        .unwrap()
        .expect("A's lost signal had not fired when B was granted the lease");
    assert!(
        fired < lease_b.sent_at,
        "A's signal fired {:?} after B's granting Acquire was sent",
        fired - lease_b.sent_at
    );
    assert!(
        fired - frozen_at <= TTL,
        "signal took {:?} after the stall",
        fired - frozen_at
    );
    assert!(
        matches!(lost.reason(), Some(LossReason::DeadlinePassed { .. })),
        "{:?}",
        lost.reason()
    );
    assert!(
        lease_b.fencing_token > token_a,
        "{:?} !> {:?}",
        lease_b.fencing_token,
        token_a
    );

    // Phase 2: A's network comes back; A stays lost and never renews or re-acquires.
    let renewals_at_loss = guard.renewals();
    for s in &stalls {
        s.freeze(false);
    }
    sleep(TTL).await;
    assert!(guard.is_lost());
    assert_eq!(guard.renewals(), renewals_at_loss, "a lost guard renewed");
    let err = a
        .renew("stall/1", guard.lease_id(), None)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err:?}");
    let d = describe(&b, "stall/1").await;
    assert!(d.held);
    assert_eq!(d.fencing_token, lease_b.fencing_token.0);
    // Releasing the old lease does not touch B's.
    assert!(!guard.release().await.unwrap());
    assert_eq!(
        describe(&b, "stall/1").await.fencing_token,
        lease_b.fencing_token.0
    );
    assert!(b.release("stall/1", &lease_b.lease_id).await.unwrap());
}

/// Test 4. Goal: an Acquire in flight when the leader is killed is retried with the same request
/// id and returns one lease, the same one a later retry of that id returns. Method: A holds the
/// resource; B waits for it through the leader; kill -9 the leader; A releases through the
/// survivors; B's call returns; repeat B's request id; Describe shows that single lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_retried_after_leader_kill_returns_the_same_lease() {
    let _serial = serial().await;
    let mut cluster = Cluster::start_default().await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let others: Vec<u64> = (1..=3).filter(|i| *i != leader).collect();
    let a = client(&cluster);
    let guard_a = a
        .lock(
            "failover/1",
            AcquireOptions::default().ttl(Duration::from_secs(8)),
        )
        .await
        .unwrap();

    // B talks to the leader first, so its waiting call sits on the node about to die.
    let b_endpoints = std::iter::once(leader)
        .chain(others.iter().copied())
        .map(|i| cluster.addr(i));
    let b = Client::new(b_endpoints).unwrap();
    let id = RequestId::random();
    let opts = AcquireOptions::default()
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(30))
        .request_id(id.clone());
    let waiting = {
        let b = b.clone();
        let opts = opts.clone();
        tokio::spawn(async move { b.acquire("failover/1", opts).await })
    };
    let follower = Client::new([cluster.addr(others[0])]).unwrap();
    eventually("B queued", PROMPTLY, || async {
        follower
            .describe("failover/1")
            .await
            .is_ok_and(|d| d.waiters == 1)
    })
    .await;

    cluster.kill(leader);
    let new_leader = cluster
        .wait_for_leader(Duration::from_secs(20))
        .await
        .unwrap();
    assert_ne!(new_leader, leader);
    eventually("B queued again at the new leader", PROMPTLY, || async {
        follower
            .describe("failover/1")
            .await
            .is_ok_and(|d| d.waiters == 1)
    })
    .await;
    assert!(!waiting.is_finished(), "B returned before A released");
    assert!(
        guard_a.release().await.unwrap(),
        "A's release failed after failover"
    );

    let lease_b = tokio::time::timeout(PROMPTLY, waiting)
        .await
        .expect("B's acquire did not return after A released")
        .unwrap()
        .unwrap();
    assert_eq!(lease_b.request_id, id);
    let again = b.acquire("failover/1", opts).await.unwrap();
    assert_eq!(
        again.lease_id, lease_b.lease_id,
        "a retry of the same id got another lease"
    );
    assert_eq!(again.fencing_token, lease_b.fencing_token);
    let d = describe(&follower, "failover/1").await;
    assert!(d.held);
    assert_eq!(d.fencing_token, lease_b.fencing_token.0);
    assert_eq!(d.waiters, 0, "B is queued twice");
    assert!(b.release("failover/1", &lease_b.lease_id).await.unwrap());
}

/// Test 4b. Goal: a client whose first endpoint is a dead leader still acquires, and the retried
/// request id maps to one lease. Method: kill -9 the leader, acquire at once through a list that
/// starts with it (transport errors, then UNAVAILABLE during the election), repeat the id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_rides_out_an_election_through_a_dead_endpoint() {
    let _serial = serial().await;
    let mut cluster = Cluster::start_default().await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let list: Vec<String> = std::iter::once(leader)
        .chain((1..=3).filter(|i| *i != leader))
        .map(|i| cluster.addr(i))
        .collect();
    let c = Client::new(list).unwrap();
    cluster.kill(leader);
    let id = RequestId::random();
    let opts = AcquireOptions::default()
        .ttl(Duration::from_secs(10))
        .request_id(id);
    let lease = c.acquire("election/1", opts.clone()).await.unwrap();
    let again = c.acquire("election/1", opts).await.unwrap();
    assert_eq!(again.lease_id, lease.lease_id);
    assert_eq!(again.fencing_token, lease.fencing_token);
    let d = describe(&c, "election/1").await;
    assert_eq!(d.fencing_token, lease.fencing_token.0);
}

/// Goal: a `lock()` that waited most of a ttl in the queue does not hand out a guard whose
/// deadline (counted from the Acquire's send time) is about to pass: it renews first, and the guard
/// then keeps the lease. Method: A holds with a 2 s ttl and releases after 1.6 s; B locks with a
/// 2 s ttl while waiting; B's guard must be valid for at least half a ttl and survive two ttls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_after_a_long_wait_renews_before_handing_out() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let a = client(&cluster);
    let guard_a = a
        .lock("wait/1", AcquireOptions::default().ttl(TTL))
        .await
        .unwrap();
    let b = client(&cluster);
    let waiting = {
        let b = b.clone();
        tokio::spawn(async move {
            let sent = Instant::now();
            let guard = b
                .lock(
                    "wait/1",
                    AcquireOptions::default()
                        .ttl(TTL)
                        .wait(Duration::from_secs(10)),
                )
                .await;
            (sent, guard)
        })
    };
    sleep(Duration::from_millis(1600)).await;
    assert!(guard_a.release().await.unwrap());
    let (sent, guard_b) = waiting.await.unwrap();
    let guard_b = guard_b.unwrap();
    let handed_out = Instant::now();
    assert!(
        handed_out - sent >= Duration::from_millis(1500),
        "{:?}",
        handed_out - sent
    );
    // Counted from the Acquire's send time, the deadline would be at most ~0.15 s away now.
    assert!(
        guard_b.deadline() >= handed_out + TTL / 2,
        "guard handed out with only {:?} left",
        guard_b.deadline() - handed_out
    );
    let lost = guard_b.lost();
    sleep(TTL * 2).await;
    assert!(!lost.is_lost(), "{:?}", lost.reason());
    assert_eq!(
        describe(&b, "wait/1").await.fencing_token,
        guard_b.fencing_token().0
    );
    assert!(guard_b.release().await.unwrap());
}

/// Goal: a guard whose lease stops being current (here: released by someone who knew the lease id)
/// learns it from `NOT_FOUND` at its next renewal, fires its lost signal with that reason, and
/// stops renewing. Method: release the guard's lease behind its back and wait one renewal interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_reports_not_current_when_its_lease_is_gone() {
    let _serial = serial().await;
    let cluster = Cluster::start_default().await.unwrap();
    let a = client(&cluster);
    let guard = a
        .lock("gone/1", AcquireOptions::default().ttl(TTL))
        .await
        .unwrap();
    let lost = guard.lost();
    assert!(a.release("gone/1", guard.lease_id()).await.unwrap());
    tokio::time::timeout(TTL, lost.fired())
        .await
        .expect("lost signal did not fire within one ttl");
    assert!(
        matches!(lost.reason(), Some(LossReason::NotCurrent { .. })),
        "{:?}",
        lost.reason()
    );
    assert!(guard.check().is_err());
    let renewals = guard.renewals();
    sleep(TTL).await;
    assert_eq!(guard.renewals(), renewals, "a lost guard kept renewing");
    assert!(!describe(&a, "gone/1").await.held, "the guard re-acquired");
}

//! Waiting for a lock on a real cluster: FIFO order, one wake-up per release, cancellation,
//! timeouts, limits and retries across a leader change.

use std::time::{Duration, Instant};

use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{
    AcquireRequest, AcquireResponse, DescribeRequest, DescribeResponse, ReleaseRequest,
};
use lockd_tests::cluster::{Cluster, ClusterOptions};
use tokio::task::JoinHandle;
use tonic::Code;
use tonic::transport::Channel;

fn req(resource: &str, request_id: &str, wait_ms: u64) -> AcquireRequest {
    AcquireRequest {
        resource: resource.into(),
        request_id: request_id.into(),
        lease_ttl_ms: 30_000,
        wait_timeout_ms: wait_ms,
        holder: request_id.into(),
    }
}

async fn describe(c: &mut LockClient<Channel>, resource: &str) -> DescribeResponse {
    c.describe(DescribeRequest {
        resource: resource.into(),
    })
    .await
    .unwrap()
    .into_inner()
}

async fn release(c: &mut LockClient<Channel>, resource: &str, lease: &AcquireResponse) -> bool {
    c.release(ReleaseRequest {
        resource: resource.into(),
        lease_id: lease.lease_id.clone(),
    })
    .await
    .unwrap()
    .into_inner()
    .released
}

type Waiting = JoinHandle<Result<AcquireResponse, tonic::Status>>;

/// Starts a waiting Acquire and returns once Describe shows it queued at `position`.
async fn enqueue(
    cluster: &Cluster,
    node: u64,
    resource: &str,
    request_id: &str,
    wait_ms: u64,
    position: u32,
) -> Waiting {
    let mut c = cluster.lock_client(node).await.unwrap();
    let r = req(resource, request_id, wait_ms);
    let handle = tokio::spawn(async move { c.acquire(r).await.map(|r| r.into_inner()) });
    let mut d = cluster.lock_client(node).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while describe(&mut d, resource).await.waiters < position {
        assert!(Instant::now() < deadline, "{request_id} never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    handle
}

/// Goal: queued waiters are served first come, first served with growing tokens,
/// and one release wakes exactly one of them. Method: hold, queue five through different nodes,
/// release one at a time, checking which calls returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_served_in_order_and_one_release_wakes_one() {
    let cluster = Cluster::start_default().await.unwrap();
    let mut c = cluster.lock_client(1).await.unwrap();
    let first = c
        .acquire(req("fifo/r", "holder", 0))
        .await
        .unwrap()
        .into_inner();
    let mut waiting = Vec::new();
    for i in 0..5u32 {
        let node = u64::from(i % 3 + 1);
        waiting.push(Some(
            enqueue(&cluster, node, "fifo/r", &format!("w{i}"), 60_000, i + 1).await,
        ));
    }
    let mut last = first.clone();
    for i in 0..5 {
        assert!(release(&mut c, "fifo/r", &last).await);
        let got = tokio::time::timeout(Duration::from_secs(5), waiting[i].take().unwrap())
            .await
            .expect("the head waiter was not woken")
            .unwrap()
            .unwrap();
        assert!(got.fencing_token > last.fencing_token);
        assert_eq!(describe(&mut c, "fifo/r").await.holder, format!("w{i}"));
        // Nobody behind the head returned: a fixed wait, since what is checked is that nothing
        // happens in it.
        tokio::time::sleep(Duration::from_millis(300)).await;
        for (j, w) in waiting.iter().enumerate().skip(i + 1) {
            assert!(
                !w.as_ref().unwrap().is_finished(),
                "waiter w{j} returned after release {i}"
            );
        }
        assert_eq!(describe(&mut c, "fifo/r").await.waiters, 4 - i as u32);
        last = got;
    }
    assert!(release(&mut c, "fifo/r", &last).await);
    assert!(!describe(&mut c, "fifo/r").await.held);
}

/// Goal: cancelling the middle waiter removes it and keeps the others' order. Method:
/// three waiters, abort the second call, release twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_middle_waiter_leaves_the_queue() {
    let cluster = Cluster::start_default().await.unwrap();
    let mut c = cluster.lock_client(2).await.unwrap();
    let held = c
        .acquire(req("cancel/r", "holder", 0))
        .await
        .unwrap()
        .into_inner();
    let w1 = enqueue(&cluster, 1, "cancel/r", "c1", 60_000, 1).await;
    let w2 = enqueue(&cluster, 2, "cancel/r", "c2", 60_000, 2).await;
    let w3 = enqueue(&cluster, 3, "cancel/r", "c3", 60_000, 3).await;
    w2.abort();
    let deadline = Instant::now() + Duration::from_secs(5);
    while describe(&mut c, "cancel/r").await.waiters != 2 {
        assert!(Instant::now() < deadline, "cancelled waiter still queued");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(release(&mut c, "cancel/r", &held).await);
    let g1 = w1.await.unwrap().unwrap();
    assert_eq!(describe(&mut c, "cancel/r").await.holder, "c1");
    assert!(release(&mut c, "cancel/r", &g1).await);
    let g3 = tokio::time::timeout(Duration::from_secs(5), w3)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(g3.fencing_token > g1.fencing_token);
    assert_eq!(describe(&mut c, "cancel/r").await.holder, "c3");
}

/// Goal: a wait that runs out answers DEADLINE_EXCEEDED and leaves no trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_timeout_is_deadline_exceeded_without_trace() {
    let cluster = Cluster::start_default().await.unwrap();
    let mut c = cluster.lock_client(3).await.unwrap();
    c.acquire(req("timeout/r", "holder", 0)).await.unwrap();
    let started = Instant::now();
    let err = c.acquire(req("timeout/r", "t1", 1_000)).await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert!(err.message().contains("timeout/r"));
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(4),
        "waited {waited:?}"
    );
    assert_eq!(describe(&mut c, "timeout/r").await.waiters, 0);
    assert_eq!(cluster.status(3).await.unwrap().waiters, 0);
    // The retry answers the original outcome.
    let err = c.acquire(req("timeout/r", "t1", 1_000)).await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded);
}

/// Goal: waiter limits per resource and per tenant answer RESOURCE_EXHAUSTED naming the
/// limit, and the queue stays intact. Method: a cluster with limits 2 and 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_limits_answer_resource_exhausted() {
    let options = ClusterOptions {
        extra_args: vec![
            "--waiters-per-resource-max".into(),
            "2".into(),
            "--waiters-per-tenant-max".into(),
            "3".into(),
        ],
        ..ClusterOptions::default()
    };
    let cluster = Cluster::start(options).await.unwrap();
    let mut c = cluster.lock_client(1).await.unwrap();
    c.acquire(req("team/a", "ha", 0)).await.unwrap();
    c.acquire(req("team/b", "hb", 0)).await.unwrap();
    let _a1 = enqueue(&cluster, 1, "team/a", "a1", 60_000, 1).await;
    let _a2 = enqueue(&cluster, 2, "team/a", "a2", 60_000, 2).await;
    let err = c.acquire(req("team/a", "a3", 60_000)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("waiters_per_resource_max"),
        "{}",
        err.message()
    );
    let _b1 = enqueue(&cluster, 3, "team/b", "b1", 60_000, 1).await;
    let err = c.acquire(req("team/b", "b2", 60_000)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("waiters_per_tenant_max") && err.message().contains("team"),
        "{}",
        err.message()
    );
    assert_eq!(describe(&mut c, "team/a").await.waiters, 2);
    assert_eq!(describe(&mut c, "team/b").await.waiters, 1);
    assert_eq!(cluster.status(2).await.unwrap().waiters, 3);
}

/// Acquires with the same request_id until the log answers, retrying UNAVAILABLE on every node,
/// as a client does across a leader change.
async fn acquire_waiting(
    cluster: &Cluster,
    resource: &str,
    request_id: &str,
    wait_ms: u64,
) -> Result<AcquireResponse, tonic::Status> {
    let deadline = Instant::now() + Duration::from_millis(wait_ms) + Duration::from_secs(20);
    let mut node = 1;
    loop {
        let mut c = cluster.lock_client(node).await.unwrap();
        match c.acquire(req(resource, request_id, wait_ms)).await {
            Err(s) if s.code() == Code::Unavailable && Instant::now() < deadline => {
                node = node % 3 + 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other.map(|r| r.into_inner()),
        }
    }
}

/// Goal: kill the leader while three callers wait; they are served in order or
/// time out cleanly, never two holders at once, and a retried waiter does not queue twice.
/// Method: callers retry with their request_id; after the failover Describe shows 3 waiters, not
/// more; each grant is checked against Describe before the next release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_survive_leader_change_in_order_without_duplicates() {
    let mut cluster = Cluster::start_default().await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let mut c = cluster.lock_client(leader).await.unwrap();
    let holder = c
        .acquire(req("fail/r", "holder", 0))
        .await
        .unwrap()
        .into_inner();
    let mut waiting = Vec::new();
    for i in 0..3u32 {
        waiting.push(enqueue(&cluster, leader, "fail/r", &format!("f{i}"), 60_000, i + 1).await);
    }
    // The waiting calls end with UNAVAILABLE when the leader dies; their owners retry.
    cluster.kill(leader);
    for w in waiting {
        match w.await.unwrap() {
            Err(s) => assert!(
                matches!(
                    s.code(),
                    Code::Unavailable | Code::Unknown | Code::Cancelled
                ),
                "{s:?}"
            ),
            Ok(r) => panic!("granted while the holder still held: {r:?}"),
        }
    }
    let new_leader = cluster
        .wait_for_leader(Duration::from_secs(20))
        .await
        .unwrap();
    let cluster = std::sync::Arc::new(cluster);
    let mut retried = Vec::new();
    for i in 0..3 {
        let cl = cluster.clone();
        retried.push(tokio::spawn(async move {
            acquire_waiting(&cl, "fail/r", &format!("f{i}"), 60_000).await
        }));
        // Retries start in their original order; a retry that took back its place shows in no
        // count, so there is nothing to poll for.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut c = cluster.lock_client(new_leader).await.unwrap();
    // A fixed wait: what is checked is that the retries landing in it queue nobody twice.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Retries took back their places: still three waiters, not six.
    assert_eq!(describe(&mut c, "fail/r").await.waiters, 3);
    let mut last = holder;
    for (i, w) in retried.into_iter().enumerate() {
        assert!(release(&mut c, "fail/r", &last).await);
        let got = tokio::time::timeout(Duration::from_secs(10), w)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(got.fencing_token > last.fencing_token);
        let d = describe(&mut c, "fail/r").await;
        assert_eq!(
            (d.holder.as_str(), d.fencing_token),
            (format!("f{i}").as_str(), got.fencing_token)
        );
        last = got;
    }
    assert!(release(&mut c, "fail/r", &last).await);
}

/// Goal: a waiting Acquire whose call was dropped and is retried with the
/// same request_id takes back its place, whether the retry or the dropped call's cancel commits
/// first. On main the cancel removed the waiter and the retry queued at the back (or, in the
/// other order, the late cancel removed the retry's registration). Method: holder, waiters w1
/// and w2; drop w1's call; retry w1; release: the retry of w1 gets the lock, not w2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue14_finding4_a_retried_waiter_keeps_its_place() {
    let cluster = Cluster::start_default().await.unwrap();
    let mut c = cluster.lock_client(1).await.unwrap();
    let held = c
        .acquire(req("retry/r", "holder", 0))
        .await
        .unwrap()
        .into_inner();
    let w1 = enqueue(&cluster, 1, "retry/r", "w1", 60_000, 1).await;
    let w2 = enqueue(&cluster, 2, "retry/r", "w2", 60_000, 2).await;
    w1.abort();
    // The cancel lands: w1 is passed over (not counted) but keeps its place.
    let deadline = Instant::now() + Duration::from_secs(5);
    while describe(&mut c, "retry/r").await.waiters != 1 {
        assert!(Instant::now() < deadline, "cancelled waiter still counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let retry = enqueue(&cluster, 3, "retry/r", "w1", 60_000, 2).await;
    assert!(release(&mut c, "retry/r", &held).await);
    let g1 = tokio::time::timeout(Duration::from_secs(5), retry)
        .await
        .expect("the retry of w1 was woken")
        .unwrap()
        .unwrap();
    assert_eq!(describe(&mut c, "retry/r").await.holder, "w1");
    assert!(!w2.is_finished(), "w2 was served before w1");
    assert!(release(&mut c, "retry/r", &g1).await);
    let g2 = tokio::time::timeout(Duration::from_secs(5), w2)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(g2.fencing_token > g1.fencing_token);
}

/// Goal: per-tenant quotas refuse one tenant's flood with
/// RESOURCE_EXHAUSTED naming the limit, count the refusal per limit, and leave other tenants
/// served. Method: a cluster with 20 records and 5 active resources per tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue14_finding5_tenant_quotas_leave_other_tenants_served() {
    let options = ClusterOptions {
        extra_args: vec![
            "--dedup-records-per-tenant-max".into(),
            "20".into(),
            "--active-resources-per-tenant-max".into(),
            "5".into(),
        ],
        ..ClusterOptions::default()
    };
    let mut cluster = Cluster::start(options).await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let mut c = cluster.lock_client(leader).await.unwrap();
    for i in 0..5 {
        c.acquire(req(&format!("held/{i}"), &format!("held-{i}"), 0))
            .await
            .unwrap();
    }
    let err = c.acquire(req("held/5", "held-5", 0)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("active_resources_per_tenant_max"),
        "{}",
        err.message()
    );
    let mut refused = None;
    for i in 0..40 {
        match c.acquire(req("flood/r", &format!("flood-{i}"), 0)).await {
            Ok(lease) => assert!(release(&mut c, "flood/r", &lease.into_inner()).await),
            Err(e) => {
                refused = Some((i, e));
                break;
            }
        }
    }
    let (i, err) = refused.expect("the flood was refused");
    assert_eq!(i, 20);
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("dedup_records_per_tenant_max"),
        "{}",
        err.message()
    );
    // Another tenant is served.
    c.acquire(req("other/r", "other-1", 0)).await.unwrap();
    let metrics = cluster.metrics_text(leader).await.unwrap();
    assert!(
        metrics.contains("lockd_acquire_refusals_total{limit=\"dedup_records_per_tenant_max\"} 1"),
        "{metrics}"
    );
}

/// Stops the nodes `paused`, so that the leader cannot commit; sends a waiting Acquire of
/// `gone/r` to node `via` whose caller gives up after 300 ms; resumes the nodes and releases
/// `held`, the lease on `gone/r`. Returns what Describe shows then.
async fn release_after_a_caller_left_before_the_commit(
    cluster: &Cluster,
    via: u64,
    paused: &[u64],
    held: &AcquireResponse,
) -> DescribeResponse {
    let mut waiting = cluster.lock_client(via).await.unwrap();
    for n in paused {
        cluster.pause(*n);
    }
    let gone = tokio::time::timeout(
        Duration::from_millis(300),
        waiting.acquire(req("gone/r", "gone", 60_000)),
    )
    .await;
    assert!(gone.is_err(), "answered without a quorum: {gone:?}");
    // Time for the call's reset to reach the leader while the log still stands still.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for n in paused {
        cluster.resume(*n);
    }
    let mut c = cluster.lock_client(via).await.unwrap();
    assert!(release(&mut c, "gone/r", held).await);
    describe(&mut c, "gone/r").await
}

/// Timings for the tests that stop a quorum of followers for half a second: elections slow
/// enough that the resumed followers keep their leader.
fn patient_elections(nodes: u64) -> ClusterOptions {
    ClusterOptions {
        nodes,
        election_timeout_ms: 1_500,
        ..ClusterOptions::default()
    }
}

/// Goal (review of the waiters, MEDIUM): a waiting Acquire whose caller leaves while its
/// proposal is not committed yet is passed over, never granted (README: "A caller that cancels
/// its call is passed over at once"). Before the fix the call's guard was armed only once the
/// log answered Queued: a caller gone before that left a live waiter, granted a lease nobody
/// received, and the lock stayed blocked for that lease's ttl. Method: hold `gone/r`; stop both
/// followers; a waiting Acquire to the leader whose caller gives up after 300 ms; resume them;
/// release: nobody holds `gone/r` and nobody is counted waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_waiters_m_a_caller_gone_before_the_commit_is_never_granted() {
    let mut cluster = Cluster::start(patient_elections(3)).await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let mut c = cluster.lock_client(leader).await.unwrap();
    let held = c
        .acquire(req("gone/r", "holder", 0))
        .await
        .unwrap()
        .into_inner();
    let followers: Vec<u64> = (1..=3).filter(|n| *n != leader).collect();
    let d =
        release_after_a_caller_left_before_the_commit(&cluster, leader, &followers, &held).await;
    assert_eq!(
        (d.held, d.holder.as_str(), d.waiters),
        (false, "", 0),
        "the caller that left was granted: {d:?}"
    );
    assert_eq!(
        cluster.leader().await.unwrap(),
        leader,
        "the leader changed"
    );
}

/// Goal (review of the waiters, MEDIUM): as above for a waiting Acquire sent to a follower,
/// which forwards it to the leader as a call of its own: the caller leaving ends the forwarded
/// call, and the leader passes the waiter over. Method: five nodes, so that the leader and the
/// follower called are no quorum with the other three stopped; then as above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_waiters_m_a_caller_gone_before_the_commit_through_a_follower_is_never_granted() {
    let mut cluster = Cluster::start(patient_elections(5)).await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let follower = leader % 5 + 1;
    let mut c = cluster.lock_client(leader).await.unwrap();
    let held = c
        .acquire(req("gone/r", "holder", 0))
        .await
        .unwrap()
        .into_inner();
    let others: Vec<u64> = (1..=5).filter(|n| *n != leader && *n != follower).collect();
    let d = release_after_a_caller_left_before_the_commit(&cluster, follower, &others, &held).await;
    assert_eq!(
        (d.held, d.holder.as_str(), d.waiters),
        (false, "", 0),
        "the caller that left was granted: {d:?}"
    );
    assert_eq!(
        cluster.leader().await.unwrap(),
        leader,
        "the leader changed"
    );
}

/// Goal (review of the waiters, LOW): a call refused for reusing a request_id with other
/// arguments does not take over the wait of the call that owns that id. Before the fix every
/// waiting call registered under its request_id before proposing, replacing the earlier call:
/// the owner was answered OUTCOME_UNKNOWN at once ("a newer call ... took over this wait") while
/// its waiter stayed queued with no call to hand a grant to. Method: hold `steal/a` and
/// `steal/b`; `shared-id` waits for `steal/a`; the same id waits for `steal/b`: refused with
/// INVALID_ARGUMENT; the first call still waits, and is granted when `steal/a` is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_waiters_low_a_refused_reuse_of_a_request_id_leaves_its_wait_alone() {
    let mut cluster = Cluster::start_default().await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let mut c = cluster.lock_client(leader).await.unwrap();
    let held = c
        .acquire(req("steal/a", "holder-a", 0))
        .await
        .unwrap()
        .into_inner();
    c.acquire(req("steal/b", "holder-b", 0)).await.unwrap();
    let owner = enqueue(&cluster, leader, "steal/a", "shared-id", 60_000, 1).await;
    let err = c
        .acquire(req("steal/b", "shared-id", 60_000))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("already used with other arguments"),
        "{}",
        err.message()
    );
    // A fixed wait: what is checked is that the owner's call does not end in it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !owner.is_finished(),
        "the owner's wait ended: {:?}",
        owner.await.unwrap()
    );
    assert_eq!(describe(&mut c, "steal/a").await.waiters, 1);
    assert!(release(&mut c, "steal/a", &held).await);
    let granted = tokio::time::timeout(Duration::from_secs(5), owner)
        .await
        .expect("the owner was not woken")
        .unwrap()
        .unwrap();
    let d = describe(&mut c, "steal/a").await;
    assert_eq!(
        (d.holder.as_str(), d.fencing_token),
        ("shared-id", granted.fencing_token)
    );
}

/// Sends a waiting Acquire of `r` to `node` while the nodes `paused` are stopped, so that the
/// leader cannot commit it; its caller gives up after 400 ms; then resumes the nodes, leaving
/// time for the call's reset to reach the leader while the log still stands still.
async fn drop_in_flight(cluster: &Cluster, node: u64, paused: &[u64], r: AcquireRequest) {
    let mut c = cluster.lock_client(node).await.unwrap();
    for n in paused {
        cluster.pause(*n);
    }
    let gone = tokio::time::timeout(Duration::from_millis(400), c.acquire(r)).await;
    assert!(gone.is_err(), "answered without a quorum: {gone:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    for n in paused {
        cluster.resume(*n);
    }
}

/// Goal (review of f67ece3, finding 1): a retry of a waiting request whose caller leaves while
/// the retry's Acquire is in flight does not end the wait of the request's call still waiting.
/// On f67ece3 the retry's Acquire became the current attempt and its cancel then passed the
/// waiter over: at the release the waiter was skipped and its record forgotten, and the older
/// call, told nothing, waited its whole wait and answered DEADLINE_EXCEEDED. Method: hold
/// `twice/r`; A1 waits for it with request id `twice`; stop both followers; A2, the same
/// request, is sent and dropped after 400 ms; resume them; release: A1 is granted within
/// seconds and Describe shows its holder with its token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_waiters2_f1_a_dropped_retry_leaves_the_waiting_call_its_grant() {
    let mut cluster = Cluster::start(patient_elections(3)).await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let mut c = cluster.lock_client(leader).await.unwrap();
    let held = c
        .acquire(req("twice/r", "holder", 0))
        .await
        .unwrap()
        .into_inner();
    let a1 = enqueue(&cluster, leader, "twice/r", "twice", 20_000, 1).await;
    let followers: Vec<u64> = (1..=3).filter(|n| *n != leader).collect();
    drop_in_flight(
        &cluster,
        leader,
        &followers,
        req("twice/r", "twice", 20_000),
    )
    .await;
    assert!(release(&mut c, "twice/r", &held).await);
    let granted = tokio::time::timeout(Duration::from_secs(3), a1)
        .await
        .expect("A1 was not granted within 3 s of the release")
        .unwrap()
        .unwrap();
    let d = describe(&mut c, "twice/r").await;
    assert_eq!(
        (d.held, d.holder.as_str(), d.fencing_token),
        (true, "twice", granted.fencing_token)
    );
    assert_eq!(
        cluster.leader().await.unwrap(),
        leader,
        "the leader changed"
    );
}

/// Goal (review of f67ece3, finding 2): a call waiting for one resource is never answered with
/// a grant of another resource under its request id (another lease, and a sequencer signed for
/// its own resource with that lease's token). On f67ece3 it followed from finding 1: the call
/// stayed registered after its request's record was forgotten, and a later request reusing the
/// id for `reuse/b`, queued and granted in one entry, woke it. Method: as in the test above up
/// to the release of `reuse/a`; then stop the followers; a short Acquire of `reuse/dummy` fills
/// the entry in flight; the id waits for `reuse/b` and `reuse/b` is released, both in the next
/// entry; resume them. A1 never answers with `reuse/b`'s lease: it has `reuse/a`'s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_waiters2_f2_a_waiting_call_never_reads_another_resources_grant() {
    let mut cluster = Cluster::start(patient_elections(3)).await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let mut c = cluster.lock_client(leader).await.unwrap();
    let held_a = c
        .acquire(req("reuse/a", "holder-a", 0))
        .await
        .unwrap()
        .into_inner();
    let held_b = c
        .acquire(req("reuse/b", "holder-b", 0))
        .await
        .unwrap()
        .into_inner();
    let a1 = enqueue(&cluster, leader, "reuse/a", "reuse", 20_000, 1).await;
    let followers: Vec<u64> = (1..=3).filter(|n| *n != leader).collect();
    drop_in_flight(
        &cluster,
        leader,
        &followers,
        req("reuse/a", "reuse", 20_000),
    )
    .await;
    assert!(release(&mut c, "reuse/a", &held_a).await);

    // The id again, for `reuse/b`: queued and granted in one entry.
    for n in &followers {
        cluster.pause(*n);
    }
    let mut d = cluster.lock_client(leader).await.unwrap();
    let dummy = tokio::spawn(async move { d.acquire(req("reuse/dummy", "dummy", 0)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut c3 = cluster.lock_client(leader).await.unwrap();
    let mut r3 = req("reuse/b", "reuse", 20_000);
    r3.holder = "a3".into();
    let a3 = tokio::spawn(async move { c3.acquire(r3).await.map(|r| r.into_inner()) });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut cb = cluster.lock_client(leader).await.unwrap();
    let rel_b = tokio::spawn(async move {
        cb.release(ReleaseRequest {
            resource: "reuse/b".into(),
            lease_id: held_b.lease_id.clone(),
        })
        .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    for n in &followers {
        cluster.resume(*n);
    }
    let _ = dummy.await;
    let _ = rel_b.await;
    let a3 = tokio::time::timeout(Duration::from_secs(3), a3).await;

    let a1 = tokio::time::timeout(Duration::from_secs(3), a1)
        .await
        .expect("A1 had no answer within 3 s")
        .unwrap();
    let b = describe(&mut c, "reuse/b").await;
    if let Ok(a1) = &a1 {
        assert_ne!(
            a1.fencing_token, b.fencing_token,
            "A1, waiting for reuse/a, was answered with reuse/b's lease: {a1:?}, {b:?}, A3: {a3:?}"
        );
        let a = describe(&mut c, "reuse/a").await;
        assert_eq!(
            (a.holder.as_str(), a.fencing_token),
            ("reuse", a1.fencing_token)
        );
    }
}

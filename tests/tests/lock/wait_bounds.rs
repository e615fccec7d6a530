//! What waiting Acquires, which park a call for up to 5 minutes, may hold of a node: the bounds
//! per source address and per node on the node the client called, and the follower's
//! connections to the leader, which parked waits must not fill for everyone else.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use lockd_api::errors::{Reason, reason_of};
use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{AcquireRequest, DescribeRequest, SigningKeysRequest};
use lockd_tests::cluster::{Cluster, ClusterOptions};
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

/// The waiters of `resource`, as the leader counts them.
async fn waiters(cluster: &Cluster, leader: u64, resource: &str) -> u32 {
    let mut c = cluster.lock_client(leader).await.unwrap();
    c.describe(DescribeRequest {
        resource: resource.into(),
    })
    .await
    .unwrap()
    .into_inner()
    .waiters
}

/// Polls until the leader counts at least `n` waiters of `resource`; returns the count.
async fn until_waiters(cluster: &Cluster, leader: u64, resource: &str, n: u32) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let w = waiters(cluster, leader, resource).await;
        if w >= n || Instant::now() > deadline {
            return w;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A client of node `id` on a connection of its own from the loopback address `from`.
fn client_from(cluster: &Cluster, id: u64, from: Ipv4Addr) -> LockClient<Channel> {
    LockClient::new(
        Channel::from_shared(format!("http://{}", cluster.addr(id)))
            .unwrap()
            .local_address(Some(IpAddr::V4(from)))
            .connect_timeout(Duration::from_secs(1))
            .connect_lazy(),
    )
}

/// Another loopback address than the cluster's (its members' address), `n` above it.
fn other_source(cluster: &Cluster, n: u8) -> Ipv4Addr {
    let o = cluster.ip.octets();
    Ipv4Addr::new(127, o[1], o[2], o[3].wrapping_add(n).max(1))
}

/// Goal (review of waiting calls, MEDIUM 1): one client's waiting Acquires through a follower do
/// not hold up the other calls that follower forwards to the leader as calls of their own. Before
/// the fix, every waiting Acquire, every Describe and every admin call went on the follower's one
/// cached HTTP/2 connection to the leader, whose 1,024 streams one client's parked waits filled:
/// another tenant's wait, the Describes and the admin calls then hung until their deadlines.
/// Method: hold two resources of tenant `flood` and park 1,100 waits on them through a follower,
/// from two client connections (a node takes 1,024 calls on one); once the leader counts 1,024
/// of them (the most that could reach it before the fix), a Describe, a SigningKeys and a waiting
/// Acquire of tenant `other`, all through the same follower, must answer within 2 s; and all
/// 1,100 waits reach the leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_waits_m1_parked_waits_through_a_follower_hold_up_no_other_call() {
    const PER_RESOURCE: u32 = 550;
    let mut cluster = Cluster::start_default().await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let follower = leader % 3 + 1;
    let mut c = cluster.lock_client(follower).await.unwrap();
    for r in 0..2 {
        c.acquire(req(&format!("flood/{r}"), &format!("holder-{r}"), 0))
            .await
            .unwrap();
    }

    // Phase 1: the flood, 550 calls on each of two connections to the follower.
    let mut parked = Vec::new();
    for r in 0..2 {
        let client = cluster.lock_client(follower).await.unwrap();
        for i in 0..PER_RESOURCE {
            let mut c = client.clone();
            let r = req(&format!("flood/{r}"), &format!("flood-{r}-{i}"), 60_000);
            parked.push(tokio::spawn(async move { c.acquire(r).await }));
        }
    }
    let started = Instant::now();
    let deadline = started + Duration::from_secs(20);
    loop {
        let at_leader = cluster.status(leader).await.unwrap().waiters;
        if at_leader >= 1_024 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {at_leader} waits reached the leader"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("1,024 waits at the leader after {:?}", started.elapsed());

    // Phase 2: other calls through the same follower answer promptly.
    let within = Duration::from_secs(2);
    let mut d = cluster.lock_client(follower).await.unwrap();
    let described = tokio::time::timeout(
        within,
        d.describe(DescribeRequest {
            resource: "flood/0".into(),
        }),
    )
    .await
    .expect("a Describe through the follower hung behind the parked waits")
    .unwrap()
    .into_inner();
    assert!(described.held);
    let mut admin = cluster.cluster_client(follower).await.unwrap();
    tokio::time::timeout(within, admin.signing_keys(SigningKeysRequest {}))
        .await
        .expect("an admin call through the follower hung behind the parked waits")
        .unwrap();
    let mut other = cluster.lock_client(follower).await.unwrap();
    let granted = tokio::time::timeout(within, other.acquire(req("other/r", "other-1", 10_000)))
        .await
        .expect("another tenant's wait through the follower hung behind the parked waits")
        .unwrap()
        .into_inner();
    assert!(granted.fencing_token > 0);

    // Phase 3: every wait reached the leader, none was refused.
    for r in 0..2 {
        let resource = format!("flood/{r}");
        assert_eq!(
            until_waiters(&cluster, leader, &resource, PER_RESOURCE).await,
            PER_RESOURCE,
            "{resource}"
        );
    }
    assert!(
        parked.iter().all(|p| !p.is_finished()),
        "a wait ended early"
    );
    for p in parked {
        p.abort();
    }
}

/// Goal (review of waiting calls, MEDIUM 2): the waiting calls parked on the node the client
/// called are bounded per source address and per node, whatever tenant they name; a call over a
/// bound is refused at once (RESOURCE_EXHAUSTED, WAITERS_EXHAUSTED, the address and the bound in
/// the message, counted in `lockd_acquire_refusals_total{limit}`), another source still gets its
/// waits, and the places come back when the calls end. The leader does not count the calls a
/// follower forwarded again. Before the fix nothing bounded them but the waiter limits, per
/// resource and per tenant, and the tenant is a name the client picks.
/// Method: a cluster with 5 waits per source and 8 per node; through a follower, 5 waits from
/// one address, a 6th refused; 3 from a second address, a 4th refused
/// for the node's bound (all 8 reach the leader, which would refuse a 6th from the follower's
/// address if it counted them); the first address's calls dropped, the second gets its 4th.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_waits_m2_parked_waits_are_bounded_per_source_and_per_node() {
    let options = ClusterOptions {
        extra_args: vec![
            "--waits-per-source-max".into(),
            "5".into(),
            "--waits-max".into(),
            "8".into(),
        ],
        ..ClusterOptions::default()
    };
    let mut cluster = Cluster::start(options).await.unwrap();
    let leader = cluster.leader().await.unwrap();
    let follower = leader % 3 + 1;
    let mut c = cluster.lock_client(follower).await.unwrap();
    c.acquire(req("bound/r", "holder", 0)).await.unwrap();
    let (attacker, bystander) = (other_source(&cluster, 1), other_source(&cluster, 2));

    // Phase 1: five waits from one source; the sixth is refused at once.
    let flood = client_from(&cluster, follower, attacker);
    let mut parked = Vec::new();
    for i in 0..5 {
        let mut c = flood.clone();
        let r = req("bound/r", &format!("a-{i}"), 60_000);
        parked.push(tokio::spawn(async move { c.acquire(r).await }));
    }
    assert_eq!(until_waiters(&cluster, leader, "bound/r", 5).await, 5);
    let started = Instant::now();
    let err = flood
        .clone()
        .acquire(req("bound/r", "a-5", 60_000))
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(1), "refused late");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    let (reason, meta) = reason_of(&err).expect("lockd's ErrorInfo");
    assert_eq!(reason, Reason::WaitersExhausted);
    assert_eq!(meta["limit"], "waits_per_source_max");
    assert!(
        err.message().starts_with("lockd: ")
            && err.message().contains(&attacker.to_string())
            && err.message().contains(" 5"),
        "{}",
        err.message()
    );

    // Phase 2: another source gets its waits, up to the node's bound.
    let other = client_from(&cluster, follower, bystander);
    for i in 0..3 {
        let mut c = other.clone();
        let r = req("bound/r", &format!("b-{i}"), 60_000);
        parked.push(tokio::spawn(async move { c.acquire(r).await }));
    }
    assert_eq!(
        until_waiters(&cluster, leader, "bound/r", 8).await,
        8,
        "the leader refused waits the follower forwarded"
    );
    let err = other
        .clone()
        .acquire(req("bound/r", "b-3", 60_000))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    let (reason, meta) = reason_of(&err).expect("lockd's ErrorInfo");
    assert_eq!(reason, Reason::WaitersExhausted);
    assert_eq!(meta["limit"], "waits_max");
    assert!(err.message().contains(" 8"), "{}", err.message());
    assert!(
        parked.iter().all(|p| !p.is_finished()),
        "a wait ended early"
    );
    let metrics = cluster.metrics_text(follower).await.unwrap();
    for limit in ["waits_per_source_max", "waits_max"] {
        assert!(
            metrics.contains(&format!(
                "lockd_acquire_refusals_total{{limit=\"{limit}\"}} 1"
            )),
            "{metrics}"
        );
    }

    // Phase 3: the first source's calls end; their places come back.
    for p in parked.drain(..5) {
        p.abort();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for attempt in 0.. {
        let answer = other
            .clone()
            .acquire(req("bound/r", &format!("b-late-{attempt}"), 300))
            .await;
        match answer {
            Err(e) if e.code() == Code::ResourceExhausted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => {
                assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
                break;
            }
            Ok(r) => panic!("granted while held: {r:?}"),
        }
    }
    for p in parked {
        p.abort();
    }
}

//! Wrong wall clocks: nodes whose clocks are an hour ahead, an hour
//! behind and right take turns as leader. A lease must never end before its holder's deadline,
//! and once its holder stops renewing it must end within its ttl plus the failover time, never
//! an hour later.

use std::time::{Duration, Instant};

use lockd_api::v1::AcquireRequest;
use lockd_tests::cluster::{Cluster, ClusterOptions};
use tonic::Code;

const HOUR_MS: i64 = 3_600_000;
const TTL_MS: u64 = 2_000;
/// What a lease may outlive its ttl by after its leader is killed: one failover (election
/// timeouts of 600..1,200 ms, a heartbeat, the new leader's first commit) plus the reaper's and
/// the poller's 50 ms, with room for a loaded 2-core machine (elections there took up to 5 s).
/// An hour-long freeze, what main did, is far outside it.
const FAILOVER_SLACK: Duration = Duration::from_millis(10_000);
/// Without a failover: reaper and poller periods plus scheduling slack.
const STEADY_SLACK: Duration = Duration::from_millis(1_500);

fn acquire_req(resource: &str, request_id: &str) -> AcquireRequest {
    AcquireRequest {
        resource: resource.into(),
        request_id: request_id.into(),
        lease_ttl_ms: TTL_MS,
        wait_timeout_ms: 0,
        holder: request_id.into(),
    }
}

/// Acquires `resource` through `nodes` (retrying UNAVAILABLE); returns when the request that
/// was granted was sent.
async fn hold(cluster: &Cluster, nodes: &[u64], resource: &str, request_id: &str) -> Instant {
    let deadline = Instant::now() + Duration::from_secs(20);
    for i in 0.. {
        let node = nodes[i % nodes.len()];
        let mut c = cluster.lock_client(node).await.unwrap();
        let sent = Instant::now();
        match c.acquire(acquire_req(resource, request_id)).await {
            Ok(_) => return sent,
            Err(s) if s.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => panic!("lockd: acquire {resource} as {request_id} on node {node}: {s:?}"),
        }
    }
    unreachable!("the loop returns or panics")
}

/// Tries to take `resource` every 50 ms through `nodes` until granted; returns when the grant's
/// reply arrived. Panics if the lock is still held after `give_up`.
async fn take_over(cluster: &Cluster, nodes: &[u64], resource: &str, give_up: Instant) -> Instant {
    for attempt in 0.. {
        let node = nodes[attempt % nodes.len()];
        let mut c = cluster.lock_client(node).await.unwrap();
        let mut req = tonic::Request::new(acquire_req(
            resource,
            &format!("{resource}-taker-{attempt}"),
        ));
        req.set_timeout(Duration::from_secs(2));
        match c.acquire(req).await {
            Ok(_) => return Instant::now(),
            Err(s)
                if matches!(
                    s.code(),
                    Code::Aborted | Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled
                ) => {}
            Err(s) => panic!("lockd: taking {resource} over on node {node}: {s:?}"),
        }
        assert!(
            Instant::now() < give_up,
            "lockd: {resource} (ttl {TTL_MS} ms) still held at the give-up time; expiry froze"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    unreachable!("the loop returns or panics")
}

/// Goal: with node clocks at +1 h, -1 h and 0, leases last at least their ttl from their
/// holder's request and end within ttl + failover time, across three leader kills (so the
/// leadership moves at least once from a faster clock to a slower one, which froze expiry on
/// main, and from slower to faster, which could end leases early). Method: per round, a holder
/// takes a 2 s lease and stops renewing; the leader is killed at once; a taker polls the
/// survivors and must get the lock no sooner than 2 s after the holder's request and no later
/// than 2 s + failover slack; then, with no failover, a second lease must end within 2 s +
/// steady slack; the killed node restarts with its offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_ignore_wall_clock_offsets_of_an_hour_across_failovers() {
    let mut cluster = Cluster::start(ClusterOptions {
        clock_offsets_ms: vec![HOUR_MS, -HOUR_MS, 0],
        ..ClusterOptions::default()
    })
    .await
    .unwrap();
    let started = Instant::now();
    for round in 0..3 {
        let leader = cluster.leader().await.unwrap();
        let survivors: Vec<u64> = (1..=3).filter(|i| *i != leader).collect();
        let resource = format!("clock/failover-{round}");
        let sent = hold(&cluster, &[leader], &resource, &format!("holder-{round}")).await;
        cluster.kill(leader);
        let killed = Instant::now();
        let taken = take_over(
            &cluster,
            &survivors,
            &resource,
            sent + Duration::from_secs(30),
        )
        .await;
        let held_for = taken - sent;
        eprintln!(
            "round {round}: leader {leader} killed; lease of {TTL_MS} ms taken over after {held_for:?}"
        );
        assert!(
            held_for >= Duration::from_millis(TTL_MS),
            "lockd: round {round}: lease of {TTL_MS} ms ended {held_for:?} after its holder's request"
        );
        assert!(
            taken - killed <= Duration::from_millis(TTL_MS) + FAILOVER_SLACK,
            "lockd: round {round}: lease of {TTL_MS} ms held {held_for:?} after the leader (node {leader}) was killed"
        );

        let steady = format!("clock/steady-{round}");
        let sent = hold(&cluster, &survivors, &steady, &format!("steady-{round}")).await;
        let taken = take_over(
            &cluster,
            &survivors,
            &steady,
            sent + Duration::from_secs(30),
        )
        .await;
        let held_for = taken - sent;
        eprintln!("round {round}: without failover, taken over after {held_for:?}");
        assert!(
            held_for >= Duration::from_millis(TTL_MS)
                && held_for <= Duration::from_millis(TTL_MS) + STEADY_SLACK,
            "lockd: round {round}: lease of {TTL_MS} ms without failover ended after {held_for:?}"
        );
        cluster.start_node(leader).unwrap();
        cluster
            .wait_for_leader(Duration::from_secs(20))
            .await
            .unwrap();
    }
    eprintln!("three rounds in {:?}", started.elapsed());
}

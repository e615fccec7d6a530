//! Faults around the proxy: an unreachable store, an upstream that is down or too slow, a restart
//! with the redb store, and a stale lockd holder fenced end to end.

use std::time::{Duration, Instant};

use crate::{assert_refused, put, redb_store, time_out};
use lockd_tests::fence_proxy::FenceProxy;
use lockd_tests::http_upstream::{DELAY_HEADER, HttpUpstream};
use lockd_tests::pg;

/// Goal: an unreachable epoch store fails closed: 503 store-unavailable and nothing forwarded;
/// reads, which need no store, still pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_unreachable_is_503_and_nothing_is_forwarded() {
    let upstream = HttpUpstream::start().await.unwrap();
    let dead = format!("postgres://postgres@127.0.0.1:{}/test", pg::free_port());
    let proxy = FenceProxy::start(&upstream.url(), &dead, &["--store-timeout", "500ms"])
        .await
        .unwrap();
    let started = Instant::now();
    let reply = put(&proxy, "orders/1", "3", "x").await;
    assert_refused(&reply, 503, "store-unavailable");
    let j = reply.json();
    assert_eq!(
        (j["resource"].as_str(), j["token"].as_u64()),
        (Some("orders/1"), Some(3))
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        upstream.writes().is_empty(),
        "forwarded while the store was down"
    );
    let reply = lockd_tests::fence_proxy::get(&proxy.url("/orders/1"))
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
}

/// Goal: an upstream that refuses connections gives 502 upstream-error, for writes and reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_is_502() {
    let dir = tempfile::tempdir().unwrap();
    let dead = format!("http://127.0.0.1:{}", pg::free_port());
    let proxy = FenceProxy::start(&dead, &redb_store(&dir), &[])
        .await
        .unwrap();
    let reply = put(&proxy, "orders/1", "3", "x").await;
    assert_refused(&reply, 502, "upstream-error");
    assert_eq!(reply.json()["token"], 3);
    let reply = lockd_tests::fence_proxy::get(&proxy.url("/x"))
        .await
        .unwrap();
    assert_refused(&reply, 502, "upstream-error");
    // The write was never delivered, so no quarantine: the next one goes straight to the store.
    let started = Instant::now();
    assert_refused(
        &put(&proxy, "orders/1", "4", "x").await,
        502,
        "upstream-error",
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
}

/// Goal: an upstream slower than --upstream-timeout gives 504 upstream-timeout, and because the
/// upstream still applies that write later, the next write of the resource is held back by the
/// quarantine until after it: the upstream's log keeps token order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_too_slow_is_504_and_quarantine_keeps_order() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &[
            "--upstream-timeout",
            "300ms",
            "--quarantine",
            "2s",
            "--lock-wait",
            "5s",
        ],
    )
    .await
    .unwrap();
    let started = Instant::now();
    time_out(&proxy, "orders/1", "1", 1000).await;
    let timed_out = started.elapsed();
    assert!(
        timed_out < Duration::from_millis(900),
        "504 after {timed_out:?}"
    );

    let reply = put(&proxy, "orders/1", "2", "next").await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(2200),
        "quarantine skipped: {:?}",
        started.elapsed()
    );
    assert_eq!(
        applied_tokens(&upstream),
        [1, 2],
        "the late write must be applied before the next one"
    );

    // Another resource is not affected by the quarantine.
    let t = Instant::now();
    time_out(&proxy, "orders/2", "1", 1000).await;
    assert_eq!(put(&proxy, "orders/3", "1", "x").await.status, 200);
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
}

/// Goal: the redb store keeps the highest tokens across a kill -9 and restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redb_highest_tokens_survive_restart() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    // After a kill every resource is quarantined for --upstream-timeout + --quarantine (see
    // below): kept short here.
    let mut proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &["--upstream-timeout", "1s", "--quarantine", "300ms"],
    )
    .await
    .unwrap();
    assert_eq!(put(&proxy, "a", "7", "x").await.status, 200);
    assert_eq!(put(&proxy, "b", "9", "x").await.status, 200);

    proxy.kill();
    proxy.restart().await.unwrap();

    let reply = put(&proxy, "a", "6", "x").await;
    assert_refused(&reply, 412, "stale-fencing-token");
    assert_eq!(reply.json()["highest"], 7);
    assert_refused(
        &put(&proxy, "b", "8", "x").await,
        412,
        "stale-fencing-token",
    );
    assert_eq!(put(&proxy, "b", "9", "x").await.status, 200);
    assert_eq!(put(&proxy, "c", "1", "x").await.status, 200);
    assert_eq!(upstream.writes().len(), 4);
}

/// The tokens of the writes the upstream applied, in the order it applied them.
fn applied_tokens(upstream: &HttpUpstream) -> Vec<u64> {
    upstream
        .writes()
        .iter()
        .map(|w| w.token().unwrap())
        .collect()
}

/// A proxy on a redb file whose write of token 1 to `orders/1` timed out (504; quarantine 5 s)
/// while the upstream still works on it (4 s), then stopped with SIGTERM: the proxy, to restart,
/// and when token 1 was sent.
async fn quarantined_then_stopped(
    dir: &tempfile::TempDir,
    upstream: &HttpUpstream,
) -> (FenceProxy, Instant) {
    let mut proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(dir),
        &[
            "--upstream-timeout",
            "300ms",
            "--quarantine",
            "5s",
            "--lock-wait",
            "8s",
        ],
    )
    .await
    .unwrap();
    let started = Instant::now();
    time_out(&proxy, "orders/1", "1", 4000).await;
    let status = proxy.stop(Duration::from_secs(10)).await.unwrap();
    assert!(
        status.success(),
        "fence-proxy exited {status} after SIGTERM"
    );
    (proxy, started)
}

/// Token 2's write of `orders/1` through the restarted proxy waits out the quarantine token 1
/// (sent at `started`) began, and the upstream applies 1 before 2; `what` names the failure.
async fn next_holder_waits_out_the_quarantine(
    proxy: &FenceProxy,
    upstream: &HttpUpstream,
    started: Instant,
    what: &str,
) {
    let reply = put(proxy, "orders/1", "2", "next").await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(5300),
        "{what}: token 2 forwarded {:?} after token 1",
        started.elapsed()
    );
    assert_eq!(
        applied_tokens(upstream),
        [1, 2],
        "the late write must be applied before the next one"
    );
}

/// Attack (review, HIGH): the redb store's quarantine lived in memory only, so a graceful
/// restart opened a quarantined resource at once. Token 1's write times out (504, quarantine
/// 5 s) while the upstream still works on it (4 s, longer than a restart takes even on a loaded
/// machine); the proxy is stopped with SIGTERM and started again; token 2's write went through
/// at once and the upstream applied 2, then 1. Goal: the quarantine is saved at a clean stop and
/// holds after the restart, so 1 lands before 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarantine_outlives_a_graceful_restart() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let (mut proxy, started) = quarantined_then_stopped(&dir, &upstream).await;
    proxy.restart().await.unwrap();

    next_holder_waits_out_the_quarantine(
        &proxy,
        &upstream,
        started,
        "the quarantine ended with the process",
    )
    .await;
    // Only the quarantined resource waited.
    let t = Instant::now();
    assert_eq!(put(&proxy, "orders/2", "1", "x").await.status, 200);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
}

/// Attack: the quarantine a clean stop saves was kept as a wall-clock end; a process restarted
/// with its wall clock an hour ahead (an NTP step, a VM resumed with a stale clock set right)
/// found it long over and forwarded the next holder's write while the upstream still worked on
/// the timed-out one. Goal: within one boot the time left is measured on the boot's own clock
/// (`CLOCK_BOOTTIME`), which no setting of the wall clock moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saved_quarantine_ignores_a_wall_clock_set_forward() {
    let faketime = lockd_tests::chaos::clock::find_library().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let (mut proxy, started) = quarantined_then_stopped(&dir, &upstream).await;
    // The wall clock one hour ahead; the monotonic clocks as they are.
    proxy.set_env(&[
        ("LD_PRELOAD", faketime.to_str().unwrap()),
        ("FAKETIME", "+3600"),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ("FAKETIME_DONT_RESET", "1"),
    ]);
    proxy.restart().await.unwrap();

    next_holder_waits_out_the_quarantine(
        &proxy,
        &upstream,
        started,
        "the wall clock cut the quarantine short",
    )
    .await;
}

/// Attack (review, HIGH): a proxy killed while the upstream works on a write forgot it had been
/// in flight; restarted at once, it forwarded the next holder's write, and the upstream applied
/// 2, then 1. Goal: after an unclean stop every resource is quarantined for `--upstream-timeout`
/// + `--quarantine` (what the proxy would have waited for that write had it lived, as the
/// Postgres store's `busy_until`), so 1 lands before 2; and a graceful stop during that
/// quarantine (the second review's finding: systemd restarts it, then someone runs `systemctl
/// restart`) saves it instead of marking the file clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_in_flight_at_a_kill_is_waited_out_after_the_restart() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let mut proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &[
            "--upstream-timeout",
            "2s",
            "--quarantine",
            "3s",
            "--lock-wait",
            "8s",
        ],
    )
    .await
    .unwrap();
    let url = proxy.url("/obj");
    let in_flight = tokio::spawn(async move {
        lockd_tests::fence_proxy::send(
            "PUT",
            &url,
            &[
                ("Lock-Resource", "orders/1"),
                ("Fencing-Token", "1"),
                (DELAY_HEADER, "1500"),
            ],
            "late",
        )
        .await
    });
    // The upstream has the whole request (it is small) and works on it for 1.5 s.
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.kill();
    let killed = Instant::now();
    let _ = in_flight.await;
    proxy.restart().await.unwrap();
    let status = proxy.stop(Duration::from_secs(10)).await.unwrap();
    assert!(
        status.success(),
        "fence-proxy exited {status} after SIGTERM"
    );
    proxy.restart().await.unwrap();

    let reply = put(&proxy, "orders/1", "2", "next").await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(
        killed.elapsed() >= Duration::from_secs(5),
        "no quarantine after the kill: token 2 forwarded {:?} after it",
        killed.elapsed()
    );
    assert_eq!(
        applied_tokens(&upstream),
        [1, 2],
        "the write in flight at the kill must be applied before the next one"
    );
    // Every resource was closed, not only the one in flight: the proxy cannot know which were.
    // By now the quarantine is over.
    assert_eq!(put(&proxy, "orders/2", "1", "x").await.status, 200);
}

/// Goal: a zombie holder's write, end to end with lockd. A acquires (token t); A's lease expires;
/// B acquires (t' > t) and writes; A's delayed write gets 412; the upstream holds B's only.
/// Method: a real three-node lockd cluster, a 1 s lease for A that is never renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockd_end_to_end_stale_holder_is_fenced() {
    use lockd_api::v1::AcquireRequest;
    use lockd_tests::cluster::Cluster;

    let cluster = Cluster::start_default().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(&upstream.url(), &redb_store(&dir), &[])
        .await
        .unwrap();
    let resource = pg::unique_name("e2e/orders");
    let acquire = |id: &str, wait_timeout_ms: u64| AcquireRequest {
        resource: resource.clone(),
        request_id: id.to_owned(),
        lease_ttl_ms: 1_000,
        wait_timeout_ms,
        holder: id.to_owned(),
    };

    // Phase 1: A acquires and prepares a write, then stalls past its lease.
    let mut lock_a = cluster.lock_client(1).await.unwrap();
    let a = lock_a.acquire(acquire("a", 0)).await.unwrap().into_inner();

    // Phase 2: B waits in lockd's queue, gets the lock when A's lease expires, and writes.
    let mut lock_b = cluster.lock_client(2).await.unwrap();
    let b = lock_b
        .acquire(acquire("b", 10_000))
        .await
        .unwrap()
        .into_inner();
    assert!(
        b.fencing_token > a.fencing_token,
        "{} !> {}",
        b.fencing_token,
        a.fencing_token
    );
    let reply = put(&proxy, &resource, &b.fencing_token.to_string(), "B").await;
    assert_eq!(reply.status, 200, "{reply:?}");

    // Phase 3: A wakes up and sends its delayed write: refused, naming B's token.
    let reply = put(&proxy, &resource, &a.fencing_token.to_string(), "A").await;
    assert_refused(&reply, 412, "stale-fencing-token");
    assert_eq!(reply.json()["highest"], b.fencing_token);

    let writes = upstream.writes();
    assert_eq!(writes.len(), 1, "{writes:?}");
    assert_eq!(&writes[0].body[..], b"B");
    assert_eq!(writes[0].token(), Some(b.fencing_token));
}

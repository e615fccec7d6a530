//! What a client that opens connections and sends nothing can hold on a node's gRPC port.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lockd_server::connections::{CONNECTIONS_PER_SOURCE_MAX, FIRST_BYTES_TIMEOUT};
use lockd_tests::cluster::{Cluster, ClusterOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A connection to `to` from the loopback address `from` (any 127.0.0.0/8 address works).
pub(super) async fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    socket.connect(to).await.unwrap()
}

/// Whether the node closed `c` within `within` (end of stream or a reset), rather than leaving
/// it open with nothing to read.
async fn closed_within(c: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout(within, c.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            // Bytes from the node (HTTP/2 SETTINGS): keep reading until it closes.
            Ok(Ok(_)) => {}
        }
    }
}

/// A three-node cluster with a leader, on one loopback address (its members' address, never
/// refused), and another loopback address to attack it from.
pub(super) async fn cluster_and_attacker() -> (Cluster, String) {
    let mut cluster = Cluster::start(ClusterOptions::default()).await.unwrap();
    cluster
        .wait_for_leader(Duration::from_secs(20))
        .await
        .unwrap();
    let octets = cluster.ip.octets();
    let attacker = format!(
        "127.{}.{}.{}",
        octets[1],
        octets[2],
        octets[3].wrapping_add(1).max(1)
    );
    (cluster, attacker)
}

/// Goal: a client that opens connections and sends nothing cannot exhaust a node's descriptors
/// (which would stop it accepting its peers and opening its files): one source address gets at
/// most `CONNECTIONS_PER_SOURCE_MAX` connections, the rest are closed at once, and a connection
/// that sends nothing is closed after `FIRST_BYTES_TIMEOUT`; the cluster serves clients
/// throughout, and the source may connect again once its connections are gone. On main every
/// connection was accepted and kept open for good.
/// Method: a three-node cluster on one loopback address (its members' address, which is never
/// refused); the attacker connects from another: the bound plus 20 silent connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_bounded_per_source_and_closed_in_time() {
    let (cluster, attacker) = cluster_and_attacker().await;
    let addr: SocketAddr = cluster.addr(1).parse().unwrap();
    let attacker = attacker.as_str();
    let started = Instant::now();
    let mut silent = Vec::new();
    for _ in 0..CONNECTIONS_PER_SOURCE_MAX + 20 {
        silent.push(connect_from(attacker, addr).await);
    }
    let mut closed_at_once = 0;
    for c in &mut silent {
        if closed_within(c, Duration::from_millis(20)).await {
            closed_at_once += 1;
        }
    }
    eprintln!(
        "{} silent connections: {closed_at_once} closed at once",
        silent.len()
    );
    assert_eq!(
        closed_at_once, 20,
        "one source kept more than {CONNECTIONS_PER_SOURCE_MAX} connections open"
    );

    // The cluster serves its clients meanwhile.
    let mut client = cluster.lock_client(1).await.unwrap();
    client
        .describe(lockd_api::v1::DescribeRequest {
            resource: "connections/probe".into(),
        })
        .await
        .expect("node 1 serves its clients");

    // The silent ones are closed once their time is up.
    let mut open = 0;
    for c in &mut silent {
        let left = (FIRST_BYTES_TIMEOUT + Duration::from_secs(5)).saturating_sub(started.elapsed());
        if !closed_within(c, left.max(Duration::from_millis(20))).await {
            open += 1;
        }
    }
    eprintln!(
        "after {:?}: {open} silent connections still open",
        started.elapsed()
    );
    assert_eq!(
        open, 0,
        "silent connections outlived {FIRST_BYTES_TIMEOUT:?}"
    );
    drop(silent);

    // The source's places came back: a new connection that speaks HTTP/2 is served.
    let mut c = connect_from(attacker, addr).await;
    c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let mut head = [0u8; 9];
    tokio::time::timeout(Duration::from_secs(5), c.read_exact(&mut head))
        .await
        .expect("the node answers a new connection's preface")
        .unwrap();
    assert_eq!(head[3], 0x4, "a SETTINGS frame: {head:?}");
}

/// How many of `CONNECTIONS_PER_SOURCE_MAX + 20` silent connections from `from` to `to` the node
/// closes at once (all are checked at the same time, then dropped).
async fn refused_of_a_flood(from: &str, to: SocketAddr) -> usize {
    let mut flood = Vec::new();
    for _ in 0..CONNECTIONS_PER_SOURCE_MAX + 20 {
        flood.push(connect_from(from, to).await);
    }
    let closed = futures::future::join_all(
        flood
            .iter_mut()
            // Long enough for a busy node's accept loop to reach the last connection; an
            // admitted silent connection stays open for FIRST_BYTES_TIMEOUT, far longer.
            .map(|c| closed_within(c, Duration::from_millis(1_500))),
    )
    .await;
    closed.into_iter().filter(|c| *c).count()
}

/// Polls `refused_of_a_flood` until `done` holds for its count, within `within`; returns the
/// last count.
async fn flood_until(
    from: &str,
    to: SocketAddr,
    within: Duration,
    done: impl Fn(usize) -> bool,
) -> usize {
    let deadline = Instant::now() + within;
    loop {
        let refused = refused_of_a_flood(from, to).await;
        if done(refused) || Instant::now() > deadline {
            return refused;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Goal: the members' addresses, which a node never refuses for their number of connections
/// (so a flood from many sources cannot cut replication off), follow the membership at runtime:
/// a member added with `lockctl member add` is trusted at once, a member whose name moves to
/// another IP is trusted there (and its old IP no longer) within the refresh period, and a
/// removed member counts like any client again. On main the set was the `--peer` flags
/// resolved at start, for the life of the process.
/// Method: a three-node cluster on named IPs; a flood of `CONNECTIONS_PER_SOURCE_MAX + 20`
/// silent connections to node 1 from node 4's IP before it joins, after, from its new IP after a
/// move, and after its removal; the node closes the 20 beyond the bound (and as many more as
/// node 4's own connections) at once exactly when it does not trust the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_added_moved_or_removed_at_runtime_are_trusted_accordingly() {
    use lockd_server::connections::TRUST_REFRESH;
    use lockd_tests::fleet::Fleet;
    let mut f = Fleet::start(3, &[]).await.unwrap();
    let to: SocketAddr = f.ip_addr(1).parse().unwrap();
    f.start_joining(4, &[1, 2, 3]).unwrap();
    let ip4 = |f: &Fleet| f.ip_addr(4).split(':').next().unwrap().to_owned();
    let before = flood_until(&ip4(&f), to, Duration::from_secs(10), |r| r >= 20).await;
    assert!(before >= 20, "not a member yet, but {before} refused");

    let add = format!("4={}", f.member_addr(4));
    f.lockctl(&[1], &["member", "add", &add, "--catch-up-timeout", "60s"])
        .unwrap();
    let added = flood_until(&ip4(&f), to, Duration::from_secs(10), |r| r == 0).await;
    assert_eq!(added, 0, "a member added at runtime is not trusted");

    let old = ip4(&f);
    f.kill(4);
    f.move_to_new_ip(4).unwrap();
    let within = TRUST_REFRESH + Duration::from_secs(10);
    let moved = flood_until(&ip4(&f), to, within, |r| r == 0).await;
    assert_eq!(moved, 0, "a member's new IP is not trusted");
    let left = flood_until(&old, to, within, |r| r >= 20).await;
    assert!(
        left >= 20,
        "a member's old IP is still trusted ({left} refused)"
    );

    f.lockctl(&[1], &["member", "remove", "4"]).unwrap();
    let removed = flood_until(&ip4(&f), to, Duration::from_secs(10), |r| r >= 20).await;
    assert!(
        removed >= 20,
        "a removed member is still trusted ({removed} refused)"
    );
}

/// Goal: the plaintext metrics listener bounds connections per source as the gRPC port does (on
/// main it accepted and kept every one: TLS had the bound, plaintext did not), and still
/// answers a scrape meanwhile.
/// Method: a three-node cluster without TLS; `CONNECTIONS_PER_SOURCE_MAX + 20` silent
/// connections to node 1's metrics port from another loopback address while they are held, a
/// scrape from the cluster's own address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plaintext_metrics_listener_bounds_connections_per_source() {
    let (cluster, attacker) = cluster_and_attacker().await;
    let to: SocketAddr = cluster.metrics_addr(1).parse().unwrap();
    let refused = flood_until(&attacker, to, Duration::from_secs(10), |r| r >= 20).await;
    assert_eq!(
        refused, 20,
        "one source kept more than {CONNECTIONS_PER_SOURCE_MAX} connections to the metrics port"
    );
    let text = cluster.metrics_text(1).await.unwrap();
    assert!(text.contains("lockd_"), "a scrape is served: {text:.200}");
}

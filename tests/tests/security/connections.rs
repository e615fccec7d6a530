//! What a client that opens connections and sends nothing can hold on a node's gRPC port.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lockd_server::connections::{CONNECTIONS_PER_SOURCE_MAX, FIRST_BYTES_TIMEOUT};
use lockd_tests::cluster::{Cluster, ClusterOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A connection to `to` from the loopback address `from` (any 127.0.0.0/8 address works).
async fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
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
    let mut cluster = Cluster::start(ClusterOptions::default()).await.unwrap();
    cluster
        .wait_for_leader(Duration::from_secs(20))
        .await
        .unwrap();
    let addr: SocketAddr = cluster.addr(1).parse().unwrap();
    // Any loopback address other than the cluster's own.
    let octets = cluster.ip.octets();
    let attacker = format!(
        "127.{}.{}.{}",
        octets[1],
        octets[2],
        octets[3].wrapping_add(1).max(1)
    );
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

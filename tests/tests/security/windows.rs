//! What a client can make a node hold through HTTP/2 flow control and a socket it does not read:
//! stream windows smaller than an answer, a connection window opened a byte at a time, and a
//! socket left unread while the node's pings are acknowledged blind.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockd_server::connections::SEND_TIMEOUT;
use lockd_server::flow_watch::STARVED_GRACE;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;

use super::connections::{cluster_and_attacker, connect_from};
use super::requests::{assert_served_from_beside, describe, h2_connection_granting, rss_bytes};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const WINDOW_UPDATE: u8 = 0x8;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
/// The payload of every ping hyper's keepalive sends (h2's "user" ping): a client can acknowledge
/// pings it never read.
const KEEPALIVE_PING: [u8; 8] = [0x3b, 0x7c, 0xdb, 0x7a, 0x0b, 0x87, 0x16, 0xb4];

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut f = vec![len[1], len[2], len[3], kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

fn window_update(stream: u32, increment: u32) -> Vec<u8> {
    frame(WINDOW_UPDATE, 0, stream, &increment.to_be_bytes())
}

/// An HPACK string literal without Huffman coding (shorter than 127 bytes).
fn hpack_string(out: &mut Vec<u8>, s: &str) {
    out.push(u8::try_from(s.len()).unwrap());
    out.extend_from_slice(s.as_bytes());
}

/// The HEADERS and DATA frames of a whole Describe of `resource` on `stream`.
fn describe_frames(to: SocketAddr, stream: u32, resource: &str) -> Vec<u8> {
    // :method POST and :scheme http from HPACK's static table, then literals without indexing:
    // :path (name 4), :authority (name 1), content-type (name 31), te (a new name).
    let mut block = vec![0x83, 0x86, 0x04];
    hpack_string(&mut block, "/lockd.v1.Lock/Describe");
    block.push(0x01);
    hpack_string(&mut block, &to.to_string());
    block.extend_from_slice(&[0x0f, 0x10]);
    hpack_string(&mut block, "application/grpc");
    block.push(0x00);
    hpack_string(&mut block, "te");
    hpack_string(&mut block, "trailers");
    let mut message = vec![0x0a, u8::try_from(resource.len()).unwrap()];
    message.extend_from_slice(resource.as_bytes());
    let mut body = vec![0];
    body.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    body.extend_from_slice(&message);
    let mut frames = frame(HEADERS, END_HEADERS, stream, &block);
    frames.extend(frame(DATA, END_STREAM, stream, &body));
    frames
}

/// A resource held by a 256-byte holder name, so that each Describe of it answers about 300
/// bytes.
async fn held_with_a_long_holder(cluster: &lockd_tests::cluster::Cluster) -> &'static str {
    const RESOURCE: &str = "windows/held";
    let client =
        lockd_client::Client::new((1..=3).map(|id| cluster.addr(id)).collect::<Vec<_>>()).unwrap();
    let lease = client
        .acquire(
            RESOURCE,
            lockd_client::AcquireOptions::default()
                .ttl(Duration::from_secs(300))
                .holder("h".repeat(256)),
        )
        .await
        .unwrap();
    // Held for the test's life.
    std::mem::forget(lease);
    RESOURCE
}

/// What a raw client has seen of each stream, and whether the node closed the connection.
#[derive(Default)]
struct Seen {
    /// Stream id -> (HEADERS frames, DATA bytes, ended).
    streams: HashMap<u32, (u32, usize, bool)>,
    closed: Option<Instant>,
}

/// An HTTP/2 client of raw frames: it writes what the test says, and a task reads the node's
/// frames, acknowledging its SETTINGS and PINGs as any client does, granting nothing itself.
struct RawClient {
    write: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    seen: Arc<Mutex<Seen>>,
}

impl RawClient {
    async fn connect(from: &str, to: SocketAddr) -> RawClient {
        let (mut read, write) = connect_from(from, to).await.into_split();
        let write = Arc::new(tokio::sync::Mutex::new(write));
        let seen = Arc::new(Mutex::new(Seen::default()));
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        write.lock().await.write_all(&hello).await.unwrap();
        let (w, s) = (write.clone(), seen.clone());
        tokio::spawn(async move {
            loop {
                let mut header = [0u8; 9];
                if read.read_exact(&mut header).await.is_err() {
                    break;
                }
                let len = usize::from(header[0]) << 16
                    | usize::from(header[1]) << 8
                    | usize::from(header[2]);
                let (kind, flags) = (header[3], header[4]);
                let stream = u32::from_be_bytes(header[5..9].try_into().unwrap()) & 0x7fff_ffff;
                let mut payload = vec![0u8; len];
                if read.read_exact(&mut payload).await.is_err() {
                    break;
                }
                let answer = match kind {
                    SETTINGS if flags & ACK == 0 => Some(frame(SETTINGS, ACK, 0, &[])),
                    PING if flags & ACK == 0 => Some(frame(PING, ACK, 0, &payload)),
                    _ => None,
                };
                if let Some(answer) = answer {
                    let _ = w.lock().await.write_all(&answer).await;
                }
                let mut seen = s.lock().unwrap();
                let entry = seen.streams.entry(stream).or_default();
                match kind {
                    HEADERS => entry.0 += 1,
                    DATA => entry.1 += len,
                    _ => {}
                }
                if (matches!(kind, HEADERS | DATA) && flags & END_STREAM != 0) || kind == RST_STREAM
                {
                    entry.2 = true;
                }
            }
            s.lock().unwrap().closed = Some(Instant::now());
        });
        RawClient { write, seen }
    }

    async fn send(&self, bytes: &[u8]) -> bool {
        self.write.lock().await.write_all(bytes).await.is_ok()
    }

    fn closed(&self) -> Option<Instant> {
        self.seen.lock().unwrap().closed
    }

    /// Waits up to `within` for `done` to hold of stream `id`, or for the connection to close.
    async fn wait_for(
        &self,
        id: u32,
        within: Duration,
        done: impl Fn((u32, usize, bool)) -> bool,
    ) -> bool {
        let deadline = Instant::now() + within;
        let state = || {
            let seen = self.seen.lock().unwrap();
            seen.streams.get(&id).copied().unwrap_or_default()
        };
        while Instant::now() < deadline && self.closed().is_none() {
            if done(state()) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        done(state())
    }
}

/// Goal: a client cannot keep answers on the node by opening its connection window a byte at a
/// time. One byte of window lets hyper hand a whole answer to h2 (and its trailers after it), so
/// neither the source's budget nor the untaken-answer timeout sees it, while h2 keeps it with its
/// stream; on main 1,000 such answers per connection stayed until a keepalive check found an
/// older one (43-51 s). While the connection window is starved past `STARVED_GRACE`, every
/// answer begun and not ended now counts as a starved stream, and over `STARVED_STREAMS_MAX` the
/// connection is closed.
/// Method: a three-node cluster; from another loopback address, a raw HTTP/2 client takes whole
/// answers until its connection window no longer holds one, then, for each of 200 more calls,
/// grants the connection one byte once the answer's head has arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_window_opened_a_byte_at_a_time_closes_the_connection() {
    let (cluster, attacker) = cluster_and_attacker().await;
    let to: SocketAddr = cluster.addr(1).parse().unwrap();
    let resource = held_with_a_long_holder(&cluster).await;
    let client = RawClient::connect(&attacker, to).await;

    // Whole answers until one no longer fits the connection window.
    let mut stream = 1u32;
    loop {
        assert!(client.send(&describe_frames(to, stream, resource)).await);
        let ended = client
            .wait_for(stream, Duration::from_secs(2), |(_, _, ended)| ended)
            .await;
        assert!(
            client.closed().is_none(),
            "the node closed a client taking its answers"
        );
        if !ended {
            break;
        }
        stream += 2;
        assert!(stream < 4_000, "the connection window never ran out");
    }
    let shut = Instant::now();

    // A byte at a time, each letting one more answer into h2 whole.
    let mut held = 0;
    while held < 200 && client.closed().is_none() {
        stream += 2;
        client.send(&describe_frames(to, stream, resource)).await;
        client
            .wait_for(stream, Duration::from_secs(2), |(heads, _, _)| heads > 0)
            .await;
        if !client.send(&window_update(0, 1)).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        held += 1;
    }
    let deadline = shut + Duration::from_secs(15);
    while Instant::now() < deadline && client.closed().is_none() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let closed_after = client.closed().map(|at| at - shut);
    eprintln!(
        "{held} answers let into h2 a byte at a time; the connection closed {closed_after:?} \
         after its window shut"
    );
    assert!(
        closed_after.is_some(),
        "a connection holding {held} answers behind a starved window is open after 15 s"
    );
    assert_served_from_beside(&attacker, to).await;
}

/// Goal: a client cannot keep answers on the node with stream windows smaller than an answer.
/// hyper hands an answer to h2 whole once its stream may take one byte, and h2 keeps the rest
/// until the client grants more, out of sight of the bounds on untaken answers (the source's
/// budget, `SEND_TIMEOUT` on answers hyper waits to hand over): on main, 4 connections granting
/// 1-byte windows kept 4,000 answers on the node (35 MB) for as long as the client answered
/// pings. Small windows are legitimate (gRPC core shrinks them under memory pressure), so they are
/// not refused: a connection with more than `STARVED_STREAMS_MAX` streams starved for over
/// `STARVED_GRACE` is closed.
/// Method: a three-node cluster; from another loopback address, 4 connections granting 1-byte
/// stream windows, 1,000 Describes each, answers left untaken; a Describe from a third address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_windows_smaller_than_an_answer_close_the_connection_in_time() {
    const CONNECTIONS: usize = 4;
    const CALLS: usize = 1_000;
    let (cluster, attacker) = cluster_and_attacker().await;
    let to: SocketAddr = cluster.addr(1).parse().unwrap();
    let pid = cluster.pid(1).unwrap();
    let before = rss_bytes(pid);
    let mut begun = 0;
    let mut kept = Vec::new();
    let mut connections = Vec::new();
    for _ in 0..CONNECTIONS {
        let (mut send, connection) = h2_connection_granting(&attacker, to, Some(1)).await;
        let mut calls = Vec::new();
        for i in 0..CALLS {
            if send.ready().await.is_err() {
                break;
            }
            calls.push(send.send_request(describe(to, &format!("windows/{i}"))));
        }
        for call in calls {
            if let Ok(Ok(answer)) = tokio::time::timeout(Duration::from_secs(10), call).await {
                kept.push(answer);
                begun += 1;
            }
        }
        connections.push(connection);
        tokio::spawn(async move {
            let _send = send;
            tokio::time::sleep(Duration::from_secs(600)).await;
        });
    }
    let sent = Instant::now();
    let grown = rss_bytes(pid).saturating_sub(before);
    assert_served_from_beside(&attacker, to).await;

    let deadline = sent + STARVED_GRACE * 2 + Duration::from_secs(10);
    while Instant::now() < deadline && !connections.iter().all(|c| c.is_finished()) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let open = connections.iter().filter(|c| !c.is_finished()).count();
    eprintln!(
        "{CONNECTIONS} connections granting 1-byte windows: {begun} answers begun, node 1 RSS {} \
         MB more; after {:?}, {open} connections open",
        grown >> 20,
        sent.elapsed()
    );
    assert_eq!(
        open, 0,
        "connections with {} streams starved for over {STARVED_GRACE:?} are still open",
        CALLS
    );
    drop(kept);
}

/// The bytes the node's socket towards `client` has sent and not had acknowledged, and whether
/// it is still open (ESTABLISHED), from /proc/net/tcp.
fn node_socket_towards(client: SocketAddr) -> Option<(u64, bool)> {
    let std::net::IpAddr::V4(ip) = client.ip() else {
        return None;
    };
    let wanted = format!(
        "{:08X}:{:04X}",
        u32::from_le_bytes(ip.octets()),
        client.port()
    );
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.get(2) == Some(&wanted.as_str())).then(|| {
            let tx = fields[4].split(':').next().unwrap();
            (u64::from_str_radix(tx, 16).unwrap(), fields[3] == "01")
        })
    })
}

/// Goal: a client that reads nothing cannot keep a connection, and what the node's socket holds
/// for it, by acknowledging the node's keepalive pings blind (their payload is fixed). On main
/// such a connection stayed open for good, its socket holding megabytes of answers the client
/// never read, and h2 the calls behind them. A write the socket has not taken for `SEND_TIMEOUT`
/// now closes the connection (with a reset, so that the kernel drops what it holds).
/// Method: a three-node cluster; from another loopback address, a client with a small receive
/// buffer that sends Describes in batches until the node's socket towards it stops taking more,
/// never reads, and sends a keepalive ping's acknowledgement every 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_nothing_is_closed_in_time_though_it_acknowledges_pings() {
    let (cluster, attacker) = cluster_and_attacker().await;
    let to: SocketAddr = cluster.addr(1).parse().unwrap();
    let resource = held_with_a_long_holder(&cluster).await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4_096).unwrap();
    socket
        .bind(format!("{attacker}:0").parse().unwrap())
        .unwrap();
    let mut tcp = socket.connect(to).await.unwrap();
    let me = tcp.local_addr().unwrap();
    let mut hello = PREFACE.to_vec();
    hello.extend(frame(SETTINGS, 0, 0, &[]));
    hello.extend(frame(SETTINGS, ACK, 0, &[]));
    // The connection window is no limit: the socket is.
    hello.extend(window_update(0, 1 << 30));
    tcp.write_all(&hello).await.unwrap();

    // Batches of calls until a batch's answers no longer fit the node's socket (fewer calls at
    // once than the 1,024 a connection may have open, so that the node keeps reading).
    const BATCH: usize = 800;
    let mut stream = 1u32;
    let unsent = |me| {
        node_socket_towards(me)
            .expect("the node's socket in /proc/net/tcp")
            .0
    };
    loop {
        let mut batch = Vec::new();
        for _ in 0..BATCH {
            batch.extend(describe_frames(to, stream, resource));
            stream += 2;
        }
        let before = unsent(me);
        tcp.write_all(&batch).await.unwrap();
        // Written whole (about 300 bytes each), or not within 3 s: the socket is full.
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut written = false;
        while Instant::now() < deadline && !written {
            tokio::time::sleep(Duration::from_millis(20)).await;
            written = unsent(me) >= before + 250 * BATCH as u64;
        }
        if !written {
            break;
        }
        assert!(stream < 200_000, "the node's socket never filled");
    }
    let unsent = unsent(me);
    let blocked = Instant::now();
    eprintln!(
        "after {} calls the node's socket holds {} KB the client has not read",
        stream / 2,
        unsent >> 10
    );

    // Acknowledge the node's keepalive pings without reading them.
    let deadline = blocked + SEND_TIMEOUT + Duration::from_secs(25);
    let mut open = true;
    while Instant::now() < deadline && open {
        let _ = tcp.write_all(&frame(PING, ACK, 0, &KEEPALIVE_PING)).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        open = node_socket_towards(me).is_some_and(|(_, established)| established);
    }
    eprintln!(
        "after {:?} the node's connection is {}",
        blocked.elapsed(),
        if open { "open" } else { "closed" }
    );
    assert!(
        !open,
        "the node kept a connection whose socket took nothing for {:?}",
        deadline - blocked
    );
    assert_served_from_beside(&attacker, to).await;
}

//! What a client can make a node hold with calls it never finishes sending.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use lockd_server::receiving::{RECEIVE_TIMEOUT, RECEIVING_PER_SOURCE_MAX};

use super::connections::{cluster_and_attacker, connect_from};

const CONNECTIONS: usize = 4;
const STREAMS_PER_CONNECTION: usize = 1_000;
/// Metadata bytes of each call: within HTTP/2's header list bound, so the node accepts them.
const PAD_BYTES: usize = 8_000;
/// The message each call announces (within the node's 64 KiB per message) and how much of it
/// arrives.
const ANNOUNCED_BYTES: u32 = 65_000;
const SENT_BYTES: usize = 60_000;

pub(super) fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// How an unfinished call makes the node hold memory.
#[derive(Clone, Copy)]
enum Unfinished {
    /// `PAD_BYTES` of metadata and `SENT_BYTES` of a message announced as `ANNOUNCED_BYTES`.
    PaddedAndHalfSent,
    /// No metadata but a `PAD_BYTES` `:authority`, and only the 5-byte prefix announcing
    /// `ANNOUNCED_BYTES` (tonic reserves them at once).
    LongAuthorityAndBarePrefix,
    /// A whole message of `SENT_BYTES`, but no end of the request (tonic keeps it decoded while
    /// it waits for the end).
    WholeMessageNoEnd,
}

/// A request body that sends its frames and then never ends.
type Endless = StreamBody<futures::stream::BoxStream<'static, Result<Frame<Bytes>, Infallible>>>;

/// An Acquire whose request body never ends.
fn unfinished_acquire(to: SocketAddr, how: Unfinished) -> hyper::Request<Endless> {
    let mut first = vec![0];
    first.extend_from_slice(&ANNOUNCED_BYTES.to_be_bytes());
    let request = match how {
        Unfinished::PaddedAndHalfSent => {
            first.resize(5 + SENT_BYTES, 0x0a);
            hyper::Request::post(format!("http://{to}/lockd.v1.Lock/Acquire"))
                .header("x-pad", "p".repeat(PAD_BYTES))
        }
        Unfinished::WholeMessageNoEnd => {
            let sent = u32::try_from(SENT_BYTES).unwrap();
            first[1..5].copy_from_slice(&sent.to_be_bytes());
            first.resize(5 + SENT_BYTES, 0x0a);
            hyper::Request::post(format!("http://{to}/lockd.v1.Lock/Acquire"))
        }
        Unfinished::LongAuthorityAndBarePrefix => hyper::Request::post(format!(
            "http://{}.example:{}/lockd.v1.Lock/Acquire",
            "h".repeat(PAD_BYTES),
            to.port()
        )),
    };
    let frames = futures::stream::iter([Ok(Frame::data(Bytes::from(first)))])
        .chain(futures::stream::pending())
        .boxed();
    request
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(StreamBody::new(frames))
        .unwrap()
}

/// An HTTP/2 connection from `from` to `to`, driven by a task of its own.
async fn h2_connection<B>(from: &str, to: SocketAddr) -> hyper::client::conn::http2::SendRequest<B>
where
    B: hyper::body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    h2_connection_granting(from, to, None).await.0
}

/// The same, granting `window` bytes to each stream (hyper's default when `None`); with the
/// task that drives it.
pub(super) async fn h2_connection_granting<B>(
    from: &str,
    to: SocketAddr,
    window: Option<u32>,
) -> (
    hyper::client::conn::http2::SendRequest<B>,
    tokio::task::JoinHandle<hyper::Result<()>>,
)
where
    B: hyper::body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let tcp = connect_from(from, to).await;
    let mut builder =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
    if let Some(window) = window {
        builder.initial_stream_window_size(window);
    }
    let (send, connection) = builder
        .handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .unwrap();
    (send, tokio::spawn(connection))
}

/// Asserts that `to` serves a whole Describe from the loopback address after `attacker`'s (not a
/// member's either).
pub(super) async fn assert_served_from_beside(attacker: &str, to: SocketAddr) {
    let [a, b, c, d] = attacker.parse::<std::net::Ipv4Addr>().unwrap().octets();
    let probe = std::net::Ipv4Addr::new(a, b, c, d.wrapping_add(1).max(1)).to_string();
    assert_eq!(
        whole_describe_from(&probe, to).await.as_deref(),
        Some("0"),
        "node 1 serves a client from {probe}"
    );
}

/// The gRPC status of a Describe sent whole from `from` to `to` on a connection of its own.
async fn whole_describe_from(from: &str, to: SocketAddr) -> Option<String> {
    let request = describe(to, "requests/probe");
    let mut send = h2_connection(from, to).await;
    let response = tokio::time::timeout(Duration::from_secs(5), send.send_request(request))
        .await
        .ok()?
        .ok()?;
    grpc_status(response).await
}

/// The gRPC status a call ended with: from its headers (a trailers-only answer) or trailers.
async fn grpc_status(response: hyper::Response<hyper::body::Incoming>) -> Option<String> {
    let from_headers = response
        .headers()
        .get("grpc-status")
        .map(|v| v.to_str().unwrap().to_owned());
    if from_headers.is_some() {
        return from_headers;
    }
    let collected = response.into_body().collect().await.ok()?;
    collected
        .trailers()
        .and_then(|t| t.get("grpc-status"))
        .map(|v| v.to_str().unwrap().to_owned())
}

/// Goal: calls that never finish arriving cannot make a node hold unbounded memory. HTTP/2 lets
/// one connection keep 1,024 calls open, each with its headers and a buffer for a message of up
/// to 64 KiB; a source may hold 256 connections, and sources are many. A call that waits for the
/// rest of its request now counts its head and its announced message against a budget per source
/// address (`RECEIVING_PER_SOURCE_MAX`) and one for the node; a call beyond it ends at once with
/// `RESOURCE_EXHAUSTED`, and one that has not arrived whole within `RECEIVE_TIMEOUT` ends the
/// same way. The node serves its clients throughout. On main every such call was held for good:
/// 4 connections of 1,000 calls made node 1 hold 268 MB more.
/// Method: a three-node cluster; from another loopback address, 4 connections of 1,000
/// unfinished Acquires of three kinds (`Unfinished`: metadata and half a message, a long
/// `:authority` and a bare prefix, a whole message without the end of the request); a Describe
/// from a third address meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_that_never_finish_arriving_are_bounded_and_ended_in_time() {
    let (cluster, attacker) = cluster_and_attacker().await;
    let to: SocketAddr = cluster.addr(1).parse().unwrap();
    let pid = cluster.pid(1).unwrap();
    let before = rss_bytes(pid);
    let started = Instant::now();

    let mut calls = futures::stream::FuturesUnordered::new();
    for c in 0..CONNECTIONS {
        let how = [
            Unfinished::PaddedAndHalfSent,
            Unfinished::LongAuthorityAndBarePrefix,
            Unfinished::WholeMessageNoEnd,
        ][c % 3];
        let mut send = h2_connection(&attacker, to).await;
        for _ in 0..STREAMS_PER_CONNECTION {
            send.ready().await.unwrap();
            let response = send.send_request(unfinished_acquire(to, how));
            calls.push(tokio::spawn(async move {
                match response.await {
                    Ok(r) => (grpc_status(r).await, started.elapsed()),
                    Err(e) => (Some(format!("stream error: {e}")), started.elapsed()),
                }
            }));
        }
    }
    // Let the node receive what was sent.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let grown = rss_bytes(pid).saturating_sub(before);
    eprintln!(
        "node 1 after {} unfinished calls: RSS {} MB more",
        CONNECTIONS * STREAMS_PER_CONNECTION,
        grown >> 20
    );

    // The node serves its clients meanwhile, from another address that is not a member's.
    assert_served_from_beside(&attacker, to).await;

    // Every call ends within the timeout, refused; none is answered otherwise.
    let deadline = RECEIVE_TIMEOUT + Duration::from_secs(5);
    let mut ended = 0;
    let mut statuses = std::collections::BTreeMap::<String, usize>::new();
    let mut last = Duration::ZERO;
    while let Ok(Some(call)) =
        tokio::time::timeout(deadline.saturating_sub(started.elapsed()), calls.next()).await
    {
        let (status, at) = call.unwrap();
        ended += 1;
        last = last.max(at);
        *statuses
            .entry(status.unwrap_or_else(|| "none".into()))
            .or_default() += 1;
    }
    eprintln!("{ended} calls ended, the last after {last:?}: {statuses:?}");
    assert!(
        grown < 128 << 20,
        "node 1 holds {} MB more for calls that never finished arriving (per source {} KiB)",
        grown >> 20,
        RECEIVING_PER_SOURCE_MAX >> 10
    );
    assert_eq!(
        ended,
        CONNECTIONS * STREAMS_PER_CONNECTION,
        "calls still open after {deadline:?}"
    );
    assert_eq!(
        statuses.get("8").copied().unwrap_or(0),
        ended,
        "every unfinished call ends RESOURCE_EXHAUSTED (8): {statuses:?}"
    );
}

/// Goal: answers a client never takes cannot make a node hold unbounded memory. A client that
/// grants no HTTP/2 flow-control window (and answers pings) leaves each answer on the node with
/// its stream and task, about 9 KB, 1,024 per connection and 256 connections per address. Now an
/// answer counts `ANSWER_BYTES` against its source's budget until taken, so once an address
/// holds its whole budget its next calls get `RESOURCE_EXHAUSTED` at once, and a connection with
/// an answer left untaken for `SEND_TIMEOUT` is closed. On main every answer was kept for good.
/// Method: a three-node cluster; from another loopback address, connections granting no window
/// with 1,000 Describes each until the address's budget is full, then one more with 1,000; a
/// Describe from a third address meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_a_client_never_takes_are_bounded_and_their_connections_closed() {
    use lockd_server::connections::SEND_TIMEOUT;
    use lockd_server::receiving::ANSWER_BYTES;
    let (cluster, attacker) = cluster_and_attacker().await;
    let to: SocketAddr = cluster.addr(1).parse().unwrap();
    let pid = cluster.pid(1).unwrap();
    let before = rss_bytes(pid);
    let started = Instant::now();

    // Connections of 1,000 calls whose answers stay on the node until the address's budget is
    // full (and the calls admitted before their answers existed); then 1,000 more on one more
    // connection, each refused at once.
    let filling = RECEIVING_PER_SOURCE_MAX / ANSWER_BYTES / STREAMS_PER_CONNECTION + 1;
    let mut connections = Vec::new();
    let mut batches = Vec::new();
    for _ in 0..=filling {
        let (mut send, connection) = h2_connection_granting(&attacker, to, Some(0)).await;
        connections.push(connection);
        let mut answers = Vec::new();
        for i in 0..STREAMS_PER_CONNECTION {
            send.ready().await.unwrap();
            answers.push(send.send_request(describe(to, &format!("requests/{i}"))));
        }
        // The heads of the answers arrive (HEADERS are not flow-controlled); bodies never can.
        let (mut kept, mut refused) = (Vec::new(), 0);
        for answer in answers {
            match tokio::time::timeout(Duration::from_secs(10), answer).await {
                Ok(Ok(r)) if r.headers().get("grpc-status").is_some_and(|s| s == "8") => {
                    refused += 1
                }
                Ok(Ok(r)) => kept.push(r),
                Ok(Err(e)) => panic!("a call failed: {e}"),
                Err(_) => panic!("no answer head within 10 s"),
            }
        }
        eprintln!(
            "{STREAMS_PER_CONNECTION} calls: {} answers kept untaken, {refused} refused",
            kept.len()
        );
        batches.push((kept, refused));
        // Kept open, so that the connection is not closed from this side.
        tokio::spawn(async move {
            let _send = send;
            tokio::time::sleep(Duration::from_secs(3_600)).await;
        });
    }
    let grown = rss_bytes(pid).saturating_sub(before);
    eprintln!("node 1 RSS {} MB more", grown >> 20);
    let kept: usize = batches[..filling].iter().map(|(k, _)| k.len()).sum();
    assert!(
        kept * ANSWER_BYTES >= RECEIVING_PER_SOURCE_MAX,
        "fewer answers kept than the budget allows: {kept}"
    );
    assert_eq!(
        batches[filling].1, STREAMS_PER_CONNECTION,
        "calls admitted from an address that holds its whole budget in untaken answers"
    );

    // Others are served meanwhile.
    assert_served_from_beside(&attacker, to).await;

    // The connection with untaken answers is closed once they have waited SEND_TIMEOUT (checked
    // at its next read or write, which keepalive pings bring within 20 s).
    let deadline = started + SEND_TIMEOUT + Duration::from_secs(25);
    while Instant::now() < deadline && !connections[0].is_finished() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "after {:?}: the connection with untaken answers closed: {}",
        started.elapsed(),
        connections[0].is_finished()
    );
    assert!(
        connections[0].is_finished(),
        "a connection with answers untaken for {SEND_TIMEOUT:?} is still open"
    );
    // The address's budget came back with the connection: its calls are served again.
    assert_eq!(
        whole_describe_from(&attacker, to).await.as_deref(),
        Some("0"),
        "{attacker} is still refused after its connection with untaken answers closed"
    );
    drop(batches);
}

/// A Describe, whole.
pub(super) fn describe(
    to: SocketAddr,
    resource: &str,
) -> hyper::Request<http_body_util::Full<Bytes>> {
    // Field 1 (`resource`), a string shorter than 128 bytes.
    let mut message = vec![0x0a, u8::try_from(resource.len()).unwrap()];
    message.extend_from_slice(resource.as_bytes());
    let mut framed = vec![0u8];
    framed.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(&message);
    hyper::Request::post(format!("http://{to}/lockd.v1.Lock/Describe"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(http_body_util::Full::new(Bytes::from(framed)))
        .unwrap()
}

/// A health `Watch` of the server's overall status, whole.
fn health_watch(to: SocketAddr) -> hyper::Request<http_body_util::Full<Bytes>> {
    hyper::Request::post(format!("http://{to}/grpc.health.v1.Health/Watch"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        // An empty HealthCheckRequest: the server as a whole.
        .body(http_body_util::Full::new(Bytes::from_static(&[
            0, 0, 0, 0, 0,
        ])))
        .unwrap()
}

/// Goal: health `Watch` streams (long-lived answers, which the answer budget does not count so
/// that clients behind one address can all watch health) are bounded per source address and per
/// node: each holds a stream, a task and a receiver for as long as its client keeps it, and on
/// main one address could open 1,024 per connection on 256 connections. A Watch beyond
/// `WATCH_STREAMS_PER_SOURCE_MAX` now gets `UNIMPLEMENTED` at once (gRPC's client-side health
/// checking then keeps using the node, where another code would mark it down), and a stream that
/// ends gives its place back.
/// Method: a three-node cluster; from another loopback address, 6 connections of 1,000 Watches
/// each; a Describe from a third address meanwhile; then one connection's Watches are dropped and
/// a new Watch from the address is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_watch_streams_are_bounded_per_source() {
    use lockd_server::receiving::WATCH_STREAMS_PER_SOURCE_MAX;
    let (cluster, attacker) = cluster_and_attacker().await;
    let to: SocketAddr = cluster.addr(1).parse().unwrap();
    let pid = cluster.pid(1).unwrap();
    let before = rss_bytes(pid);
    let (mut live, mut refused) = (Vec::new(), 0);
    let mut senders = Vec::new();
    for _ in 0..WATCH_STREAMS_PER_SOURCE_MAX.div_ceil(STREAMS_PER_CONNECTION) + 1 {
        let mut send = h2_connection(&attacker, to).await;
        let mut calls = Vec::new();
        for _ in 0..STREAMS_PER_CONNECTION {
            send.ready().await.unwrap();
            calls.push(send.send_request(health_watch(to)));
        }
        let mut watches = Vec::new();
        for call in calls {
            let answer = tokio::time::timeout(Duration::from_secs(10), call)
                .await
                .expect("a Watch answered within 10 s")
                .expect("a Watch answered");
            match answer.headers().get("grpc-status") {
                Some(code) => {
                    assert_eq!(code, "12", "a refused Watch is UNIMPLEMENTED");
                    refused += 1;
                }
                None => watches.push(answer),
            }
        }
        live.push(watches);
        senders.push(send);
    }
    let open: usize = live.iter().map(Vec::len).sum();
    eprintln!(
        "{open} Watch streams open from one address, {refused} refused; node 1 RSS {} MB more",
        rss_bytes(pid).saturating_sub(before) >> 20
    );
    assert_eq!(
        open, WATCH_STREAMS_PER_SOURCE_MAX,
        "Watch streams open from one address"
    );
    assert_served_from_beside(&attacker, to).await;

    // Streams that end give their places back.
    drop(live.swap_remove(0));
    let mut send = h2_connection(&attacker, to).await;
    let mut served = false;
    for _ in 0..50 {
        let answer = send.send_request(health_watch(to)).await.unwrap();
        if answer.headers().get("grpc-status").is_none() {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(served, "no Watch served after 1,000 of the address's ended");
    drop(live);
}

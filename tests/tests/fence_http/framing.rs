//! How a forwarded request is framed towards the upstream (review of 2026-12-05, third round):
//! nothing a client sends inside a body may reach the upstream as a request of its own, and a
//! body its client cut off never reaches the upstream as a complete one.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use lockd_tests::fence_proxy::{FenceProxy, send};
use lockd_tests::http_upstream::{HttpUpstream, drain_before_close, raw_header, read_raw_head};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::redb_store;

/// Longest chunk-size line or body the [`MethodUpstream`] reads, so that a broken test cannot
/// grow its buffer forever.
const RAW_BODY_MAX_BYTES: usize = 64 * 1024;

/// One request head a [`MethodUpstream`] read, and what it did with the request.
#[derive(Clone, Debug)]
struct Seen {
    /// Which of the upstream's connections it came on (numbered from 0 as accepted).
    connection: usize,
    method: String,
    path: String,
    /// The head as received.
    head: String,
    /// The body it applied; `None` for a request it answered 405 without reading its body.
    applied: Option<String>,
}

impl Seen {
    fn asks_to_close(&self) -> bool {
        raw_header(&self.head, "connection").is_some_and(|v| v.eq_ignore_ascii_case("close"))
    }
}

/// An HTTP/1.1 upstream on raw sockets that implements PUT, POST and PATCH only, as many do: it
/// reads their bodies (`Content-Length` or chunked) and applies them; any other method, in any
/// spelling, is answered `405` at once and kept alive, its body unread: whatever follows the head
/// is taken for the next request. So is a POST to `/early`, answered `404` at once (as a router,
/// an authentication check or the upstream's own fencing check answers before the body). A
/// request that says `Connection: close` is the last one read on its connection, as on any
/// server.
struct MethodUpstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl MethodUpstream {
    async fn start() -> MethodUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let task = tokio::spawn(async move {
            for connection in 0.. {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(serve_methods(stream, connection, log.clone()));
            }
        });
        MethodUpstream { addr, seen, task }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for MethodUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_methods(mut stream: TcpStream, connection: usize, log: Arc<Mutex<Vec<Seen>>>) {
    let mut buf = Vec::new();
    while let Some(head) = read_raw_head(&mut stream, &mut buf).await {
        let mut words = head.split_whitespace();
        let method = words.next().unwrap_or_default().to_owned();
        let path = words.next().unwrap_or_default().to_owned();
        let applied = if matches!(method.as_str(), "PUT" | "POST" | "PATCH") && path != "/early" {
            let Some(body) = read_body(&mut stream, &mut buf, &head).await else {
                return;
            };
            Some(String::from_utf8_lossy(&body).into_owned())
        } else {
            None
        };
        let seen = Seen {
            connection,
            method,
            path,
            head,
            applied,
        };
        let status = if seen.applied.is_some() {
            "200 OK"
        } else if seen.path == "/early" {
            "404 Not Found"
        } else {
            "405 Method Not Allowed"
        };
        let close = seen.asks_to_close();
        log.lock().unwrap().push(seen);
        let response = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n");
        if stream.write_all(response.as_bytes()).await.is_err() {
            return;
        }
        if close {
            drain_before_close(&mut stream).await;
            return;
        }
    }
}

/// The body of the request whose head is `head`; `None` if the connection ends first.
async fn read_body(stream: &mut TcpStream, buf: &mut Vec<u8>, head: &str) -> Option<Vec<u8>> {
    if let Some(length) = raw_header(head, "content-length").and_then(|v| v.parse::<usize>().ok()) {
        fill(stream, buf, length).await?;
        return Some(buf.drain(..length).collect());
    }
    if !raw_header(head, "transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        return Some(Vec::new());
    }
    let mut body = Vec::new();
    loop {
        let line = read_line(stream, buf).await?;
        let size = usize::from_str_radix(line.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            // Trailers, up to the blank line.
            while !read_line(stream, buf).await?.is_empty() {}
            return Some(body);
        }
        fill(stream, buf, size + 2).await?;
        body.extend(buf.drain(..size));
        buf.drain(..2);
    }
}

/// Reads until `buf` holds at least `n` bytes.
async fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>, n: usize) -> Option<()> {
    if n > RAW_BODY_MAX_BYTES {
        return None;
    }
    while buf.len() < n {
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(read) => buf.extend_from_slice(&chunk[..read]),
        }
    }
    Some(())
}

/// One line (without its CRLF) taken from the front of `buf`.
async fn read_line(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    loop {
        if let Some(i) = buf.windows(2).position(|w| w == b"\r\n") {
            let line = String::from_utf8_lossy(&buf[..i]).into_owned();
            buf.drain(..i + 2);
            return Some(line);
        }
        fill(stream, buf, buf.len() + 1).await?;
    }
}

/// Attack (review of 2026-12-05, third round, HIGH, and the review of its fix): `Connection:
/// close` went only with a body on GET, HEAD, OPTIONS, DELETE and TRACE, so a fenced write by
/// MOVE, PROPFIND, a lowercase `put` or a method of the client's own naming kept its pooled
/// upstream connection; an upstream that answers a method it does not implement with 405 without
/// reading the body took the body for the next request: a stale `PUT /orders/42` with token 41,
/// inside a write of `junk/1`, applied after 42's write. The first fix kept POST, PUT and PATCH
/// on their connections, and a POST the upstream answered early (404) without reading its body
/// smuggled the same write. Goal: by default every request with a body goes upstream with
/// `Connection: close`. Method: token 42 applied for `orders/42`, then each attack carrying the
/// stale write as its body, each followed by a plain POST; the upstream of the finding never
/// applies `old41`; plain POST, PUT and PATCH writes ask to close too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_on_any_method_cannot_smuggle_a_request() {
    let (upstream, seen, statuses) = smuggle_through(&[]).await;
    let expected: Vec<(&str, u16)> = ATTACKS
        .iter()
        .flat_map(|(m, p)| [(*m, if *p == "/early" { 404 } else { 405 }), ("POST", 200)])
        .collect();
    assert_eq!(statuses, expected, "{seen:?}");
    let plain: Vec<&Seen> = seen.iter().filter(|s| s.path == "/plain").collect();
    assert_eq!(plain.len(), 6, "{seen:?}");
    assert!(
        plain.iter().all(|s| s.asks_to_close()),
        "POST, PUT and PATCH bodies must close their upstream connection by default: {plain:?}"
    );
    drop(upstream);
}

/// Goal: `--upstream-reuse-after-body` (for upstreams that read or discard every body they
/// answer) keeps the connection after POST, PUT and PATCH bodies, and still closes it after a
/// body on any other method. Method: the attacks of the test above but the early POST (which
/// such an upstream would not answer so); the plain writes share their connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reuse_after_body_keeps_post_put_patch_connections_and_no_other() {
    let (upstream, seen, _) = smuggle_through(&["--upstream-reuse-after-body"]).await;
    let plain: Vec<&Seen> = seen.iter().filter(|s| s.path == "/plain").collect();
    assert_eq!(plain.len(), 6, "{seen:?}");
    assert!(
        plain.iter().all(|s| !s.asks_to_close()),
        "POST, PUT and PATCH must keep their upstream connection: {plain:?}"
    );
    let mut connections: Vec<usize> = plain.iter().map(|s| s.connection).collect();
    connections.dedup();
    assert!(
        connections.len() <= 2,
        "six writes one after the other should share a connection: {connections:?}"
    );
    drop(upstream);
}

/// Bodies that smuggle a stale write: methods the upstream does not implement, and a POST it
/// answers early without reading the body (only without `--upstream-reuse-after-body`).
const ATTACKS: [(&str, &str); 5] = [
    ("MOVE", "/junk"),
    ("PROPFIND", "/junk"),
    ("put", "/junk"),
    ("FROBNICATE", "/junk"),
    ("POST", "/early"),
];

/// Runs the smuggling attempts of [`ATTACKS`] through a proxy with `extra` flags, then six
/// plain POST, PUT and PATCH writes; checks that no smuggled write was applied and that every
/// attack asked its connection to close; returns what the upstream saw and the attacks'
/// statuses (each attack followed by a plain POST).
async fn smuggle_through(extra: &[&str]) -> (MethodUpstream, Vec<Seen>, Vec<(&'static str, u16)>) {
    let upstream = MethodUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut flags = vec!["--threads", "1"];
    flags.extend_from_slice(extra);
    let reuse = extra.contains(&"--upstream-reuse-after-body");
    let proxy = FenceProxy::start(&upstream.url(), &redb_store(&dir), &flags)
        .await
        .unwrap();

    // Phase 1: token 42's write of orders/42 is applied.
    let reply = proxy
        .write(
            "PUT",
            "/orders/42",
            (Some("orders/42"), Some("42")),
            &[],
            "new42",
        )
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");

    // Phase 2: writes of other resources by methods the upstream does not implement, each with
    // a stale write of orders/42 as its body, and a write after each on the same pool.
    let smuggled = "PUT /orders/42 HTTP/1.1\r\nHost: up\r\nLock-Resource: orders/42\r\n\
                    Fencing-Token: 41\r\nContent-Length: 5\r\n\r\nold41";
    // Their answers are checked after the upstream's record: a smuggled request also shifts
    // the answers on its connection by one.
    let mut statuses = Vec::new();
    for (i, (method, path)) in ATTACKS.iter().enumerate() {
        if reuse && *path == "/early" {
            continue;
        }
        let resource = format!("junk/{i}");
        let reply = proxy
            .write(method, path, (Some(&resource), Some("1")), &[], smuggled)
            .await
            .unwrap();
        statuses.push((*method, reply.status));
        let reply = proxy
            .write("POST", "/after", (Some("after"), Some("1")), &[], "after")
            .await
            .unwrap();
        statuses.push(("POST", reply.status));
    }

    // Phase 3: writes by POST, PUT and PATCH, one after the other.
    for method in ["PUT", "POST", "PATCH", "PUT", "POST", "PATCH"] {
        let reply = proxy
            .write(method, "/plain", (Some("plain"), Some("1")), &[], "plain")
            .await
            .unwrap();
        assert_eq!(reply.status, 200, "{method}: {reply:?}");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    let seen = upstream.seen();
    let applied: Vec<(&str, &str, &str)> = seen
        .iter()
        .filter_map(|s| Some((s.method.as_str(), s.path.as_str(), s.applied.as_deref()?)))
        .collect();
    assert!(
        !seen.iter().any(|s| s.applied.as_deref() == Some("old41")),
        "a request smuggled in a body reached the upstream: {applied:?}"
    );
    for s in seen
        .iter()
        .filter(|s| s.path == "/junk" || s.path == "/early")
    {
        assert!(
            s.asks_to_close(),
            "{} with a body went upstream without Connection: close: {:?}",
            s.method,
            s.head
        );
    }
    drop(proxy);
    (upstream, seen, statuses)
}

/// Attack (review of the third round's HTTP fixes, LOW): `Transfer-Encoding: gzip, chunked` was
/// taken apart by hyper's chunked decoding only and forwarded chunked: the upstream stored the
/// compressed bytes as the body. Goal: any transfer coding but `chunked` alone is refused, 501
/// `unsupported-transfer-coding`, and nothing reaches the upstream. Method: a raw HTTP/1.1 PUT
/// with `gzip, chunked`, and one with two Transfer-Encoding fields; then a plain chunked PUT,
/// which is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_coding_other_than_chunked_is_refused() {
    let upstream = MethodUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = FenceProxy::start(&upstream.url(), &redb_store(&dir), &[])
        .await
        .unwrap();
    let chunked = "5\r\nhello\r\n0\r\n\r\n";
    for (i, coding) in [
        "Transfer-Encoding: gzip, chunked\r\n",
        "Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
    ]
    .iter()
    .enumerate()
    {
        let request = format!(
            "PUT /obj/{i} HTTP/1.1\r\nHost: p\r\nLock-Resource: obj/{i}\r\nFencing-Token: 1\r\n\
             {coding}Connection: close\r\n\r\n{chunked}"
        );
        let reply = raw_exchange(proxy.addr, &request).await;
        assert!(
            reply.starts_with("HTTP/1.1 501")
                && reply
                    .to_ascii_lowercase()
                    .contains("fence-proxy-error: unsupported-transfer-coding"),
            "{coding:?}: {reply}"
        );
    }
    let request = format!(
        "PUT /obj/plain HTTP/1.1\r\nHost: p\r\nLock-Resource: obj/plain\r\nFencing-Token: 1\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n{chunked}"
    );
    let reply = raw_exchange(proxy.addr, &request).await;
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let seen = upstream.seen();
    assert_eq!(
        seen.iter()
            .map(|s| (s.path.as_str(), s.applied.as_deref()))
            .collect::<Vec<_>>(),
        [("/obj/plain", Some("hello"))],
        "{seen:?}"
    );
}

/// Sends `request` on a new connection to `addr` and reads the answer until the proxy closes.
async fn raw_exchange(addr: SocketAddr, request: &str) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).into_owned()
}

/// Attack (review of 2026-12-05, third round, LOW): `Expect: 100-continue` went upstream while
/// the proxy's client sends the body at once; an upstream that answers early (417, or a final
/// status) and assumes no body follows reads the body as the next request, as in the smuggling
/// above. Goal: the proxy never forwards `Expect` (its own server side answers 100 to the client
/// when it reads the body). Method: a write and a read with `Expect: 100-continue`; the upstream
/// sees neither with an `expect` header, and the write's body arrives whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_is_not_forwarded() {
    let upstream = HttpUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = FenceProxy::start(&upstream.url(), &redb_store(&dir), &[])
        .await
        .unwrap();
    let expect = [("Expect", "100-continue")];
    let reply = proxy
        .write(
            "PUT",
            "/obj",
            (Some("obj"), Some("1")),
            &expect,
            "whole body",
        )
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    let reply = send("GET", &proxy.url("/obj"), &expect, "").await.unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");

    let applied = upstream.applied();
    assert_eq!(applied.len(), 2, "{applied:?}");
    for a in &applied {
        assert_eq!(
            a.header("expect"),
            None,
            "{} {} went upstream with Expect",
            a.method,
            a.path
        );
    }
    assert_eq!(applied[0].body, "whole body");
}

/// A PUT of `/{resource}` fenced by `token`, for an h2 client; its body follows as DATA frames.
fn h2_put(proxy: &FenceProxy, resource: &str, token: &str) -> hyper::Request<()> {
    hyper::Request::put(proxy.url(&format!("/{resource}")))
        .header("lock-resource", resource)
        .header("fencing-token", token)
        .body(())
        .unwrap()
}

/// Attack (review of 2026-12-05, third round, MEDIUM): hyper's `Incoming` ends an HTTP/2 body
/// cleanly when the client resets the stream with NO_ERROR (RFC 9113 §8.1 allows it after an
/// early response); the proxy took that for the body's end, ended the chunked upstream body
/// properly, and the upstream applied an upload its client had cut off as a whole write. Goal:
/// an HTTP/2 body that ends without the client's END_STREAM is a failed body: the upstream body
/// is aborted, never finished. Method: h2c with raw frames; an upload ended by END_STREAM is
/// applied (the control); `partial-` without END_STREAM then RST_STREAM(NO_ERROR), once after
/// 0.5 s (the write is under way upstream) and once at once; neither may be applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_upload_reset_with_no_error_is_not_applied_as_complete() {
    let upstream = HttpUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = FenceProxy::start(&upstream.url(), &redb_store(&dir), &[])
        .await
        .unwrap();
    let tcp = TcpStream::connect(proxy.addr).await.unwrap();
    let (client, connection) = h2::client::handshake(tcp).await.unwrap();
    let connection = tokio::spawn(async move {
        let _ = connection.await;
    });

    // Phase 1 (control): an upload its client ends is applied.
    let mut sender = client.clone().ready().await.unwrap();
    let (response, mut body) = sender
        .send_request(h2_put(&proxy, "objects/whole", "7"), false)
        .unwrap();
    body.send_data(Bytes::from_static(b"whole-"), false)
        .unwrap();
    body.send_data(Bytes::from_static(b"body"), true).unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200, "{response:?}");

    // Phase 2: uploads cut off by RST_STREAM(NO_ERROR), after a pause and at once.
    for (resource, pause_ms) in [("objects/big", 500), ("objects/quick", 0)] {
        let mut sender = client.clone().ready().await.unwrap();
        let (response, mut body) = sender
            .send_request(h2_put(&proxy, resource, "7"), false)
            .unwrap();
        body.send_data(Bytes::from_static(b"partial-"), false)
            .unwrap();
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        body.send_reset(h2::Reason::NO_ERROR);
        drop(response);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    connection.abort();

    let writes: Vec<(Option<String>, String)> = upstream
        .writes()
        .iter()
        .map(|w| {
            (
                w.resource().map(str::to_owned),
                String::from_utf8_lossy(&w.body).into_owned(),
            )
        })
        .collect();
    assert_eq!(
        writes,
        [(Some("objects/whole".to_owned()), "whole-body".to_owned())],
        "an upload its client cut off was applied as complete"
    );
}

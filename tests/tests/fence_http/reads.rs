//! Reads pass through on upstream connections that the task serving the read drives itself
//! (`fence_proxy_http::upstream`): a connection goes back to its thread's pool only once its
//! response was read whole, and anything else closes it. These tests run the proxy against a
//! scripted upstream that counts its connections and can misbehave on purpose.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockd_tests::fence_proxy::{FenceProxy, send};
use lockd_tests::http_upstream::drain_before_close;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::redb_store;

/// Size of the `/big` response, larger than any socket buffer on loopback.
const BIG_BODY: usize = 16 << 20;

/// An HTTP/1.1 upstream written on raw sockets, so that it can close connections whenever a
/// test needs: `/close` answers with `Connection: close` and closes; `/drop-after` answers and
/// then closes the idle connection without saying so (a keep-alive timeout); `/big` answers
/// `BIG_BODY` bytes; `/chunked` answers `ok` in chunks; anything else answers `ok`. HEAD gets
/// the head of the same response. It never reads a request's body (it takes whatever follows a
/// head for the next request, as some servers do) and closes after a request that says
/// `Connection: close`; it keeps every request line it served.
struct ScriptedUpstream {
    addr: std::net::SocketAddr,
    /// Connections that carried at least one request.
    connections: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
    lines: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ScriptedUpstream {
    async fn start() -> ScriptedUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(AtomicUsize::new(0));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (c, r, l) = (connections.clone(), requests.clone(), lines.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(serve(stream, c.clone(), r.clone(), l.clone()));
            }
        });
        ScriptedUpstream {
            addr,
            connections,
            requests,
            lines,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    /// The request lines served so far (`GET /x`), in order.
    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }
}

impl Drop for ScriptedUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves one connection. It counts once its first request arrives: the proxy's readiness check
/// opens connections that send nothing.
async fn serve(
    mut stream: TcpStream,
    connections: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
    lines: Arc<Mutex<Vec<String>>>,
) {
    let mut buf = Vec::new();
    let mut counted = false;
    loop {
        // One request head (the proxy sends no body with these reads).
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        buf.drain(..head_end);
        if !counted {
            connections.fetch_add(1, Ordering::SeqCst);
            counted = true;
        }
        requests.fetch_add(1, Ordering::SeqCst);
        let mut words = head.split_whitespace();
        let method = words.next().unwrap_or_default().to_owned();
        let path = words.next().unwrap_or_default().to_owned();
        lines.lock().unwrap().push(format!("{method} {path}"));
        let asked_to_close = head
            .to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n");
        let body = if path == "/big" {
            vec![b'x'; BIG_BODY]
        } else {
            b"ok".to_vec()
        };
        let close = path == "/close";
        let chunked = path == "/chunked";
        let framing = if chunked {
            "Transfer-Encoding: chunked".to_owned()
        } else {
            format!("Content-Length: {}", body.len())
        };
        let mut response = format!(
            "HTTP/1.1 200 OK\r\n{framing}\r\n{}\r\n",
            if close { "Connection: close\r\n" } else { "" }
        )
        .into_bytes();
        if method != "HEAD" {
            if chunked {
                // Two chunks and the last one: a body whose length nobody knows in advance.
                response.extend_from_slice(b"1\r\no\r\n1\r\nk\r\n0\r\n\r\n");
            } else {
                response.extend_from_slice(&body);
            }
        }
        if stream.write_all(&response).await.is_err() {
            return;
        }
        if close {
            return;
        }
        if asked_to_close {
            drain_before_close(&mut stream).await;
            return;
        }
        if path == "/drop-after" {
            tokio::time::sleep(Duration::from_millis(50)).await;
            return;
        }
    }
}

async fn proxy_for(
    upstream: &ScriptedUpstream,
    dir: &tempfile::TempDir,
    threads: &str,
) -> FenceProxy {
    FenceProxy::start(&upstream.url(), &redb_store(dir), &["--threads", threads])
        .await
        .unwrap()
}

async fn read(proxy: &FenceProxy, method: &str, path: &str) -> (u16, String) {
    let reply = send(method, &proxy.url(path), &[], "").await.unwrap();
    (reply.status, reply.body)
}

/// Goal: reads reuse upstream connections instead of opening one each. Method: 30 GETs, 10
/// HEADs and 10 GETs of chunked responses one after the other, each on a new client
/// connection, through a proxy with two connection threads; the upstream counts the
/// connections it accepted: at most one per thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_reuse_upstream_connections() {
    let upstream = ScriptedUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = proxy_for(&upstream, &dir, "2").await;
    for _ in 0..30 {
        assert_eq!(read(&proxy, "GET", "/obj").await, (200, "ok".to_owned()));
    }
    for _ in 0..10 {
        assert_eq!(read(&proxy, "HEAD", "/obj").await, (200, String::new()));
    }
    // A chunked body's end is known only when its last chunk arrives.
    for _ in 0..10 {
        assert_eq!(
            read(&proxy, "GET", "/chunked").await,
            (200, "ok".to_owned())
        );
    }
    assert_eq!(upstream.requests(), 50);
    assert!(
        upstream.connections() <= 2,
        "{} upstream connections for 50 sequential reads on 2 threads",
        upstream.connections()
    );
}

/// Goal: a connection the upstream closes, with or without saying so, is never used again, and
/// the reads after it succeed. Method: alternate reads the upstream answers with `Connection:
/// close` and reads after which it drops the idle connection silently, each followed by a plain
/// read; every read must succeed and each close must cost exactly one new connection (none is
/// dropped while still usable).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_upstream_connections_are_replaced() {
    let upstream = ScriptedUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = proxy_for(&upstream, &dir, "1").await;
    for round in 0..5 {
        assert_eq!(
            read(&proxy, "GET", "/close").await,
            (200, "ok".to_owned()),
            "round {round}"
        );
        assert_eq!(
            read(&proxy, "GET", "/obj").await,
            (200, "ok".to_owned()),
            "round {round}"
        );
        assert_eq!(
            read(&proxy, "GET", "/drop-after").await,
            (200, "ok".to_owned()),
            "round {round}"
        );
        // Past the upstream's silent close: the pooled connection is dead by now.
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(
            read(&proxy, "GET", "/obj").await,
            (200, "ok".to_owned()),
            "round {round}"
        );
    }
    assert_eq!(upstream.requests(), 20);
    // The first /close opens the first connection; then each /close and each silent close
    // costs one new connection: 1 + 2 per round.
    assert_eq!(upstream.connections(), 11);
}

/// Goal: a response the client stops reading half-way closes its upstream connection instead
/// of returning it to the pool with the rest of the body unread. Method: start reading a large
/// response through the proxy and drop the client connection after the first bytes, then read
/// normally; the next read must get its own answer (`ok`), on a new upstream connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_response_does_not_poison_the_pool() {
    let upstream = ScriptedUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = proxy_for(&upstream, &dir, "1").await;
    assert_eq!(read(&proxy, "GET", "/obj").await, (200, "ok".to_owned()));
    assert_eq!(upstream.connections(), 1);
    {
        let mut client = TcpStream::connect(proxy.addr).await.unwrap();
        client
            .write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut first = [0u8; 1024];
        let n = client.read(&mut first).await.unwrap();
        assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    for _ in 0..3 {
        assert_eq!(read(&proxy, "GET", "/obj").await, (200, "ok".to_owned()));
    }
    // /big took the pooled connection and closed it; the reads after it needed a new one.
    assert_eq!(upstream.connections(), 2);
    // A large body read whole still comes through intact.
    let (status, body) = read(&proxy, "GET", "/big").await;
    assert_eq!((status, body.len()), (200, BIG_BODY));
}

/// Attack (review, HIGH where the upstream does not read bodies): a GET (or a fenced DELETE)
/// carrying `PUT /orders/42 ...` as its body went upstream body and all on a kept-alive
/// connection; an upstream that answers without reading a body (a static file handler, Python's
/// `http.server`) then took the body for the next request: an unfenced write smuggled inside a
/// read, or inside another resource's write. Goal: a body on a method that defines none goes
/// upstream with `Connection: close`, so nothing is read after it on that connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_on_a_method_that_defines_none_cannot_smuggle_a_request() {
    let upstream = ScriptedUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = proxy_for(&upstream, &dir, "1").await;
    let smuggled = "PUT /orders/42 HTTP/1.1\r\nHost: up\r\nContent-Length: 0\r\n\r\n";
    let reply = send("GET", &proxy.url("/static"), &[], smuggled)
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    let reply = proxy
        .write(
            "DELETE",
            "/orders/1",
            (Some("orders/1"), Some("5")),
            &[],
            smuggled,
        )
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    // Reads without a body still share connections, and answer as before.
    for _ in 0..3 {
        assert_eq!(read(&proxy, "GET", "/after").await, (200, "ok".to_owned()));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lines = upstream.lines();
    assert!(
        !lines.iter().any(|l| l.starts_with("PUT")),
        "a request smuggled in a body reached the upstream: {lines:?}"
    );
    assert_eq!(
        lines,
        [
            "GET /static",
            "DELETE /orders/1",
            "GET /after",
            "GET /after",
            "GET /after"
        ]
    );
}

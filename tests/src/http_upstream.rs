//! A real HTTP server standing for the storage behind fence-proxy: it runs in-process on Tokio,
//! applies every request it receives (after an optional per-request delay), and keeps the
//! applied requests in order so that a test can check what reached the storage and when.
//!
//! A request is applied even when the client (the proxy) has given up on it and closed the
//! connection: that is the worst case a fencing proxy faces, and the one its quarantine is for.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio_util::sync::CancellationToken;

/// Request header asking the upstream to wait this many milliseconds before applying.
pub const DELAY_HEADER: &str = "Upstream-Delay-Ms";

/// Longest delay a request may ask for, so that a typo cannot hang a test.
const DELAY_MAX_MS: u64 = 30_000;

/// One request as the upstream applied it.
#[derive(Clone, Debug)]
pub struct Applied {
    pub method: String,
    /// Path and query as received.
    pub path: String,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
    /// When its head arrived, on this process's monotonic clock.
    pub received: Instant,
    /// When it was applied, on this process's monotonic clock.
    pub at: Instant,
}

impl Applied {
    /// The `Fencing-Token` it carried, if any.
    pub fn token(&self) -> Option<u64> {
        self.header("fencing-token")?.parse().ok()
    }

    /// The `Lock-Resource` it carried, if any.
    pub fn resource(&self) -> Option<&str> {
        self.header("lock-resource")
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name)?.to_str().ok()
    }
}

/// The running upstream; stops when dropped.
pub struct HttpUpstream {
    pub addr: SocketAddr,
    log: Arc<Mutex<Vec<Applied>>>,
    shutdown: CancellationToken,
}

impl HttpUpstream {
    /// Binds 127.0.0.1 on a free port and serves until dropped.
    pub async fn start() -> anyhow::Result<HttpUpstream> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let log = Arc::new(Mutex::new(Vec::new()));
        let shutdown = CancellationToken::new();
        tokio::spawn(serve(listener, log.clone(), shutdown.clone()));
        Ok(HttpUpstream {
            addr,
            log,
            shutdown,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request applied so far, in the order applied.
    pub fn applied(&self) -> Vec<Applied> {
        self.log.lock().unwrap().clone()
    }

    /// The applied requests other than GET, HEAD and OPTIONS.
    pub fn writes(&self) -> Vec<Applied> {
        self.applied()
            .into_iter()
            .filter(|a| !matches!(a.method.as_str(), "GET" | "HEAD" | "OPTIONS"))
            .collect()
    }
}

impl Drop for HttpUpstream {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn serve(
    listener: tokio::net::TcpListener,
    log: Arc<Mutex<Vec<Applied>>>,
    shutdown: CancellationToken,
) {
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
        };
        let log = log.clone();
        let service = hyper::service::service_fn(move |req| apply(req, log.clone()));
        tokio::spawn(async move {
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn apply(
    req: Request<Incoming>,
    log: Arc<Mutex<Vec<Applied>>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let received = Instant::now();
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        // The sender gave up mid-body: a real store would not apply a truncated request.
        Err(_) => {
            return Ok(Response::builder()
                .status(400)
                .body(Full::default())
                .unwrap());
        }
    };
    let delay_ms = parts
        .headers
        .get(DELAY_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        .min(DELAY_MAX_MS);
    // Applied in a task of its own, so that it happens even if the connection closes first.
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        let index = {
            let mut log = log.lock().unwrap();
            log.push(Applied {
                method: parts.method.to_string(),
                path: parts
                    .uri
                    .path_and_query()
                    .map_or("/".into(), |p| p.to_string()),
                headers: parts.headers.clone(),
                body,
                received,
                at: Instant::now(),
            });
            log.len() - 1
        };
        let _ = tx.send(index);
    });
    let index = rx.await.unwrap_or(usize::MAX);
    Ok(Response::builder()
        .status(200)
        .header("Upstream-Applied-Index", index.to_string())
        .body(Full::new(Bytes::from(format!("applied #{index}\n"))))
        .unwrap())
}

/// What an [`EarlyAnswerUpstream`] saw of one request, in the order it saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BodyEvent {
    /// The request head arrived (and the upstream answered 200 at once).
    Started { resource: String, token: u64 },
    /// The last byte of that request's body was read.
    Completed {
        resource: String,
        token: u64,
        body: Vec<u8>,
    },
    /// The connection ended before the whole body arrived.
    Truncated {
        resource: String,
        token: u64,
        received: usize,
    },
}

/// Longest request head the raw upstream accepts, so that a broken test cannot grow it forever.
const RAW_HEAD_MAX_BYTES: usize = 64 * 1024;

/// Reads one request head (through the blank line) from a raw connection, leaving what follows
/// it in `buf`. `None` when the peer closes first or the head passes `RAW_HEAD_MAX_BYTES` (64 KiB).
pub async fn read_raw_head(
    stream: &mut tokio::net::TcpStream,
    buf: &mut Vec<u8>,
) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > RAW_HEAD_MAX_BYTES {
            return None;
        }
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    buf.drain(..head_end);
    Some(head)
}

/// Takes what the peer still sends (until it stops for 100 ms or closes) before a raw upstream
/// closes the connection, so that the close is not a reset that could cost the peer the answer;
/// none of it is read as a request.
pub async fn drain_before_close(stream: &mut tokio::net::TcpStream) {
    use tokio::io::AsyncReadExt;
    let mut rest = [0u8; 4096];
    while let Ok(Ok(n)) = tokio::time::timeout(
        std::time::Duration::from_millis(100),
        stream.read(&mut rest),
    )
    .await
    {
        if n == 0 {
            break;
        }
    }
}

/// The value of header `name` (any case) in a head read by [`read_raw_head`].
pub fn raw_header(head: &str, name: &str) -> Option<String> {
    head.lines().skip(1).find_map(|line| {
        let (k, v) = line.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case(name)
            .then(|| v.trim().to_owned())
    })
}

/// An upstream that answers every request with `200` as soon as its head has arrived and only then
/// reads the request body, as a server that acknowledges early and applies later does. It logs,
/// per request, when the head arrived and when the body was read completely: the order of these
/// events is what a fencing proxy must keep in token order.
///
/// It speaks HTTP/1.1 by hand (heads with `Content-Length`; others get `411`), because hyper's
/// server reads bodies only as its service asks and would hide the moment a body was finished.
pub struct EarlyAnswerUpstream {
    pub addr: SocketAddr,
    events: Arc<Mutex<Vec<BodyEvent>>>,
    shutdown: CancellationToken,
}

impl EarlyAnswerUpstream {
    pub async fn start() -> anyhow::Result<EarlyAnswerUpstream> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let events = Arc::new(Mutex::new(Vec::new()));
        let shutdown = CancellationToken::new();
        let (log, stop) = (events.clone(), shutdown.clone());
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    _ = stop.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                };
                tokio::spawn(early_answer_connection(stream, log.clone()));
            }
        });
        Ok(EarlyAnswerUpstream {
            addr,
            events,
            shutdown,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The events of `resource`, in the order they happened.
    pub fn events(&self, resource: &str) -> Vec<BodyEvent> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .filter(|e| match e {
                BodyEvent::Started { resource: r, .. }
                | BodyEvent::Completed { resource: r, .. }
                | BodyEvent::Truncated { resource: r, .. } => r == resource,
            })
            .cloned()
            .collect()
    }
}

impl Drop for EarlyAnswerUpstream {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn early_answer_connection(stream: tokio::net::TcpStream, log: Arc<Mutex<Vec<BodyEvent>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = stream;
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let Some(head) = read_raw_head(&mut stream, &mut buf).await else {
            return;
        };
        let header = |name: &str| raw_header(&head, name);
        let Some(length) = header("content-length").and_then(|v| v.parse::<usize>().ok()) else {
            let _ = stream
                .write_all(b"HTTP/1.1 411 Length Required\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                .await;
            return;
        };
        let resource = header("lock-resource").unwrap_or_default();
        let token = header("fencing-token")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        log.lock().unwrap().push(BodyEvent::Started {
            resource: resource.clone(),
            token,
        });
        if stream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .await
            .is_err()
        {
            return;
        }
        // Now read the body, as it comes.
        while buf.len() < length {
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => {
                    log.lock().unwrap().push(BodyEvent::Truncated {
                        resource,
                        token,
                        received: buf.len(),
                    });
                    return;
                }
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body: Vec<u8> = buf.drain(..length).collect();
        log.lock().unwrap().push(BodyEvent::Completed {
            resource,
            token,
            body,
        });
    }
}

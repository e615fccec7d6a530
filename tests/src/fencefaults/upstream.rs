//! An HTTP upstream that misbehaves as each request asks (header `Upstream-Fault`), and a raw
//! HTTP/1.1 client that streams a request body in pieces while it watches for the response.
//!
//! The upstream applies a write only when it has read the whole body, and logs the applied
//! writes in order: that log is what the oracle compares with what the clients were told. It
//! speaks HTTP/1.1 by hand, because answering before the body is read, or closing mid-body, is
//! exactly what a well-behaved server library does not let a handler do.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// Request header naming the misbehaviour (see [`Fault`]).
pub const FAULT_HEADER: &str = "Upstream-Fault";
/// Request header carrying the write's id, which the upstream logs.
pub const WRITE_ID_HEADER: &str = "Write-Id";

/// Longest a raw client waits for its response.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);

/// What the upstream does with one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Reads the body, applies, answers 200.
    None,
    /// Reads the body, waits, applies (also when the proxy has gone meanwhile), answers 200.
    Slow { ms: u64 },
    /// Answers 200 at the head, then reads the body and applies it if it arrives whole.
    Early200,
    /// Answers 413 at the head and closes without reading the body; applies nothing.
    Early413,
    /// Reads `bytes` of the body and closes without an answer, unless the whole body has
    /// arrived by then (then as `None`).
    CloseMidBody { bytes: usize },
    /// Answers 200 at the head, reads `bytes` of the body and closes, unless the whole body has
    /// arrived by then (then as `Early200`).
    Early200ThenClose { bytes: usize },
}

impl Fault {
    pub fn header_value(self) -> String {
        match self {
            Fault::None => "none".into(),
            Fault::Slow { ms } => format!("slow:{ms}"),
            Fault::Early200 => "early-200".into(),
            Fault::Early413 => "early-413".into(),
            Fault::CloseMidBody { bytes } => format!("close:{bytes}"),
            Fault::Early200ThenClose { bytes } => format!("early-200-close:{bytes}"),
        }
    }

    fn parse(v: &str) -> Fault {
        let (name, arg) = v.split_once(':').unwrap_or((v, ""));
        let n = arg.parse().unwrap_or(0);
        match name {
            "slow" => Fault::Slow { ms: n },
            "early-200" => Fault::Early200,
            "early-413" => Fault::Early413,
            "close" => Fault::CloseMidBody { bytes: n as usize },
            "early-200-close" => Fault::Early200ThenClose { bytes: n as usize },
            _ => Fault::None,
        }
    }
}

/// One write the upstream applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppliedWrite {
    pub resource: String,
    pub token: u64,
    pub write_id: u64,
}

/// The running upstream; stops accepting when dropped.
pub struct FaultUpstream {
    pub addr: SocketAddr,
    applied: Arc<Mutex<Vec<AppliedWrite>>>,
    /// Write ids whose request head arrived (whether or not the write was then applied).
    heads: Arc<Mutex<Vec<u64>>>,
    shutdown: CancellationToken,
}

impl FaultUpstream {
    pub async fn start() -> anyhow::Result<FaultUpstream> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let applied = Arc::new(Mutex::new(Vec::new()));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let shutdown = CancellationToken::new();
        let (log, seen, stop) = (applied.clone(), heads.clone(), shutdown.clone());
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    _ = stop.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                };
                tokio::spawn(connection(stream, log.clone(), seen.clone()));
            }
        });
        Ok(FaultUpstream {
            addr,
            applied,
            heads,
            shutdown,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every write applied so far, in order.
    pub fn applied(&self) -> Vec<AppliedWrite> {
        self.applied.lock().unwrap().clone()
    }

    /// Whether the head of write `id` has arrived.
    pub fn saw_head(&self, id: u64) -> bool {
        self.heads.lock().unwrap().contains(&id)
    }
}

impl Drop for FaultUpstream {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";

async fn connection(
    mut stream: TcpStream,
    log: Arc<Mutex<Vec<AppliedWrite>>>,
    heads: Arc<Mutex<Vec<u64>>>,
) {
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let Some(head) = crate::http_upstream::read_raw_head(&mut stream, &mut buf).await else {
            return;
        };
        let header = |name: &str| crate::http_upstream::raw_header(&head, name);
        let length: usize = header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let fault = header(FAULT_HEADER).map_or(Fault::None, |v| Fault::parse(&v));
        let write = AppliedWrite {
            resource: header("lock-resource").unwrap_or_default(),
            token: header("fencing-token")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            write_id: header(WRITE_ID_HEADER)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
        };
        heads.lock().unwrap().push(write.write_id);
        let early = matches!(
            fault,
            Fault::Early200 | Fault::Early200ThenClose { .. } | Fault::Early413
        );
        if early {
            let answer: &[u8] = if fault == Fault::Early413 {
                b"HTTP/1.1 413 Content Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            } else {
                OK
            };
            if stream.write_all(answer).await.is_err() || fault == Fault::Early413 {
                return;
            }
        }
        let read_max = match fault {
            Fault::CloseMidBody { bytes } | Fault::Early200ThenClose { bytes } => {
                bytes.min(length.saturating_sub(1))
            }
            _ => length,
        };
        while buf.len() < read_max {
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        if buf.len() < length {
            // Close mid-body: the write is not applied. (When the whole body has already
            // arrived, there is no "mid-body" left: the write is applied as usual, since an
            // upstream that has the request and drops it after a 200 is one no proxy can check.)
            return;
        }
        buf.drain(..length);
        if let Fault::Slow { ms } = fault {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if !write.resource.is_empty() {
            log.lock().unwrap().push(write);
        }
        if !early && stream.write_all(OK).await.is_err() {
            return;
        }
    }
}

/// What a raw client saw of its write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RawOutcome {
    /// A response head arrived: its status and `Fence-Proxy-Error` reason.
    Answered {
        status: u16,
        proxy_error: Option<String>,
    },
    /// No response: the connection broke or the wait timed out.
    Broken(String),
}

/// A PUT of `pieces` (sent one after another with `pause` between them) to `addr` with these
/// extra headers, over a connection of its own. The response is read while the body is still
/// being sent, as a client that reacts to an early answer does.
///
/// `sent` is told when the head and first piece have been written (to time a kill mid-body).
pub async fn put(
    addr: SocketAddr,
    headers: &[(&str, String)],
    pieces: &[Vec<u8>],
    pause: Duration,
    sent: Option<tokio::sync::oneshot::Sender<()>>,
) -> RawOutcome {
    let stream = match TcpStream::connect(addr).await {
        Ok(s) => s,
        Err(e) => return RawOutcome::Broken(format!("connect: {e}")),
    };
    let (mut rd, mut wr) = stream.into_split();
    let length: usize = pieces.iter().map(Vec::len).sum();
    let mut head = format!(
        "PUT /obj HTTP/1.1\r\nhost: {addr}\r\ncontent-length: {length}\r\nconnection: close\r\n"
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let pieces = pieces.to_vec();
    let writer = tokio::spawn(async move {
        let mut sent = sent;
        if wr.write_all(head.as_bytes()).await.is_err() {
            return None;
        }
        for (i, piece) in pieces.iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(pause).await;
            }
            if wr.write_all(piece).await.is_err() {
                return None;
            }
            if let Some(tx) = sent.take() {
                let _ = tx.send(());
            }
        }
        // The write half stays open until the reader is done: a half-close could end the
        // exchange early on some servers.
        Some(wr)
    });
    let read = async {
        let mut buf = Vec::new();
        loop {
            if let Some(i) = buf.windows(4).position(|w: &[u8]| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..i]).into_owned();
                let status = head
                    .split_whitespace()
                    .nth(1)
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                let proxy_error = head.lines().find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.trim()
                        .eq_ignore_ascii_case("fence-proxy-error")
                        .then(|| v.trim().to_owned())
                });
                return RawOutcome::Answered {
                    status,
                    proxy_error,
                };
            }
            let mut chunk = [0u8; 4096];
            match rd.read(&mut chunk).await {
                Ok(0) => return RawOutcome::Broken("closed before a response".into()),
                Err(e) => return RawOutcome::Broken(format!("read: {e}")),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    };
    let outcome = tokio::time::timeout(CLIENT_TIMEOUT, read)
        .await
        .unwrap_or_else(|_| RawOutcome::Broken(format!("no response within {CLIENT_TIMEOUT:?}")));
    // A client that got an early answer still sends the rest of its body, as HTTP/1.1 clients
    // do; only then does it close the connection.
    let _ = tokio::time::timeout(CLIENT_TIMEOUT, writer).await;
    outcome
}

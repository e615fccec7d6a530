//! The protected HTTP target of a chaos run: an in-process register that applies every write it
//! receives (it checks nothing itself, like most storage) and logs each applied write in order,
//! with the fencing token it carried. Also a minimal HTTP/1.1 client for the workload's writes.
//!
//! `PUT /reg/<anything>` with `Lock-Resource`, `Fencing-Token` and a body applies the write and
//! answers 200. Everything else answers 404.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::checker::Applied;

/// Largest request body the register reads.
const MAX_BODY_BYTES: usize = 64 * 1024;

pub struct Register {
    pub addr: SocketAddr,
    applied: Arc<Mutex<Vec<Applied>>>,
    stop: CancellationToken,
}

impl Register {
    pub async fn start(ip: std::net::IpAddr) -> anyhow::Result<Register> {
        let listener = TcpListener::bind((ip, 0)).await?;
        let addr = listener.local_addr()?;
        let applied = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let (a, s) = (applied.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let conn = tokio::select! {
                    _ = s.cancelled() => return,
                    c = listener.accept() => c,
                };
                if let Ok((stream, _)) = conn {
                    tokio::spawn(serve(stream, a.clone(), s.clone()));
                }
            }
        });
        Ok(Register {
            addr,
            applied,
            stop,
        })
    }

    /// The writes applied so far, in order.
    pub fn applied(&self) -> Vec<Applied> {
        self.applied.lock().unwrap().clone()
    }
}

impl Drop for Register {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn serve(stream: TcpStream, applied: Arc<Mutex<Vec<Applied>>>, stop: CancellationToken) {
    let mut reader = BufReader::new(stream);
    loop {
        let req = tokio::select! {
            _ = stop.cancelled() => return,
            r = read_request(&mut reader) => r,
        };
        let Ok(Some(req)) = req else { return };
        let status = if req.method == "PUT" && req.path.starts_with("/reg/") {
            match (req.header("lock-resource"), req.header("fencing-token")) {
                (Some(resource), Some(token)) => match token.parse::<u64>() {
                    Ok(token) => {
                        applied.lock().unwrap().push(Applied {
                            resource: resource.to_owned(),
                            token,
                            value: String::from_utf8_lossy(&req.body).into_owned(),
                        });
                        "200 OK"
                    }
                    Err(_) => "400 Bad Request",
                },
                _ => "400 Bad Request",
            }
        } else {
            "404 Not Found"
        };
        let close = req
            .header("connection")
            .is_some_and(|c| c.eq_ignore_ascii_case("close"));
        let reply = format!(
            "HTTP/1.1 {status}\r\nContent-Length: 0\r\n{}\r\n",
            if close { "Connection: close\r\n" } else { "" }
        );
        if reader.get_mut().write_all(reply.as_bytes()).await.is_err() || close {
            return;
        }
    }
}

struct Request {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Reads one HTTP/1.1 request (Content-Length or chunked body); `None` at a clean end of stream.
async fn read_request<R: tokio::io::AsyncBufRead + Unpin>(
    r: &mut R,
) -> anyhow::Result<Option<Request>> {
    let mut line = String::new();
    if r.read_line(&mut line).await? == 0 {
        return Ok(None);
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_owned();
    let path = parts.next().unwrap_or_default().to_owned();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).await? == 0 {
            anyhow::bail!("end of stream in headers");
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((n, v)) = h.split_once(':') {
            headers.push((n.trim().to_owned(), v.trim().to_owned()));
        }
    }
    let mut req = Request {
        method,
        path,
        headers,
        body: Vec::new(),
    };
    if let Some(len) = req.header("content-length") {
        let len: usize = len.parse()?;
        anyhow::ensure!(len <= MAX_BODY_BYTES, "body of {len} bytes");
        let mut body = vec![0u8; len];
        r.read_exact(&mut body).await?;
        req.body = body;
    } else if req
        .header("transfer-encoding")
        .is_some_and(|t| t.eq_ignore_ascii_case("chunked"))
    {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).await?;
            let size = usize::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16)?;
            anyhow::ensure!(
                req.body.len() + size <= MAX_BODY_BYTES,
                "chunked body too large"
            );
            let mut chunk = vec![0u8; size + 2];
            r.read_exact(&mut chunk).await?;
            if size == 0 {
                break;
            }
            req.body.extend_from_slice(&chunk[..size]);
        }
    }
    Ok(Some(req))
}

/// The result of one write as the client saw it.
#[derive(Debug)]
pub enum WriteResult {
    /// The HTTP status and the `Fence-Proxy-Error` header, if any.
    Status(u16, Option<String>),
    /// No complete reply: sent or not, the outcome is unknown.
    NoReply(String),
}

/// `PUT /reg/<resource>` to `addr` with the fence headers, one connection per write.
pub async fn put(
    addr: SocketAddr,
    resource: &str,
    token: u64,
    value: &str,
    timeout: Duration,
) -> WriteResult {
    let attempt = async {
        let mut s = TcpStream::connect(addr).await?;
        let path: String = resource
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let req = format!(
            "PUT /reg/{path} HTTP/1.1\r\nHost: {addr}\r\nLock-Resource: {resource}\r\nFencing-Token: {token}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{value}",
            value.len()
        );
        s.write_all(req.as_bytes()).await?;
        let mut reply = Vec::new();
        s.read_to_end(&mut reply).await?;
        let text = String::from_utf8_lossy(&reply);
        let status: u16 = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("malformed reply {text:?}"))?;
        let head = text.split("\r\n\r\n").next().unwrap_or_default();
        let error = head.lines().find_map(|l| {
            l.split_once(':')
                .filter(|(n, _)| n.trim().eq_ignore_ascii_case("fence-proxy-error"))
                .map(|(_, v)| v.trim().to_owned())
        });
        anyhow::Ok(WriteResult::Status(status, error))
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => WriteResult::NoReply(e.to_string()),
        Err(_) => WriteResult::NoReply(format!("no reply within {timeout:?}")),
    }
}

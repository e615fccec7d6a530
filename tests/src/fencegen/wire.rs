//! A raw Postgres frontend over a `TcpStream`: it sends exactly the generated messages (encoded
//! with postgres-protocol's frontend encoders) and reads the backend's answers only as far as
//! counting ReadyForQuery and errors, so that nothing a driver would normalise gets in the way.

use std::time::Duration;

use bytes::{BufMut, BytesMut};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::blocks::Step;

/// Longest backend message the generator reads; larger ones mean something is broken.
const BACKEND_MESSAGE_MAX_BYTES: usize = 16 * 1024 * 1024;

/// What a session saw.
#[derive(Debug, Default, Clone, Copy)]
pub struct Seen {
    pub errors: u64,
    pub ready: u64,
    /// The session stopped answering (or closed) before every expected ReadyForQuery came.
    pub stuck: bool,
}

pub struct RawSession {
    stream: TcpStream,
    /// Where the session connected (CancelRequests go there too).
    addr: String,
    /// BackendKeyData: process ID and secret key.
    backend_key: Option<(i32, i32)>,
    pending: BytesMut,
    /// ReadyForQuery messages expected but not yet read.
    expected_ready: u64,
    pub seen: Seen,
}

impl RawSession {
    /// Connects and authenticates (trust) with the given startup parameters.
    pub async fn connect(
        addr: &str,
        params: &[(&str, &str)],
        timeout: Duration,
    ) -> anyhow::Result<RawSession> {
        let stream = tokio::time::timeout(timeout, TcpStream::connect(addr)).await??;
        let _ = stream.set_nodelay(true);
        let mut s = RawSession {
            stream,
            addr: addr.to_owned(),
            backend_key: None,
            pending: BytesMut::new(),
            expected_ready: 1,
            seen: Seen::default(),
        };
        let mut buf = BytesMut::new();
        frontend::startup_message(params.iter().copied(), &mut buf)?;
        s.stream.write_all(&buf).await?;
        s.settle(timeout).await;
        anyhow::ensure!(
            !s.seen.stuck && s.seen.errors == 0,
            "startup through {addr} failed ({:?})",
            s.seen
        );
        Ok(s)
    }

    /// Sends the steps; waits for the answers of every Query and Sync sent so far.
    pub async fn send(&mut self, steps: &[Step], timeout: Duration) -> anyhow::Result<()> {
        let mut buf = BytesMut::new();
        for step in steps {
            encode(step, &mut buf)?;
            if matches!(step, Step::Query(_) | Step::Sync) {
                self.expected_ready += 1;
            }
        }
        if self.stream.write_all(&buf).await.is_err() {
            self.seen.stuck = true;
            return Ok(());
        }
        for step in steps {
            if let (Step::Cancel { delay_us }, Some(key)) = (step, self.backend_key) {
                send_cancel(self.addr.clone(), key, Duration::from_micros(*delay_us));
            }
        }
        self.settle(timeout).await;
        Ok(())
    }

    /// Ends the session politely.
    pub async fn terminate(mut self) {
        let mut buf = BytesMut::new();
        frontend::terminate(&mut buf);
        let _ = self.stream.write_all(&buf).await;
        let _ = self.stream.shutdown().await;
        // Wait for the server to close, so that the session's backend is gone before the oracle.
        let mut sink = [0u8; 4096];
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while matches!(self.stream.read(&mut sink).await, Ok(n) if n > 0) {}
        })
        .await;
    }

    /// Reads until every expected ReadyForQuery arrived, the timeout passes, or the peer closes.
    async fn settle(&mut self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.expected_ready > 0 && !self.seen.stuck {
            match tokio::time::timeout_at(deadline, self.next_message()).await {
                Ok(Some(tag)) => match tag {
                    b'Z' => {
                        self.expected_ready -= 1;
                        self.seen.ready += 1;
                    }
                    b'E' => self.seen.errors += 1,
                    _ => {}
                },
                Ok(None) | Err(_) => self.seen.stuck = true,
            }
        }
    }

    /// The tag of the next backend message, `None` when the connection ended or broke.
    async fn next_message(&mut self) -> Option<u8> {
        loop {
            if self.pending.len() >= 5 {
                let len = i32::from_be_bytes([
                    self.pending[1],
                    self.pending[2],
                    self.pending[3],
                    self.pending[4],
                ]);
                if len < 4 || len as usize > BACKEND_MESSAGE_MAX_BYTES {
                    return None;
                }
                let total = len as usize + 1;
                if self.pending.len() >= total {
                    let tag = self.pending[0];
                    let frame = self.pending.split_to(total);
                    if tag == b'K' && frame.len() >= 13 {
                        let word = |at: usize| {
                            i32::from_be_bytes([
                                frame[at],
                                frame[at + 1],
                                frame[at + 2],
                                frame[at + 3],
                            ])
                        };
                        self.backend_key = Some((word(5), word(9)));
                    }
                    return Some(tag);
                }
            }
            let mut chunk = [0u8; 8192];
            match self.stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.pending.extend_from_slice(&chunk[..n]),
            }
        }
    }
}

/// Sends a CancelRequest for `key` to `addr` after `delay`, on a thread of its own: the tokio
/// timer's resolution is a millisecond, and the cancel must be able to land inside the first
/// statements of a query.
fn send_cancel(addr: String, key: (i32, i32), delay: Duration) {
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        let until = std::time::Instant::now() + delay;
        while std::time::Instant::now() < until {
            std::hint::spin_loop();
        }
        let mut packet = BytesMut::new();
        frontend::cancel_request(key.0, key.1, &mut packet);
        if let Ok(mut stream) = std::net::TcpStream::connect(&addr) {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            if stream.write_all(&packet).is_ok() {
                let mut rest = Vec::new();
                let _ = stream.read_to_end(&mut rest);
            }
        }
    });
}

fn encode(step: &Step, buf: &mut BytesMut) -> std::io::Result<()> {
    match step {
        Step::Query(sql) => frontend::query(sql, buf)?,
        Step::Parse { name, sql } => frontend::parse(name, sql, std::iter::empty(), buf)?,
        Step::Bind { portal, statement } => {
            // No parameters, default formats: encoded by hand, postgres-protocol's `bind`
            // needs a value serializer even for none.
            let mut body = BytesMut::new();
            body.put_slice(portal.as_bytes());
            body.put_u8(0);
            body.put_slice(statement.as_bytes());
            body.put_u8(0);
            body.put_i16(0);
            body.put_i16(0);
            body.put_i16(0);
            buf.put_u8(b'B');
            buf.put_i32(body.len() as i32 + 4);
            buf.put_slice(&body);
        }
        Step::Execute { portal } => frontend::execute(portal, 0, buf)?,
        Step::Sync => frontend::sync(buf),
        Step::Flush => frontend::flush(buf),
        Step::CopyData(data) => {
            buf.put_u8(b'd');
            buf.put_i32(data.len() as i32 + 4);
            buf.put_slice(data);
        }
        Step::CopyDone => frontend::copy_done(buf),
        Step::Raw(bytes) => buf.put_slice(bytes),
        // Sent on a connection of its own once the batch is written (see `send_cancel`).
        Step::Cancel { .. } => {}
    }
    Ok(())
}

//! What a connection to the gRPC port may hold, before anyone knows who is calling: a place among
//! at most [`CONNECTIONS_MAX`] (and [`CONNECTIONS_PER_SOURCE_MAX`] from one address; the members'
//! addresses, kept current with the membership, are never refused), and [`FIRST_BYTES_TIMEOUT`]
//! to start speaking. Without these, a client that opens sockets and sends nothing (or a TLS
//! handshake and nothing after it) held a task and a descriptor each for as long as it liked,
//! until the node ran out of descriptors and could neither accept its peers nor open its files.
//!
//! Once a connection speaks HTTP/2, the server's keepalive pings close it when its peer stops
//! answering (`node.rs`); a connection that answers pings but sends no call keeps its place, which
//! the per-source bound limits. A connection whose client leaves an answer untaken for
//! [`SEND_TIMEOUT`] (it grants no HTTP/2 flow-control window, yet answers pings) is closed, with
//! every call on it: each such answer holds its stream, task and buffers (about 9 KB), 1,024 per
//! connection.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use lockd_service_kit::admission::{SourceSlot, SourceSlots, TrustedSources};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// Connections open at once, from all sources; well under the 65,536 descriptors the packaged
/// unit allows, so the node keeps descriptors for its files and its peers.
pub const CONNECTIONS_MAX: usize = 16_384;
/// Connections open at once from one source address (members exempt). A client library keeps one
/// or a few HTTP/2 connections per process, each carrying many calls.
pub const CONNECTIONS_PER_SOURCE_MAX: usize = 256;
/// From accept to the connection's first byte of HTTP/2 (after the TLS handshake, under TLS).
pub const FIRST_BYTES_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the members' names are resolved again for the exemption when the membership did
/// not change (a member back on another IP under its name); a change is applied at once.
pub const TRUST_REFRESH: Duration = Duration::from_secs(10);

/// How long an answer may wait for its client to take it (HTTP/2 flow control) before the node
/// closes the connection, as nginx's `send_timeout`. Checked whenever the connection reads or
/// writes, which its keepalive pings make happen at least every 20 s.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// The connection places of one node's gRPC port.
pub(crate) fn slots(members: TrustedSources) -> SourceSlots {
    SourceSlots::new(CONNECTIONS_MAX, CONNECTIONS_PER_SOURCE_MAX, members)
}

/// The answers of one connection its client has not taken yet: since when each has waited.
/// A call's answer body registers itself ([`Untaken::answer`]) and says when hyper has taken
/// each frame; the connection ([`Admitted`]) looks at the oldest.
#[derive(Default)]
pub(crate) struct Untaken {
    waiting_since: Mutex<HashMap<u64, Instant>>,
    next_id: AtomicU64,
}

/// The open connections' [`Untaken`], by (local, remote) address, for the services, which see a
/// call's addresses but not its connection.
static OPEN: LazyLock<Mutex<HashMap<ConnectionKey, Weak<Untaken>>>> = LazyLock::new(Mutex::default);

/// A connection's (local, remote) addresses.
type ConnectionKey = (SocketAddr, SocketAddr);

impl Untaken {
    /// The answers of the open connection between `local` and `remote`, if it is one of
    /// [`Admitted`]'s.
    pub(crate) fn of(local: SocketAddr, remote: SocketAddr) -> Option<Arc<Untaken>> {
        OPEN.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(local, remote))
            .and_then(Weak::upgrade)
    }

    /// A new answer, waiting from now until hyper first takes a frame of it.
    pub(crate) fn answer(self: &Arc<Self>) -> UntakenAnswer {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(id, Instant::now());
        UntakenAnswer {
            of: self.clone(),
            id,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Instant>> {
        self.waiting_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// How long the answer waiting longest has waited.
    fn longest_wait(&self) -> Option<Duration> {
        self.lock().values().min().map(Instant::elapsed)
    }
}

/// One answer of an [`Untaken`]; its wait ends when it is dropped.
pub(crate) struct UntakenAnswer {
    of: Arc<Untaken>,
    id: u64,
}

impl UntakenAnswer {
    /// The answer gave hyper a frame: it waits until hyper comes back for the next, which it does
    /// once the frame is on its way.
    pub(crate) fn yielded(&self) {
        self.of.lock().insert(self.id, Instant::now());
    }

    /// hyper is reading the answer (it waits for its own data, or has ended).
    pub(crate) fn polled(&self) {
        self.of.lock().remove(&self.id);
    }
}

impl Drop for UntakenAnswer {
    fn drop(&mut self) {
        self.polled();
    }
}

/// A connection with its place, given back when the connection is dropped, the deadline for its
/// first byte, and its untaken answers.
pub(crate) struct Admitted<S> {
    io: S,
    _slot: SourceSlot,
    /// Until the first byte arrives: reads fail with `TimedOut` once it has passed, so the server
    /// drops the connection.
    first_bytes: Option<Pin<Box<tokio::time::Sleep>>>,
    /// With the (local, remote) addresses it is registered under in [`OPEN`].
    untaken: Option<(ConnectionKey, Arc<Untaken>)>,
}

impl<S> Admitted<S> {
    /// `io` holding `slot`; it must read its first byte by `deadline`. `addresses` (local, remote)
    /// register it for the services to find its [`Untaken`].
    pub(crate) fn new(
        io: S,
        slot: SourceSlot,
        deadline: tokio::time::Instant,
        addresses: Option<ConnectionKey>,
    ) -> Self {
        let untaken = addresses.map(|key| {
            let untaken = Arc::new(Untaken::default());
            OPEN.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(key, Arc::downgrade(&untaken));
            (key, untaken)
        });
        Admitted {
            io,
            _slot: slot,
            first_bytes: Some(Box::pin(tokio::time::sleep_until(deadline))),
            untaken,
        }
    }

    /// An error that closes the connection if an answer has waited for the client longer than
    /// [`SEND_TIMEOUT`].
    fn answers_overdue(&self) -> Option<io::Error> {
        let (_, untaken) = self.untaken.as_ref()?;
        let waited = untaken.longest_wait()?;
        (waited > SEND_TIMEOUT).then(|| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the client has not taken an answer for {} s",
                    SEND_TIMEOUT.as_secs()
                ),
            )
        })
    }
}

impl<S> Drop for Admitted<S> {
    fn drop(&mut self) {
        if let Some((key, untaken)) = &self.untaken {
            let mut open = OPEN.lock().unwrap_or_else(PoisonError::into_inner);
            // Only this connection's entry: another with the same addresses may follow it.
            if open
                .get(key)
                .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(untaken)))
            {
                open.remove(key);
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Admitted<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(overdue) = this.answers_overdue() {
            return Poll::Ready(Err(overdue));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Some(deadline) = &mut this.first_bytes {
            match &polled {
                Poll::Ready(Ok(())) if buf.filled().len() > before => this.first_bytes = None,
                Poll::Pending if deadline.as_mut().poll(cx).is_ready() => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "no request within {} s of connecting",
                            FIRST_BYTES_TIMEOUT.as_secs()
                        ),
                    )));
                }
                _ => {}
            }
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Admitted<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        if let Some(overdue) = self.answers_overdue() {
            return Poll::Ready(Err(overdue));
        }
        Pin::new(&mut self.get_mut().io).poll_write(cx, b)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if let Some(overdue) = self.answers_overdue() {
            return Poll::Ready(Err(overdue));
        }
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// The server sees what it saw of the connection itself (address, TLS certificates).
impl<S: Connected> Connected for Admitted<S> {
    type ConnectInfo = S::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// Logs a refusal at most once per 10 s (a flood must not flood the log too).
pub(crate) struct RefusalLog(Option<std::time::Instant>);

impl RefusalLog {
    pub(crate) fn new() -> Self {
        RefusalLog(None)
    }
    pub(crate) fn refused(
        &mut self,
        what: &str,
        remote: std::net::SocketAddr,
        why: &dyn std::fmt::Display,
    ) {
        if self.0.is_none_or(|t| t.elapsed().as_secs() >= 10) {
            self.0 = Some(std::time::Instant::now());
            tracing::warn!(%remote, "lockd: {what} refused: {why}; closing such connections (logged once per 10 s)");
        }
    }
}

/// Accepts plaintext connections on `listener`, each with a place from `slots` (others are closed
/// at once), Nagle off. Accept errors (out of descriptors, mostly) back off instead of spinning.
pub(crate) fn plain_incoming(
    listener: tokio::net::TcpListener,
    slots: SourceSlots,
    shutdown: tokio_util::sync::CancellationToken,
) -> impl futures::Stream<Item = io::Result<Admitted<tokio::net::TcpStream>>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let mut log = RefusalLog::new();
        loop {
            let (stream, remote) = tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "lockd: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let slot = match slots.admit(remote.ip()) {
                Ok(slot) => slot,
                Err(why) => {
                    log.refused("connection", remote, &why);
                    continue;
                }
            };
            // With Nagle on, a small reply waits for the peer's delayed ACK (40 ms).
            let _ = stream.set_nodelay(true);
            let deadline = tokio::time::Instant::now() + FIRST_BYTES_TIMEOUT;
            let addresses = stream.local_addr().ok().map(|local| (local, remote));
            if tx
                .send(Ok(Admitted::new(stream, slot, deadline, addresses)))
                .await
                .is_err()
            {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

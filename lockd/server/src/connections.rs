//! What a connection to the gRPC port may hold, before anyone knows who is calling: a place among
//! at most [`CONNECTIONS_MAX`] (and [`CONNECTIONS_PER_SOURCE_MAX`] from one address; the members'
//! addresses, kept current with the membership, are never refused), and [`FIRST_BYTES_TIMEOUT`]
//! to start speaking. Without these, a client that opens sockets and sends nothing (or a TLS
//! handshake and nothing after it) held a task and a descriptor each for as long as it liked,
//! until the node ran out of descriptors and could neither accept its peers nor open its files.
//!
//! Once a connection speaks HTTP/2, the server's keepalive pings close it when its peer stops
//! answering (`node.rs`); a connection that answers pings but sends no call keeps its place, which
//! the per-source bound limits. A connection is closed, with every call on it, once its client
//! has taken nothing for [`SEND_TIMEOUT`] while the node had something for it: an answer hyper
//! waits to hand to HTTP/2 (the client grants no flow-control window, yet answers pings), a
//! window (a stream's or the connection's) the client keeps starved ([`crate::flow_watch`]), or
//! bytes its socket does not take (the client reads nothing, and may acknowledge the node's pings
//! without reading them: their payload is fixed). Each answer held that way keeps its stream and
//! buffers, 1,024 per connection.

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

use crate::flow_watch::{FlowWatch, STARVED_GRACE};

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

/// How long an answer may wait for its client to take it (HTTP/2 flow control), and a write for
/// the socket to take a byte, before the node closes the connection, as nginx's `send_timeout`.
/// Checked whenever the connection reads or writes, which its keepalive pings make happen at
/// least every 20 s; a blocked write wakes the connection when it has waited this long.
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

/// What the services may need of an open connection, which they see only through a call's
/// addresses.
#[derive(Default)]
pub(crate) struct Open {
    /// The answers its client has not taken yet.
    pub(crate) untaken: Arc<Untaken>,
    /// The uid that owns the socket at the other end, looked up when a call first needs it (an
    /// internal service on a plaintext loopback port, `crate::local_peer`), then kept: a socket's
    /// owner never changes. A lookup that failed is not kept: the next call asks again.
    pub(crate) owner: tokio::sync::OnceCell<u32>,
}

/// The open connections' [`Open`] state, by (local, remote) address.
static OPEN: LazyLock<Mutex<HashMap<ConnectionKey, Weak<Open>>>> = LazyLock::new(Mutex::default);

/// A connection's (local, remote) addresses.
type ConnectionKey = (SocketAddr, SocketAddr);

impl Open {
    /// The state of the open connection between `local` and `remote`, if it is one of
    /// [`Admitted`]'s.
    pub(crate) fn of(local: SocketAddr, remote: SocketAddr) -> Option<Arc<Open>> {
        OPEN.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(local, remote))
            .and_then(Weak::upgrade)
    }
}

impl Untaken {
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
    /// Its state for the services, with the (local, remote) addresses it is registered under in
    /// [`OPEN`].
    open: Option<(ConnectionKey, Arc<Open>)>,
    /// The HTTP/2 windows the client grants.
    flow: FlowWatch,
    /// Since the socket last took a byte, while the node has bytes for it: fires at
    /// [`SEND_TIMEOUT`].
    write_blocked: Option<Pin<Box<tokio::time::Sleep>>>,
    /// While a window is starved: wakes the connection to look at it again.
    starving_check: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> Admitted<S> {
    /// `io` holding `slot`; it must read its first byte by `deadline`. `addresses` (local, remote)
    /// register it for the services to find its [`Open`] state.
    pub(crate) fn new(
        io: S,
        slot: SourceSlot,
        deadline: tokio::time::Instant,
        addresses: Option<ConnectionKey>,
    ) -> Self {
        let open = addresses.map(|key| {
            let open = Arc::new(Open::default());
            OPEN.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(key, Arc::downgrade(&open));
            (key, open)
        });
        Admitted {
            io,
            _slot: slot,
            first_bytes: Some(Box::pin(tokio::time::sleep_until(deadline))),
            open,
            flow: FlowWatch::new(),
            write_blocked: None,
            starving_check: None,
        }
    }

    /// While a window is starved, a timer that wakes the connection every [`STARVED_GRACE`] to
    /// look at it again (the DATA that starves it may be the last thing the connection does); an
    /// error that closes the connection once it is overdue.
    fn look_again_while_starving(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        while self.flow.starving() {
            let check = self
                .starving_check
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(STARVED_GRACE)));
            if check.as_mut().poll(cx).is_pending() {
                return None;
            }
            self.starving_check = None;
            if let Some(overdue) = self.answers_overdue() {
                return Some(overdue);
            }
        }
        None
    }

    /// An error that closes the connection if an answer has waited for the client longer than
    /// [`SEND_TIMEOUT`], or the client has kept a window starved that long.
    fn answers_overdue(&mut self) -> Option<io::Error> {
        if let Some(starved) = self.flow.overdue(SEND_TIMEOUT) {
            return Some(io::Error::new(io::ErrorKind::TimedOut, starved.to_string()));
        }
        let (_, open) = self.open.as_ref()?;
        let waited = open.untaken.longest_wait()?;
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

impl<S: ResetOnClose> Admitted<S> {
    /// Notes how a write went: bytes taken end a wait; `Pending` starts one (or goes on with
    /// it), and fails the write once it has lasted [`SEND_TIMEOUT`]. The timer wakes the
    /// connection then, even if nothing else does.
    fn note_write<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
        took: bool,
    ) -> Poll<io::Result<T>> {
        match polled {
            Poll::Pending => {
                let blocked = self
                    .write_blocked
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(SEND_TIMEOUT)));
                if blocked.as_mut().poll(cx).is_ready() {
                    // A reset, not a FIN: a closed socket would keep its unsent bytes for a
                    // client that reads nothing until the kernel gave up on it.
                    self.io.reset_on_close();
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "the client's socket has taken no byte for {} s",
                            SEND_TIMEOUT.as_secs()
                        ),
                    )));
                }
                Poll::Pending
            }
            Poll::Ready(Ok(value)) => {
                if took {
                    self.write_blocked = None;
                }
                Poll::Ready(Ok(value))
            }
            ready @ Poll::Ready(Err(_)) => ready,
        }
    }
}

/// A connection the node can end with a reset instead of a FIN.
pub(crate) trait ResetOnClose {
    fn reset_on_close(&self);
}

impl ResetOnClose for tokio::net::TcpStream {
    fn reset_on_close(&self) {
        let _ = self.set_zero_linger();
    }
}

impl ResetOnClose for tokio_rustls::server::TlsStream<tokio::net::TcpStream> {
    fn reset_on_close(&self) {
        let _ = self.get_ref().0.set_zero_linger();
    }
}

impl<S> Drop for Admitted<S> {
    fn drop(&mut self) {
        if let Some((key, state)) = &self.open {
            let mut open = OPEN.lock().unwrap_or_else(PoisonError::into_inner);
            // Only this connection's entry: another with the same addresses may follow it.
            if open
                .get(key)
                .is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(state)))
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
        match &polled {
            Poll::Ready(Ok(())) => this.flow.read(&buf.filled()[before..]),
            // Nothing moves on the connection: a starved window is looked at again regardless.
            Poll::Pending => {
                if let Some(overdue) = this.look_again_while_starving(cx) {
                    return Poll::Ready(Err(overdue));
                }
            }
            Poll::Ready(Err(_)) => {}
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin + ResetOnClose> AsyncWrite for Admitted<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Some(overdue) = this.answers_overdue() {
            return Poll::Ready(Err(overdue));
        }
        let polled = Pin::new(&mut this.io).poll_write(cx, b);
        if let Poll::Ready(Ok(n)) = polled {
            this.flow.wrote(&b[..n]);
            if let Some(overdue) = this.look_again_while_starving(cx) {
                return Poll::Ready(Err(overdue));
            }
        }
        let took = matches!(polled, Poll::Ready(Ok(n)) if n > 0);
        this.note_write(cx, polled, took)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Some(overdue) = this.answers_overdue() {
            return Poll::Ready(Err(overdue));
        }
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = polled {
            this.flow.wrote_vectored(bufs, n);
            if let Some(overdue) = this.look_again_while_starving(cx) {
                return Poll::Ready(Err(overdue));
            }
        }
        let took = matches!(polled, Poll::Ready(Ok(n)) if n > 0);
        this.note_write(cx, polled, took)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_flush(cx);
        // A finished flush means the socket took everything (a TLS stream's records too).
        this.note_write(cx, polled, true)
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

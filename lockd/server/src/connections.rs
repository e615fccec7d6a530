//! What a connection to the gRPC port may hold, before anyone knows who is calling: a place among
//! at most [`CONNECTIONS_MAX`] (and [`CONNECTIONS_PER_SOURCE_MAX`] from one address; the members'
//! addresses, kept current with the membership, are never refused), and [`FIRST_BYTES_TIMEOUT`]
//! to start speaking. Without these, a client that opens sockets and sends nothing (or a TLS
//! handshake and nothing after it) held a task and a descriptor each for as long as it liked,
//! until the node ran out of descriptors and could neither accept its peers nor open its files.
//!
//! Once a connection speaks HTTP/2, the server's keepalive pings close it when its peer stops
//! answering (`node.rs`); a connection that answers pings but sends no call keeps its place, which
//! the per-source bound limits.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

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

/// The connection places of one node's gRPC port.
pub(crate) fn slots(members: TrustedSources) -> SourceSlots {
    SourceSlots::new(CONNECTIONS_MAX, CONNECTIONS_PER_SOURCE_MAX, members)
}

/// A connection with its place, given back when the connection is dropped, and the deadline for
/// its first byte.
pub(crate) struct Admitted<S> {
    io: S,
    _slot: SourceSlot,
    /// Until the first byte arrives: reads fail with `TimedOut` once it has passed, so the server
    /// drops the connection.
    first_bytes: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> Admitted<S> {
    /// `io` holding `slot`; it must read its first byte by `deadline`.
    pub(crate) fn new(io: S, slot: SourceSlot, deadline: tokio::time::Instant) -> Self {
        Admitted {
            io,
            _slot: slot,
            first_bytes: Some(Box::pin(tokio::time::sleep_until(deadline))),
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
        Pin::new(&mut self.get_mut().io).poll_write(cx, b)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
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
            if tx
                .send(Ok(Admitted::new(stream, slot, deadline)))
                .await
                .is_err()
            {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

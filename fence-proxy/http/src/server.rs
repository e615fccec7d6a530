//! Accepting connections, and shutting down without leaving a resource locked.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use fence_epoch_store::EpochStore;
use fence_proxy_net::{ConnectionThreads, TlsReloader};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use lockd_service_kit::admission::{SourceSlots, TrustedSources};
use lockd_service_kit::checks::Readiness;
use lockd_service_kit::flow_watch::FlowWatch;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceBuilder;
use tower::limit::ConcurrencyLimitLayer;
use tower_http::trace::TraceLayer;

use crate::per_client::{ClientsInFlight, PerClient};
use crate::tls::Access;
use crate::{Args, Proxy, ProxyConfig};

/// How long shutdown waits for requests in flight: long enough for a forward that is already
/// waiting on a slow upstream to end, after which the permits of the ones left are released as
/// unknown (quarantine) by their drop.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// A connection's timeouts, from [`Limits`].
#[derive(Clone, Copy, Debug)]
struct Timeouts {
    header_read: Duration,
    idle: Duration,
    send: Duration,
}

/// When the watchdog of [`serve_connection`] looks at its connection: often enough for the
/// shortest timeout to fire close to its time.
fn watch_tick(t: Timeouts) -> Duration {
    (t.header_read.min(t.idle).min(t.send) / 4)
        .clamp(Duration::from_millis(20), Duration::from_secs(1))
}

/// "Never" in [`Activity`]'s fields.
const NEVER: u64 = u64::MAX;

/// What a connection's watchdog reads, in milliseconds since the connection was opened.
struct Activity {
    opened: std::time::Instant,
    /// When the last request's head arrived; [`NEVER`] before the first.
    last_request_ms: AtomicU64,
    /// Since when a write to the client has waited for it to read; [`NEVER`] while none waits.
    write_blocked_ms: AtomicU64,
    unpolled: Mutex<Unpolled>,
    /// The HTTP/2 windows the client grants: hyper hands a response's chunk to h2 whole once
    /// its stream may take one byte, so a client granting 1-byte windows would leave every
    /// response in h2, finished in the proxy's eyes.
    flow: Mutex<FlowWatch>,
}

impl Activity {
    /// `send_timeout` is also the grace of the window watch: a client's small windows starve each
    /// stream of a large body for a round trip, legitimately.
    fn new(send_timeout: Duration) -> Self {
        Activity {
            opened: std::time::Instant::now(),
            last_request_ms: AtomicU64::new(NEVER),
            write_blocked_ms: AtomicU64::new(NEVER),
            unpolled: Mutex::default(),
            flow: Mutex::new(FlowWatch::with_grace(send_timeout)),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(NEVER - 1)
    }

    /// How long ago `at` was set, if it is.
    fn since(&self, at: &AtomicU64) -> Option<Duration> {
        let at = at.load(Ordering::Relaxed);
        (at != NEVER).then(|| Duration::from_millis(self.now_ms().saturating_sub(at)))
    }
}

/// Response bodies of a connection that yielded a frame hyper has not come back for yet: when
/// each yielded it, in milliseconds since the connection opened. hyper polls a body again once
/// the frame is on its way; over HTTP/2 a client that grants no flow-control window (and answers
/// pings) leaves it unpolled without a single blocked write to the socket.
#[derive(Default)]
struct Unpolled {
    next_id: u64,
    yielded_ms: std::collections::HashMap<u64, u64>,
}

impl Activity {
    /// How long the body hyper has left unpolled longest has waited, if any has.
    fn longest_unpolled(&self) -> Option<Duration> {
        let unpolled = self.unpolled.lock().unwrap_or_else(PoisonError::into_inner);
        let oldest = unpolled.yielded_ms.values().min().copied()?;
        Some(Duration::from_millis(self.now_ms().saturating_sub(oldest)))
    }
}

/// A response body that tells [`Activity`] when it has yielded a frame and when hyper comes back
/// for the next.
struct WatchedBody<B> {
    inner: B,
    id: u64,
    activity: Arc<Activity>,
}

impl<B> WatchedBody<B> {
    fn new(inner: B, activity: Arc<Activity>) -> Self {
        let id = {
            let mut unpolled = activity
                .unpolled
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            unpolled.next_id += 1;
            unpolled.next_id
        };
        WatchedBody {
            inner,
            id,
            activity,
        }
    }

    fn unpolled(&self) -> std::sync::MutexGuard<'_, Unpolled> {
        self.activity
            .unpolled
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl<B: http_body::Body + Unpin> http_body::Body for WatchedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        let now = this.activity.now_ms();
        let mut unpolled = this.unpolled();
        match &polled {
            Poll::Ready(Some(Ok(_))) => {
                unpolled.yielded_ms.insert(this.id, now);
            }
            _ => {
                unpolled.yielded_ms.remove(&this.id);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Drop for WatchedBody<B> {
    fn drop(&mut self) {
        self.unpolled().yielded_ms.remove(&self.id);
    }
}

/// The proxy's service for one connection: notes when each request arrives, and watches each
/// response body (see [`WatchedBody`]).
#[derive(Clone)]
struct Watch<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S, R, B> tower::Service<R> for Watch<S>
where
    S: tower::Service<R, Response = http::Response<B>>,
{
    type Response = http::Response<WatchedBody<B>>;
    type Error = S::Error;
    type Future = Watching<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        let a = &self.activity;
        a.last_request_ms.store(a.now_ms(), Ordering::Relaxed);
        Watching {
            inner: self.inner.call(request),
            activity: self.activity.clone(),
        }
    }
}

pin_project_lite::pin_project! {
    /// A response on its way, whose body [`Watch`] will watch.
    struct Watching<F> {
        #[pin]
        inner: F,
        activity: Arc<Activity>,
    }
}

impl<F, B, E> Future for Watching<F>
where
    F: Future<Output = Result<http::Response<B>, E>>,
{
    type Output = Result<http::Response<WatchedBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let activity = this.activity;
        this.inner.poll(cx).map(|done| {
            done.map(|response| response.map(|body| WatchedBody::new(body, activity.clone())))
        })
    }
}

/// The client's stream, telling [`Activity`] when a write to it blocks (the client reads
/// nothing and the socket buffer is full) and when writes go on.
struct Watched<I> {
    io: I,
    activity: Arc<Activity>,
}

impl<I> Watched<I> {
    fn note<T>(&self, polled: Poll<T>) -> Poll<T> {
        let blocked = &self.activity.write_blocked_ms;
        if polled.is_pending() {
            if blocked.load(Ordering::Relaxed) == NEVER {
                blocked.store(self.activity.now_ms(), Ordering::Relaxed);
            }
        } else {
            blocked.store(NEVER, Ordering::Relaxed);
        }
        polled
    }
}

impl<I> Watched<I> {
    fn flow(&self) -> std::sync::MutexGuard<'_, FlowWatch> {
        self.activity
            .flow
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            this.flow().read(&buf.filled()[before..]);
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            this.flow().wrote(&buf[..n]);
        }
        this.note(polled)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = polled {
            this.flow().wrote_vectored(bufs, n);
        }
        this.note(polled)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_flush(cx);
        this.note(polled)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// Serves one accepted connection (plain or TLS) until it ends, `drain` closes it gracefully, or
/// a watchdog closes it: no request head within the header read timeout of opening (hyper's
/// own header timer starts only once the protocol is known, so a client that sends nothing or a
/// few bytes of the HTTP/2 preface is closed here), no new request for the idle timeout
/// (gracefully: requests in flight end first; hyper never closes an idle HTTP/2 connection), or
/// a client that has read nothing of a response for the send timeout (at once: it would
/// otherwise hold the connection, the response and its upstream connection for good).
async fn serve_connection<I, S, B>(
    stream: I,
    peer: std::net::SocketAddr,
    service: S,
    builder: auto::Builder<TokioExecutor>,
    drain: CancellationToken,
    cut: CancellationToken,
    timeouts: Timeouts,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: tower::Service<http::Request<hyper::body::Incoming>, Response = http::Response<B>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Unpin + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let activity = Arc::new(Activity::new(timeouts.send));
    let connection_service = Watch {
        inner: service,
        activity: activity.clone(),
    };
    let stream = Watched {
        io: stream,
        activity: activity.clone(),
    };
    let connection = builder
        .serve_connection(
            TokioIo::new(stream),
            TowerToHyperService::new(connection_service),
        )
        .into_owned();
    tokio::pin!(connection);
    let mut tick = tokio::time::interval(watch_tick(timeouts));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut closing = false;
    let ended = loop {
        tokio::select! {
            ended = &mut connection => break ended,
            // The drain gave up: requests still here end now (write tasks run on apart).
            () = cut.cancelled() => return,
            () = drain.cancelled(), if !closing => {
                closing = true;
                connection.as_mut().graceful_shutdown();
            }
            _ = tick.tick() => {
                match activity.since(&activity.last_request_ms) {
                    None if activity.opened.elapsed() >= timeouts.header_read => {
                        tracing::debug!(%peer, "no request within the header read timeout; closing");
                        return;
                    }
                    Some(idle) if !closing && idle >= timeouts.idle => {
                        tracing::debug!(%peer, "no new request within the idle timeout; closing once requests in flight end");
                        closing = true;
                        connection.as_mut().graceful_shutdown();
                    }
                    _ => {}
                }
                let stalled = [
                    activity.since(&activity.write_blocked_ms),
                    activity.longest_unpolled(),
                ];
                if stalled.iter().flatten().any(|waited| *waited >= timeouts.send) {
                    tracing::debug!(%peer, "the client took no response data within the send timeout; closing");
                    return;
                }
                let starved = activity
                    .flow
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .overdue(timeouts.send);
                if let Some(starved) = starved {
                    tracing::debug!(%peer, %starved, "closing");
                    return;
                }
            }
        }
    };
    if let Err(e) = ended {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

/// HTTP/2 pings on a connection quiet this long...
const H2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// ...which must be answered within this.
const H2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Requests one HTTP/2 connection may have open at once (nginx's `http2_max_concurrent_streams`).
const H2_STREAMS_PER_CONNECTION_MAX: u32 = 128;

/// Pause after a failed `accept` (for example too many open files), so that the loop does not
/// spin while the condition lasts.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);

/// Bounds on what clients may hold of the server.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Requests handled at once; more wait for a free slot.
    pub max_in_flight: usize,
    /// Requests of one client address handled at once; more of them wait for its own.
    pub max_in_flight_per_client: usize,
    /// Client connections open at once; more wait in the kernel's accept backlog.
    pub max_connections: usize,
    /// Client connections one source address may hold at once; more are closed at once.
    pub max_connections_per_client: usize,
    /// Time a client has to send a complete request head (and, on a new connection, the first
    /// bytes that show its protocol); past it the connection is closed.
    pub header_read_timeout: Duration,
    /// Time a connection may go without a new request; past it the connection is closed once
    /// its requests in flight end.
    pub idle_timeout: Duration,
    /// Time a client may read nothing of a response; past it the connection is closed.
    pub send_timeout: Duration,
    /// Threads that serve client connections, each with an event loop of its own; 0: one per
    /// CPU.
    pub threads: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_in_flight: crate::args::DEFAULT_MAX_IN_FLIGHT as usize,
            max_in_flight_per_client: crate::args::default_per_client(
                crate::args::DEFAULT_MAX_IN_FLIGHT,
            ),
            max_connections: crate::args::DEFAULT_MAX_CONNECTIONS as usize,
            max_connections_per_client: crate::args::DEFAULT_MAX_CONNECTIONS_PER_CLIENT as usize,
            header_read_timeout: humantime::parse_duration(
                crate::args::DEFAULT_HEADER_READ_TIMEOUT,
            )
            .expect("the default header read timeout is a valid duration"),
            idle_timeout: humantime::parse_duration(crate::args::DEFAULT_IDLE_TIMEOUT)
                .expect("the default idle timeout is a valid duration"),
            send_timeout: humantime::parse_duration(crate::args::DEFAULT_SEND_TIMEOUT)
                .expect("the default send timeout is a valid duration"),
            threads: 0,
        }
    }
}

/// Opens the store, binds `--listen`, and serves until `shutdown` is cancelled. Certificates
/// are read once; [`run_with_reload`] lets the caller read them again.
pub async fn run(args: Args, shutdown: CancellationToken) -> anyhow::Result<()> {
    run_with_reload(args, shutdown, &TlsReloader::new(), None).await
}

/// [`run`], registering every TLS file it reads (`--tls-cert`, `--tls-key`, `--tls-client-ca`,
/// `--upstream-ca`) with `reloader`: after `reloader.reload()` new client connections and new
/// upstream connections use the files as they are then, established ones keep theirs. Once it
/// listens it starts `readiness`'s checks of the store and the upstream ([`crate::ready`]).
pub async fn run_with_reload(
    args: Args,
    shutdown: CancellationToken,
    reloader: &TlsReloader,
    readiness: Option<&Readiness>,
) -> anyhow::Result<()> {
    crate::metrics::describe();
    // Flag errors first: a bad flag is one line, not a warning and then the error.
    let access = args.tls.access()?;
    let upstream_tls = args.tls.upstream_tls(&args.upstream)?;
    access.register(reloader);
    if let Some(config) = &upstream_tls {
        reloader.add_client(config);
    }
    let store = args
        .store
        .open(&args.store_options())
        .with_context(|| format!("opening the epoch store {}", args.store))?;
    let verification =
        crate::Verification::from_flags(&args.verify_key, args.allow_unsigned, "http")?;
    let signed_only = verification.as_ref().is_some_and(|v| !v.allow_unsigned);
    if args.bind_resource != crate::ResourceBinding::Off && !signed_only {
        // With plain tokens a client names any resource it likes, so the binding keeps honest
        // clients apart and stops nobody else.
        tracing::warn!(
            bind_resource = %args.bind_resource,
            "--bind-resource without signed tokens only (--verify-key without --allow-unsigned): \
             a client can send a plain Lock-Resource for the path it writes and any token"
        );
    }
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding --listen {}", args.listen))?;
    tracing::info!(
        listen = %args.listen,
        upstream = %args.upstream,
        store = %args.store,
        tls = access.tls.is_some(),
        client_ca = args.tls.tls_client_ca.is_some(),
        allow_client = %access.allow,
        "fence-proxy http serving"
    );
    let limits = args.limits();
    if let Some(readiness) = readiness {
        readiness.start(
            crate::ready::checks(store.clone(), &args.upstream),
            shutdown.clone(),
        );
    }
    let config = ProxyConfig {
        upstream: args.upstream.with_tls(upstream_tls),
        upstream_timeout: args.upstream_timeout,
        verification: verification.map(Arc::new),
        resource_binding: args.bind_resource,
        reuse_after_body: args.upstream_reuse_after_body,
    };
    let served = serve_with_access(listener, store.clone(), config, limits, access, shutdown).await;
    // After the drain: the store saves what must outlive this process (the redb store: its
    // quarantines, and that it stopped cleanly). If it cannot, the next start assumes a crash.
    if let Err(e) = store.close().await {
        tracing::warn!(store = %args.store, error = %e, "the epoch store did not close cleanly");
    }
    served
}

/// Serves the proxy on `listener` with any [`EpochStore`] until `shutdown` is cancelled; this is
/// the entry point for a custom store (see `examples/examples/custom_epoch_store.rs`). The other
/// limits keep their defaults ([`Limits::default`]). It does not close the store: call
/// [`EpochStore::close`] once it has returned (the drain is over by then).
pub async fn serve(
    listener: TcpListener,
    store: Arc<dyn EpochStore>,
    config: ProxyConfig,
    max_in_flight: usize,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let limits = Limits {
        max_in_flight,
        max_in_flight_per_client: crate::args::default_per_client(max_in_flight as u64),
        ..Limits::default()
    };
    serve_with_limits(listener, store, config, limits, shutdown).await
}

/// [`serve`] with every limit chosen by the caller.
pub async fn serve_with_limits(
    listener: TcpListener,
    store: Arc<dyn EpochStore>,
    config: ProxyConfig,
    limits: Limits,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    serve_with_access(listener, store, config, limits, Access::default(), shutdown).await
}

/// [`serve_with_limits`] with TLS on the listener and a client allow-list.
pub async fn serve_with_access(
    listener: TcpListener,
    store: Arc<dyn EpochStore>,
    config: ProxyConfig,
    limits: Limits,
    access: Access,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let proxy = Proxy::new(config, store, limits.max_in_flight);
    let handler = proxy.clone();
    let service = ServiceBuilder::new()
        .layer(TraceLayer::new_for_http())
        .layer(ConcurrencyLimitLayer::new(limits.max_in_flight))
        .service_fn(move |request| handler.clone().handle(request));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // hyper runs this timer from the moment it waits for a request head, idle keep-alive
    // included, so a client that sends nothing or trickles a head is closed after it.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    // Pings find an HTTP/2 peer that is gone or paused (closed when one is not answered); a
    // connection carries at most this many requests at once, as nginx's default.
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(H2_KEEPALIVE_INTERVAL))
        .keep_alive_timeout(H2_KEEPALIVE_TIMEOUT)
        .max_concurrent_streams(H2_STREAMS_PER_CONNECTION_MAX);
    // Cancelled at shutdown: every connection closes gracefully (requests in flight end first).
    let drain = CancellationToken::new();
    // Cancelled when the drain gives up: connections still open are closed at once.
    let cut = CancellationToken::new();
    let connections = Arc::new(Semaphore::new(limits.max_connections));
    // Without a bound per address, one client holding `--max-connections` idle connections
    // (a header byte before each header read timeout) kept every other client in the backlog.
    let in_flight_per_client = ClientsInFlight::new(limits.max_in_flight_per_client);
    let per_client = SourceSlots::new(
        limits.max_connections,
        limits.max_connections_per_client,
        TrustedSources::default(),
    );
    // Each connection is served on one thread for its lifetime, requests and their upstream
    // connections included (see `upstream`): no hand-off between threads per request.
    let threads = ConnectionThreads::start(limits.threads, "fence-proxy-http")?;
    // Connection tasks, which the drain below waits for.
    let connection_tasks = TaskTracker::new();

    loop {
        // Wait for a free connection slot before accepting: past the cap, new connections wait
        // in the kernel's backlog instead of costing a task and buffers each.
        let slot = tokio::select! {
            _ = shutdown.cancelled() => break,
            slot = connections.clone().acquire_owned() => slot.expect("the semaphore is never closed"),
        };
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                    continue;
                }
            },
        };
        // Before TLS or any byte of a request: a client from outside the allow-list costs
        // nothing but this accept.
        if !access.allow.allows(peer.ip()) {
            // Debug, not info: one line per connection would let anyone flood the log.
            tracing::debug!(%peer, allow_client = %access.allow, "closing a client outside --allow-client");
            drop(stream);
            continue;
        }
        // Closed at once rather than left waiting: waiting, it would hold up the clients
        // behind it in the backlog.
        let place = match per_client.admit(peer.ip()) {
            Ok(place) => place,
            Err(why) => {
                // Debug, not info: one line per refused connection would let a client flood
                // the log.
                tracing::debug!(%peer, "closing a connection: {why} (--max-connections-per-client)");
                drop(stream);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        // Registered again on the thread that serves it.
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "cannot hand the connection to a connection thread");
                continue;
            }
        };
        let service = PerClient::new(service.clone(), in_flight_per_client.of(peer.ip()));
        let builder = builder.clone();
        let drain = drain.clone();
        let cut = cut.clone();
        // The configuration current at accept time: a reload reaches the next connection.
        let tls = access.tls.as_ref().map(|t| t.acceptor());
        let timeouts = Timeouts {
            header_read: limits.header_read_timeout,
            idle: limits.idle_timeout,
            send: limits.send_timeout,
        };
        threads.spawn(&connection_tasks, async move {
            // The slot and the place are given back when this task ends, with the connection.
            let _slot = slot;
            let _place = place;
            let stream = match TcpStream::from_std(stream) {
                Ok(stream) => stream,
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "cannot register the connection on its thread");
                    return;
                }
            };
            let Some(acceptor) = tls else {
                serve_connection(stream, peer, service, builder, drain, cut, timeouts).await;
                return;
            };
            // The handshake shares the header read timeout: a client that opens a connection
            // and stalls in TLS holds its slot no longer than one that stalls in HTTP.
            let handshake = tokio::time::timeout(timeouts.header_read, acceptor.accept(stream));
            let handshake = tokio::select! {
                h = handshake => h,
                () = drain.cancelled() => return,
            };
            match handshake {
                Ok(Ok(tls_stream)) => {
                    serve_connection(tls_stream, peer, service, builder, drain, cut, timeouts).await
                }
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "no TLS handshake within the header read timeout"),
            }
        });
    }

    drop(listener);
    tracing::info!("shutting down: draining requests in flight");
    let writes = proxy.writes().clone();
    writes.close();
    drain.cancel();
    connection_tasks.close();
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        connection_tasks.wait().await;
        writes.wait().await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            drain_timeout_ms = DRAIN_TIMEOUT.as_millis() as u64,
            "requests still in flight at shutdown"
        );
        // Connections still open close now, so no request of theirs reaches the store after
        // this returns; writes still running keep their threads until they end (each ends by
        // its deadline): stopping the threads would cut them off, and a store may set a
        // write's quarantine only when it is released. The caller's `EpochStore::close` finds
        // them in flight.
        cut.cancel();
        tokio::spawn(async move {
            writes.wait().await;
            drop(threads);
        });
        return Ok(());
    }
    // Stops the connection threads: nothing of a request runs there any more.
    drop(threads);
    Ok(())
}

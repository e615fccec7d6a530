//! Connections to the upstream for reads, driven by the task that forwards the request.
//!
//! hyper-util's pooled client drives every upstream connection in a task of its own, so each
//! request crosses tasks several times: the request is handed to the connection's task, the
//! response head and every body chunk are handed back, a channel send and a wake-up each. Here
//! the task that forwards a read polls the connection itself: while it waits for the response
//! head, and then through the response body, which carries the connection until its last byte
//! has been read and gives it back to the pool when it is dropped. A connection that is not idle
//! by then (a body dropped half-way, a request body still being sent, `Connection: close`) is
//! closed instead, so a connection in the pool never has anything of an earlier request left.
//! Idle connections are kept per thread: a connection's socket is registered with the event
//! loop of the thread that opened it, and is reused only by requests served on that thread (the
//! connection threads of `fence-proxy-net`), so no wake-up crosses threads.
//!
//! Writes keep hyper-util's client (one per thread, so their connections stay on the thread
//! too): their request body must keep flowing while the write task waits for it, independently
//! of who reads the response body (see `exchange`).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker, ready};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::{TrySendError, http1};

use crate::exchange::{BoxError, TrackedBody};
use crate::tls::{UpstreamConnection, UpstreamConnector};

type RequestBody = TrackedBody<Incoming>;
type Sender = http1::SendRequest<RequestBody>;
type Connection = http1::Connection<UpstreamConnection, RequestBody>;

/// Idle connections kept at most per thread; past it the longest idle one is closed. Each holds
/// hyper's read and write buffers (some kilobytes); the pool refills to the number of reads in
/// flight.
pub(crate) const MAX_IDLE: usize = 256;

/// An idle connection older than this is closed instead of reused (hyper-util's default), so
/// that a burst's connections do not stay open for good.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Why a read could not be forwarded.
#[derive(Debug)]
pub enum SendError {
    /// No connection to the upstream could be made: nothing was sent.
    Connect(BoxError),
    /// The exchange failed after the connection was made; the request may have been sent.
    Exchange(hyper::Error),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Connect(e) => write!(f, "connecting: {e}"),
            SendError::Exchange(e) => write!(f, "{e:?}"),
        }
    }
}

struct Idle {
    sender: Sender,
    connection: Connection,
    since: Instant,
}

/// The read path's connections to one upstream.
pub struct UpstreamPool {
    connector: UpstreamConnector,
    /// The upstream's `host[:port]`, the `Host` of a request that came without one (HTTP/2).
    host: HeaderValue,
    /// Per thread, most recently used at the back: reuse takes the warmest connection, trimming
    /// the oldest. A handful of threads: a list is enough.
    idle: Mutex<Vec<(ThreadId, VecDeque<Idle>)>>,
}

impl UpstreamPool {
    /// A pool of connections to `upstream`, empty until the first read.
    pub fn new(upstream: &crate::Upstream) -> Arc<UpstreamPool> {
        Arc::new(UpstreamPool {
            connector: UpstreamConnector::new(upstream),
            host: host_header(upstream),
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Sends `request` (whose URI is the upstream's absolute URL) and returns the response head;
    /// its body drives the connection until it has been read. A reused connection that turns out
    /// closed before the request was written is replaced, once per connection tried.
    pub async fn send(
        self: &Arc<Self>,
        request: Request<RequestBody>,
    ) -> Result<Response<PooledBody>, SendError> {
        let (mut parts, body) = request.into_parts();
        let target = parts.uri.clone();
        // HTTP/1.1 to the upstream: origin-form target, and a Host header.
        parts.uri = origin_form(&parts.uri);
        if !parts.headers.contains_key(header::HOST) {
            parts.headers.insert(header::HOST, self.host.clone());
        }
        let mut request = Request::from_parts(parts, body);
        loop {
            let (sender, connection, reused) = match self.checkout().await {
                Some((s, c)) => (s, c, true),
                None => {
                    let (s, c) = self.connect(target.clone()).await?;
                    (s, c, false)
                }
            };
            match exchange(sender, connection, request).await {
                Ok((response, held)) => {
                    let pool = self.clone();
                    return Ok(response.map(|body| PooledBody {
                        ended: body.is_end_stream(),
                        body,
                        held: Some(held),
                        pool,
                    }));
                }
                Err(mut e) => match e.take_message() {
                    // Not written at all: safe to send on another connection.
                    Some(unsent) if reused => request = unsent,
                    _ => return Err(SendError::Exchange(e.into_error())),
                },
            }
        }
    }

    async fn connect(&self, target: Uri) -> Result<(Sender, Connection), SendError> {
        let mut connector = self.connector.clone();
        let io = tower::Service::call(&mut connector, target)
            .await
            .map_err(SendError::Connect)?;
        http1::Builder::new()
            .handshake(io)
            .await
            .map_err(SendError::Exchange)
    }

    /// The most recently used idle connection that is still open and ready for a request.
    async fn checkout(&self) -> Option<(Sender, Connection)> {
        loop {
            let (newest, expired) = self.with_idle(|idle| match idle.pop_back() {
                // Everything in front of an expired one is older still: all go, and are closed
                // outside the lock.
                Some(newest) if newest.since.elapsed() > IDLE_TIMEOUT => {
                    (None, std::mem::take(idle))
                }
                newest => (newest, VecDeque::new()),
            });
            drop(expired);
            let mut idle = newest?;
            // Polled here, with this task's waker: a connection the upstream closed while idle
            // ends now, and an open one registers its socket with this task.
            let ready = std::future::poll_fn(|cx| {
                let open = Pin::new(&mut idle.connection).poll(cx).is_pending();
                Poll::Ready(open && matches!(idle.sender.poll_ready(cx), Poll::Ready(Ok(()))))
            })
            .await;
            if ready {
                return Some((idle.sender, idle.connection));
            }
        }
    }

    fn checkin(&self, sender: Sender, connection: Connection) {
        // Closed outside the lock: dropping a connection closes its socket.
        let mut closed = Vec::new();
        self.with_idle(|idle| {
            if idle.len() >= MAX_IDLE {
                closed.extend(idle.pop_front());
            }
            while idle
                .front()
                .is_some_and(|oldest| oldest.since.elapsed() > IDLE_TIMEOUT)
            {
                closed.extend(idle.pop_front());
            }
            idle.push_back(Idle {
                sender,
                connection,
                since: Instant::now(),
            });
        });
        drop(closed);
    }

    /// Runs `f` on this thread's idle connections.
    fn with_idle<T>(&self, f: impl FnOnce(&mut VecDeque<Idle>) -> T) -> T {
        let thread = std::thread::current().id();
        // The lists stay consistent whatever panicked while holding the lock.
        let mut all = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let index = match all.iter().position(|(t, _)| *t == thread) {
            Some(index) => index,
            None => {
                all.push((thread, VecDeque::new()));
                all.len() - 1
            }
        };
        f(&mut all[index].1)
    }
}

/// The connection of one exchange, kept with the response body until its end.
struct Held {
    sender: Sender,
    /// `None` once the connection has ended (closed by the upstream, or failed).
    connection: Option<Connection>,
}

impl Held {
    /// Drives the connection; false once it has ended.
    fn poll_connection(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(connection) = self.connection.as_mut()
            && Pin::new(connection).poll(cx).is_ready()
        {
            self.connection = None;
        }
        self.connection.is_some()
    }
}

/// Sends the request and drives the connection until the response head is there.
async fn exchange(
    mut sender: Sender,
    connection: Connection,
    request: Request<RequestBody>,
) -> Result<(Response<Incoming>, Held), TrySendError<Request<RequestBody>>> {
    let response = sender.try_send_request(request);
    let mut response = std::pin::pin!(response);
    let mut held = Held {
        sender,
        connection: Some(connection),
    };
    let response = std::future::poll_fn(|cx| {
        // The connection first: it writes the request and reads the head the response future
        // then finds. If it ends, hyper resolves the response future with the error.
        held.poll_connection(cx);
        response.as_mut().poll(cx)
    })
    .await?;
    Ok((response, held))
}

/// `host[:port]` of the upstream, the port only when it is not the scheme's default (as
/// hyper-util's client writes it); never user information.
fn host_header(upstream: &crate::Upstream) -> HeaderValue {
    let authority = &upstream.authority;
    let default_port = if upstream.scheme == http::uri::Scheme::HTTPS {
        443
    } else {
        80
    };
    let host = match authority.port_u16() {
        Some(port) if port != default_port => format!("{}:{port}", authority.host()),
        _ => authority.host().to_owned(),
    };
    HeaderValue::from_str(&host).expect("a URI's host and port make a valid header value")
}

/// `/path?query` of an absolute URI, the form an HTTP/1.1 origin server expects.
fn origin_form(uri: &Uri) -> Uri {
    let path_and_query = uri.path_and_query().map_or("/", |pq| pq.as_str());
    Uri::try_from(path_and_query).unwrap_or_else(|_| Uri::from_static("/"))
}

/// A response body from the upstream that drives its connection while it is read, and gives
/// the connection back to the pool when dropped after its end.
pub struct PooledBody {
    body: Incoming,
    /// The body reached its end. Not `is_end_stream`: hyper reports that only for a body of a
    /// known length, never for a chunked one.
    ended: bool,
    /// `None` once given back (only in `drop`).
    held: Option<Held>,
    pool: Arc<UpstreamPool>,
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        // The connection fills the body: it must run for the body to make progress, and its
        // waker is this task's.
        if let Some(held) = this.held.as_mut() {
            held.poll_connection(cx);
        }
        let frame = ready!(Pin::new(&mut this.body).poll_frame(cx));
        match &frame {
            None => this.ended = true,
            Some(Ok(_)) => this.ended = this.body.is_end_stream(),
            Some(Err(_)) => {}
        }
        Poll::Ready(frame.map(|f| f.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        let Some(mut held) = self.held.take() else {
            return;
        };
        // Only a connection whose response was read to its end, and that hyper then reports
        // open and ready for the next request, goes back; dropping any other closes it.
        if !self.ended {
            return;
        }
        let mut cx = Context::from_waker(Waker::noop());
        if !held.poll_connection(&mut cx) || !held.sender.is_ready() {
            return;
        }
        if let Some(connection) = held.connection {
            self.pool.checkin(held.sender, connection);
        }
    }
}

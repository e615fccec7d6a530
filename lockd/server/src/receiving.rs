//! What a call may make a node hold while it arrives, before its handler runs.
//!
//! HTTP/2 lets one connection keep 1,024 calls open, and each one holds its stream, its headers
//! (up to 16 KiB), tonic's read buffer (8 KiB, grown to the announced size of a message as soon
//! as its 5-byte prefix arrives) and the messages decoded so far, for as long as the client takes
//! to end its request. Bounding connections (`connections.rs`) does not bound that: 256
//! connections from one address could make a node hold 20 GiB, and sources are many. So while a
//! call to a client-facing service waits for more of its request, it counts [`CALL_BYTES`], its
//! URI and header bytes and twice the largest message it announced (buffer and decoded copy)
//! against a budget of its source address ([`RECEIVING_PER_SOURCE_MAX`]) and one of the node; a
//! call that would go beyond them ends at once with `RESOURCE_EXHAUSTED`, and so does one that
//! has not arrived in time ([`RECEIVE_TIMEOUT`]).
//!
//! The node's budget has two parts, so that sources which fill it cannot refuse everyone else:
//! [`RECEIVING_MAX`] for anyone, then [`RECEIVING_RESERVE_MAX`] more for sources that hold at most
//! [`RECEIVING_RESERVE_PER_SOURCE`] (a client whose calls wait a moment between their frames, as
//! any client's may). Filling both takes over 250 source addresses. A call whose request is
//! already there when it is read is never counted at all. The members' addresses (kept current
//! with the membership) count against a budget of their own per address, outside the node's. A
//! call waiting for a lock holds nothing here; the places of parked waits bound it, per source
//! address and per node (`parked.rs`), beside the table's waiter limits.
//!
//! Answers count too, from the moment the handler returns one until hyper has handed it all to
//! HTTP/2 ([`ANSWER_BYTES`]): a client that grants no HTTP/2 flow-control window leaves every
//! answer on the node. A source that holds its whole budget in answers and waiting calls gets
//! `RESOURCE_EXHAUSTED` for its next calls at once, and the connection of an answer left untaken
//! for `connections::SEND_TIMEOUT` is closed. Long-lived answers (health `Watch`, `SaveSnapshot`)
//! are not counted. Answers hyper has handed over but HTTP/2 flow control holds (a stream window
//! smaller than the answer) are bounded per connection by `flow_watch`.
//!
//! Reflection is a stream of requests whose service stops reading while its answers are not
//! taken, so h2 may buffer up to a stream's window (1 MiB) for it unseen: each reflection call
//! also takes one of [`REFLECTION_CALLS_PER_SOURCE_MAX`] places of its source (and
//! [`REFLECTION_CALLS_MAX`] of the node) for its whole life. A health `Watch` (a long-lived
//! answer, not counted as one) takes one of [`WATCH_STREAMS_PER_SOURCE_MAX`] places of its source
//! ([`WATCH_STREAMS_MAX`] of the node) until its answer stream ends.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::Frame;
use lockd_service_kit::admission::{SourceSlot, SourceSlots, TrustedSources};
use tokio::time::{Instant, Sleep};
use tonic::Status;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::service::errors::{transit_exhausted, watch_refused};

/// Bytes of calls waiting for more of their request, and of answers not yet taken, from one
/// source address (members excepted): about 4,000 waiting calls with small messages, or 8,000
/// untaken answers. A client that sends 1,500 calls at once, each waiting a moment between its
/// frames, holds about 25 MiB for that moment.
pub const RECEIVING_PER_SOURCE_MAX: usize = 64 << 20;
/// The same from all sources but the members.
pub const RECEIVING_MAX: usize = 256 << 20;
/// Bytes beyond [`RECEIVING_MAX`] for sources that hold little: they are not the ones filling it.
pub const RECEIVING_RESERVE_MAX: usize = 64 << 20;
/// What a source may hold to use [`RECEIVING_RESERVE_MAX`].
pub const RECEIVING_RESERVE_PER_SOURCE: usize = 256 << 10;
/// The same from one member's address (outside the node's budget).
pub const RECEIVING_PER_MEMBER_MAX: usize = 64 << 20;
/// What a waiting call counts besides its URI, headers and messages: its HTTP/2 stream, tonic's
/// 8 KiB read buffer, the tasks and futures that serve it.
pub const CALL_BYTES: usize = 16 << 10;
/// What an answer counts from the moment its handler returns it until hyper has handed it all to
/// HTTP/2: its stream, task and buffers (about 9 KB measured for a small answer).
pub const ANSWER_BYTES: usize = 8 << 10;
/// Methods whose answers are long-lived streams: not counted as answers (health `Watch`, one per
/// channel of a client that checks health; `SaveSnapshot`, an administrator's download).
const LONG_LIVED_ANSWERS: &[&str] = &[
    "/grpc.health.v1.Health/Watch",
    "/lockd.v1.Cluster/SaveSnapshot",
];
/// From a unary call's arrival to the end of its request body; for a streaming request, to the
/// end of its first message, and from the first byte of each later message to its last.
pub const RECEIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Reflection calls open at once from one source address (members: `TRUSTED_PER_SOURCE_MAX`).
pub const REFLECTION_CALLS_PER_SOURCE_MAX: usize = 4;
/// Reflection calls open at once on a node, members' apart.
pub const REFLECTION_CALLS_MAX: usize = 64;
/// Health `Watch` streams open at once from one source address (members:
/// `TRUSTED_PER_SOURCE_MAX`): a client channel that checks health keeps one per connection, so
/// this many clients behind one address can watch; each stream keeps a task and a stream (about
/// 9 KB).
pub const WATCH_STREAMS_PER_SOURCE_MAX: usize = 4_096;
/// Health `Watch` streams open at once on a node, members' apart.
pub const WATCH_STREAMS_MAX: usize = 16_384;

/// The `limit` each refusal names in its ErrorInfo (docs/api.md, status codes).
const LIMIT_PER_SOURCE: &str = "receiving_per_source_max";
const LIMIT_NODE: &str = "receiving_max";
const LIMIT_TIME: &str = "receive_timeout";
const LIMIT_REFLECTION: &str = "reflection_calls_max";
const LIMIT_WATCH: &str = "watch_streams_max";
/// The one method of the health service that holds a place ([`WATCH_STREAMS_PER_SOURCE_MAX`]).
const HEALTH_WATCH: &str = "/grpc.health.v1.Health/Watch";

/// Per HTTP/2's accounting of a header list (RFC 9113, SETTINGS_MAX_HEADER_LIST_SIZE): the
/// bytes of each name and value plus 32.
const HEADER_OVERHEAD_BYTES: usize = 32;
/// The largest message a wrapped service decodes: every one is built with
/// `max_decoding_message_size(CLIENT_MESSAGE_MAX_BYTES)` (`node.rs`), so tonic refuses a larger
/// announcement at once.
const MESSAGE_MAX_BYTES: u64 = crate::node::CLIENT_MESSAGE_MAX_BYTES as u64;

/// The budget of one node, shared by every wrapped service. Cheap to clone.
#[derive(Clone)]
pub struct ReceiveBudget {
    table: Arc<Mutex<Table>>,
    /// Places of reflection calls.
    reflection: SourceSlots,
    /// Places of health `Watch` streams.
    watches: SourceSlots,
    members: TrustedSources,
    bounds: Bounds,
}

/// The bounds of a [`ReceiveBudget`], in bytes.
#[derive(Clone, Copy)]
struct Bounds {
    per_source: usize,
    total: usize,
    reserve: usize,
    reserve_per_source: usize,
    per_member: usize,
}

impl Bounds {
    const NODE: Bounds = Bounds {
        per_source: RECEIVING_PER_SOURCE_MAX,
        total: RECEIVING_MAX,
        reserve: RECEIVING_RESERVE_MAX,
        reserve_per_source: RECEIVING_RESERVE_PER_SOURCE,
        per_member: RECEIVING_PER_MEMBER_MAX,
    };
}

#[derive(Default)]
struct Table {
    /// Held by sources that are not members.
    total: usize,
    /// Held per source (members and others); `None` when the transport gave no address.
    by_source: HashMap<Option<IpAddr>, usize>,
}

impl ReceiveBudget {
    /// The node's budget, with `members` counted apart.
    pub fn new(members: TrustedSources) -> Self {
        Self::with_bounds(members, Bounds::NODE)
    }

    fn with_bounds(members: TrustedSources, bounds: Bounds) -> Self {
        ReceiveBudget {
            table: Arc::default(),
            reflection: SourceSlots::new(
                REFLECTION_CALLS_MAX,
                REFLECTION_CALLS_PER_SOURCE_MAX,
                members.clone(),
            ),
            watches: SourceSlots::new(
                WATCH_STREAMS_MAX,
                WATCH_STREAMS_PER_SOURCE_MAX,
                members.clone(),
            ),
            members,
            bounds,
        }
    }

    /// A charge of nothing yet for a call from `source`.
    fn charge(&self, source: Option<IpAddr>) -> Charge {
        let source = source.map(|ip| ip.to_canonical());
        let member = source.is_some_and(|ip| self.members.trusts(ip));
        Charge {
            budget: self.clone(),
            source,
            member,
            held: 0,
        }
    }

    /// Wraps a unary service: each call's request body must end within [`RECEIVE_TIMEOUT`].
    pub fn unary<S>(&self, inner: S) -> Receiving<S> {
        Receiving {
            inner,
            budget: self.clone(),
            streaming: false,
        }
    }

    /// Wraps a reflection service, whose requests are streams of messages: the first message must
    /// arrive within [`RECEIVE_TIMEOUT`] of the call, each later one within [`RECEIVE_TIMEOUT`] of
    /// its first byte; a stream may stay open between messages (its bytes stay counted), and
    /// holds a reflection place for its whole life.
    pub fn reflection<S>(&self, inner: S) -> Receiving<Places<S>> {
        Receiving {
            inner: Places {
                inner,
                places: self.reflection.clone(),
                only: None,
                limit: LIMIT_REFLECTION,
                what: "reflection calls",
                refuse: |limit, msg| transit_exhausted(limit, msg),
            },
            budget: self.clone(),
            streaming: true,
        }
    }

    /// Wraps the health service: unary as [`Self::unary`], and each `Watch` holds a place of its
    /// source ([`WATCH_STREAMS_PER_SOURCE_MAX`]) for as long as its answer stream lives; one
    /// without a place is answered `UNIMPLEMENTED` (`service::errors::watch_refused`).
    pub fn health<S>(&self, inner: S) -> Receiving<Places<S>> {
        Receiving {
            inner: Places {
                inner,
                places: self.watches.clone(),
                only: Some(HEALTH_WATCH),
                limit: LIMIT_WATCH,
                what: "health Watch streams",
                refuse: |limit, msg| watch_refused(limit, msg),
            },
            budget: self.clone(),
            streaming: false,
        }
    }

    /// Why a new call from `charge`'s source is refused at once, if it is: the source holds its
    /// whole budget, or it holds more than the reserve's share while the node's budget is spent.
    fn refusal(&self, charge: &Charge) -> Option<Status> {
        let b = self.bounds;
        let t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let of_source = t.by_source.get(&charge.source).copied().unwrap_or(0);
        let source_max = if charge.member {
            b.per_member
        } else {
            b.per_source
        };
        let (limit, why) = if of_source >= source_max {
            (
                LIMIT_PER_SOURCE,
                format!(
                    "lockd: calls from {} hold {of_source} bytes in requests not yet received and \
                 answers not yet taken, the most one address may hold is {source_max}",
                    charge
                        .source
                        .map_or_else(|| "an unknown address".to_owned(), |ip| ip.to_string()),
                ),
            )
        } else if !charge.member && t.total >= b.total && of_source > b.reserve_per_source {
            (
                LIMIT_NODE,
                format!(
                    "lockd: calls hold {} bytes in requests not yet received and answers not yet \
                 taken, the most this node holds is {} (more only for addresses that hold under \
                 {} bytes)",
                    t.total, b.total, b.reserve_per_source
                ),
            )
        } else {
            return None;
        };
        Some(transit_exhausted(
            limit,
            format!("{why}; nothing was done, retry"),
        ))
    }

    #[cfg(test)]
    fn held(&self) -> (usize, usize) {
        let t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        (t.total, t.by_source.values().sum())
    }
}

/// The bytes one call holds of the budget; given back when dropped.
struct Charge {
    budget: ReceiveBudget,
    source: Option<IpAddr>,
    member: bool,
    held: usize,
}

impl Charge {
    /// A charge of nothing yet for the same source, as a member or not as this one is.
    fn another(&self) -> Charge {
        Charge {
            budget: self.budget.clone(),
            source: self.source,
            member: self.member,
            held: 0,
        }
    }

    /// Makes the call hold `bytes` in all, or says why it may not (and then holds nothing).
    fn set(&mut self, bytes: usize) -> Result<(), Status> {
        if bytes <= self.held {
            self.give_back(self.held - bytes);
            return Ok(());
        }
        let more = bytes - self.held;
        let b = self.budget.bounds;
        let mut t = self
            .budget
            .table
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let of_source = t.by_source.get(&self.source).copied().unwrap_or(0);
        let source_max = if self.member {
            b.per_member
        } else {
            b.per_source
        };
        let small = of_source + more <= b.reserve_per_source;
        let refusal = if of_source + more > source_max {
            Some((
                LIMIT_PER_SOURCE,
                format!(
                    "lockd: calls from {} already hold {of_source} bytes while they arrive, the most \
                 one address may hold is {source_max}",
                    self.source
                        .map_or_else(|| "an unknown address".to_owned(), |ip| ip.to_string()),
                ),
            ))
        } else if !self.member
            && t.total + more > b.total
            && (!small || t.total + more > b.total + b.reserve)
        {
            Some((
                LIMIT_NODE,
                format!(
                    "lockd: calls hold {} bytes while they arrive, the most this node holds is {} \
                 ({} more for addresses that hold under {} bytes)",
                    t.total, b.total, b.reserve, b.reserve_per_source
                ),
            ))
        } else {
            None
        };
        if let Some((limit, why)) = refusal {
            drop(t);
            self.give_back(self.held);
            return Err(transit_exhausted(
                limit,
                format!("{why}; this call was not received whole and nothing was done, retry"),
            ));
        }
        *t.by_source.entry(self.source).or_insert(0) += more;
        if !self.member {
            t.total += more;
        }
        self.held = bytes;
        Ok(())
    }

    /// Makes the call hold `bytes` more, whatever the bounds: for answers, which are made already;
    /// the bounds then refuse the source's next calls.
    fn force(&mut self, bytes: usize) {
        let mut t = self
            .budget
            .table
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *t.by_source.entry(self.source).or_insert(0) += bytes;
        if !self.member {
            t.total += bytes;
        }
        self.held += bytes;
    }

    fn give_back(&mut self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let mut t = self
            .budget
            .table
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(held) = t.by_source.get_mut(&self.source) {
            *held -= bytes;
            if *held == 0 {
                t.by_source.remove(&self.source);
            }
        }
        if !self.member {
            t.total -= bytes;
        }
        self.held -= bytes;
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.give_back(self.held);
    }
}

/// Where a stream of gRPC messages (a 5-byte prefix with the length, then the message) stands.
#[derive(Default)]
struct Framing {
    /// Bytes of the current prefix received (0 to 5).
    prefix_len: usize,
    prefix: [u8; 5],
    /// Bytes of the current message still to come, once its prefix is whole.
    remaining: u64,
    /// Bytes of the current message (prefix included) received so far; 0 between messages.
    partial: u64,
    /// The largest message announced so far, prefix included, at most `MESSAGE_MAX_BYTES + 5`.
    largest: u64,
    /// Whether a message has been received whole.
    finished_any: bool,
}

impl Framing {
    /// Takes the next bytes of the stream; returns whether a message began in them.
    fn advance(&mut self, mut data: &[u8]) -> bool {
        let mut began = false;
        while !data.is_empty() {
            if self.prefix_len < 5 {
                began |= self.prefix_len == 0;
                let n = (5 - self.prefix_len).min(data.len());
                self.prefix[self.prefix_len..self.prefix_len + n].copy_from_slice(&data[..n]);
                self.prefix_len += n;
                self.partial += n as u64;
                data = &data[n..];
                if self.prefix_len == 5 {
                    let mut len = [0u8; 4];
                    len.copy_from_slice(&self.prefix[1..]);
                    self.remaining = u64::from(u32::from_be_bytes(len));
                    self.largest = self.largest.max(5 + self.remaining.min(MESSAGE_MAX_BYTES));
                }
            } else {
                let n = self.remaining.min(data.len() as u64);
                self.remaining -= n;
                self.partial += n;
                // `n` is at most `data.len()`.
                data = &data[usize::try_from(n).unwrap_or(data.len())..];
            }
            if self.prefix_len == 5 && self.remaining == 0 {
                self.prefix_len = 0;
                self.partial = 0;
                self.finished_any = true;
            }
        }
        began
    }

    fn partial(&self) -> usize {
        usize::try_from(self.partial).unwrap_or(usize::MAX)
    }

    /// What the messages take: tonic's buffer, grown to the largest announced message, and the
    /// decoded copy of one; before any prefix is whole, the bytes received.
    fn held(&self) -> usize {
        usize::try_from((2 * self.largest).max(self.partial)).unwrap_or(usize::MAX)
    }
}

/// What the transport saw of a call's connection (its addresses), with or without TLS.
fn connect_info<B>(req: &http::Request<B>) -> Option<&TcpConnectInfo> {
    req.extensions().get::<TcpConnectInfo>().or_else(|| {
        req.extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .map(TlsConnectInfo::get_ref)
    })
}

/// The address a call came from.
fn source_of<B>(req: &http::Request<B>) -> Option<IpAddr> {
    connect_info(req)?.remote_addr().map(|a| a.ip())
}

/// The (local, remote) addresses of a call's connection.
fn connection_of<B>(
    req: &http::Request<B>,
) -> Option<(std::net::SocketAddr, std::net::SocketAddr)> {
    let tcp = connect_info(req)?;
    Some((tcp.local_addr()?, tcp.remote_addr()?))
}

/// What a call counts before its messages: [`CALL_BYTES`] and what hyper keeps of its request
/// line and headers (the URI, with `:authority` and the query, and every header).
fn head_bytes<B>(req: &http::Request<B>) -> usize {
    CALL_BYTES
        + req.uri().to_string().len()
        + req
            .headers()
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + HEADER_OVERHEAD_BYTES)
            .sum::<usize>()
}

/// A service whose calls count against a [`ReceiveBudget`] while they wait for their request.
#[derive(Clone)]
pub struct Receiving<S> {
    inner: S,
    budget: ReceiveBudget,
    streaming: bool,
}

impl<S: NamedService> NamedService for Receiving<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> tower::Service<http::Request<Body>> for Receiving<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<B>, Error = Infallible>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Answering<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let source = source_of(&req);
        let untaken = connection_of(&req)
            .and_then(|(local, remote)| crate::connections::Open::of(local, remote))
            .map(|open| open.untaken.clone());
        let header_bytes = head_bytes(&req);
        let long_lived = LONG_LIVED_ANSWERS.contains(&req.uri().path());
        let (parts, body) = req.into_parts();
        let charge = self.budget.charge(source);
        let refused = self.budget.refusal(&charge);
        // A long-lived answer (a stream of updates or a download) is not counted: clients
        // keep some open for as long as they run, many behind one address.
        let answer_charge = (!long_lived).then(|| charge.another());
        let arriving = Arriving {
            inner: body,
            charge,
            header_bytes,
            framing: Framing::default(),
            streaming: self.streaming,
            deadline: Some(Instant::now() + RECEIVE_TIMEOUT),
            sleep: None,
            refused,
            ended: false,
        };
        Answering {
            inner: self
                .inner
                .call(http::Request::from_parts(parts, Body::new(arriving))),
            answer: Some((answer_charge, untaken)),
        }
    }
}

pin_project_lite::pin_project! {
    /// A call's answer on its way: once the handler returns it, its body counts against the
    /// budget and in its connection's untaken answers until the client has taken it all.
    pub struct Answering<F> {
        #[pin]
        inner: F,
        answer: Option<(Option<Charge>, Option<Arc<crate::connections::Untaken>>)>,
    }
}

impl<F, B> std::future::Future for Answering<F>
where
    F: std::future::Future<Output = Result<http::Response<B>, Infallible>>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Output = Result<http::Response<Body>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let Poll::Ready(Ok(response)) = this.inner.poll(cx) else {
            return Poll::Pending;
        };
        let (charge, untaken) = this.answer.take().unwrap_or_else(|| {
            unreachable!("an Answering future is not polled after it completed")
        });
        Poll::Ready(Ok(response.map(|body| {
            if body.is_end_stream() {
                // Headers only (a refusal, an error): they leave at once, unlimited by flow
                // control.
                return Body::new(body);
            }
            let charge = charge.map(|mut c| {
                c.force(ANSWER_BYTES);
                c
            });
            Body::new(Answer {
                inner: Body::new(body),
                _charge: charge,
                untaken: untaken.map(|u| u.answer()),
            })
        })))
    }
}

/// An answer body: counts [`ANSWER_BYTES`] until hyper has handed it all to HTTP/2 (it is
/// dropped then), and tells its connection when it waits for the client to take a frame.
struct Answer {
    inner: Body,
    /// `None` for a long-lived answer.
    _charge: Option<Charge>,
    untaken: Option<crate::connections::UntakenAnswer>,
}

impl http_body::Body for Answer {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Some(untaken) = &this.untaken {
            if matches!(polled, Poll::Ready(Some(Ok(_)))) {
                untaken.yielded();
            } else {
                untaken.polled();
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

/// A request body that, while it waits for more, keeps its call's [`Charge`] at what the call
/// holds, and ends in an error when the budget or the time runs out.
struct Arriving {
    inner: Body,
    /// Nothing until the body first waits for the client.
    charge: Charge,
    /// [`CALL_BYTES`], the URI and the headers.
    header_bytes: usize,
    framing: Framing,
    streaming: bool,
    /// When the body (unary), or the first or current message (streaming), must have arrived;
    /// `None` for a stream between messages.
    deadline: Option<Instant>,
    /// The timer for `deadline`, made the first time the body waits for more.
    sleep: Option<Pin<Box<Sleep>>>,
    /// Refused when it came (its source holds its budget): the first read fails with it.
    refused: Option<Status>,
    ended: bool,
}

impl Arriving {
    /// Ends the body with `status`, giving back what it held.
    fn fail(&mut self, status: Status) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        self.ended = true;
        let _ = self.charge.set(0);
        Poll::Ready(Some(Err(status)))
    }

    fn end(&mut self) {
        self.ended = true;
        let _ = self.charge.set(0);
    }

    /// What the call holds while it waits for more.
    fn waiting_bytes(&self) -> usize {
        self.header_bytes + self.framing.held()
    }

    fn too_late() -> Status {
        transit_exhausted(
            LIMIT_TIME,
            format!(
                "lockd: the call did not arrive in full within {RECEIVE_TIMEOUT:?}; nothing was \
                 done, retry"
            ),
        )
    }
}

impl http_body::Body for Arriving {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        if let Some(status) = this.refused.take() {
            return this.fail(status);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let Some(data) = frame.data_ref() else {
                    // Trailers: the body has ended.
                    this.end();
                    return Poll::Ready(Some(Ok(frame)));
                };
                let began = this.framing.advance(data);
                // A call that has waited keeps its charge at what it holds now (more once a
                // prefix announces a larger message); one that has not is charged when it waits.
                if this.charge.held > 0 {
                    let bytes = this.waiting_bytes();
                    if let Err(status) = this.charge.set(bytes) {
                        return this.fail(status);
                    }
                }
                // A stream: no deadline between messages; each message after the first has its
                // own from its first byte (the first keeps the call's).
                if this.streaming && this.framing.finished_any && !data.is_empty() {
                    if this.framing.partial() == 0 {
                        this.deadline = None;
                    } else if began {
                        this.deadline = Some(Instant::now() + RECEIVE_TIMEOUT);
                    }
                    this.sleep = None;
                }
                if this.inner.is_end_stream() {
                    this.end();
                } else if this.deadline.is_some_and(|d| Instant::now() >= d) {
                    return this.fail(Self::too_late());
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(status))) => {
                this.end();
                Poll::Ready(Some(Err(status)))
            }
            Poll::Ready(None) => {
                this.end();
                Poll::Ready(None)
            }
            Poll::Pending => {
                let bytes = this.waiting_bytes();
                if let Err(status) = this.charge.set(bytes) {
                    return this.fail(status);
                }
                let Some(deadline) = this.deadline else {
                    return Poll::Pending;
                };
                let sleep = this
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if sleep.as_mut().poll(cx).is_ready() {
                    return this.fail(Self::too_late());
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // A refused call's first read must happen, even with an empty request.
        self.ended || (self.refused.is_none() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A service whose calls (or the calls to one of its methods) each hold a place of their source
/// for their whole life: until both their request stream and their answer stream are gone. A call
/// without a place is answered `RESOURCE_EXHAUSTED` at once.
#[derive(Clone)]
pub struct Places<S> {
    inner: S,
    places: SourceSlots,
    /// The one method whose calls take a place; `None`: every call.
    only: Option<&'static str>,
    /// The `limit` a refusal names, and what the places are, for its message.
    limit: &'static str,
    what: &'static str,
    /// The refusal: [`transit_exhausted`], or [`watch_refused`] for health `Watch`.
    refuse: fn(&'static str, String) -> Status,
}

impl<S: NamedService> NamedService for Places<S> {
    const NAME: &'static str = S::NAME;
}

/// The answer of a call that took a place, or of its refusal.
type PlacedAnswer =
    Pin<Box<dyn std::future::Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

impl<S> tower::Service<http::Request<Body>> for Places<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = futures::future::Either<S::Future, PlacedAnswer>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        if self.only.is_some_and(|path| req.uri().path() != path) {
            return futures::future::Either::Left(self.inner.call(req));
        }
        let source = source_of(&req).unwrap_or(IpAddr::from([0, 0, 0, 0]));
        match self.places.admit(source) {
            Ok(place) => {
                let place = Arc::new(place);
                let (parts, body) = req.into_parts();
                let body = Body::new(Placed {
                    inner: body,
                    _place: place.clone(),
                });
                let answer = self.inner.call(http::Request::from_parts(parts, body));
                futures::future::Either::Right(Box::pin(async move {
                    let answer = answer.await?;
                    Ok(answer.map(|inner| {
                        Body::new(Placed {
                            inner,
                            _place: place,
                        })
                    }))
                }))
            }
            Err(why) => {
                let refusal = (self.refuse)(
                    self.limit,
                    format!("lockd: {}: {why}; nothing was done, retry later", self.what),
                );
                futures::future::Either::Right(Box::pin(std::future::ready(
                    Ok(refusal.into_http()),
                )))
            }
        }
    }
}

/// A request or answer body holding its call's place until both are dropped.
struct Placed {
    inner: Body,
    _place: Arc<SourceSlot>,
}

impl http_body::Body for Placed {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn message(len: usize) -> Vec<u8> {
        let mut m = vec![0u8];
        m.extend_from_slice(&u32::try_from(len).unwrap().to_be_bytes());
        m.resize(5 + len, 7);
        m
    }

    /// Bounds without a reserve.
    fn bounds(total: usize, per_source: usize, per_member: usize) -> Bounds {
        Bounds {
            per_source,
            total,
            reserve: 0,
            reserve_per_source: 0,
            per_member,
        }
    }

    #[test]
    fn framing_counts_the_unfinished_message_and_the_largest_announced() {
        let mut f = Framing::default();
        let two = [message(10), message(3)].concat();
        // Byte by byte: the partial count rises within a message and drops to 0 at its end.
        let mut seen = Vec::new();
        for b in &two {
            f.advance(std::slice::from_ref(b));
            seen.push(f.partial());
        }
        assert_eq!(
            seen[..15],
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 0]
        );
        assert_eq!(seen[15..], [1, 2, 3, 4, 5, 6, 7, 0]);
        // Held: the bytes before the first prefix is whole, then twice the largest message.
        let mut f = Framing::default();
        f.advance(&[0, 0, 0]);
        assert_eq!(f.held(), 3);
        f.advance(&[0, 100]);
        assert_eq!(f.held(), 210);
        assert!(!f.finished_any);
        f.advance(&[7; 100]);
        assert!(f.finished_any);
        assert_eq!((f.partial(), f.held()), (0, 210));
        // In one piece, with the start of a third; an announcement over the limit counts as the
        // limit (tonic refuses it at once).
        let mut f = Framing::default();
        assert!(f.advance(&[two.clone(), message(100)[..20].to_vec()].concat()));
        assert_eq!((f.partial(), f.held()), (20, 210));
        assert!(!f.advance(&[7; 50]));
        assert_eq!(f.partial(), 70);
        let mut f = Framing::default();
        f.advance(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(
            f.held(),
            usize::try_from(2 * (5 + MESSAGE_MAX_BYTES)).unwrap()
        );
        // An empty message ends with its prefix.
        let mut f = Framing::default();
        f.advance(&message(0));
        assert_eq!((f.partial(), f.held()), (0, 10));
    }

    #[test]
    fn charges_are_bounded_per_source_and_in_all_and_given_back() {
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let m: IpAddr = "10.0.0.9".parse().unwrap();
        let budget =
            ReceiveBudget::with_bounds(TrustedSources::new(vec![m]), bounds(150, 100, 120));
        let mut a1 = budget.charge(Some(a));
        a1.set(60).unwrap();
        let mut a2 = budget.charge(Some(a));
        let err = a2.set(41).unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(err.message().contains("10.0.0.1"), "{}", err.message());
        a2.set(40).unwrap();
        let mut b1 = budget.charge(Some(b));
        let err = b1.set(51).unwrap_err();
        assert!(
            err.message().contains("the most this node holds is 150"),
            "{}",
            err.message()
        );
        b1.set(50).unwrap();
        assert_eq!(budget.held(), (150, 150));
        // A member counts against its own bound only, even with the node's budget spent.
        let mut m1 = budget.charge(Some(m));
        m1.set(120).unwrap();
        assert!(budget.charge(Some(m)).set(1).is_err());
        // A refused charge holds nothing, even if it held some before.
        assert!(a2.set(41).is_err());
        assert_eq!(budget.held(), (110, 230));
        // Lowering and dropping give back.
        a1.set(10).unwrap();
        drop(b1);
        drop(m1);
        assert_eq!(budget.held(), (10, 10));
        drop(a1);
        assert_eq!(budget.held(), (0, 0));
        // An IPv4-mapped source is its IPv4 address.
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let mut c = budget.charge(Some(mapped));
        c.set(100).unwrap();
        assert!(budget.charge(Some(a)).set(1).is_err());
    }

    #[test]
    fn sources_that_fill_the_node_budget_leave_a_reserve_for_small_ones() {
        let budget = ReceiveBudget::with_bounds(
            TrustedSources::default(),
            Bounds {
                per_source: 100,
                total: 200,
                reserve: 50,
                reserve_per_source: 20,
                per_member: 100,
            },
        );
        let source = |i: u8| Some(IpAddr::from([10, 0, 0, i]));
        // Two large holders fill the node's budget.
        let mut big1 = budget.charge(source(1));
        big1.set(100).unwrap();
        let mut big2 = budget.charge(source(2));
        big2.set(100).unwrap();
        // A third large one is refused, and so are the large ones' further calls.
        assert!(budget.charge(source(3)).set(21).is_err());
        assert!(big1.set(101).is_err());
        big1.set(100).unwrap();
        // Small holders take the reserve, each up to its bound, until it is spent.
        let mut small: Vec<Charge> = (3..5).map(|i| budget.charge(source(i))).collect();
        for c in &mut small {
            c.set(20).unwrap();
        }
        let mut more = budget.charge(source(3));
        assert!(more.set(1).is_err(), "a source over the reserve's bound");
        let mut last = budget.charge(source(5));
        last.set(10).unwrap();
        let err = budget.charge(source(6)).set(1).unwrap_err();
        assert!(
            err.message()
                .contains("(50 more for addresses that hold under 20 bytes)"),
            "{}",
            err.message()
        );
        assert_eq!(budget.held(), (250, 250));
    }

    /// A body from frames sent over a channel, as a connection delivers them.
    fn channel_body() -> (
        tokio::sync::mpsc::Sender<Result<Frame<Bytes>, Status>>,
        Body,
    ) {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        (tx, Body::new(http_body_util::StreamBody::new(stream)))
    }

    fn arriving(budget: &ReceiveBudget, streaming: bool, inner: Body) -> Arriving {
        Arriving {
            inner,
            charge: budget.charge(Some("10.0.0.1".parse().unwrap())),
            header_bytes: 10,
            framing: Framing::default(),
            streaming,
            deadline: Some(Instant::now() + RECEIVE_TIMEOUT),
            sleep: None,
            refused: None,
            ended: false,
        }
    }

    type Polled = Option<Option<Result<Frame<Bytes>, Status>>>;

    /// Polls `body` once: `None` if it waits.
    fn poll_once(body: &mut Arriving) -> Polled {
        futures::FutureExt::now_or_never(body.frame())
    }

    async fn send(tx: &tokio::sync::mpsc::Sender<Result<Frame<Bytes>, Status>>, bytes: &[u8]) {
        tx.send(Ok(Frame::data(Bytes::from(bytes.to_vec()))))
            .await
            .unwrap();
    }

    #[test]
    fn the_head_counts_the_uri_and_every_header() {
        let host = "a".repeat(8_000);
        let query = "q".repeat(100);
        let req = http::Request::post(format!("http://{host}/lockd.v1.Lock/Acquire?{query}"))
            .header("te", "trailers")
            .body(())
            .unwrap();
        assert_eq!(
            head_bytes(&req),
            CALL_BYTES
                + "http://".len()
                + 8_000
                + "/lockd.v1.Lock/Acquire?".len()
                + 100
                + "te".len()
                + "trailers".len()
                + 32
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_counts_only_while_it_waits_and_must_end_in_time() {
        let budget = ReceiveBudget::with_bounds(TrustedSources::default(), bounds(1_000, 500, 500));
        let (tx, inner) = channel_body();
        let mut body = arriving(&budget, false, inner);
        let message = message(100);
        send(&tx, &message[..60]).await;
        assert!(matches!(poll_once(&mut body), Some(Some(Ok(_)))));
        assert_eq!(
            budget.held(),
            (0, 0),
            "nothing counted before the call waits"
        );
        // Waiting for the rest: the head and twice the announced message count.
        assert!(poll_once(&mut body).is_none());
        assert_eq!(budget.held(), (220, 220));
        // The whole message, but no end of the body: tonic holds it decoded, so it still counts.
        send(&tx, &message[60..]).await;
        assert!(matches!(poll_once(&mut body), Some(Some(Ok(_)))));
        assert_eq!(budget.held(), (220, 220));
        // Nothing more comes: the body fails at the timeout from the call and gives back.
        let err = body.frame().await.unwrap().unwrap_err();
        assert_eq!(Instant::now(), body.deadline.unwrap());
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(err.message().contains("within 10s"), "{}", err.message());
        // From lockd, nothing done, and which bound.
        let (reason, metadata) = lockd_api::errors::reason_of(&err).unwrap();
        assert_eq!(reason, lockd_api::errors::Reason::LimitReached);
        assert_eq!(metadata["limit"], "receive_timeout");
        assert_eq!(budget.held(), (0, 0));
        assert!(body.frame().await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_waits_beyond_the_budget_fails_and_gives_back() {
        let budget = ReceiveBudget::with_bounds(TrustedSources::default(), bounds(1_000, 500, 500));
        let (tx, inner) = channel_body();
        let mut body = arriving(&budget, false, inner);
        // A bare prefix announcing 1,000 bytes: tonic reserves them, so they count.
        send(&tx, &message(1_000)[..5]).await;
        assert!(matches!(poll_once(&mut body), Some(Some(Ok(_)))));
        let Some(Some(Err(err))) = poll_once(&mut body) else {
            panic!("a call waiting with 2,020 bytes is not refused at 500");
        };
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(
            err.message()
                .contains("the most one address may hold is 500"),
            "{}",
            err.message()
        );
        assert_eq!(budget.held(), (0, 0));

        // A prefix that arrives while the call already waits raises its charge at once.
        let (tx, inner) = channel_body();
        let mut body = arriving(&budget, false, inner);
        assert!(poll_once(&mut body).is_none());
        assert_eq!(budget.held(), (10, 10));
        send(&tx, &message(1_000)[..5]).await;
        assert!(matches!(poll_once(&mut body), Some(Some(Err(_)))));
        assert_eq!(budget.held(), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_arrives_whole_needs_no_budget() {
        let budget = ReceiveBudget::with_bounds(TrustedSources::default(), bounds(100, 100, 100));
        // Another source holds the node's whole budget.
        let mut other = budget.charge(Some("10.0.0.2".parse().unwrap()));
        other.set(100).unwrap();
        let (tx, inner) = channel_body();
        let mut body = arriving(&budget, false, inner);
        send(&tx, &message(50)).await;
        drop(tx);
        assert!(matches!(poll_once(&mut body), Some(Some(Ok(_)))));
        assert!(matches!(poll_once(&mut body), Some(None)));
        assert_eq!(budget.held(), (100, 100));
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_may_idle_between_messages_but_not_within_one() {
        let budget = ReceiveBudget::with_bounds(TrustedSources::default(), bounds(1_000, 500, 500));
        let (tx, inner) = channel_body();
        let mut body = arriving(&budget, true, inner);
        let first_by = body.deadline.unwrap();
        // The first message keeps the call's deadline, even when its first byte comes late.
        tokio::time::sleep(RECEIVE_TIMEOUT / 2).await;
        send(&tx, &message(20)[..3]).await;
        body.frame().await.unwrap().unwrap();
        assert_eq!(body.deadline, Some(first_by));
        send(&tx, &message(20)[3..]).await;
        body.frame().await.unwrap().unwrap();
        // Between messages: no deadline; the head and the largest message stay counted.
        let next = tokio::time::timeout(RECEIVE_TIMEOUT * 3, body.frame()).await;
        assert!(next.is_err(), "a stream between messages was cut");
        assert_eq!(budget.held(), (60, 60));
        // An empty frame changes nothing.
        send(&tx, &[]).await;
        body.frame().await.unwrap().unwrap();
        assert_eq!(body.deadline, None);
        // Half a message, then nothing: cut at the timeout from its first byte.
        send(&tx, &message(20)[..12]).await;
        body.frame().await.unwrap().unwrap();
        let waited = Instant::now();
        let err = body.frame().await.unwrap().unwrap_err();
        assert_eq!(waited.elapsed(), RECEIVE_TIMEOUT);
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert_eq!(budget.held(), (0, 0));
    }

    #[tokio::test]
    async fn reflection_calls_hold_a_place_for_their_life_and_are_refused_beyond() {
        let budget = ReceiveBudget::new(TrustedSources::default());
        let mut service =
            budget.reflection(tower::service_fn(|req: http::Request<Body>| async move {
                // Keeps the request stream for the call's life, as reflection does.
                Ok::<_, Infallible>(http::Response::new(Body::new(RequestKept {
                    _request: req.into_body(),
                })))
            }));
        let call = |service: &mut Receiving<_>| {
            // A request stream still open, as reflection's are while the call lives.
            let mut req = http::Request::new(channel_body().1);
            req.extensions_mut().insert(TcpConnectInfo {
                local_addr: None,
                remote_addr: Some("10.0.0.1:5000".parse().unwrap()),
            });
            tower::Service::call(service, req)
        };
        let mut kept = Vec::new();
        for _ in 0..REFLECTION_CALLS_PER_SOURCE_MAX {
            let answer = call(&mut service).await.unwrap();
            assert!(answer.headers().get("grpc-status").is_none());
            kept.push(answer);
        }
        let refused = call(&mut service).await.unwrap();
        assert_eq!(
            refused.headers().get("grpc-status").unwrap(),
            "8",
            "RESOURCE_EXHAUSTED"
        );
        // A call that ends gives its place back.
        drop(kept.pop());
        let again = call(&mut service).await.unwrap();
        assert!(again.headers().get("grpc-status").is_none());
    }

    #[tokio::test]
    async fn health_watches_hold_a_place_for_their_answer_stream_and_checks_none() {
        let budget = ReceiveBudget::new(TrustedSources::default());
        // Answers at once with a stream that never ends; the request is dropped, as tonic does
        // once a server-streaming call has its message.
        let mut service = budget.health(tower::service_fn(|_req: http::Request<Body>| async {
            Ok::<_, Infallible>(http::Response::new(Body::new(RequestKept {
                _request: Body::empty(),
            })))
        }));
        let call = |service: &mut Receiving<_>, path: &str| {
            let mut req = http::Request::new(Body::empty());
            *req.uri_mut() = path.parse().unwrap();
            req.extensions_mut().insert(TcpConnectInfo {
                local_addr: None,
                remote_addr: Some("10.0.0.1:5000".parse().unwrap()),
            });
            tower::Service::call(service, req)
        };
        let mut watches = Vec::new();
        for _ in 0..WATCH_STREAMS_PER_SOURCE_MAX {
            let answer = call(&mut service, HEALTH_WATCH).await.unwrap();
            assert!(answer.headers().get("grpc-status").is_none());
            watches.push(answer);
        }
        let refused = call(&mut service, HEALTH_WATCH).await.unwrap();
        assert_eq!(
            refused.headers().get("grpc-status").unwrap(),
            "12",
            "UNIMPLEMENTED"
        );
        // Check takes no place.
        let check = call(&mut service, "/grpc.health.v1.Health/Check")
            .await
            .unwrap();
        assert!(check.headers().get("grpc-status").is_none());
        // A Watch whose answer stream ends gives its place back.
        drop(watches.pop());
        let again = call(&mut service, HEALTH_WATCH).await.unwrap();
        assert!(again.headers().get("grpc-status").is_none());
    }

    /// An answer body that keeps the request's until it is dropped.
    struct RequestKept {
        _request: Body,
    }

    impl http_body::Body for RequestKept {
        type Data = Bytes;
        type Error = Status;
        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
            Poll::Pending
        }
    }
}

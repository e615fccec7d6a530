//! The request handler: reads pass through; writes are checked by the epoch store, forwarded
//! while the store's permit is held, and the permit is released with what became of the forward.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fence_epoch_store::{Admission, EpochStore, ForwardOutcome, Permit, StoreError};
use http::header::{self, HeaderMap, HeaderName};
use http::{Method, Request, Response, Uri};
use http_body_util::BodyExt;
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use lockd_fence::Fence;
use tokio::sync::{Semaphore, oneshot};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::binding::ResourceBinding;
use crate::exchange::{BodyEnd, BoxError, TrackedBody};
use crate::fence::read_fence;
use crate::metrics::{self as m, FRONTEND};
use crate::tls::UpstreamConnector;
use crate::upstream::{PooledBody, SendError, UpstreamPool};
use crate::{Refusal, Upstream};

/// Body of every response the proxy sends: the upstream's, streamed, or the proxy's own JSON.
pub type ProxyBody = BoxBody<Bytes, BoxError>;

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1): never forwarded.
/// Headers named in `Connection` are dropped too.
const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Headers that upstream frameworks read as the request's original host, path or prefix when
/// they trust a proxy in front (Rails, Express and Django: `X-Forwarded-Host`; Spring:
/// `Forwarded`, `X-Forwarded-Prefix`; Symfony, Zend and IIS URL Rewrite: `X-Original-URL`,
/// `X-Rewrite-URL`). Under `--bind-resource` they are removed from writes: the client's copy would
/// route a write bound to one path to another object. Not exhaustive: an upstream that takes
/// its route from another header must not trust the client's copy.
const ROUTING_HEADERS: [HeaderName; 13] = [
    header::FORWARDED,
    HeaderName::from_static("x-forwarded-host"),
    HeaderName::from_static("x-forwarded-prefix"),
    HeaderName::from_static("x-forwarded-server"),
    HeaderName::from_static("x-forwarded-uri"),
    HeaderName::from_static("x-forwarded-path"),
    HeaderName::from_static("x-envoy-original-path"),
    HeaderName::from_static("x-script-name"),
    HeaderName::from_static("x-original-url"),
    HeaderName::from_static("x-original-uri"),
    HeaderName::from_static("x-rewrite-url"),
    HeaderName::from_static("x-original-host"),
    HeaderName::from_static("x-host"),
];

/// `Fencing-Token`, as the proxy sets it on a forwarded write.
const FENCING_TOKEN: HeaderName = HeaderName::from_static("fencing-token");

/// How long past the exchange deadline the write task waits for the bodies to report that they
/// were cut off, before it decides on its own that the outcome is unknown.
const DEADLINE_REPORT_GRACE: Duration = Duration::from_millis(100);

/// What the handler needs besides the store.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Where writes and reads are forwarded.
    pub upstream: Upstream,
    /// How long the upstream may take to send its response head; for a write, also the bound on
    /// its whole exchange (request body sent, response received), after which it is cut off.
    pub upstream_timeout: Duration,
    /// Verify keys and `--allow-unsigned`; `None`: plain tokens, not authenticated.
    pub verification: Option<Arc<crate::verify::Verification>>,
    /// `--bind-resource`: whether a write's resource must name its path.
    pub resource_binding: ResourceBinding,
    /// `--upstream-reuse-after-body`: a POST, PUT or PATCH with a body keeps its upstream
    /// connection (otherwise every request with a body closes it).
    pub reuse_after_body: bool,
}

/// The proxy's state, shared by all connections.
pub struct Proxy {
    config: ProxyConfig,
    /// Decides writes and orders them by token per resource; `dyn` so the store is chosen at run
    /// time.
    store: Arc<dyn EpochStore>,
    /// Connection pools to the upstream for writes, one per thread that forwards writes (see
    /// [`Proxy::write_client`]). Request bodies are wrapped so that a write's permit is held
    /// until its body has been sent completely.
    write_clients: WriteClients,
    /// Connections for reads, driven by the task that forwards each read.
    reads: Arc<UpstreamPool>,
    /// Write tasks in flight, awaited on shutdown so that their permits are released.
    writes: TaskTracker,
    /// One slot per write task, `--max-in-flight` of them, taken before the task is spawned and
    /// held until it ends: a task outlives its request when the client goes away (an h2 reset
    /// frees the request's own slot at once), and without this bound a client that resets
    /// every write could leave any number of them queued behind a quarantine.
    write_slots: Arc<Semaphore>,
}

/// hyper-util's client drives each pooled connection in a task on the runtime that opened it; one
/// client per thread keeps a write's connection on the thread that serves the write, so that no
/// request or response crosses threads (the connection threads of `fence-proxy-net`).
type WriteClient = Client<UpstreamConnector, TrackedBody<Incoming>>;
struct WriteClients {
    connector: UpstreamConnector,
    by_thread: std::sync::Mutex<Vec<(std::thread::ThreadId, WriteClient)>>,
}

impl Proxy {
    /// A proxy forwarding to `config.upstream`, admitting writes through `store`, with at most
    /// `max_writes` write tasks at a time. Write tasks run on the runtime of the request that
    /// starts them.
    pub fn new(config: ProxyConfig, store: Arc<dyn EpochStore>, max_writes: usize) -> Arc<Self> {
        let connector = UpstreamConnector::new(&config.upstream);
        let reads = UpstreamPool::new(&config.upstream);
        Arc::new(Proxy {
            config,
            store,
            write_clients: WriteClients {
                connector,
                by_thread: std::sync::Mutex::default(),
            },
            reads,
            writes: TaskTracker::new(),
            write_slots: Arc::new(Semaphore::new(max_writes)),
        })
    }

    /// The write client of the calling thread (made on its first write).
    fn write_client(&self) -> WriteClient {
        let thread = std::thread::current().id();
        let mut clients = self
            .write_clients
            .by_thread
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, client)) = clients.iter().find(|(t, _)| *t == thread) {
            return client.clone();
        }
        // As the read pool: idle connections bounded per thread and closed after a while, so
        // that a pool per thread does not multiply what one pool would keep.
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .pool_idle_timeout(crate::upstream::IDLE_TIMEOUT)
            .pool_max_idle_per_host(crate::upstream::MAX_IDLE)
            .build(self.write_clients.connector.clone());
        clients.push((thread, client.clone()));
        client
    }

    pub(crate) fn writes(&self) -> &TaskTracker {
        &self.writes
    }

    /// Handles one request; never fails, every error becomes a proxy-made response.
    pub async fn handle(
        self: Arc<Self>,
        request: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, Infallible> {
        // A transfer coding besides `chunked` (`gzip, chunked`): hyper takes the chunks off and
        // nothing else, and the proxy forwards the body chunked: the upstream would apply the
        // compressed bytes as the body. Refused, as RFC 9112 6.1 has a server do with a coding
        // it does not implement.
        if let Some(coding) = unsupported_transfer_coding(request.headers()) {
            return Ok(refuse(Refusal::UnsupportedTransferCoding { coding }));
        }
        if is_read(request.method()) {
            let request = request.map(TrackedBody::untracked);
            let deadline = Instant::now() + self.config.upstream_timeout;
            let response = match self.forward_read(request, deadline).await {
                Ok(response) => {
                    m::count(m::RESULT_PASSTHROUGH);
                    response.map(|body| body.boxed())
                }
                Err(refusal) => refuse(refusal),
            };
            return Ok(response);
        }
        let fence = match read_fence(request.headers(), self.config.verification.as_deref()) {
            Ok(fence) => fence,
            Err(refusal) => return Ok(refuse(refusal)),
        };
        let path = request.uri().path();
        if let Err(detail) = self.config.resource_binding.check(&fence.resource, path) {
            return Ok(refuse(Refusal::BadFence {
                resource: Some(fence.resource),
                token: Some(fence.token),
                detail,
            }));
        }
        // The upstream gets the token the proxy ordered the write by, in one spelling: `0042`
        // is 42 here, but an upstream comparing text would order it below `5`; and a write
        // fenced by a sequencer alone gets the header too, for an upstream that checks it.
        let mut request = request;
        request
            .headers_mut()
            .insert(FENCING_TOKEN, http::HeaderValue::from(fence.token.0));
        // The write runs in its own task: if the client goes away, the task still follows the
        // exchange to its end and releases the permit with the right outcome instead of being
        // cancelled half-way. It hands the response over as soon as the head is there and keeps
        // the permit until both bodies have ended.
        // It runs on the thread that serves the request (a connection thread), with that
        // thread's upstream connections: no hand-off between threads per write. The drain waits
        // for it, and if the drain gives up, the threads are kept until the write tasks end
        // (`server`); a write cut off all the same (the process exits) has its permit dropped,
        // which quarantines the resource (the redb store for `--upstream-timeout` +
        // `--quarantine`; the Postgres store's `busy_until` stays set).
        // The slot is taken here, where waiting is still cancellable: a client that goes away
        // now leaves nothing behind.
        let slot = self
            .write_slots
            .clone()
            .acquire_owned()
            .await
            .expect("the write slots are never closed");
        // The client's place (`--max-in-flight-per-client`) goes with the task too: a client
        // that resets its writes leaves at most its own bound of tasks behind, so the others
        // still find write slots.
        let place = request
            .extensions()
            .get::<crate::per_client::HeldPlace>()
            .and_then(crate::per_client::HeldPlace::take);
        let (respond, response) = oneshot::channel();
        let this = self.clone();
        self.writes.spawn_on(
            async move {
                let _slot = slot;
                let _place = place;
                this.write(request, fence, respond).await
            },
            &tokio::runtime::Handle::current(),
        );
        Ok(match response.await {
            Ok(response) => response,
            // The task panicked before answering: its permit was released as Unknown by its drop.
            Err(_) => refuse(Refusal::UpstreamError {
                resource: None,
                token: None,
                detail: "internal error while forwarding".to_owned(),
                maybe_applied: true,
            }),
        })
    }

    async fn write(
        &self,
        request: Request<Incoming>,
        fence: Fence,
        respond: oneshot::Sender<Response<ProxyBody>>,
    ) {
        let Fence { resource, token } = fence;
        let mut respond = respond;
        // A client that goes away before its write is admitted leaves nothing to follow, and
        // its write is not forwarded. Where the store allows it the admission is dropped at
        // once, so that the write slot is free again: otherwise writes reset by their client
        // would hold their slots for as long as a quarantine keeps them waiting. Elsewhere the
        // admission ends and its permit is released unused.
        let admitted = {
            let admission = self.store.admit(&resource, token);
            tokio::pin!(admission);
            tokio::select! {
                biased;
                admitted = &mut admission => admitted,
                () = respond.closed() => {
                    tracing::debug!(%resource, %token, "the client went away before the write was admitted; not forwarded");
                    if !self.store.admission_cancel_safe()
                        && let Ok(Admission::Accepted(permit)) = admission.await
                    {
                        self.release(permit, ForwardOutcome::NotSent).await;
                    }
                    return;
                }
            }
        };
        // The client may have gone in the instant the admission ended: nothing to forward to.
        if respond.is_closed() {
            if let Ok(Admission::Accepted(permit)) = admitted {
                self.release(permit, ForwardOutcome::NotSent).await;
            }
            return;
        }
        // A send fails only when the client has gone; the response is then dropped, which ends
        // its body as abandoned.
        let reply = |response| {
            let _ = respond.send(response);
        };
        let permit = match admitted {
            Ok(Admission::Accepted(permit)) => permit,
            Ok(Admission::Stale { highest }) => {
                metrics::counter!(m::STALE_REJECTIONS_TOTAL, "frontend" => FRONTEND).increment(1);
                return reply(refuse(Refusal::Stale {
                    resource,
                    token,
                    highest,
                }));
            }
            Err(e @ StoreError::Busy { .. }) => {
                return reply(refuse(Refusal::ResourceBusy {
                    resource,
                    token,
                    detail: e.to_string(),
                }));
            }
            Err(e @ StoreError::ResourceLimit { .. }) => {
                // Counted (`result="resource-limit"`), not logged at warn: a client naming
                // fresh resources would otherwise fill the log as it would have filled the store.
                return reply(refuse(Refusal::ResourceLimit {
                    resource,
                    token,
                    detail: e.to_string(),
                }));
            }
            Err(e @ StoreError::TokenOutOfRange { .. }) => {
                return reply(refuse(Refusal::BadFence {
                    resource: Some(resource),
                    token: Some(token),
                    detail: e.to_string(),
                }));
            }
            Err(e) => {
                tracing::warn!(%resource, %token, error = %e, "epoch store unavailable; failing closed");
                return reply(refuse(Refusal::StoreUnavailable {
                    resource,
                    token,
                    detail: e.to_string(),
                }));
            }
        };
        // One deadline for the whole exchange: response head, request body and response body.
        // Past it both bodies are cut off and the outcome is unknown (quarantine).
        let deadline = Instant::now() + self.config.upstream_timeout;
        let (request, request_end) = {
            let (parts, body) = request.into_parts();
            let h2 = parts.version == http::Version::HTTP_2;
            let (body, end) = TrackedBody::tracked(body, deadline, h2);
            (Request::from_parts(parts, body), end)
        };
        let (result, outcome) = self
            .forward(request, Some((&resource, token)), deadline)
            .await;
        let response = match result {
            Ok(response) => response,
            Err(refusal) => {
                // The forward failed before a response head: its outcome is already decided
                // (nothing sent, or unknown), whatever became of the request body.
                self.release(permit, outcome).await;
                return reply(refuse(refusal));
            }
        };
        // A success that arrives before the request body has gone upstream whole is only a
        // promise: if the rest of the body then fails to get there (the upstream closes
        // mid-body, the connection breaks), the upstream never had the write. So a 2xx head is
        // held until the body has been sent, and the client learns of a failure instead.
        let mut request_end = request_end;
        let mut request_ended = None;
        if response.status().is_success() {
            let end =
                match tokio::time::timeout_at(deadline + DEADLINE_REPORT_GRACE, &mut request_end)
                    .await
                {
                    Ok(Ok(end)) => end,
                    // The body was dropped without a word: only its task going away does that.
                    Ok(Err(_)) => BodyEnd::Abandoned,
                    Err(_) => BodyEnd::TimedOut,
                };
            if end != BodyEnd::Complete {
                let status = response.status();
                drop(response);
                tracing::debug!(%resource, %token, %status, ?end, "success answered before the request body was sent whole");
                self.release(permit, ForwardOutcome::Unknown).await;
                return reply(refuse(Refusal::UpstreamError {
                    detail: format!(
                        "{} answered {status} before it had the whole request body, then the body could not be sent ({end:?})",
                        self.config.upstream
                    ),
                    resource: Some(resource),
                    token: Some(token),
                    maybe_applied: true,
                }));
            }
            request_ended = Some(end);
        }
        m::count(m::RESULT_FORWARDED);
        let (parts, body) = response.into_parts();
        let (body, response_end) = TrackedBody::tracked(body, deadline, false);
        reply(Response::from_parts(parts, body.boxed()));
        let request_end = async move {
            match request_ended {
                Some(end) => Ok(end),
                None => request_end.await,
            }
        };
        let outcome = exchange_outcome(request_end, response_end, deadline).await;
        if outcome != ForwardOutcome::Answered {
            tracing::debug!(%resource, %token, ?outcome, "write exchange did not end cleanly");
        }
        self.release(permit, outcome).await;
    }

    async fn release(&self, permit: Permit, outcome: ForwardOutcome) {
        let (resource, token) = (permit.resource().to_owned(), permit.token());
        if let Err(e) = permit.release(outcome).await {
            tracing::warn!(%resource, %token, ?outcome, error = %e, "releasing the resource after a forward");
        }
    }

    /// Sends the request upstream and waits (until `deadline`) for the response head. Returns
    /// what the permit needs to know if no head came: whether the upstream may have applied it.
    async fn forward(
        &self,
        request: Request<TrackedBody<Incoming>>,
        fence: Option<(&str, lockd_fence::FencingToken)>,
        deadline: Instant,
    ) -> (Result<Response<Incoming>, Refusal>, ForwardOutcome) {
        let request = match self.upstream_request(request, fence) {
            Ok(request) => request,
            Err(refusal) => return (Err(refusal), ForwardOutcome::NotSent),
        };
        match timed(deadline, self.write_client().request(request)).await {
            Ok(Ok(response)) => (Ok(strip_response(response)), ForwardOutcome::Answered),
            Ok(Err(e)) => {
                let not_sent = e.is_connect();
                let refusal = self.upstream_error(fence, format!("{e:?}"), not_sent);
                let outcome = if not_sent {
                    ForwardOutcome::NotSent
                } else {
                    ForwardOutcome::Unknown
                };
                (Err(refusal), outcome)
            }
            Err(_) => (Err(self.upstream_timeout(fence)), ForwardOutcome::Unknown),
        }
    }

    /// A read's forward: the same as [`Proxy::forward`], on a connection this task drives itself.
    async fn forward_read(
        &self,
        request: Request<TrackedBody<Incoming>>,
        deadline: Instant,
    ) -> Result<Response<PooledBody>, Refusal> {
        let request = self.upstream_request(request, None)?;
        match timed(deadline, self.reads.send(request)).await {
            Ok(Ok(response)) => Ok(strip_response(response)),
            Ok(Err(e)) => {
                let not_sent = matches!(e, SendError::Connect(_));
                Err(self.upstream_error(None, e.to_string(), not_sent))
            }
            Err(_) => Err(self.upstream_timeout(None)),
        }
    }

    /// The request as it goes upstream: the upstream's URL, no hop-by-hop headers, HTTP/1.1.
    fn upstream_request<B: http_body::Body>(
        &self,
        request: Request<B>,
        fence: Option<(&str, lockd_fence::FencingToken)>,
    ) -> Result<Request<B>, Refusal> {
        let (mut parts, body) = request.into_parts();
        parts.uri = self
            .upstream_uri(&parts.uri)
            .map_err(|detail| Refusal::UpstreamError {
                resource: fence.map(|f| f.0.to_owned()),
                token: fence.map(|f| f.1),
                detail,
                maybe_applied: false,
            })?;
        strip_hop_by_hop(&mut parts.headers);
        // A write bound to its path must not be routed elsewhere by headers of the client's
        // choosing: the upstream's own Host is set from the URL instead (as nginx does by
        // default), and the headers frameworks take as the "original" host or URL go.
        if fence.is_some() && self.config.resource_binding != ResourceBinding::Off {
            parts.headers.remove(header::HOST);
            // Also their spellings with '_', one and the same header to CGI-style servers.
            let routing: Vec<HeaderName> = parts
                .headers
                .keys()
                .filter(|name| {
                    ROUTING_HEADERS
                        .iter()
                        .any(|r| crate::fence::reads_as(name.as_str(), r.as_str()))
                })
                .cloned()
                .collect();
            for name in routing {
                parts.headers.remove(name);
            }
        }
        // `Expect: 100-continue` asks the upstream to answer before the body, but the proxy's
        // client sends the body at once: an upstream that answers early (417, or a final status
        // it takes as the end of the exchange) would read the body as the next request. The
        // proxy's own server side already answers 100 to the client when the body is read.
        parts.headers.remove(header::EXPECT);
        // A body: an upstream may answer the request without reading it (the method defines
        // none, or the upstream does not implement it: WebDAV's MOVE, a lowercase `put`, a
        // method of the client's naming, answered 405; or it answers early: a router's 404, an
        // authentication check's 401, its own fencing check's 412) and take the body for the
        // next request on the connection, a write of the client's choosing that no fence
        // checked ("CL.0" smuggling). The proxy cannot see whether the upstream read a body, so
        // nothing follows one on its connection: the upstream is told to close it after
        // answering. `--upstream-reuse-after-body` keeps it for POST, PUT and PATCH, whose
        // bodies an upstream that follows HTTP/1.1 reads or discards.
        let keeps = self.config.reuse_after_body && body_keeps_connection(&parts.method);
        if !body.is_end_stream() && !keeps {
            parts
                .headers
                .insert(header::CONNECTION, http::HeaderValue::from_static("close"));
        }
        // Always HTTP/1.1 towards the upstream; the client picks the wire version itself.
        parts.version = http::Version::HTTP_11;
        Ok(Request::from_parts(parts, body))
    }

    fn upstream_error(
        &self,
        fence: Option<(&str, lockd_fence::FencingToken)>,
        error: String,
        not_sent: bool,
    ) -> Refusal {
        Refusal::UpstreamError {
            resource: fence.map(|f| f.0.to_owned()),
            token: fence.map(|f| f.1),
            detail: format!("{} ({error})", self.config.upstream),
            maybe_applied: !not_sent,
        }
    }

    fn upstream_timeout(&self, fence: Option<(&str, lockd_fence::FencingToken)>) -> Refusal {
        Refusal::UpstreamTimeout {
            resource: fence.map(|f| f.0.to_owned()),
            token: fence.map(|f| f.1),
            timeout_ms: self.config.upstream_timeout.as_millis() as u64,
        }
    }

    fn upstream_uri(&self, uri: &Uri) -> Result<Uri, String> {
        let upstream = &self.config.upstream;
        let path_and_query = uri.path_and_query().map_or("/", |pq| pq.as_str());
        Uri::builder()
            .scheme(upstream.scheme.clone())
            .authority(upstream.authority.clone())
            .path_and_query(format!("{}{}", upstream.path_prefix, path_and_query))
            .build()
            .map_err(|e| format!("building the upstream URL for {uri}: {e}"))
    }
}

/// Waits until both bodies of a forwarded write have ended (or the deadline has passed) and says
/// what the permit must be released with. Only an exchange in which every byte went both ways is
/// `Answered`; anything else leaves a partial or unknown request at the upstream, which the
/// quarantine waits out.
async fn exchange_outcome(
    request_end: impl Future<Output = Result<BodyEnd, oneshot::error::RecvError>>,
    response_end: oneshot::Receiver<BodyEnd>,
    deadline: Instant,
) -> ForwardOutcome {
    // A body that is not being polled (its reader blocked on a full socket) cannot notice the
    // deadline itself, so the wait has its own; the grace lets a body that noticed it report so.
    let both = async { (request_end.await, response_end.await) };
    match tokio::time::timeout_at(deadline + DEADLINE_REPORT_GRACE, both).await {
        Ok((Ok(BodyEnd::Complete), Ok(BodyEnd::Complete))) => ForwardOutcome::Answered,
        _ => ForwardOutcome::Unknown,
    }
}

/// Waits for a response head until `deadline`, and records how long the upstream took.
async fn timed<T>(
    deadline: Instant,
    sent: impl Future<Output = T>,
) -> Result<T, tokio::time::error::Elapsed> {
    let started = std::time::Instant::now();
    let sent = tokio::time::timeout_at(deadline, sent).await;
    metrics::histogram!(m::FORWARD_DURATION_SECONDS, "frontend" => FRONTEND)
        .record(started.elapsed().as_secs_f64());
    sent
}

/// The upstream's response without its hop-by-hop headers.
fn strip_response<B>(response: Response<B>) -> Response<B> {
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, body)
}

/// GET, HEAD and OPTIONS pass unchecked; every other method, including ones this proxy does not
/// know (WebDAV's MKCOL, PROPPATCH...), counts as a write and needs a fence: failing closed.
fn is_read(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Methods whose request bodies an upstream that implements them reads before the next request
/// on the connection, under `--upstream-reuse-after-body`: POST, PUT and PATCH, exactly (methods
/// are case-sensitive, RFC 9110 §9.1: `put` is another method, which an upstream may answer 405
/// without reading its body). A body on any other method closes its upstream connection.
fn body_keeps_connection(method: &Method) -> bool {
    matches!(*method, Method::POST | Method::PUT | Method::PATCH)
}

/// The request's transfer coding when it is anything but `chunked` alone (hyper decodes only
/// that one): `None` without a `Transfer-Encoding` or with `chunked`.
fn unsupported_transfer_coding(headers: &http::HeaderMap) -> Option<String> {
    let values: Vec<&http::HeaderValue> =
        headers.get_all(header::TRANSFER_ENCODING).iter().collect();
    if values.is_empty() {
        return None;
    }
    let text: Vec<String> = values
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect();
    // Empty list elements (`, chunked`) are ignored, as RFC 9110 5.6.1 has it.
    let codings: Vec<&str> = text
        .iter()
        .flat_map(|t| t.split(','))
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    match codings.as_slice() {
        [only] if only.eq_ignore_ascii_case("chunked") => None,
        _ => Some(text.join(", ")),
    }
}

fn refuse(refusal: Refusal) -> Response<ProxyBody> {
    m::count(refusal.reason());
    tracing::debug!(reason = refusal.reason(), message = %refusal.message(), "refused");
    refusal.into_response()
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in HOP_BY_HOP.iter().chain(named.iter()) {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_go_conditional_ones_stay() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "keep-alive, x-private".parse().unwrap());
        h.insert("x-private", "1".parse().unwrap());
        h.insert(header::IF_MATCH, "\"v1\"".parse().unwrap());
        h.insert(
            header::IF_UNMODIFIED_SINCE,
            "Sat, 01 Jan 2000 00:00:00 GMT".parse().unwrap(),
        );
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        strip_hop_by_hop(&mut h);
        let mut left: Vec<_> = h.keys().map(|k| k.as_str()).collect();
        left.sort();
        assert_eq!(left, ["if-match", "if-unmodified-since"]);
    }

    /// Goal: only `chunked` alone passes (any case, empty list elements ignored); any other
    /// coding, alone, before it or repeated, is named back for the 501.
    #[test]
    fn only_chunked_alone_is_a_supported_transfer_coding() {
        let te = |values: &[&str]| {
            let mut h = http::HeaderMap::new();
            for v in values {
                h.append(header::TRANSFER_ENCODING, v.parse().unwrap());
            }
            unsupported_transfer_coding(&h)
        };
        assert_eq!(te(&[]), None);
        for ok in [
            &["chunked"][..],
            &["Chunked"],
            &[", chunked"],
            &[" chunked ,"],
        ] {
            assert_eq!(te(ok), None, "{ok:?}");
        }
        for bad in [
            &["gzip, chunked"][..],
            &["gzip", "chunked"],
            &["chunked, chunked"],
            &["chunked", "chunked"],
            &["identity"],
        ] {
            assert!(te(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn only_post_put_and_patch_bodies_keep_the_upstream_connection() {
        for method in ["POST", "PUT", "PATCH"] {
            assert!(body_keeps_connection(&method.parse().unwrap()), "{method}");
        }
        for method in [
            "put",
            "Post",
            "MOVE",
            "PROPFIND",
            "DELETE",
            "GET",
            "FROBNICATE",
        ] {
            assert!(!body_keeps_connection(&method.parse().unwrap()), "{method}");
        }
    }
}

//! The request handler: reads pass through; writes are checked by the epoch store, forwarded
//! while the store's permit is held, and the permit is released with what became of the forward.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fence_epoch_store::{Admission, EpochStore, ForwardOutcome, StoreError};
use http::header::{self, HeaderMap, HeaderName};
use http::{Method, Request, Response, Uri};
use http_body_util::BodyExt;
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use lockd_fence::Fence;
use tokio_util::task::TaskTracker;

use crate::fence::read_fence;
use crate::metrics::{self as m, FRONTEND};
use crate::{Refusal, Upstream};

/// Body of every response the proxy sends: the upstream's, streamed, or the proxy's own JSON.
pub type ProxyBody = BoxBody<Bytes, hyper::Error>;

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

/// What the handler needs besides the store.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    pub upstream: Upstream,
    /// How long the upstream may take to send its response head.
    pub upstream_timeout: Duration,
}

/// The proxy's state, shared by all connections.
pub struct Proxy {
    config: ProxyConfig,
    /// Decides and serialises writes; `dyn` so the store is chosen at run time.
    store: Arc<dyn EpochStore>,
    /// Connection pool to the upstream.
    client: Client<HttpConnector, Incoming>,
    /// Write tasks in flight, awaited on shutdown so that their permits are released.
    writes: TaskTracker,
}

impl Proxy {
    pub fn new(config: ProxyConfig, store: Arc<dyn EpochStore>) -> Arc<Self> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Arc::new(Proxy {
            config,
            store,
            client,
            writes: TaskTracker::new(),
        })
    }

    pub(crate) fn writes(&self) -> &TaskTracker {
        &self.writes
    }

    /// Handles one request; never fails, every error becomes a proxy-made response.
    pub async fn handle(
        self: Arc<Self>,
        request: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, Infallible> {
        if is_read(request.method()) {
            let response = match self.forward(request, None).await.0 {
                Ok(response) => {
                    m::count(m::RESULT_PASSTHROUGH);
                    response
                }
                Err(refusal) => refuse(refusal),
            };
            return Ok(response);
        }
        let fence = match read_fence(request.headers()) {
            Ok(fence) => fence,
            Err(refusal) => return Ok(refuse(refusal)),
        };
        // The write runs in its own task: if the client goes away, the task still finishes the
        // forward and releases the permit with the right outcome instead of being cancelled
        // half-way.
        let this = self.clone();
        let task = self
            .writes
            .spawn(async move { this.write(request, fence).await });
        Ok(match task.await {
            Ok(response) => response,
            // The task panicked: its permit was released as Unknown by its drop.
            Err(e) => refuse(Refusal::UpstreamError {
                resource: None,
                token: None,
                detail: format!("internal error while forwarding: {e}"),
                maybe_applied: true,
            }),
        })
    }

    async fn write(&self, request: Request<Incoming>, fence: Fence) -> Response<ProxyBody> {
        let Fence { resource, token } = fence;
        let permit = match self.store.admit(&resource, token).await {
            Ok(Admission::Accepted(permit)) => permit,
            Ok(Admission::Stale { highest }) => {
                metrics::counter!(m::STALE_REJECTIONS_TOTAL, "frontend" => FRONTEND).increment(1);
                return refuse(Refusal::Stale {
                    resource,
                    token,
                    highest,
                });
            }
            Err(e @ StoreError::Busy { .. }) => {
                return refuse(Refusal::ResourceBusy {
                    resource,
                    token,
                    detail: e.to_string(),
                });
            }
            Err(e @ StoreError::TokenOutOfRange { .. }) => {
                return refuse(Refusal::BadFence {
                    resource: Some(resource),
                    token: Some(token),
                    detail: e.to_string(),
                });
            }
            Err(e) => {
                tracing::warn!(%resource, %token, error = %e, "epoch store unavailable; failing closed");
                return refuse(Refusal::StoreUnavailable {
                    resource,
                    token,
                    detail: e.to_string(),
                });
            }
        };
        let (result, outcome) = self.forward(request, Some((&resource, token))).await;
        if let Err(e) = permit.release(outcome).await {
            tracing::warn!(%resource, %token, ?outcome, error = %e, "releasing the resource after a forward");
        }
        match result {
            Ok(response) => {
                m::count(m::RESULT_FORWARDED);
                response
            }
            Err(refusal) => refuse(refusal),
        }
    }

    /// Sends the request upstream and waits for the response head. Returns what the permit
    /// needs to know: whether the upstream may have applied the request.
    async fn forward(
        &self,
        request: Request<Incoming>,
        fence: Option<(&str, lockd_fence::FencingToken)>,
    ) -> (Result<Response<ProxyBody>, Refusal>, ForwardOutcome) {
        let (mut parts, body) = request.into_parts();
        parts.uri = match self.upstream_uri(&parts.uri) {
            Ok(uri) => uri,
            Err(detail) => {
                let refusal = Refusal::UpstreamError {
                    resource: fence.map(|f| f.0.to_owned()),
                    token: fence.map(|f| f.1),
                    detail,
                    maybe_applied: false,
                };
                return (Err(refusal), ForwardOutcome::NotSent);
            }
        };
        strip_hop_by_hop(&mut parts.headers);
        // Always HTTP/1.1 towards the upstream; the client picks the wire version itself.
        parts.version = http::Version::HTTP_11;
        let request = Request::from_parts(parts, body);

        let started = Instant::now();
        let sent = tokio::time::timeout(self.config.upstream_timeout, self.client.request(request));
        let sent = sent.await;
        metrics::histogram!(m::FORWARD_DURATION_SECONDS, "frontend" => FRONTEND)
            .record(started.elapsed().as_secs_f64());
        let resource = || fence.map(|f| f.0.to_owned());
        let token = fence.map(|f| f.1);
        match sent {
            Ok(Ok(response)) => {
                let (mut parts, body) = response.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                (
                    Ok(Response::from_parts(parts, body.boxed())),
                    ForwardOutcome::Answered,
                )
            }
            Ok(Err(e)) => {
                let not_sent = e.is_connect();
                let refusal = Refusal::UpstreamError {
                    resource: resource(),
                    token,
                    detail: format!("{} ({e:?})", self.config.upstream),
                    maybe_applied: !not_sent,
                };
                let outcome = if not_sent {
                    ForwardOutcome::NotSent
                } else {
                    ForwardOutcome::Unknown
                };
                (Err(refusal), outcome)
            }
            Err(_) => (
                Err(Refusal::UpstreamTimeout {
                    resource: resource(),
                    token,
                    timeout_ms: self.config.upstream_timeout.as_millis() as u64,
                }),
                ForwardOutcome::Unknown,
            ),
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

/// GET, HEAD and OPTIONS pass unchecked; every other method, including ones this proxy does not
/// know (WebDAV's MKCOL, PROPPATCH...), counts as a write and needs a fence: failing closed.
fn is_read(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
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
}

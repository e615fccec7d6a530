//! The metrics and health listener: `GET /metrics` (Prometheus text), `GET /healthz` (200 while
//! the process is up) and `GET /readyz` (200 or 503 with a one-line reason, as the service
//! decides). It serves plain TCP or any stream of connections, such as lockd's TLS listener.

use std::convert::Infallible;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// Content type of `/metrics`: the Prometheus text exposition format.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How long shutdown waits for the requests of open connections (a scrape in progress) to end;
/// connections still open after it are dropped.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Pause after a failed `accept` (out of file descriptors, say), so that the loop does not spin
/// while the condition lasts.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);

/// What a service answers on the listener.
pub trait Endpoints: Send + Sync + 'static {
    /// The Prometheus text of `/metrics`.
    fn metrics(&self) -> String;

    /// `/readyz`: `Ok(line)` answers 200 with it, `Err(line)` 503 with it. Must not block: a
    /// load balancer polls it often, so it reports state kept by the service, never probes.
    fn readiness(&self) -> Result<String, String>;
}

/// Accepts on `listener` until `shutdown`; see [`serve`].
pub async fn serve_tcp(
    listener: TcpListener,
    endpoints: Arc<dyn Endpoints>,
    shutdown: CancellationToken,
) {
    serve(tcp_connections(listener), endpoints, shutdown).await
}

/// The connections `listener` accepts. After an error it pauses briefly before yielding it.
pub fn tcp_connections(listener: TcpListener) -> impl Stream<Item = io::Result<TcpStream>> {
    futures::stream::unfold(listener, |listener| async move {
        let accepted = match listener.accept().await {
            Ok((stream, _)) => Ok(stream),
            Err(e) => {
                tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                Err(e)
            }
        };
        Some((accepted, listener))
    })
}

/// Serves the endpoints on every connection `connections` yields (HTTP/1.1 or h2c), until
/// `shutdown`; then stops accepting and waits up to [`DRAIN_TIMEOUT`] for open requests. A
/// connection error (a failed accept or TLS handshake) is logged at debug level and skipped.
pub async fn serve<S, Io>(
    connections: S,
    endpoints: Arc<dyn Endpoints>,
    shutdown: CancellationToken,
) where
    S: Stream<Item = io::Result<Io>> + Send,
    Io: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let graceful = GracefulShutdown::new();
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let mut connections = std::pin::pin!(connections);
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            next = connections.next() => match next {
                Some(Ok(stream)) => stream,
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "metrics listener: connection failed");
                    continue;
                }
                None => break,
            },
        };
        let endpoints = endpoints.clone();
        let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
            let endpoints = endpoints.clone();
            async move { Ok::<_, Infallible>(answer(req.method(), req.uri().path(), &*endpoints)) }
        });
        let connection = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            let _ = connection.await;
        });
    }
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown()).await;
}

/// The response to one request; GET and HEAD only.
pub fn answer(method: &Method, path: &str, endpoints: &dyn Endpoints) -> Response<Full<Bytes>> {
    const TEXT: &str = "text/plain; charset=utf-8";
    let (status, content_type, body) = if method != Method::GET && method != Method::HEAD {
        (
            StatusCode::METHOD_NOT_ALLOWED,
            TEXT,
            format!("method {method} not allowed; use GET\n"),
        )
    } else {
        match path {
            "/metrics" => (StatusCode::OK, METRICS_CONTENT_TYPE, endpoints.metrics()),
            "/healthz" => (StatusCode::OK, TEXT, "ok\n".to_owned()),
            "/readyz" => match endpoints.readiness() {
                Ok(line) => (StatusCode::OK, TEXT, format!("{line}\n")),
                Err(line) => (StatusCode::SERVICE_UNAVAILABLE, TEXT, format!("{line}\n")),
            },
            other => (
                StatusCode::NOT_FOUND,
                TEXT,
                format!("no such path {other:?}; try /metrics, /healthz or /readyz\n"),
            ),
        }
    };
    let mut response = Response::builder()
        .status(status)
        .header(hyper::header::CONTENT_TYPE, content_type);
    if status == StatusCode::METHOD_NOT_ALLOWED {
        response = response.header(hyper::header::ALLOW, "GET, HEAD");
    }
    let body = if method == Method::HEAD {
        Bytes::new()
    } else {
        Bytes::from(body)
    };
    response
        .body(Full::new(body))
        .expect("static response parts are valid")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Endpoints whose readiness a test switches.
    #[derive(Default)]
    struct Fake {
        ready: AtomicBool,
    }

    impl Endpoints for Fake {
        fn metrics(&self) -> String {
            "fake_total 1\n".into()
        }
        fn readiness(&self) -> Result<String, String> {
            if self.ready.load(Ordering::Relaxed) {
                Ok("ready".into())
            } else {
                Err("not ready: upstream 127.0.0.1:1: connection refused".into())
            }
        }
    }

    async fn body(r: Response<Full<Bytes>>) -> String {
        let bytes = r.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn each_path_answers_as_documented() {
        let fake = Fake::default();
        let r = answer(&Method::GET, "/metrics", &fake);
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["content-type"], METRICS_CONTENT_TYPE);
        assert_eq!(body(r).await, "fake_total 1\n");
        let r = answer(&Method::GET, "/healthz", &fake);
        assert_eq!(
            (r.status(), body(r).await.as_str()),
            (StatusCode::OK, "ok\n")
        );
        let r = answer(&Method::GET, "/readyz", &fake);
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            body(r).await,
            "not ready: upstream 127.0.0.1:1: connection refused\n"
        );
        fake.ready.store(true, Ordering::Relaxed);
        let r = answer(&Method::GET, "/readyz", &fake);
        assert_eq!(
            (r.status(), body(r).await.as_str()),
            (StatusCode::OK, "ready\n")
        );
        let r = answer(&Method::GET, "/nope", &fake);
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        assert!(body(r).await.contains("\"/nope\""));
        let r = answer(&Method::POST, "/metrics", &fake);
        assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(r.headers()["allow"], "GET, HEAD");
        let r = answer(&Method::HEAD, "/healthz", &fake);
        assert_eq!((r.status(), body(r).await.as_str()), (StatusCode::OK, ""));
    }

    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_over_tcp_until_shutdown() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = Arc::new(Fake::default());
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve_tcp(listener, fake.clone(), shutdown.clone()));
        let r = get(addr, "/readyz").await;
        assert!(r.starts_with("HTTP/1.1 503"), "{r}");
        fake.ready.store(true, Ordering::Relaxed);
        let r = get(addr, "/readyz").await;
        assert!(
            r.starts_with("HTTP/1.1 200") && r.ends_with("ready\n"),
            "{r}"
        );
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("serve ends after shutdown")
            .unwrap();
        assert!(TcpStream::connect(addr).await.is_err(), "still accepting");
    }
}

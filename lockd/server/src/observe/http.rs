//! The metrics listener: `/metrics` (Prometheus text), `/healthz` (process up), `/readyz` (part of
//! a quorum with a known leader). With the node's TLS on, the listener speaks TLS with the node's
//! certificate too (a scraper trusts the CA that issued it; no client certificate is required).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio_util::sync::CancellationToken;

use crate::node::NodeCtx;

pub async fn serve(
    ctx: Arc<NodeCtx>,
    listen: SocketAddr,
    tls: Option<Arc<crate::tls::TlsHandle>>,
    peer_ips: Vec<std::net::IpAddr>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(ctx);
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("binding metrics listener {listen}: {e}"))?;
    match tls {
        Some(tls) => {
            let local = listener.local_addr()?;
            let tls_listener = TlsListener {
                local,
                incoming: Box::pin(crate::tls::incoming(
                    listener,
                    tls,
                    crate::tls::NodeTls::metrics_server,
                    peer_ips,
                    shutdown.clone(),
                )),
            };
            axum::serve(tls_listener, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await?
        }
        None => {
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await?
        }
    }
    Ok(())
}

type TlsConn = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;

/// The metrics listener's connections after their TLS handshake (`crate::tls::incoming`).
struct TlsListener {
    local: SocketAddr,
    incoming: std::pin::Pin<Box<dyn futures::Stream<Item = std::io::Result<TlsConn>> + Send>>,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsConn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TlsConn, SocketAddr) {
        use futures::StreamExt as _;
        loop {
            match self.incoming.next().await {
                Some(Ok(conn)) => {
                    let remote = conn.get_ref().0.peer_addr().unwrap_or(self.local);
                    return (conn, remote);
                }
                Some(Err(_)) => continue,
                // The accept loop ends only at shutdown; wait for the server to notice.
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

async fn metrics(State(ctx): State<Arc<NodeCtx>>) -> String {
    ctx.refresh_gauges();
    ctx.metrics.render()
}

async fn readyz(State(ctx): State<Arc<NodeCtx>>) -> (StatusCode, String) {
    match ctx.readiness() {
        Ok(msg) => (StatusCode::OK, format!("{msg}\n")),
        Err(msg) => (StatusCode::SERVICE_UNAVAILABLE, format!("{msg}\n")),
    }
}

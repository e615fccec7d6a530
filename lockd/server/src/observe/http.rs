//! The metrics listener: `/metrics` (Prometheus text), `/healthz` (process up), `/readyz` (part of
//! a quorum with a known leader).

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
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await?;
    Ok(())
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

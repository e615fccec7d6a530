//! The metrics listener: `/metrics` (Prometheus text), `/healthz` (process up), `/readyz` (part of
//! a quorum with a known leader). With the node's TLS on, the listener speaks TLS with the node's
//! certificate too (a scraper trusts the CA that issued it; no client certificate is required).
//! The HTTP side is `lockd_service_kit::endpoints`, shared with fence-proxy.

use std::net::SocketAddr;
use std::sync::Arc;

use lockd_service_kit::endpoints::{self, Endpoints};
use tokio_util::sync::CancellationToken;

use crate::node::NodeCtx;

/// What the listener answers for one node.
struct NodeEndpoints(Arc<NodeCtx>);

impl Endpoints for NodeEndpoints {
    fn metrics(&self) -> String {
        self.0.refresh_gauges();
        self.0.metrics.render()
    }

    fn readiness(&self) -> Result<String, String> {
        self.0.readiness()
    }
}

pub async fn serve(
    ctx: Arc<NodeCtx>,
    listen: SocketAddr,
    tls: Option<Arc<crate::tls::TlsHandle>>,
    peer_ips: lockd_service_kit::admission::TrustedSources,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("binding metrics listener {listen}: {e}"))?;
    let node = Arc::new(NodeEndpoints(ctx));
    match tls {
        Some(tls) => {
            let connections = crate::tls::incoming(
                listener,
                tls,
                crate::tls::NodeTls::metrics_server,
                crate::connections::slots(peer_ips.clone()),
                peer_ips,
                shutdown.clone(),
            );
            endpoints::serve(connections, node, shutdown).await
        }
        // The same bounds as the gRPC port's (`connections.rs`): without them anyone who
        // reaches this port could hold connections until the node ran out of descriptors.
        None => {
            let connections = crate::connections::plain_incoming(
                listener,
                crate::connections::slots(peer_ips),
                shutdown.clone(),
            );
            endpoints::serve(connections, node, shutdown).await
        }
    }
    Ok(())
}

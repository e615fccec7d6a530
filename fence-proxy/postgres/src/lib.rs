//! Postgres wire-protocol front end of fence-proxy (first increment: entry point only).

use std::net::SocketAddr;

use tokio_util::sync::CancellationToken;

/// Flags of `fence-proxy postgres`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Address the proxy accepts Postgres clients on.
    #[arg(long, default_value = "127.0.0.1:6432", env = "FENCE_PROXY_PG_LISTEN")]
    pub listen: SocketAddr,
    /// The Postgres server behind the proxy, as postgres://user@host:port/db.
    #[arg(long, env = "FENCE_PROXY_PG_UPSTREAM")]
    pub upstream: String,
    /// Sessions without a fence may only read.
    #[arg(long, env = "FENCE_PROXY_PG_REQUIRE_FENCE")]
    pub require_fence: bool,
    /// Connections of the proxy's own pool (schema setup), not of client sessions.
    #[arg(long, default_value_t = 2, env = "FENCE_PROXY_PG_POOL_SIZE")]
    pub pool_size: usize,
    /// Timeout for opening a TCP connection to the upstream.
    #[arg(long, default_value_t = 5_000, env = "FENCE_PROXY_PG_CONNECT_TIMEOUT_MS")]
    pub connect_timeout_ms: u64,
    /// Time a client has to finish its startup and authentication.
    #[arg(long, default_value_t = 30_000, env = "FENCE_PROXY_PG_STARTUP_TIMEOUT_MS")]
    pub startup_timeout_ms: u64,
}

/// Runs the proxy until `shutdown` is cancelled.
pub async fn run(args: Args, shutdown: CancellationToken) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("fence-proxy: cannot listen on {}: {e}", args.listen))?;
    tracing::info!(listen = %args.listen, upstream = %args.upstream, "postgres front end listening (relay not built yet)");
    shutdown.cancelled().await;
    drop(listener);
    Ok(())
}

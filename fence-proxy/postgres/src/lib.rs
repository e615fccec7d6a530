//! Postgres wire-protocol front end of fence-proxy: clients point their connection string at it,
//! and while a session has a fence (`SET lockd.fence = '<resource>:<token>'`), every transaction
//! first records the fence in the `lockd_fence` table inside that same upstream transaction, so a
//! stale holder's transaction fails with SQLSTATE 55P03 instead of overwriting a newer holder's
//! rows.
//!
//! It deliberately does not terminate TLS, authenticate clients or multiplex sessions onto shared
//! upstream connections: authentication passes through to the upstream, so each client session
//! owns one upstream connection for its lifetime (see `docs/fence-proxy-postgres.md`).
//!
//! # Layout
//! - [`Args`] and [`run`]: flags and the accept loop.
//! - `config`: settings shared by sessions.
//! - `limits`: every bound, with its reason.
//! - `codec`: length-bounded message framing.
//! - `startup`: SSL/cancel requests, startup packet, authentication relay.
//! - `session`: the relay and the fence placement.
//! - `sql`: statement splitting and classification.
//! - `fence_sql`, `fence_value`: the SQL the proxy runs and the fence value rules.
//! - `error`: proxy-made errors and their SQLSTATE table.
//! - `metrics_names`: metric names.

mod codec;
mod config;
mod error;
mod fence_sql;
mod fence_value;
pub mod limits;
mod metrics_names;
mod session;
mod sql;
mod startup;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::error::ProxyError;
use crate::fence_sql::FenceTable;
use crate::startup::Startup;

pub use crate::error::{
    ADMIN_SHUTDOWN, BAD_FENCE, CONNECTION_FAILURE, LIMIT_EXCEEDED, NOT_SUPPORTED,
    PROTOCOL_VIOLATION, STALE_TOKEN, TOO_MANY_CONNECTIONS,
};

/// Flags of `fence-proxy postgres`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Address the proxy accepts Postgres clients on.
    #[arg(long, default_value = "127.0.0.1:6432", env = "FENCE_PROXY_PG_LISTEN")]
    pub listen: SocketAddr,
    /// The Postgres server behind the proxy, as postgres://user@host:port/db. Clients connect
    /// to its host and port with their own user, database and credentials; the user and database
    /// of this URL serve the proxy's own pool (creating the fence table).
    #[arg(long, env = "FENCE_PROXY_PG_UPSTREAM")]
    pub upstream: String,
    /// Sessions without a fence may only read: each of their transactions is made read-only.
    #[arg(long, env = "FENCE_PROXY_PG_REQUIRE_FENCE")]
    pub require_fence: bool,
    /// Connections of the proxy's own pool (schema setup); client sessions never share them.
    #[arg(long, default_value_t = 2, env = "FENCE_PROXY_PG_POOL_SIZE")]
    pub pool_size: usize,
    /// Most concurrent client sessions; each holds one upstream connection.
    #[arg(long, default_value_t = limits::DEFAULT_MAX_SESSIONS, env = "FENCE_PROXY_PG_MAX_SESSIONS")]
    pub max_sessions: usize,
    /// Largest protocol message body accepted in either direction, in bytes.
    #[arg(long, default_value_t = limits::DEFAULT_MAX_MESSAGE_BYTES, env = "FENCE_PROXY_PG_MAX_MESSAGE_BYTES")]
    pub max_message_bytes: usize,
    /// Timeout for opening a TCP connection to the upstream, in milliseconds.
    #[arg(
        long,
        default_value_t = 5_000,
        env = "FENCE_PROXY_PG_CONNECT_TIMEOUT_MS"
    )]
    pub connect_timeout_ms: u64,
    /// Time a client has to finish its startup and authentication, in milliseconds.
    #[arg(
        long,
        default_value_t = 30_000,
        env = "FENCE_PROXY_PG_STARTUP_TIMEOUT_MS"
    )]
    pub startup_timeout_ms: u64,
    /// Table the fences are recorded in; qualify it (`public.lockd_fence`) if sessions change
    /// their search_path.
    #[arg(
        long,
        default_value = "lockd_fence",
        env = "FENCE_PROXY_PG_FENCE_TABLE"
    )]
    pub fence_table: String,
}

/// Runs the proxy until `shutdown` is cancelled; open sessions then end with FATAL 57P01.
pub async fn run(args: Args, shutdown: CancellationToken) -> anyhow::Result<()> {
    let fence_table = FenceTable::parse(&args.fence_table).map_err(|e| anyhow::anyhow!("{e}"))?;
    let pg_config: tokio_postgres::Config = args.upstream.parse().map_err(|e| {
        anyhow::anyhow!(
            "--upstream {:?} is not a postgres:// URL: {e}",
            args.upstream
        )
    })?;
    let host = match pg_config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        Some(_) => anyhow::bail!(
            "--upstream {:?}: only TCP hosts are supported, not Unix sockets",
            args.upstream
        ),
        None => anyhow::bail!("--upstream {:?} names no host", args.upstream),
    };
    let port = pg_config.get_ports().first().copied().unwrap_or(5432);
    anyhow::ensure!(args.max_sessions > 0, "--max-sessions must be at least 1");
    anyhow::ensure!(args.pool_size > 0, "--pool-size must be at least 1");
    let cfg = Arc::new(Config {
        upstream_addr: if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        },
        fence_table,
        require_fence: args.require_fence,
        max_message_bytes: args.max_message_bytes,
        connect_timeout: Duration::from_millis(args.connect_timeout_ms),
        startup_timeout: Duration::from_millis(args.startup_timeout_ms),
    });

    ensure_fence_table(pg_config, &cfg, args.pool_size).await;

    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("fence-proxy: cannot listen on {}: {e}", args.listen))?;
    tracing::info!(
        listen = %args.listen,
        upstream = %cfg.upstream_addr,
        require_fence = cfg.require_fence,
        "postgres front end listening"
    );
    let sessions = Arc::new(Semaphore::new(args.max_sessions));
    let tracker = TaskTracker::new();
    loop {
        let (mut stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let _ = stream.set_nodelay(true);
        let Ok(permit) = sessions.clone().try_acquire_owned() else {
            let e = ProxyError::fatal(
                error::TOO_MANY_CONNECTIONS,
                format!(
                    "sorry, too many clients already: {} sessions are open (--max-sessions)",
                    args.max_sessions
                ),
            );
            tracker.spawn(async move {
                let _ = stream.write_all(&e.to_message().frame).await;
            });
            continue;
        };
        let cfg = cfg.clone();
        let shutdown = shutdown.clone();
        tracker.spawn(async move {
            let _permit = permit;
            let startup = tokio::time::timeout(cfg.startup_timeout, startup::handshake(stream, cfg.clone()));
            let startup = tokio::select! {
                s = startup => s,
                // A client still authenticating is dropped at shutdown rather than waited for.
                () = shutdown.cancelled() => return,
            };
            let session = match startup {
                Ok(Ok(Startup::Session(s))) => s,
                Ok(Ok(Startup::Done)) => return,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, "startup ended: {e}");
                    return;
                }
                Err(_) => {
                    tracing::info!(%peer, timeout_ms = cfg.startup_timeout.as_millis() as u64, "client did not finish startup in time");
                    return;
                }
            };
            if let Err(e) = session.run(shutdown).await {
                tracing::debug!(%peer, "session ended: {e}");
            }
        });
    }
    tracker.close();
    tracker.wait().await;
    Ok(())
}

/// Creates the fence table through the proxy's own pool. A failure is not fatal: sessions create
/// the table themselves inside their first fenced transaction, and the upstream may come up later.
async fn ensure_fence_table(pg_config: tokio_postgres::Config, cfg: &Config, pool_size: usize) {
    let manager = deadpool_postgres::Manager::new(pg_config, tokio_postgres::NoTls);
    let pool = match deadpool_postgres::Pool::builder(manager)
        .max_size(pool_size)
        .wait_timeout(Some(cfg.connect_timeout))
        .create_timeout(Some(cfg.connect_timeout))
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
    {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!("building the upstream pool: {e}");
            return;
        }
    };
    let result = async {
        let client = pool.get().await.map_err(|e| e.to_string())?;
        client
            .batch_execute(&cfg.fence_table.create_sql())
            .await
            .map_err(|e| e.to_string())
    }
    .await;
    match result {
        Ok(()) => tracing::info!(table = cfg.fence_table.as_str(), "fence table ready"),
        Err(e) => tracing::warn!(
            table = cfg.fence_table.as_str(),
            upstream = %cfg.upstream_addr,
            "could not create the fence table now; sessions will create it when they need it: {e}"
        ),
    }
}

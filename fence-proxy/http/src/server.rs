//! Accepting connections, and shutting down without leaving a resource locked.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use fence_epoch_store::EpochStore;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceBuilder;
use tower::limit::ConcurrencyLimitLayer;
use tower_http::trace::TraceLayer;

use crate::{Args, Proxy, ProxyConfig};

/// How long shutdown waits for requests in flight: long enough for a forward that is already
/// waiting on a slow upstream to end, after which the permits of the ones left are released as
/// unknown (quarantine) by their drop.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Pause after a failed `accept` (for example too many open files), so that the loop does not
/// spin while the condition lasts.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);

/// Opens the store, binds `--listen`, and serves until `shutdown` is cancelled.
pub async fn run(args: Args, shutdown: CancellationToken) -> anyhow::Result<()> {
    crate::metrics::describe();
    let store = args
        .store
        .open(&args.store_options())
        .with_context(|| format!("opening the epoch store {}", args.store))?;
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding --listen {}", args.listen))?;
    tracing::info!(
        listen = %args.listen,
        upstream = %args.upstream,
        store = %args.store,
        "fence-proxy http serving"
    );
    let config = ProxyConfig {
        upstream: args.upstream,
        upstream_timeout: args.upstream_timeout,
    };
    serve(
        listener,
        store,
        config,
        args.max_in_flight as usize,
        shutdown,
    )
    .await
}

/// Serves the proxy on `listener` with any [`EpochStore`] until `shutdown` is cancelled; this is
/// the entry point for a custom store (see `examples/examples/custom_epoch_store.rs`).
pub async fn serve(
    listener: TcpListener,
    store: Arc<dyn EpochStore>,
    config: ProxyConfig,
    max_in_flight: usize,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let proxy = Proxy::new(config, store);
    let handler = proxy.clone();
    let service = ServiceBuilder::new()
        .layer(TraceLayer::new_for_http())
        .layer(ConcurrencyLimitLayer::new(max_in_flight))
        .service_fn(move |request| handler.clone().handle(request));
    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();

    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let connection = builder
            .serve_connection(
                TokioIo::new(stream),
                TowerToHyperService::new(service.clone()),
            )
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }

    drop(listener);
    tracing::info!("shutting down: draining requests in flight");
    let writes = proxy.writes().clone();
    writes.close();
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        graceful.shutdown().await;
        writes.wait().await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            drain_timeout_ms = DRAIN_TIMEOUT.as_millis() as u64,
            "requests still in flight at shutdown"
        );
    }
    Ok(())
}

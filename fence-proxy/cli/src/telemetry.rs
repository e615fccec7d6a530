//! Logging to stderr and the Prometheus endpoint.

use std::convert::Infallible;
use std::time::Duration;

use anyhow::Context;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

/// Histogram buckets in seconds, 1 ms to 10 s: a forward to a healthy upstream on the same
/// network takes a few milliseconds; past 10 s everything lands in `+Inf`. Buckets (not the
/// exporter's default summaries) so that replicas' histograms can be aggregated.
const LATENCY_BUCKETS_SECONDS: [f64; 13] = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
];

pub fn init_tracing(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

pub fn install_recorder() -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets(&LATENCY_BUCKETS_SECONDS)
        .context("configuring histogram buckets")?
        .install_recorder()
        .context("installing the metrics recorder")?;
    // Without an upkeep task the exporter's histograms grow without bound between scrapes.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// Serves `GET /metrics` (Prometheus text) and `GET /healthz` (`ok`) until `shutdown`.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    handle: PrometheusHandle,
    shutdown: CancellationToken,
) {
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics accept failed");
                    continue;
                }
            },
        };
        let handle = handle.clone();
        let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
            let handle = handle.clone();
            async move { Ok::<_, Infallible>(answer(&req, &handle)) }
        });
        tokio::spawn(async move {
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn answer(
    req: &Request<hyper::body::Incoming>,
    handle: &PrometheusHandle,
) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match req.uri().path() {
        "/metrics" => (StatusCode::OK, "text/plain; version=0.0.4", handle.render()),
        "/healthz" => (StatusCode::OK, "text/plain", "ok\n".to_owned()),
        other => (
            StatusCode::NOT_FOUND,
            "text/plain",
            format!("no such path {other:?}; try /metrics or /healthz\n"),
        ),
    };
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}

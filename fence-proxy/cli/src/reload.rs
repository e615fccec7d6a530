//! SIGHUP: read every TLS file again (see `fence_proxy_net::reload`), log the outcome and count
//! it. SIGHUP never stops the proxy, with or without TLS.

use fence_proxy_net::{ReloadOutcome, TlsReloader};
use tokio::signal::unix::Signal;
use tokio_util::sync::CancellationToken;

use lockd_service_kit::names::fence_proxy::{TLS_GENERATION, TLS_RELOADS_TOTAL};

const RESULT_OK: &str = "ok";
const RESULT_ERROR: &str = "error";

/// Watches SIGHUP. Call it before anything else starts: from then on SIGHUP no longer takes its
/// default action, which would terminate the process.
pub fn watch_sighup() -> Option<Signal> {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::error!(error = %e, "cannot watch SIGHUP: certificates will not reload, and SIGHUP stops the proxy");
            None
        }
    }
}

/// Reloads the certificates registered with `reloader` on every SIGHUP until `shutdown`.
pub async fn reload_on_sighup(
    mut hup: Signal,
    reloader: TlsReloader,
    frontend: &'static str,
    shutdown: CancellationToken,
) {
    metrics::describe_counter!(
        TLS_RELOADS_TOTAL,
        "Certificate reloads on SIGHUP, by result (ok: new connections use the new files; error: the previous ones stay)."
    );
    metrics::describe_gauge!(
        TLS_GENERATION,
        "Generation of the TLS files in use: 0 as read at start, one more per successful reload."
    );
    // Both series from the start, so that a rate or an alert on errors has a zero to start from.
    for result in [RESULT_OK, RESULT_ERROR] {
        metrics::counter!(TLS_RELOADS_TOTAL, "frontend" => frontend, "result" => result)
            .increment(0);
    }
    metrics::gauge!(TLS_GENERATION, "frontend" => frontend).set(0.0);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            got = hup.recv() => if got.is_none() { return },
        }
        // Reading files blocks: not on a worker thread that also serves connections.
        let r = reloader.clone();
        let outcome = tokio::task::spawn_blocking(move || r.reload())
            .await
            .unwrap_or_else(|e| Err(anyhow::anyhow!("the reload task failed: {e}")));
        match outcome {
            Ok(ReloadOutcome::Nothing) => {
                tracing::info!(
                    frontend,
                    "SIGHUP: no TLS file is configured, nothing to reload"
                )
            }
            Ok(ReloadOutcome::Reloaded { generation, files }) => {
                metrics::counter!(TLS_RELOADS_TOTAL, "frontend" => frontend, "result" => RESULT_OK)
                    .increment(1);
                metrics::gauge!(TLS_GENERATION, "frontend" => frontend).set(generation as f64);
                let files: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
                tracing::info!(
                    frontend,
                    generation,
                    files = %files.join(", "),
                    "certificates reloaded (SIGHUP): new connections use them, open ones keep theirs"
                );
            }
            Err(e) => {
                metrics::counter!(TLS_RELOADS_TOTAL, "frontend" => frontend, "result" => RESULT_ERROR)
                    .increment(1);
                tracing::error!(
                    frontend,
                    generation = reloader.generation(),
                    error = %format!("{e:#}"),
                    "certificate reload failed (SIGHUP): the previous certificates stay in use"
                );
            }
        }
    }
}

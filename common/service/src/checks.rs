//! Readiness from background checks: each check (a cheap query to a store, a TCP connect to an
//! upstream) runs on an interval with a timeout, and `/readyz` reports the latest results, so a
//! request to it never waits for a probe and a flood of them never reaches the dependencies.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Default interval between two runs of the checks.
pub const CHECK_EVERY: Duration = Duration::from_secs(2);

/// Default bound on one run of one check; past it the check has failed.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// What a check's probe returns: `Err` with the reason (naming the address or store) if the
/// dependency did not answer.
pub type CheckFuture = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// One dependency to watch.
pub struct Check {
    /// Names the dependency in the reason, such as `upstream` or `epoch store`.
    name: String,
    /// Starts one probe.
    probe: Box<dyn Fn() -> CheckFuture + Send + Sync>,
}

impl Check {
    /// A check named `name` that runs `probe` each time.
    pub fn new<F, Fut>(name: impl Into<String>, probe: F) -> Check
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), String>> + Send + 'static,
    {
        Check {
            name: name.into(),
            probe: Box::new(move || Box::pin(probe())),
        }
    }

    /// A check that `addr` (`host:port`, resolved each time) accepts a TCP connection, which it
    /// closes at once.
    pub fn tcp_connect(name: impl Into<String>, addr: String) -> Check {
        Check::new(name, move || {
            let addr = addr.clone();
            async move {
                match tokio::net::TcpStream::connect(addr.as_str()).await {
                    Ok(_) => Ok(()),
                    Err(e) => Err(format!("{addr}: {e}")),
                }
            }
        })
    }
}

/// The latest result of one check.
#[derive(Clone, Debug)]
struct Latest {
    name: String,
    /// When the last run ended and how; `None` until the first run ends.
    outcome: Option<(Instant, Result<(), String>)>,
}

/// What `/readyz` reports.
#[derive(Debug, Default)]
enum Phase {
    /// The service has not started its checks yet (it is still opening stores, binding).
    #[default]
    Starting,
    /// Checks run; a result older than `stale_after` no longer counts as an answer.
    Running {
        latest: Vec<Latest>,
        stale_after: Duration,
    },
    /// Shutdown began: the service drains and takes no new work.
    Stopping,
}

/// The readiness of a service, kept up to date by its checks. Clones share the state.
#[derive(Clone, Debug, Default)]
pub struct Readiness {
    phase: Arc<Mutex<Phase>>,
}

impl Readiness {
    /// Not ready ("starting") until [`Readiness::start`].
    pub fn new() -> Readiness {
        Readiness::default()
    }

    /// Starts running `checks` every [`CHECK_EVERY`] with [`CHECK_TIMEOUT`] on the current
    /// Tokio runtime, until `shutdown`; from then on the service reports "shutting down".
    pub fn start(&self, checks: Vec<Check>, shutdown: CancellationToken) {
        self.start_with(checks, CHECK_EVERY, CHECK_TIMEOUT, shutdown)
    }

    /// [`Readiness::start`] with the interval and the timeout chosen by the caller.
    pub fn start_with(
        &self,
        checks: Vec<Check>,
        every: Duration,
        timeout: Duration,
        shutdown: CancellationToken,
    ) {
        let latest = checks
            .iter()
            .map(|c| Latest {
                name: c.name.clone(),
                outcome: None,
            })
            .collect();
        // Two missed rounds: a check that hangs past its timeout, or a task that stopped, turns
        // the service unready instead of freezing the last good answer.
        let stale_after = 2 * (every + timeout);
        *self.phase.lock().expect("readiness lock") = Phase::Running {
            latest,
            stale_after,
        };
        let phase = self.phase.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = shutdown.cancelled() => break,
                }
                let rounds = checks.iter().enumerate().map(|(i, check)| {
                    let phase = phase.clone();
                    async move {
                        let result = match tokio::time::timeout(timeout, (check.probe)()).await {
                            Ok(result) => result,
                            Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
                        };
                        if let Phase::Running { latest, .. } =
                            &mut *phase.lock().expect("readiness lock")
                        {
                            latest[i].outcome = Some((Instant::now(), result));
                        }
                    }
                });
                tokio::select! {
                    _ = futures::future::join_all(rounds) => {}
                    _ = shutdown.cancelled() => break,
                }
            }
            *phase.lock().expect("readiness lock") = Phase::Stopping;
        });
    }

    /// `Ok("ready")` when every check answered within its last run and that run is recent;
    /// otherwise `Err` with one line naming each failed check and why.
    pub fn status(&self) -> Result<String, String> {
        let phase = self.phase.lock().expect("readiness lock");
        let (latest, stale_after) = match &*phase {
            Phase::Starting => return Err("not ready: starting".into()),
            Phase::Stopping => return Err("not ready: shutting down".into()),
            Phase::Running {
                latest,
                stale_after,
            } => (latest, *stale_after),
        };
        let now = Instant::now();
        let failed: Vec<String> = latest
            .iter()
            .filter_map(|l| match &l.outcome {
                None => Some(format!("{}: not checked yet", l.name)),
                Some((at, _)) if now.duration_since(*at) > stale_after => Some(format!(
                    "{}: no result for {} ms",
                    l.name,
                    now.duration_since(*at).as_millis()
                )),
                Some((_, Err(e))) => Some(format!("{}: {e}", l.name)),
                Some((_, Ok(()))) => None,
            })
            .collect();
        if failed.is_empty() {
            Ok("ready".into())
        } else {
            Err(format!("not ready: {}", failed.join("; ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A check whose answer the test switches.
    fn switch(name: &str, up: &Arc<AtomicBool>) -> Check {
        let up = up.clone();
        Check::new(name, move || {
            let up = up.load(Ordering::Relaxed);
            async move {
                if up {
                    Ok(())
                } else {
                    Err("connection refused".into())
                }
            }
        })
    }

    /// Lets the paused clock run the check task for `d`.
    async fn run_for(d: Duration) {
        tokio::time::sleep(d).await;
    }

    #[tokio::test(start_paused = true)]
    async fn follows_its_checks_and_names_the_failed_one() {
        let ready = Readiness::new();
        assert_eq!(ready.status().unwrap_err(), "not ready: starting");
        let (store, upstream) = (
            Arc::new(AtomicBool::new(true)),
            Arc::new(AtomicBool::new(true)),
        );
        let shutdown = CancellationToken::new();
        ready.start(
            vec![switch("epoch store", &store), switch("upstream", &upstream)],
            shutdown.clone(),
        );
        run_for(Duration::from_millis(10)).await;
        assert_eq!(ready.status().unwrap(), "ready");

        upstream.store(false, Ordering::Relaxed);
        run_for(CHECK_EVERY).await;
        assert_eq!(
            ready.status().unwrap_err(),
            "not ready: upstream: connection refused"
        );
        store.store(false, Ordering::Relaxed);
        run_for(CHECK_EVERY).await;
        assert_eq!(
            ready.status().unwrap_err(),
            "not ready: epoch store: connection refused; upstream: connection refused"
        );
        store.store(true, Ordering::Relaxed);
        upstream.store(true, Ordering::Relaxed);
        run_for(CHECK_EVERY).await;
        assert_eq!(ready.status().unwrap(), "ready");

        shutdown.cancel();
        run_for(Duration::from_millis(10)).await;
        assert_eq!(ready.status().unwrap_err(), "not ready: shutting down");
    }

    #[tokio::test(start_paused = true)]
    async fn a_hanging_check_fails_by_its_timeout() {
        let ready = Readiness::new();
        let hang = Check::new("epoch store", || {
            std::future::pending::<Result<(), String>>()
        });
        ready.start_with(
            vec![hang],
            Duration::from_secs(2),
            Duration::from_millis(500),
            CancellationToken::new(),
        );
        run_for(Duration::from_millis(100)).await;
        assert_eq!(
            ready.status().unwrap_err(),
            "not ready: epoch store: not checked yet"
        );
        run_for(Duration::from_millis(500)).await;
        assert_eq!(
            ready.status().unwrap_err(),
            "not ready: epoch store: no answer within 500 ms"
        );
    }

    #[tokio::test]
    async fn tcp_connect_names_the_address() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let check = Check::tcp_connect("upstream", addr.clone());
        assert_eq!((check.probe)().await, Ok(()));
        drop(listener);
        let err = (check.probe)().await.unwrap_err();
        assert!(err.starts_with(&format!("{addr}: ")), "{err}");
    }
}

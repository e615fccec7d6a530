//! Waiting for a condition instead of sleeping a fixed time before an assert: a fixed sleep is
//! too short on a loaded machine (a flake) and longer than needed everywhere else.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often a condition is probed.
const EVERY: Duration = Duration::from_millis(50);

/// Probes until `probe` returns `Ok`, and returns its value. `Err` says why the condition does
/// not hold yet; after `within` the call panics with `what` and the last such reason.
pub async fn until<T>(
    what: &str,
    within: Duration,
    mut probe: impl FnMut() -> Result<T, String>,
) -> T {
    until_async(what, within, || std::future::ready(probe())).await
}

/// [`until`] for a probe that has to await (an RPC, an HTTP scrape).
pub async fn until_async<T, F>(what: &str, within: Duration, mut probe: impl FnMut() -> F) -> T
where
    F: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + within;
    loop {
        match probe().await {
            Ok(value) => return value,
            Err(why) if Instant::now() >= deadline => {
                panic!("{what}: still not so after {within:?}: {why}")
            }
            Err(_) => tokio::time::sleep(EVERY).await,
        }
    }
}

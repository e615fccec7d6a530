//! [`LeaseGuard`]: a held lease that renews itself and says, on the client's monotonic clock, when
//! it can no longer be trusted.
//!
//! The guard renews every ttl/3 (shortened by a random jitter) from the send time of the last
//! successful renewal. Each success moves the local deadline to `that send time + ttl − margin`.
//! The [`LostSignal`] fires, and stays fired, when
//! - a `Renew` answers `NOT_FOUND` (the lease is gone: expired, superseded),
//! - the local deadline passes without a successful renewal (the lease may be gone),
//! - a `Renew` is refused for another definite reason, or
//! - the guard is released or dropped.
//!
//! After it fires the guard never renews again and never acquires anew: a new lease needs a new
//! `Client::lock`, with a new fencing token.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use lockd_fence::FencingToken;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use crate::client::Client;
use crate::config::{RENEW_JITTER_DIVISOR, RENEWALS_PER_TTL};
use crate::error::{Error, humanize};
use crate::lease::{Lease, LeaseId, local_deadline};
use crate::request_id::RequestId;

/// Why a lease stopped being usable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LossReason {
    /// `Renew` answered `NOT_FOUND`: the lease is not current any more.
    NotCurrent {
        /// The server's message.
        message: String,
    },
    /// No renewal succeeded before the local deadline: the lease may have expired at the server
    /// and been granted to someone else.
    DeadlinePassed {
        /// How long before the deadline the last successful renewal (or the acquire) was sent.
        last_success_before_deadline: Duration,
    },
    /// `Renew` was refused for a reason other than `NOT_FOUND` (e.g. `INVALID_ARGUMENT`).
    RenewRefused {
        /// The error, as [`Error`] shows it.
        message: String,
    },
    /// The guard was released or dropped by its owner.
    Released,
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossReason::NotCurrent { message } => {
                write!(f, "lease is not current any more: {message}")
            }
            LossReason::DeadlinePassed {
                last_success_before_deadline,
            } => write!(
                f,
                "no renewal succeeded before the local deadline ({} after the last successful send); \
                 the lease may have expired",
                humanize(*last_success_before_deadline)
            ),
            LossReason::RenewRefused { message } => write!(f, "renewal refused: {message}"),
            LossReason::Released => f.write_str("lease released by its owner"),
        }
    }
}

/// State shared by the guard, its renewal task and every [`LostSignal`].
struct Shared {
    /// Cancelled exactly once, when the lease stops being usable; never reset.
    lost: CancellationToken,
    /// The first reason the lease was lost; set before `lost` is cancelled.
    reason: OnceLock<LossReason>,
    /// The current local deadline. A std mutex: held for a copy, never across an await.
    deadline: Mutex<Instant>,
    /// Successful renewals so far, for observability and tests.
    renewals: AtomicU64,
}

impl Shared {
    fn deadline(&self) -> Instant {
        *self.deadline.lock().expect("deadline mutex")
    }

    /// Records the first reason and fires the signal. Later calls keep the first reason.
    fn fire(&self, reason: LossReason) {
        let _ = self.reason.set(reason);
        self.lost.cancel();
    }

    /// Checks the deadline on the spot, so that a reader after a process pause sees the loss even
    /// before the renewal task has run.
    fn is_lost(&self, ttl_minus_margin: Duration) -> bool {
        if self.lost.is_cancelled() {
            return true;
        }
        let deadline = self.deadline();
        if Instant::now() >= deadline {
            self.fire(LossReason::DeadlinePassed {
                last_success_before_deadline: ttl_minus_margin,
            });
            return true;
        }
        false
    }
}

/// Fires when the lease of a [`LeaseGuard`] can no longer be trusted. Clone it into every task that
/// works under the lease; each must stop writing when it fires.
#[derive(Clone)]
pub struct LostSignal {
    shared: Arc<Shared>,
    ttl_minus_margin: Duration,
}

impl LostSignal {
    /// Completes when the lease is lost (immediately if it already is).
    pub async fn fired(&self) {
        self.shared.lost.cancelled().await
    }

    /// Whether the lease is lost, checking the local deadline now.
    pub fn is_lost(&self) -> bool {
        self.shared.is_lost(self.ttl_minus_margin)
    }

    /// Why the lease was lost, once it is.
    pub fn reason(&self) -> Option<LossReason> {
        self.shared.reason.get().cloned()
    }

    /// The underlying token, to combine with other tokio-util cancellation.
    pub fn token(&self) -> CancellationToken {
        self.shared.lost.clone()
    }
}

/// A held lease that renews itself until released, dropped or lost.
pub struct LeaseGuard {
    /// Shares connections with the caller's client; used for the final release.
    client: Client,
    /// The lease as acquired; its id and token never change while the guard lives.
    lease: Lease,
    /// Subtracted from every deadline; also the grace `lockctl hold` gives a command on loss.
    margin: Duration,
    shared: Arc<Shared>,
    /// Stops the renewal task when the owner releases or drops the guard.
    stop: CancellationToken,
    renewer: Option<JoinHandle<()>>,
    /// Set by `release`, so that `Drop` does not release a second time.
    released: bool,
}

impl LeaseGuard {
    /// Starts renewing `lease`, whose latest grant or renewal was sent at `valid_from` with `ttl`.
    pub(crate) fn start(
        client: Client,
        lease: Lease,
        valid_from: Instant,
        ttl: Duration,
        margin: Duration,
    ) -> Self {
        let shared = Arc::new(Shared {
            lost: CancellationToken::new(),
            reason: OnceLock::new(),
            deadline: Mutex::new(local_deadline(valid_from, ttl, margin)),
            renewals: AtomicU64::new(0),
        });
        let stop = CancellationToken::new();
        let renewer = tokio::spawn(renew_loop(
            client.clone(),
            lease.resource.clone(),
            lease.lease_id.clone(),
            margin,
            shared.clone(),
            stop.clone(),
            valid_from,
            ttl,
        ));
        LeaseGuard {
            client,
            lease,
            margin,
            shared,
            stop,
            renewer: Some(renewer),
            released: false,
        }
    }

    /// The locked resource.
    pub fn resource(&self) -> &str {
        &self.lease.resource
    }

    /// The token to attach to every write made under this lease.
    pub fn fencing_token(&self) -> FencingToken {
        self.lease.fencing_token
    }

    /// The lease's id.
    pub fn lease_id(&self) -> &LeaseId {
        &self.lease.lease_id
    }

    /// The signed sequencer of the grant (see [`crate::Lease::sequencer`]). A renewal keeps it.
    pub fn sequencer(&self) -> &[u8] {
        &self.lease.sequencer
    }

    /// The request id the `Acquire` carried.
    pub fn request_id(&self) -> &RequestId {
        &self.lease.request_id
    }

    /// The ttl the cluster granted with the lease.
    pub fn ttl(&self) -> Duration {
        self.lease.ttl
    }

    /// The margin subtracted from each deadline: the time between the lost signal firing for a
    /// missed deadline and the earliest moment the server may let the lease expire.
    pub fn safety_margin(&self) -> Duration {
        self.margin
    }

    /// The current local deadline on the monotonic clock.
    pub fn deadline(&self) -> Instant {
        self.shared.deadline()
    }

    /// Successful renewals so far.
    pub fn renewals(&self) -> u64 {
        self.shared.renewals.load(Ordering::Relaxed)
    }

    /// A handle on the lost signal.
    pub fn lost(&self) -> LostSignal {
        LostSignal {
            shared: self.shared.clone(),
            ttl_minus_margin: self.lease.ttl.saturating_sub(self.margin),
        }
    }

    /// Whether the lease is lost, checking the local deadline now.
    pub fn is_lost(&self) -> bool {
        self.lost().is_lost()
    }

    /// `Ok` while the lease is held; the reason once it is lost. Call before each protected write.
    pub fn check(&self) -> Result<(), LossReason> {
        if self.is_lost() {
            return Err(self
                .shared
                .reason
                .get()
                .cloned()
                .unwrap_or(LossReason::Released));
        }
        Ok(())
    }

    /// Stops renewing, fires the lost signal (so that workers stop before the lock is given up),
    /// then releases. `Ok(false)` when the lease was no longer current.
    pub async fn release(mut self) -> Result<bool, Error> {
        self.released = true;
        self.stop_renewing();
        self.client
            .release(&self.lease.resource, &self.lease.lease_id)
            .await
    }

    fn stop_renewing(&mut self) {
        self.stop.cancel();
        self.shared.fire(LossReason::Released);
        if let Some(task) = self.renewer.take() {
            task.abort();
        }
    }
}

impl Drop for LeaseGuard {
    /// Best effort: stops renewing and, inside a tokio runtime, sends a `Release` in the background.
    /// Without one the lease simply expires after its ttl.
    fn drop(&mut self) {
        if self.released {
            return;
        }
        self.stop_renewing();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let client = self.client.clone();
            let resource = self.lease.resource.clone();
            let lease_id = self.lease.lease_id.clone();
            runtime.spawn(async move {
                if let Err(e) = client.release(&resource, &lease_id).await {
                    tracing::warn!(%resource, error = %e, "best-effort release of a dropped lease guard failed");
                }
            });
        }
    }
}

impl fmt::Debug for LeaseGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseGuard")
            .field("resource", &self.lease.resource)
            .field("lease_id", &self.lease.lease_id)
            .field("fencing_token", &self.lease.fencing_token)
            .field("ttl", &self.lease.ttl)
            .field("lost", &self.shared.lost.is_cancelled())
            .finish()
    }
}

/// The next renewal time: `interval` after `last_sent`, shortened by a random jitter of up to
/// `interval / RENEW_JITTER_DIVISOR`.
fn next_renewal(last_sent: Instant, interval: Duration) -> Instant {
    let max_jitter = interval / RENEW_JITTER_DIVISOR;
    let jitter = max_jitter.mul_f64(rand::random::<f64>());
    last_sent + interval - jitter
}

/// Renews until stopped or lost. The deadline branch of each `select!` comes first, so a deadline
/// that passes while a renewal is in flight wins over a reply that arrives at the same time.
#[allow(
    clippy::too_many_arguments,
    reason = "the loop's state, moved into its task; one call site passes it"
)]
async fn renew_loop(
    client: Client,
    resource: String,
    lease_id: LeaseId,
    margin: Duration,
    shared: Arc<Shared>,
    stop: CancellationToken,
    mut last_sent: Instant,
    mut ttl: Duration,
) {
    loop {
        let interval = ttl / RENEWALS_PER_TTL;
        let deadline = shared.deadline();
        let expired = || LossReason::DeadlinePassed {
            last_success_before_deadline: deadline.saturating_duration_since(last_sent),
        };
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = sleep_until(deadline) => {
                shared.fire(expired());
                return;
            }
            _ = sleep_until(next_renewal(last_sent, interval)) => {}
        }
        // Each attempt may take at most one renewal interval, so a stuck node leaves time to try
        // the others before the deadline.
        let attempt_timeout = interval.min(client.config().attempt_timeout);
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = sleep_until(deadline) => {
                shared.fire(expired());
                return;
            }
            result = client.renew_until(&resource, &lease_id, None, deadline, attempt_timeout) => {
                match result {
                    Ok(renewed) => {
                        if Instant::now() >= deadline {
                            // Too late: the signal must already be seen as fired, and a lost lease
                            // is never revived.
                            shared.fire(expired());
                            return;
                        }
                        let next = local_deadline(renewed.sent_at, renewed.ttl, margin);
                        {
                            let mut d = shared.deadline.lock().expect("deadline mutex");
                            *d = (*d).max(next);
                        }
                        shared.renewals.fetch_add(1, Ordering::Relaxed);
                        last_sent = renewed.sent_at;
                        ttl = renewed.ttl;
                        tracing::trace!(%resource, "lease renewed");
                    }
                    Err(Error::NotFound { message, .. }) => {
                        shared.fire(LossReason::NotCurrent { message });
                        return;
                    }
                    Err(Error::OutcomeUnknown { .. } | Error::Unavailable { .. }) => {
                        // Retries ran up to the deadline without an answer.
                        shared.fire(expired());
                        return;
                    }
                    Err(e) => {
                        shared.fire(LossReason::RenewRefused { message: e.to_string() });
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewals_are_due_within_the_jitter_window() {
        let now = Instant::now();
        let interval = Duration::from_millis(900);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let due = next_renewal(now, interval);
            assert!(due <= now + interval, "{:?}", due - now);
            assert!(due >= now + interval - interval / RENEW_JITTER_DIVISOR);
            seen.insert(due - now);
        }
        assert!(
            seen.len() > 100,
            "jitter produced only {} distinct delays",
            seen.len()
        );
    }

    /// With tokio's clock paused, a guard whose renewals never get an answer fires its signal at
    /// exactly send time + ttl − margin, not later.
    #[tokio::test(start_paused = true)]
    async fn signal_fires_at_the_local_deadline_when_renewals_hang() {
        // A listener that accepts and never answers: every renewal attempt times out.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let holder = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        let client = Client::new([addr.to_string()]).unwrap();
        let ttl = Duration::from_secs(3);
        let margin = client.safety_margin(ttl);
        let sent = Instant::now();
        let lease = Lease {
            resource: "r".into(),
            lease_id: LeaseId::new("lease-1"),
            fencing_token: FencingToken(7),
            ttl,
            request_id: RequestId::random(),
            sent_at: sent,
            expires_at_unix_ms: 0,
            sequencer: Vec::new(),
        };
        let guard = LeaseGuard::start(client, lease, sent, ttl, margin);
        let lost = guard.lost();
        assert!(!lost.is_lost());
        lost.fired().await;
        let fired_at = Instant::now();
        assert_eq!(
            fired_at,
            sent + ttl - margin,
            "fired {:?} after send",
            fired_at - sent
        );
        assert!(matches!(
            lost.reason(),
            Some(LossReason::DeadlinePassed { .. })
        ));
        assert_eq!(guard.renewals(), 0);
        assert_eq!(guard.fencing_token(), FencingToken(7));
        holder.abort();
        // Dropping after loss must not panic; the background release fails quietly.
        drop(guard);
    }

    /// `is_lost` sees a passed deadline even if the renewal task has not run (a paused process).
    #[tokio::test(start_paused = true)]
    async fn is_lost_checks_the_clock_itself() {
        let client = Client::new(["127.0.0.1:1"]).unwrap();
        let ttl = Duration::from_secs(3);
        let now = Instant::now();
        let shared = Shared {
            lost: CancellationToken::new(),
            reason: OnceLock::new(),
            deadline: Mutex::new(now + Duration::from_secs(1)),
            renewals: AtomicU64::new(0),
        };
        assert!(!shared.is_lost(ttl));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(shared.is_lost(ttl));
        assert!(shared.lost.is_cancelled());
        // The first reason sticks.
        shared.fire(LossReason::Released);
        assert!(matches!(
            shared.reason.get(),
            Some(LossReason::DeadlinePassed { .. })
        ));
        drop(client);
    }
}

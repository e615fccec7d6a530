//! The epoch-store trait and the permit a front end holds while it forwards a write.

use std::time::Duration;

use futures::future::BoxFuture;
use lockd_fence::FencingToken;

use crate::StoreError;

/// Checks and records fencing tokens per resource, and keeps the forwards of one resource in
/// token order.
///
/// Implementations must uphold, for each resource:
/// - a token lower than the highest recorded is answered [`Admission::Stale`] with that highest;
/// - a token greater than or equal to it is recorded durably *before* `admit` returns
///   [`Admission::Accepted`];
/// - while a [`Permit`] of a resource is alive, no other `admit` of that resource with another
///   token returns `Accepted` (in any process sharing the store); writes of the same token may
///   be admitted side by side (they are one holder's), or one at a time;
/// - after a permit is released with [`ForwardOutcome::Unknown`], no `admit` of that resource
///   returns `Accepted` before [`Timing::quarantine`] has passed.
///
/// The trait is object safe so that a front end can pick the store at run time
/// (`Arc<dyn EpochStore>`); see `examples/examples/custom_epoch_store.rs` for a store of one's own.
pub trait EpochStore: Send + Sync + 'static {
    /// Waits (at most [`Timing::lock_wait`]) until `resource` may be written with `token` (no
    /// write of another token in flight), then checks `token` against the highest accepted
    /// token and records it if it is not lower.
    fn admit<'a>(
        &'a self,
        resource: &'a str,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<Admission, StoreError>>;

    /// A short name for logs and error messages, such as `redb` or `postgres`.
    fn kind(&self) -> &'static str;

    /// Whether an `admit` future may be dropped at any await without leaving anything behind
    /// but what a refused admission leaves (a token recorded without a forward is fine; a
    /// resource closed for longer than its wait is not). A front end drops the admission of a
    /// client that went away only then; otherwise it lets the admission end and releases the
    /// permit unused.
    ///
    /// The default is `false`, the safe answer for a store that does not know.
    fn admission_cancel_safe(&self) -> bool {
        false
    }

    /// A cheap check that the store answers, for the proxy's `/readyz`: it reads nothing about
    /// any resource and records nothing. Errors as `admit` would report them.
    ///
    /// The default answers `Ok` at once: a store with nothing outside the process that can fail
    /// (an in-memory one) is ready whenever the process is.
    fn check(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }

    /// Called once by the front end when it stops, after its drain, when no write should be in
    /// flight any more: a store that keeps state in the process saves what must outlive it (the
    /// redb store: its quarantines, and that it stopped cleanly). Every `admit` after it fails.
    /// An error means the store could not close cleanly; the next process that opens it then
    /// assumes a crash.
    ///
    /// The default does nothing: a store without state of its own in the process (the Postgres
    /// store keeps its quarantines in its table) has nothing to save.
    fn close(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }
}

/// The store's answer to a write.
#[derive(Debug)]
pub enum Admission {
    /// The token was recorded; forward the write while holding the permit, then release it.
    Accepted(Permit),
    /// The token is lower than `highest`, the highest token accepted for the resource.
    Stale {
        /// The highest token accepted for the resource.
        highest: FencingToken,
    },
}

/// What became of a forward, which decides how long the resource stays closed after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardOutcome {
    /// The upstream answered (any status): whatever it did with the write is done.
    Answered,
    /// The write never left the proxy (connection refused, bad request line): nothing to wait for.
    NotSent,
    /// The proxy gave up or lost the connection after sending: the upstream may still apply the
    /// write, so the resource is quarantined.
    Unknown,
}

/// Time bounds shared by the stores.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Longest a write waits for the forwards of writes of the same resource with another token
    /// (or its quarantine) before it is refused as busy.
    pub lock_wait: Duration,
    /// Longest the front end waits for the upstream's answer. A shared store marks a record "in
    /// flight" for this long plus `quarantine`, so that a replica that dies mid-forward is waited
    /// out by the others.
    pub forward_timeout: Duration,
    /// How long a resource stays closed after a forward with an unknown outcome.
    pub quarantine: Duration,
    /// Bound on one store operation: connecting, or one statement other than the lock wait.
    pub store_timeout: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            lock_wait: Duration::from_secs(10),
            forward_timeout: Duration::from_secs(30),
            quarantine: Duration::from_secs(10),
            store_timeout: Duration::from_secs(5),
        }
    }
}

/// The store-specific half of a permit: what to do when the forward is over.
pub trait PermitRelease: Send + 'static {
    /// Ends the exclusive use of the resource. With [`ForwardOutcome::Unknown`] the resource
    /// must stay closed for the quarantine period.
    fn release(
        self: Box<Self>,
        outcome: ForwardOutcome,
    ) -> BoxFuture<'static, Result<(), StoreError>>;

    /// Ends the use of a permit that was dropped unreleased (its forward was cut off, or its task
    /// panicked): its write may have been sent an instant before, and an upstream connection may
    /// still be sending it, so a store that can should keep the resource closed for the whole
    /// time the proxy would have waited for it and then quarantined it. By default, a release
    /// with [`ForwardOutcome::Unknown`].
    fn abandon(self: Box<Self>) -> BoxFuture<'static, Result<(), StoreError>> {
        self.release(ForwardOutcome::Unknown)
    }
}

/// Use of one resource, at one accepted token, for the duration of one forward: no write of
/// another token of the resource is forwarded while it is alive.
///
/// Release it with [`Permit::release`] once the outcome of the forward is known. A permit that is
/// dropped without being released is abandoned ([`PermitRelease::abandon`]) on the current Tokio
/// runtime, because nobody can tell whether its write reached the upstream. Where no runtime
/// runs (or one is shutting down and cancels what is spawned on it), only the store's own drop
/// glue runs: a store must then keep the resource closed from its drop (the redb store
/// quarantines it, the Postgres store's `busy_until` stays set).
pub struct Permit {
    /// The resource this permit excludes others from.
    resource: String,
    /// The token that was accepted and recorded.
    token: FencingToken,
    /// The store's release action; `None` once released.
    release: Option<Box<dyn PermitRelease>>,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("resource", &self.resource)
            .field("token", &self.token)
            .field("released", &self.release.is_none())
            .finish()
    }
}

impl Permit {
    /// Made by a store when it accepted `token` for `resource`.
    pub fn new(
        resource: impl Into<String>,
        token: FencingToken,
        release: impl PermitRelease,
    ) -> Self {
        Permit {
            resource: resource.into(),
            token,
            release: Some(Box::new(release)),
        }
    }

    /// The resource the token was recorded for.
    pub fn resource(&self) -> &str {
        &self.resource
    }

    /// The token recorded.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// Ends the forward. An error here does not undo the accepted token; it means the store may
    /// keep the resource closed longer (for example until the in-flight mark expires).
    pub async fn release(mut self, outcome: ForwardOutcome) -> Result<(), StoreError> {
        match self.release.take() {
            Some(release) => release.release(outcome).await,
            None => Ok(()),
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let Some(release) = self.release.take() else {
            return;
        };
        let resource = std::mem::take(&mut self.resource);
        let token = self.token;
        // Without a runtime the store's own drop glue runs instead (closing the connection or
        // unlocking the mutex); the durable in-flight mark still covers a shared store.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            // Called here, not in the task: a store that acts at once (the redb store) does so
            // even when the runtime is shutting down and the task never runs.
            let abandoned = release.abandon();
            handle.spawn(async move {
                if let Err(e) = abandoned.await {
                    tracing::warn!(%resource, %token, error = %e, "releasing a dropped permit");
                }
            });
        }
    }
}

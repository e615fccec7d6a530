//! Rust client of lockd: it follows the cluster across node failures, makes `Acquire` retry-safe
//! with one request id per logical attempt, and hands out [`LeaseGuard`]s that renew themselves and
//! signal, on the client's own monotonic clock, the moment the lease can no longer be trusted.
//!
//! It deliberately does not depend on openraft or redb, never re-acquires a lease on its own after a
//! loss, and never decides lease time from the server's wall clock (`expires_at_unix_ms` is shown,
//! not used).
//!
//! # Layout
//! - [`client`]: [`Client`], the retrying gRPC client of the `Lock` and `Cluster` services.
//! - [`guard`]: [`LeaseGuard`] and its [`LostSignal`]: auto-renewal and loss detection.
//! - [`lease`]: [`Lease`], [`LeaseId`] and the deadline arithmetic (send time + ttl − margin).
//! - [`error`]: [`Error`], one variant per outcome a caller branches on, and the status mapping.
//! - [`endpoints`]: parsing endpoints and rotating among them on transport errors.
//! - [`retry`]: exponential backoff with jitter (backon) bounded by a deadline.
//! - [`request_id`]: [`RequestId`], the idempotency key of `Acquire`.
//! - [`config`]: [`ClientConfig`] and every timing constant with its reason.
//!
//! # Example
//!
//! ```no_run
//! # async fn demo() -> Result<(), lockd_client::Error> {
//! use lockd_client::{AcquireOptions, Client};
//! use std::time::Duration;
//!
//! let client = Client::new(["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"])?;
//! let guard = client
//!     .lock("orders/42", AcquireOptions::default().ttl(Duration::from_secs(10)))
//!     .await?;
//! let lost = guard.lost();
//! tokio::select! {
//!     _ = lost.fired() => { /* stop writing: the lease may belong to someone else now */ }
//!     _ = async { /* write, sending guard.fencing_token() with every write */ } => {}
//! }
//! guard.release().await?;
//! # Ok(())
//! # }
//! ```

pub mod client;
pub mod config;
pub mod endpoints;
pub mod error;
pub mod guard;
pub mod lease;
pub mod request_id;
pub mod retry;

pub use client::{AcquireOptions, Client, ReleaseOutcome, Renewed};
pub use config::{BearerToken, ClientConfig, ClientTls};
pub use error::{Error, Op, Outcome};
pub use guard::{LeaseGuard, LossReason, LostSignal};
pub use lease::{Lease, LeaseId, default_safety_margin};
pub use lockd_fence::FencingToken;
pub use request_id::RequestId;

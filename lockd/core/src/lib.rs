//! The lock table that every lockd replica holds: leases, fencing tokens, FIFO waiters and the
//! request-id dedup records, changed only by applying committed command batches.
//!
//! It does no I/O, starts no tasks and never reads a clock: time enters only as the [`Stamp`]
//! the leader put on each [`Batch`], so every replica that applies the same log holds the same
//! table and returns the same outcomes. Replication, persistence and RPC live in `lockd-server`.
//!
//! # Layout
//! - [`types`]: newtypes that must not be mixed up (`LeaseId`, `RequestKey`, `ResourceName`).
//! - [`limits`]: every bound of the table, with its reason, and the per-batch [`Policy`].
//! - [`validate`]: checks of client input at the edge, with messages naming the value.
//! - [`command`]: commands, batches, outcomes and the events apply emits.
//! - [`keys`]: the replicated sequencer signing keys ([`SigningKeys`]).
//! - [`table`]: [`LockTable`], the deterministic state machine.
//!
//! # Invariants
//! Asserted with `assert!` in [`table`] (on in release builds: a replica that breaks one stops
//! instead of answering), checked again by the property test in `table::tests` and by the
//! integration suites under `tests/`.
//!
//! | id | statement |
//! |---|---|
//! | `INV-SINGLE-HOLDER` | a resource has at most one lease in the table |
//! | `INV-TOKEN-MONOTONIC` | every grant's fencing token is larger than every token issued before |
//! | `INV-CURRENT-LEASE-ONLY` | only the current lease id renews or releases; others never touch the holder |
//! | `INV-DEDUP` | an Acquire retried with the same request_id returns the original outcome |
//! | `INV-QUEUE-ONCE` | a request_id is queued at most once, and only while its resource is held; a retry takes back its place |
//! | `INV-NO-CLIENT-PANIC` | nothing a client sends reaches an assert: digests are keyed with a replicated secret, and a record that does not fit is an error answer |
//! | `INV-TENANT-QUOTA` | one tenant's dedup records and active resources stay within its quotas (policy of the batch) |
//! | `INV-TIME-MONOTONIC` | the table's clock never goes backwards, whatever the stamps |
//! | `INV-CLOCK-MONOTONIC-DELTA` | the table's clock advances only by one leader process's monotonic deltas and pauses over a change of leader process, so it never runs ahead of real time and no wall-clock offset moves it |
//! | `INV-CONSERVATIVE-FAILOVER` | (legacy unstamped entries only) a new term never expires a lease earlier than its first stamp plus the lease's ttl |

pub mod command;
pub mod keys;
pub mod limits;
pub mod table;
pub mod types;
pub mod validate;

pub use command::{Batch, Command, EndWaitReason, Event, EventKind, Grant, Limit, Outcome, Stamp};
pub use keys::{KeyRecord, SigningKeys};
pub use limits::Policy;
pub use lockd_fence::FencingToken;
pub use table::{
    ClockAnchor, LockTable, ResourceView, RestoreReport, SnapshotCopy, SnapshotError, TableStats,
};
pub use types::{LeaseId, RequestKey, ResourceName};

//! Epoch stores for fence-proxy: they check a write's fencing token against the highest token
//! accepted for its resource, record the new highest, and keep writes of one resource in token
//! order while they are forwarded.
//!
//! They do not forward anything or speak any client protocol: the front ends (`fence-proxy-http`,
//! `fence-proxy-postgres`) do that and hold the [`Permit`] a store hands out while they forward.
//!
//! # Ordering guarantee
//!
//! `INV-FENCE-ORDER`: once a write with token `t` was accepted for a resource, no write with a
//! token lower than `t` for that resource reaches the upstream afterwards, and the writes of lower
//! tokens forwarded before it have ended before `t`'s is forwarded. A store gets there by three
//! rules:
//!
//! 1. One token per resource at a time: [`EpochStore::admit`] returns a [`Permit`] that excludes
//!    every write of the same resource with another token until the front end releases it after
//!    the exchange ended. Writes of the same token may share the resource (the redb store lets
//!    them, through [`Slots::share`]); the Postgres store forwards one write at a time (an
//!    in-process grant and a session advisory lock, so across replicas).
//! 2. The new highest token is durable before the forward starts, so a crash never lowers it.
//! 3. A forward whose outcome is unknown (timeout, connection lost after sending) may still be
//!    applied later: the resource stays closed for a quarantine period after it. The Postgres store
//!    writes the in-flight deadline into the record, so a replica that crashed mid-forward is
//!    waited out by the others too. The redb store saves its running quarantines when it is
//!    closed ([`EpochStore::close`]); opened after an unclean stop, it closes every resource for
//!    the forward timeout plus the quarantine, since it cannot know which had a write in flight.
//!
//! The limit that remains: an upstream that applies a request later than the forward timeout plus
//! the quarantine after the proxy gave up on it can still apply it after a newer write.
//!
//! # Layout
//! - [`store`]: the [`EpochStore`] trait, [`Admission`], [`Permit`], [`ForwardOutcome`], [`Timing`].
//! - [`mod@error`]: [`StoreError`], one variant per way a store can fail to decide.
//! - [`slots`]: the in-process per-resource grant table (shared by one token, or exclusive) with
//!   quarantine, shared by the stores.
//! - [`redb_store`]: [`RedbStore`], the embedded default.
//! - [`redb_writer`]: the redb store's commit thread (group commit of admissions).
//! - [`postgres_store`]: [`PostgresStore`], shared by many proxy replicas.
//! - [`spec`]: [`StoreSpec`], parsing `redb:PATH` / `postgres://...` and opening the store.
//! - [`highest`]: [`EpochsMax`], the highest token of a store over all resources (the floor of a
//!   lock cluster restored from a backup).

pub mod error;
pub mod highest;
pub mod postgres_store;
pub mod redb_store;
pub mod redb_writer;
pub mod slots;
pub mod spec;
pub mod store;

pub use error::StoreError;
pub use highest::EpochsMax;
pub use lockd_fence::FencingToken;
pub use postgres_store::PostgresStore;
pub use redb_store::RedbStore;
pub use slots::{Share, SlotGuard, Slots};
pub use spec::{StoreOptions, StoreSpec};
pub use store::{Admission, EpochStore, ForwardOutcome, Permit, PermitRelease, Timing};

//! Every bound of the lock table, kept together with its reason.
//!
//! The bounds that shape replicated state travel in each [`Policy`] the leader stamps on a batch,
//! so replicas configured differently still apply a batch identically.

use serde::{Deserialize, Serialize};

/// Default lease ttl: long enough to ride out a GC pause or a leader election, short enough that
/// a crashed holder's work is picked up within half a minute.
pub const LEASE_TTL_DEFAULT_MS: u64 = 30_000;
/// Shortest lease: below one second a renewal every ttl/3 competes with election timeouts.
pub const LEASE_TTL_MIN_MS: u64 = 1_000;
/// Longest lease: five minutes bounds how long a vanished holder blocks a resource.
pub const LEASE_TTL_MAX_MS: u64 = 300_000;
/// Longest wait a caller may ask for; longer waits belong in a job queue, not a lock.
pub const WAIT_TIMEOUT_MAX_MS: u64 = 300_000;
/// Resource names are keys in several indexes and in every audit line.
pub const RESOURCE_MAX_BYTES: usize = lockd_fence::RESOURCE_MAX_BYTES;
/// A request_id is a client-chosen idempotency key (a UUID is 36 bytes).
pub const REQUEST_ID_MAX_BYTES: usize = 128;
/// Holder is free text for humans (host, pid, job); bounded because it is stored per lease.
pub const HOLDER_MAX_BYTES: usize = 256;
/// Default bound on one resource's queue: a longer queue means the lock is the bottleneck.
pub const WAITERS_PER_RESOURCE_DEFAULT: u32 = 1_000;
/// Default bound on all queues of one tenant, so one tenant cannot exhaust the table.
pub const WAITERS_PER_TENANT_DEFAULT: u32 = 10_000;
/// How long a request_id keeps returning its original outcome (docs/api.md: at least 10 minutes).
pub const DEDUP_RETENTION_DEFAULT_MS: u64 = 600_000;
/// Upper bound on dedup records: 2,000 acquires/s for 10 minutes is 1.2 million; past this bound
/// new acquires are refused rather than forgetting records early.
pub const DEDUP_RECORDS_MAX: usize = 2_000_000;
/// Upper bound on resources with a holder or waiters (the design target is 100,000 resources
/// with 20,000 held); past it new grants are refused rather than growing without limit.
pub const ACTIVE_RESOURCES_MAX: usize = 1_000_000;

/// Signing keys kept (the active one and the retired ones): enough for several rotations within
/// the longest lease, small enough to list and to export as files.
pub const SIGNING_KEYS_MAX: usize = 8;
/// A retired signing key is kept at least this long after its retirement: every sequencer it
/// signed names a lease that has expired by then (a lease's ttl is at most [`LEASE_TTL_MAX_MS`]),
/// so stores that verify with the exported keys never refuse a current holder's sequencer.
pub const RETIRED_KEY_KEEP_MS: u64 = LEASE_TTL_MAX_MS;

/// Default bound on one tenant's dedup records (its acquires within the retention window): the
/// design load (2,000 acquires/s for 10 minutes, 1.2 million records) fits in one tenant with
/// 25% to spare, and a tenant at its bound still leaves 500,000 of the table-wide 2 million to
/// the others.
pub const DEDUP_RECORDS_PER_TENANT_DEFAULT: u32 = 1_500_000;
/// Default bound on one tenant's active resources (held or with waiters): the design target
/// (100,000 resources, 20,000 held) fits in one tenant with room, and a tenant at its bound
/// leaves 750,000 of the table-wide million to the others.
pub const ACTIVE_RESOURCES_PER_TENANT_DEFAULT: u32 = 250_000;

/// The bounds that shape replicated state, stamped by the leader on every batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Longest queue of one resource.
    pub waiters_per_resource_max: u32,
    /// Most waiters one tenant may have queued, over all its resources.
    pub waiters_per_tenant_max: u32,
    /// How long a request_id keeps returning its original outcome, in ms.
    pub dedup_retention_ms: u64,
    /// Most request_id records one tenant may have.
    pub dedup_records_per_tenant_max: u32,
    /// Most active resources (held or with waiters) one tenant may have.
    pub active_resources_per_tenant_max: u32,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            waiters_per_resource_max: WAITERS_PER_RESOURCE_DEFAULT,
            waiters_per_tenant_max: WAITERS_PER_TENANT_DEFAULT,
            dedup_retention_ms: DEDUP_RETENTION_DEFAULT_MS,
            dedup_records_per_tenant_max: DEDUP_RECORDS_PER_TENANT_DEFAULT,
            active_resources_per_tenant_max: ACTIVE_RESOURCES_PER_TENANT_DEFAULT,
        }
    }
}

/// The policy as unstamped (legacy) batches carry it, before per-tenant quotas.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LegacyPolicy {
    pub waiters_per_resource_max: u32,
    pub waiters_per_tenant_max: u32,
    pub dedup_retention_ms: u64,
}

impl From<LegacyPolicy> for Policy {
    /// No per-tenant quotas: those entries applied without them.
    fn from(p: LegacyPolicy) -> Self {
        Policy {
            waiters_per_resource_max: p.waiters_per_resource_max,
            waiters_per_tenant_max: p.waiters_per_tenant_max,
            dedup_retention_ms: p.dedup_retention_ms,
            dedup_records_per_tenant_max: u32::MAX,
            active_resources_per_tenant_max: u32::MAX,
        }
    }
}

impl From<Policy> for LegacyPolicy {
    fn from(p: Policy) -> Self {
        LegacyPolicy {
            waiters_per_resource_max: p.waiters_per_resource_max,
            waiters_per_tenant_max: p.waiters_per_tenant_max,
            dedup_retention_ms: p.dedup_retention_ms,
        }
    }
}

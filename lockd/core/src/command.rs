//! What the leader proposes, what apply answers, and the events apply emits.

use serde::{Deserialize, Serialize};

use crate::FencingToken;
use crate::limits::{LegacyPolicy, Policy};
use crate::types::{LeaseId, RequestKey, ResourceName};

/// One Raft entry: many client commands committed together (group commit), stamped once by the
/// leader with its clock and its policy. Apply takes time and bounds only from here.
///
/// Encoding: a stamped batch is written as `(STAMPED_MARKER, now_ms, stamp, policy, commands)`;
/// a batch without a stamp (every batch lockd wrote before the monotonic table clock) as
/// `(now_ms, policy, commands)`, which is how those batches sit in existing logs. The marker is
/// `i64::MIN`, which no wall-clock stamp ever was, so the first field tells the two apart.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// The leader's wall-clock time in Unix ms. With a [`Stamp`] it only sets the first time of
    /// an empty table (so `expires_at_ms` is roughly a Unix time); without one (legacy entries)
    /// it is the clock itself, clamped so the table's clock never goes backwards.
    pub now_ms: i64,
    /// Who stamped the batch and when by its monotonic clock; `None` only in legacy entries.
    pub stamp: Option<Stamp>,
    /// The limits and dedup retention the leader stamped on this batch, so every replica applies
    /// the same.
    pub policy: Policy,
    /// The client commands, applied in this order.
    pub commands: Vec<Command>,
}

/// The stamping leader's monotonic time, which advances the table's clock (see
/// [`crate::LockTable`]'s clock rule): only differences of two stamps of the same `session` are
/// ever used, so the offset of any node's wall clock does not matter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamp {
    /// The Raft term the leader believed it led when it stamped.
    pub term: u64,
    /// Random per process start: two stamps with the same session were read from one monotonic
    /// clock.
    pub session: u64,
    /// Milliseconds of that process's monotonic clock (since it started).
    pub mono_ms: u64,
    /// Random per process start, secret: the first stamped batch a table applies makes it the
    /// key of the table's keyed digests (request keys, argument digests, tenant tags).
    pub key_seed: u128,
}

/// First field of a stamped batch's encoding (see [`Batch`]).
const STAMPED_MARKER: i64 = i64::MIN;

impl Serialize for Batch {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        match &self.stamp {
            Some(stamp) => {
                let mut t = serializer.serialize_tuple(5)?;
                t.serialize_element(&STAMPED_MARKER)?;
                t.serialize_element(&self.now_ms)?;
                t.serialize_element(stamp)?;
                t.serialize_element(&self.policy)?;
                t.serialize_element(&self.commands)?;
                t.end()
            }
            None => {
                let mut t = serializer.serialize_tuple(3)?;
                t.serialize_element(&self.now_ms)?;
                t.serialize_element(&LegacyPolicy::from(self.policy))?;
                t.serialize_element(&self.commands)?;
                t.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for Batch {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct BatchVisitor;
        impl<'de> serde::de::Visitor<'de> for BatchVisitor {
            type Value = Batch;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a lockd command batch")
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Batch, A::Error> {
                use serde::de::Error;
                let missing = |what: &str| A::Error::custom(format!("lockd: batch without {what}"));
                let first: i64 = seq.next_element()?.ok_or_else(|| missing("a clock"))?;
                let (now_ms, stamp, policy) = if first == STAMPED_MARKER {
                    let now_ms = seq.next_element()?.ok_or_else(|| missing("now_ms"))?;
                    let stamp: Stamp = seq.next_element()?.ok_or_else(|| missing("a stamp"))?;
                    let policy: Policy = seq.next_element()?.ok_or_else(|| missing("a policy"))?;
                    (now_ms, Some(stamp), policy)
                } else {
                    let policy: LegacyPolicy =
                        seq.next_element()?.ok_or_else(|| missing("a policy"))?;
                    (first, None, Policy::from(policy))
                };
                let commands = seq.next_element()?.ok_or_else(|| missing("commands"))?;
                Ok(Batch {
                    now_ms,
                    stamp,
                    policy,
                    commands,
                })
            }
        }
        // Postcard reads the elements one by one and stops where the visitor stops, so the
        // shorter legacy layout decodes through the same call.
        deserializer.deserialize_tuple(5, BatchVisitor)
    }
}

/// A state change a client (or the leader's reaper) asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// Take the lock on `resource`, or queue for it.
    Acquire {
        /// The resource to lock.
        resource: ResourceName,
        /// The caller's id for this call: a retry with the same id gets the first call's answer.
        request_id: String,
        /// How long the lease lasts without a renewal, in ms.
        lease_ttl_ms: u64,
        /// 0 = answer `Held` instead of queueing.
        wait_timeout_ms: u64,
        /// Who holds the lease, as the caller named itself (shown by Describe and in the audit log).
        holder: String,
        /// Chosen by the leader's CSPRNG before proposing; used if this request is granted.
        lease_id: LeaseId,
    },
    /// Extend a lease the caller holds.
    Renew {
        /// The locked resource.
        resource: ResourceName,
        /// The lease to extend; any other id gets `NotFound`.
        lease_id: LeaseId,
        /// 0 = keep the lease's ttl.
        lease_ttl_ms: u64,
    },
    /// Give up a lease.
    Release {
        /// The locked resource.
        resource: ResourceName,
        /// The lease to end; another id leaves the resource as it is.
        lease_id: LeaseId,
    },
    /// Proposed by the leader's reaper: expire the lease and time out waiters of this resource
    /// whose time has passed by this batch's clock. Harmless when nothing is due.
    Reap {
        /// The resource to look at.
        resource: ResourceName,
    },
    /// A waiter leaves the queue: its wait timed out or its caller went away. Kept for entries
    /// written before `EndWaitAttempt`; applies to whichever attempt is current.
    EndWait {
        /// The resource the waiter queues for.
        resource: ResourceName,
        /// The request_id of the waiting acquire.
        request_id: String,
        /// Why the wait ends.
        reason: EndWaitReason,
    },
    /// Like `EndWait`, for one attempt of the request: `attempt` is the lease id drawn for the
    /// call that ends. A newer attempt (a retry with the same request_id) has replaced it if the
    /// ids differ, and then nothing happens: a cancel never removes a newer registration.
    /// (Appended last: variants are encoded by index, so older entries still decode.)
    EndWaitAttempt {
        /// The resource the waiter queues for.
        resource: ResourceName,
        /// The request_id of the waiting acquire.
        request_id: String,
        /// Why the wait ends.
        reason: EndWaitReason,
        /// The lease id drawn for the call that ends.
        attempt: LeaseId,
    },
    /// Proposed by the leader: makes `pkcs8` (an Ed25519 private key, PKCS#8 DER, made by the
    /// leader's CSPRNG) the key that signs sequencers, if the active key is `replaces` (`None`: no
    /// key yet). The previous active key is retired but kept (see [`crate::keys`]).
    /// (Appended last: variants are encoded by index, so older entries still decode.)
    InstallSigningKey {
        /// The new private key.
        pkcs8: Vec<u8>,
        /// Key id of the key it replaces; `None` when the table has no active key yet.
        replaces: Option<[u8; 8]>,
    },
    /// [`Command::Acquire`] whose `Held` answer is recorded under the request_id like a grant,
    /// so a late copy of the request is refused again instead of granted (chaos seed 9601).
    /// lockd proposes only this form now. The rule travels with the entry rather than with the
    /// binary: `Acquire` entries already in a log replay as they were first applied, so every
    /// replica computes the same table whichever snapshot it restarts from, and an older lockd
    /// cannot decode this variant and stops instead of applying it differently.
    /// (Appended last: variants are encoded by index.)
    AcquireV2 {
        /// The resource to lock.
        resource: ResourceName,
        /// The caller's id for this call: a retry with the same id gets the first call's answer.
        request_id: String,
        /// How long the lease lasts without a renewal, in ms.
        lease_ttl_ms: u64,
        /// 0 = answer `Held` (and record it) instead of queueing.
        wait_timeout_ms: u64,
        /// Who holds the lease, as the caller named itself (shown by Describe and in the audit log).
        holder: String,
        /// Chosen by the leader's CSPRNG before proposing; used if this request is granted.
        lease_id: LeaseId,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
/// Why a waiter leaves the queue.
pub enum EndWaitReason {
    /// Its wait_timeout_ms passed by the table's clock.
    TimedOut,
    /// Its caller went away (cancelled the call or disconnected).
    Cancelled,
}

/// A granted lease as the client sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    /// The lease's id, which renewals and the release must present.
    pub lease_id: LeaseId,
    /// The resource's fencing token for this lease: higher than any earlier lease of it.
    pub fencing_token: FencingToken,
    /// When the lease expires unless renewed, by the table's clock (roughly Unix ms).
    pub expires_at_ms: i64,
    /// The ttl the lease was granted (or last renewed) with, in ms.
    pub lease_ttl_ms: u64,
}

/// The answer to one command, in the order of the batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Acquire (or a retry of it, or an EndWait that lost the race to a grant).
    Granted(Grant),
    /// Acquire without waiting found the resource held.
    Held {
        /// The current lease's holder.
        holder: String,
    },
    /// Acquire joined (or, retried, is still in) the queue at this 1-based position.
    Queued {
        /// 1-based place in the queue.
        position: u32,
    },
    /// The wait ended without the lock (this call or an earlier one with the same request_id).
    WaitTimedOut,
    /// EndWait(Cancelled) removed the waiter, or found nothing to remove.
    WaitCancelled,
    /// Renew extended the lease.
    Renewed {
        /// The new expiry, by the table's clock (roughly Unix ms).
        expires_at_ms: i64,
        /// The ttl now in force, in ms.
        lease_ttl_ms: u64,
    },
    /// Renew with a lease id that is not current.
    NotFound,
    /// Release answer: `true` if the lease was current and ended, `false` if nothing changed.
    Released(bool),
    /// Reap ran (whether or not anything was due).
    Reaped,
    /// The same request_id came with different arguments.
    InvalidArgument(String),
    /// A waiter, table or tenant limit; the message names it.
    Exhausted(Limit, String),
    /// InstallSigningKey made this key the active one.
    SigningKeyInstalled {
        /// Id of the newly active key.
        key_id: [u8; 8],
    },
    /// InstallSigningKey changed nothing; the message says why (another key is active, the key
    /// bound is reached, the key does not parse).
    SigningKeyRefused(String),
}

/// The bound an `Exhausted` outcome hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Limit {
    /// `waiters_per_resource_max`: the resource's queue is full.
    WaitersPerResource,
    /// `waiters_per_tenant_max`: the tenant has that many waiters queued.
    WaitersPerTenant,
    /// `dedup_records_max`: the table-wide record of request_ids is full.
    DedupRecords,
    /// `active_resources_max`: the table holds that many locked or awaited resources.
    ActiveResources,
    /// `dedup_records_per_tenant_max`: the tenant has that many request_id records.
    DedupRecordsPerTenant,
    /// `active_resources_per_tenant_max`: the tenant has that many active resources.
    ActiveResourcesPerTenant,
}

impl Limit {
    /// Stable name for metrics (the flag or constant that sets the bound).
    pub fn name(&self) -> &'static str {
        match self {
            Limit::WaitersPerResource => "waiters_per_resource_max",
            Limit::WaitersPerTenant => "waiters_per_tenant_max",
            Limit::DedupRecords => "dedup_records_max",
            Limit::ActiveResources => "active_resources_max",
            Limit::DedupRecordsPerTenant => "dedup_records_per_tenant_max",
            Limit::ActiveResourcesPerTenant => "active_resources_per_tenant_max",
        }
    }
}

/// A state change, emitted by apply in log order for wake-ups, metrics and the audit log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// What happened.
    pub kind: EventKind,
    /// The resource it happened to.
    pub resource: ResourceName,
    /// The lease's token (for waiter events: 0).
    pub fencing_token: FencingToken,
    /// The lease's or waiter's holder name.
    pub holder: String,
    /// The request_id of the acquire behind the lease or waiter.
    pub request_id: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// What kind of state change an [`Event`] is.
pub enum EventKind {
    /// A lease was granted; `to_waiter` is set when it went to a queued request, whose call must
    /// be woken (and only that call).
    Granted {
        /// The queued request that got the lease; `None` for an immediate grant.
        to_waiter: Option<RequestKey>,
        /// The lease granted.
        grant: Grant,
    },
    /// A lease was renewed.
    Renewed,
    /// A lease was released by its holder.
    Released,
    /// A lease ran out without a renewal and was reaped.
    Expired,
    /// A request joined the queue.
    Queued,
    /// A waiter left: its caller went away.
    Cancelled {
        /// The waiter's request.
        waiter: RequestKey,
    },
    /// A waiter left: its wait ran out.
    TimedOut {
        /// The waiter's request.
        waiter: RequestKey,
    },
}

impl EventKind {
    /// Stable lower-case name for logs, metrics and the audit log.
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::Granted { .. } => "granted",
            EventKind::Renewed => "renewed",
            EventKind::Released => "released",
            EventKind::Expired => "expired",
            EventKind::Queued => "queued",
            EventKind::Cancelled { .. } => "cancelled",
            EventKind::TimedOut { .. } => "timed_out",
        }
    }
}

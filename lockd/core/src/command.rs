//! What the leader proposes, what apply answers, and the events apply emits.

use serde::{Deserialize, Serialize};

use crate::FencingToken;
use crate::limits::Policy;
use crate::types::{LeaseId, RequestKey, ResourceName};

/// One Raft entry: many client commands committed together (group commit), stamped once by the
/// leader with its clock and its policy. Apply takes time and bounds only from here.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Batch {
    /// The leader's wall-clock time in Unix ms, advanced by its monotonic clock. The table clamps
    /// it so its own clock never goes backwards.
    pub now_ms: i64,
    pub policy: Policy,
    pub commands: Vec<Command>,
}

/// A state change a client (or the leader's reaper) asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Command {
    Acquire {
        resource: ResourceName,
        request_id: String,
        lease_ttl_ms: u64,
        /// 0 = answer `Held` instead of queueing.
        wait_timeout_ms: u64,
        holder: String,
        /// Chosen by the leader's CSPRNG before proposing; used if this request is granted.
        lease_id: LeaseId,
    },
    Renew {
        resource: ResourceName,
        lease_id: LeaseId,
        /// 0 = keep the lease's ttl.
        lease_ttl_ms: u64,
    },
    Release {
        resource: ResourceName,
        lease_id: LeaseId,
    },
    /// Proposed by the leader's reaper: expire the lease and time out waiters of this resource
    /// whose time has passed by this batch's clock. Harmless when nothing is due.
    Reap { resource: ResourceName },
    /// A waiter leaves the queue: its wait timed out or its caller went away.
    EndWait {
        resource: ResourceName,
        request_id: String,
        reason: EndWaitReason,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum EndWaitReason {
    TimedOut,
    Cancelled,
}

/// A granted lease as the client sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub lease_id: LeaseId,
    pub fencing_token: FencingToken,
    pub expires_at_ms: i64,
    pub lease_ttl_ms: u64,
}

/// The answer to one command, in the order of the batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Acquire (or a retry of it, or an EndWait that lost the race to a grant).
    Granted(Grant),
    /// Acquire without waiting found the resource held.
    Held {
        holder: String,
    },
    /// Acquire joined (or, retried, is still in) the queue at this 1-based position.
    Queued {
        position: u32,
    },
    /// The wait ended without the lock (this call or an earlier one with the same request_id).
    WaitTimedOut,
    /// EndWait(Cancelled) removed the waiter, or found nothing to remove.
    WaitCancelled,
    Renewed {
        expires_at_ms: i64,
        lease_ttl_ms: u64,
    },
    /// Renew with a lease id that is not current.
    NotFound,
    Released(bool),
    Reaped,
    /// The same request_id came with different arguments.
    InvalidArgument(String),
    /// A waiter or table limit; the message names it.
    Exhausted(String),
}

/// A state change, emitted by apply in log order for wake-ups, metrics and the audit log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub kind: EventKind,
    pub resource: ResourceName,
    /// The lease's token (for waiter events: 0).
    pub fencing_token: FencingToken,
    pub holder: String,
    pub request_id: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// A lease was granted; `to_waiter` is set when it went to a queued request, whose call must
    /// be woken (and only that call).
    Granted {
        to_waiter: Option<RequestKey>,
        grant: Grant,
    },
    Renewed,
    Released,
    Expired,
    Queued,
    /// A waiter left: its caller went away.
    Cancelled {
        waiter: RequestKey,
    },
    /// A waiter left: its wait ran out.
    TimedOut {
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

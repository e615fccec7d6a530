//! The one table from lockd's outcomes to gRPC statuses (docs/api.md, "Errors"). Every status
//! carries a `google.rpc.ErrorInfo` of domain `lockd` whose reason tells a program what to do
//! (see [`lockd_api::errors::Reason`]); the message starts with `lockd: ` and names the values
//! involved, for people.

use lockd_api::errors::{DECIDED_BY_KEY, DECIDED_BY_STATE_MACHINE, Reason, status};
use lockd_core::command::Limit;
use tonic::{Code, Status};

use crate::proposer::ProposeError;

/// The ErrorInfo metadata entry on every refusal that settles this call (see
/// [`lockd_api::errors::DECIDED_BY_KEY`]): the state machine's answers recorded under the request
/// id (held, a wait the queue timed out), a lease that is not current, and a request id reused
/// with other arguments. Clients read a refusal without it, after an earlier attempt of theirs may
/// have arrived, as "outcome unknown", since such a refusal (parked-wait and transit bounds, field
/// checks, authorization, the table's bounds, which are not recorded) says nothing about that
/// earlier attempt (docs/api.md, "Status codes and reasons").
const DECIDED: (&str, &str) = (DECIDED_BY_KEY, DECIDED_BY_STATE_MACHINE);

/// `lockd: ` and the message (once: messages of the vote gate already start with it).
fn prefixed(msg: impl std::fmt::Display) -> String {
    let msg = msg.to_string();
    if msg.starts_with("lockd: ") {
        msg
    } else {
        format!("lockd: {msg}")
    }
}

/// `INVALID_ARGUMENT` for the request field `field`.
pub fn invalid_field(field: &str, msg: impl std::fmt::Display) -> Status {
    status(
        Code::InvalidArgument,
        prefixed(msg),
        Reason::InvalidField,
        &[("field", field)],
    )
}

/// `INVALID_ARGUMENT` where no single field is at fault, decided at the edge.
pub fn invalid(msg: impl std::fmt::Display) -> Status {
    status(
        Code::InvalidArgument,
        prefixed(msg),
        Reason::InvalidField,
        &[],
    )
}

/// `INVALID_ARGUMENT` from the state machine's own checks of a request id (reused with other
/// arguments, a digest collision): its decision for this request.
pub fn decided_invalid(msg: impl std::fmt::Display) -> Status {
    status(
        Code::InvalidArgument,
        prefixed(msg),
        Reason::InvalidField,
        &[DECIDED],
    )
}

/// `FAILED_PRECONDITION`: the request is well formed but the cluster's state refuses it.
pub fn precondition(field: &str, msg: impl std::fmt::Display) -> Status {
    status(
        Code::FailedPrecondition,
        prefixed(msg),
        Reason::InvalidField,
        &[("field", field)],
    )
}

pub fn held(resource: &str, holder: &str) -> Status {
    // A refusal is this request_id's answer for good (a retry gets it again), so a new try
    // needs a new request_id. A replayed refusal names whoever holds the resource now (empty:
    // nobody, or a holder that gave no name).
    status(
        Code::Aborted,
        format!(
            "lockd: resource {resource:?} is held (holder now: {holder:?}), or was when this \
             request_id was first answered; try again later with a new request_id (with \
             wait_timeout_ms to queue)"
        ),
        Reason::LockHeld,
        &[("resource", resource), DECIDED],
    )
}

/// Whether a refusal is the state machine's decision for this request (see [`DECIDED`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decided {
    /// The log decided it for this request.
    ByStateMachine,
    /// A node decided it on its own (e.g. a backstop timer): it may not speak for every attempt.
    ByThisNode,
}

pub fn wait_timed_out(resource: &str, wait_ms: u64, decided: Decided) -> Status {
    let wait = wait_ms.to_string();
    let mut metadata = vec![("resource", resource), ("wait_timeout_ms", wait.as_str())];
    if decided == Decided::ByStateMachine {
        metadata.push(DECIDED);
    }
    status(
        Code::DeadlineExceeded,
        format!("lockd: waited {wait_ms} ms for {resource:?} without getting the lock"),
        Reason::WaitTimeout,
        &metadata,
    )
}

pub fn not_found(resource: &str) -> Status {
    status(
        Code::NotFound,
        format!(
            "lockd: that lease is not the current lease of {resource:?} (expired, released, superseded or unknown); stop work that depends on it"
        ),
        Reason::LeaseNotCurrent,
        &[("resource", resource), DECIDED],
    )
}

/// `RESOURCE_EXHAUSTED` for `limit` of the table, named in the metadata key `limit`. Not marked
/// [`DECIDED`], although the state machine decides it: the table does not record it under the
/// request id (unlike `LOCK_HELD`), so it does not settle the request, and a late copy of an
/// earlier attempt may still be granted once the bound has room.
pub fn exhausted(limit: Limit, msg: impl std::fmt::Display) -> Status {
    let reason = match limit {
        Limit::WaitersPerResource | Limit::WaitersPerTenant => Reason::WaitersExhausted,
        Limit::DedupRecords
        | Limit::ActiveResources
        | Limit::DedupRecordsPerTenant
        | Limit::ActiveResourcesPerTenant => Reason::LimitReached,
    };
    status(
        Code::ResourceExhausted,
        prefixed(msg),
        reason,
        &[("limit", limit.name())],
    )
}

/// `RESOURCE_EXHAUSTED` for one of the bounds on waiting Acquires parked on the node the client
/// called (`parked.rs`: per source address, per node; `members.rs`: the follower's connections
/// to the leader), named in the metadata key `limit`. Nothing was proposed.
pub fn waits_exhausted(limit: &'static str, msg: impl std::fmt::Display) -> Status {
    status(
        Code::ResourceExhausted,
        prefixed(msg),
        Reason::WaitersExhausted,
        &[("limit", limit)],
    )
}

/// `RESOURCE_EXHAUSTED` for one of the node's bounds on calls in transit (`receiving.rs`: bytes of
/// requests not yet received and answers not yet taken, per address or in all; the time to
/// arrive; reflection calls), named in the metadata key `limit`. The handler never ran.
pub fn transit_exhausted(limit: &'static str, msg: impl std::fmt::Display) -> Status {
    status(
        Code::ResourceExhausted,
        prefixed(msg),
        Reason::LimitReached,
        &[("limit", limit)],
    )
}

/// `UNIMPLEMENTED` with the ErrorInfo of a transport bound: a health `Watch` over its bound. gRPC's
/// client-side health checking treats UNIMPLEMENTED as "no health service" and keeps using the
/// node, where any other code would make it treat the node as down: a source (or four) holding
/// every Watch place must not take the node out of its clients' rotation.
pub fn watch_refused(limit: &'static str, msg: impl std::fmt::Display) -> Status {
    status(
        Code::Unimplemented,
        prefixed(msg),
        Reason::LimitReached,
        &[("limit", limit)],
    )
}

/// `UNAVAILABLE`, nothing proposed: no leader known, reachable or confirmed. Safe to retry.
pub fn no_quorum(msg: impl std::fmt::Display) -> Status {
    status(Code::Unavailable, prefixed(msg), Reason::NoQuorum, &[])
}

/// `UNAVAILABLE`, refused before proposing because the node is overloaded. Safe to retry later.
pub fn overloaded(msg: impl std::fmt::Display) -> Status {
    status(Code::Unavailable, prefixed(msg), Reason::Overloaded, &[])
}

/// `UNAVAILABLE`, the call may have committed: retry with the same request_id.
pub fn outcome_unknown(msg: impl std::fmt::Display) -> Status {
    status(
        Code::Unavailable,
        prefixed(msg),
        Reason::OutcomeUnknown,
        &[],
    )
}

/// `INTERNAL`: a state this node did not expect after the call arrived; it may have committed.
pub fn internal(msg: impl std::fmt::Display) -> Status {
    status(Code::Internal, prefixed(msg), Reason::OutcomeUnknown, &[])
}

/// `UNAUTHENTICATED`: credentials (token, certificate, peer identity) not accepted.
pub fn unauthenticated(msg: impl std::fmt::Display) -> Status {
    status(
        Code::Unauthenticated,
        prefixed(msg),
        Reason::Unauthenticated,
        &[],
    )
}

/// What an admin call is answered in open mode (no `--auth-policy`) when it may not run there:
/// PERMISSION_DENIED naming the call (`what`), the caller's address, why open mode refuses it
/// (`danger`), and the two ways out: a policy, whose `admin` operation covers `covered`, or
/// `flag`, after which `anyone_then` (shared by `service::snapshot::may_save` and
/// `service::membership::may_change`).
pub fn open_mode_refused(
    what: &str,
    danger: &str,
    covered: &str,
    flag: &str,
    anyone_then: &str,
    remote: Option<std::net::SocketAddr>,
) -> Status {
    permission_denied(
        format!(
            "{what} refused: this node runs without --auth-policy, so it cannot tell who the \
             caller ({}) is, and {danger}. Give the nodes --auth-policy ({covered} the `admin` \
             operation), or start them with {flag} (then anyone who reaches the port can \
             {anyone_then})",
            remote.map_or_else(|| "address unknown".to_owned(), |a| a.to_string())
        ),
        "anonymous",
        "admin",
        None,
    )
}

/// `PERMISSION_DENIED` for `identity` doing `operation` (on `resource`), all three in the metadata.
pub fn permission_denied(
    msg: impl std::fmt::Display,
    identity: &str,
    operation: &str,
    resource: Option<&str>,
) -> Status {
    let mut metadata = vec![("identity", identity), ("operation", operation)];
    if let Some(r) = resource {
        metadata.push(("resource", r));
    }
    status(
        Code::PermissionDenied,
        prefixed(msg),
        Reason::PermissionDenied,
        &metadata,
    )
}

/// A proposal without an outcome. Overload is "definitely not done"; everything else may have
/// committed, so the caller must retry with the same request_id.
pub fn propose_failed(node: u64, e: ProposeError) -> Status {
    match e {
        ProposeError::Overloaded => {
            overloaded(format!("node {node}: {e}; nothing was done, retry later"))
        }
        ProposeError::Unknown(why) => outcome_unknown(format!(
            "node {node}: outcome unknown ({why}); retry with the same request_id"
        )),
    }
}

/// Whether `status` is an answer from a lockd node (it carries lockd's ErrorInfo), as opposed to
/// a transport failure on the way to one. A forwarding node passes the former on unchanged.
pub fn is_from_lockd(status: &Status) -> bool {
    lockd_api::errors::is_from_lockd(status)
}

/// A forwarded call that failed on the way to the leader: if the connection was never made,
/// nothing was done; otherwise the leader may have committed it.
pub fn forward_failed(msg: String, transport: &Status) -> Status {
    if lockd_api::errors::is_connect_error(transport) {
        no_quorum(format!(
            "{msg}; the connection was refused, nothing was done, retry"
        ))
    } else {
        outcome_unknown(format!(
            "{msg}; outcome unknown, retry with the same request_id"
        ))
    }
}

/// The `outcome` label of `lockd_requests_total` for a reply.
pub fn outcome_label<T>(result: &Result<T, Status>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(s) => match s.code() {
            Code::Aborted => "held",
            Code::DeadlineExceeded => "timeout",
            Code::NotFound => "not_found",
            Code::InvalidArgument => "invalid",
            Code::ResourceExhausted => "exhausted",
            _ => "unavailable",
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockd_api::errors::reason_of;

    #[test]
    fn every_helper_carries_its_reason() {
        let cases = [
            (invalid_field("resource", "x"), Reason::InvalidField),
            (invalid("x"), Reason::InvalidField),
            (precondition("replaces_key_id", "x"), Reason::InvalidField),
            (held("a", "h"), Reason::LockHeld),
            (
                wait_timed_out("a", 5, Decided::ByStateMachine),
                Reason::WaitTimeout,
            ),
            (not_found("a"), Reason::LeaseNotCurrent),
            (
                exhausted(Limit::WaitersPerTenant, "x"),
                Reason::WaitersExhausted,
            ),
            (exhausted(Limit::ActiveResources, "x"), Reason::LimitReached),
            (no_quorum("x"), Reason::NoQuorum),
            (overloaded("x"), Reason::Overloaded),
            (outcome_unknown("x"), Reason::OutcomeUnknown),
            (internal("x"), Reason::OutcomeUnknown),
            (unauthenticated("x"), Reason::Unauthenticated),
            (
                permission_denied("x", "anonymous", "acquire", Some("a")),
                Reason::PermissionDenied,
            ),
            (
                propose_failed(1, ProposeError::Overloaded),
                Reason::Overloaded,
            ),
            (
                propose_failed(1, ProposeError::Unknown("x".into())),
                Reason::OutcomeUnknown,
            ),
        ];
        for (s, want) in cases {
            assert!(s.message().starts_with("lockd: "), "{s:?}");
            assert!(is_from_lockd(&s), "{s:?}");
            assert_eq!(reason_of(&s).map(|(r, _)| r), Some(want), "{s:?}");
        }
        let (_, md) = reason_of(&invalid_field("lease_ttl_ms", "x")).unwrap();
        assert_eq!(md["field"], "lease_ttl_ms");
        let (_, md) = reason_of(&exhausted(Limit::DedupRecordsPerTenant, "x")).unwrap();
        assert_eq!(md["limit"], "dedup_records_per_tenant_max");
    }

    /// Goal (review "clients" finding 2, review "clients2" finding 2): exactly the refusals that
    /// settle the request carry the `decided_by` mark: those the state machine records under the
    /// request id (held, a wait the queue timed out), a lease that is not current, and a request id
    /// reused with other arguments (this call's answer). Those decided before the request id is
    /// looked up (parked-wait and transit bounds, field checks, authorization, forwarding) do not,
    /// nor do the table's bounds: they are not recorded, so a late copy of an earlier attempt of
    /// the same request may still be granted once the bound has room.
    #[test]
    fn review_clients_finding2_only_the_state_machines_refusals_are_marked() {
        use lockd_api::errors::decided_by_state_machine;
        let marked = [
            held("a", "h"),
            wait_timed_out("a", 5, Decided::ByStateMachine),
            not_found("a"),
            decided_invalid("request_id reused"),
        ];
        for s in &marked {
            assert!(decided_by_state_machine(s), "not marked: {s:?}");
        }
        let unmarked = [
            exhausted(Limit::WaitersPerResource, "x"),
            exhausted(Limit::WaitersPerTenant, "x"),
            exhausted(Limit::DedupRecords, "x"),
            exhausted(Limit::DedupRecordsPerTenant, "x"),
            exhausted(Limit::ActiveResources, "x"),
            exhausted(Limit::ActiveResourcesPerTenant, "x"),
            wait_timed_out("a", 5, Decided::ByThisNode),
            invalid_field("lease_ttl_ms", "x"),
            invalid("x"),
            precondition("id", "x"),
            waits_exhausted("waits_per_source_max", "x"),
            transit_exhausted("receiving_per_source_max", "x"),
            watch_refused("watch_streams_max", "x"),
            no_quorum("x"),
            overloaded("x"),
            outcome_unknown("x"),
            internal("x"),
            unauthenticated("x"),
            permission_denied("x", "anonymous", "acquire", Some("a")),
            forward_failed("x".into(), &Status::unavailable("reset")),
        ];
        for s in &unmarked {
            assert!(!decided_by_state_machine(s), "marked: {s:?}");
        }
        // The mark sits beside the other metadata, which keeps its meaning.
        let (_, md) = reason_of(&held("a", "h")).unwrap();
        assert_eq!(md["resource"], "a");
        assert_eq!(md["decided_by"], "state_machine");
    }

    #[test]
    fn a_plain_status_is_not_from_lockd() {
        // What tonic makes of a broken connection or a proxy's refusal: no ErrorInfo.
        assert!(!is_from_lockd(&Status::unavailable(
            "lockd: looks like ours"
        )));
    }
}

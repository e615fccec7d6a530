//! The errors a caller branches on, and the one table that maps gRPC statuses onto them.
//!
//! | status from lockd | `Acquire` | `Renew` | `Release` / `Describe` / `Status` |
//! |---|---|---|---|
//! | `ABORTED` | [`Error::Held`] | - | - |
//! | `DEADLINE_EXCEEDED` with reason `WAIT_TIMEOUT` | [`Error::WaitTimedOut`] | retried | retried |
//! | `RESOURCE_EXHAUSTED` | [`Error::LimitReached`] | same | same |
//! | `INVALID_ARGUMENT` | [`Error::InvalidArgument`] | same | same |
//! | `NOT_FOUND` | [`Error::NotFound`] | [`Error::NotFound`] | [`Error::NotFound`] |
//! | `PERMISSION_DENIED` | [`Error::PermissionDenied`] | same | same |
//! | `UNAUTHENTICATED` | [`Error::Unauthenticated`] | same | same |
//! | `UNAVAILABLE`, transport error, no answer | retried, then [`Error::OutcomeUnknown`] | same | same (reads: [`Error::Unavailable`]) |
//! | connection refused on every attempt | [`Error::Unavailable`] | same | same |
//! | anything else | [`Error::Protocol`] | same | same |
//!
//! Once an earlier attempt of an `Acquire`, `Renew` or `Release` may have reached a node (or the
//! caller gave the request id of an earlier call), a refusal without lockd's `decided_by =
//! state_machine` mark becomes [`Error::OutcomeUnknown`]: it was decided before the request id
//! was looked up and says nothing about that earlier attempt (docs/clients.md, rule 6).

use std::fmt;
use std::time::Duration;

use lockd_api::errors::{Reason, decided_by_state_machine, is_connect_error, reason_of};
use tonic::{Code, Status};

use crate::request_id::RequestId;

/// The RPC an error came from; it decides how a status is read (see the table above).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Take a lock, or wait for it.
    Acquire,
    /// Extend a lease.
    Renew,
    /// Give up a lease.
    Release,
    /// Read one resource's state.
    Describe,
    /// Read the cluster's state.
    Status,
    /// Admin: list the sequencer signing keys.
    SigningKeys,
    /// Admin: rotate the sequencer signing key.
    RotateSigningKey,
    /// Admin: stream a backup of the state machine.
    SaveSnapshot,
    /// Admin: list the members.
    ListMembers,
    /// Admin: add, promote or remove a member.
    ChangeMembers,
    /// Admin: move leadership to another voter.
    TransferLeader,
}

impl Op {
    /// Whether the RPC changes state, so that an unanswered attempt leaves its outcome unknown.
    pub fn mutates(self) -> bool {
        matches!(
            self,
            Op::Acquire
                | Op::Renew
                | Op::Release
                | Op::RotateSigningKey
                | Op::ChangeMembers
                | Op::TransferLeader
        )
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Acquire => "acquire",
            Op::Renew => "renew",
            Op::Release => "release",
            Op::Describe => "describe",
            Op::Status => "status",
            Op::SigningKeys => "signing keys",
            Op::RotateSigningKey => "rotate signing key",
            Op::SaveSnapshot => "snapshot save",
            Op::ListMembers => "list members",
            Op::ChangeMembers => "change members",
            Op::TransferLeader => "transfer leader",
        })
    }
}

/// What a failed call did to the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Definitely not done: nothing was granted, renewed or released.
    NotDone,
    /// May have happened. For `Acquire`, retry with the same request id to learn the outcome; a
    /// lease granted and never learnt expires after its ttl.
    Unknown,
}

/// Errors of [`crate::Client`] and [`crate::LeaseGuard`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `ABORTED`: another lease holds the resource and the call did not wait. Not granted.
    #[error("{resource:?} is held by another lease (not granted): {message}")]
    Held {
        /// The resource asked for.
        resource: String,
        /// The server's message.
        message: String,
    },

    /// `DEADLINE_EXCEEDED` on `Acquire`: waited `wait_timeout` without getting the lock. Not
    /// granted, and the waiter has left the queue.
    #[error("waited {} for {resource:?} without getting it (not granted): {message}", humanize(*wait_timeout))]
    WaitTimedOut {
        /// The resource asked for.
        resource: String,
        /// How long the call asked to wait.
        wait_timeout: Duration,
        /// The server's message.
        message: String,
    },

    /// `RESOURCE_EXHAUSTED`: the waiter limit of the resource or its tenant is reached. Not granted.
    #[error("waiter limit reached for {resource:?} (not granted): {message}")]
    LimitReached {
        /// The resource asked for.
        resource: String,
        /// The server's message, which names the limit.
        message: String,
    },

    /// `INVALID_ARGUMENT` from the server, or an argument this client refused to send.
    #[error("invalid argument: {message}")]
    InvalidArgument {
        /// Which argument and why.
        message: String,
    },

    /// `NOT_FOUND`: the lease is not the current lease of the resource (expired, released,
    /// superseded or unknown). Nothing was renewed.
    #[error(
        "lease {lease} of {resource:?} is not current (expired, released or superseded): {message}"
    )]
    NotFound {
        /// The lease's resource.
        resource: String,
        /// The lease id presented.
        lease: String,
        /// The server's message.
        message: String,
    },

    /// The call may or may not have taken effect: an attempt reached a node (or may have) but no
    /// answer arrived before the deadline, or a later attempt was refused in a way that says
    /// nothing about it. For `Acquire`, retry with `request_id`.
    #[error(
        "{op} of {resource:?}: outcome unknown after {attempts} attempt(s) in {}{}: {last_error}",
        humanize(*elapsed),
        request_id.as_ref().map(|id| format!(" (retry with request id {})", crate::lease::abbreviate(id.as_str()))).unwrap_or_default()
    )]
    OutcomeUnknown {
        /// The RPC.
        op: Op,
        /// The resource it was for.
        resource: String,
        /// The request id to retry an `Acquire` with; `None` for other RPCs. A credential:
        /// messages and `Debug` show its start only, [`RequestId::as_str`] all of it.
        request_id: Option<RequestId>,
        /// Attempts made.
        attempts: u32,
        /// Time spent on them.
        elapsed: Duration,
        /// The last attempt's error.
        last_error: String,
    },

    /// No node could serve the call before the deadline and nothing was done: every attempt
    /// failed to connect, or the call only reads.
    #[error(
        "{op}{}: no lockd node answered after {attempts} attempt(s) in {} (not done): {last_error}",
        resource.as_ref().map(|r| format!(" of {r:?}")).unwrap_or_default(),
        humanize(*elapsed)
    )]
    Unavailable {
        /// The RPC.
        op: Op,
        /// The resource it was for; `None` for cluster-wide RPCs.
        resource: Option<String>,
        /// Attempts made.
        attempts: u32,
        /// Time spent on them.
        elapsed: Duration,
        /// The last attempt's error.
        last_error: String,
    },

    /// An endpoint that is not `host:port` or `http://host:port`.
    #[error("bad endpoint {endpoint:?}: {reason}")]
    BadEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What is wrong with it.
        reason: String,
    },

    /// TLS settings that cannot be used (a file that cannot be read, a certificate without
    /// its key).
    #[error("TLS: {reason}")]
    BadTls {
        /// What is wrong, naming the file.
        reason: String,
    },

    /// `PERMISSION_DENIED`: the cluster's authorization policy does not let this client's
    /// identity do this. Not done.
    #[error("{op}: {message}")]
    PermissionDenied {
        /// The RPC.
        op: Op,
        /// The server's message (identity, operation and resource).
        message: String,
    },

    /// `UNAUTHENTICATED`: the cluster did not accept this client's credentials (a bearer token
    /// it does not know, a certificate it does not trust). Not done.
    #[error("{op}: {message}")]
    Unauthenticated {
        /// The RPC.
        op: Op,
        /// The server's message.
        message: String,
    },

    /// A bearer token that cannot be used (a file that cannot be read, an empty token).
    #[error("bearer token: {reason}")]
    BadToken {
        /// What is wrong with it.
        reason: String,
    },

    /// A status docs/api.md does not list for this RPC (e.g. `INTERNAL`, `UNIMPLEMENTED`).
    #[error("{op}: unexpected reply {code:?} from lockd: {message}")]
    Protocol {
        /// The RPC.
        op: Op,
        /// The gRPC code answered.
        code: Code,
        /// The server's message.
        message: String,
        /// Whether the call may have taken effect (unknown for a mutating RPC).
        outcome: Outcome,
    },
}

impl Error {
    /// Whether the cluster may have done what the call asked.
    pub fn outcome(&self) -> Outcome {
        match self {
            Error::OutcomeUnknown { .. } => Outcome::Unknown,
            Error::Protocol { outcome, .. } => *outcome,
            _ => Outcome::NotDone,
        }
    }

    /// Whether `Acquire` definitely did not grant a lease (the opposite of "outcome unknown").
    pub fn is_definitely_not_granted(&self) -> bool {
        self.outcome() == Outcome::NotDone
    }
}

/// How one failed attempt is handled by the retry loop.
#[derive(Debug)]
pub(crate) enum AttemptFailure {
    /// The request never left this client (connection refused, connect timeout): retry elsewhere,
    /// nothing happened.
    NotSent(String),
    /// The request may have reached a node (server `UNAVAILABLE`, broken connection, no answer in
    /// time): retry elsewhere, the outcome is unknown until an answer arrives.
    MaybeSent(String),
    /// A definite answer: stop retrying.
    Final(Status),
}

/// Sorts a failed attempt's status into "retry" or "final". Transport errors carry a source error
/// (tonic builds them from the failing I/O); statuses sent by a server have none.
pub(crate) fn classify(op: Op, status: Status, endpoint: &str) -> AttemptFailure {
    let describe = |s: &Status| format!("{endpoint}: {:?}: {}", s.code(), s.message());
    if is_connect_error(&status) {
        return AttemptFailure::NotSent(describe(&status));
    }
    let from_transport = std::error::Error::source(&status).is_some();
    // lockd says in its ErrorInfo whether the call may have taken effect; a status without one
    // did not come from lockd (a broken connection, a proxy) and proves nothing.
    let reason = reason_of(&status).map(|(r, _)| r);
    match status.code() {
        Code::Unavailable if reason.is_some_and(Reason::nothing_done) => {
            AttemptFailure::NotSent(describe(&status))
        }
        Code::Unavailable => AttemptFailure::MaybeSent(describe(&status)),
        // A broken connection surfaces as UNKNOWN or CANCELLED with the I/O error as source; a
        // proxy's INTERNAL carries no ErrorInfo, and lockd's own INTERNAL says OUTCOME_UNKNOWN
        // (docs/clients.md rule 4): none says what happened to the request.
        Code::Unknown | Code::Cancelled | Code::Internal
            if from_transport || reason.is_none() || reason == Some(Reason::OutcomeUnknown) =>
        {
            AttemptFailure::MaybeSent(describe(&status))
        }
        // Only a waiting Acquire has a deadline of its own, and lockd says so with WAIT_TIMEOUT;
        // anything else (a proxy's or a server-side timeout) says nothing final.
        Code::DeadlineExceeded if op != Op::Acquire || reason != Some(Reason::WaitTimeout) => {
            AttemptFailure::MaybeSent(describe(&status))
        }
        _ => AttemptFailure::Final(status),
    }
}

/// Whether a final refusal of `op` speaks for the attempt it answers only, so that after an
/// earlier attempt that may have arrived the outcome is unknown. lockd refuses some calls before
/// it looks the request id up: bounds on parked waits and on calls in transit, field checks and
/// the authorization policy (which may differ between nodes during a rollout). It marks the
/// refusals its state machine decided for the request (`decided_by = state_machine`); an older
/// lockd marks none, which only makes this client more cautious.
///
/// A Renew answered `NOT_FOUND` is final whatever came before: Renew is not deduplicated, and an
/// earlier renewal that succeeded could only have extended the current lease, so `NOT_FOUND`
/// now means the lease is not current now. The admin calls are not covered: their refusals
/// (`FAILED_PRECONDITION` of the membership calls) are about the cluster's state and their
/// retries are safe by design.
pub(crate) fn speaks_for_this_attempt_only(op: Op, status: &Status) -> bool {
    if !matches!(op, Op::Acquire | Op::Renew | Op::Release) || decided_by_state_machine(status) {
        return false;
    }
    !(op == Op::Renew && status.code() == Code::NotFound)
}

/// Maps a final status of `op` on `resource` to the caller's error (the table above).
pub(crate) fn from_final_status(
    op: Op,
    status: Status,
    resource: &str,
    lease: Option<&str>,
    wait_timeout: Duration,
) -> Error {
    let message = status.message().to_owned();
    let resource = resource.to_owned();
    match status.code() {
        Code::Aborted if op == Op::Acquire => Error::Held { resource, message },
        Code::DeadlineExceeded if op == Op::Acquire => Error::WaitTimedOut {
            resource,
            wait_timeout,
            message,
        },
        Code::ResourceExhausted => Error::LimitReached { resource, message },
        Code::InvalidArgument => Error::InvalidArgument { message },
        Code::PermissionDenied => Error::PermissionDenied { op, message },
        Code::Unauthenticated => Error::Unauthenticated { op, message },
        Code::NotFound => Error::NotFound {
            resource,
            lease: lease.map(crate::lease::abbreviate).unwrap_or_default(),
            message,
        },
        code => Error::Protocol {
            op,
            code,
            message,
            // INTERNAL after the request arrived may hide a commit; only a read is harmless.
            outcome: if op.mutates() {
                Outcome::Unknown
            } else {
                Outcome::NotDone
            },
        },
    }
}

/// `1.5s`-style rendering for messages.
pub(crate) fn humanize(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_statuses_are_final_and_typed() {
        let held = from_final_status(
            Op::Acquire,
            Status::aborted("lockd: \"a\" is held"),
            "a",
            None,
            Duration::ZERO,
        );
        assert!(matches!(held, Error::Held { .. }), "{held:?}");
        assert!(held.is_definitely_not_granted());
        assert!(held.to_string().contains("\"a\""), "{held}");

        let timed_out = from_final_status(
            Op::Acquire,
            Status::deadline_exceeded("lockd: waited"),
            "a",
            None,
            Duration::from_secs(3),
        );
        assert!(matches!(timed_out, Error::WaitTimedOut { .. }));
        assert!(timed_out.to_string().contains("3s"), "{timed_out}");

        let nf = from_final_status(
            Op::Renew,
            Status::not_found("lockd: lease not current"),
            "a",
            Some("0123456789abcdef0123"),
            Duration::ZERO,
        );
        assert!(matches!(nf, Error::NotFound { .. }));
        assert!(
            !nf.to_string().contains("0123456789abcdef0123"),
            "full lease id leaked: {nf}"
        );

        let limit = from_final_status(
            Op::Acquire,
            Status::resource_exhausted("x"),
            "a",
            None,
            Duration::ZERO,
        );
        assert!(matches!(limit, Error::LimitReached { .. }));
        let invalid = from_final_status(
            Op::Acquire,
            Status::invalid_argument("x"),
            "a",
            None,
            Duration::ZERO,
        );
        assert!(matches!(invalid, Error::InvalidArgument { .. }));
        let internal = from_final_status(
            Op::Acquire,
            Status::internal("x"),
            "a",
            None,
            Duration::ZERO,
        );
        assert_eq!(internal.outcome(), Outcome::Unknown);
        let internal_read = from_final_status(
            Op::Describe,
            Status::internal("x"),
            "a",
            None,
            Duration::ZERO,
        );
        assert_eq!(internal_read.outcome(), Outcome::NotDone);
    }

    #[test]
    fn unavailable_is_retried_with_unknown_outcome() {
        let f = classify(Op::Acquire, Status::unavailable("lockd: no quorum"), "e1");
        assert!(
            matches!(f, AttemptFailure::MaybeSent(ref m) if m.contains("e1")),
            "{f:?}"
        );
        // UNKNOWN, CANCELLED or INTERNAL without lockd's ErrorInfo (a proxy's), or lockd's own
        // INTERNAL with OUTCOME_UNKNOWN, says nothing of the request: retried with the same id,
        // so that an Acquire ends with its request id (review of the clients, second round:
        // such an Acquire ended as a protocol error with no id, and lockctl exited 1).
        for status in [
            Status::unknown("boom"),
            Status::internal("a proxy's"),
            Status::cancelled("gone"),
            lockd_api::errors::status(
                Code::Internal,
                "lockd: internal".into(),
                Reason::OutcomeUnknown,
                &[],
            ),
        ] {
            let f = classify(Op::Acquire, status, "e1");
            assert!(matches!(f, AttemptFailure::MaybeSent(_)), "{f:?}");
        }
        // With another reason of lockd's it is final.
        let f = classify(
            Op::Acquire,
            lockd_api::errors::status(
                Code::Internal,
                "lockd: bad".into(),
                Reason::InvalidField,
                &[],
            ),
            "e1",
        );
        assert!(matches!(f, AttemptFailure::Final(_)), "{f:?}");
        // DEADLINE_EXCEEDED is final only for a waiting Acquire, and only with lockd's
        // WAIT_TIMEOUT (review "clients" finding 2: a proxy's timeout is not "waited").
        let f = classify(Op::Acquire, Status::deadline_exceeded("w"), "e1");
        assert!(matches!(f, AttemptFailure::MaybeSent(_)), "{f:?}");
        let waited = lockd_api::errors::status(
            Code::DeadlineExceeded,
            "lockd: waited".into(),
            Reason::WaitTimeout,
            &[],
        );
        let f = classify(Op::Acquire, waited, "e1");
        assert!(matches!(f, AttemptFailure::Final(_)));
        let f = classify(Op::Renew, Status::deadline_exceeded("w"), "e1");
        assert!(matches!(f, AttemptFailure::MaybeSent(_)));
        let f = classify(Op::Acquire, Status::aborted("held"), "e1");
        assert!(matches!(f, AttemptFailure::Final(_)));
    }

    #[test]
    fn reasons_tell_nothing_done_from_outcome_unknown() {
        use lockd_api::errors::status;
        for r in [Reason::Overloaded, Reason::NoQuorum] {
            let f = classify(
                Op::Acquire,
                status(Code::Unavailable, "lockd: x".into(), r, &[]),
                "e1",
            );
            assert!(matches!(f, AttemptFailure::NotSent(_)), "{r}: {f:?}");
        }
        let unknown = status(
            Code::Unavailable,
            "lockd: x".into(),
            Reason::OutcomeUnknown,
            &[],
        );
        let f = classify(Op::Acquire, unknown, "e1");
        assert!(matches!(f, AttemptFailure::MaybeSent(_)), "{f:?}");
        // The message alone proves nothing: without lockd's ErrorInfo the outcome is unknown.
        let f = classify(
            Op::Acquire,
            Status::unavailable("lockd: nothing was done"),
            "e1",
        );
        assert!(matches!(f, AttemptFailure::MaybeSent(_)), "{f:?}");
    }

    /// Goal (review "clients" finding 2): only a refusal the state machine decided speaks for
    /// earlier attempts of a request; edge refusals (no mark, or an older lockd) do not, and
    /// `NOT_FOUND` on Renew is final whatever came before.
    #[test]
    fn review_clients_finding2_which_refusals_speak_for_earlier_attempts() {
        use lockd_api::errors::{DECIDED_BY_KEY, DECIDED_BY_STATE_MACHINE, status};
        let marked = |code, reason| {
            status(
                code,
                "lockd: x".into(),
                reason,
                &[(DECIDED_BY_KEY, DECIDED_BY_STATE_MACHINE)],
            )
        };
        let plain = |code, reason| status(code, "lockd: x".into(), reason, &[]);
        for op in [Op::Acquire, Op::Release] {
            for (code, reason) in [
                (Code::ResourceExhausted, Reason::WaitersExhausted),
                (Code::ResourceExhausted, Reason::LimitReached),
                (Code::InvalidArgument, Reason::InvalidField),
                (Code::PermissionDenied, Reason::PermissionDenied),
                (Code::Unauthenticated, Reason::Unauthenticated),
                (Code::Aborted, Reason::LockHeld),
            ] {
                assert!(
                    speaks_for_this_attempt_only(op, &plain(code, reason)),
                    "{op} {code:?}"
                );
                assert!(
                    !speaks_for_this_attempt_only(op, &marked(code, reason)),
                    "{op} {code:?}"
                );
            }
            assert!(speaks_for_this_attempt_only(
                op,
                &Status::resource_exhausted("proxy")
            ));
        }
        assert!(!speaks_for_this_attempt_only(
            Op::Renew,
            &plain(Code::NotFound, Reason::LeaseNotCurrent)
        ));
        assert!(speaks_for_this_attempt_only(
            Op::Renew,
            &plain(Code::PermissionDenied, Reason::PermissionDenied)
        ));
        for op in [Op::Describe, Op::Status, Op::ChangeMembers] {
            assert!(!speaks_for_this_attempt_only(
                op,
                &plain(Code::PermissionDenied, Reason::PermissionDenied)
            ));
        }
    }

    #[test]
    fn connect_errors_are_not_sent() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let status = Status::from_error(Box::new(tonic::ConnectError(Box::new(io))));
        assert_eq!(status.code(), Code::Unavailable);
        let f = classify(Op::Acquire, status, "e1");
        assert!(matches!(f, AttemptFailure::NotSent(_)), "{f:?}");
    }

    #[test]
    fn outcome_unknown_names_the_request_id() {
        let id = RequestId::parse("0123456789abcdef0123456789abcdef").unwrap();
        let e = Error::OutcomeUnknown {
            op: Op::Acquire,
            resource: "orders/1".into(),
            request_id: Some(id.clone()),
            attempts: 4,
            elapsed: Duration::from_millis(1500),
            last_error: "e1: Unavailable: no quorum".into(),
        };
        let s = e.to_string();
        assert!(
            s.contains("01234567…") && s.contains("\"orders/1\"") && s.contains("1.5s"),
            "{s}"
        );
        // Review "clients" finding 4: a request id is a credential, shown like a lease id.
        let debug = format!("{e:?}");
        assert!(
            !s.contains(id.as_str()) && !debug.contains("89abcdef0123"),
            "{s} / {debug}"
        );
        match &e {
            Error::OutcomeUnknown { request_id, .. } => {
                assert_eq!(
                    request_id.as_ref().map(RequestId::as_str),
                    Some(id.as_str())
                );
            }
            _ => unreachable!(),
        }
        assert_eq!(e.outcome(), Outcome::Unknown);
        assert!(!e.is_definitely_not_granted());
    }
}

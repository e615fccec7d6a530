//! Generated types and gRPC stubs of the public lockd API, package `lockd.v1`.
//!
//! This crate has no server logic and pulls in neither openraft nor redb, so clients, the proxy and
//! the adapters can depend on it cheaply.
//!
//! # Layout
//! - [`v1`]: messages and the `Lock` / `Cluster` clients and servers generated from
//!   `proto/lockd/v1/lockd.proto`.
//! - [`errors`]: the `google.rpc.ErrorInfo` reasons every lockd error status carries.

/// The `lockd.v1` package.
#[allow(
    missing_docs,
    reason = "generated from proto/lockd/v1/lockd.proto, which documents it; proto comments carry over where present"
)]
pub mod v1 {
    tonic::include_proto!("lockd.v1");
}

/// The encoded `FileDescriptorSet` of `lockd.v1`, which lockd serves through gRPC server
/// reflection so that generic clients (grpcurl, Postman, Evans) need no .proto file.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/lockd_descriptor.bin"));

/// gRPC metadata key a node sets when it forwards a client call to the leader, so the receiver
/// never forwards it again (no forwarding loops during leader changes).
pub const FORWARDED_HEADER: &str = "lockd-forwarded-by";

/// Machine-readable reasons of lockd's error statuses.
///
/// Every status lockd answers with carries a `google.rpc.ErrorInfo` (in the
/// `grpc-status-details-bin` trailer) with domain [`errors::DOMAIN`] and one [`errors::Reason`].
/// The gRPC code says what kind of failure it is; the reason says what the caller should do, in
/// particular whether the call may have taken effect. A status without an ErrorInfo of this
/// domain did not come from lockd (a transport failure, a proxy, a deadline of the client's own).
pub mod errors {
    use std::collections::HashMap;

    use tonic::{Code, Status};
    use tonic_types::{ErrorDetails, StatusExt};

    /// The `domain` of every ErrorInfo lockd sends.
    pub const DOMAIN: &str = "lockd";

    /// What happened, as a program needs to know it. `as_str` is the wire form.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub enum Reason {
        /// `ABORTED`: another lease holds the resource and the call did not wait. Not granted.
        LockHeld,
        /// `DEADLINE_EXCEEDED`: the acquire waited its `wait_timeout_ms` in the queue. Not granted.
        WaitTimeout,
        /// `NOT_FOUND`: the lease is not the resource's current lease. Nothing renewed or released.
        LeaseNotCurrent,
        /// `RESOURCE_EXHAUSTED`: a waiter limit (per resource or per tenant). Not done.
        WaitersExhausted,
        /// `RESOURCE_EXHAUSTED`: a table limit (active resources, request-id records), named in
        /// the metadata key `limit`. Not done.
        LimitReached,
        /// `UNAVAILABLE`: the leader refused the work before proposing it (its queue of
        /// proposals is full). Nothing was done: retry later, with the same request_id or a new one.
        Overloaded,
        /// `UNAVAILABLE` (or `INTERNAL`): the call may have committed. Retry with the same
        /// request_id to learn its outcome.
        OutcomeUnknown,
        /// `UNAVAILABLE`: no leader was known, or it could not be reached or confirmed, before
        /// anything was proposed. Nothing was done: retry.
        NoQuorum,
        /// `INVALID_ARGUMENT` (or `FAILED_PRECONDITION`): a field's value cannot be used; the
        /// metadata key `field` names it when one field is at fault.
        InvalidField,
        /// `PERMISSION_DENIED`: the authorization policy does not grant this identity the
        /// operation on the resource (metadata `identity`, `operation`, `resource`).
        PermissionDenied,
        /// `UNAUTHENTICATED`: the credentials were not accepted (a bearer token lockd does not
        /// know, a certificate it does not trust, a Raft message from a non-member).
        Unauthenticated,
    }

    impl Reason {
        /// Every reason, for tables and tests.
        pub const ALL: [Reason; 11] = [
            Reason::LockHeld,
            Reason::WaitTimeout,
            Reason::LeaseNotCurrent,
            Reason::WaitersExhausted,
            Reason::LimitReached,
            Reason::Overloaded,
            Reason::OutcomeUnknown,
            Reason::NoQuorum,
            Reason::InvalidField,
            Reason::PermissionDenied,
            Reason::Unauthenticated,
        ];

        /// The wire form (`ErrorInfo.reason`).
        pub fn as_str(self) -> &'static str {
            match self {
                Reason::LockHeld => "LOCK_HELD",
                Reason::WaitTimeout => "WAIT_TIMEOUT",
                Reason::LeaseNotCurrent => "LEASE_NOT_CURRENT",
                Reason::WaitersExhausted => "WAITERS_EXHAUSTED",
                Reason::LimitReached => "LIMIT_REACHED",
                Reason::Overloaded => "OVERLOADED",
                Reason::OutcomeUnknown => "OUTCOME_UNKNOWN",
                Reason::NoQuorum => "NO_QUORUM",
                Reason::InvalidField => "INVALID_FIELD",
                Reason::PermissionDenied => "PERMISSION_DENIED",
                Reason::Unauthenticated => "UNAUTHENTICATED",
            }
        }

        /// The reason of a wire form, if it is one of lockd's.
        pub fn parse(s: &str) -> Option<Reason> {
            Reason::ALL.into_iter().find(|r| r.as_str() == s)
        }

        /// Whether an `UNAVAILABLE` with this reason says that *this attempt* did nothing
        /// (nothing was proposed). It covers the one attempt lockd answered: if an earlier
        /// attempt of the same request (yours, or a retrying proxy's or library's) may have
        /// reached lockd, the request's outcome is still unknown.
        pub fn nothing_done(self) -> bool {
            // An explicit list: a reason added later is not "nothing done" by default.
            matches!(self, Reason::NoQuorum | Reason::Overloaded)
        }
    }

    impl std::fmt::Display for Reason {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.as_str())
        }
    }

    /// The ErrorInfo metadata key that marks a refusal as settled by lockd's replicated state
    /// machine for this call, with these arguments, after it looked the request id up: the
    /// resource is held or the wait timed out in the queue (both recorded under the request id,
    /// so the outcome of every attempt of the call), a lease that is not current, or the request
    /// id recorded for a call with other arguments (this call is refused; it says nothing about
    /// the other call's outcome). A refusal without the mark speaks for the attempt it answers
    /// only: it was decided before the request id was looked up (bounds on parked waits or calls
    /// in transit, field checks, authorization, which may differ between nodes), or it is a
    /// table bound, which is not recorded, so that a late copy of an earlier attempt may still be
    /// granted once the bound has room.
    pub const DECIDED_BY_KEY: &str = "decided_by";
    /// The value of [`DECIDED_BY_KEY`] on a refusal the state machine decided.
    pub const DECIDED_BY_STATE_MACHINE: &str = "state_machine";

    /// Whether `status` carries lockd's ErrorInfo with the [`DECIDED_BY_KEY`] mark.
    pub fn decided_by_state_machine(status: &Status) -> bool {
        status.get_details_error_info().is_some_and(|info| {
            info.domain == DOMAIN
                && info.metadata.get(DECIDED_BY_KEY).map(String::as_str)
                    == Some(DECIDED_BY_STATE_MACHINE)
        })
    }

    /// A status with lockd's ErrorInfo: `code`, `message`, `reason` and `metadata` pairs.
    pub fn status(
        code: Code,
        message: String,
        reason: Reason,
        metadata: &[(&str, &str)],
    ) -> Status {
        let metadata: HashMap<String, String> = metadata
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Status::with_error_details(
            code,
            message,
            ErrorDetails::with_error_info(reason.as_str(), DOMAIN, metadata),
        )
    }

    /// Whether `status` carries an ErrorInfo of domain [`DOMAIN`], that is, came from a lockd
    /// node (of any version, so also with a reason this build does not know).
    pub fn is_from_lockd(status: &Status) -> bool {
        status
            .get_details_error_info()
            .is_some_and(|info| info.domain == DOMAIN)
    }

    /// Whether `status` is tonic's report of a connection that was never made (TCP connect or
    /// TLS handshake failed): the request was not written, so nothing was done.
    pub fn is_connect_error(status: &Status) -> bool {
        let mut source = std::error::Error::source(status);
        while let Some(err) = source {
            if err.downcast_ref::<tonic::ConnectError>().is_some() {
                return true;
            }
            source = err.source();
        }
        false
    }

    /// `status` with another message and the same code and details; the copy of the message
    /// inside the encoded details (which grpc-go and grpc-java show) is replaced as well.
    pub fn with_message(status: &Status, message: String) -> Status {
        let details = status.get_error_details_vec();
        if details.is_empty() {
            Status::with_details(status.code(), message, status.details().to_vec().into())
        } else {
            Status::with_error_details_vec(status.code(), message, details)
        }
    }

    /// The reason of a status lockd sent, with its metadata; `None` for a status that carries no
    /// ErrorInfo of domain [`DOMAIN`] (it did not come from lockd) or an unknown reason.
    pub fn reason_of(status: &Status) -> Option<(Reason, HashMap<String, String>)> {
        let info = status.get_details_error_info()?;
        if info.domain != DOMAIN {
            return None;
        }
        Some((Reason::parse(&info.reason)?, info.metadata))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn reasons_round_trip_through_the_status_details() {
            for r in Reason::ALL {
                let s = status(
                    Code::Unavailable,
                    format!("m {r}"),
                    r,
                    &[("field", "resource")],
                );
                // What the peer sees: the status rebuilt from its header map.
                let http: tonic::codegen::http::Response<()> = s.into_http();
                let wire = Status::from_header_map(http.headers()).unwrap();
                let (back, md) = reason_of(&wire).expect("reason");
                assert_eq!(back, r);
                assert_eq!(md.get("field").map(String::as_str), Some("resource"));
                assert_eq!(Reason::parse(r.as_str()), Some(r));
            }
        }

        #[test]
        fn the_state_machine_mark_survives_the_wire_and_needs_lockds_domain() {
            let marked = status(
                Code::Aborted,
                "lockd: held".into(),
                Reason::LockHeld,
                &[(DECIDED_BY_KEY, DECIDED_BY_STATE_MACHINE)],
            );
            let http: tonic::codegen::http::Response<()> = marked.into_http();
            let wire = Status::from_header_map(http.headers()).unwrap();
            assert!(decided_by_state_machine(&wire));
            let plain = status(Code::Aborted, "lockd: held".into(), Reason::LockHeld, &[]);
            assert!(!decided_by_state_machine(&plain));
            let other = Status::with_error_details(
                Code::Aborted,
                "x",
                ErrorDetails::with_error_info(
                    "LOCK_HELD",
                    "envoy",
                    HashMap::from([(
                        DECIDED_BY_KEY.to_owned(),
                        DECIDED_BY_STATE_MACHINE.to_owned(),
                    )]),
                ),
            );
            assert!(
                !decided_by_state_machine(&other),
                "only the lockd domain counts"
            );
        }

        #[test]
        fn statuses_of_others_have_no_reason() {
            assert!(reason_of(&Status::unavailable("connection reset")).is_none());
            let other = Status::with_error_details(
                Code::Unavailable,
                "x",
                ErrorDetails::with_error_info("OVERLOADED", "envoy", HashMap::new()),
            );
            assert!(reason_of(&other).is_none(), "only the lockd domain counts");
        }
    }
}

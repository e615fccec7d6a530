//! Exit codes (documented in docs/client.md) and the one-line error every failure becomes.

use lockd_client::{Error, RequestId};

/// Success.
pub const OK: u8 = 0;
/// Unexpected reply from lockd, I/O error, or another failure not listed below.
pub const INTERNAL: u8 = 1;
/// Bad flags, bad endpoint or bad duration (clap's own usage code).
pub const USAGE: u8 = lockd_service_kit::flag_errors::USAGE_EXIT;
/// The resource is held by another lease and the command did not wait (`ABORTED`).
pub const HELD: u8 = 3;
/// `--wait` elapsed without getting the lock (`DEADLINE_EXCEEDED`).
pub const WAIT_TIMED_OUT: u8 = 4;
/// The lease is not current: renew answered `NOT_FOUND`, or release answered `released=false`.
pub const NOT_FOUND: u8 = 5;
/// The waiter limit is reached (`RESOURCE_EXHAUSTED`).
pub const LIMIT_REACHED: u8 = 6;
/// lockd refused an argument (`INVALID_ARGUMENT`).
pub const INVALID_ARGUMENT: u8 = 7;
/// The outcome is unknown: retry with the same `--request-id`.
pub const OUTCOME_UNKNOWN: u8 = 8;
/// No node answered and nothing was done.
pub const UNAVAILABLE: u8 = 9;
/// `hold`: the lease was lost or became uncertain, and COMMAND was stopped.
pub const LEASE_LOST: u8 = 10;
/// The cluster's authorization policy refused the call (`PERMISSION_DENIED`).
pub const PERMISSION_DENIED: u8 = 11;
/// The cluster did not accept the credentials (`UNAUTHENTICATED`: token or certificate).
pub const UNAUTHENTICATED: u8 = 12;
/// `hold`: COMMAND exists but could not be executed (shell convention).
pub const CANNOT_EXECUTE: u8 = 126;
/// `hold`: COMMAND was not found (shell convention).
pub const COMMAND_NOT_FOUND: u8 = 127;

/// A failed command: its exit code, a short machine-readable kind, and a one-line message that
/// names the values involved.
pub struct Failure {
    pub code: u8,
    pub kind: &'static str,
    pub message: String,
    /// The whole request id of an `acquire` whose outcome is unknown. The message shows only its
    /// start (it is a credential), but repeating the acquire with it is the only way to learn
    /// the outcome, so the user must be given all of it, once, apart from the message.
    pub request_id: Option<RequestId>,
}

// By hand: the request id is a credential, and `RequestId`'s own `Debug` shortens it.
impl std::fmt::Debug for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Failure")
            .field("code", &self.code)
            .field("kind", &self.kind)
            .field("message", &self.message)
            .field("request_id", &self.request_id)
            .finish()
    }
}

impl Failure {
    pub fn new(code: u8, kind: &'static str, message: impl Into<String>) -> Self {
        Failure {
            code,
            kind,
            message: message.into(),
            request_id: None,
        }
    }

    /// Prints the one-line error (and, with `--json`, one JSON object on stdout); returns the
    /// code. An acquire with an unknown outcome adds a second stderr line with its whole request
    /// id (and `request_id` in the JSON object), to repeat it with `--request-id`.
    pub fn report(&self, json: bool) -> u8 {
        let line = self.message.replace(['\n', '\r'], " ");
        eprintln!("lockctl: {line}");
        if let Some(id) = &self.request_id {
            eprintln!(
                "lockctl: request id: {} (a credential: repeat the acquire with --request-id and \
                 the same flags to learn the outcome)",
                id.as_str()
            );
        }
        if json {
            let mut error = serde_json::json!({
                "kind": self.kind, "message": line, "exit_code": self.code
            });
            if let Some(id) = &self.request_id {
                error["request_id"] = id.as_str().into();
            }
            println!("{}", serde_json::json!({ "error": error }));
        }
        self.code
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let (code, kind) = match &e {
            Error::Held { .. } => (HELD, "held"),
            Error::WaitTimedOut { .. } => (WAIT_TIMED_OUT, "wait_timed_out"),
            Error::NotFound { .. } => (NOT_FOUND, "not_found"),
            Error::LimitReached { .. } => (LIMIT_REACHED, "limit_reached"),
            Error::InvalidArgument { .. } => (INVALID_ARGUMENT, "invalid_argument"),
            Error::OutcomeUnknown { .. } => (OUTCOME_UNKNOWN, "outcome_unknown"),
            Error::Unavailable { .. } => (UNAVAILABLE, "unavailable"),
            Error::BadEndpoint { .. } => (USAGE, "bad_endpoint"),
            Error::BadTls { .. } => (USAGE, "bad_tls"),
            Error::BadToken { .. } => (USAGE, "bad_token"),
            Error::PermissionDenied { .. } => (PERMISSION_DENIED, "permission_denied"),
            Error::Unauthenticated { .. } => (UNAUTHENTICATED, "unauthenticated"),
            _ => (INTERNAL, "protocol"),
        };
        Failure::new(code, kind, e.to_string())
    }
}

impl Failure {
    /// The failure of `lockctl acquire`: as [`From<Error>`], plus the whole request id when the
    /// outcome is unknown. Only there: `hold` sends other arguments (its holder), so repeating
    /// its id with `acquire --request-id` would be refused as reused.
    pub fn from_acquire(e: Error) -> Self {
        let request_id = match &e {
            Error::OutcomeUnknown { request_id, .. } => request_id.clone(),
            _ => None,
        };
        Failure {
            request_id,
            ..Failure::from(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_errors_map_to_distinct_codes() {
        let held = Failure::from(Error::Held {
            resource: "r".into(),
            message: "m".into(),
        });
        assert_eq!((held.code, held.kind), (HELD, "held"));
        let bad = Failure::from(Error::BadEndpoint {
            endpoint: "x".into(),
            reason: "y".into(),
        });
        assert_eq!(bad.code, USAGE);
        let codes = [
            OK,
            INTERNAL,
            USAGE,
            HELD,
            WAIT_TIMED_OUT,
            NOT_FOUND,
            LIMIT_REACHED,
            INVALID_ARGUMENT,
            OUTCOME_UNKNOWN,
            UNAVAILABLE,
            LEASE_LOST,
            PERMISSION_DENIED,
            UNAUTHENTICATED,
            CANNOT_EXECUTE,
            COMMAND_NOT_FOUND,
        ];
        let distinct: std::collections::BTreeSet<u8> = codes.iter().copied().collect();
        assert_eq!(distinct.len(), codes.len());
    }
}

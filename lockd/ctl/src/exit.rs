//! Exit codes (documented in docs/client.md) and the one-line error every failure becomes.

use lockd_client::Error;

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
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub kind: &'static str,
    pub message: String,
}

impl Failure {
    pub fn new(code: u8, kind: &'static str, message: impl Into<String>) -> Self {
        Failure {
            code,
            kind,
            message: message.into(),
        }
    }

    /// Prints the one-line error (and, with `--json`, one JSON object on stdout); returns the code.
    pub fn report(&self, json: bool) -> u8 {
        let line = self.message.replace(['\n', '\r'], " ");
        eprintln!("lockctl: {line}");
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "error": { "kind": self.kind, "message": line, "exit_code": self.code }
                })
            );
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

//! The one table from lockd's outcomes to gRPC status codes (CONTRACT.md). Every message starts
//! with `lockd: ` and names the values involved.

use tonic::{Code, Status};

use crate::observe::metrics::Op;
use crate::proposer::ProposeError;

pub fn invalid(msg: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("lockd: {msg}"))
}

pub fn held(resource: &str, holder: &str) -> Status {
    Status::aborted(format!(
        "lockd: resource {resource:?} is held by {holder:?}; retry later or set wait_timeout_ms to queue"
    ))
}

pub fn wait_timed_out(resource: &str, wait_ms: u64) -> Status {
    Status::deadline_exceeded(format!(
        "lockd: waited {wait_ms} ms for {resource:?} without getting the lock"
    ))
}

pub fn not_found(resource: &str) -> Status {
    Status::not_found(format!(
        "lockd: that lease is not the current lease of {resource:?} (expired, released, superseded or unknown); stop work that depends on it"
    ))
}

pub fn exhausted(msg: impl std::fmt::Display) -> Status {
    Status::resource_exhausted(format!("lockd: {msg}"))
}

pub fn unavailable(msg: impl std::fmt::Display) -> Status {
    Status::unavailable(format!("lockd: {msg}"))
}

/// A proposal without an outcome. Overload is "definitely not done"; everything else may have
/// committed, so the caller must retry with the same request_id.
pub fn propose_failed(node: u64, e: ProposeError) -> Status {
    match e {
        ProposeError::Overloaded => {
            unavailable(format!("node {node}: {e}; nothing was done, retry later"))
        }
        ProposeError::Unknown(why) => unavailable(format!(
            "node {node}: outcome unknown ({why}); retry with the same request_id"
        )),
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

/// Metrics label for an op (kept here so the status table and metrics agree).
pub fn op_label(op: Op) -> &'static str {
    op.as_str()
}

//! Metric names and label values of the Postgres front end (recorded with the `metrics` macros;
//! the binary installs the exporter).
//!
//! The names are shared with the HTTP front end and defined once, in
//! `lockd_service_kit::names::fence_proxy`. Here `REQUESTS_TOTAL` counts client requests
//! (simple Query, extended-protocol Sync group, FunctionCall) by `result`: `ok`, `error`
//! (upstream error), `stale` (stale fencing token), `rejected` (refused by the proxy itself);
//! `STALE_REJECTIONS_TOTAL` counts transactions failed with 55P03; `FORWARD_DURATION_SECONDS`
//! times a request from forwarding to the upstream's ReadyForQuery, including the fence record
//! and the implicit COMMIT the proxy adds.

use lockd_service_kit::names::fence_proxy::{
    FORWARD_DURATION_SECONDS, REQUESTS_TOTAL, STALE_REJECTIONS_TOTAL,
};

/// Value of the `frontend` label.
pub const FRONTEND: &str = "postgres";

/// Outcome of one client request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestResult {
    Ok,
    Error,
    Stale,
    Rejected,
}

impl RequestResult {
    pub fn label(self) -> &'static str {
        match self {
            RequestResult::Ok => "ok",
            RequestResult::Error => "error",
            RequestResult::Stale => "stale",
            RequestResult::Rejected => "rejected",
        }
    }
}

pub fn record_request(result: RequestResult, elapsed: Option<std::time::Duration>) {
    metrics::counter!(REQUESTS_TOTAL, "frontend" => FRONTEND, "result" => result.label())
        .increment(1);
    if result == RequestResult::Stale {
        metrics::counter!(STALE_REJECTIONS_TOTAL, "frontend" => FRONTEND).increment(1);
    }
    if let Some(elapsed) = elapsed {
        metrics::histogram!(FORWARD_DURATION_SECONDS, "frontend" => FRONTEND)
            .record(elapsed.as_secs_f64());
    }
}

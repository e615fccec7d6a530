//! Metrics of the HTTP front end. The names are shared with the Postgres front end
//! (`frontend="postgres"`) and defined once, in `lockd_service_kit::names::fence_proxy`.

pub use lockd_service_kit::names::fence_proxy::{
    FORWARD_DURATION_SECONDS, REQUESTS_TOTAL, STALE_REJECTIONS_TOTAL,
};

/// The `frontend` label of this crate.
pub const FRONTEND: &str = "http";

/// `result` of a write that was forwarded and answered by the upstream.
pub const RESULT_FORWARDED: &str = "forwarded";
/// `result` of a read (GET, HEAD, OPTIONS) that was passed through unchecked and answered.
pub const RESULT_PASSTHROUGH: &str = "passthrough";
// Refusals use their `Fence-Proxy-Error` reason as `result` (see `Refusal::reason`).

/// Registers descriptions, so that `/metrics` explains each series.
pub fn describe() {
    metrics::describe_counter!(
        REQUESTS_TOTAL,
        "Requests by front end and result (forwarded, passthrough, or the Fence-Proxy-Error reason)."
    );
    metrics::describe_counter!(
        STALE_REJECTIONS_TOTAL,
        "Writes refused because their fencing token was lower than the highest accepted."
    );
    metrics::describe_histogram!(
        FORWARD_DURATION_SECONDS,
        metrics::Unit::Seconds,
        "Time from forwarding a request to the upstream's response head."
    );
}

pub(crate) fn count(result: &'static str) {
    metrics::counter!(REQUESTS_TOTAL, "frontend" => FRONTEND, "result" => result).increment(1);
}

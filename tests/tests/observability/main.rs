//! Metrics, the audit log and readiness of real lockd nodes.
//!
//! # Layout
//! - `metrics`: a scripted workload counted exactly, what operators watch, and the alert rules.
//! - `audit`: the audit log: each change once, in log order, without request ids.
//! - `status`: `/readyz` and `lockctl status`.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test, with its message"
)]

mod audit;
mod metrics;
mod status;

use lockd_api::v1::AcquireRequest;

fn req(resource: &str, request_id: &str, ttl_ms: u64, wait_ms: u64) -> AcquireRequest {
    AcquireRequest {
        resource: resource.into(),
        request_id: request_id.into(),
        lease_ttl_ms: ttl_ms,
        wait_timeout_ms: wait_ms,
        holder: "obs".into(),
    }
}

/// The value of one sample line (`name{labels} value`) in Prometheus text, 0 if absent.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

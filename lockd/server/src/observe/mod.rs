//! Metrics, health endpoints and the audit log.

pub mod http;
pub mod metrics;

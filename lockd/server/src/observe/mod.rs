//! Metrics, health endpoints and the audit log.

pub mod audit;
pub mod http;
pub mod metrics;

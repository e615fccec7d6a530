//! Metrics, health endpoints, the audit log and the hot-resource lists of Status.

pub mod audit;
pub mod hot;
pub mod http;
pub mod metrics;

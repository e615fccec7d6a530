//! Metric names that more than one crate records. Operators' dashboards and alerts use them:
//! keep them exactly.

/// fence-proxy's metrics; both front ends record them, told apart by the `frontend` label
/// (`http` or `postgres`).
pub mod fence_proxy {
    /// Counter, labels `frontend` and `result`: every request, by what became of it.
    pub const REQUESTS_TOTAL: &str = "fence_proxy_requests_total";
    /// Counter, label `frontend`: writes refused because their token was stale.
    pub const STALE_REJECTIONS_TOTAL: &str = "fence_proxy_stale_rejections_total";
    /// Histogram, label `frontend`: time from forwarding a request to the upstream's answer
    /// (the response head for HTTP, ReadyForQuery for Postgres).
    pub const FORWARD_DURATION_SECONDS: &str = "fence_proxy_forward_duration_seconds";
    /// Counter, labels `frontend` and `result` (`ok`, `error`): certificate reloads on SIGHUP.
    pub const TLS_RELOADS_TOTAL: &str = "fence_proxy_tls_reloads_total";
    /// Gauge, label `frontend`: the generation of the TLS files in use (0: as read at start,
    /// then one more per successful reload).
    pub const TLS_GENERATION: &str = "fence_proxy_tls_generation";
}

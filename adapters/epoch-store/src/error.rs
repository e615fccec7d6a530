//! Errors of the epoch stores, with the values involved in every message.

use std::time::Duration;

use lockd_fence::FencingToken;

/// Why a store could not decide about a write. Every variant means the write was not forwarded.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached or failed; the proxy fails closed.
    #[error("epoch store {store} unavailable: {detail}")]
    Unavailable {
        /// The store, as its spec names it (without a password).
        store: String,
        /// What failed.
        detail: String,
    },
    /// Another write of the resource held it (or a quarantine did) for longer than the wait bound.
    #[error("resource {resource:?} busy: {why}; waited {waited_ms} ms of at most {wait_max_ms} ms")]
    Busy {
        /// The resource written.
        resource: String,
        /// What held it (another forward of it, a quarantine).
        why: &'static str,
        /// How long this write waited, in ms.
        waited_ms: u64,
        /// The wait bound, in ms.
        wait_max_ms: u64,
    },
    /// The store cannot represent this token (Postgres `bigint` is signed).
    #[error("fencing token {token} exceeds the {store} store's largest token {max}")]
    TokenOutOfRange {
        /// The token the write carried.
        token: FencingToken,
        /// The largest token the store can record.
        max: u64,
        /// The kind of store.
        store: &'static str,
    },
    /// The store records `limit` resources, its bound (`--max-resources`), and this write is of
    /// a resource it has no record of: refused rather than grow the store without end. Writes
    /// of recorded resources go on.
    #[error(
        "epoch store {store} records {limit} resources, its limit (--max-resources): a write of the new resource {resource:?} is refused"
    )]
    ResourceLimit {
        /// The resource written.
        resource: String,
        /// The bound on resources recorded.
        limit: u64,
        /// The store, as its spec names it (without a password).
        store: String,
    },
    /// The store's configuration is invalid (bad path, bad table name).
    #[error("epoch store configuration: {0}")]
    Config(String),
}

impl StoreError {
    pub(crate) fn busy(resource: &str, why: &'static str, waited: Duration, max: Duration) -> Self {
        StoreError::Busy {
            resource: resource.to_owned(),
            why,
            waited_ms: waited.as_millis() as u64,
            wait_max_ms: max.as_millis() as u64,
        }
    }
}

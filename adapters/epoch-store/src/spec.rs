//! Choosing a store from a `--store` value: `redb:PATH` or a `postgres://` URL.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use crate::postgres_store::DEFAULT_TABLE;
use crate::{EpochStore, PostgresStore, RedbStore, StoreError, Timing};

/// Default size of the Postgres pool: each write in flight holds one connection (its advisory
/// lock lives in the session), and one process rarely forwards more writes of distinct resources
/// at once; excess writers wait for a connection up to the store timeout.
pub const DEFAULT_POSTGRES_CONNECTIONS: u32 = 32;

/// Default bound on the resources a store records (`--max-resources`). A record is never deleted
/// (forgetting a resource's highest token would let an older holder write again), so without a
/// bound any client with a plain token could grow the store by one row per fresh resource name,
/// forever. A million records of 250-byte names take about 0.7 GB of redb file (the review of
/// 2026-12-05 measured 2.1 MB for 3,000), within what a proxy host is expected to have.
pub const DEFAULT_MAX_RESOURCES: u64 = 1_000_000;

/// Which store to open, parsed from `redb:PATH`, `postgres://...` or `postgresql://...`.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreSpec {
    /// A redb database file at this path.
    Redb(PathBuf),
    /// The full URL, password included; `Display` leaves the password out.
    Postgres(String),
}

impl FromStr for StoreSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("redb:") {
            if path.is_empty() {
                return Err(format!("store {s:?}: redb:PATH needs a file path"));
            }
            return Ok(StoreSpec::Redb(PathBuf::from(path)));
        }
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            return Ok(StoreSpec::Postgres(s.to_owned()));
        }
        Err(format!(
            "store {:?} must be redb:PATH or a postgres:// URL",
            redact(s)
        ))
    }
}

impl fmt::Display for StoreSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreSpec::Redb(path) => write!(f, "redb:{}", path.display()),
            StoreSpec::Postgres(url) => f.write_str(&redact(url)),
        }
    }
}

impl fmt::Debug for StoreSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// `url` with its passwords (`user:password@`, `password=`) replaced by `***`, for logs and
/// errors.
fn redact(url: &str) -> String {
    lockd_service_kit::redact::connection_string(url)
}

/// Everything a store needs besides its spec.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Wait and forward bounds.
    pub timing: Timing,
    /// Table of the Postgres store.
    pub postgres_table: String,
    /// Pool size of the Postgres store.
    pub postgres_max_connections: u32,
    /// Resources the store records at most; a write of a new resource beyond it is refused
    /// ([`StoreError::ResourceLimit`]).
    pub max_resources: u64,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            timing: Timing::default(),
            postgres_table: DEFAULT_TABLE.to_owned(),
            postgres_max_connections: DEFAULT_POSTGRES_CONNECTIONS,
            max_resources: DEFAULT_MAX_RESOURCES,
        }
    }
}

impl StoreSpec {
    /// Opens the store. The redb file is opened (and locked) now; the Postgres pool connects on
    /// first use, so that the proxy starts, and fails closed, while the database is down.
    pub fn open(&self, options: &StoreOptions) -> Result<Arc<dyn EpochStore>, StoreError> {
        Ok(match self {
            StoreSpec::Redb(path) => Arc::new(
                RedbStore::open(path, options.timing)?.with_max_resources(options.max_resources),
            ),
            StoreSpec::Postgres(url) => Arc::new(
                PostgresStore::connect_lazy(
                    url,
                    &options.postgres_table,
                    options.postgres_max_connections,
                    options.timing,
                )?
                .with_max_resources(options.max_resources),
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_redacts() {
        assert_eq!(
            "redb:/tmp/e.redb".parse::<StoreSpec>().unwrap(),
            StoreSpec::Redb("/tmp/e.redb".into())
        );
        let pg: StoreSpec = "postgres://u:secret@h:5432/db".parse().unwrap();
        assert_eq!(pg.to_string(), "postgres://u:***@h:5432/db");
        let err = "mysql://u:secret@h/db".parse::<StoreSpec>().unwrap_err();
        assert!(
            !err.contains("secret") && err.contains("mysql://u:***@h/db"),
            "{err}"
        );
        assert!("redb:".parse::<StoreSpec>().is_err());
    }
}

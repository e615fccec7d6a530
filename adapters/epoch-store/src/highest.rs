//! The highest token a store has accepted over all its resources (`fence-proxy epochs max`).
//!
//! A lock cluster restored from a backup must never hand out a token a store has already
//! accepted: this figure is the floor it is told to start above (`lockd restore --token-floor`).

use std::path::Path;

use lockd_fence::FencingToken;
use redb::{Database, DatabaseError, ReadOnlyDatabase, ReadableDatabase};
use sqlx::AssertSqlSafe;

use crate::redb_store::EPOCHS;
use crate::{PostgresStore, StoreError, StoreOptions, StoreSpec};

/// What a store holds, in brief.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpochsMax {
    /// Resources with a recorded token.
    pub resources: u64,
    /// The highest recorded token and its resource (the first by name among equals); `None`
    /// for an empty store.
    pub highest: Option<(String, FencingToken)>,
    /// The schema-qualified table read (a Postgres store's table is found through the
    /// connection's search_path, so the operator can check it is the proxy's); `None` for redb.
    pub table: Option<String>,
}

impl StoreSpec {
    /// Reads the highest token of the store. A redb file is opened read-only; the file of a
    /// proxy that was killed needs redb's repair first, which this does (as the proxy itself
    /// would on its next start); a file a running proxy holds cannot be read, and the error
    /// says so. A Postgres table is read with one statement.
    pub async fn epochs_max(&self, options: &StoreOptions) -> Result<EpochsMax, StoreError> {
        match self {
            StoreSpec::Redb(path) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || redb_max(&path))
                    .await
                    .map_err(|e| StoreError::Unavailable {
                        store: self.to_string(),
                        detail: e.to_string(),
                    })?
            }
            StoreSpec::Postgres(url) => {
                let store =
                    PostgresStore::connect_lazy(url, &options.postgres_table, 1, options.timing)?;
                store.epochs_max().await
            }
        }
    }
}

fn redb_max(path: &Path) -> Result<EpochsMax, StoreError> {
    let unavailable = |e: &dyn std::fmt::Display| StoreError::Unavailable {
        store: format!("redb:{}", path.display()),
        detail: e.to_string(),
    };
    if !path.exists() {
        return Err(unavailable(&"no such file"));
    }
    let held = || {
        unavailable(&format!(
            "the file is held open by a running process (a live fence-proxy using this store?): \
             stop that proxy first, then run this again (`fuser {}` shows who holds it); a redb \
             file can be read only while no process has it open",
            path.display()
        ))
    };
    // The database must outlive the read transaction: a transaction of a dropped database
    // reads nothing ("Database has been closed").
    enum Opened {
        ReadOnly(ReadOnlyDatabase),
        Repaired(Database),
    }
    let opened = match ReadOnlyDatabase::open(path) {
        Ok(db) => Opened::ReadOnly(db),
        Err(DatabaseError::DatabaseAlreadyOpen) => return Err(held()),
        // Left by a process that did not close it (a killed proxy): a read-only open cannot
        // repair it, a read-write open does, as the proxy would on its next start.
        Err(DatabaseError::RepairAborted) => match Database::open(path) {
            Ok(db) => Opened::Repaired(db),
            Err(DatabaseError::DatabaseAlreadyOpen) => return Err(held()),
            Err(e) => return Err(unavailable(&format!("opening to repair it: {e}"))),
        },
        Err(e) => return Err(unavailable(&format!("opening: {e}"))),
    };
    let txn = match &opened {
        Opened::ReadOnly(db) => db.begin_read(),
        Opened::Repaired(db) => db.begin_read(),
    }
    .map_err(|e| unavailable(&e))?;
    let table = match txn.open_table(EPOCHS) {
        Ok(t) => t,
        // A file the proxy created but never wrote to.
        Err(redb::TableError::TableDoesNotExist(_)) => {
            return Ok(EpochsMax {
                table: None,
                resources: 0,
                highest: None,
            });
        }
        Err(e) => return Err(unavailable(&e)),
    };
    let mut max = EpochsMax {
        table: None,
        resources: 0,
        highest: None,
    };
    for entry in redb::ReadableTable::iter(&table).map_err(|e| unavailable(&e))? {
        let (resource, token) = entry.map_err(|e| unavailable(&e))?;
        max.resources += 1;
        let token = token.value();
        if max.highest.as_ref().is_none_or(|(_, t)| token > t.0) {
            max.highest = Some((resource.value().to_owned(), FencingToken(token)));
        }
    }
    Ok(max)
}

impl PostgresStore {
    /// See [`StoreSpec::epochs_max`].
    pub async fn epochs_max(&self) -> Result<EpochsMax, StoreError> {
        let table = self.table();
        // One row whatever the table holds; the name is a validated plain identifier.
        let (qualified, count, resource, token): (
            Option<String>,
            i64,
            Option<String>,
            Option<i64>,
        ) = self
            .bounded(
                "reading the highest token",
                sqlx::query_as(AssertSqlSafe(format!(
                    "SELECT (SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class c \
                       JOIN pg_namespace n ON n.oid = c.relnamespace \
                       WHERE c.oid = to_regclass('{table}')), \
                     (SELECT count(*) FROM {table})::bigint, m.resource, m.token \
                     FROM (SELECT 1) AS one LEFT JOIN \
                       (SELECT resource, token FROM {table} ORDER BY token DESC, resource LIMIT 1) \
                       AS m ON true"
                )))
                .fetch_one(&self.pool),
            )
            .await?;
        Ok(EpochsMax {
            table: qualified,
            resources: count as u64,
            highest: resource
                .zip(token)
                .map(|(r, t)| (r, FencingToken(t as u64))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EpochStore, RedbStore, Timing};

    /// Goal: the highest token over all resources of a redb store, read while no proxy holds
    /// the file; an empty store says so; a missing file is an error naming it.
    #[tokio::test]
    async fn redb_highest_over_all_resources() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("epochs.redb");
        let spec = StoreSpec::Redb(path.clone());
        let e = spec.epochs_max(&StoreOptions::default()).await.unwrap_err();
        assert!(e.to_string().contains("epochs.redb"), "{e}");
        {
            let store = RedbStore::open(&path, Timing::default()).unwrap();
            assert_eq!(
                spec.epochs_max(&StoreOptions::default())
                    .await
                    .err()
                    .map(|_| ()),
                Some(()),
                "a file held by a running store cannot be opened"
            );
            let e = spec.epochs_max(&StoreOptions::default()).await.unwrap_err();
            assert!(
                e.to_string().contains("held open by a running process"),
                "{e}"
            );
            drop(store);
        }
        let max = spec.epochs_max(&StoreOptions::default()).await.unwrap();
        assert_eq!(
            max,
            EpochsMax {
                resources: 0,
                highest: None,
                table: None,
            }
        );
        {
            let store = RedbStore::open(&path, Timing::default()).unwrap();
            for (resource, token) in [("a", 5), ("b", 90), ("c", 12), ("b", 91)] {
                match store.admit(resource, FencingToken(token)).await.unwrap() {
                    crate::Admission::Accepted(p) => {
                        p.release(crate::ForwardOutcome::Answered).await.unwrap()
                    }
                    other => panic!("{other:?}"),
                }
            }
        }
        let max = spec.epochs_max(&StoreOptions::default()).await.unwrap();
        assert_eq!(
            max,
            EpochsMax {
                resources: 3,
                highest: Some(("b".to_owned(), FencingToken(91))),
                table: None,
            }
        );
    }
}

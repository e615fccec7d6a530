//! The lock table as openraft's state machine, with snapshots persisted in `snapshot.bin`.

use std::io::Cursor;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use anyhow::Context;

use lockd_core::{Event, EventKind, LockTable, ResourceName};
use openraft::storage::RaftStateMachine;
use openraft::{
    BasicNode, EntryPayload, RaftSnapshotBuilder, Snapshot, SnapshotMeta, StorageIOError,
    StoredMembership,
};
use redb::{Database, ReadableDatabase};
use serde::{Deserialize, Serialize};

use super::snapshot_file::{SnapshotFile, StoredSnapshot};
use super::{
    Databases, KEY_SNAPSHOT, KEY_SNAPSHOT_META, KEY_SNAPSHOT_TABLE, META, SNAPSHOTS, background,
    blocking, open_legacy_snapshot_db,
};
use crate::raft::{BatchResponse, LogId, NodeId, StorageError, TypeConfig};

/// Receives the state changes of every applied entry, in log order: it wakes waiting calls,
/// counts metrics and writes the audit log. Called while apply runs, so it must be quick.
pub trait AppliedSink: Send + Sync + 'static {
    /// `unix_ms` is the table's clock after the entry (the leader's stamp, clamped).
    /// `queue_lens[i]` is the queue length of `events[i].resource` after the entry, for the
    /// events that change a queue (queued, handed off, cancelled, timed out); `None` otherwise.
    fn on_applied(
        &self,
        log_index: u64,
        unix_ms: i64,
        events: &[Event],
        queue_lens: &[Option<u32>],
    );
    /// A snapshot from the leader replaced the table up to `log_index`.
    fn on_snapshot_installed(&self, log_index: u64, unix_ms: i64);
    /// The table was loaded or replaced: its longest queues, for Status.
    fn on_table_replaced(&self, longest_queues: Vec<(ResourceName, u32)>);
}

/// Queues reported to the sink when a table is loaded or replaced; Status lists the top 10.
const LONGEST_QUEUES_REPORTED: usize = 64;

/// The queue length after the entry of each event's resource, for the events that change one.
/// Looked up only for those (a minority of events), so grants cost nothing extra.
fn queue_lens(table: &LockTable, events: &[Event]) -> Vec<Option<u32>> {
    events
        .iter()
        .map(|e| match e.kind {
            EventKind::Queued
            | EventKind::Granted {
                to_waiter: Some(_), ..
            }
            | EventKind::Cancelled { .. }
            | EventKind::TimedOut { .. } => Some(table.describe(&e.resource).waiters),
            _ => None,
        })
        .collect()
}

/// The in-memory state machine, shared read-only with the RPC layer.
#[derive(Default)]
pub struct SmState {
    pub table: LockTable,
    pub last_applied: Option<LogId>,
    pub membership: StoredMembership<NodeId, BasicNode>,
}

/// The format of data dirs written before snapshots left the log database: meta and the encoded
/// table nested in one value. Read once, when such a snapshot is moved to `snapshot.bin`.
#[derive(Serialize, Deserialize)]
struct LegacySnapshot {
    meta: SnapshotMeta<NodeId, BasicNode>,
    table: Vec<u8>,
}

pub struct StateMachine {
    state: Arc<RwLock<SmState>>,
    snapshots: SnapshotFile,
    sink: Arc<dyn AppliedSink>,
    snapshot_seq: Arc<AtomicU64>,
}

impl StateMachine {
    /// Loads the latest snapshot, if any; openraft then replays the committed log after it.
    pub async fn open(dbs: Databases, sink: Arc<dyn AppliedSink>) -> anyhow::Result<Self> {
        let mut state = SmState::default();
        if let Some(stored) = read_snapshot(&dbs)? {
            let table = LockTable::decode_snapshot(&stored.table)?;
            drop(stored.table);
            table.check_consistency().map_err(|e| {
                anyhow::anyhow!("snapshot {} is inconsistent: {e}", stored.meta.snapshot_id)
            })?;
            state.table = table;
            state.last_applied = stored.meta.last_log_id;
            state.membership = stored.meta.last_membership.clone();
        }
        sink.on_table_replaced(state.table.top_by_waiters(LONGEST_QUEUES_REPORTED));
        Ok(StateMachine {
            state: Arc::new(RwLock::new(state)),
            snapshots: dbs.snapshots,
            sink,
            snapshot_seq: Arc::new(AtomicU64::new(0)),
        })
    }

    pub fn shared(&self) -> Arc<RwLock<SmState>> {
        self.state.clone()
    }
}

/// The latest snapshot. Earlier versions kept it in `snapshot.redb`, and before that in the log
/// database; such a snapshot is written to `snapshot.bin` (durably) before its old copy is
/// removed, so a crash in between leaves it in one place or both, never in none.
fn read_snapshot(dbs: &Databases) -> anyhow::Result<Option<StoredSnapshot>> {
    let mut found = dbs.snapshots.read()?;
    let legacy = &dbs.legacy_snapshot_db;
    if legacy.exists() {
        // A leftover next to snapshot.bin is not even opened: it is older, and if damaged it
        // must not stop the node.
        if found.is_none() {
            let db = open_legacy_snapshot_db(legacy)?;
            found = read_legacy_snapshot_db(&db)
                .with_context(|| format!("reading the snapshot in {}", legacy.display()))?;
            if let Some(stored) = &found {
                dbs.snapshots.write(stored)?;
            }
        }
        std::fs::remove_file(legacy).with_context(|| format!("removing {}", legacy.display()))?;
    }
    let in_log = {
        let txn = dbs.log.begin_read()?;
        let table = txn.open_table(META)?;
        table.get(KEY_SNAPSHOT)?.map(|v| v.value().to_vec())
    };
    if let Some(bytes) = in_log {
        if found.is_none() {
            let LegacySnapshot { meta, table } = postcard::from_bytes(&bytes)
                .context("decoding the snapshot kept in the log database (lockd.redb)")?;
            let stored = StoredSnapshot { meta, table };
            dbs.snapshots.write(&stored)?;
            found = Some(stored);
        }
        let txn = dbs.log.begin_write()?;
        txn.open_table(META)?.remove(KEY_SNAPSHOT)?;
        txn.commit()?;
    }
    Ok(found)
}

fn read_legacy_snapshot_db(db: &Database) -> anyhow::Result<Option<StoredSnapshot>> {
    let txn = db.begin_read()?;
    let Ok(snapshots) = txn.open_table(SNAPSHOTS) else {
        return Ok(None);
    };
    let (Some(meta), Some(table)) = (
        snapshots.get(KEY_SNAPSHOT_META)?,
        snapshots.get(KEY_SNAPSHOT_TABLE)?,
    ) else {
        return Ok(None);
    };
    Ok(Some(StoredSnapshot {
        meta: postcard::from_bytes(meta.value())?,
        table: table.value().to_vec(),
    }))
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId>, StoredMembership<NodeId, BasicNode>), StorageError> {
        let s = self.state.read().expect("state lock");
        Ok((s.last_applied, s.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<BatchResponse>, StorageError>
    where
        I: IntoIterator<Item = openraft::Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let mut responses = Vec::new();
        let mut events = Vec::new();
        for entry in entries {
            events.clear();
            let (response, now_ms, lens) = {
                let mut s = self.state.write().expect("state lock");
                s.last_applied = Some(entry.log_id);
                let response = match entry.payload {
                    EntryPayload::Blank => BatchResponse::default(),
                    EntryPayload::Normal(batch) => BatchResponse(s.table.apply(
                        entry.log_id.leader_id.term,
                        &batch,
                        &mut events,
                    )),
                    EntryPayload::Membership(m) => {
                        s.membership = StoredMembership::new(Some(entry.log_id), m);
                        BatchResponse::default()
                    }
                };
                (
                    response,
                    s.table.stats().now_ms,
                    queue_lens(&s.table, &events),
                )
            };
            self.sink
                .on_applied(entry.log_id.index, now_ms, &events, &lens);
            responses.push(response);
        }
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapshotBuilder {
            state: self.state.clone(),
            snapshots: self.snapshots.clone(),
            seq: self.snapshot_seq.clone(),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    /// Replaces the table with a snapshot from the leader and persists it, so a restart starts
    /// from it.
    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let bytes = snapshot.into_inner();
        let table = LockTable::decode_snapshot(&bytes)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?;
        if let Err(e) = table.check_consistency() {
            return Err(StorageIOError::read_snapshot(
                Some(meta.signature()),
                &std::io::Error::other(format!("inconsistent snapshot: {e}")),
            )
            .into());
        }
        let stored = StoredSnapshot {
            meta: meta.clone(),
            table: bytes,
        };
        let file = self.snapshots.clone();
        blocking(move || file.write(&stored))
            .await
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        let now_ms = table.stats().now_ms;
        let longest = table.top_by_waiters(LONGEST_QUEUES_REPORTED);
        {
            let mut s = self.state.write().expect("state lock");
            s.table = table;
            s.last_applied = meta.last_log_id;
            s.membership = meta.last_membership.clone();
        }
        self.sink
            .on_snapshot_installed(meta.last_log_id.map(|l| l.index).unwrap_or(0), now_ms);
        self.sink.on_table_replaced(longest);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        let file = self.snapshots.clone();
        let raw = blocking(move || file.read())
            .await
            .map_err(|e| StorageIOError::read_snapshot(None, &e))?;
        Ok(raw.map(|stored| Snapshot {
            meta: stored.meta,
            snapshot: Box::new(Cursor::new(stored.table)),
        }))
    }
}

pub struct SnapshotBuilder {
    state: Arc<RwLock<SmState>>,
    snapshots: SnapshotFile,
    seq: Arc<AtomicU64>,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    /// Copies the table under the read lock (apply waits only for the copy), then encodes and
    /// persists it off the async workers.
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let started = std::time::Instant::now();
        let (table, last_applied, membership) = {
            let s = self.state.read().expect("state lock");
            (
                s.table.snapshot_copy(),
                s.last_applied,
                s.membership.clone(),
            )
        };
        let copied = started.elapsed();
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let snapshot_id = match last_applied {
            Some(l) => format!("{}-{}-{seq}", l.leader_id.term, l.index),
            None => format!("0-0-{seq}"),
        };
        let meta = SnapshotMeta {
            last_log_id: last_applied,
            last_membership: membership,
            snapshot_id,
        };
        let meta2 = meta.clone();
        let file = self.snapshots.clone();
        let bytes = background(move || file.write_with(&meta2, |out| Ok(table.encode_to(out)?)))
            .await
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        tracing::info!(
            snapshot_id = %meta.snapshot_id,
            bytes,
            copy_ms = copied.as_millis() as u64,
            encode_and_persist_ms = (started.elapsed() - copied).as_millis() as u64,
            "snapshot built"
        );
        // openraft 0.9 keeps only the meta of a snapshot it asked for (core/sm/worker.rs) and
        // reads the data through get_current_snapshot when a follower needs it, so the bytes are
        // not returned here: holding them would cost a second copy of the table in memory.
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(Vec::new())),
        })
    }
}

#[cfg(test)]
mod tests {
    use lockd_core::{Batch, Command, Event, LeaseId, Policy, ResourceName};
    use openraft::CommittedLeaderId;

    use super::*;

    struct NoSink;
    impl AppliedSink for NoSink {
        fn on_applied(&self, _: u64, _: i64, _: &[Event], _: &[Option<u32>]) {}
        fn on_snapshot_installed(&self, _: u64, _: i64) {}
        fn on_table_replaced(&self, _: Vec<(ResourceName, u32)>) {}
    }

    fn sample() -> (LockTable, StoredSnapshot) {
        let mut table = LockTable::default();
        let batch = Batch {
            now_ms: 1_000,
            stamp: None,
            policy: Policy::default(),
            commands: vec![Command::Acquire {
                resource: ResourceName::new_unchecked("jobs/a".into()),
                request_id: "r1".into(),
                lease_ttl_ms: 30_000,
                wait_timeout_ms: 0,
                holder: "test".into(),
                lease_id: "0123456789abcdef0123456789abcdef"
                    .parse::<LeaseId>()
                    .unwrap(),
            }],
        };
        table.apply(1, &batch, &mut Vec::new());
        let meta = SnapshotMeta {
            last_log_id: Some(LogId::new(CommittedLeaderId::new(1, 1), 7)),
            last_membership: StoredMembership::default(),
            snapshot_id: "1-7-0".into(),
        };
        let stored = StoredSnapshot {
            meta,
            table: table.encode_snapshot(),
        };
        (table, stored)
    }

    /// Opens the state machine on `dir` and checks it starts from `table` at index 7, from
    /// `snapshot.bin`, with no copy left in an old place.
    async fn assert_starts_from(dir: &std::path::Path, table: &LockTable) {
        let dbs = crate::storage::open(dir).unwrap();
        let log = dbs.log.clone();
        let sm = StateMachine::open(dbs, Arc::new(NoSink)).await.unwrap();
        {
            let state = sm.shared();
            let s = state.read().unwrap();
            assert_eq!(s.table.stats(), table.stats());
            assert_eq!(s.table.stats().active_locks, 1);
            assert_eq!(s.last_applied.map(|l| l.index), Some(7));
        }
        let moved = SnapshotFile::new(dir).read().unwrap().unwrap();
        assert_eq!(moved.meta.snapshot_id, "1-7-0");
        assert!(!dir.join("snapshot.redb").exists());
        let txn = log.begin_read().unwrap();
        assert!(
            txn.open_table(META)
                .unwrap()
                .get(KEY_SNAPSHOT)
                .unwrap()
                .is_none()
        );
    }

    /// Goal: a data dir whose snapshot sits in the log database (the first layout) starts from
    /// that snapshot and moves it to `snapshot.bin`, so nothing compacted away is lost.
    #[tokio::test]
    async fn a_snapshot_in_the_log_database_moves_to_snapshot_bin() {
        let dir = tempfile::tempdir().unwrap();
        let (table, stored) = sample();
        {
            let dbs = crate::storage::open(dir.path()).unwrap();
            let legacy = postcard::to_allocvec(&LegacySnapshot {
                meta: stored.meta,
                table: stored.table,
            })
            .unwrap();
            let txn = dbs.log.begin_write().unwrap();
            txn.open_table(META)
                .unwrap()
                .insert(KEY_SNAPSHOT, legacy.as_slice())
                .unwrap();
            txn.commit().unwrap();
        }
        assert_starts_from(dir.path(), &table).await;
        // And again, now from snapshot.bin.
        assert_starts_from(dir.path(), &table).await;
    }

    /// Goal: the same for a snapshot in `snapshot.redb` (the second layout).
    #[tokio::test]
    async fn a_snapshot_in_snapshot_redb_moves_to_snapshot_bin() {
        let dir = tempfile::tempdir().unwrap();
        let (table, stored) = sample();
        {
            let db = redb::Database::create(dir.path().join("snapshot.redb")).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut t = txn.open_table(SNAPSHOTS).unwrap();
                let meta = postcard::to_allocvec(&stored.meta).unwrap();
                t.insert(KEY_SNAPSHOT_META, meta.as_slice()).unwrap();
                t.insert(KEY_SNAPSHOT_TABLE, stored.table.as_slice())
                    .unwrap();
            }
            txn.commit().unwrap();
        }
        assert_starts_from(dir.path(), &table).await;
    }
}

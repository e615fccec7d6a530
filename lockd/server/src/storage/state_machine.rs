//! The lock table as openraft's state machine, with snapshots persisted in redb.

use std::io::Cursor;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use lockd_core::{Event, LockTable};
use openraft::storage::RaftStateMachine;
use openraft::{
    BasicNode, EntryPayload, RaftSnapshotBuilder, Snapshot, SnapshotMeta, StorageIOError,
    StoredMembership,
};
use redb::{Database, ReadableDatabase};
use serde::{Deserialize, Serialize};

use super::{
    Databases, KEY_SNAPSHOT, KEY_SNAPSHOT_META, KEY_SNAPSHOT_TABLE, META, SNAPSHOTS, background,
    blocking,
};
use crate::raft::{BatchResponse, LogId, NodeId, StorageError, TypeConfig};

/// Receives the state changes of every applied entry, in log order: it wakes waiting calls,
/// counts metrics and writes the audit log. Called while apply runs, so it must be quick.
pub trait AppliedSink: Send + Sync + 'static {
    /// `unix_ms` is the table's clock after the entry (the leader's stamp, clamped).
    fn on_applied(&self, log_index: u64, unix_ms: i64, events: &[Event]);
    /// A snapshot from the leader replaced the table up to `log_index`.
    fn on_snapshot_installed(&self, log_index: u64, unix_ms: i64);
}

/// The in-memory state machine, shared read-only with the RPC layer.
#[derive(Default)]
pub struct SmState {
    pub table: LockTable,
    pub last_applied: Option<LogId>,
    pub membership: StoredMembership<NodeId, BasicNode>,
}

/// The format of data dirs written before snapshots had their own file: meta and the encoded
/// table nested in one value. Read once, when such a snapshot is moved to `snapshot.redb`.
#[derive(Serialize, Deserialize)]
struct LegacySnapshot {
    meta: SnapshotMeta<NodeId, BasicNode>,
    table: Vec<u8>,
}

/// A snapshot: openraft's meta, and the postcard-encoded [`LockTable`] (the bytes a lagging node
/// receives; openraft sends the meta beside them). Stored under two keys of one transaction.
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, BasicNode>,
    table: Vec<u8>,
}

pub struct StateMachine {
    state: Arc<RwLock<SmState>>,
    db: Arc<Database>,
    sink: Arc<dyn AppliedSink>,
    snapshot_seq: Arc<AtomicU64>,
}

impl StateMachine {
    /// Loads the latest snapshot from the database, if any; openraft then replays the committed
    /// log after it.
    pub async fn open(dbs: Databases, sink: Arc<dyn AppliedSink>) -> anyhow::Result<Self> {
        let mut state = SmState::default();
        let db = dbs.snapshots;
        if let Some(stored) = read_snapshot(&db, &dbs.log)? {
            let table = LockTable::decode_snapshot(&stored.table)?;
            drop(stored.table);
            table.check_consistency().map_err(|e| {
                anyhow::anyhow!("snapshot {} is inconsistent: {e}", stored.meta.snapshot_id)
            })?;
            state.table = table;
            state.last_applied = stored.meta.last_log_id;
            state.membership = stored.meta.last_membership.clone();
        }
        Ok(StateMachine {
            state: Arc::new(RwLock::new(state)),
            db,
            sink,
            snapshot_seq: Arc::new(AtomicU64::new(0)),
        })
    }

    pub fn shared(&self) -> Arc<RwLock<SmState>> {
        self.state.clone()
    }
}

/// The latest snapshot. Data dirs written before snapshots had their own file keep it in the log
/// database; it is moved to `snapshot.redb` first (written and synced there before it is removed
/// from the log database, so a crash in between leaves a copy in one of them).
fn read_snapshot(db: &Database, log_db: &Database) -> anyhow::Result<Option<StoredSnapshot>> {
    if let Some(stored) = read_stored(db)? {
        return Ok(Some(stored));
    }
    let legacy = {
        let txn = log_db.begin_read()?;
        let table = txn.open_table(META)?;
        table.get(KEY_SNAPSHOT)?.map(|v| v.value().to_vec())
    };
    let Some(bytes) = legacy else { return Ok(None) };
    let LegacySnapshot { meta, table } = postcard::from_bytes(&bytes)?;
    let stored = StoredSnapshot { meta, table };
    write_stored(db, &stored)?;
    let txn = log_db.begin_write()?;
    txn.open_table(META)?.remove(KEY_SNAPSHOT)?;
    txn.commit()?;
    Ok(Some(stored))
}

fn read_stored(db: &Database) -> anyhow::Result<Option<StoredSnapshot>> {
    let txn = db.begin_read()?;
    let snapshots = txn.open_table(SNAPSHOTS)?;
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

/// Meta and table in one durable transaction, replacing the previous snapshot.
fn write_stored(db: &Database, stored: &StoredSnapshot) -> anyhow::Result<()> {
    let meta = postcard::to_allocvec(&stored.meta)?;
    let txn = db.begin_write()?;
    {
        let mut snapshots = txn.open_table(SNAPSHOTS)?;
        snapshots.insert(KEY_SNAPSHOT_META, meta.as_slice())?;
        snapshots.insert(KEY_SNAPSHOT_TABLE, stored.table.as_slice())?;
    }
    txn.commit()?;
    Ok(())
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
            let (response, now_ms) = {
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
                (response, s.table.stats().now_ms)
            };
            self.sink.on_applied(entry.log_id.index, now_ms, &events);
            responses.push(response);
        }
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        SnapshotBuilder {
            state: self.state.clone(),
            db: self.db.clone(),
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
        let db = self.db.clone();
        blocking(move || write_stored(&db, &stored))
            .await
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        let now_ms = table.stats().now_ms;
        {
            let mut s = self.state.write().expect("state lock");
            s.table = table;
            s.last_applied = meta.last_log_id;
            s.membership = meta.last_membership.clone();
        }
        self.sink
            .on_snapshot_installed(meta.last_log_id.map(|l| l.index).unwrap_or(0), now_ms);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        let db = self.db.clone();
        let raw = blocking(move || read_stored(&db))
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
    db: Arc<Database>,
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
        let db = self.db.clone();
        let (bytes, encoded) = background(move || {
            let mut stored = StoredSnapshot {
                meta: meta2,
                table: table.encode(),
            };
            drop(table);
            let encoded = started.elapsed();
            write_stored(&db, &stored)?;
            Ok((std::mem::take(&mut stored.table), encoded))
        })
        .await
        .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        tracing::info!(
            snapshot_id = %meta.snapshot_id,
            bytes = bytes.len(),
            copy_ms = copied.as_millis() as u64,
            encode_ms = (encoded - copied).as_millis() as u64,
            persist_ms = (started.elapsed() - encoded).as_millis() as u64,
            "snapshot built"
        );
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
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
        fn on_applied(&self, _: u64, _: i64, _: &[Event]) {}
        fn on_snapshot_installed(&self, _: u64, _: i64) {}
    }

    /// Goal: a data dir whose snapshot sits in the log database (as before `snapshot.redb`)
    /// starts from that snapshot and moves it, so nothing compacted away is lost.
    #[tokio::test]
    async fn a_snapshot_in_the_old_place_moves_to_snapshot_redb() {
        let dir = tempfile::tempdir().unwrap();
        let dbs = crate::storage::open(dir.path()).unwrap();
        let mut table = LockTable::default();
        let batch = Batch {
            now_ms: 1_000,
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
        let legacy = postcard::to_allocvec(&LegacySnapshot {
            meta,
            table: table.encode_snapshot(),
        })
        .unwrap();
        let txn = dbs.log.begin_write().unwrap();
        txn.open_table(META)
            .unwrap()
            .insert(KEY_SNAPSHOT, legacy.as_slice())
            .unwrap();
        txn.commit().unwrap();

        let reopened = Databases {
            log: dbs.log.clone(),
            snapshots: dbs.snapshots.clone(),
        };
        let sm = StateMachine::open(reopened, Arc::new(NoSink))
            .await
            .unwrap();
        {
            let state = sm.shared();
            let s = state.read().unwrap();
            assert_eq!(s.table.stats(), table.stats());
            assert_eq!(s.table.stats().active_locks, 1);
            assert_eq!(s.last_applied.map(|l| l.index), Some(7));
        }
        let txn = dbs.log.begin_read().unwrap();
        assert!(
            txn.open_table(META)
                .unwrap()
                .get(KEY_SNAPSHOT)
                .unwrap()
                .is_none()
        );
        let moved = read_stored(&dbs.snapshots).unwrap().unwrap();
        assert_eq!(moved.meta.snapshot_id, "1-7-0");
    }
}

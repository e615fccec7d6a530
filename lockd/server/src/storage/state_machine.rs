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

use super::{Databases, KEY_SNAPSHOT, META, SNAPSHOTS, background, blocking};
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

/// A snapshot as stored in redb and sent to lagging nodes.
#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, BasicNode>,
    /// postcard-encoded [`LockTable`].
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
            let table: LockTable = postcard::from_bytes(&stored.table)?;
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
    if read_snapshot_bytes(db)?.is_none() {
        let legacy = {
            let txn = log_db.begin_read()?;
            let table = txn.open_table(META)?;
            table.get(KEY_SNAPSHOT)?.map(|v| v.value().to_vec())
        };
        if let Some(bytes) = legacy {
            let txn = db.begin_write()?;
            txn.open_table(SNAPSHOTS)?
                .insert(KEY_SNAPSHOT, bytes.as_slice())?;
            txn.commit()?;
            let txn = log_db.begin_write()?;
            txn.open_table(META)?.remove(KEY_SNAPSHOT)?;
            txn.commit()?;
        }
    }
    Ok(match read_snapshot_bytes(db)? {
        Some(bytes) => Some(postcard::from_bytes(&bytes)?),
        None => None,
    })
}

fn read_snapshot_bytes(db: &Database) -> anyhow::Result<Option<Vec<u8>>> {
    let txn = db.begin_read()?;
    let table = txn.open_table(SNAPSHOTS)?;
    Ok(table.get(KEY_SNAPSHOT)?.map(|v| v.value().to_vec()))
}

async fn write_snapshot(db: Arc<Database>, bytes: Vec<u8>) -> Result<(), std::io::Error> {
    blocking(move || {
        let txn = db.begin_write()?;
        txn.open_table(SNAPSHOTS)?
            .insert(KEY_SNAPSHOT, bytes.as_slice())?;
        txn.commit()?;
        Ok(())
    })
    .await
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
        let stored: StoredSnapshot = postcard::from_bytes(&bytes)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?;
        let table: LockTable = postcard::from_bytes(&stored.table)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?;
        if let Err(e) = table.check_consistency() {
            return Err(StorageIOError::read_snapshot(
                Some(meta.signature()),
                &std::io::Error::other(format!("inconsistent snapshot: {e}")),
            )
            .into());
        }
        write_snapshot(self.db.clone(), bytes)
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
        let raw = blocking(move || read_snapshot_bytes(&db))
            .await
            .map_err(|e| StorageIOError::read_snapshot(None, &e))?;
        let Some(bytes) = raw else { return Ok(None) };
        let stored: StoredSnapshot =
            postcard::from_bytes(&bytes).map_err(|e| StorageIOError::read_snapshot(None, &e))?;
        Ok(Some(Snapshot {
            meta: stored.meta,
            snapshot: Box::new(Cursor::new(bytes)),
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
            (s.table.clone(), s.last_applied, s.membership.clone())
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
            let stored = StoredSnapshot {
                meta: meta2,
                table: postcard::to_allocvec(&table)?,
            };
            drop(table);
            let bytes = postcard::to_allocvec(&stored)?;
            drop(stored);
            let encoded = started.elapsed();
            let txn = db.begin_write()?;
            txn.open_table(SNAPSHOTS)?
                .insert(KEY_SNAPSHOT, bytes.as_slice())?;
            txn.commit()?;
            Ok((bytes, encoded))
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

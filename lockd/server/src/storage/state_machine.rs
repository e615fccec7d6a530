//! The lock table as openraft's state machine, with snapshots persisted in `snapshot.bin`.

use std::io::{Read, Seek, SeekFrom};
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

use super::snapshot_data::SnapshotData;
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
    /// A snapshot of `bytes` was made durable in `took`: built here from the table, or
    /// `installed` from the leader (decoded, checked and written).
    fn on_snapshot_stored(&self, installed: bool, took: std::time::Duration, bytes: u64) {
        let _ = (installed, took, bytes);
    }
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
            sink: self.sink.clone(),
        }
    }

    /// A temporary file in the data dir to receive the leader's snapshot into, so a transfer
    /// of tens of megabytes does not sit in memory.
    async fn begin_receiving_snapshot(&mut self) -> Result<Box<SnapshotData>, StorageError> {
        let file = self.snapshots.clone();
        let (received, path) = blocking(move || file.create_receive_file())
            .await
            .map_err(|e| StorageIOError::write_snapshot(None, &e))?;
        Ok(Box::new(SnapshotData::receiving(received, path)))
    }

    /// Replaces the table with a snapshot from the leader and persists it, so a restart starts
    /// from it.
    ///
    /// The received table is read into memory once, to decode it, and written from there into
    /// `snapshot.bin` with its meta (synced in steps, renamed under the lock that keeps an
    /// older snapshot from replacing a newer one). Then the received file is deleted.
    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<SnapshotData>,
    ) -> Result<(), StorageError> {
        let read_err =
            |e: &std::io::Error| StorageIOError::read_snapshot(Some(meta.signature()), e);
        let Some((mut received, _remove_when_done)) =
            snapshot.into_received().await.map_err(|e| read_err(&e))?
        else {
            return Err(read_err(&std::io::Error::other(format!(
                "lockd: snapshot {} to install was not received by this node",
                meta.snapshot_id
            )))
            .into());
        };
        let snapshot_id = meta.snapshot_id.clone();
        let started = std::time::Instant::now();
        // Reading and decoding tens of megabytes: off the async workers.
        let (table, bytes) = blocking(move || {
            received.seek(SeekFrom::Start(0))?;
            let mut bytes = Vec::with_capacity(received.metadata()?.len() as usize);
            received.read_to_end(&mut bytes)?;
            let table = LockTable::decode_snapshot(&bytes)?;
            table.check_consistency().map_err(|e| {
                anyhow::anyhow!("lockd: snapshot {snapshot_id} is inconsistent: {e}")
            })?;
            Ok((table, bytes))
        })
        .await
        .map_err(|e| read_err(&e))?;
        let size = bytes.len() as u64;
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
        self.sink.on_snapshot_stored(true, started.elapsed(), size);
        self.sink
            .on_snapshot_installed(meta.last_log_id.map(|l| l.index).unwrap_or(0), now_ms);
        self.sink.on_table_replaced(longest);
        Ok(())
    }

    /// The latest snapshot, for a follower that needs it. Only its header and meta are read
    /// here (off the async workers); the table is read from the open file as openraft sends it,
    /// on the replication task, so apply never waits for a read of the whole file.
    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        let file = self.snapshots.clone();
        let open = blocking(move || file.open_latest())
            .await
            .map_err(|e| StorageIOError::read_snapshot(None, &e))?;
        let Some(open) = open else {
            return Ok(None);
        };
        let data = SnapshotData::sending(open.file, open.table_start)
            .await
            .map_err(|e| StorageIOError::read_snapshot(Some(open.meta.signature()), &e))?;
        Ok(Some(Snapshot {
            meta: open.meta,
            snapshot: Box::new(data),
        }))
    }
}

pub struct SnapshotBuilder {
    state: Arc<RwLock<SmState>>,
    snapshots: SnapshotFile,
    seq: Arc<AtomicU64>,
    sink: Arc<dyn AppliedSink>,
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
        self.sink
            .on_snapshot_stored(false, started.elapsed(), bytes);
        // openraft 0.9 keeps only the meta of a snapshot it asked for (core/sm/worker.rs) and
        // reads the data through get_current_snapshot when a follower needs it, so the bytes are
        // not returned here: holding them would cost a second copy of the table in memory.
        Ok(Snapshot {
            meta,
            snapshot: Box::new(SnapshotData::empty()),
        })
    }
}

#[cfg(test)]
mod tests {
    use lockd_core::{Batch, Command, Event, LeaseId, Policy, ResourceName};
    use openraft::CommittedLeaderId;
    use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

    use super::*;
    use crate::storage::snapshot_file::TMP_PREFIX;

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

    /// openraft's chunk size for sending snapshots (`snapshot_max_chunk_size` in node.rs).
    const CHUNK: usize = 4 * 1024 * 1024;

    /// A state machine on `dir` with no snapshot yet.
    async fn empty_sm(dir: &std::path::Path) -> StateMachine {
        let dbs = crate::storage::open(dir).unwrap();
        StateMachine::open(dbs, Arc::new(NoSink)).await.unwrap()
    }

    /// Meta of a snapshot up to log index `index`.
    fn meta_at(index: u64) -> SnapshotMeta<NodeId, BasicNode> {
        SnapshotMeta {
            last_log_id: Some(LogId::new(CommittedLeaderId::new(1, 1), index)),
            last_membership: StoredMembership::default(),
            snapshot_id: format!("1-{index}-0"),
        }
    }

    /// Reads a snapshot's data the way openraft's chunked sender does (network/
    /// snapshot_transport.rs): the end from `SeekFrom::End(0)`, then for each chunk a seek to
    /// its offset and reads until the chunk is full or the data ends.
    async fn read_like_the_sender(data: &mut SnapshotData) -> Vec<u8> {
        let end = data.seek(SeekFrom::End(0)).await.unwrap();
        let mut all = Vec::new();
        let mut offset = 0;
        loop {
            assert_eq!(data.seek(SeekFrom::Start(offset)).await.unwrap(), offset);
            let mut buf = Vec::with_capacity(CHUNK);
            while buf.capacity() > buf.len() {
                if data.read_buf(&mut buf).await.unwrap() == 0 {
                    break;
                }
            }
            offset += buf.len() as u64;
            all.extend_from_slice(&buf);
            if offset == end {
                return all;
            }
            assert!(!buf.is_empty(), "data ended at {offset}, before {end}");
        }
    }

    /// Receives `bytes` the way openraft's receiver does (Streaming::receive): a seek to each
    /// chunk's offset, a write, and a shutdown at the end. The second half arrives first, so
    /// the seeks matter.
    async fn receive(sm: &mut StateMachine, bytes: &[u8]) -> Box<SnapshotData> {
        let mut data = sm.begin_receiving_snapshot().await.unwrap();
        let half = bytes.len() / 2;
        for (offset, chunk) in [(half, &bytes[half..]), (0, &bytes[..half])] {
            data.seek(SeekFrom::Start(offset as u64)).await.unwrap();
            data.write_all(chunk).await.unwrap();
        }
        data.shutdown().await.unwrap();
        data
    }

    /// The names of the temporary snapshot files in `dir`.
    fn tmp_files(dir: &std::path::Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with(TMP_PREFIX))
            .collect()
    }

    /// Goal: the data get_current_snapshot returns are exactly the table bytes of
    /// `snapshot.bin`, read in chunks from non-zero offsets as openraft sends them; and a newer
    /// snapshot renamed over the file during the transfer does not change what is sent (it
    /// would no longer match the meta sent with it).
    #[tokio::test]
    async fn issue14_finding8a_current_snapshot_reads_the_table_bytes_in_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let mut sm = empty_sm(dir.path()).await;
        assert!(sm.get_current_snapshot().await.unwrap().is_none());

        // More than two chunks, not a multiple of one; the data are opaque here.
        let table: Vec<u8> = (0..2 * CHUNK + 12_345).map(|i| (i % 251) as u8).collect();
        sm.snapshots
            .write(&StoredSnapshot {
                meta: meta_at(7),
                table: table.clone(),
            })
            .unwrap();

        let mut snap = sm.get_current_snapshot().await.unwrap().unwrap();
        assert_eq!(snap.meta.snapshot_id, "1-7-0");
        // Offsets count from the first table byte, not from the file's header.
        snap.snapshot.seek(SeekFrom::Start(1_000)).await.unwrap();
        let mut some = [0u8; 100];
        snap.snapshot.read_exact(&mut some).await.unwrap();
        assert_eq!(some[..], table[1_000..1_100]);
        assert_eq!(
            snap.snapshot.seek(SeekFrom::Current(-100)).await.unwrap(),
            1_000
        );

        // Phase 2: a newer snapshot replaces the file before the transfer.
        sm.snapshots
            .write(&StoredSnapshot {
                meta: meta_at(9),
                table: b"newer".to_vec(),
            })
            .unwrap();
        let sent = read_like_the_sender(&mut snap.snapshot).await;
        assert!(sent == table, "sent {} bytes, not the table", sent.len());

        // Phase 3: the next request gets the newer one.
        let mut snap = sm.get_current_snapshot().await.unwrap().unwrap();
        assert_eq!(snap.meta.snapshot_id, "1-9-0");
        assert_eq!(read_like_the_sender(&mut snap.snapshot).await, b"newer");
    }

    /// Goal: get_current_snapshot does not read the table on the state machine task (apply
    /// waits for that task): the table is read only as the sender reads the returned data.
    /// Method: after get_current_snapshot returns, overwrite the table bytes in place in
    /// `snapshot.bin`; the data then read must be the new bytes. Code that read the file whole
    /// into memory before returning (as before this fix) sends the old bytes and fails.
    #[tokio::test]
    async fn issue14_finding8a_current_snapshot_does_not_read_the_table_up_front() {
        let dir = tempfile::tempdir().unwrap();
        let mut sm = empty_sm(dir.path()).await;
        let len = 3 * CHUNK / 2;
        sm.snapshots
            .write(&StoredSnapshot {
                meta: meta_at(7),
                table: vec![0xaa; len],
            })
            .unwrap();

        let mut snap = sm.get_current_snapshot().await.unwrap().unwrap();

        // The table is the last `len` bytes of the file.
        let path = dir.path().join("snapshot.bin");
        let mut file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let file_len = file.metadata().unwrap().len();
        file.seek(SeekFrom::Start(file_len - len as u64)).unwrap();
        std::io::Write::write_all(&mut file, &vec![0xbb; len]).unwrap();
        drop(file);

        let sent = read_like_the_sender(&mut snap.snapshot).await;
        assert_eq!(sent.len(), len);
        assert!(
            sent.iter().all(|b| *b == 0xbb),
            "the table was read before get_current_snapshot returned"
        );
    }

    /// Goal: a snapshot received from the leader in chunks installs, replaces the table, is in
    /// `snapshot.bin` for a restart, and leaves no temporary file; a transfer given up removes
    /// its file at once, and one a crash interrupted is removed on the next start.
    #[tokio::test]
    async fn issue14_finding8a_a_received_snapshot_installs_and_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let (table, stored) = sample();
        {
            let mut sm = empty_sm(dir.path()).await;
            let data = receive(&mut sm, &stored.table).await;
            assert_eq!(
                tmp_files(dir.path()).len(),
                1,
                "receives into a temporary file"
            );
            sm.install_snapshot(&stored.meta, data).await.unwrap();
            {
                let s = sm.state.read().unwrap();
                assert_eq!(s.table.stats(), table.stats());
                assert_eq!(s.last_applied, stored.meta.last_log_id);
            }
            assert_eq!(tmp_files(dir.path()), Vec::<String>::new());

            // Phase 2: openraft drops the data of a transfer it gives up.
            let given_up = receive(&mut sm, b"half a snapshot").await;
            assert_eq!(tmp_files(dir.path()).len(), 1);
            drop(given_up);
            assert_eq!(tmp_files(dir.path()), Vec::<String>::new());

            // Phase 3: a crash in the middle of a transfer (no drop runs).
            std::mem::forget(receive(&mut sm, b"half a snapshot").await);
            assert_eq!(tmp_files(dir.path()).len(), 1);
        }
        // Phase 4: the restart starts from the installed snapshot (and opening the storage
        // removes the leftover).
        assert_starts_from(dir.path(), &table).await;
        assert_eq!(tmp_files(dir.path()), Vec::<String>::new());
    }

    /// Goal: installing a snapshot older than the one already in `snapshot.bin` (a build that
    /// finished first) leaves the newer one in place, and no temporary file.
    #[tokio::test]
    async fn issue14_finding8a_an_older_received_snapshot_does_not_replace_a_newer_one() {
        let dir = tempfile::tempdir().unwrap();
        let (_, stored) = sample();
        let mut sm = empty_sm(dir.path()).await;
        sm.snapshots
            .write(&StoredSnapshot {
                meta: meta_at(9),
                table: stored.table.clone(),
            })
            .unwrap();

        let data = receive(&mut sm, &stored.table).await;
        sm.install_snapshot(&stored.meta, data).await.unwrap();

        let on_disk = SnapshotFile::new(dir.path()).read().unwrap().unwrap();
        assert_eq!(on_disk.meta.snapshot_id, "1-9-0");
        assert_eq!(tmp_files(dir.path()), Vec::<String>::new());
    }

    /// Goal: a received snapshot that does not decode is refused with an error naming it, and
    /// its file is removed.
    #[tokio::test]
    async fn a_received_snapshot_that_does_not_decode_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut sm = empty_sm(dir.path()).await;
        let data = receive(&mut sm, b"not a table").await;
        let e = sm
            .install_snapshot(&meta_at(7), data)
            .await
            .expect_err("an error")
            .to_string();
        assert!(e.contains("1-7-0"), "{e}");
        assert!(!dir.path().join("snapshot.bin").exists());
        assert_eq!(tmp_files(dir.path()), Vec::<String>::new());
    }
}

//! The Raft log and vote in redb, written by one writer thread.
//!
//! `append` hands the encoded entries to the writer thread and returns, so the fsync never blocks
//! a tokio worker; the thread commits everything queued in one durable redb transaction and only
//! then fires each append's flush callback (openraft counts an entry towards the quorum only
//! after its callback). Until then the entries are served from an in-memory overlay, so
//! replication can read them at once. Vote, truncate and purge go through the same queue, in
//! order, and their callers wait for the durable commit.
//!
//! openraft 0.9 awaits each append's callback before its core goes on
//! (`RaftCore::append_to_log`), so a round never holds two appends: every append is one fsync,
//! joined only by the committed index and purge steps queued meanwhile. Commands are batched
//! before they reach the log (the proposer's `Batch`, AppendEntries of up to 16 entries).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{Entry, LogState, RaftLogReader, StorageIOError, Vote};
use redb::{Database, ReadableDatabase, ReadableTable};
use tokio::sync::oneshot;
use tokio::sync::watch;

use super::{
    KEY_COMMITTED, KEY_FOUNDING, KEY_LAST_PURGED, KEY_REJOIN_PROOF, KEY_REJOINING, KEY_RESTORE_ID,
    KEY_VOTE, LOG, META, StorageObserver, blocking,
};
use crate::raft::{LogId, NodeId, StorageError, TypeConfig};

/// Log storage handle. Cloning shares the database, the overlay and the writer.
#[derive(Clone)]
pub struct LogStore {
    db: Arc<Database>,
    /// Entries handed to the writer but not yet durable, by index.
    pending: Arc<Mutex<BTreeMap<u64, Entry<TypeConfig>>>>,
    writer: Sender<WriteOp>,
    /// The committed index openraft last reported, for Status (0 = none).
    committed: Arc<AtomicU64>,
}

/// The last log id covered by the durable snapshot. openraft can ask for a purge before the
/// snapshot that covers it is on disk (when a follower installs one from the leader, the purge
/// is issued beside the install); entries are deleted only once the snapshot is durable, so a
/// crash in between never leaves a purged log with an older snapshot.
pub type SnapshotGate = watch::Receiver<Option<LogId>>;

enum WriteOp {
    Append {
        entries: Vec<(u64, Vec<u8>)>,
        callback: LogFlushed<TypeConfig>,
    },
    /// Durable before `done` fires.
    Meta {
        key: &'static str,
        value: Vec<u8>,
        done: Option<oneshot::Sender<Result<(), String>>>,
    },
    /// The rejoining flag and proof cleared together (`LogStore::finish_rejoining`).
    FinishRejoin {
        flag: Vec<u8>,
        proof: Vec<u8>,
        done: oneshot::Sender<Result<(), String>>,
    },
    Truncate {
        from: u64,
        done: oneshot::Sender<Result<(), String>>,
    },
    Purge {
        upto: LogId,
        done: oneshot::Sender<Result<(), String>>,
    },
}

impl WriteOp {
    /// Whether nobody waits for this write to be durable (it rides on the next commit).
    fn rides(&self) -> bool {
        matches!(self, WriteOp::Meta { done: None, .. })
    }
}

impl LogStore {
    /// A log store whose purges wait for `gate` (see [`SnapshotGate`]), observed by no one.
    #[cfg(test)]
    pub fn new(db: Arc<Database>, gate: SnapshotGate) -> Self {
        Self::observed(db, gate, Arc::new(super::Unobserved))
    }

    /// [`LogStore::new`] that tells `observer` how long each durable write took.
    pub fn observed(
        db: Arc<Database>,
        gate: SnapshotGate,
        observer: Arc<dyn StorageObserver>,
    ) -> Self {
        let (tx, rx) = channel();
        let pending = Arc::new(Mutex::new(BTreeMap::new()));
        let (db2, pending2) = (db.clone(), pending.clone());
        std::thread::Builder::new()
            .name("raft-log-writer".into())
            .spawn(move || write_loop(db2, pending2, rx, gate, observer))
            .expect("spawning the log writer thread");
        LogStore {
            db,
            pending,
            writer: tx,
            committed: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Shared view of the committed index, for Status.
    pub fn committed_index(&self) -> Arc<AtomicU64> {
        self.committed.clone()
    }

    fn read_meta<T: serde::de::DeserializeOwned>(&self, key: &str) -> anyhow::Result<Option<T>> {
        read_meta(&self.db, key)
    }

    /// Whether this node is rejoining after starting with an empty data dir and has not caught
    /// up yet (see [`crate::raft::vote_gate`]). Absent in older data dirs: not rejoining.
    pub fn rejoining(&self) -> anyhow::Result<bool> {
        Ok(self.read_meta::<bool>(KEY_REJOINING)?.unwrap_or(false))
    }

    /// Records durably that this node is rejoining, so a crash while catching up does not let it
    /// vote on a partial log after the restart. A proof kept from before a restart stays.
    pub async fn start_rejoining(&self) -> Result<(), std::io::Error> {
        let value = encode(&true).map_err(io)?;
        self.submit(|done| WriteOp::Meta {
            key: KEY_REJOINING,
            value,
            done: Some(done),
        })
        .await
    }

    /// The proof a rejoining node learned from its peers, if it learned one before a restart
    /// (see [`crate::raft::vote_gate`]); `None` in older data dirs and once cleared.
    pub fn rejoin_proof<P: serde::de::DeserializeOwned>(&self) -> anyhow::Result<Option<P>> {
        Ok(self.read_meta::<Option<P>>(KEY_REJOIN_PROOF)?.flatten())
    }

    /// Records durably what a rejoining node learned from its peers.
    pub async fn set_rejoin_proof<P: serde::Serialize>(
        &self,
        proof: &P,
    ) -> Result<(), std::io::Error> {
        let value = encode(&Some(proof)).map_err(io)?;
        self.submit(|done| WriteOp::Meta {
            key: KEY_REJOIN_PROOF,
            value,
            done: Some(done),
        })
        .await
    }

    /// The membership (id, address) `lockd init` recorded for this node to found a cluster of;
    /// `None` when it was never initialized that way.
    pub fn founding(&self) -> anyhow::Result<Option<Vec<(u64, String)>>> {
        self.read_meta::<Vec<(u64, String)>>(KEY_FOUNDING)
    }

    /// Records durably that this node founds a cluster of `members` on its next start
    /// (`lockd init`).
    pub async fn set_founding(&self, members: Vec<(u64, String)>) -> Result<(), std::io::Error> {
        let value = encode(&members).map_err(io)?;
        self.submit(|done| WriteOp::Meta {
            key: KEY_FOUNDING,
            value,
            done: Some(done),
        })
        .await
    }

    /// The restore id this node keeps for good (see `crate::backup::restore`): written by
    /// `lockd restore`, or learned by a wiped node from the peers that vouched for its proof.
    /// `None` for a node of a cluster that was never restored.
    pub fn restore_id(&self) -> anyhow::Result<Option<String>> {
        self.read_meta::<String>(KEY_RESTORE_ID)
    }

    /// Records durably the restore id a wiped node learned from its peers.
    pub async fn set_restore_id(&self, id: &str) -> Result<(), std::io::Error> {
        let value = encode(&id.to_owned()).map_err(io)?;
        self.submit(|done| WriteOp::Meta {
            key: KEY_RESTORE_ID,
            value,
            done: Some(done),
        })
        .await
    }

    /// Clears the rejoining flag and the proof in one durable transaction, so that no proof
    /// outlives its flag (a later rejoin must never find an old one).
    pub async fn finish_rejoining(&self) -> Result<(), std::io::Error> {
        let flag = encode(&false).map_err(io)?;
        let proof = encode(&None::<()>).map_err(io)?;
        self.submit(|done| WriteOp::FinishRejoin { flag, proof, done })
            .await
    }

    /// Queues an operation and waits for its durable commit.
    async fn submit(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<(), String>>) -> WriteOp,
    ) -> Result<(), std::io::Error> {
        let (tx, rx) = oneshot::channel();
        self.writer
            .send(make(tx))
            .map_err(|_| std::io::Error::other("the log writer thread has stopped"))?;
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(std::io::Error::other(e)),
            Err(_) => Err(std::io::Error::other("the log writer thread has stopped")),
        }
    }
}

/// Log entries deleted per write round at most. Compaction frees thousands of entries at once;
/// deleting them all in one transaction would hold up the appends of that round (and so every
/// commit) for as long as it takes. In chunks the purge trails behind by a few rounds instead.
const PURGE_CHUNK: u64 = 256;
/// How soon an idle writer deletes the next chunk of a purge backlog.
const PURGE_IDLE_DELAY: Duration = Duration::from_millis(5);
/// How long writes that need not be durable at once (the committed index) wait for a durable one
/// to share its commit. openraft reports the committed index right after each append's flush, so
/// alone they cost a commit and an fsync of their own after almost every append (a third of the
/// leader's commits and half of a follower's, measured with callgrind, docs/benchmarks.md).
/// Under load the next append comes well within this; an idle node writes them after it.
const RIDE_WAIT: Duration = Duration::from_millis(50);

/// Commits everything queued, one durable transaction per round.
///
/// A purge records `last_purged` in its round and leaves the entries to be deleted
/// [`PURGE_CHUNK`] per round. openraft never reads at or below `last_purged`, and a restart
/// resumes the deletion from the recorded `last_purged`. A purge the durable snapshot does not
/// cover yet is held (openraft is answered at once: a purge need not be durable) and recorded
/// when the snapshot catches up, see [`SnapshotGate`].
fn write_loop(
    db: Arc<Database>,
    pending: Arc<Mutex<BTreeMap<u64, Entry<TypeConfig>>>>,
    rx: Receiver<WriteOp>,
    gate: SnapshotGate,
    observer: Arc<dyn StorageObserver>,
) {
    // A purge asked for beyond the durable snapshot, held until the snapshot catches up.
    let mut held_purge: Option<LogId> = None;
    let covered = |upto: &LogId| gate.borrow().is_some_and(|s| s.index >= upto.index);
    let mut purge_upto = match read_meta::<LogId>(&db, KEY_LAST_PURGED) {
        Ok(last) => last.map(|l| l.index),
        Err(e) => {
            tracing::error!(error = %e, "reading last_purged; old entries stay until the next purge");
            None
        }
    };
    loop {
        let first = if purge_upto.is_some() || held_purge.is_some() {
            match rx.recv_timeout(PURGE_IDLE_DELAY) {
                Ok(op) => Some(op),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        } else {
            match rx.recv() {
                Ok(op) => Some(op),
                Err(_) => return,
            }
        };
        let mut ops: Vec<WriteOp> = first.into_iter().collect();
        while let Ok(op) = rx.try_recv() {
            ops.push(op);
        }
        // Nothing here waits for durability: give a durable write the chance to take it along.
        // Appends and every op with a caller waiting end the wait at once.
        if !ops.is_empty() && ops.iter().all(WriteOp::rides) {
            let deadline = Instant::now() + RIDE_WAIT;
            while let Some(left) = deadline.checked_duration_since(Instant::now()) {
                let Ok(op) = rx.recv_timeout(left) else { break };
                let durable = !op.rides();
                ops.push(op);
                if durable {
                    while let Ok(op) = rx.try_recv() {
                        ops.push(op);
                    }
                    break;
                }
            }
        }
        let mut record_purge = held_purge.take();
        for op in &ops {
            if let WriteOp::Purge { upto, .. } = op {
                record_purge = record_purge.max(Some(*upto));
            }
        }
        if let Some(upto) = record_purge
            && !covered(&upto)
        {
            held_purge = Some(upto);
            record_purge = None;
        }
        if ops.is_empty() && record_purge.is_none() && purge_upto.is_none() {
            // Woken only to look at a held purge, which still waits for its snapshot.
            continue;
        }
        let mut backlog_done = false;
        let result = (|| -> anyhow::Result<()> {
            let txn = db.begin_write()?;
            {
                let mut log = txn.open_table(LOG)?;
                let mut meta = txn.open_table(META)?;
                for op in &ops {
                    match op {
                        WriteOp::Append { entries, .. } => {
                            for (index, bytes) in entries {
                                log.insert(index, bytes.as_slice())?;
                            }
                        }
                        WriteOp::Meta { key, value, .. } => {
                            meta.insert(*key, value.as_slice())?;
                        }
                        WriteOp::FinishRejoin { flag, proof, .. } => {
                            meta.insert(KEY_REJOINING, flag.as_slice())?;
                            meta.insert(KEY_REJOIN_PROOF, proof.as_slice())?;
                        }
                        WriteOp::Truncate { from, .. } => {
                            log.retain_in(*from.., |_, _| false)?;
                        }
                        WriteOp::Purge { .. } => {}
                    }
                }
                if let Some(upto) = &record_purge {
                    meta.insert(KEY_LAST_PURGED, postcard::to_allocvec(upto)?.as_slice())?;
                    purge_upto = Some(purge_upto.map_or(upto.index, |p| p.max(upto.index)));
                }
                if let Some(upto) = purge_upto {
                    let first = log.first()?.map(|(k, _)| k.value());
                    match first {
                        Some(first) if first <= upto => {
                            let end = upto.min(first + PURGE_CHUNK - 1);
                            log.retain_in(..=end, |_, _| false)?;
                            backlog_done = end == upto;
                        }
                        _ => backlog_done = true,
                    }
                }
            }
            let syncing = Instant::now();
            txn.commit()?;
            observer.log_synced(syncing.elapsed());
            Ok(())
        })();
        if result.is_ok() && backlog_done {
            purge_upto = None;
        }
        let err = result.as_ref().err().map(|e| e.to_string());
        if let Some(e) = &err {
            tracing::error!(error = %e, "raft log write failed");
        }
        for op in ops {
            match op {
                WriteOp::Append { entries, callback } => {
                    if err.is_none() {
                        // Durable now: readers find them in redb.
                        let mut p = pending.lock().expect("pending lock");
                        for (index, _) in &entries {
                            p.remove(index);
                        }
                    }
                    callback.log_io_completed(match &err {
                        None => Ok(()),
                        Some(e) => Err(std::io::Error::other(e.clone())),
                    });
                }
                WriteOp::Meta { done, .. } => {
                    if let Some(done) = done {
                        let _ = done.send(err.clone().map_or(Ok(()), Err));
                    }
                }
                WriteOp::FinishRejoin { done, .. }
                | WriteOp::Truncate { done, .. }
                | WriteOp::Purge { done, .. } => {
                    let _ = done.send(err.clone().map_or(Ok(()), Err));
                }
            }
        }
    }
}

fn read_meta<T: serde::de::DeserializeOwned>(
    db: &Database,
    key: &str,
) -> anyhow::Result<Option<T>> {
    let txn = db.begin_read()?;
    let table = txn.open_table(META)?;
    match table.get(key)? {
        Some(v) => Ok(Some(postcard::from_bytes(v.value())?)),
        None => Ok(None),
    }
}

/// An anyhow error as the io::Error openraft's error constructors take.
fn io(e: anyhow::Error) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

fn encode<T: serde::Serialize>(v: &T) -> anyhow::Result<Vec<u8>> {
    Ok(postcard::to_allocvec(v)?)
}

fn range_of(range: &impl RangeBounds<u64>) -> (u64, Option<u64>) {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s + 1,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => Some(e + 1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => None,
    };
    (start, end)
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError> {
        let (start, end) = range_of(&range);
        // Snapshot the overlay first: an entry leaves it only after it is durable in redb, so
        // every entry is in at least one of the two reads.
        let overlay: Vec<Entry<TypeConfig>> = {
            let p = self.pending.lock().expect("pending lock");
            match end {
                Some(end) => p.range(start..end).map(|(_, e)| e.clone()).collect(),
                None => p.range(start..).map(|(_, e)| e.clone()).collect(),
            }
        };
        let db = self.db.clone();
        let mut stored = blocking(move || {
            let txn = db.begin_read()?;
            let table = txn.open_table(LOG)?;
            let iter = match end {
                Some(end) => table.range(start..end)?,
                None => table.range(start..)?,
            };
            let mut out = BTreeMap::new();
            for item in iter {
                let (k, v) = item?;
                out.insert(
                    k.value(),
                    postcard::from_bytes::<Entry<TypeConfig>>(v.value())?,
                );
            }
            Ok(out)
        })
        .await
        .map_err(|e| StorageIOError::read_logs(&e))?;
        for e in overlay {
            stored.insert(e.log_id.index, e);
        }
        Ok(stored.into_values().collect())
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let db = self.db.clone();
        let last_purged: Option<LogId> = self
            .read_meta(KEY_LAST_PURGED)
            .map_err(|e| StorageIOError::read_logs(&io(e)))?;
        let pending_last = self
            .pending
            .lock()
            .expect("pending lock")
            .last_key_value()
            .map(|(_, e)| e.log_id);
        let last = blocking(move || {
            let txn = db.begin_read()?;
            let table = txn.open_table(LOG)?;
            match table.last()? {
                Some((_, v)) => Ok(Some(
                    postcard::from_bytes::<Entry<TypeConfig>>(v.value())?.log_id,
                )),
                None => Ok(None),
            }
        })
        .await
        .map_err(|e| StorageIOError::read_logs(&e))?;
        // Entries at or below last_purged may still wait for the writer's chunked deletion.
        let last = [last, pending_last, last_purged]
            .into_iter()
            .flatten()
            .max_by_key(|l| l.index);
        Ok(LogState {
            last_purged_log_id: last_purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    /// Durable before it returns: a vote that is forgotten after a crash allows two leaders in
    /// one term.
    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        let value = encode(vote).map_err(|e| StorageIOError::write_vote(&io(e)))?;
        self.submit(|done| WriteOp::Meta {
            key: KEY_VOTE,
            value,
            done: Some(done),
        })
        .await
        .map_err(|e| StorageIOError::write_vote(&e).into())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.read_meta(KEY_VOTE)
            .map_err(|e| StorageIOError::read_vote(&io(e)).into())
    }

    /// Queued without waiting: it rides on the next durable commit (or is written alone after
    /// [`RIDE_WAIT`]), and losing it only means replaying less on restart until the leader
    /// repeats it.
    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        if let Some(c) = committed {
            self.committed.store(c.index, Ordering::Relaxed);
        }
        let value = encode(&committed).map_err(|e| StorageIOError::write(&io(e)))?;
        self.writer
            .send(WriteOp::Meta {
                key: KEY_COMMITTED,
                value,
                done: None,
            })
            .map_err(|_| {
                StorageIOError::write(&std::io::Error::other("the log writer thread has stopped"))
                    .into()
            })
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        let c: Option<Option<LogId>> = self
            .read_meta(KEY_COMMITTED)
            .map_err(|e| StorageIOError::read(&io(e)))?;
        let c = c.flatten();
        if let Some(c) = c {
            self.committed.store(c.index, Ordering::Relaxed);
        }
        Ok(c)
    }

    /// Hands the entries to the writer and returns; the callback fires after the fsync.
    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let mut encoded = Vec::new();
        {
            let mut p = self.pending.lock().expect("pending lock");
            for e in entries {
                let bytes = encode(&e).map_err(|err| StorageIOError::write_logs(&io(err)))?;
                encoded.push((e.log_id.index, bytes));
                p.insert(e.log_id.index, e);
            }
        }
        self.writer
            .send(WriteOp::Append {
                entries: encoded,
                callback,
            })
            .map_err(|_| {
                StorageIOError::write_logs(&std::io::Error::other(
                    "the log writer thread has stopped",
                ))
                .into()
            })
    }

    /// Deletes entries from `log_id.index` on (a conflicting suffix), durably, before returning.
    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.pending
            .lock()
            .expect("pending lock")
            .retain(|index, _| *index < log_id.index);
        self.submit(|done| WriteOp::Truncate {
            from: log_id.index,
            done,
        })
        .await
        .map_err(|e| StorageIOError::write_logs(&e).into())
    }

    /// Deletes entries up to `log_id.index` and records `last_purged` in the same transaction,
    /// so a restart after compaction knows where the log starts.
    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.pending
            .lock()
            .expect("pending lock")
            .retain(|index, _| *index > log_id.index);
        self.submit(|done| WriteOp::Purge { upto: log_id, done })
            .await
            .map_err(|e| StorageIOError::write_logs(&e).into())
    }
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, EntryPayload};

    use super::*;

    fn log_id(index: u64) -> LogId {
        LogId::new(CommittedLeaderId::new(1, 1), index)
    }

    /// Writes blank entries straight into redb, as earlier rounds of the writer would have.
    fn put_entries(db: &Database, indexes: std::ops::RangeInclusive<u64>) {
        let txn = db.begin_write().unwrap();
        {
            let mut log = txn.open_table(LOG).unwrap();
            for i in indexes {
                let entry: Entry<TypeConfig> = Entry {
                    log_id: log_id(i),
                    payload: EntryPayload::Blank,
                };
                log.insert(i, postcard::to_allocvec(&entry).unwrap().as_slice())
                    .unwrap();
            }
        }
        txn.commit().unwrap();
    }

    /// A gate that never holds a purge.
    fn open_gate() -> SnapshotGate {
        watch::channel(Some(log_id(u64::MAX))).1
    }

    fn first_index(db: &Database) -> Option<u64> {
        let txn = db.begin_read().unwrap();
        let log = txn.open_table(LOG).unwrap();
        log.first().unwrap().map(|(k, _)| k.value())
    }

    async fn wait_first_index(db: &Database, want: Option<u64>) {
        for _ in 0..200 {
            if first_index(db) == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("log starts at {:?}, want {want:?}", first_index(db));
    }

    fn durable_committed(db: &Database) -> Option<LogId> {
        read_meta::<Option<LogId>>(db, KEY_COMMITTED)
            .unwrap()
            .flatten()
    }

    /// Goal: the committed index, which waits for a durable write to ride on (`RIDE_WAIT`), is
    /// still written when none comes. Method: report it on an otherwise idle store and read redb
    /// directly until it is there; a writer that held it for the next append would never write it.
    #[tokio::test]
    async fn a_committed_index_alone_is_written_after_the_ride_wait() {
        let dir = tempfile::tempdir().unwrap();
        let db = crate::storage::open(dir.path()).unwrap().log;
        let mut store = LogStore::new(db.clone(), open_gate());
        store.save_committed(Some(log_id(7))).await.unwrap();
        for _ in 0..500 {
            if durable_committed(&db) == Some(log_id(7)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "committed index not durable 5 s after save_committed: {:?}",
            durable_committed(&db)
        );
    }

    /// Goal: a durable write that follows the committed index carries it (or finds it written):
    /// once the vote's save returns, both are in redb, and a restart reads both back.
    #[tokio::test]
    async fn a_committed_index_is_durable_once_a_later_vote_is() {
        let dir = tempfile::tempdir().unwrap();
        let db = crate::storage::open(dir.path()).unwrap().log;
        let mut store = LogStore::new(db.clone(), open_gate());
        store.save_committed(Some(log_id(9))).await.unwrap();
        let vote = Vote::new_committed(1, 1);
        store.save_vote(&vote).await.unwrap();
        assert_eq!(durable_committed(&db), Some(log_id(9)));
        drop(store);
        let mut reopened = LogStore::new(db, open_gate());
        assert_eq!(reopened.read_committed().await.unwrap(), Some(log_id(9)));
        assert_eq!(reopened.read_vote().await.unwrap(), Some(vote));
    }

    /// Goal: a purge is recorded at once and its entries are deleted in chunks, also after a
    /// restart, while the entries after it stay readable.
    #[tokio::test]
    async fn purge_records_at_once_and_deletes_in_chunks_across_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let db = crate::storage::open(dir.path()).unwrap().log;
        put_entries(&db, 1..=1_000);
        let mut store = LogStore::new(db.clone(), open_gate());
        store.purge(log_id(600)).await.unwrap();

        let state = store.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id, Some(log_id(600)));
        assert_eq!(state.last_log_id, Some(log_id(1_000)));
        wait_first_index(&db, Some(601)).await;
        let kept = store.try_get_log_entries(601..=1_000).await.unwrap();
        assert_eq!(kept.len(), 400);
        assert_eq!(kept[0].log_id, log_id(601));

        // A crash before the deletion finished leaves old entries behind; a restart removes them.
        drop(store);
        put_entries(&db, 1..=300);
        let mut store = LogStore::new(db.clone(), open_gate());
        wait_first_index(&db, Some(601)).await;
        let state = store.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id, Some(log_id(600)));
        assert_eq!(state.last_log_id, Some(log_id(1_000)));
    }

    /// Goal: a purge past the end of the local log (a snapshot from the leader covers more than
    /// this node has) makes the purged id the last log id, not the stale end of the log.
    #[tokio::test]
    async fn purge_past_the_end_moves_the_last_log_id() {
        let dir = tempfile::tempdir().unwrap();
        let db = crate::storage::open(dir.path()).unwrap().log;
        put_entries(&db, 1..=10);
        let mut store = LogStore::new(db.clone(), open_gate());
        store.purge(log_id(50)).await.unwrap();
        let state = store.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id, Some(log_id(50)));
        assert_eq!(state.last_log_id, Some(log_id(50)));
        wait_first_index(&db, None).await;
    }

    /// Goal: a purge beyond the durable snapshot (a follower installing one from the leader) is
    /// neither recorded nor carried out until that snapshot is on disk.
    #[tokio::test]
    async fn a_purge_waits_for_the_snapshot_that_covers_it() {
        let dir = tempfile::tempdir().unwrap();
        let db = crate::storage::open(dir.path()).unwrap().log;
        put_entries(&db, 1..=100);
        let (snapshot, gate) = watch::channel(Some(log_id(20)));
        let mut store = LogStore::new(db.clone(), gate);
        store.purge(log_id(80)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(first_index(&db), Some(1));
        let recorded: Option<LogId> = read_meta(&db, KEY_LAST_PURGED).unwrap();
        assert_eq!(recorded, None);
        // Appends go on meanwhile.
        assert_eq!(
            store.get_log_state().await.unwrap().last_log_id,
            Some(log_id(100))
        );

        snapshot.send_replace(Some(log_id(80)));
        wait_first_index(&db, Some(81)).await;
        let recorded: Option<LogId> = read_meta(&db, KEY_LAST_PURGED).unwrap();
        assert_eq!(recorded, Some(log_id(80)));
    }
}

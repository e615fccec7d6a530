//! The Raft log and vote in redb.

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{Entry, LogState, RaftLogReader, StorageIOError, Vote};
use redb::{Database, ReadableDatabase, ReadableTable};

use super::{KEY_COMMITTED, KEY_LAST_PURGED, KEY_VOTE, LOG, META, blocking};
use crate::raft::{LogId, NodeId, StorageError, TypeConfig};

/// Log storage handle. Cloning shares the database; openraft uses a clone as its log reader.
#[derive(Clone)]
pub struct LogStore {
    db: Arc<Database>,
    /// The committed index openraft last reported, for Status (0 = none).
    committed: Arc<AtomicU64>,
}

impl LogStore {
    pub fn new(db: Arc<Database>) -> Self {
        LogStore {
            db,
            committed: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Shared view of the committed index, for Status.
    pub fn committed_index(&self) -> Arc<AtomicU64> {
        self.committed.clone()
    }

    fn read_meta<T: serde::de::DeserializeOwned>(&self, key: &str) -> anyhow::Result<Option<T>> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(META)?;
        match table.get(key)? {
            Some(v) => Ok(Some(postcard::from_bytes(v.value())?)),
            None => Ok(None),
        }
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
        let db = self.db.clone();
        blocking(move || {
            let txn = db.begin_read()?;
            let table = txn.open_table(LOG)?;
            let iter = match end {
                Some(end) => table.range(start..end)?,
                None => table.range(start..)?,
            };
            let mut out = Vec::new();
            for item in iter {
                let (_, v) = item?;
                out.push(postcard::from_bytes::<Entry<TypeConfig>>(v.value())?);
            }
            Ok(out)
        })
        .await
        .map_err(|e| StorageIOError::read_logs(&e).into())
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let db = self.db.clone();
        let last_purged: Option<LogId> = self
            .read_meta(KEY_LAST_PURGED)
            .map_err(|e| StorageIOError::read_logs(&io(e)))?;
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
        Ok(LogState {
            last_purged_log_id: last_purged,
            last_log_id: last.or(last_purged),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    /// Durable before it returns: a vote that is forgotten after a crash allows two leaders in
    /// one term.
    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        let db = self.db.clone();
        let bytes = encode(vote).map_err(|e| StorageIOError::write_vote(&io(e)))?;
        blocking(move || {
            let txn = db.begin_write()?;
            txn.open_table(META)?.insert(KEY_VOTE, bytes.as_slice())?;
            txn.commit()?;
            Ok(())
        })
        .await
        .map_err(|e| StorageIOError::write_vote(&e).into())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.read_meta(KEY_VOTE)
            .map_err(|e| StorageIOError::read_vote(&io(e)).into())
    }

    /// Written without its own fsync: the next append's durable commit carries it, and losing it
    /// only means replaying less on restart until the leader repeats it.
    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        if let Some(c) = committed {
            self.committed.store(c.index, Ordering::Relaxed);
        }
        let db = self.db.clone();
        let bytes = encode(&committed).map_err(|e| StorageIOError::write(&io(e)))?;
        blocking(move || {
            let mut txn = db.begin_write()?;
            txn.set_durability(redb::Durability::None)?;
            txn.open_table(META)?
                .insert(KEY_COMMITTED, bytes.as_slice())?;
            txn.commit()?;
            Ok(())
        })
        .await
        .map_err(|e| StorageIOError::write(&e).into())
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

    /// Appends and fsyncs, and only then reports the entries flushed: openraft counts them
    /// towards the quorum as soon as the callback fires.
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
        for e in entries {
            let bytes = encode(&e).map_err(|err| StorageIOError::write_logs(&io(err)))?;
            encoded.push((e.log_id.index, bytes));
        }
        let db = self.db.clone();
        let result = blocking(move || {
            let txn = db.begin_write()?;
            {
                let mut table = txn.open_table(LOG)?;
                for (index, bytes) in &encoded {
                    table.insert(index, bytes.as_slice())?;
                }
            }
            txn.commit()?;
            Ok(())
        })
        .await;
        match result {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                let err = StorageIOError::write_logs(&e);
                callback.log_io_completed(Err(e));
                Err(err.into())
            }
        }
    }

    /// Deletes entries from `log_id.index` on (a conflicting suffix).
    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let db = self.db.clone();
        blocking(move || {
            let txn = db.begin_write()?;
            {
                let mut table = txn.open_table(LOG)?;
                table.retain_in(log_id.index.., |_, _| false)?;
            }
            txn.commit()?;
            Ok(())
        })
        .await
        .map_err(|e| StorageIOError::write_logs(&e).into())
    }

    /// Deletes entries up to `log_id.index` and records `last_purged` in the same transaction,
    /// so a restart after compaction knows where the log starts.
    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let db = self.db.clone();
        let bytes = encode(&log_id).map_err(|e| StorageIOError::write_logs(&io(e)))?;
        blocking(move || {
            let txn = db.begin_write()?;
            {
                txn.open_table(META)?
                    .insert(KEY_LAST_PURGED, bytes.as_slice())?;
                let mut table = txn.open_table(LOG)?;
                table.retain_in(..=log_id.index, |_, _| false)?;
            }
            txn.commit()?;
            Ok(())
        })
        .await
        .map_err(|e| StorageIOError::write_logs(&e).into())
    }
}

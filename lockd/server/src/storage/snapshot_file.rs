//! The latest snapshot, in one plain file: `<data_dir>/snapshot.bin`.
//!
//! Layout: the magic `LKDSNAP1`, the length of the meta (u32, little endian), openraft's meta
//! (postcard), then the encoded table (the bytes a lagging follower receives). A new snapshot is
//! written to a temporary file `snapshot.bin.tmp.<n>`, synced, and renamed over the old one, so a
//! crash leaves either the old or the new snapshot whole.
//!
//! Only a restart reads the file whole (`SnapshotFile::read`). To send the snapshot to a
//! follower, `SnapshotFile::open_latest` reads the header and meta and leaves the file open
//! at the table, which the sender then reads chunk by chunk
//! ([`super::snapshot_data::SnapshotData`]). A snapshot received from the leader arrives in a
//! temporary file of its own (`SnapshotFile::create_receive_file`) and is published by
//! `SnapshotFile::write` like any other.
//!
//! The write is synced every `SYNC_EVERY` bytes rather than once at the end. An fsync on ext4
//! commits the journal together with every block allocated since the last commit: one fsync of a
//! 70 MB snapshot made the Raft log's small fsyncs wait behind it (on this node, and on a shared
//! disk on every node), which showed as AppendEntries timeouts and 1.7 s commit stalls. Syncing
//! in small steps bounds what a log fsync can be made to wait for.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use openraft::{BasicNode, SnapshotMeta};
use tokio::sync::watch;

use super::sync_dir;
use crate::raft::{LogId, NodeId};

const MAGIC: &[u8; 8] = b"LKDSNAP1";
const FILE_NAME: &str = "snapshot.bin";
pub(crate) const TMP_PREFIX: &str = "snapshot.bin.tmp.";
const SYNC_EVERY: usize = 2 * 1024 * 1024;

/// A snapshot: openraft's meta, and the encoded table.
pub(crate) struct StoredSnapshot {
    pub meta: SnapshotMeta<NodeId, BasicNode>,
    pub table: Vec<u8>,
}

/// The latest snapshot, open: its meta, and the file positioned at the first table byte.
pub(crate) struct OpenSnapshot {
    pub meta: SnapshotMeta<NodeId, BasicNode>,
    pub file: File,
    /// The offset of the first table byte in `file` (the header and meta come before it).
    pub table_start: u64,
    /// The number of table bytes, from `table_start` to the end of the file.
    pub table_len: u64,
}

/// Where a node's latest snapshot lives. Clones share the state below.
///
/// openraft builds a snapshot in a task of its own while it may install one received from the
/// leader, so two writes can overlap. Each writes its own temporary file, and the renames are
/// ordered under one lock: a snapshot older than the one already in place is dropped, so the
/// file never goes back behind a log that was purged up to the newer one.
#[derive(Clone, Debug)]
pub struct SnapshotFile {
    path: PathBuf,
    /// The last log id of the snapshot in `path`, once known; its lock orders the renames.
    published: Arc<Mutex<Option<LogId>>>,
    /// The same, for the log store: it deletes log entries only once a durable snapshot
    /// covers them.
    durable: Arc<watch::Sender<Option<LogId>>>,
    tmp_seq: Arc<AtomicU64>,
}

impl SnapshotFile {
    pub(crate) fn new(data_dir: &Path) -> Self {
        SnapshotFile {
            path: data_dir.join(FILE_NAME),
            published: Arc::new(Mutex::new(None)),
            durable: Arc::new(watch::channel(None).0),
            tmp_seq: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The last log id covered by the snapshot on disk, as it changes.
    pub fn durable(&self) -> watch::Receiver<Option<LogId>> {
        self.durable.subscribe()
    }

    fn dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }

    /// Deletes temporary files of writes a crash interrupted.
    pub(crate) fn remove_leftovers(&self) -> anyhow::Result<()> {
        let dir = self.dir();
        for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
            let path = entry?.path();
            if path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(TMP_PREFIX))
            {
                std::fs::remove_file(&path)
                    .with_context(|| format!("removing {}", path.display()))?;
            }
        }
        Ok(())
    }

    /// Records that the snapshot in place covers the log up to `last`.
    fn publish(&self, published: &mut Option<LogId>, last: Option<LogId>) {
        if last > *published {
            *published = last;
            self.durable.send_replace(last);
        }
    }

    /// The latest snapshot, read whole, or `None` if this node has none yet.
    pub(crate) fn read(&self) -> anyhow::Result<Option<StoredSnapshot>> {
        let Some(OpenSnapshot {
            meta,
            mut file,
            table_len,
            ..
        }) = self.open_latest()?
        else {
            return Ok(None);
        };
        let mut table = Vec::with_capacity(table_len as usize);
        file.read_to_end(&mut table)
            .with_context(|| format!("reading {}", self.path.display()))?;
        Ok(Some(StoredSnapshot { meta, table }))
    }

    /// The latest snapshot with only its header and meta read, or `None` if this node has none
    /// yet. Blocking, but reads only a few hundred bytes whatever the size of the table.
    pub(crate) fn open_latest(&self) -> anyhow::Result<Option<OpenSnapshot>> {
        let path = &self.path;
        let mut file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => anyhow::bail!("opening {}: {e}", path.display()),
        };
        let bad =
            |what: &str| anyhow::anyhow!("{} is not a lockd snapshot: {what}", path.display());
        let mut head = [0u8; 12];
        file.read_exact(&mut head)
            .map_err(|e| bad(&format!("reading its header: {e}")))?;
        if &head[..8] != MAGIC {
            return Err(bad("wrong magic"));
        }
        let meta_len = u32::from_le_bytes(head[8..].try_into().expect("4 bytes")) as u64;
        // The size of the file this handle has open, which stays the same if a newer snapshot
        // is renamed over the path meanwhile.
        let total = file
            .metadata()
            .with_context(|| format!("reading {}", path.display()))?
            .len();
        let table_start = head.len() as u64 + meta_len;
        if table_start > total {
            return Err(bad(&format!(
                "meta length {meta_len} past the end of the file"
            )));
        }
        let mut meta = vec![0u8; meta_len as usize];
        file.read_exact(&mut meta)
            .with_context(|| format!("reading {}", path.display()))?;
        let meta: SnapshotMeta<NodeId, BasicNode> =
            postcard::from_bytes(&meta).map_err(|e| bad(&format!("meta: {e}")))?;
        let mut published = self.published.lock().expect("snapshot lock");
        self.publish(&mut published, meta.last_log_id);
        Ok(Some(OpenSnapshot {
            meta,
            file,
            table_start,
            table_len: total - table_start,
        }))
    }

    /// Creates an empty temporary file to receive a snapshot from the leader into, and returns
    /// it with its path. Its name starts like every temporary file here, so if a crash
    /// interrupts the transfer, [`SnapshotFile::remove_leftovers`] deletes it on the next start.
    pub(crate) fn create_receive_file(&self) -> anyhow::Result<(File, PathBuf)> {
        let path = self.tmp_path();
        let file = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        Ok((file, path))
    }

    /// A fresh temporary path in the data dir. Each write and each transfer has its own, so
    /// overlapping ones never share a file.
    fn tmp_path(&self) -> PathBuf {
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        self.dir().join(format!("{TMP_PREFIX}{seq}"))
    }

    /// Replaces the latest snapshot durably: when this returns, a restart finds `stored` (or a
    /// newer snapshot).
    pub(crate) fn write(&self, stored: &StoredSnapshot) -> anyhow::Result<()> {
        self.write_with(&stored.meta, |out| Ok(out.write_all(&stored.table)?))?;
        Ok(())
    }

    /// Like `SnapshotFile::write`, with the table bytes written by `table` straight into the
    /// file (no buffer of the whole snapshot). Returns the size of the table bytes.
    pub(crate) fn write_with(
        &self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        table: impl FnOnce(&mut dyn Write) -> anyhow::Result<()>,
    ) -> anyhow::Result<u64> {
        let tmp = self.tmp_path();
        let result = self.write_tmp(&tmp, meta, table).and_then(|bytes| {
            let mut published = self.published.lock().expect("snapshot lock");
            if meta.last_log_id <= *published && published.is_some() {
                tracing::info!(
                    snapshot_id = %meta.snapshot_id,
                    "snapshot not kept: a newer one is already in place"
                );
                std::fs::remove_file(&tmp)
                    .with_context(|| format!("removing {}", tmp.display()))?;
                return Ok(bytes);
            }
            std::fs::rename(&tmp, &self.path).with_context(|| {
                format!("renaming {} to {}", tmp.display(), self.path.display())
            })?;
            sync_dir(self.dir())?;
            self.publish(&mut published, meta.last_log_id);
            Ok(bytes)
        });
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    fn write_tmp(
        &self,
        tmp: &Path,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        table: impl FnOnce(&mut dyn Write) -> anyhow::Result<()>,
    ) -> anyhow::Result<u64> {
        let context = || format!("writing {}", tmp.display());
        let meta = postcard::to_allocvec(meta)?;
        let file = File::create(tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut head = MAGIC.to_vec();
        head.extend_from_slice(&u32::try_from(meta.len())?.to_le_bytes());
        head.extend_from_slice(&meta);
        let mut out = BufWriter::with_capacity(256 * 1024, SyncingWriter::new(file));
        out.write_all(&head).with_context(context)?;
        table(&mut out).with_context(context)?;
        let file = out
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(context)?;
        file.file.sync_all().with_context(context)?;
        Ok(file.written - head.len() as u64)
    }
}

/// Writes through to a file and syncs its data every `SYNC_EVERY` bytes.
struct SyncingWriter {
    file: File,
    written: u64,
    unsynced: usize,
}

impl SyncingWriter {
    fn new(file: File) -> Self {
        SyncingWriter {
            file,
            written: 0,
            unsynced: 0,
        }
    }
}

impl Write for SyncingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.written += n as u64;
        self.unsynced += n;
        if self.unsynced >= SYNC_EVERY {
            self.file.sync_data()?;
            self.unsynced = 0;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, LogId, StoredMembership};

    use super::*;

    fn sample(table: Vec<u8>) -> StoredSnapshot {
        StoredSnapshot {
            meta: SnapshotMeta {
                last_log_id: Some(LogId::new(CommittedLeaderId::new(3, 1), 42)),
                last_membership: StoredMembership::default(),
                snapshot_id: "3-42-0".into(),
            },
            table,
        }
    }

    #[test]
    fn a_written_snapshot_reads_back_and_replaces_the_last() {
        let dir = tempfile::tempdir().unwrap();
        let file = SnapshotFile::new(dir.path());
        assert!(file.read().unwrap().is_none());

        // Larger than one sync step, and not a multiple of it.
        let big: Vec<u8> = (0..5 * SYNC_EVERY + 7).map(|i| (i % 251) as u8).collect();
        file.write(&sample(big.clone())).unwrap();
        let back = file.read().unwrap().unwrap();
        assert_eq!(back.meta.snapshot_id, "3-42-0");
        assert_eq!(back.table, big);

        // Same log id: the one in place stays.
        file.write(&sample(b"same".to_vec())).unwrap();
        assert_eq!(file.read().unwrap().unwrap().table, big);
        let mut newer = sample(b"newer".to_vec());
        newer.meta.last_log_id = Some(LogId::new(CommittedLeaderId::new(3, 1), 43));
        file.write(&newer).unwrap();
        assert_eq!(file.read().unwrap().unwrap().table, b"newer");
        assert_eq!(*file.durable().borrow(), newer.meta.last_log_id);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "temporary files left"
        );
    }

    /// Goal: a snapshot older than the one in place (a build that finished after the install
    /// of a newer snapshot from the leader) never replaces it.
    #[test]
    fn an_older_snapshot_never_replaces_a_newer_one() {
        let dir = tempfile::tempdir().unwrap();
        let file = SnapshotFile::new(dir.path());
        let mut newer = sample(b"newer".to_vec());
        newer.meta.last_log_id = Some(LogId::new(CommittedLeaderId::new(4, 2), 90));
        file.write(&newer).unwrap();
        file.write(&sample(b"older".to_vec())).unwrap();
        assert_eq!(file.read().unwrap().unwrap().table, b"newer");
        // Also across a restart, where the first thing known is the file itself.
        let reopened = SnapshotFile::new(dir.path());
        assert_eq!(reopened.read().unwrap().unwrap().table, b"newer");
        reopened.write(&sample(b"older".to_vec())).unwrap();
        assert_eq!(reopened.read().unwrap().unwrap().table, b"newer");
    }

    #[test]
    fn leftover_temporary_files_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(format!("{TMP_PREFIX}7")), b"half").unwrap();
        std::fs::write(dir.path().join("lockd.redb"), b"keep").unwrap();
        SnapshotFile::new(dir.path()).remove_leftovers().unwrap();
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("lockd.redb")]);
    }

    #[test]
    fn a_streamed_snapshot_reads_back_with_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let file = SnapshotFile::new(dir.path());
        let meta = sample(Vec::new()).meta;
        let written = file
            .write_with(&meta, |out| {
                for i in 0..3 * SYNC_EVERY as u64 {
                    out.write_all(&[(i % 7) as u8])?;
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(written, 3 * SYNC_EVERY as u64);
        let back = file.read().unwrap().unwrap();
        assert_eq!(back.table.len(), 3 * SYNC_EVERY);
        assert!(
            back.table
                .iter()
                .enumerate()
                .all(|(i, b)| *b == (i % 7) as u8)
        );
    }

    #[test]
    fn a_foreign_or_truncated_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = SnapshotFile::new(dir.path());
        std::fs::write(dir.path().join(FILE_NAME), b"not a snapshot at all").unwrap();
        let e = file.read().err().expect("an error").to_string();
        assert!(
            e.contains("snapshot.bin") && e.contains("wrong magic"),
            "{e}"
        );

        let mut cut = MAGIC.to_vec();
        cut.extend_from_slice(&1000u32.to_le_bytes());
        std::fs::write(dir.path().join(FILE_NAME), cut).unwrap();
        let e = file.read().err().expect("an error").to_string();
        assert!(e.contains("past the end"), "{e}");
    }
}

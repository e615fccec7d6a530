//! The latest snapshot, in one plain file: `<data_dir>/snapshot.bin`.
//!
//! Layout: the magic `LKDSNAP1`, the length of the meta (u32, little endian), openraft's meta
//! (postcard), then the encoded table (the bytes a lagging follower receives). A new snapshot is
//! written to `snapshot.bin.tmp`, synced, and renamed over the old one, so a crash leaves either
//! the old or the new snapshot whole.
//!
//! The write is synced every [`SYNC_EVERY`] bytes rather than once at the end. An fsync on ext4
//! commits the journal together with every block allocated since the last commit: one fsync of a
//! 70 MB snapshot made the Raft log's small fsyncs wait behind it (on this node, and on a shared
//! disk on every node), which showed as AppendEntries timeouts and 1.7 s commit stalls. Syncing
//! in small steps bounds what a log fsync can be made to wait for.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use openraft::{BasicNode, SnapshotMeta};

use crate::raft::NodeId;

const MAGIC: &[u8; 8] = b"LKDSNAP1";
const FILE_NAME: &str = "snapshot.bin";
const SYNC_EVERY: usize = 2 * 1024 * 1024;

/// A snapshot: openraft's meta, and the encoded table.
pub(crate) struct StoredSnapshot {
    pub meta: SnapshotMeta<NodeId, BasicNode>,
    pub table: Vec<u8>,
}

/// Where a node's latest snapshot lives.
#[derive(Clone, Debug)]
pub struct SnapshotFile {
    path: PathBuf,
}

impl SnapshotFile {
    pub(crate) fn new(data_dir: &Path) -> Self {
        SnapshotFile {
            path: data_dir.join(FILE_NAME),
        }
    }

    fn tmp_path(&self) -> PathBuf {
        self.path.with_extension("bin.tmp")
    }

    /// The latest snapshot, or `None` if this node has none yet.
    pub(crate) fn read(&self) -> anyhow::Result<Option<StoredSnapshot>> {
        let mut file = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => anyhow::bail!("opening {}: {e}", self.path.display()),
        };
        let bad =
            |what: &str| anyhow::anyhow!("{} is not a lockd snapshot: {what}", self.path.display());
        let mut head = [0u8; 12];
        file.read_exact(&mut head)
            .map_err(|e| bad(&format!("reading its header: {e}")))?;
        if &head[..8] != MAGIC {
            return Err(bad("wrong magic"));
        }
        let meta_len = u32::from_le_bytes(head[8..].try_into().expect("4 bytes")) as usize;
        let total = file.metadata()?.len() as usize;
        if meta_len > total.saturating_sub(head.len()) {
            return Err(bad(&format!(
                "meta length {meta_len} past the end of the file"
            )));
        }
        let mut meta = vec![0u8; meta_len];
        file.read_exact(&mut meta)?;
        let meta = postcard::from_bytes(&meta).map_err(|e| bad(&format!("meta: {e}")))?;
        let mut table = Vec::with_capacity(total - head.len() - meta_len);
        file.read_to_end(&mut table)?;
        Ok(Some(StoredSnapshot { meta, table }))
    }

    /// Replaces the latest snapshot durably: when this returns, a restart finds `stored`.
    pub(crate) fn write(&self, stored: &StoredSnapshot) -> anyhow::Result<()> {
        let meta = postcard::to_allocvec(&stored.meta)?;
        let tmp = self.tmp_path();
        let mut file =
            File::create(&tmp).map_err(|e| anyhow::anyhow!("creating {}: {e}", tmp.display()))?;
        let mut head = MAGIC.to_vec();
        head.extend_from_slice(&u32::try_from(meta.len())?.to_le_bytes());
        head.extend_from_slice(&meta);
        file.write_all(&head)?;
        for chunk in stored.table.chunks(SYNC_EVERY) {
            file.write_all(chunk)?;
            file.sync_data()?;
        }
        file.sync_all()?;
        drop(file);
        std::fs::rename(&tmp, &self.path)?;
        sync_dir(self.path.parent().unwrap_or(Path::new(".")))?;
        Ok(())
    }
}

/// Makes a rename in `dir` durable.
fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| anyhow::anyhow!("syncing directory {}: {e}", dir.display()))
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

        file.write(&sample(b"small".to_vec())).unwrap();
        assert_eq!(file.read().unwrap().unwrap().table, b"small");
        assert!(!file.tmp_path().exists());
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

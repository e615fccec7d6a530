//! openraft's `SnapshotData`: the table bytes of a snapshot, in a file rather than in memory.
//!
//! The leader sends a snapshot by seeking and reading it in chunks (openraft's `Chunked`
//! transport, `snapshot_max_chunk_size` at a time) from the replication task. Backed by
//! `snapshot.bin` itself, the table is read only as chunks go out: the state machine task that
//! hands the snapshot over reads just the header and meta, so a slow follower that needs the
//! snapshot again and again no longer makes apply wait for a whole-file read each time.
//!
//! A follower receives the chunks into a temporary file of the data dir, which
//! `install_snapshot` then decodes and publishes as `snapshot.bin` (see [`super::snapshot_file`]).

use std::io::SeekFrom;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncSeek, AsyncSeekExt, AsyncWrite, ReadBuf};

/// The table bytes of one snapshot. Offsets seen through `AsyncSeek` count from the first table
/// byte, whatever precedes it in the file.
pub struct SnapshotData {
    /// The open file; `None` for the handle a built snapshot carries (openraft 0.9 keeps only the
    /// meta of a snapshot it built, so that handle is never read).
    file: Option<tokio::fs::File>,
    /// Where the table starts in `file`: after the header and meta in `snapshot.bin`, 0 in a
    /// file being received.
    table_start: u64,
    /// The temporary file being received, deleted with this handle unless `install_snapshot`
    /// takes it over. openraft drops the handle of a transfer it gives up (the leader moved on
    /// to a newer snapshot), which must not leave files behind until the next restart.
    received: Option<RemoveOnDrop>,
}

impl SnapshotData {
    /// A handle over the table of an open `snapshot.bin`, whose table starts at `table_start`.
    ///
    /// The open file keeps its inode: if a newer snapshot is renamed over `snapshot.bin` while
    /// this one is being sent, the sender goes on reading the old table, which matches the meta
    /// it sends with it.
    pub(crate) async fn sending(file: std::fs::File, table_start: u64) -> std::io::Result<Self> {
        let mut file = tokio::fs::File::from_std(file);
        // Through tokio, not on the std file: tokio tracks the position a seek reports, and
        // starts it at 0 whatever the std file's position is.
        file.seek(SeekFrom::Start(table_start)).await?;
        Ok(SnapshotData {
            file: Some(file),
            table_start,
            received: None,
        })
    }

    /// A handle that receives a snapshot into `file`, the newly created temporary file at
    /// `path`.
    pub(crate) fn receiving(file: std::fs::File, path: PathBuf) -> Self {
        SnapshotData {
            file: Some(tokio::fs::File::from_std(file)),
            table_start: 0,
            received: Some(RemoveOnDrop(path)),
        }
    }

    /// The handle a built snapshot carries: no data (see `SnapshotBuilder::build_snapshot`).
    pub(crate) fn empty() -> Self {
        SnapshotData {
            file: None,
            table_start: 0,
            received: None,
        }
    }

    /// For a received snapshot: the file, with every write finished, and the guard that deletes
    /// it when dropped. `None` for a handle that did not receive.
    pub(crate) async fn into_received(
        self,
    ) -> std::io::Result<Option<(std::fs::File, RemoveOnDrop)>> {
        let (Some(mut file), Some(received)) = (self.file, self.received) else {
            return Ok(None);
        };
        // openraft has already shut the handle down, which flushes; flushing again costs
        // nothing and reports a failed write here rather than as a short read later.
        tokio::io::AsyncWriteExt::flush(&mut file).await?;
        Ok(Some((file.into_std().await, received)))
    }

    fn no_data() -> std::io::Error {
        std::io::Error::other("lockd: a built snapshot's handle carries no data")
    }
}

impl AsyncRead for SnapshotData {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().file {
            Some(file) => Pin::new(file).poll_read(cx, buf),
            // End of data at once.
            None => Poll::Ready(Ok(())),
        }
    }
}

impl AsyncSeek for SnapshotData {
    fn start_seek(self: Pin<&mut Self>, position: SeekFrom) -> std::io::Result<()> {
        let me = self.get_mut();
        let Some(file) = &mut me.file else {
            return Ok(());
        };
        let position = match position {
            SeekFrom::Start(n) => {
                SeekFrom::Start(me.table_start.checked_add(n).ok_or_else(|| {
                    std::io::Error::other(format!("lockd: snapshot offset {n} too large"))
                })?)
            }
            // Relative to the end or to the position: the same in file and table offsets.
            other => other,
        };
        Pin::new(file).start_seek(position)
    }

    fn poll_complete(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<u64>> {
        let me = self.get_mut();
        let Some(file) = &mut me.file else {
            return Poll::Ready(Ok(0));
        };
        let position = ready!(Pin::new(file).poll_complete(cx))?;
        Poll::Ready(position.checked_sub(me.table_start).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "lockd: seek to file offset {position}, before the snapshot table at {}",
                    me.table_start
                ),
            )
        }))
    }
}

/// Writes go to a file being received. A handle over `snapshot.bin` has it open read-only, so
/// a write there fails instead of changing the published snapshot.
impl AsyncWrite for SnapshotData {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match &mut self.get_mut().file {
            Some(file) => Pin::new(file).poll_write(cx, buf),
            None => Poll::Ready(Err(Self::no_data())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().file {
            Some(file) => Pin::new(file).poll_flush(cx),
            None => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match &mut self.get_mut().file {
            Some(file) => Pin::new(file).poll_shutdown(cx),
            None => Poll::Ready(Ok(())),
        }
    }
}

/// Deletes a temporary file when dropped. A crash skips it; `remove_leftovers` deletes such
/// files on the next start (their names begin with the same prefix).
pub(crate) struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        // An unlink, not I/O on the data: quick enough for the async task that drops it.
        if let Err(e) = std::fs::remove_file(&self.0)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %self.0.display(), error = %e, "lockd: removing a received snapshot's temporary file");
        }
    }
}

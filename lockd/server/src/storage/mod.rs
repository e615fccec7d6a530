//! Persistence in two redb files per node: `lockd.redb` holds the Raft log, the vote and the
//! committed index; `snapshot.redb` holds the latest state-machine snapshot.
//!
//! Two files because redb has one writer per database: a snapshot is megabytes, and writing it
//! into the log's database would hold up every log append (and so every commit) until its fsync.
//! The order of writes keeps the pair consistent: openraft purges log entries only after the
//! snapshot covering them is durable.
//!
//! The state machine itself lives in memory; after a restart it is rebuilt from the snapshot plus
//! the committed log entries after it, which openraft replays. Every write that openraft is told
//! is durable went through a redb commit with `Durability::Immediate` (fsync) first.

pub mod log_store;
pub mod state_machine;

use std::path::Path;
use std::sync::Arc;

use redb::{Database, TableDefinition};

/// Log entries by index, each a postcard-encoded `openraft::Entry`.
pub(crate) const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_log");
/// Small records by name: `vote`, `committed`, `last_purged` (and `snapshot` in data dirs written
/// before snapshots moved to their own file).
pub(crate) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");
/// In `snapshot.redb`: the latest snapshot, its meta and its encoded table.
pub(crate) const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
pub(crate) const KEY_SNAPSHOT_META: &str = "meta";
pub(crate) const KEY_SNAPSHOT_TABLE: &str = "table";

pub(crate) const KEY_VOTE: &str = "vote";
pub(crate) const KEY_COMMITTED: &str = "committed";
pub(crate) const KEY_LAST_PURGED: &str = "last_purged";
pub(crate) const KEY_SNAPSHOT: &str = "snapshot";

/// The node's two databases.
pub struct Databases {
    pub log: Arc<Database>,
    pub snapshots: Arc<Database>,
}

/// Opens (or creates) the node's databases in `data_dir`.
pub fn open(data_dir: &Path) -> anyhow::Result<Databases> {
    std::fs::create_dir_all(data_dir)
        .map_err(|e| anyhow::anyhow!("creating data dir {}: {e}", data_dir.display()))?;
    let log = create(&data_dir.join("lockd.redb"), LOG_CACHE_BYTES, |txn| {
        txn.open_table(LOG)?;
        txn.open_table(META)?;
        Ok(())
    })?;
    let snapshots = create(
        &data_dir.join("snapshot.redb"),
        SNAPSHOT_CACHE_BYTES,
        |txn| {
            txn.open_table(SNAPSHOTS)?;
            Ok(())
        },
    )?;
    Ok(Databases { log, snapshots })
}

/// redb caches up to 1 GiB per database by default, and counts written pages in it: a replica
/// writing 100 MB snapshots grew by hundreds of megabytes. The log is read mostly near its end
/// (fresh entries also sit in the writer's overlay), snapshots only when a node restarts or a
/// follower needs one, so small caches cost little.
const LOG_CACHE_BYTES: usize = 32 * 1024 * 1024;
const SNAPSHOT_CACHE_BYTES: usize = 4 * 1024 * 1024;

fn create(
    path: &Path,
    cache_bytes: usize,
    tables: impl FnOnce(&redb::WriteTransaction) -> Result<(), redb::TableError>,
) -> anyhow::Result<Arc<Database>> {
    let db = redb::Builder::new()
        .set_cache_size(cache_bytes)
        .create(path)
        .map_err(|e| anyhow::anyhow!("opening {}: {e}", path.display()))?;
    let txn = db.begin_write()?;
    tables(&txn)?;
    txn.commit()?;
    Ok(Arc::new(db))
}

/// Runs blocking redb work off the async workers, so an fsync never stalls other tasks.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, anyhow::Error> + Send + 'static,
) -> Result<T, std::io::Error> {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(std::io::Error::other(e.to_string())),
        Err(join) => Err(std::io::Error::other(join.to_string())),
    }
}

/// Runs snapshot work (encoding megabytes, then a large fsync) on its own thread at a lower CPU
/// priority: on a small machine it would otherwise take cores from the commit path and show up
/// as latency on every call in flight. Its result is awaited like [`blocking`].
pub(crate) async fn background<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, anyhow::Error> + Send + 'static,
) -> Result<T, std::io::Error> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("snapshot".into())
        .spawn(move || {
            lower_thread_priority();
            let _ = tx.send(f());
        })?;
    match rx.await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(std::io::Error::other(e.to_string())),
        Err(_) => Err(std::io::Error::other("the snapshot thread panicked")),
    }
}

/// Nice 10 for the calling thread (on Linux the nice value is per thread). Best effort: if it
/// fails the work runs at normal priority.
fn lower_thread_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: setpriority has no memory-safety preconditions; gettid names the calling thread.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 10);
    }
}

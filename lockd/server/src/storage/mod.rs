//! Persistence in one redb file per node: the Raft log, the vote, the committed index and the
//! latest state-machine snapshot.
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
/// Small records by name: `vote`, `committed`, `last_purged`, `snapshot_meta`, `snapshot`.
pub(crate) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");

pub(crate) const KEY_VOTE: &str = "vote";
pub(crate) const KEY_COMMITTED: &str = "committed";
pub(crate) const KEY_LAST_PURGED: &str = "last_purged";
pub(crate) const KEY_SNAPSHOT: &str = "snapshot";

/// Opens (or creates) the node's database in `data_dir`.
pub fn open(data_dir: &Path) -> anyhow::Result<Arc<Database>> {
    std::fs::create_dir_all(data_dir)
        .map_err(|e| anyhow::anyhow!("creating data dir {}: {e}", data_dir.display()))?;
    let path = data_dir.join("lockd.redb");
    let db =
        Database::create(&path).map_err(|e| anyhow::anyhow!("opening {}: {e}", path.display()))?;
    let txn = db.begin_write()?;
    txn.open_table(LOG)?;
    txn.open_table(META)?;
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

//! Persistence per node: the redb database `lockd.redb` holds the Raft log, the vote and the
//! committed index; the plain file `snapshot.bin` holds the latest state-machine snapshot.
//!
//! The snapshot is kept apart because redb has one writer per database: a snapshot is tens of
//! megabytes, and writing it into the log's database would hold up every log append (and so
//! every commit) until its fsync. A plain file also lets the snapshot be synced in small steps
//! (see `snapshot_file`). The order of writes keeps the pair consistent: openraft purges log
//! entries only after the snapshot covering them is durable.
//!
//! The state machine itself lives in memory; after a restart it is rebuilt from the snapshot plus
//! the committed log entries after it, which openraft replays. Every write that openraft is told
//! is durable was fsynced first.

pub(crate) mod log_store;
pub(crate) mod snapshot_data;
pub(crate) mod snapshot_file;
pub(crate) mod state_machine;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use redb::{Database, TableDefinition};

use snapshot_file::SnapshotFile;

/// Log entries by index, each a postcard-encoded `openraft::Entry`.
pub(crate) const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_log");
/// Small records by name: `vote`, `committed`, `last_purged`, `rejoining`, `rejoin_proof`,
/// `restore_id` (and `snapshot` in data dirs written before snapshots moved out of the log
/// database).
pub(crate) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");
/// In `snapshot.redb`, where snapshots were kept before `snapshot.bin`: the latest snapshot's
/// meta and encoded table. Read once, to move them.
pub(crate) const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
pub(crate) const KEY_SNAPSHOT_META: &str = "meta";
pub(crate) const KEY_SNAPSHOT_TABLE: &str = "table";

pub(crate) const KEY_VOTE: &str = "vote";
pub(crate) const KEY_COMMITTED: &str = "committed";
pub(crate) const KEY_LAST_PURGED: &str = "last_purged";
pub(crate) const KEY_SNAPSHOT: &str = "snapshot";
/// `true` while a node that started with an empty data dir has not caught up with a leader.
pub(crate) const KEY_REJOINING: &str = "rejoining";
/// What a rejoining node learned from its peers about its lost disk (see `raft::vote_gate`), kept
/// beside the flag so a restart while catching up does not need the peers to vouch again.
pub(crate) const KEY_REJOIN_PROOF: &str = "rejoin_proof";

/// The restore id of a node restored from a backup, or that learned it while rejoining beside
/// restored members (see `backup::restore`); kept for good.
pub(crate) const KEY_RESTORE_ID: &str = "restore_id";

/// Name of the log database in the data dir.
pub(crate) const LOG_FILE: &str = "lockd.redb";

/// Hears how long storage work took, for metrics. Called on the storage threads, once per
/// durable write batch or snapshot: it must be quick.
pub(crate) trait StorageObserver: Send + Sync + 'static {
    /// A batch of log writes (appends, vote, committed index, truncation) became durable: the
    /// redb commit, whose time is mostly its fsync.
    fn log_synced(&self, took: Duration);
}

/// Observes nothing (unit tests).
#[cfg(test)]
pub(crate) struct Unobserved;

#[cfg(test)]
impl StorageObserver for Unobserved {
    fn log_synced(&self, _: Duration) {}
}
/// The membership `lockd init` recorded: the node founds a cluster of it on its next start if
/// its log is still empty. Kept in the data dir, so a node that loses its disk loses it too.
pub(crate) const KEY_FOUNDING: &str = "founding";

/// A node's persistent state.
pub struct Databases {
    pub(crate) log: Arc<Database>,
    pub(crate) snapshots: SnapshotFile,
    /// Where snapshots were kept before `snapshot.bin` (moved on open if present).
    pub(crate) legacy_snapshot_db: PathBuf,
}

/// Opens (or creates) the node's storage in `data_dir`.
pub fn open(data_dir: &Path) -> anyhow::Result<Databases> {
    let marker = data_dir.join(crate::backup::restore::RESTORE_MARKER);
    if marker.exists() {
        anyhow::bail!(
            "data dir {} holds an interrupted `lockd restore` ({} is present): delete its \
             contents and run the restore again",
            data_dir.display(),
            marker.display()
        );
    }
    open_unmarked(data_dir)
}

/// [`open`] without the check for an interrupted restore: for `lockd restore` itself, which
/// puts the marker there first.
pub(crate) fn open_unmarked(data_dir: &Path) -> anyhow::Result<Databases> {
    create_data_dir(data_dir)?;
    let log = create(&data_dir.join(LOG_FILE), LOG_CACHE_BYTES, |txn| {
        txn.open_table(LOG)?;
        txn.open_table(META)?;
        Ok(())
    })?;
    sync_dir(data_dir)?;
    let snapshots = SnapshotFile::new(data_dir);
    snapshots.remove_leftovers()?;
    Ok(Databases {
        log,
        snapshots,
        legacy_snapshot_db: data_dir.join("snapshot.redb"),
    })
}

/// Creates `data_dir` (and missing parents) for its owner only, or restricts it to its owner,
/// and makes every new name durable.
/// Creates `dir` (and what is missing above it) for this user only, or checks that an existing
/// one is this user's and writable by nobody else: whoever may write in it could swap what a
/// node reads from it (`lockd dev --tls` writes its CA and node keys there) or rename it away.
/// A symbolic link is refused, not followed.
pub(crate) fn private_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", dir.display()))?;
    let uid = nix::unistd::geteuid().as_raw();
    if !meta.is_dir() {
        anyhow::bail!(
            "{} is not a directory (a link?): use a folder of your own",
            dir.display()
        );
    }
    if meta.uid() != uid {
        anyhow::bail!(
            "{} belongs to uid {}, not to this user (uid {uid}): use a folder of your own",
            dir.display(),
            meta.uid()
        );
    }
    if meta.mode() & 0o022 != 0 {
        anyhow::bail!(
            "{} is writable by others (mode {:o}): use a folder of your own, or chmod go-w it",
            dir.display(),
            meta.mode() & 0o7777
        );
    }
    Ok(())
}

pub(crate) fn create_data_dir(data_dir: &Path) -> anyhow::Result<()> {
    // Owner only: the log and snapshots hold every lease id and the sequencer signing key.
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    // The folders this call creates, outermost first: each new name needs its parent synced.
    let created: Vec<PathBuf> = {
        let mut missing: Vec<PathBuf> = data_dir
            .ancestors()
            .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
            .map(Path::to_path_buf)
            .collect();
        missing.reverse();
        missing
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(data_dir)
        .map_err(|e| anyhow::anyhow!("creating data dir {}: {e}", data_dir.display()))?;
    std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| {
        anyhow::anyhow!(
            "restricting data dir {} to its owner: {e}",
            data_dir.display()
        )
    })?;
    // A new name is durable only once its directory is synced: without these, a power loss
    // before the first snapshot (the first directory sync) could take the whole log and the vote
    // with it. The data dir is synced on every start (cheap), and the parent of every folder this call made.
    for dir in &created {
        match dir.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => sync_dir(parent)?,
            _ => sync_dir(Path::new("."))?,
        }
    }
    Ok(())
}

/// Makes the names in `dir` (a create, a rename) durable.
pub(crate) fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| anyhow::anyhow!("syncing directory {}: {e}", dir.display()))
}

/// redb caches up to 1 GiB per database by default, and counts written pages in it. The log is
/// read mostly near its end, where the writer's overlay serves entries not yet durable, so a small
/// cache costs little. Once the cache is full redb stops adding written pages to it (pages read
/// on a miss still replace others), so it stays full for the life of the process: memory every
/// replica holds. 2 MiB (32 before 6b9603d, then 8) measured no slower at 6,000 ops/s
/// (docs/benchmarks.md, "Memory, second step"); redb then buffers at most 1 MiB of a
/// write transaction before writing pages out, far above one batch of log entries.
const LOG_CACHE_BYTES: usize = 2 * 1024 * 1024;
/// Enough for reading a legacy `snapshot.redb` once.
const LEGACY_SNAPSHOT_CACHE_BYTES: usize = 4 * 1024 * 1024;

/// Opens a `snapshot.redb` left by an earlier version.
pub(crate) fn open_legacy_snapshot_db(path: &Path) -> anyhow::Result<Database> {
    redb::Builder::new()
        .set_cache_size(LEGACY_SNAPSHOT_CACHE_BYTES)
        .open(path)
        .map_err(|e| anyhow::anyhow!("opening {}: {e}", path.display()))
}

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
    // SAFETY: gettid and setpriority take and return plain integers: no memory-safety
    // preconditions; gettid names the calling thread.
    #[allow(
        unsafe_code,
        reason = "FFI: setpriority of one thread has no safe wrapper"
    )]
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 10);
    }
}

#[cfg(test)]
mod private_dir_tests {
    use super::private_dir;
    use std::os::unix::fs::PermissionsExt;

    /// Goal (review of the third round's fixes): `lockd dev` keeps its keys and log only in a
    /// folder this user alone may change: a folder writable by others, one of another user, and
    /// a link are refused with the path named; a new folder is made 0700; the user's own 0755
    /// folder is accepted. Method: such folders in a temporary directory (the test runs as root
    /// in CI, so the other user's folder is made by chown where allowed).
    #[test]
    fn a_folder_others_may_change_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let fresh = tmp.path().join("a/b");
        private_dir(&fresh).unwrap();
        let mode = std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);

        let shared = tmp.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = private_dir(&shared).unwrap_err().to_string();
        assert!(
            e.contains("writable by others") && e.contains("shared"),
            "{e}"
        );

        let own = tmp.path().join("own");
        std::fs::create_dir(&own).unwrap();
        std::fs::set_permissions(&own, std::fs::Permissions::from_mode(0o755)).unwrap();
        private_dir(&own).unwrap();

        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&own, &link).unwrap();
        let e = private_dir(&link).unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");

        let theirs = tmp.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        if nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(65534)), None).is_ok() {
            let e = private_dir(&theirs).unwrap_err().to_string();
            assert!(e.contains("belongs to uid 65534"), "{e}");
        }
    }
}

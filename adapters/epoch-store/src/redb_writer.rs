//! Group commit for the redb store: one thread owns the write transactions, and each durable
//! commit takes every raise that queued while the previous commit was being made durable, as
//! lockd's proposer batches Raft entries. A durable commit costs an fsync whatever it holds, so
//! one commit per admission caps the store at the disk's fsync rate (docs/benchmarks.md has the
//! figures measured for the HTTP front end).
//!
//! Every raise is answered only after the commit that holds it is durable (or, when its batch
//! changed nothing, after the read that found its token recorded); a failed commit answers
//! every raise of its batch with the error, so none of them is forwarded. So does a panic in a
//! commit: the thread goes on with the next batch, and if it ever stops all the same,
//! `RedbWriter::check` says so (the store's readiness check).

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use lockd_fence::FencingToken;
use redb::{Database, Durability, ReadableTable, ReadableTableMetadata};
use tokio::sync::{mpsc, oneshot};

use crate::redb_store::EPOCHS;

/// Most raises in one transaction: bounds the work of one commit, and so how long the first
/// raise of a batch waits for the last.
const BATCH_MAX: usize = 1024;

/// Raises queued for the commit thread at most; past it an admission waits for room (within the
/// store timeout). fence-proxy http bounds its write tasks by `--max-in-flight`, but a store may
/// serve other callers; and an admission that gave up after the store timeout leaves its raise
/// queued, to be answered into the void.
const QUEUE_MAX: usize = 4096;

/// Where the commit thread runs a test's hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// A batch was taken, outside the commit's panic catch: a panic here stops the thread.
    Batch,
    /// Inside the commit's panic catch, before the write transaction.
    Commit,
}

/// A hook the commit thread runs at each [`Phase`] (tests only: to stall or break it).
pub(crate) type Hook = Arc<dyn Fn(Phase) + Send + Sync>;

/// What became of one raise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Raised {
    /// Recorded, or found recorded at that token.
    Recorded,
    /// Refused: this higher token is recorded.
    Stale(FencingToken),
    /// Refused: the resource has no record, and the store already records its bound's worth
    /// (`--max-resources`, the `u64` given).
    Full(u64),
}

/// One admission's request to record `token` for `resource` unless a higher one is recorded.
struct Raise {
    resource: String,
    token: FencingToken,
    /// The answer: the raise's own result, or the batch's error as text.
    reply: oneshot::Sender<Result<Raised, String>>,
}

/// The commit thread and the queue to it. Dropping it lets the thread finish what is queued,
/// then waits for it, so that the database is closed when the store is gone.
pub(crate) struct RedbWriter {
    /// `None` only while dropping.
    queue: Option<mpsc::Sender<Raise>>,
    thread: Option<JoinHandle<()>>,
    /// Durable commits made, for tests and benchmarks.
    commits: Arc<AtomicU64>,
    /// Resources the table may hold at most (`--max-resources`); set after the start, read by
    /// the commit thread at each new resource.
    max_resources: Arc<AtomicU64>,
}

impl RedbWriter {
    /// Starts the commit thread on `db`; `hook` is for tests.
    pub(crate) fn start(db: Arc<Database>, hook: Option<Hook>) -> std::io::Result<Self> {
        let (queue, raises) = mpsc::channel(QUEUE_MAX);
        let commits = Arc::new(AtomicU64::new(0));
        let counted = commits.clone();
        let max_resources = Arc::new(AtomicU64::new(crate::spec::DEFAULT_MAX_RESOURCES));
        let limit = max_resources.clone();
        let thread = std::thread::Builder::new()
            .name("fence-epochs-commit".to_owned())
            .spawn(move || run(&db, raises, &counted, &limit, hook.as_deref()))?;
        Ok(RedbWriter {
            queue: Some(queue),
            thread: Some(thread),
            commits,
            max_resources,
        })
    }

    /// Sets the bound on the resources the table records.
    pub(crate) fn set_max_resources(&self, max: u64) {
        self.max_resources.store(max, Ordering::Relaxed);
    }

    /// Records `token` for `resource` unless a higher token is recorded, durably, in the next
    /// commit. The error is the text of the failure that stopped the batch (or the thread), or
    /// says that no answer came within `within` (a stalled disk): the caller must then assume
    /// the token may be recorded later, and forward nothing.
    pub(crate) async fn raise(
        &self,
        resource: &str,
        token: FencingToken,
        within: Duration,
    ) -> Result<Raised, String> {
        let (reply, answer) = oneshot::channel();
        let queue = self.queue.as_ref().expect("set until drop");
        let raise = Raise {
            resource: resource.to_owned(),
            token,
            reply,
        };
        let asked = async {
            if queue.send(raise).await.is_err() {
                return Err("the commit thread has stopped".to_owned());
            }
            answer
                .await
                .map_err(|_| "the commit thread stopped before answering".to_owned())?
        };
        tokio::time::timeout(within, asked)
            .await
            .unwrap_or_else(|_| {
                Err(format!(
                    "no durable commit within {} ms",
                    within.as_millis()
                ))
            })
    }

    /// Fails once the commit thread has stopped: every raise would fail from then on.
    pub(crate) fn check(&self) -> Result<(), String> {
        match &self.thread {
            Some(thread) if !thread.is_finished() => Ok(()),
            _ => Err(
                "the commit thread has stopped (see the log for its panic); writes are \
                      refused until the proxy is restarted"
                    .to_owned(),
            ),
        }
    }

    /// Raises waiting for the commit thread, not counting the batch being committed.
    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        let queue = self.queue.as_ref().expect("set until drop");
        queue.max_capacity() - queue.capacity()
    }

    /// Durable commits made so far.
    pub(crate) fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }
}

impl Drop for RedbWriter {
    fn drop(&mut self) {
        drop(self.queue.take());
        if let Some(thread) = self.thread.take() {
            // It ends once the queue is drained; a panic there already failed its raises.
            let _ = thread.join();
        }
    }
}

/// The commit thread: waits for a raise, takes every other one queued by then, commits them in
/// one transaction and answers each.
fn run(
    db: &Database,
    mut raises: mpsc::Receiver<Raise>,
    commits: &AtomicU64,
    max_resources: &AtomicU64,
    hook: Option<&(dyn Fn(Phase) + Send + Sync)>,
) {
    while let Some(first) = raises.blocking_recv() {
        let mut batch = vec![first];
        while batch.len() < BATCH_MAX {
            match raises.try_recv() {
                Ok(raise) => batch.push(raise),
                Err(_) => break,
            }
        }
        if let Some(hook) = hook {
            hook(Phase::Batch);
        }
        // A panic in one commit (a redb bug, say) fails its batch, not every later write: the
        // write transaction it left is aborted by its drop while unwinding.
        let decided = std::panic::catch_unwind(AssertUnwindSafe(|| {
            if let Some(hook) = hook {
                hook(Phase::Commit);
            }
            commit(
                db,
                batch.iter().map(|r| (r.resource.as_str(), r.token)),
                max_resources.load(Ordering::Relaxed),
                commits,
            )
            .map_err(|e| e.to_string())
        }))
        .unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(format!("the commit panicked: {what}"))
        });
        match decided {
            Ok(results) => {
                for (raise, result) in batch.into_iter().zip(results) {
                    // An admission that went away needs no answer.
                    let _ = raise.reply.send(Ok(result));
                }
            }
            Err(e) => {
                tracing::warn!(raises = batch.len(), error = %e, "epoch store commit failed");
                for raise in batch {
                    let _ = raise.reply.send(Err(e.clone()));
                }
            }
        }
    }
}

/// Applies `raises` in order in one write transaction and commits it durably if it changed
/// anything; returns each raise's result. A raise below the token recorded for its resource,
/// by an earlier commit or by an earlier raise of the same batch, is refused with that token;
/// a raise of a resource without a record while the table holds `max_resources` records is
/// refused as full (redb keeps a table's length in its header: counting costs nothing).
pub(crate) fn commit<'a>(
    db: &Database,
    raises: impl Iterator<Item = (&'a str, FencingToken)>,
    max_resources: u64,
    commits: &AtomicU64,
) -> Result<Vec<Raised>, redb::Error> {
    let mut txn = db.begin_write()?;
    // Immediate is redb's default; it is set here anyway because a recorded token that a crash
    // could lower would let an older write through after a newer one was forwarded.
    txn.set_durability(Durability::Immediate)?;
    let mut results = Vec::new();
    let mut changed = false;
    {
        let mut table = txn.open_table(EPOCHS)?;
        for (resource, token) in raises {
            let current = table.get(resource)?.map(|v| v.value());
            results.push(match current {
                Some(current) if current > token.0 => Raised::Stale(FencingToken(current)),
                Some(current) if current == token.0 => Raised::Recorded,
                None if table.len()? >= max_resources => Raised::Full(max_resources),
                _ => {
                    table.insert(resource, token.0)?;
                    changed = true;
                    Raised::Recorded
                }
            });
        }
    }
    if changed {
        txn.commit()?;
        commits.fetch_add(1, Ordering::Relaxed);
    } else {
        // Every token was found recorded by earlier commits, which are durable: nothing to wait
        // for.
        txn.abort()?;
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: one batch answers each raise by itself, in order: a raise, a stale one beside it,
    /// a lower token after a higher one of the same resource in the same batch, an equal one;
    /// and all of it is committed: read back after reopening the file. (In this process: this
    /// shows what was committed, not that it survives a crash; that is the `Immediate`
    /// durability set in `commit`.)
    #[test]
    fn a_batch_answers_each_raise_and_is_committed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.redb");
        let commits = AtomicU64::new(0);
        {
            let db = Database::create(&path).unwrap();
            let t = FencingToken;
            let first = commit(&db, [("a", t(10))].into_iter(), u64::MAX, &commits).unwrap();
            assert_eq!(first, [Raised::Recorded]);
            let batch = [
                ("b", t(3)),
                ("a", t(5)),
                ("c", t(7)),
                ("c", t(6)),
                ("c", t(7)),
                ("d", t(2)),
                ("d", t(4)),
                ("a", t(10)),
            ];
            let results = commit(&db, batch.into_iter(), u64::MAX, &commits).unwrap();
            assert_eq!(
                results,
                [
                    Raised::Recorded,
                    Raised::Stale(t(10)),
                    Raised::Recorded,
                    Raised::Stale(t(7)),
                    Raised::Recorded,
                    Raised::Recorded,
                    Raised::Recorded,
                    Raised::Recorded
                ]
            );
            assert_eq!(commits.load(Ordering::Relaxed), 2);
            // Nothing to change: no commit.
            let again = commit(
                &db,
                [("a", t(10)), ("b", t(1))].into_iter(),
                u64::MAX,
                &commits,
            )
            .unwrap();
            assert_eq!(again, [Raised::Recorded, Raised::Stale(t(3))]);
            assert_eq!(commits.load(Ordering::Relaxed), 2);
        }
        let db = Database::create(&path).unwrap();
        let txn = redb::ReadableDatabase::begin_read(&db).unwrap();
        let table = txn.open_table(EPOCHS).unwrap();
        for (resource, token) in [("a", 10), ("b", 3), ("c", 7), ("d", 4)] {
            assert_eq!(
                table.get(resource).unwrap().map(|v| v.value()),
                Some(token),
                "{resource}"
            );
        }
    }

    /// Goal (review of 2026-12-05, third round): the table records at most `max_resources`
    /// resources; a raise of a new one beyond the bound is refused, raises of recorded ones go
    /// on, also within one batch; a higher bound lets it in.
    #[test]
    fn a_new_resource_beyond_the_bound_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::create(dir.path().join("e.redb")).unwrap();
        let commits = AtomicU64::new(0);
        let t = FencingToken;
        let batch = [("a", t(1)), ("b", t(1)), ("c", t(1)), ("a", t(2))];
        let results = commit(&db, batch.into_iter(), 2, &commits).unwrap();
        assert_eq!(
            results,
            [
                Raised::Recorded,
                Raised::Recorded,
                Raised::Full(2),
                Raised::Recorded
            ]
        );
        let batch = [("c", t(5)), ("b", t(3)), ("b", t(0))];
        let again = commit(&db, batch.into_iter(), 2, &commits).unwrap();
        assert_eq!(
            again,
            [Raised::Full(2), Raised::Recorded, Raised::Stale(t(3))]
        );
        let raised = commit(&db, [("c", t(5))].into_iter(), 3, &commits).unwrap();
        assert_eq!(raised, [Raised::Recorded]);
    }
}

//! The embedded epoch store: one redb file, for a single proxy process.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use lockd_fence::FencingToken;
use redb::{
    Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
};
use tokio::time::Instant;

use crate::redb_writer::{Hook, Raised, RedbWriter};
use crate::slots::Share;
use crate::{Admission, EpochStore, ForwardOutcome, Permit, PermitRelease, SlotGuard, Slots};
use crate::{StoreError, Timing};

/// Resource name to the highest token accepted for it.
pub(crate) const EPOCHS: TableDefinition<&str, u64> = TableDefinition::new("fence_proxy_epochs");

/// Resource name to the end of its quarantine (milliseconds since the Unix epoch), written when
/// the proxy stops cleanly and read back when it starts: a quarantine outlives a restart.
const QUARANTINES: TableDefinition<&str, u64> = TableDefinition::new("fence_proxy_quarantines");

/// How the last process left the file: open ([`OPENED_AT`]) or closed cleanly ([`CLOSED_AT`]),
/// each as milliseconds since the Unix epoch, with [`ALL_QUARANTINED_UNTIL`] and
/// [`QUARANTINE_CAP`].
const STATE: TableDefinition<&str, u64> = TableDefinition::new("fence_proxy_state");
/// Set when a process opens the file, removed by its clean close: found at open, it means the
/// last process crashed (or was killed) and may have left writes in flight.
const OPENED_AT: &str = "opened_at_unix_ms";
/// Set by a clean close.
const CLOSED_AT: &str = "closed_at_unix_ms";
/// Set by a clean close: the boot it happened in ([`Stamp::boot`]) and the boot's clock then
/// (milliseconds of `CLOCK_BOOTTIME`). An open in the same boot measures the time since the close
/// on that clock, which no setting of the wall clock moves.
const CLOSED_BOOT: &str = "closed_boot_id";
const CLOSED_BOOTTIME: &str = "closed_boottime_ms";
/// [`CLOSED_AT`] of the close that wrote the two keys above, written by every close of this
/// version: an earlier version leaves them in place when it opens and closes the file, and its
/// close must not be measured from them.
const CLOSED_BOOT_FOR: &str = "closed_boot_for_unix_ms";
/// Set by a clean close during the quarantine of every resource that follows an unclean stop:
/// when that quarantine ends.
const ALL_QUARANTINED_UNTIL: &str = "all_quarantined_until_unix_ms";
/// Set at open and by a clean close: the longest quarantine that process could set
/// (`--upstream-timeout` + `--quarantine`, or longer while a carried one runs), so that a
/// restart with shorter settings, after a crash or not, does not cut a quarantine short.
const QUARANTINE_CAP: &str = "quarantine_cap_ms";

/// Why every write waits after an unclean stop.
const AFTER_UNCLEAN_STOP: &str = "quarantined: the last process using this store did not stop \
     cleanly, so writes it forwarded may still be applied by the upstream";

/// Epoch store in an embedded redb file.
///
/// Writes of one resource hold an in-process grant for the whole forward ([`Slots::share`]):
/// writes of the same token share it, a write of another token waits until all of them have
/// ended. The token is committed durably (fsync) before the forward starts; admissions that
/// raise tokens at the same time share one commit (group commit, [`crate::redb_writer`]). A
/// redb file is opened by one process at a time, so this store serves exactly one proxy; use
/// [`crate::PostgresStore`] for several replicas.
pub struct RedbStore {
    /// The open database; `Arc` because reads run on the blocking thread pool and writes on the
    /// commit thread.
    db: Arc<Database>,
    /// The commit thread, which records raised tokens in batches.
    writer: RedbWriter,
    /// Where the file lives, for error messages.
    path: PathBuf,
    /// Per-resource exclusion and quarantine.
    slots: Slots,
    timing: Timing,
    /// After an unclean stop: until when every resource is quarantined, since any of them may
    /// have had a write in flight when the last process died.
    reopened_quarantine: Option<Instant>,
    /// Set by [`EpochStore::close`]: admissions are refused from then on.
    closed: AtomicBool,
}

/// What [`RedbStore::open`] found about the last process that used the file.
#[derive(Debug)]
struct Reopened {
    /// It did not close cleanly (crash, kill, or a version that kept no state).
    unclean: bool,
    /// Time left of a quarantine of every resource it saved (it closed during one).
    all_quarantined: Option<Duration>,
    /// Quarantines it saved when it closed, with the time left of each.
    quarantines: Vec<(String, Duration)>,
    /// The longest quarantine this process or the last one could set: the last one's, kept in
    /// the file from its open on, and this one's.
    cap: Duration,
}

impl RedbStore {
    /// Opens or creates the file at `path` (its directory must exist).
    pub fn open(path: impl AsRef<Path>, timing: Timing) -> Result<Self, StoreError> {
        Self::open_hooked(path, timing, None)
    }

    /// [`RedbStore::open`], with a hook run by the commit thread (tests).
    fn open_hooked(
        path: impl AsRef<Path>,
        timing: Timing,
        hook: Option<Hook>,
    ) -> Result<Self, StoreError> {
        let path = path.as_ref().to_owned();
        let db = Database::create(&path).map_err(|e| StoreError::Unavailable {
            store: format!("redb:{}", path.display()),
            detail: format!("opening: {e}"),
        })?;
        let unavailable = |e: &dyn std::fmt::Display| StoreError::Unavailable {
            store: format!("redb:{}", path.display()),
            detail: e.to_string(),
        };
        // Before any admission: learn how the last process stopped and mark the file open,
        // durably, so that a crash of this process is noticed by the next.
        let reopened = reopen(&db, longest_quarantine(&timing)).map_err(|e| unavailable(&e))?;
        let cap = reopened.cap;
        let slots = Slots::new();
        for (resource, left) in &reopened.quarantines {
            slots.quarantine(resource, *left);
        }
        // After an unclean stop any resource may have had a write at the upstream, sent up to
        // just before the stop: it is waited out as this process would have waited out its own
        // (up to --upstream-timeout for the answer, then --quarantine), as the Postgres store's
        // `busy_until` does for a replica that died.
        let all_quarantined = if reopened.unclean {
            tracing::warn!(
                store = %format!("redb:{}", path.display()),
                quarantine_ms = cap.as_millis() as u64,
                "the last process using this epoch store did not stop cleanly: every resource is \
                 quarantined for --upstream-timeout + --quarantine, in case a write it forwarded \
                 is still applied"
            );
            Some(cap)
        } else {
            reopened.all_quarantined
        };
        let reopened_quarantine = all_quarantined.map(|left| Instant::now() + left);
        let db = Arc::new(db);
        let writer = RedbWriter::start(db.clone(), hook)
            .map_err(|e| unavailable(&format!("starting the commit thread: {e}")))?;
        Ok(RedbStore {
            db,
            writer,
            path,
            slots,
            timing,
            reopened_quarantine,
            closed: AtomicBool::new(false),
        })
    }

    /// The store with a bound on the resources it records (default
    /// [`crate::spec::DEFAULT_MAX_RESOURCES`]): a write of a resource without a record is
    /// refused ([`StoreError::ResourceLimit`]) once the file records `max` of them.
    pub fn with_max_resources(self, max: u64) -> Self {
        self.writer.set_max_resources(max);
        self
    }

    /// Durable commits made since the store was opened: fewer than the admissions that raised a
    /// token when they were grouped.
    pub fn commits(&self) -> u64 {
        self.writer.commits()
    }

    /// The highest token recorded for `resource`, if any.
    pub async fn highest(&self, resource: &str) -> Result<Option<FencingToken>, StoreError> {
        let db = self.db.clone();
        let resource = resource.to_owned();
        let read = tokio::task::spawn_blocking(move || -> Result<Option<u64>, redb::Error> {
            let txn = db.begin_read()?;
            let table = txn.open_table(EPOCHS)?;
            Ok(table.get(resource.as_str())?.map(|v| v.value()))
        });
        let value = read
            .await
            .map_err(|e| self.unavailable(e))?
            .map_err(|e| self.unavailable(e))?;
        Ok(value.map(FencingToken))
    }

    fn unavailable(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError::Unavailable {
            store: format!("redb:{}", self.path.display()),
            detail: e.to_string(),
        }
    }

    async fn admit_inner(
        &self,
        resource: &str,
        token: FencingToken,
    ) -> Result<Admission, StoreError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(self.unavailable("the store was closed (the proxy is stopping)"));
        }
        let started = Instant::now();
        let wait_max = self.timing.lock_wait;
        if let Some(until) = self.reopened_quarantine.filter(|until| *until > started) {
            // As a resource's own quarantine: refused at once if it outlasts the wait bound.
            if until > started + wait_max {
                return Err(StoreError::busy(
                    resource,
                    AFTER_UNCLEAN_STOP,
                    Duration::ZERO,
                    wait_max,
                ));
            }
            tokio::time::sleep_until(until).await;
        }
        let wait_left = wait_max.saturating_sub(started.elapsed());
        let mut guard = match self.slots.share(resource, token, wait_left).await? {
            Share::Granted(guard) => guard,
            Share::Stale(highest) => return Ok(Admission::Stale { highest }),
        };
        let permit = |guard| {
            Admission::Accepted(Permit::new(
                resource,
                token,
                RedbPermit {
                    guard,
                    quarantine: self.timing.quarantine,
                    dropped_quarantine: longest_quarantine(&self.timing),
                    released: false,
                },
            ))
        };
        // Another write of this token recorded it while the resource was in use: it is durable.
        if guard.recorded() {
            return Ok(permit(guard));
        }
        guard.recording();
        let decided = self
            .writer
            .raise(resource, token, self.timing.store_timeout)
            .await
            .map_err(|e| self.unavailable(e))?;
        Ok(match decided {
            Raised::Recorded => {
                guard.note_recorded(token);
                permit(guard)
            }
            Raised::Stale(highest) => {
                guard.note_recorded(highest);
                Admission::Stale { highest }
            }
            Raised::Full(limit) => {
                return Err(StoreError::ResourceLimit {
                    resource: resource.to_owned(),
                    limit,
                    store: format!("redb:{}", self.path.display()),
                });
            }
        })
    }
}

/// The release half of a redb permit: the in-process guard.
struct RedbPermit {
    guard: SlotGuard,
    /// After a forward whose outcome is unknown, counted from when the proxy gave up on it.
    quarantine: std::time::Duration,
    /// After a permit dropped unreleased: its write may have been sent just before, so the
    /// whole time the proxy would have waited for it and then quarantined it (as after an
    /// unclean stop).
    dropped_quarantine: std::time::Duration,
    /// Set by `release`. A permit dropped without it (its `Permit` was dropped where no Tokio
    /// runtime runs, so no release was spawned) quarantines the resource: nobody knows what
    /// became of its write.
    released: bool,
}

impl PermitRelease for RedbPermit {
    fn release(
        mut self: Box<Self>,
        outcome: ForwardOutcome,
    ) -> BoxFuture<'static, Result<(), StoreError>> {
        if outcome == ForwardOutcome::Unknown {
            self.guard.quarantine(self.quarantine);
        }
        self.released = true;
        drop(self);
        Box::pin(async { Ok(()) })
    }

    fn abandon(self: Box<Self>) -> BoxFuture<'static, Result<(), StoreError>> {
        // The drop quarantines for the longer period, as a permit dropped without a runtime.
        drop(self);
        Box::pin(async { Ok(()) })
    }
}

impl Drop for RedbPermit {
    fn drop(&mut self) {
        if !self.released {
            self.guard.quarantine(self.dropped_quarantine);
        }
    }
}

impl EpochStore for RedbStore {
    fn admit<'a>(
        &'a self,
        resource: &'a str,
        token: FencingToken,
    ) -> BoxFuture<'a, Result<Admission, StoreError>> {
        Box::pin(self.admit_inner(resource, token))
    }

    fn kind(&self) -> &'static str {
        "redb"
    }

    /// Yes: a dropped admission leaves its waiter's queue place (`Slots`) and, mid-record, a
    /// raise the commit thread still makes (a token recorded without a forward); the guard it
    /// held forgets what it knew and is released.
    fn admission_cancel_safe(&self) -> bool {
        true
    }

    /// Saves the quarantines still running and marks the file closed cleanly, in one durable
    /// commit, unless a write is still held or waited for (the drain did not end): then the
    /// file stays marked open, and the next process quarantines every resource.
    fn close(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            self.closed.store(true, Ordering::Release);
            // One step: nothing is granted after the table was found idle.
            let Ok(quarantines) = self.slots.close() else {
                return Err(self.unavailable(
                    "writes were still in flight when the store was closed; the next start \
                     quarantines every resource",
                ));
            };
            let all_quarantined = self
                .reopened_quarantine
                .and_then(|until| until.checked_duration_since(Instant::now()));
            // This process's longest, or longer if a quarantine it carried from the process
            // before runs longer: a restart with shorter settings shrinks the cap once those
            // are over.
            let longest_left = quarantines
                .iter()
                .map(|(_, left)| *left)
                .chain(all_quarantined)
                .max()
                .unwrap_or_default();
            let saved = Saved {
                quarantines,
                all_quarantined,
                cap: longest_quarantine(&self.timing).max(longest_left),
            };
            let db = self.db.clone();
            let done = tokio::task::spawn_blocking(move || save_and_close(&db, &saved))
                .await
                .map_err(|e| self.unavailable(format!("closing: {e}")))?;
            done.map_err(|e| self.unavailable(format!("closing: {e}")))
        })
    }

    /// Fails when the commit thread has stopped (no write could be admitted), then opens a
    /// read transaction on the table (on the blocking pool, as every file access here): it
    /// fails when the file can no longer be read.
    fn check(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        let db = self.db.clone();
        Box::pin(async move {
            self.writer.check().map_err(|e| self.unavailable(e))?;
            let read = tokio::task::spawn_blocking(move || -> Result<(), redb::Error> {
                db.begin_read()?.open_table(EPOCHS)?;
                Ok(())
            })
            .await;
            match read {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(self.unavailable(e)),
                Err(e) => Err(self.unavailable(format!("checking: {e}"))),
            }
        })
    }
}

/// The clocks a close and the next open compare: the wall clock (kept in the file for people and
/// for files of earlier versions) and, where Linux provides them, the boot and its own clock.
#[derive(Clone, Copy, Debug)]
struct Stamp {
    /// Milliseconds since the Unix epoch, by the wall clock.
    unix_ms: u64,
    /// The first 64 bits of the kernel's boot id: equal for two processes of one boot.
    boot: Option<u64>,
    /// Milliseconds of `CLOCK_BOOTTIME`: monotonic through the whole boot, suspend included, and
    /// not moved by the wall clock (NTP steps, an operator's `date -s`).
    boottime_ms: Option<u64>,
}

impl Stamp {
    fn now() -> Stamp {
        let unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()
            .and_then(|id| boot_prefix(&id));
        let boottime_ms = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
            .ok()
            .map(|t| Duration::from(t).as_millis() as u64);
        Stamp {
            unix_ms,
            boot,
            boottime_ms,
        }
    }

    /// How long ago a clean close at `closed` was, as far as it can be known for certain: on the
    /// boot's clock when both are of this boot; zero after a reboot or where either boot clock
    /// is unknown (the wall clock is the only clock left, and one set forward would cut a
    /// quarantine short: waiting it out again costs at most one quarantine); by the wall clock
    /// for a close by the version before, which kept nothing else.
    fn since(&self, closed: &ClosedAt) -> Duration {
        let ms = match closed.clock {
            CloseClock::Boot { boot, boottime_ms } => match (self.boot, self.boottime_ms) {
                (Some(b), Some(now)) if b == boot => now.saturating_sub(boottime_ms),
                _ => 0,
            },
            CloseClock::Unknown => 0,
            CloseClock::WallOnly => self.unix_ms.saturating_sub(closed.unix_ms),
        };
        Duration::from_millis(ms)
    }
}

/// The first 16 hex digits of a boot id (`/proc/sys/kernel/random/boot_id`, a UUID).
fn boot_prefix(id: &str) -> Option<u64> {
    let hex: String = id.trim().chars().filter(|c| *c != '-').take(16).collect();
    (hex.len() == 16)
        .then(|| u64::from_str_radix(&hex, 16).ok())
        .flatten()
}

/// What a clean close left in the file about when it happened.
#[derive(Clone, Copy, Debug)]
struct ClosedAt {
    /// [`CLOSED_AT`].
    unix_ms: u64,
    clock: CloseClock,
}

/// The clock a close can be measured from.
#[derive(Clone, Copy, Debug)]
enum CloseClock {
    /// Its boot and the boot's clock then.
    Boot { boot: u64, boottime_ms: u64 },
    /// None: the close had no boot clock, or the boot keys are of another close.
    Unknown,
    /// The wall clock: a close by the version before, which wrote no boot keys.
    WallOnly,
}

/// The longest a resource can stay closed after a write of this process: its answer waited
/// for, then the quarantine.
fn longest_quarantine(timing: &Timing) -> Duration {
    timing.forward_timeout + timing.quarantine
}

/// What a clean close writes.
struct Saved {
    /// Each quarantined resource with the time it has left.
    quarantines: Vec<(String, Duration)>,
    /// Time left of the quarantine of every resource after an unclean stop, if one runs.
    all_quarantined: Option<Duration>,
    /// [`longest_quarantine`] of the closing process.
    cap: Duration,
}

/// Reads how the last process left the file and marks it open, in one durable commit. Saved
/// quarantines are taken out of the file (this process saves its own at close); each keeps the
/// time it had left at the close less the time since ([`Stamp::since`]), capped at the longer of
/// `cap` and the closing process's cap, so that a restart with shorter settings does not cut
/// one short and a file of an earlier version, whose ends are wall-clock times, cannot close a
/// resource for longer when the clock was set back.
fn reopen(db: &Database, cap: Duration) -> Result<Reopened, redb::Error> {
    reopen_at(db, cap, &Stamp::now())
}

/// [`reopen`] at the time `now`.
fn reopen_at(db: &Database, cap: Duration, now: &Stamp) -> Result<Reopened, redb::Error> {
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)?;
    let reopened = {
        // Created now too, so that a read before the first write finds the table.
        let epochs = txn.open_table(EPOCHS)?;
        let mut state = txn.open_table(STATE)?;
        let mut saved = txn.open_table(QUARANTINES)?;
        // Every forward records its token first, so a file without tokens never had a write
        // forwarded. One with tokens but no state was written by a version that kept none: it
        // may have crashed.
        let unclean = !epochs.is_empty()?
            && (state.get(OPENED_AT)?.is_some() || state.get(CLOSED_AT)?.is_none());
        let cap = state
            .get(QUARANTINE_CAP)?
            .map_or(cap, |c| cap.max(Duration::from_millis(c.value())));
        let closed = match state.get(CLOSED_AT)?.map(|at| at.value()) {
            Some(unix_ms) => {
                let boot_for = state.get(CLOSED_BOOT_FOR)?.map(|v| v.value());
                let boot = state.get(CLOSED_BOOT)?.map(|v| v.value());
                let boottime_ms = state.get(CLOSED_BOOTTIME)?.map(|v| v.value());
                let clock = match (boot_for, boot, boottime_ms) {
                    (None, None, None) => CloseClock::WallOnly,
                    (Some(at), Some(boot), Some(boottime_ms)) if at == unix_ms => {
                        CloseClock::Boot { boot, boottime_ms }
                    }
                    // Without a boot clock at the close, or keys an earlier version left from
                    // another close (it was run on the file since).
                    _ => CloseClock::Unknown,
                };
                Some(ClosedAt { unix_ms, clock })
            }
            None => None,
        };
        // Saved ends are wall-clock times of the close: what was left then is `until - closed
        // at`, whatever the wall clock says now.
        let left = |until: u64| {
            let left = match &closed {
                Some(closed) => Duration::from_millis(until.saturating_sub(closed.unix_ms))
                    .saturating_sub(now.since(closed)),
                None => Duration::from_millis(until.saturating_sub(now.unix_ms)),
            };
            Some(left.min(cap)).filter(|left| !left.is_zero())
        };
        let all_quarantined = state
            .get(ALL_QUARANTINED_UNTIL)?
            .and_then(|until| left(until.value()));
        let mut quarantines = Vec::new();
        for row in saved.iter()? {
            let (resource, until) = row?;
            if let Some(left) = left(until.value()) {
                quarantines.push((resource.value().to_owned(), left));
            }
        }
        saved.retain(|_, _| false)?;
        for key in [
            CLOSED_AT,
            CLOSED_BOOT,
            CLOSED_BOOTTIME,
            CLOSED_BOOT_FOR,
            ALL_QUARANTINED_UNTIL,
        ] {
            state.remove(key)?;
        }
        state.insert(OPENED_AT, now.unix_ms)?;
        // Kept while the file is open: if this process crashes, the next one waits out the
        // longest quarantine either could have set.
        state.insert(QUARANTINE_CAP, cap.as_millis() as u64)?;
        Reopened {
            unclean,
            all_quarantined,
            quarantines,
            cap,
        }
    };
    txn.commit()?;
    Ok(reopened)
}

/// Writes what a clean close saves and marks the file closed, durably.
fn save_and_close(db: &Database, saved: &Saved) -> Result<(), redb::Error> {
    save_and_close_at(db, saved, &Stamp::now())
}

/// [`save_and_close`] at the time `stamp`.
fn save_and_close_at(db: &Database, saved: &Saved, stamp: &Stamp) -> Result<(), redb::Error> {
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)?;
    let now = stamp.unix_ms;
    // Rounded up: a quarantine is never shortened by the save.
    let until = |left: &Duration| now + left.as_nanos().div_ceil(1_000_000) as u64;
    {
        let mut table = txn.open_table(QUARANTINES)?;
        table.retain(|_, _| false)?;
        for (resource, left) in &saved.quarantines {
            table.insert(resource.as_str(), until(left))?;
        }
        let mut state = txn.open_table(STATE)?;
        state.remove(OPENED_AT)?;
        state.remove(ALL_QUARANTINED_UNTIL)?;
        if let Some(left) = &saved.all_quarantined {
            state.insert(ALL_QUARANTINED_UNTIL, until(left))?;
        }
        state.insert(QUARANTINE_CAP, saved.cap.as_millis() as u64)?;
        state.insert(CLOSED_AT, now)?;
        state.remove(CLOSED_BOOT)?;
        state.remove(CLOSED_BOOTTIME)?;
        if let (Some(boot), Some(boottime)) = (stamp.boot, stamp.boottime_ms) {
            state.insert(CLOSED_BOOT, boot)?;
            state.insert(CLOSED_BOOTTIME, boottime)?;
        }
        // Also without a boot clock: boot keys an earlier close left are then not this one's.
        state.insert(CLOSED_BOOT_FOR, now)?;
    }
    txn.commit()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redb_writer::Phase;

    fn timing() -> Timing {
        Timing {
            lock_wait: Duration::from_millis(200),
            forward_timeout: Duration::from_millis(100),
            quarantine: Duration::from_millis(300),
            ..Timing::default()
        }
    }

    async fn accepted(store: &RedbStore, r: &str, t: u64) -> Permit {
        match store.admit(r, FencingToken(t)).await.unwrap() {
            Admission::Accepted(p) => p,
            Admission::Stale { highest } => panic!("{r}:{t} stale, highest {highest}"),
        }
    }

    #[tokio::test]
    async fn check_answers_on_an_open_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStore::open(dir.path().join("epochs.redb"), timing()).unwrap();
        store.check().await.unwrap();
    }

    #[tokio::test]
    async fn records_and_rejects_lower_tokens_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("epochs.redb");
        {
            let store = RedbStore::open(&path, timing()).unwrap();
            let p = accepted(&store, "a", 7).await;
            p.release(ForwardOutcome::Answered).await.unwrap();
            let p = accepted(&store, "a", 7).await;
            p.release(ForwardOutcome::Answered).await.unwrap();
            match store.admit("a", FencingToken(6)).await.unwrap() {
                Admission::Stale { highest } => assert_eq!(highest, FencingToken(7)),
                Admission::Accepted(p) => panic!("6 accepted after 7: {p:?}"),
            }
        }
        let store = RedbStore::open(&path, timing()).unwrap();
        assert_eq!(store.highest("a").await.unwrap(), Some(FencingToken(7)));
        assert_eq!(store.highest("b").await.unwrap(), None);
    }

    /// A hook that stalls the commit thread in its `nth` commit (0 = the first) until told to
    /// go on; `entered` says that it is stalled.
    struct Stall {
        hook: Hook,
        entered: std::sync::mpsc::Receiver<()>,
        go: std::sync::mpsc::Sender<()>,
    }

    fn stall_commit(nth: usize) -> Stall {
        let (entered_tx, entered) = std::sync::mpsc::channel();
        let (go, go_rx) = std::sync::mpsc::channel::<()>();
        let seen = std::sync::atomic::AtomicUsize::new(0);
        let stall = std::sync::Mutex::new(Some((entered_tx, go_rx)));
        let hook: Hook = Arc::new(move |phase| {
            if phase != Phase::Commit || seen.fetch_add(1, Ordering::SeqCst) != nth {
                return;
            }
            if let Some((entered, go)) = stall.lock().unwrap().take() {
                entered.send(()).unwrap();
                // Bounded, so that a failing test cannot hang the store's drop (it joins).
                let _ = go.recv_timeout(Duration::from_secs(30));
            }
        });
        Stall { hook, entered, go }
    }

    /// Goal (issue 17, group commit): admissions that raise tokens of distinct resources while
    /// a commit is being made share the next one, each gets its own answer (a stale one among
    /// them is refused with the highest token), and every accepted token is read back after
    /// reopening. The commit thread is held in a commit until all of them have queued, so the
    /// count does not depend on how fast the disk syncs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_raises_share_commits() {
        const RESOURCES: u64 = 64;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.redb");
        {
            // Commit 0 records "old"; commit 1 ("busy") is held while the others queue.
            let stall = stall_commit(1);
            let store =
                Arc::new(RedbStore::open_hooked(&path, timing(), Some(stall.hook)).unwrap());
            accepted(&store, "old", 10)
                .await
                .release(ForwardOutcome::Answered)
                .await
                .unwrap();
            let before = store.commits();
            let busy = tokio::spawn({
                let store = store.clone();
                async move {
                    accepted(&store, "busy", 1)
                        .await
                        .release(ForwardOutcome::Answered)
                        .await
                }
            });
            let entered = stall.entered;
            tokio::task::spawn_blocking(move || entered.recv().unwrap())
                .await
                .unwrap();
            let mut tasks = tokio::task::JoinSet::new();
            for i in 0..RESOURCES {
                let store = store.clone();
                tasks.spawn(async move {
                    let (resource, token) = if i == RESOURCES / 2 {
                        ("old".to_owned(), 5)
                    } else {
                        (format!("r{i}"), i + 1)
                    };
                    let admission = store.admit(&resource, FencingToken(token)).await.unwrap();
                    let answer = match admission {
                        Admission::Accepted(p) => {
                            p.release(ForwardOutcome::Answered).await.unwrap();
                            None
                        }
                        Admission::Stale { highest } => Some(highest),
                    };
                    (resource, token, answer)
                });
            }
            let t0 = std::time::Instant::now();
            while store.writer.queued() < RESOURCES as usize {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "{} of {RESOURCES} raises queued",
                    store.writer.queued()
                );
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            stall.go.send(()).unwrap();
            busy.await.unwrap().unwrap();
            while let Some(done) = tasks.join_next().await {
                let (resource, token, answer) = done.unwrap();
                let expected = (resource == "old").then_some(FencingToken(10));
                assert_eq!(answer, expected, "{resource}:{token}");
            }
            // "busy", then one commit for all the queued raises.
            assert_eq!(store.commits() - before, 2);
        }
        let store = RedbStore::open(&path, timing()).unwrap();
        assert_eq!(store.highest("old").await.unwrap(), Some(FencingToken(10)));
        for i in (0..RESOURCES).filter(|i| *i != RESOURCES / 2) {
            assert_eq!(
                store.highest(&format!("r{i}")).await.unwrap(),
                Some(FencingToken(i + 1)),
                "r{i}"
            );
        }
    }

    /// Goal (review L1): a commit that does not come back (a stalled disk) fails the admission
    /// within the store timeout instead of holding it, and its grant, for as long as the disk
    /// stalls; the table forgets what it knew, since the token may be recorded later.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_commit_fails_the_admission_within_the_store_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let stall = stall_commit(0);
        let timing = Timing {
            store_timeout: Duration::from_millis(200),
            ..timing()
        };
        let store =
            RedbStore::open_hooked(dir.path().join("e.redb"), timing, Some(stall.hook)).unwrap();
        let t0 = std::time::Instant::now();
        let admitted =
            tokio::time::timeout(Duration::from_secs(5), store.admit("a", FencingToken(5)))
                .await
                .expect("the admission waited for the stalled commit");
        let err = admitted.unwrap_err();
        assert!(matches!(err, StoreError::Unavailable { .. }), "{err}");
        assert!(
            err.to_string().contains("no durable commit within 200 ms"),
            "{err}"
        );
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        assert!(
            store.slots.is_empty(),
            "the grant outlived its failed admission"
        );
        // The disk comes back: the late commit recorded 5, which the store now enforces.
        stall.go.send(()).unwrap();
        accepted(&store, "a", 5)
            .await
            .release(ForwardOutcome::Answered)
            .await
            .unwrap();
        match store.admit("a", FencingToken(4)).await.unwrap() {
            Admission::Stale { highest } => assert_eq!(highest, FencingToken(5)),
            Admission::Accepted(p) => panic!("4 accepted after 5: {p:?}"),
        }
    }

    /// Goal (review M1): a panic in one commit fails that batch's admissions only; the commit
    /// thread goes on, later writes are admitted and the readiness check stays green.
    #[tokio::test]
    async fn a_panicking_commit_fails_its_batch_only() {
        let dir = tempfile::tempdir().unwrap();
        let once = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let hook: Hook = Arc::new(move |phase| {
            if phase == Phase::Commit && once.swap(false, Ordering::SeqCst) {
                panic!("injected commit failure");
            }
        });
        let store =
            RedbStore::open_hooked(dir.path().join("e.redb"), timing(), Some(hook)).unwrap();
        let err = store.admit("a", FencingToken(5)).await.unwrap_err();
        assert!(err.to_string().contains("injected commit failure"), "{err}");
        accepted(&store, "a", 5)
            .await
            .release(ForwardOutcome::Answered)
            .await
            .unwrap();
        store.check().await.unwrap();
    }

    /// Goal (review M1): once the commit thread has stopped, every write fails, and the
    /// readiness check says so instead of staying green.
    #[tokio::test]
    async fn check_fails_once_the_commit_thread_has_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let hook: Hook = Arc::new(|phase| {
            if phase == Phase::Batch {
                panic!("injected: the commit thread dies");
            }
        });
        let store =
            RedbStore::open_hooked(dir.path().join("e.redb"), timing(), Some(hook)).unwrap();
        let err = store.admit("a", FencingToken(5)).await.unwrap_err();
        assert!(matches!(err, StoreError::Unavailable { .. }), "{err}");
        // The thread is finishing its unwinding; give it a moment to be reported finished.
        let t0 = std::time::Instant::now();
        let err = loop {
            match store.check().await {
                Err(e) => break e,
                Ok(()) if t0.elapsed() < Duration::from_secs(5) => {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                Ok(()) => panic!("check green with the commit thread gone"),
            }
        };
        assert!(
            err.to_string().contains("commit thread has stopped"),
            "{err}"
        );
    }

    /// Goal (review, HIGH): a quarantine running at a clean close is saved and holds after the
    /// file is opened again, for the time it had left; other resources are open at once.
    #[tokio::test]
    async fn a_quarantine_outlives_a_clean_close() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.redb");
        // Seconds, so that a slow disk on a loaded machine cannot end it before it is checked.
        let timing = Timing {
            quarantine: Duration::from_secs(3),
            ..timing()
        };
        {
            let store = RedbStore::open(&path, timing).unwrap();
            accepted(&store, "a", 1)
                .await
                .release(ForwardOutcome::Unknown)
                .await
                .unwrap();
            store.close().await.unwrap();
            let err = store.admit("b", FencingToken(1)).await.unwrap_err();
            assert!(err.to_string().contains("the store was closed"), "{err}");
        }
        let reopened = std::time::Instant::now();
        let store = RedbStore::open(&path, timing).unwrap();
        let err = store.admit("a", FencingToken(2)).await.unwrap_err();
        assert!(
            err.to_string().contains("quarantined after a forward"),
            "{err}"
        );
        accepted(&store, "b", 1)
            .await
            .release(ForwardOutcome::Answered)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(3).saturating_sub(reopened.elapsed())).await;
        accepted(&store, "a", 2)
            .await
            .release(ForwardOutcome::Answered)
            .await
            .unwrap();
        // Nothing ran when this one closed: the next open finds no quarantine and a clean stop.
        store.close().await.unwrap();
        drop(store);
        let store = RedbStore::open(&path, timing).unwrap();
        assert!(store.reopened_quarantine.is_none());
        accepted(&store, "a", 3)
            .await
            .release(ForwardOutcome::Answered)
            .await
            .unwrap();
    }

    /// Goal (review, HIGH): a file that was not closed cleanly (the process crashed or was
    /// killed: here, dropped without `close`) quarantines every resource when it is opened
    /// again, since any of them may have had a write in flight.
    #[tokio::test]
    async fn an_unclean_stop_quarantines_every_resource() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.redb");
        {
            let store = RedbStore::open(&path, timing()).unwrap();
            assert!(store.reopened_quarantine.is_none(), "a new file is clean");
            accepted(&store, "a", 1)
                .await
                .release(ForwardOutcome::Answered)
                .await
                .unwrap();
        }
        let reopened = std::time::Instant::now();
        let timing = Timing {
            quarantine: Duration::from_secs(2),
            ..timing()
        };
        let store = RedbStore::open(&path, timing).unwrap();
        // The quarantine (forward timeout 100 ms + quarantine 2 s) outlasts the wait bound
        // (200 ms): refused at once, any resource.
        for resource in ["a", "never-written"] {
            let err = store.admit(resource, FencingToken(5)).await.unwrap_err();
            assert!(matches!(err, StoreError::Busy { .. }), "{err}");
            assert!(err.to_string().contains("did not stop cleanly"), "{err}");
        }
        tokio::time::sleep(Duration::from_millis(2100).saturating_sub(reopened.elapsed())).await;
        accepted(&store, "a", 5)
            .await
            .release(ForwardOutcome::Answered)
            .await
            .unwrap();
    }

    /// Goal: a close while a write still holds its resource (the drain gave up) does not mark
    /// the file clean: the next open quarantines every resource.
    #[tokio::test]
    async fn a_close_with_a_write_in_flight_is_not_clean() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.redb");
        {
            let store = RedbStore::open(&path, timing()).unwrap();
            let held = accepted(&store, "a", 1).await;
            let err = store.close().await.unwrap_err();
            assert!(err.to_string().contains("still in flight"), "{err}");
            drop(held);
        }
        let store = RedbStore::open(&path, timing()).unwrap();
        assert!(store.reopened_quarantine.is_some());
    }

    /// Goal (review): a clean close during the quarantine of every resource that follows an
    /// unclean stop saves it: SIGTERM soon after a crash restart must not open everything.
    #[tokio::test]
    async fn a_close_during_the_quarantine_after_an_unclean_stop_saves_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.redb");
        let timing = Timing {
            quarantine: Duration::from_secs(30),
            ..timing()
        };
        {
            let store = RedbStore::open(&path, timing).unwrap();
            accepted(&store, "a", 1)
                .await
                .release(ForwardOutcome::Answered)
                .await
                .unwrap();
        }
        // Not closed: unclean. This one closes cleanly, at once, while the quarantine runs.
        let store = RedbStore::open(&path, timing).unwrap();
        assert!(store.reopened_quarantine.is_some());
        store.close().await.unwrap();
        drop(store);
        let store = RedbStore::open(&path, timing).unwrap();
        let left = store
            .reopened_quarantine
            .expect("the quarantine of every resource was lost at the clean close")
            .duration_since(Instant::now());
        assert!(left > Duration::from_secs(20), "{left:?}");
        let err = store.admit("x", FencingToken(1)).await.unwrap_err();
        assert!(err.to_string().contains("did not stop cleanly"), "{err}");
    }

    /// Goal (third review): after a crash, every resource is quarantined for the longest either
    /// process could set: the crashed one's cap is in the file from its open on, so a restart
    /// with shorter settings does not shorten what the crashed process's writes are owed.
    #[tokio::test]
    async fn the_quarantine_after_a_crash_follows_the_crashed_process_settings() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.redb");
        let long = Timing {
            quarantine: Duration::from_secs(30),
            ..timing()
        };
        {
            let store = RedbStore::open(&path, long).unwrap();
            accepted(&store, "a", 1)
                .await
                .release(ForwardOutcome::Answered)
                .await
                .unwrap();
        }
        // Dropped without close: a crash. The next process has a 400 ms longest quarantine.
        let store = RedbStore::open(&path, timing()).unwrap();
        let left = store
            .reopened_quarantine
            .expect("unclean")
            .duration_since(Instant::now());
        assert!(left > Duration::from_secs(20), "{left:?}");
    }

    /// A redb file in `dir` with a token recorded (a file without any is clean whatever its
    /// state says).
    fn file_with_a_token(dir: &tempfile::TempDir) -> Database {
        let db = Database::create(dir.path().join("e.redb")).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(EPOCHS).unwrap().insert("a", 1).unwrap();
        txn.commit().unwrap();
        db
    }

    /// Goal: a wall clock set back between a close and the next open cannot stretch a saved
    /// quarantine past the longest either process could set, and a restart with shorter
    /// settings does not cut one short.
    #[test]
    fn saved_quarantines_are_capped_at_the_longest_either_process_sets() {
        let dir = tempfile::tempdir().unwrap();
        let db = file_with_a_token(&dir);
        let hour = Duration::from_secs(3600);
        let minute = Duration::from_secs(60);
        let saved = Saved {
            quarantines: vec![
                ("a".to_owned(), hour),
                ("b".to_owned(), Duration::ZERO),
                ("c".to_owned(), Duration::from_secs(30)),
            ],
            all_quarantined: Some(hour),
            cap: minute,
        };
        save_and_close(&db, &saved).unwrap();
        let reopened = reopen(&db, Duration::from_secs(10)).unwrap();
        assert!(!reopened.unclean);
        let mut left = reopened.quarantines.clone();
        left.sort();
        assert_eq!(left.len(), 2, "{left:?}");
        assert_eq!((left[0].0.as_str(), left[0].1), ("a", minute));
        assert_eq!(left[1].0, "c");
        assert!(left[1].1 > Duration::from_secs(29), "cut short: {left:?}");
        assert_eq!(reopened.all_quarantined, Some(minute));
        // Taken out of the file: a crash now leaves no stale copy (the unclean stop covers it).
        let again = reopen(&db, Duration::from_secs(10)).unwrap();
        assert!(again.unclean && again.quarantines.is_empty() && again.all_quarantined.is_none());
    }

    /// Goal: the time left of a saved quarantine is measured on the boot's clock when the close
    /// and the open are of one boot, whatever the wall clock did between them; after a reboot
    /// (or where the boot is unknown) the whole time left at the close is waited again; a file
    /// closed by an earlier version (wall-clock ends only) keeps the wall-clock rule.
    #[test]
    fn saved_quarantines_count_time_on_the_boot_clock() {
        let minute = Duration::from_secs(60);
        let at = |unix_ms: u64, boot: Option<u64>, boottime_ms: Option<u64>| Stamp {
            unix_ms,
            boot,
            boottime_ms,
        };
        let closing = at(10_000_000, Some(7), Some(50_000));
        // Opened 10 s later by the boot's clock, with the wall clock an hour ahead, an hour
        // behind, and right; then after a reboot, and with no boot clock now or at the close.
        let cases: [(&str, Stamp, Stamp, Duration); 6] = [
            (
                "wall clock an hour ahead",
                closing,
                at(10_000_000 + 3_610_000, Some(7), Some(60_000)),
                Duration::from_secs(20),
            ),
            (
                "wall clock an hour behind",
                closing,
                at(10_000_000 - 3_590_000, Some(7), Some(60_000)),
                Duration::from_secs(20),
            ),
            (
                "wall clock right",
                closing,
                at(10_010_000, Some(7), Some(60_000)),
                Duration::from_secs(20),
            ),
            (
                "after a reboot",
                closing,
                at(10_000_000 + 3_610_000, Some(8), Some(1_000)),
                Duration::from_secs(30),
            ),
            (
                "no boot clock now",
                closing,
                at(10_000_000 + 3_610_000, None, None),
                Duration::from_secs(30),
            ),
            (
                "no boot clock at the close",
                at(10_000_000, None, None),
                at(10_010_000, Some(7), Some(60_000)),
                Duration::from_secs(30),
            ),
        ];
        for (what, close, open, expected) in cases {
            let dir = tempfile::tempdir().unwrap();
            let db = file_with_a_token(&dir);
            let saved = Saved {
                quarantines: vec![("a".to_owned(), Duration::from_secs(30))],
                all_quarantined: Some(Duration::from_secs(30)),
                cap: minute,
            };
            save_and_close_at(&db, &saved, &close).unwrap();
            let reopened = reopen_at(&db, minute, &open).unwrap();
            assert!(!reopened.unclean, "{what}");
            assert_eq!(
                reopened.quarantines,
                vec![("a".to_owned(), expected)],
                "{what}"
            );
            assert_eq!(reopened.all_quarantined, Some(expected), "{what}");
        }
        // Files the version before (12e96d6, wall-clock ends only) closed, written by hand as
        // it writes them: one it alone closed keeps the wall-clock rule; one this version closed,
        // then it opened and closed (a rollback) leaves this version's boot keys behind, which
        // must not measure its close (review: an hour of boot clock cut its quarantine to 0).
        for (what, new_close_first, expected) in [
            (
                "closed by the version before only",
                false,
                Duration::from_secs(20),
            ),
            (
                "closed by it after this version",
                true,
                Duration::from_secs(30),
            ),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let db = file_with_a_token(&dir);
            if new_close_first {
                let saved = Saved {
                    quarantines: Vec::new(),
                    all_quarantined: None,
                    cap: minute,
                };
                save_and_close_at(&db, &saved, &closing).unwrap();
                // The version before opens it: it knows nothing of the boot keys.
                let txn = db.begin_write().unwrap();
                {
                    let mut state = txn.open_table(STATE).unwrap();
                    state.remove(CLOSED_AT).unwrap();
                    state.remove(ALL_QUARANTINED_UNTIL).unwrap();
                    state.insert(OPENED_AT, 10_001_000).unwrap();
                }
                txn.commit().unwrap();
            }
            let old_close = 10_000_000 + 3_600_000;
            let txn = db.begin_write().unwrap();
            {
                let mut state = txn.open_table(STATE).unwrap();
                state.remove(OPENED_AT).unwrap();
                state.insert(CLOSED_AT, old_close).unwrap();
                state.insert(QUARANTINE_CAP, 60_000).unwrap();
                let mut saved = txn.open_table(QUARANTINES).unwrap();
                saved.insert("a", old_close + 30_000).unwrap();
            }
            txn.commit().unwrap();
            let open = at(old_close + 10_000, Some(7), Some(50_000 + 3_610_000));
            let reopened = reopen_at(&db, minute, &open).unwrap();
            assert!(!reopened.unclean, "{what}");
            assert_eq!(
                reopened.quarantines,
                vec![("a".to_owned(), expected)],
                "{what}"
            );
        }
        assert_eq!(
            boot_prefix("5f1c2a0e-7d3b-4c1a-9e2f-0123456789ab\n"),
            Some(0x5f1c_2a0e_7d3b_4c1a)
        );
        assert_eq!(boot_prefix("not a boot id"), None);
    }

    /// Goal: a permit dropped where no runtime runs (so no release can be spawned for it)
    /// still quarantines its resource, as a release with an unknown outcome would.
    #[tokio::test]
    async fn a_permit_dropped_outside_a_runtime_quarantines() {
        let dir = tempfile::tempdir().unwrap();
        let timing = Timing {
            forward_timeout: Duration::from_secs(2),
            ..timing()
        };
        let store = RedbStore::open(dir.path().join("e.redb"), timing).unwrap();
        let permit = accepted(&store, "a", 1).await;
        std::thread::spawn(move || drop(permit)).join().unwrap();
        let err = store.admit("a", FencingToken(2)).await.unwrap_err();
        assert!(err.to_string().contains("quarantined"), "{err}");
        // Its write may have been sent just before the drop: the quarantine covers the wait for
        // its answer too (--upstream-timeout + --quarantine), not --quarantine (300 ms) alone.
        tokio::time::sleep(Duration::from_millis(600)).await;
        let err = store.admit("a", FencingToken(2)).await.unwrap_err();
        assert!(err.to_string().contains("quarantined"), "{err}");
    }

    #[tokio::test]
    async fn permit_excludes_and_unknown_outcome_quarantines() {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStore::open(dir.path().join("e.redb"), timing()).unwrap();
        let p = accepted(&store, "a", 1).await;
        let err = store.admit("a", FencingToken(2)).await.unwrap_err();
        assert!(matches!(err, StoreError::Busy { .. }), "{err}");
        p.release(ForwardOutcome::Unknown).await.unwrap();
        // The quarantine (300 ms) outlasts the wait bound (200 ms): refused at once.
        let err = store.admit("a", FencingToken(2)).await.unwrap_err();
        assert!(err.to_string().contains("quarantined"), "{err}");
        tokio::time::sleep(Duration::from_millis(350)).await;
        accepted(&store, "a", 2)
            .await
            .release(ForwardOutcome::Answered)
            .await
            .unwrap();
    }
}

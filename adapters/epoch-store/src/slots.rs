//! The in-process lock table: per resource with a write in flight, waiting or in quarantine, who
//! may forward now. Writes carrying the same token share the resource (a shared grant, the
//! writes of one holder); a write with another token, or an exclusive one, waits until every
//! grant of the resource has been released; a quarantine closes the resource for everyone.
//!
//! # Why this keeps INV-FENCE-ORDER
//!
//! A grant at token `t` is handed out only while every grant the resource has is at `t`, no
//! quarantine runs, and nobody waits ahead with another token. So when a higher token `h` is
//! granted, every grant of a lower token has been released (its forward is over, bodies and
//! all: the front end releases only then), and while `h` is held no lower token is granted at
//! all. Once `h` is recorded the store refuses every lower token; this table also refuses them
//! itself ([`Share::Stale`]) once the store told it, including ones that queued up while `h`
//! waited. Waiters are served in arrival order, and a waiter with another token blocks newcomers
//! of the token in flight, so a steady stream of one holder's writes cannot starve the next
//! holder.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use lockd_fence::FencingToken;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::StoreError;

/// Size of the table above which a release sweeps out idle entries whose quarantine ended.
/// Entries of resources in use are removed as soon as their last user leaves, so only resources
/// whose quarantine expired while nobody used them linger; sweeping past this size bounds them
/// without paying a scan on every release.
const SWEEP_ABOVE_ENTRIES: usize = 1024;

/// Why a write found the resource closed by a quarantine.
const QUARANTINED: &str = "quarantined after a forward with an unknown outcome";

/// Where [`Slots::acquire`] lets a test hook run (between two critical sections).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pause {
    /// The waiter has queued and released the table lock.
    Queued,
    /// The waiter's sleep ended, before it locks the table again.
    Woke,
}

/// A test hook, run once.
#[cfg(test)]
type Hook = Box<dyn FnOnce() + Send>;

/// Test hooks, each run once at its pause point.
#[cfg(test)]
#[derive(Clone, Default)]
struct Hooks(Arc<Mutex<Vec<(Pause, Hook)>>>);

#[cfg(test)]
impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hooks")
    }
}

/// What a write asks of a resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    /// Alone: nobody else forwards while it is held (the Postgres store, whose cross-replica
    /// advisory lock is exclusive anyway).
    Exclusive,
    /// Together with every other write of this token.
    Shared(FencingToken),
}

/// The grants a resource has right now: all of one kind, `count` of them.
#[derive(Clone, Copy, Debug)]
struct Holders {
    want: Want,
    count: usize,
}

/// How a waiter's wait ended, told by whoever decided it (under the table lock).
#[derive(Debug)]
enum Decision {
    /// Granted; whether its token was known recorded then.
    Granted(bool),
    /// Its token is lower than this one, which the store recorded while it waited.
    Stale(FencingToken),
}

/// A write waiting for a resource.
#[derive(Debug)]
struct Waiter {
    /// Unique in the table, so that a waiter that gives up can find itself.
    id: u64,
    want: Want,
    tell: oneshot::Sender<Decision>,
}

/// What the table remembers about one resource.
#[derive(Debug, Default)]
struct Entry {
    /// End of the quarantine after a forward with an unknown outcome; `None` when open.
    /// `Instant` because it is a local, monotonic deadline that never leaves the process.
    quarantined_until: Option<Instant>,
    /// The grants held; `None` when nobody forwards.
    holders: Option<Holders>,
    /// Writes waiting, in arrival order. The table sets no count: the front end bounds its
    /// writes (fence-proxy http: `--max-in-flight` write tasks, also those whose client went
    /// away), and each waiter leaves after at most its wait bound (`--lock-wait`).
    queue: VecDeque<Waiter>,
    /// The highest token the store told this table it has recorded durably for the resource
    /// (see [`SlotGuard::note_recorded`]); lower tokens are refused without asking the store.
    /// Forgotten with the entry, which only costs a store round trip later.
    recorded: Option<FencingToken>,
    /// Wakes the waiters when a quarantine starts, so that they sleep until its end instead of
    /// until their own deadline (decisions reach them through their own channel).
    quarantine_started: Arc<tokio::sync::Notify>,
}

/// The table behind the mutex.
#[derive(Debug, Default)]
struct Table {
    entries: HashMap<String, Entry>,
    /// Id of the next waiter.
    next_id: u64,
    /// Set by [`Slots::close`]: no new write is granted or queued from then on (writes queued
    /// before a close that found the table in use may still be granted as grants end; the
    /// store then counts the stop as unclean anyway).
    closed: bool,
}

/// Why [`Slots::close`] found the table not idle.
#[derive(Debug)]
pub struct InUse;

/// Per-resource shared and exclusive grants with quarantine. Cheap to clone; clones share the
/// table.
#[derive(Clone, Debug, Default)]
pub struct Slots {
    /// A std mutex: it is held only to decide, never across an await.
    table: Arc<Mutex<Table>>,
    #[cfg(test)]
    hooks: Hooks,
}

/// The answer to [`Slots::share`].
#[derive(Debug)]
pub enum Share {
    /// The write may go on to the store: it holds the resource together with the other writes of
    /// its token until the guard is dropped.
    Granted(SlotGuard),
    /// The token is lower than this token, which the store has recorded: refuse it.
    Stale(FencingToken),
}

/// A grant of one resource in this process. Dropping it releases the grant (and opens the
/// resource once no grant is left), unless [`SlotGuard::quarantine`] was called.
#[derive(Debug)]
pub struct SlotGuard {
    resource: String,
    /// The grant's token; `None` for an exclusive one.
    token: Option<FencingToken>,
    /// Whether the store had told the table that this token is recorded when it was granted.
    recorded: bool,
    /// Set by [`SlotGuard::quarantine`]; applied on drop.
    quarantine: Option<std::time::Duration>,
    /// Set by [`SlotGuard::recording`] until [`SlotGuard::note_recorded`]: the store may have
    /// recorded a token the table was not told of, so a drop then forgets what it knows.
    unsure: bool,
    table: Arc<Mutex<Table>>,
}

impl Slots {
    /// An empty table: every resource free.
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits until `resource` is free and out of quarantine, then holds it alone; refuses with
    /// [`StoreError::Busy`] once `wait_max` has passed (at once if a quarantine outlasts it).
    pub async fn lock(
        &self,
        resource: &str,
        wait_max: std::time::Duration,
    ) -> Result<SlotGuard, StoreError> {
        match self.acquire(resource, Want::Exclusive, wait_max).await? {
            Share::Granted(guard) => Ok(guard),
            Share::Stale(_) => unreachable!("an exclusive want is never refused as stale"),
        }
    }

    /// Waits until `resource` may be written with `token`: every grant it has is of the same
    /// token, no quarantine runs and nobody waits ahead with another token. Refuses with
    /// [`Share::Stale`] as soon as the store has recorded a higher token (it told the table
    /// through [`SlotGuard::note_recorded`]), and with [`StoreError::Busy`] once `wait_max` has
    /// passed (at once if a quarantine outlasts it).
    pub async fn share(
        &self,
        resource: &str,
        token: FencingToken,
        wait_max: std::time::Duration,
    ) -> Result<Share, StoreError> {
        self.acquire(resource, Want::Shared(token), wait_max).await
    }

    async fn acquire(
        &self,
        resource: &str,
        want: Want,
        wait_max: std::time::Duration,
    ) -> Result<Share, StoreError> {
        let started = Instant::now();
        let deadline = started + wait_max;
        let (id, decided, quarantine_started) = {
            let mut table = self.lock_table();
            if table.closed {
                return Err(StoreError::Unavailable {
                    store: "epoch store".to_owned(),
                    detail: "closed: the proxy is stopping".to_owned(),
                });
            }
            let id = table.next_id;
            table.next_id += 1;
            let entry = table.entries.entry(resource.to_owned()).or_default();
            if let (Want::Shared(token), Some(highest)) = (want, entry.recorded)
                && token < highest
            {
                return Ok(Share::Stale(highest));
            }
            let now = Instant::now();
            let quarantined = entry.quarantined_until.filter(|until| *until > now);
            if quarantined.is_none() && entry.queue.is_empty() && fits(entry.holders, want) {
                entry.quarantined_until = None;
                let recorded = hold(entry, want);
                return Ok(Share::Granted(self.guard(resource, want, recorded)));
            }
            if quarantined.is_some_and(|until| until > deadline) {
                // Nobody is queued for it: drop the entry if it only held this lookup.
                return Err(StoreError::busy(
                    resource,
                    QUARANTINED,
                    started.elapsed(),
                    wait_max,
                ));
            }
            let (tell, decided) = oneshot::channel();
            entry.queue.push_back(Waiter { id, want, tell });
            // Taken now: once the lock is released the entry may be decided and removed by
            // others (a stale waiter is swept, the last grant dropped) before this task runs.
            (id, decided, entry.quarantine_started.clone())
        };
        // Leaves the queue if this future is dropped, and gives back a grant it was handed but
        // never took.
        let mut waiting = Waiting {
            slots: self,
            resource,
            id,
            decided: Some(decided),
        };
        self.pause(Pause::Queued);
        loop {
            let started_now = quarantine_started.notified();
            tokio::pin!(started_now);
            let quarantine_end = {
                let mut table = self.lock_table();
                // Registered under the lock that a quarantine is set under: either it is read
                // here, or this future is woken.
                started_now.as_mut().enable();
                let quarantine_end = table
                    .entries
                    .get(resource)
                    .and_then(|e| e.quarantined_until);
                // A quarantine that outlasts this waiter's bound (it may have started after the
                // waiter queued): refused now rather than at the deadline. If the waiter was
                // decided meanwhile, its answer is in the channel.
                if quarantine_end.is_some_and(|end| end > deadline)
                    && let Some(why) = give_up(&mut table, resource, id, want)
                {
                    waiting.decided = None;
                    return Err(StoreError::busy(resource, why, started.elapsed(), wait_max));
                }
                quarantine_end
            };
            let wake = quarantine_end.map_or(deadline, |q| q.min(deadline));
            let decided = waiting.decided.as_mut().expect("taken only on return");
            tokio::select! {
                // An answer that is there wins over a deadline passing in the same instant.
                biased;
                told = decided => {
                    waiting.decided = None;
                    return match told {
                        Ok(Decision::Granted(recorded)) => {
                            Ok(Share::Granted(self.guard(resource, want, recorded)))
                        }
                        Ok(Decision::Stale(highest)) => Ok(Share::Stale(highest)),
                        // Every path that takes a waiter out of the queue answers it first; fail
                        // closed rather than panic if that ever changes.
                        Err(_) => Err(StoreError::busy(
                            resource,
                            "left the queue without an answer",
                            started.elapsed(),
                            wait_max,
                        )),
                    };
                }
                _ = tokio::time::sleep_until(wake) => {
                    self.pause(Pause::Woke);
                    let mut table = self.lock_table();
                    let Some(entry) = table.entries.get_mut(resource) else {
                        // Decided and removed since the select looked (swept as stale, say): the
                        // answer is in the channel.
                        continue;
                    };
                    if Instant::now() < deadline {
                        // The quarantine ended: whoever is first may go now.
                        grant_waiters(entry);
                        continue;
                    }
                    let Some(why) = give_up(&mut table, resource, id, want) else {
                        // Decided in the same instant; the answer is in the channel.
                        continue;
                    };
                    waiting.decided = None;
                    return Err(StoreError::busy(resource, why, started.elapsed(), wait_max));
                }
                _ = &mut started_now => continue,
            }
        }
    }

    /// Runs the test hook set for `at`, if any: lets a test interleave others between two
    /// critical sections of [`Slots::acquire`] deterministically.
    #[cfg(test)]
    fn pause(&self, at: Pause) {
        let hook = {
            let mut hooks = self.hooks.0.lock().unwrap();
            hooks
                .iter()
                .position(|(p, _)| *p == at)
                .map(|i| hooks.remove(i).1)
        };
        if let Some(hook) = hook {
            hook();
        }
    }

    #[cfg(not(test))]
    #[inline(always)]
    fn pause(&self, _at: Pause) {}

    fn guard(&self, resource: &str, want: Want, recorded: bool) -> SlotGuard {
        SlotGuard {
            resource: resource.to_owned(),
            token: match want {
                Want::Exclusive => None,
                Want::Shared(t) => Some(t),
            },
            recorded,
            quarantine: None,
            unsure: false,
            table: self.table.clone(),
        }
    }

    fn lock_table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().expect("slot table poisoned")
    }

    /// Number of resources in the table (in use, waited for, or quarantined).
    pub fn len(&self) -> usize {
        self.lock_table().entries.len()
    }

    /// Whether no resource is in use, waited for or quarantined.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Closes the table for good, in one step with looking at it: from now on no new write is
    /// granted or queued. Returns the quarantines running (each resource with the time it has
    /// left), or [`InUse`] if a resource is still held or waited for, whose outcome is unknown
    /// (waiters already queued then may still be granted as the grants ahead of them end).
    pub fn close(&self) -> Result<Vec<(String, std::time::Duration)>, InUse> {
        let mut table = self.lock_table();
        table.closed = true;
        if table
            .entries
            .values()
            .any(|e| e.holders.is_some() || !e.queue.is_empty())
        {
            return Err(InUse);
        }
        let now = Instant::now();
        Ok(table
            .entries
            .iter()
            .filter_map(|(resource, e)| {
                let until = e.quarantined_until.filter(|q| *q > now)?;
                Some((resource.clone(), until - now))
            })
            .collect())
    }

    /// Closes `resource` for everyone for `period` from now (or longer, if a quarantine that
    /// ends later already runs): a quarantine carried over from an earlier process.
    pub fn quarantine(&self, resource: &str, period: std::time::Duration) {
        let mut table = self.lock_table();
        let entry = table.entries.entry(resource.to_owned()).or_default();
        let until = Instant::now() + period;
        entry.quarantined_until = Some(entry.quarantined_until.map_or(until, |q| q.max(until)));
        entry.quarantine_started.notify_waiters();
    }
}

/// Whether a write wanting `want` may join `holders`.
fn fits(holders: Option<Holders>, want: Want) -> bool {
    match (holders, want) {
        (None, _) => true,
        (Some(h), Want::Shared(t)) => h.want == Want::Shared(t),
        (Some(_), Want::Exclusive) => false,
    }
}

/// Adds a grant of `want` to the entry; says whether its token is known to be recorded.
fn hold(entry: &mut Entry, want: Want) -> bool {
    match &mut entry.holders {
        Some(h) => h.count += 1,
        None => entry.holders = Some(Holders { want, count: 1 }),
    }
    matches!(want, Want::Shared(t) if entry.recorded == Some(t))
}

/// Decides the waiters that can be decided now: those below the recorded token are refused,
/// then waiters are granted from the front while they fit (a run of one token, or one exclusive).
/// Called after every change of the entry.
fn grant_waiters(entry: &mut Entry) {
    if let Some(highest) = entry.recorded {
        let mut kept = VecDeque::with_capacity(entry.queue.len());
        for w in entry.queue.drain(..) {
            match w.want {
                Want::Shared(t) if t < highest => {
                    // A waiter that went away needs no answer.
                    let _ = w.tell.send(Decision::Stale(highest));
                }
                _ => kept.push_back(w),
            }
        }
        entry.queue = kept;
    }
    let now = Instant::now();
    if entry.quarantined_until.is_some_and(|q| q > now) {
        return;
    }
    entry.quarantined_until = None;
    while entry
        .queue
        .front()
        .is_some_and(|w| fits(entry.holders, w.want))
    {
        let w = entry.queue.pop_front().expect("checked above");
        let recorded = matches!(w.want, Want::Shared(t) if entry.recorded == Some(t));
        // Counted only if the waiter is still there to take it.
        if w.tell.send(Decision::Granted(recorded)).is_ok() {
            hold(entry, w.want);
        }
    }
}

/// An entry nobody holds, waits for or is kept out of by a quarantine carries nothing that must
/// be kept.
fn idle(entry: &Entry) -> bool {
    entry.holders.is_none()
        && entry.queue.is_empty()
        && entry.quarantined_until.is_none_or(|q| q <= Instant::now())
}

fn remove_if_idle(table: &mut Table, resource: &str) {
    if table.entries.get(resource).is_some_and(idle) {
        table.entries.remove(resource);
    }
    if table.entries.len() > SWEEP_ABOVE_ENTRIES {
        table.entries.retain(|_, e| !idle(e));
    }
}

/// Takes waiter `id` out of the queue of `resource` when it gives up, and says what kept it
/// waiting; `None` if it is no longer queued (it was decided: its answer is in its channel).
fn give_up(table: &mut Table, resource: &str, id: u64, want: Want) -> Option<&'static str> {
    let entry = table.entries.get_mut(resource)?;
    let at = entry.queue.iter().position(|w| w.id == id)?;
    entry.queue.remove(at);
    // This waiter may have been the one blocking those behind it.
    grant_waiters(entry);
    let why = if entry.quarantined_until.is_some_and(|q| q > Instant::now()) {
        QUARANTINED
    } else {
        match want {
            // The Postgres store's writes are all exclusive: any other write of it.
            Want::Exclusive => "another write of it is being forwarded",
            Want::Shared(_) => "a write of it with another token is being forwarded or waits ahead",
        }
    };
    remove_if_idle(table, resource);
    Some(why)
}

/// A waiter in a queue; dropping it before it was decided takes it out of the queue, and gives
/// back a grant that was counted for it while it went away.
struct Waiting<'a> {
    slots: &'a Slots,
    resource: &'a str,
    id: u64,
    /// Where its answer arrives; `None` once the answer was taken (nothing to undo).
    decided: Option<oneshot::Receiver<Decision>>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let Some(mut decided) = self.decided.take() else {
            return;
        };
        let mut table = lock_in_drop(&self.slots.table);
        let Some(entry) = table.entries.get_mut(self.resource) else {
            return;
        };
        if let Some(at) = entry.queue.iter().position(|w| w.id == self.id) {
            entry.queue.remove(at);
        } else if let Ok(Decision::Granted(_)) = decided.try_recv() {
            // Granted (and counted, under this lock) but never taken.
            release_one(entry);
        }
        grant_waiters(entry);
        remove_if_idle(&mut table, self.resource);
    }
}

/// Locks the table in a drop: a panic elsewhere must not turn a release into a second panic (an
/// abort), so a poisoned lock is taken as it is.
fn lock_in_drop(table: &Mutex<Table>) -> MutexGuard<'_, Table> {
    table.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Takes one grant off the entry's count.
fn release_one(entry: &mut Entry) {
    // Counted whenever a grant exists; never panic here, it runs in drops under the lock.
    let Some(holders) = entry.holders.as_mut() else {
        debug_assert!(false, "a grant being released is not counted in its entry");
        return;
    };
    holders.count -= 1;
    if holders.count == 0 {
        entry.holders = None;
    }
}

impl SlotGuard {
    /// The resource this guard holds.
    pub fn resource(&self) -> &str {
        &self.resource
    }

    /// Whether the store had told the table that this guard's token is recorded durably when
    /// the guard was granted: the store need not check it again.
    pub fn recorded(&self) -> bool {
        self.recorded
    }

    /// The store is about to record this guard's token. If the guard is dropped before
    /// [`SlotGuard::note_recorded`] (the admission was cancelled, or the store failed after
    /// perhaps writing), the table forgets the token it knew recorded, so that it never
    /// vouches for a token below one the store holds.
    pub fn recording(&mut self) {
        self.unsure = true;
    }

    /// The store has recorded `highest` for this resource durably (or found it recorded):
    /// writes with a lower token, waiting or to come, are refused without asking it again.
    pub fn note_recorded(&mut self, highest: FencingToken) {
        self.unsure = false;
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        // An entry with a grant is never removed; if it were, knowing less is the safe side.
        let Some(entry) = table.entries.get_mut(&self.resource) else {
            return;
        };
        if entry.recorded.is_none_or(|r| r < highest) {
            entry.recorded = Some(highest);
            grant_waiters(entry);
        }
    }

    /// Keeps the resource closed for everyone for `period` after this guard is dropped.
    pub fn quarantine(&mut self, period: std::time::Duration) {
        self.quarantine = Some(period);
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let mut table = lock_in_drop(&self.table);
        // An entry with a grant is never removed; nothing to release if it were.
        let Some(entry) = table.entries.get_mut(&self.resource) else {
            return;
        };
        if self.unsure {
            entry.recorded = None;
        }
        if let Some(period) = self.quarantine {
            let until = Instant::now() + period;
            entry.quarantined_until = Some(entry.quarantined_until.map_or(until, |q| q.max(until)));
            entry.quarantine_started.notify_waiters();
        }
        debug_assert_eq!(
            entry.holders.map(|h| h.want),
            Some(self.token.map_or(Want::Exclusive, Want::Shared))
        );
        release_one(entry);
        grant_waiters(entry);
        remove_if_idle(&mut table, &self.resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const WAIT: Duration = Duration::from_secs(1);

    fn t(n: u64) -> FencingToken {
        FencingToken(n)
    }

    async fn granted(slots: &Slots, r: &str, token: u64, wait: Duration) -> SlotGuard {
        match slots.share(r, t(token), wait).await.unwrap() {
            Share::Granted(g) => g,
            Share::Stale(h) => panic!("{r}:{token} refused as stale, highest {h}"),
        }
    }

    /// Whether `fut` is still pending after the runtime had a chance to run everything else.
    async fn pending<F: Future + Unpin>(fut: &mut F) -> bool {
        tokio::select! {
            biased;
            _ = fut => false,
            _ = tokio::task::yield_now() => true,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn second_writer_waits_for_the_first() {
        let slots = Slots::new();
        let first = slots.lock("r", WAIT).await.unwrap();
        let err = slots
            .lock("r", Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Busy { .. }), "{err}");
        assert!(err.to_string().contains("\"r\""), "{err}");
        let other = slots.lock("s", Duration::from_millis(100)).await.unwrap();
        drop(first);
        let again = slots.lock("r", Duration::from_millis(100)).await.unwrap();
        drop((again, other));
        assert!(slots.is_empty(), "idle entries must be removed");
    }

    /// Goal (review): closing the table and looking at it are one step: a close finds a grant
    /// or a waiter, or it returns the quarantines and nothing is granted or queued after it.
    #[tokio::test(start_paused = true)]
    async fn a_closed_table_grants_nothing() {
        let slots = Slots::new();
        let mut g = granted(&slots, "q", 1, WAIT).await;
        g.quarantine(Duration::from_secs(5));
        drop(g);
        let held = granted(&slots, "held", 1, WAIT).await;
        assert!(slots.close().is_err(), "closed idle with a grant held");
        drop(held);
        let quarantines = slots.close().expect("idle");
        assert_eq!(quarantines.len(), 1, "{quarantines:?}");
        assert_eq!(quarantines[0].0, "q");
        let err = slots.share("other", t(1), WAIT).await.unwrap_err();
        assert!(err.to_string().contains("closed"), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn quarantine_keeps_the_resource_closed() {
        let slots = Slots::new();
        let mut g = slots.lock("r", WAIT).await.unwrap();
        g.quarantine(Duration::from_secs(5));
        drop(g);
        assert_eq!(slots.len(), 1, "a quarantined entry must stay");
        // A quarantine longer than the wait bound is refused at once.
        let t0 = Instant::now();
        let err = slots.lock("r", Duration::from_secs(2)).await.unwrap_err();
        assert!(err.to_string().contains("quarantined"), "{err}");
        assert!(t0.elapsed() < Duration::from_millis(10));
        // A waiter whose bound covers it waits it out.
        let g = slots.lock("r", Duration::from_secs(10)).await.unwrap();
        assert!(t0.elapsed() >= Duration::from_secs(5));
        drop(g);
        assert!(slots.is_empty());
    }

    /// Goal: writes of one token hold the resource together; another token and an exclusive
    /// write wait for all of them.
    #[tokio::test(start_paused = true)]
    async fn same_token_shares_other_tokens_wait() {
        let slots = Slots::new();
        let a = granted(&slots, "r", 5, WAIT).await;
        let b = granted(&slots, "r", 5, WAIT).await;
        let short = Duration::from_millis(50);
        for (err, why) in [
            (slots.share("r", t(6), short).await, "another token"),
            (slots.share("r", t(4), short).await, "another token"),
            // The Postgres store's exclusive writes: no token to speak of (review L4).
            (
                slots.lock("r", short).await.map(Share::Granted),
                "another write of it",
            ),
        ] {
            let err = err.unwrap_err();
            assert!(matches!(err, StoreError::Busy { .. }), "{err}");
            assert!(err.to_string().contains(why), "{err}");
        }
        let mut six = Box::pin(slots.share("r", t(6), WAIT));
        assert!(pending(&mut six).await);
        drop(a);
        assert!(
            pending(&mut six).await,
            "6 went while a write of 5 was in flight"
        );
        drop(b);
        let six = match six.await.unwrap() {
            Share::Granted(g) => g,
            other => panic!("{other:?}"),
        };
        drop(six);
        assert!(slots.is_empty());
    }

    /// Goal: while a higher token waits, no newcomer of the token in flight joins (so the higher
    /// one is not starved), and once the higher one is recorded every lower waiter and newcomer
    /// is refused as stale, without a grant.
    #[tokio::test(start_paused = true)]
    async fn a_waiting_higher_token_closes_the_resource_to_lower_ones() {
        let slots = Slots::new();
        let mut five = granted(&slots, "r", 5, WAIT).await;
        five.note_recorded(t(5));
        let mut seven = Box::pin(slots.share("r", t(7), WAIT));
        assert!(pending(&mut seven).await);
        // Arriving while 7 waits: another 5 and a 6 queue behind it.
        let mut late5 = Box::pin(slots.share("r", t(5), WAIT));
        let mut late6 = Box::pin(slots.share("r", t(6), WAIT));
        assert!(pending(&mut late5).await, "5 joined while 7 waited");
        assert!(pending(&mut late6).await);
        // A token below the recorded one is refused at once.
        assert!(matches!(
            slots.share("r", t(4), WAIT).await.unwrap(),
            Share::Stale(h) if h == t(5)
        ));
        drop(five);
        let mut seven = match seven.await.unwrap() {
            Share::Granted(g) => g,
            other => panic!("{other:?}"),
        };
        assert!(!seven.recorded());
        assert!(pending(&mut late5).await, "5 went while 7 was held");
        assert!(pending(&mut late6).await, "6 went while 7 was held");
        seven.note_recorded(t(7));
        for late in [late5.await.unwrap(), late6.await.unwrap()] {
            assert!(matches!(late, Share::Stale(h) if h == t(7)), "{late:?}");
        }
        // Writes of 7 join the recorded 7 and know it is recorded.
        let again = granted(&slots, "r", 7, WAIT).await;
        assert!(again.recorded());
        drop((seven, again));
        assert!(slots.is_empty());
    }

    /// Goal: a grant dropped while the store was recording its token (cancelled, or the store
    /// failed after perhaps writing) makes the table forget the token it knew recorded, so that
    /// writes of that token go back to the store instead of trusting the table.
    #[tokio::test(start_paused = true)]
    async fn a_grant_dropped_while_recording_forgets_what_was_recorded() {
        let slots = Slots::new();
        // The table learns that 5 is recorded; a quarantine keeps the entry.
        let mut five = granted(&slots, "r", 5, WAIT).await;
        five.note_recorded(t(5));
        five.quarantine(Duration::from_millis(100));
        drop(five);
        tokio::time::sleep(Duration::from_millis(200)).await;
        // 7 is granted and the store starts recording it; a 5 waits behind it.
        let mut seven = granted(&slots, "r", 7, WAIT).await;
        seven.recording();
        let mut late5 = Box::pin(slots.share("r", t(5), WAIT));
        assert!(pending(&mut late5).await);
        // 7's admission goes away before the store answered: the store may hold 7 now.
        drop(seven);
        match late5.await.unwrap() {
            Share::Granted(g) => assert!(
                !g.recorded(),
                "the table vouched for 5 although the store may hold 7"
            ),
            Share::Stale(h) => panic!("stale {h}: the table never learned of 7"),
        }
        assert!(slots.is_empty());
    }

    /// Goal: a higher token whose record failed leaves the lower waiters to the store: they are
    /// granted once it is released, since nothing higher was recorded.
    #[tokio::test(start_paused = true)]
    async fn lower_waiters_go_on_when_the_higher_one_was_not_recorded() {
        let slots = Slots::new();
        let five = granted(&slots, "r", 5, WAIT).await;
        let mut seven = Box::pin(slots.share("r", t(7), WAIT));
        assert!(pending(&mut seven).await);
        let mut six = Box::pin(slots.share("r", t(6), WAIT));
        assert!(pending(&mut six).await);
        drop(five);
        let seven = match seven.await.unwrap() {
            Share::Granted(g) => g,
            other => panic!("{other:?}"),
        };
        drop(seven);
        assert!(matches!(six.await.unwrap(), Share::Granted(_)));
        assert!(slots.is_empty());
    }

    /// Goal: a quarantine closes the resource for the token in flight too; the other writes of
    /// that token still run to their end.
    #[tokio::test(start_paused = true)]
    async fn quarantine_closes_the_resource_for_the_same_token() {
        let slots = Slots::new();
        let mut a = granted(&slots, "r", 5, WAIT).await;
        let b = granted(&slots, "r", 5, WAIT).await;
        a.quarantine(Duration::from_secs(3));
        drop(a);
        let t0 = Instant::now();
        let err = slots
            .share("r", t(5), Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("quarantined"), "{err}");
        let c = granted(&slots, "r", 5, Duration::from_secs(10)).await;
        assert!(t0.elapsed() >= Duration::from_secs(3), "{:?}", t0.elapsed());
        drop((b, c));
        assert!(slots.is_empty());
    }

    /// Goal: a write that waits for another token's write, which then ends with an unknown
    /// outcome, is admitted when the quarantine ends, not at its own deadline.
    #[tokio::test(start_paused = true)]
    async fn a_quarantine_that_starts_while_waiting_is_waited_out() {
        let slots = Slots::new();
        let mut five = granted(&slots, "r", 5, WAIT).await;
        let t0 = Instant::now();
        let seven = tokio::spawn({
            let slots = slots.clone();
            async move {
                match slots.share("r", t(7), Duration::from_secs(30)).await {
                    Ok(Share::Granted(g)) => {
                        drop(g);
                        Instant::now()
                    }
                    other => panic!("{other:?}"),
                }
            }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        five.quarantine(Duration::from_secs(2));
        drop(five);
        let admitted = seven.await.unwrap() - t0;
        assert!(
            admitted >= Duration::from_secs(3) && admitted < Duration::from_secs(4),
            "admitted after {admitted:?}"
        );
        assert!(slots.is_empty());
    }

    /// Goal: a waiter that gives up (its bound passed, or its future was dropped) leaves the
    /// queue and no longer blocks those behind it; nothing lingers in the table.
    #[tokio::test(start_paused = true)]
    async fn waiters_that_give_up_leave_no_trace() {
        let slots = Slots::new();
        let five = granted(&slots, "r", 5, WAIT).await;
        let mut dropped = Box::pin(slots.share("r", t(7), WAIT));
        assert!(pending(&mut dropped).await);
        drop(dropped);
        // 7 is gone, so another 5 may join again.
        let five_again = granted(&slots, "r", 5, Duration::from_millis(10)).await;
        let err = slots
            .share("r", t(8), Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Busy { .. }), "{err}");
        drop((five, five_again));
        assert!(slots.is_empty());
        // A waiter granted at the moment its future is dropped gives the grant back.
        let six = granted(&slots, "r", 6, WAIT).await;
        let mut nine = Box::pin(slots.share("r", t(9), WAIT));
        assert!(pending(&mut nine).await);
        drop(six);
        drop(nine);
        assert!(slots.is_empty(), "a grant nobody took is still counted");
    }

    impl Slots {
        /// Runs `hook` once when a waiter reaches `at`.
        fn hook(&self, at: Pause, hook: impl FnOnce() + Send + 'static) {
            self.hooks.0.lock().unwrap().push((at, Box::new(hook)));
        }
    }

    /// A hook that tells the table the store holds `highest` (the raise of `guard`'s token was
    /// refused with it), then drops the grant, as the redb store's admission does.
    fn refused_and_dropped(guard: SlotGuard, highest: u64) -> impl FnOnce() + Send + 'static {
        move || {
            let mut guard = guard;
            guard.note_recorded(t(highest));
            drop(guard);
        }
    }

    /// Goal (review H1): a waiter that is swept as stale, and whose entry is then removed,
    /// between queueing and its next look at the table, gets its answer. It used to index the
    /// missing entry under the table lock: a panic that poisoned the lock, then a second one in
    /// the waiter's drop, which aborts the process.
    #[tokio::test(start_paused = true)]
    async fn a_waiter_decided_and_removed_right_after_queueing_gets_its_answer() {
        let slots = Slots::new();
        // The store holds 9; the table knows nothing. 8 is granted and goes to the store.
        let mut eight = granted(&slots, "r", 8, WAIT).await;
        eight.recording();
        slots.hook(Pause::Queued, refused_and_dropped(eight, 9));
        match slots.share("r", t(5), WAIT).await.unwrap() {
            Share::Stale(h) => assert_eq!(h, t(9)),
            Share::Granted(_) => panic!("5 granted although 9 is recorded"),
        }
        assert!(slots.is_empty());
    }

    /// Goal (review H1): the same when it happens after the waiter's sleep ended and before it
    /// locks the table (it used to be `unreachable!` under the lock).
    #[tokio::test(start_paused = true)]
    async fn a_waiter_decided_and_removed_as_its_sleep_ends_gets_its_answer() {
        let slots = Slots::new();
        let mut eight = granted(&slots, "r", 8, WAIT).await;
        eight.recording();
        slots.hook(Pause::Woke, refused_and_dropped(eight, 9));
        match slots.share("r", t(5), Duration::from_millis(100)).await {
            Ok(Share::Stale(h)) => assert_eq!(h, t(9)),
            other => panic!("{other:?}"),
        }
        assert!(slots.is_empty());
    }

    /// Goal (review L3): a waiter already queued when a quarantine longer than its bound starts
    /// is refused at once, not when its bound has passed.
    #[tokio::test(start_paused = true)]
    async fn a_quarantine_outlasting_a_queued_waiter_refuses_it_at_once() {
        let slots = Slots::new();
        let mut five = granted(&slots, "r", 5, WAIT).await;
        let t0 = Instant::now();
        let seven = tokio::spawn({
            let slots = slots.clone();
            async move {
                let got = slots.share("r", t(7), Duration::from_secs(2)).await;
                (got.map(|_| ()), Instant::now())
            }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        five.quarantine(Duration::from_secs(5));
        drop(five);
        let (got, at) = seven.await.unwrap();
        let err = got.unwrap_err();
        assert!(err.to_string().contains("quarantined"), "{err}");
        assert_eq!(
            at - t0,
            Duration::from_millis(500),
            "refused only at its deadline"
        );
    }

    /// Goal (documented in docs/fence-proxy.md): a token below one the table knows recorded is
    /// refused as stale at once, also while the resource is quarantined (not 503 busy).
    #[tokio::test(start_paused = true)]
    async fn a_known_stale_token_is_refused_at_once_during_a_quarantine() {
        let slots = Slots::new();
        let mut seven = granted(&slots, "r", 7, WAIT).await;
        seven.note_recorded(t(7));
        seven.quarantine(Duration::from_secs(5));
        drop(seven);
        let t0 = Instant::now();
        match slots.share("r", t(5), Duration::from_secs(1)).await {
            Ok(Share::Stale(h)) => assert_eq!(h, t(7)),
            other => panic!("{other:?}"),
        }
        assert_eq!(t0.elapsed(), Duration::ZERO);
    }

    /// Goal: the table stays bounded: entries whose quarantine ended with nobody around are
    /// swept once the table passes its bound.
    #[tokio::test(start_paused = true)]
    async fn expired_quarantines_are_swept() {
        let slots = Slots::new();
        for i in 0..=SWEEP_ABOVE_ENTRIES {
            let mut g = granted(&slots, &format!("r{i}"), 1, WAIT).await;
            g.quarantine(Duration::from_millis(10));
        }
        assert_eq!(slots.len(), SWEEP_ABOVE_ENTRIES + 1);
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(granted(&slots, "other", 1, WAIT).await);
        assert!(slots.is_empty(), "{} entries left", slots.len());
    }
}

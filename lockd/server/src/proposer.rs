//! Group commit: client commands queue here and go to Raft many per entry.
//!
//! One redb commit with fsync costs milliseconds, so one entry per command would cap a node at a
//! few hundred commands per second. The proposer takes whatever queued while the previous batches
//! were in flight and proposes it as one entry, with a bounded number of entries in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use lockd_core::{Batch, Command, Outcome, Policy};
use tokio::sync::{Semaphore, mpsc, oneshot, watch};

use crate::clock::Clock;
use crate::observe::metrics::NodeMetrics;
use crate::raft::Raft;

/// Commands waiting for a batch. Beyond this the node answers UNAVAILABLE ("overloaded") at once
/// instead of queueing without bound.
pub const PROPOSE_QUEUE_MAX: usize = 8_192;
/// Commands in one Raft entry: large enough to amortise an fsync, small enough that one entry
/// stays well under the replication message limit.
pub const BATCH_COMMANDS_MAX: usize = 512;
/// Entries proposed but not yet applied: one. openraft 0.9 runs each append, fsync included,
/// inside its core and handles the followers' answers only between appends, so a second entry
/// in flight puts its fsync ahead of the commit of the first instead of overlapping it; the
/// commands that queue meanwhile go in the next entry. Measured against 2 and 4 (4 was the
/// bound before) on three replicas of one 2-core machine: acquire p50 at 6,000 ops/s 5.6-5.9 ms
/// against 8.3-8.5, and 16,300 ops/s in a closed loop of 256 workers against 14,200
/// (docs/benchmarks.md, "The proposer's entries in flight").
pub const INFLIGHT_BATCHES_MAX: usize = 1;
/// How long a proposal may take to commit and apply before the caller is told the outcome is
/// unknown (well inside the 5 s bound for UNAVAILABLE, docs/api.md "Limits and policy").
pub const COMMIT_TIMEOUT: Duration = Duration::from_secs(3);

/// Why a command has no outcome.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProposeError {
    /// Nothing was proposed: the queue is full.
    #[error("node is overloaded: {PROPOSE_QUEUE_MAX} commands already queued")]
    Overloaded,
    /// The command may or may not commit (timeout, leadership lost mid-flight, shutdown).
    #[error("{0}")]
    Unknown(String),
}

struct Pending {
    command: Command,
    reply: oneshot::Sender<Result<Outcome, ProposeError>>,
    /// Set for a command whose caller must know, once it has left, whether the command went
    /// into a batch ([`Proposer::propose_ticketed`]).
    ticket: Option<Arc<Ticket>>,
}

impl Pending {
    /// Whether the command goes into the batch being cut: not if its caller already gave up
    /// (it needs no slot in the log), nor if its ticket was withdrawn.
    fn cut(&self) -> bool {
        !self.reply.is_closed() && self.ticket.as_ref().is_none_or(|t| t.cut())
    }
}

/// Whether a command was cut into a batch, decided once, by whichever comes first: the proposer
/// cutting it ([`Ticket::cut`]) or its caller, gone, withdrawing it ([`Ticket::withdraw`]).
/// A waiting Acquire whose caller left needs a cancel in the log only if it was cut: one never
/// cut is never proposed. A flag the proposer set before looking at `is_closed` would not be
/// enough: a caller reading "not cut" could not know that the proposer would still see it gone.
#[derive(Debug, Default)]
pub struct Ticket(AtomicU8);

const TICKET_OPEN: u8 = 0;
const TICKET_CUT: u8 = 1;
const TICKET_WITHDRAWN: u8 = 2;

impl Ticket {
    /// The proposer cuts the command into a batch, unless it was withdrawn.
    fn cut(&self) -> bool {
        match self
            .0
            .compare_exchange(TICKET_OPEN, TICKET_CUT, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => true,
            Err(now) => now == TICKET_CUT,
        }
    }

    /// The caller left: true if the command was never cut, and now never will be; false if it
    /// was (it is in the log, or may still be).
    pub fn withdraw(&self) -> bool {
        match self.0.compare_exchange(
            TICKET_OPEN,
            TICKET_WITHDRAWN,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => true,
            Err(now) => now == TICKET_WITHDRAWN,
        }
    }
}

#[derive(Clone)]
pub struct Proposer {
    tx: mpsc::Sender<Pending>,
    /// The [`ProposalHold`]s alive; new batches wait while there is one and its time runs.
    holds: Arc<watch::Sender<Holds>>,
    raft: Raft,
    clock: Clock,
    policy: Policy,
}

impl Proposer {
    pub fn start(raft: Raft, clock: Clock, policy: Policy, metrics: Arc<NodeMetrics>) -> Self {
        let (tx, rx) = mpsc::channel(PROPOSE_QUEUE_MAX);
        let (holds, held) = watch::channel(Holds::default());
        tokio::spawn(run(raft.clone(), clock.clone(), policy, metrics, rx, held));
        Proposer {
            tx,
            holds: Arc::new(holds),
            raft,
            clock,
            policy,
        }
    }

    /// Commits an empty stamped batch, so the table's clock is anchored to this process: a new
    /// leader cannot tell which leases are due (and the table's clock does not advance) until
    /// one of its stamps is applied.
    pub async fn anchor_clock(&self) -> Result<(), ProposeError> {
        let batch = stamped(&self.raft, &self.clock, self.policy, Vec::new());
        match tokio::time::timeout(COMMIT_TIMEOUT, self.raft.client_write(batch)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(ProposeError::Unknown(format!("lockd: clock anchor: {e}"))),
            Err(_) => Err(ProposeError::Unknown(format!(
                "lockd: clock anchor not committed within {} ms",
                COMMIT_TIMEOUT.as_millis()
            ))),
        }
    }

    /// Stops proposing new batches until the hold is dropped or `until` has passed, whichever
    /// comes first (so a holder stuck in an await cannot stall the clients); commands queue
    /// meanwhile (up to [`PROPOSE_QUEUE_MAX`], each still bound by [`COMMIT_TIMEOUT`]). A
    /// leader transfer holds them for the moment its target catches up: under steady load the
    /// leader's log never stands still, so without the hold the target's log could take seconds
    /// to match it. A batch already being formed when the hold starts still goes out.
    pub fn hold(&self, until: tokio::time::Instant) -> ProposalHold {
        ProposalHold::take(&self.holds, until)
    }

    pub async fn propose(&self, command: Command) -> Result<Outcome, ProposeError> {
        self.propose_with(command, None).await
    }

    /// As [`Proposer::propose`], with a [`Ticket`] that tells the caller, should it leave
    /// before the answer, whether the command was cut into a batch.
    pub async fn propose_ticketed(
        &self,
        command: Command,
        ticket: Arc<Ticket>,
    ) -> Result<Outcome, ProposeError> {
        self.propose_with(command, Some(ticket)).await
    }

    async fn propose_with(
        &self,
        command: Command,
        ticket: Option<Arc<Ticket>>,
    ) -> Result<Outcome, ProposeError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .try_send(Pending {
                command,
                reply,
                ticket,
            })
            .map_err(|_| ProposeError::Overloaded)?;
        match tokio::time::timeout(COMMIT_TIMEOUT, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(ProposeError::Unknown("the node is shutting down".into())),
            Err(_) => Err(ProposeError::Unknown(format!(
                "not committed within {} ms",
                COMMIT_TIMEOUT.as_millis()
            ))),
        }
    }
}

/// The holds alive, and until when the latest of them holds.
#[derive(Clone, Copy, Debug, Default)]
struct Holds {
    count: usize,
    until: Option<tokio::time::Instant>,
}

impl Holds {
    /// Until when new batches must wait, if they must.
    fn waits_until(&self) -> Option<tokio::time::Instant> {
        self.until
            .filter(|until| self.count > 0 && tokio::time::Instant::now() < *until)
    }
}

/// See [`Proposer::hold`]: proposing resumes when the last hold is dropped, or its time is up.
pub struct ProposalHold {
    holds: Arc<watch::Sender<Holds>>,
}

impl ProposalHold {
    fn take(holds: &Arc<watch::Sender<Holds>>, until: tokio::time::Instant) -> ProposalHold {
        holds.send_modify(|h| {
            h.count += 1;
            h.until = h.until.max(Some(until));
        });
        ProposalHold {
            holds: holds.clone(),
        }
    }
}

impl Drop for ProposalHold {
    fn drop(&mut self) {
        self.holds.send_modify(|h| {
            h.count -= 1;
            if h.count == 0 {
                h.until = None;
            }
        });
    }
}

/// Waits while a hold is alive and its time runs.
async fn wait_for_holds(held: &mut watch::Receiver<Holds>) {
    loop {
        let Some(until) = held.borrow_and_update().waits_until() else {
            return;
        };
        match tokio::time::timeout_at(until, held.changed()).await {
            // A hold changed: look again.
            Ok(Ok(())) => {}
            // The time is up, or the proposer is gone.
            Ok(Err(_)) | Err(_) => return,
        }
    }
}

/// A batch stamped now with this leader's clock and its current term.
fn stamped(raft: &Raft, clock: &Clock, policy: Policy, commands: Vec<Command>) -> Batch {
    let term = raft.metrics().borrow().current_term;
    let (now_ms, stamp) = clock.stamp(term);
    Batch {
        now_ms,
        stamp: Some(stamp),
        policy,
        commands,
    }
}

async fn run(
    raft: Raft,
    clock: Clock,
    policy: Policy,
    metrics: Arc<NodeMetrics>,
    mut rx: mpsc::Receiver<Pending>,
    mut held: watch::Receiver<Holds>,
) {
    let inflight = Arc::new(Semaphore::new(INFLIGHT_BATCHES_MAX));
    loop {
        let Ok(permit) = inflight.clone().acquire_owned().await else {
            return;
        };
        wait_for_holds(&mut held).await;
        let Some(first) = rx.recv().await else { return };
        let mut pending = vec![first];
        while pending.len() < BATCH_COMMANDS_MAX {
            match rx.try_recv() {
                Ok(p) => pending.push(p),
                Err(_) => break,
            }
        }
        // Callers that already gave up need no slot in the log.
        pending.retain(Pending::cut);
        if pending.is_empty() {
            continue;
        }
        let (commands, replies): (Vec<_>, Vec<_>) =
            pending.into_iter().map(|p| (p.command, p.reply)).unzip();
        let batch = stamped(&raft, &clock, policy, commands);
        let raft = raft.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            // Bounded: openraft 0.9 never answers a write whose entry a snapshot install purged
            // from a former leader's log (it answers only applied or truncated entries), and the
            // one permit held for good would stop this node's proposals for good. The callers
            // have given up by then (`COMMIT_TIMEOUT` from their own start); the entry may still
            // commit, so the outcome stays unknown.
            let result = match tokio::time::timeout(COMMIT_TIMEOUT, raft.client_write(batch)).await
            {
                Ok(result) => result,
                Err(_) => {
                    drop(permit);
                    let err = ProposeError::Unknown(format!(
                        "not committed within {} ms",
                        COMMIT_TIMEOUT.as_millis()
                    ));
                    for reply in replies {
                        let _ = reply.send(Err(err.clone()));
                    }
                    return;
                }
            };
            drop(permit);
            metrics.with(|| {
                metrics::histogram!("lockd_raft_commit_duration_seconds")
                    .record(started.elapsed().as_secs_f64())
            });
            match result {
                Ok(resp) => {
                    let outcomes = resp.data.0;
                    assert_eq!(outcomes.len(), replies.len(), "one outcome per command");
                    for (reply, outcome) in replies.into_iter().zip(outcomes) {
                        let _ = reply.send(Ok(outcome));
                    }
                }
                Err(e) => {
                    // Unknown even for openraft's ForwardToLeader: besides "never appended" it
                    // answers entries truncated by a newer leader's log or by a snapshot, and
                    // such an entry may still be committed elsewhere (five voters: a later
                    // leader that holds it; or the snapshot that replaced it already holds it).
                    let err = ProposeError::Unknown(format!("commit failed: {e}"));
                    for reply in replies {
                        let _ = reply.send(Err(err.clone()));
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::{Instant, advance};

    fn pending(
        ticket: &Arc<Ticket>,
    ) -> (Pending, oneshot::Receiver<Result<Outcome, ProposeError>>) {
        let (reply, rx) = oneshot::channel();
        let command = Command::Reap {
            resource: lockd_core::validate::resource("r").unwrap(),
        };
        let ticket = Some(ticket.clone());
        (
            Pending {
                command,
                reply,
                ticket,
            },
            rx,
        )
    }

    /// Goal (review of f67ece3, finding 4): a caller that leaves learns whether its command was
    /// cut into a batch, so that it proposes a cancel only for an Acquire that may be in the
    /// log, and the proposer never cuts a command its caller withdrew. Method: the two orders
    /// of cutting and withdrawing, and a caller gone before the cut.
    #[test]
    fn a_ticket_is_either_cut_or_withdrawn_never_both() {
        // Cut first: the caller cannot withdraw it and must cancel.
        let ticket = Arc::new(Ticket::default());
        let (p, _rx) = pending(&ticket);
        assert!(p.cut());
        assert!(!ticket.withdraw());
        assert!(p.cut(), "cutting is idempotent");

        // Withdrawn first: never cut, nothing to cancel.
        let ticket = Arc::new(Ticket::default());
        let (p, _rx) = pending(&ticket);
        assert!(ticket.withdraw());
        assert!(!p.cut());
        assert!(ticket.withdraw());

        // The caller's reply dropped before the cut: not cut, and the ticket stays open, so
        // the caller's withdrawal succeeds.
        let ticket = Arc::new(Ticket::default());
        let (p, rx) = pending(&ticket);
        drop(rx);
        assert!(!p.cut());
        assert!(ticket.withdraw());
    }

    /// Whether the batching loop's wait for holds has ended after `after` of (paused) time.
    async fn ended_after(wait: &tokio::task::JoinHandle<()>, after: Duration) -> bool {
        advance(after).await;
        tokio::task::yield_now().await;
        wait.is_finished()
    }

    /// Goal: new batches wait while a hold is alive, and go on when the last hold is dropped or
    /// when its time is up even though it is still alive (a holder stuck in an await must not
    /// stall the clients). Method: the batching loop's wait under paused time.
    #[tokio::test(start_paused = true)]
    async fn a_hold_stops_batches_until_dropped_or_its_time_is_up() {
        let (holds, held) = watch::channel(Holds::default());
        let holds = Arc::new(holds);
        let wait = |mut held: watch::Receiver<Holds>| {
            tokio::spawn(async move { wait_for_holds(&mut held).await })
        };

        // No hold: no wait.
        let free = wait(held.clone());
        assert!(ended_after(&free, Duration::ZERO).await);

        // Two holds: the wait ends with the last one dropped, before their time.
        let first = ProposalHold::take(&holds, Instant::now() + Duration::from_millis(250));
        let second = ProposalHold::take(&holds, Instant::now() + Duration::from_millis(100));
        let waiting = wait(held.clone());
        assert!(!ended_after(&waiting, Duration::from_millis(50)).await);
        drop(first);
        assert!(!ended_after(&waiting, Duration::from_millis(10)).await);
        drop(second);
        assert!(ended_after(&waiting, Duration::ZERO).await);
        assert_eq!(holds.borrow().count, 0);
        assert_eq!(holds.borrow().until, None);

        // A hold never dropped: the wait ends when its time is up.
        let stuck = ProposalHold::take(&holds, Instant::now() + Duration::from_millis(250));
        let waiting = wait(held.clone());
        assert!(!ended_after(&waiting, Duration::from_millis(240)).await);
        assert!(ended_after(&waiting, Duration::from_millis(20)).await);
        // Later batches do not wait for it either.
        assert!(ended_after(&wait(held.clone()), Duration::ZERO).await);
        drop(stuck);
    }
}

//! Group commit: client commands queue here and go to Raft many per entry.
//!
//! One redb commit with fsync costs milliseconds, so one entry per command would cap a node at a
//! few hundred commands per second. The proposer takes whatever queued while the previous batches
//! were in flight and proposes it as one entry, with a bounded number of entries in flight.

use std::sync::Arc;
use std::time::Duration;

use lockd_core::{Batch, Command, Outcome, Policy};
use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::clock::Clock;
use crate::observe::metrics::NodeMetrics;
use crate::raft::Raft;

/// Commands waiting for a batch. Beyond this the node answers UNAVAILABLE ("overloaded") at once
/// instead of queueing without bound.
pub const PROPOSE_QUEUE_MAX: usize = 8_192;
/// Commands in one Raft entry: large enough to amortise an fsync, small enough that one entry
/// stays well under the replication message limit.
pub const BATCH_COMMANDS_MAX: usize = 512;
/// Entries proposed but not yet applied. More in flight lets replication pipeline; fewer keeps
/// batches large under load.
pub const INFLIGHT_BATCHES_MAX: usize = 4;
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
}

#[derive(Clone)]
pub struct Proposer {
    tx: mpsc::Sender<Pending>,
    raft: Raft,
    clock: Clock,
    policy: Policy,
}

impl Proposer {
    pub fn start(raft: Raft, clock: Clock, policy: Policy, metrics: Arc<NodeMetrics>) -> Self {
        let (tx, rx) = mpsc::channel(PROPOSE_QUEUE_MAX);
        tokio::spawn(run(raft.clone(), clock.clone(), policy, metrics, rx));
        Proposer {
            tx,
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

    pub async fn propose(&self, command: Command) -> Result<Outcome, ProposeError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .try_send(Pending { command, reply })
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
) {
    let inflight = Arc::new(Semaphore::new(INFLIGHT_BATCHES_MAX));
    loop {
        let Ok(permit) = inflight.clone().acquire_owned().await else {
            return;
        };
        let Some(first) = rx.recv().await else { return };
        let mut pending = vec![first];
        while pending.len() < BATCH_COMMANDS_MAX {
            match rx.try_recv() {
                Ok(p) => pending.push(p),
                Err(_) => break,
            }
        }
        // Callers that already gave up need no slot in the log.
        pending.retain(|p| !p.reply.is_closed());
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
            let result = raft.client_write(batch).await;
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
                    let err = ProposeError::Unknown(format!("commit failed: {e}"));
                    for reply in replies {
                        let _ = reply.send(Err(err.clone()));
                    }
                }
            }
        });
    }
}

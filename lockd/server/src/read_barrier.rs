//! Linearizable reads, many per quorum round. A linearizable read on the leader first confirms
//! with a quorum that it still leads (openraft's `ensure_linearizable`: a round of AppendEntries
//! to every voter through the Raft core, then a wait until the state machine has applied the
//! read point). One round per call let a client flooding Describe make the leader send a round
//! of messages to every voter per call, through the one loop that also sends heartbeats and
//! replication. Here the reads that arrive while a round runs wait for the next round, which
//! serves them all: at most one round is in flight, and each read is still confirmed by a round
//! that began after it arrived (what linearizability needs).

use std::future::Future;
use std::time::Duration;

use futures::FutureExt;
use tokio::sync::{mpsc, oneshot};

/// Longest a round may take: half of what a caller waits (3 s), since a read that arrives just
/// after a round began waits for that round and then its own.
pub const ROUND_TIMEOUT: Duration = Duration::from_millis(1_500);

/// Reads waiting for a round at most; beyond it a read is refused at once.
pub const READS_QUEUED_MAX: usize = 8_192;

/// Why a read was not confirmed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadRefused {
    /// The round failed (not the leader, no quorum); the message says why.
    #[error("{0}")]
    Failed(String),
    /// [`READS_QUEUED_MAX`] reads already wait.
    #[error("{READS_QUEUED_MAX} reads already wait for a leadership check")]
    Overloaded,
    /// The node is shutting down.
    #[error("the node is shutting down")]
    Stopped,
}

/// The queue of reads of one node.
#[derive(Clone)]
pub struct ReadBarrier {
    tx: mpsc::Sender<oneshot::Sender<Result<(), ReadRefused>>>,
}

impl ReadBarrier {
    /// Starts the rounds: `confirm` runs one (for lockd, `ensure_linearizable`), and fails if it
    /// takes longer than `round_timeout`. The bound matters: openraft's wait for apply has none,
    /// and one round that never ended would leave every later read of the node waiting.
    pub fn start<F, Fut>(round_timeout: Duration, mut confirm: F) -> Self
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), String>> + Send,
    {
        let (tx, mut rx) =
            mpsc::channel::<oneshot::Sender<Result<(), ReadRefused>>>(READS_QUEUED_MAX);
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                // Everything queued now arrived before this round starts.
                let mut waiting = vec![first];
                while let Ok(next) = rx.try_recv() {
                    waiting.push(next);
                }
                waiting.retain(|w| !w.is_closed());
                if waiting.is_empty() {
                    continue;
                }
                // A round that panics fails its reads only: this task serves every later read of
                // the node, so it must outlive any one round.
                let round = std::panic::AssertUnwindSafe(confirm()).catch_unwind();
                let outcome = match tokio::time::timeout(round_timeout, round).await {
                    Ok(Ok(done)) => done.map_err(ReadRefused::Failed),
                    Ok(Err(_)) => Err(ReadRefused::Failed(
                        "the leadership check failed unexpectedly (see the node's log)".to_owned(),
                    )),
                    Err(_) => Err(ReadRefused::Failed(format!(
                        "leadership not confirmed with a quorum, or the read point not applied, \
                         within {} ms",
                        round_timeout.as_millis()
                    ))),
                };
                for w in waiting {
                    let _ = w.send(outcome.clone());
                }
            }
        });
        ReadBarrier { tx }
    }

    /// Returns once a round that began after this call has confirmed the read point and the
    /// state machine has applied it.
    pub async fn confirm(&self) -> Result<(), ReadRefused> {
        let (reply, answer) = oneshot::channel();
        self.tx.try_send(reply).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => ReadRefused::Overloaded,
            mpsc::error::TrySendError::Closed(_) => ReadRefused::Stopped,
        })?;
        answer.await.unwrap_or(Err(ReadRefused::Stopped))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Goal: reads that arrive while a round runs share the next round (so 200 concurrent reads
    /// take two or three rounds, not 200), no read is answered by a round that began before it
    /// arrived, and a failed, stuck or panicking round fails its reads only. Method: a fake round
    /// that takes 20 ms (paused time) and records when it began; each read records when it was
    /// called.
    #[tokio::test(start_paused = true)]
    async fn reads_share_rounds_that_began_after_them() {
        let rounds = Arc::new(std::sync::Mutex::new(Vec::<tokio::time::Instant>::new()));
        let fail_next = Arc::new(AtomicUsize::new(0));
        let barrier = {
            let (rounds, fail_next) = (rounds.clone(), fail_next.clone());
            ReadBarrier::start(Duration::from_secs(3), move || {
                let (rounds, fail_next) = (rounds.clone(), fail_next.clone());
                async move {
                    rounds.lock().unwrap().push(tokio::time::Instant::now());
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    match fail_next.swap(0, Ordering::SeqCst) {
                        1 => Err("not the leader".to_owned()),
                        // A round that never ends (openraft's wait for apply has no bound).
                        2 => std::future::pending().await,
                        3 => panic!("a round that panics"),
                        _ => Ok(()),
                    }
                }
            })
        };
        let mut reads = Vec::new();
        for i in 0..200u64 {
            let barrier = barrier.clone();
            let rounds = rounds.clone();
            reads.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(i % 30)).await;
                let asked = tokio::time::Instant::now();
                barrier.confirm().await.unwrap();
                // Some round began at or after this read was asked, and before it was answered.
                let answered = tokio::time::Instant::now();
                assert!(
                    rounds
                        .lock()
                        .unwrap()
                        .iter()
                        .any(|&began| began >= asked && began <= answered),
                    "read asked at {asked:?} answered at {answered:?} by an older round"
                );
            }));
        }
        for r in reads {
            r.await.unwrap();
        }
        let count = rounds.lock().unwrap().len();
        assert!(
            (2..=4).contains(&count),
            "{count} rounds for 200 reads over 30 ms"
        );

        fail_next.store(1, Ordering::SeqCst);
        assert_eq!(
            barrier.confirm().await,
            Err(ReadRefused::Failed("not the leader".to_owned()))
        );
        assert_eq!(barrier.confirm().await, Ok(()));

        fail_next.store(2, Ordering::SeqCst);
        let stuck = barrier.confirm().await;
        assert!(
            matches!(&stuck, Err(ReadRefused::Failed(why)) if why.contains("3000 ms")),
            "{stuck:?}"
        );
        assert_eq!(
            barrier.confirm().await,
            Ok(()),
            "a stuck round blocks no later read"
        );

        fail_next.store(3, Ordering::SeqCst);
        let panicked = barrier.confirm().await;
        assert!(
            matches!(&panicked, Err(ReadRefused::Failed(why)) if why.contains("unexpectedly")),
            "{panicked:?}"
        );
        assert_eq!(
            barrier.confirm().await,
            Ok(()),
            "a round that panicked stops no later read"
        );
    }
}

//! The threads that serve client sessions: each runs a single-threaded Tokio runtime, and a
//! session stays on the thread it was given, from its startup to its end.
//!
//! Why not Tokio's multi-threaded runtime: a relayed round trip is two socket reads and two
//! writes, and the proxy's own code was about 5 % of its CPU time. Most of the rest went to
//! context switches: with two workers, a session woken by the I/O driver on one thread was often
//! run on the other, and workers woke and parked each other through futexes (profile and figures
//! in docs/benchmarks.md, "fence-proxy Postgres front end"). On a thread of its own, a session's
//! client and upstream sockets are polled by the epoll loop that wakes it, with no hand-off.
//! Sessions are independent (each has its own upstream connection), so nothing is lost by never
//! moving one; new sessions go to the thread that serves the fewest.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The session threads; dropping it stops them (sessions still running are dropped).
pub struct SessionThreads {
    threads: Vec<SessionThread>,
    /// Cancelled on drop: each thread then leaves its runtime's `block_on` and drops it.
    stop: CancellationToken,
}

struct SessionThread {
    /// Where this thread's sessions are spawned (from the accept loop's runtime).
    handle: Handle,
    /// Sessions (startups included) now on this thread, to place new ones.
    sessions: Arc<AtomicUsize>,
}

/// Decrements a thread's session count when the session's task ends or is dropped.
struct Placed(Arc<AtomicUsize>);

impl Drop for Placed {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl SessionThreads {
    /// Starts `count` threads (at least one), each driving a current-thread runtime with I/O and
    /// timers until the value is dropped.
    pub fn start(count: usize) -> anyhow::Result<SessionThreads> {
        // Built first, so that an error below drops it and stops the threads already started.
        let mut started = SessionThreads {
            threads: Vec::with_capacity(count.max(1)),
            stop: CancellationToken::new(),
        };
        for i in 0..count.max(1) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| anyhow::anyhow!("starting the runtime of session thread {i}: {e}"))?;
            let handle = runtime.handle().clone();
            let stopped = started.stop.clone();
            std::thread::Builder::new()
                .name(format!("fence-proxy-pg-{i}"))
                .spawn(move || runtime.block_on(stopped.cancelled()))
                .map_err(|e| anyhow::anyhow!("starting session thread {i}: {e}"))?;
            started.threads.push(SessionThread {
                handle,
                sessions: Arc::new(AtomicUsize::new(0)),
            });
        }
        Ok(started)
    }

    /// How many threads serve sessions.
    pub fn count(&self) -> usize {
        self.threads.len()
    }

    /// Runs `task` on the thread with the fewest sessions, tracked by `tracker`.
    pub fn spawn<F>(&self, tracker: &TaskTracker, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let thread = self
            .threads
            .iter()
            .min_by_key(|t| t.sessions.load(Ordering::Relaxed))
            .expect("SessionThreads::start made at least one thread");
        thread.sessions.fetch_add(1, Ordering::Relaxed);
        let placed = Placed(thread.sessions.clone());
        tracker.spawn_on(
            async move {
                let _placed = placed;
                task.await
            },
            &thread.handle,
        );
    }
}

impl Drop for SessionThreads {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: sessions are spread over the threads, each runs on one thread of the set, and the
    /// counts fall back when sessions end. Method: hold two sessions open on two threads, check
    /// they ran on different threads, end them, and check a third one is placed again.
    #[test]
    fn sessions_go_to_the_least_loaded_thread() {
        let threads = SessionThreads::start(2).unwrap();
        let tracker = TaskTracker::new();
        let (names_tx, names_rx) = std::sync::mpsc::channel();
        let release = CancellationToken::new();
        for _ in 0..2 {
            let names_tx = names_tx.clone();
            let release = release.clone();
            threads.spawn(&tracker, async move {
                let name = std::thread::current().name().map(str::to_owned);
                names_tx.send(name).unwrap();
                release.cancelled().await;
            });
        }
        let a = names_rx.recv().unwrap().unwrap();
        let b = names_rx.recv().unwrap().unwrap();
        assert!(a.starts_with("fence-proxy-pg-"), "{a}");
        assert_ne!(a, b, "two sessions placed on one thread of two");
        release.cancel();
        tracker.close();
        let waited = std::time::Instant::now();
        while !tracker.is_empty() {
            assert!(
                waited.elapsed() < std::time::Duration::from_secs(5),
                "sessions did not end"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(
            threads
                .threads
                .iter()
                .all(|t| t.sessions.load(Ordering::Relaxed) == 0),
            "session counts not released"
        );
    }
}

//! The threads that serve client connections: each runs a single-threaded Tokio runtime, and a
//! connection (a Postgres session, an HTTP connection) stays on the thread it was given, from
//! its first byte to its end.
//!
//! Why not Tokio's multi-threaded runtime: a relayed round trip is two socket reads and two
//! writes, and the proxy's own code is a small part of its CPU time. Most of the rest went to
//! context switches: with two workers, a connection woken by the I/O driver on one thread was
//! often run on the other, and workers woke and parked each other through futexes (profiles and
//! figures in docs/benchmarks.md, "fence-proxy Postgres front end" and "fence-proxy http against
//! nginx"). On a thread of its own, a connection's client and upstream sockets are polled by the
//! epoll loop that wakes it, with no hand-off. Connections are independent, so nothing is lost
//! by never moving one; new connections go to the thread that serves the fewest.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The connection threads; dropping it stops them (connections still open are dropped).
pub struct ConnectionThreads {
    threads: Vec<ConnectionThread>,
    /// Cancelled on drop: each thread then leaves its runtime's `block_on` and drops it.
    stop: CancellationToken,
}

struct ConnectionThread {
    /// Where this thread's connections are spawned (from the accept loop's runtime).
    handle: Handle,
    /// Connections now on this thread, to place new ones.
    connections: Arc<AtomicUsize>,
}

/// Decrements a thread's connection count when the connection's task ends or is dropped.
struct Placed(Arc<AtomicUsize>);

impl Drop for Placed {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How each connection thread is made, beyond its name.
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadSetup {
    /// Its stack in bytes; `None`: Rust's default for spawned threads (2 MiB).
    pub stack_bytes: Option<usize>,
    /// Runs on the thread before it serves any connection.
    pub on_start: Option<fn()>,
}

impl ConnectionThreads {
    /// Starts `count` threads (at least one; 0 means one per CPU) named `<name>-<i>`, each
    /// driving a current-thread runtime with I/O and timers until the value is dropped.
    pub fn start(count: usize, name: &str) -> anyhow::Result<ConnectionThreads> {
        Self::start_with(count, name, ThreadSetup::default())
    }

    /// [`ConnectionThreads::start`], each thread made as `setup` says.
    pub fn start_with(
        count: usize,
        name: &str,
        setup: ThreadSetup,
    ) -> anyhow::Result<ConnectionThreads> {
        let count = match count {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        // Built first, so that an error below drops it and stops the threads already started.
        let mut started = ConnectionThreads {
            threads: Vec::with_capacity(count.max(1)),
            stop: CancellationToken::new(),
        };
        for i in 0..count.max(1) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| anyhow::anyhow!("starting the runtime of thread {name}-{i}: {e}"))?;
            let handle = runtime.handle().clone();
            let stopped = started.stop.clone();
            let mut thread = std::thread::Builder::new().name(format!("{name}-{i}"));
            if let Some(bytes) = setup.stack_bytes {
                thread = thread.stack_size(bytes);
            }
            thread
                .spawn(move || {
                    if let Some(on_start) = setup.on_start {
                        on_start();
                    }
                    runtime.block_on(stopped.cancelled())
                })
                .map_err(|e| anyhow::anyhow!("starting thread {name}-{i}: {e}"))?;
            started.threads.push(ConnectionThread {
                handle,
                connections: Arc::new(AtomicUsize::new(0)),
            });
        }
        Ok(started)
    }

    /// How many threads serve connections.
    pub fn count(&self) -> usize {
        self.threads.len()
    }

    /// Runs `task` on the thread with the fewest connections, tracked by `tracker`.
    pub fn spawn<F>(&self, tracker: &TaskTracker, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let thread = self
            .threads
            .iter()
            .min_by_key(|t| t.connections.load(Ordering::Relaxed))
            .expect("ConnectionThreads::start made at least one thread");
        thread.connections.fetch_add(1, Ordering::Relaxed);
        let placed = Placed(thread.connections.clone());
        tracker.spawn_on(
            async move {
                let _placed = placed;
                task.await
            },
            &thread.handle,
        );
    }
}

impl Drop for ConnectionThreads {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: connections are spread over the threads, each runs on one thread of the set, and
    /// the counts fall back when connections end. Method: hold two connections' tasks open on
    /// two threads, check they ran on different threads, end them, and check the counts.
    #[test]
    fn connections_go_to_the_least_loaded_thread() {
        let threads = ConnectionThreads::start(2, "fence-proxy-test").unwrap();
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
        assert!(a.starts_with("fence-proxy-test-"), "{a}");
        assert_ne!(a, b, "two connections placed on one thread of two");
        release.cancel();
        tracker.close();
        let waited = std::time::Instant::now();
        while !tracker.is_empty() {
            assert!(
                waited.elapsed() < std::time::Duration::from_secs(5),
                "connections did not end"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(
            threads
                .threads
                .iter()
                .all(|t| t.connections.load(Ordering::Relaxed) == 0),
            "connection counts not released"
        );
    }
}

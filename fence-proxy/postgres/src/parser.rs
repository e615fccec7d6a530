//! Where Postgres's parser runs: always on a thread whose stack holds the deepest tree the text
//! can make, and never more parses of long texts at once than a few threads run.
//!
//! pg_query's protobuf output recurses once per tree level without a stack-depth check, so a
//! deep text (`SELECT -+-+...1`, one level per byte) would overflow a small stack and abort the
//! process. Spawning a thread per parse avoided that, but cost 70-510 µs a call against 11-15
//! µs for the parse itself (thread creation with its stack, and pg_query setting up its memory
//! contexts on every new thread; `cargo run --release -p fence-proxy-postgres --example
//! classify_cost`), on every simple Query. So texts are parsed where their deepest tree fits:
//! - up to [`INLINE_PARSE_SQL_BYTES`] (most statements) on the session thread itself, whose
//!   stack is made for it ([`session_threads`]): no hand-off at all (the session yields after a
//!   slow one, see `classify::classify_async`);
//! - up to [`POOLED_PARSE_SQL_BYTES`] on a few long-lived parser threads, so that no session
//!   thread stalls its other sessions for a long parse;
//! - longer ones on a second, smaller set of long-lived threads with the large stack, so a few
//!   slow parses never hold up the short ones. A long text costs hundreds of times its size in
//!   memory while it is parsed (about 100 MiB at the 128 KiB limit), and sessions are many: one
//!   thread per parse let a client with a few dozen connections run the proxy out of memory, so
//!   long texts wait their turn for one of [`LONG_PARSE_THREADS_MAX`] threads instead.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use fence_proxy_net::ThreadSetup;

use crate::limits::{
    CLASSIFY_STACK_BYTES, INLINE_PARSE_SQL_BYTES, LONG_PARSE_THREADS_MAX, POOLED_PARSE_SQL_BYTES,
    POOLED_PARSER_STACK_BYTES, SESSION_THREAD_STACK_BYTES,
};

/// At most this many pooled parser threads for texts up to [`POOLED_PARSE_SQL_BYTES`], however
/// many CPUs.
const POOL_THREADS_MAX: usize = 8;

/// What the parser returns for a text.
pub type Parsed = Result<pg_query::ParseResult, pg_query::Error>;

/// A parse to run, with what to do with its result.
type Job = Box<dyn FnOnce() + Send>;

/// Why a parse did not run: no parser thread could be started.
#[derive(Debug)]
pub struct NoParserThread(pub String);

thread_local! {
    /// Whether this thread was made by [`session_threads`], with a stack for inline parses.
    static PARSES_INLINE: Cell<bool> = const { Cell::new(false) };
}

/// How the session threads are made: with a stack for the deepest tree of a text of
/// [`INLINE_PARSE_SQL_BYTES`], and marked so that [`parse_here`] parses on them. The two come
/// together so that no thread is marked without the stack.
pub fn session_threads() -> ThreadSetup {
    ThreadSetup {
        stack_bytes: Some(SESSION_THREAD_STACK_BYTES),
        on_start: Some(|| PARSES_INLINE.with(|inline| inline.set(true))),
    }
}

/// Parses `sql` on the calling thread if it is short and the thread is a session thread made
/// by [`session_threads`]; `None` otherwise (then parse on a parser thread).
pub fn parse_here(sql: &str) -> Option<Parsed> {
    (sql.len() <= INLINE_PARSE_SQL_BYTES && PARSES_INLINE.with(Cell::get))
        .then(|| pg_query::parse(sql))
}

/// Parses `sql` on a parser thread and hands the text back with the result to `reply`, on that
/// thread. `reply` should do with the tree whatever needs it and pass on only what is left (the
/// tree of a long text is large: dropping it on the parser thread is what bounds the memory
/// parses hold at once). If the parse panics, `reply` is dropped unrun, which the caller sees as
/// a closed channel.
pub fn parse_on_parser_thread(
    sql: String,
    reply: impl FnOnce(String, Parsed) + Send + 'static,
) -> Result<(), NoParserThread> {
    let pool = if sql.len() <= POOLED_PARSE_SQL_BYTES {
        &SHORT
    } else {
        &LONG
    };
    pool.get()?.submit(Box::new(move || {
        let parsed = pg_query::parse(&sql);
        reply(sql, parsed);
    }))
}

/// [`parse_on_parser_thread`], waiting for the result on the calling thread.
pub fn parse_blocking(sql: &str) -> Result<Parsed, NoParserThread> {
    let (tx, rx) = channel();
    parse_on_parser_thread(sql.to_owned(), move |_, parsed| {
        let _ = tx.send(parsed);
    })?;
    rx.recv()
        .map_err(|_| NoParserThread("the parser thread panicked".to_owned()))
}

/// Starts the parser threads now, so that a proxy that cannot start them (a limit on threads or
/// address space) refuses to start instead of failing queries later. Without it they start on
/// the first parse that needs them.
pub fn start() -> Result<(), NoParserThread> {
    SHORT.get()?;
    LONG.get().map(drop)
}

/// Parser threads for texts up to [`POOLED_PARSE_SQL_BYTES`]: one per CPU, two to
/// [`POOL_THREADS_MAX`].
static SHORT: PoolSlot = PoolSlot {
    pool: OnceLock::new(),
    starting: Mutex::new(()),
    threads: |cpus| cpus.clamp(2, POOL_THREADS_MAX),
    stack_bytes: POOLED_PARSER_STACK_BYTES,
};

/// Parser threads for longer texts: one per two CPUs, two to [`LONG_PARSE_THREADS_MAX`].
static LONG: PoolSlot = PoolSlot {
    pool: OnceLock::new(),
    starting: Mutex::new(()),
    threads: |cpus| (cpus / 2).clamp(2, LONG_PARSE_THREADS_MAX),
    stack_bytes: CLASSIFY_STACK_BYTES,
};

/// A set of long-lived parser threads, started on first use. A failed start is not kept: the
/// next parse tries again (the threads that did start stop when their queue's sender is dropped).
struct PoolSlot {
    pool: OnceLock<Pool>,
    starting: Mutex<()>,
    /// How many threads, given the number of CPUs.
    threads: fn(usize) -> usize,
    /// Each thread's stack: reserved, not touched beyond what a parse uses.
    stack_bytes: usize,
}

impl PoolSlot {
    fn get(&self) -> Result<&Pool, NoParserThread> {
        if let Some(pool) = self.pool.get() {
            return Ok(pool);
        }
        let _starting = self.starting.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(pool) = self.pool.get() {
            return Ok(pool);
        }
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        let pool = Pool::start((self.threads)(cpus), self.stack_bytes).map_err(NoParserThread)?;
        Ok(self.pool.get_or_init(|| pool))
    }
}

/// Long-lived parser threads that take jobs from one queue, in the order they came. The queue
/// needs no bound of its own: each session waits for its parse before it reads on, so at most one
/// job per session is queued, and sessions are bounded (`--max-sessions`).
struct Pool {
    jobs: Mutex<Sender<Job>>,
}

impl Pool {
    fn start(threads: usize, stack_bytes: usize) -> Result<Pool, String> {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..threads {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name("fence-proxy-parse".to_owned())
                .stack_size(stack_bytes)
                .spawn(move || Pool::serve(&rx))
                .map_err(|e| format!("starting a parser thread: {e}"))?;
        }
        Ok(Pool {
            jobs: Mutex::new(tx),
        })
    }

    fn serve(jobs: &Mutex<Receiver<Job>>) {
        loop {
            // The lock is held only to take one job, not while it runs.
            let job = jobs.lock().unwrap_or_else(PoisonError::into_inner).recv();
            let Ok(job) = job else { return };
            // A panic ends this job only (its reply is dropped: the caller sees an error), not
            // the thread, so the pool never shrinks.
            let _ = catch_unwind(AssertUnwindSafe(job));
        }
    }

    fn submit(&self, job: Job) -> Result<(), NoParserThread> {
        let jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        jobs.send(job)
            .map_err(|_| NoParserThread("the parser threads have stopped".to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: a session thread parses the deepest tree a text it parses inline can hold without
    /// overflowing its stack, and only session threads parse inline. Method: on a connection
    /// thread made by [`session_threads`], `parse_here` of the longest inline text as a unary
    /// chain `-+-+...1` (one tree level per byte) answers; on another thread it declines.
    #[test]
    fn session_threads_parse_the_deepest_short_text_inline() {
        let deep = format!("SELECT {}1", "-+".repeat((INLINE_PARSE_SQL_BYTES - 8) / 2));
        assert!(deep.len() <= INLINE_PARSE_SQL_BYTES);
        assert!(parse_here(&deep).is_none(), "not a session thread");
        let threads =
            fence_proxy_net::ConnectionThreads::start_with(1, "parse-test", session_threads())
                .unwrap();
        let tracker = tokio_util::task::TaskTracker::new();
        let (tx, rx) = std::sync::mpsc::channel();
        let short = "SELECT 1".to_owned();
        threads.spawn(&tracker, async move {
            let parsed = parse_here(&deep).map(|p| p.map(drop).map_err(|e| e.to_string()));
            let _ = tx.send((parsed, parse_here(&short).is_some()));
        });
        let (parsed, short_inline) = rx.recv().unwrap();
        assert!(short_inline);
        // Postgres's grammar takes it; prost refuses to decode a tree this deep.
        assert!(
            parsed
                .as_ref()
                .is_some_and(|p| p.as_ref().is_err_and(|e| e.contains("recursion limit"))),
            "{parsed:?}"
        );
    }

    /// Goal: the pooled threads parse what the calling thread parses, and many callers at once
    /// each get their own text's result; the deepest tree a pooled text can hold comes back as
    /// an answer (prost refuses to decode it), never a stack overflow; so do texts above the
    /// pool's bound, on the long-text threads. Method: 64 threads each parse a distinct short
    /// text and the deepest pooled one; then long texts, deep and flat.
    #[test]
    fn pooled_and_long_parses_return_each_callers_result() {
        let deep = format!("SELECT {}1", "-+".repeat((POOLED_PARSE_SQL_BYTES - 8) / 2));
        assert!(deep.len() <= POOLED_PARSE_SQL_BYTES);
        let callers: Vec<_> = (0..64)
            .map(|i| {
                let deep = deep.clone();
                std::thread::spawn(move || {
                    let sql = format!("SELECT {i} AS c{i}");
                    let parsed = parse_blocking(&sql).unwrap().unwrap();
                    assert_eq!(pg_query::parse(&sql).unwrap().protobuf, parsed.protobuf);
                    let deep = parse_blocking(&deep).unwrap();
                    assert!(deep.is_err_and(|e| e.to_string().contains("recursion limit")));
                })
            })
            .collect();
        for c in callers {
            c.join().unwrap();
        }
        let long = format!("SELECT 1{}", " + 1".repeat(POOLED_PARSE_SQL_BYTES / 4));
        assert!(long.len() > POOLED_PARSE_SQL_BYTES);
        let parsed = parse_blocking(&long).unwrap();
        assert!(parsed.is_err_and(|e| e.to_string().contains("recursion limit")));
        let long = format!("SELECT 1{}", ", 1".repeat(POOLED_PARSE_SQL_BYTES / 3));
        assert!(long.len() > POOLED_PARSE_SQL_BYTES);
        assert!(parse_blocking(&long).unwrap().is_ok());
        assert!(parse_blocking("SELEC 1").unwrap().is_err());
    }
}

//! Calls waiting for a lock on this node, woken one at a time by applied events.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use lockd_core::Grant;
use tokio::sync::oneshot;

/// How a wait ended, as decided by the log.
#[derive(Debug, Clone, Copy)]
pub enum WaitEnd {
    Granted(Grant),
    TimedOut,
}

/// Waiting calls by request_id (the id itself, not a digest: a collision must never hand one
/// call another's grant). Only the event that names a request wakes its call: a release wakes
/// one waiter, never all of them.
#[derive(Default)]
pub struct WaitRegistry {
    calls: Mutex<HashMap<String, (u64, oneshot::Sender<WaitEnd>)>>,
    next_id: AtomicU64,
}

impl WaitRegistry {
    /// Registers a call before its Acquire is proposed, so a grant applied at once is not missed.
    /// A retry of the same request replaces the older call, which then sees its channel close.
    pub fn register(&self, request_id: &str) -> (u64, oneshot::Receiver<WaitEnd>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.calls
            .lock()
            .expect("waiters lock")
            .insert(request_id.to_owned(), (id, tx));
        (id, rx)
    }

    /// Removes a registration if it is still this call's.
    pub fn unregister(&self, request_id: &str, id: u64) {
        let mut calls = self.calls.lock().expect("waiters lock");
        if calls
            .get(request_id)
            .is_some_and(|(current, _)| *current == id)
        {
            calls.remove(request_id);
        }
    }

    pub fn notify(&self, request_id: &str, end: WaitEnd) {
        if let Some((_, tx)) = self.calls.lock().expect("waiters lock").remove(request_id) {
            let _ = tx.send(end);
        }
    }
}

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
/// call another's grant). Only the event that names a request wakes its calls: a release wakes
/// one waiter, never all of them.
///
/// A request may have several calls registered at once: a retry whose Acquire has not applied
/// yet beside the call it retries, or a call about to be refused for reusing the id with other
/// arguments. Registering therefore ends no other call's wait; only a call the log answered
/// Queued takes the wait over from the calls registered before it ([`WaitRegistry::take_over`]).
/// Their number is bounded by the node's parked waits (`crate::parked`).
#[derive(Default)]
pub struct WaitRegistry {
    /// Each request's calls, oldest registration first.
    calls: Mutex<HashMap<String, Vec<Registration>>>,
    next_id: AtomicU64,
}

/// One waiting call: its registration id (growing, so older calls have lower ids) and where its
/// wait's end goes.
type Registration = (u64, oneshot::Sender<WaitEnd>);

impl WaitRegistry {
    /// Registers a call before its Acquire is proposed, so a grant applied at once is not missed.
    pub fn register(&self, request_id: &str) -> (u64, oneshot::Receiver<WaitEnd>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.calls
            .lock()
            .expect("waiters lock")
            .entry(request_id.to_owned())
            .or_default()
            .push((id, tx));
        (id, rx)
    }

    /// Registration `id`'s Acquire was queued (a retry took the waiter over, or it joined the
    /// queue): the calls of the same request registered before it see their channel close.
    /// Not done at registration, since the newer call may yet be refused.
    pub fn take_over(&self, request_id: &str, id: u64) {
        if let Some(calls) = self.calls.lock().expect("waiters lock").get_mut(request_id) {
            calls.retain(|(other, _)| *other >= id);
        }
    }

    /// Removes registration `id`, if it is still there.
    pub fn unregister(&self, request_id: &str, id: u64) {
        let mut calls = self.calls.lock().expect("waiters lock");
        if let Some(list) = calls.get_mut(request_id) {
            list.retain(|(other, _)| *other != id);
            if list.is_empty() {
                calls.remove(request_id);
            }
        }
    }

    /// Ends the wait of every call registered for the request. The log decided the request, so
    /// the end is each call's answer; a call whose Acquire is still in flight answers from its
    /// own outcome instead (the same decision, read from the dedup record, or a refusal).
    pub fn notify(&self, request_id: &str, end: WaitEnd) {
        let calls = self.calls.lock().expect("waiters lock").remove(request_id);
        for (_, tx) in calls.into_iter().flatten() {
            let _ = tx.send(end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot::error::TryRecvError;

    fn grant() -> WaitEnd {
        WaitEnd::Granted(Grant {
            lease_id: lockd_core::LeaseId(7),
            fencing_token: lockd_core::FencingToken(3),
            expires_at_ms: 1,
            lease_ttl_ms: 1,
        })
    }

    /// Goal: a second call registered under a request id (a refused reuse of the id, or a retry
    /// not yet queued) ends no earlier call's wait, and the grant reaches the earlier call.
    /// Method: register twice, unregister the second, notify.
    #[test]
    fn registering_again_leaves_the_earlier_call_waiting() {
        let waits = WaitRegistry::default();
        let (_, mut owner) = waits.register("r");
        let (refused, _) = waits.register("r");
        assert!(matches!(owner.try_recv(), Err(TryRecvError::Empty)));
        waits.unregister("r", refused);
        assert!(matches!(owner.try_recv(), Err(TryRecvError::Empty)));
        waits.notify("r", grant());
        assert!(matches!(owner.try_recv(), Ok(WaitEnd::Granted(_))));
        assert!(waits.calls.lock().unwrap().is_empty());
    }

    /// Goal: a queued retry takes the wait over from the calls registered before it, not from
    /// those registered after it. Method: three registrations, the middle one takes over.
    #[test]
    fn a_queued_call_takes_over_from_older_calls_only() {
        let waits = WaitRegistry::default();
        let (_, mut older) = waits.register("r");
        let (middle, mut queued) = waits.register("r");
        let (_, mut newer) = waits.register("r");
        waits.take_over("r", middle);
        assert!(matches!(older.try_recv(), Err(TryRecvError::Closed)));
        waits.notify("r", WaitEnd::TimedOut);
        assert!(matches!(queued.try_recv(), Ok(WaitEnd::TimedOut)));
        assert!(matches!(newer.try_recv(), Ok(WaitEnd::TimedOut)));
    }
}

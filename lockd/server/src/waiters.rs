//! Calls waiting for a lock on this node, woken one request at a time by applied events.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lockd_core::{Grant, LeaseId, ResourceName};
use tokio::sync::oneshot;

/// How often at most a failed cancel of a waiter is logged: under overload every waiting call
/// that leaves may fail to propose its cancel, and the log must not flood with them.
const CANCEL_FAILURE_LOG_EVERY: Duration = Duration::from_secs(10);

/// Attempts kept per request to cancel once its last call leaves (see [`WaitRegistry::leave`]).
const LEFT_ATTEMPTS_MAX: usize = 32;

/// How a wait ended, as decided by the log, with the resource the log decided it on: a call
/// checks it against its own before answering, so that it never answers (nor signs a sequencer
/// for its resource) with a lease of another.
#[derive(Debug, Clone)]
pub enum WaitEnd {
    Granted(ResourceName, Grant),
    TimedOut(ResourceName),
}

impl WaitEnd {
    /// The resource the log decided the request on.
    pub fn resource(&self) -> &ResourceName {
        match self {
            WaitEnd::Granted(resource, _) | WaitEnd::TimedOut(resource) => resource,
        }
    }
}

/// Waiting calls by request: request_id (the id itself, not a digest: a collision must never
/// hand one call another's grant) and resource. Only the event that names a request on a
/// resource wakes its calls: a release wakes one waiter, never all of them, and a request id
/// reused for another resource once its record is forgotten is another request.
///
/// A request may have several calls registered at once: a retry whose Acquire has not applied
/// yet beside the call it retries, or a call about to be refused for reusing the id with other
/// arguments (which answers from its refusal and never reads its channel). Every call of the
/// request is told how it ended: the log decided it once, and a retry returns the first answer.
/// Their number is bounded by the node's parked waits (`crate::parked`).
///
/// A call that leaves without its answer while another call of its request with the same
/// arguments is still registered here does not cancel its attempt (the cancel of the current
/// attempt would pass over the request that the other call still waits for); it leaves the
/// attempt with the request, and the last call with those arguments to leave, answered or not,
/// takes them all to cancel ([`WaitRegistry::leave`]). A call with other arguments holds back
/// no cancel: the log refuses it, so it never waits for the request. Each such cancel ends
/// nothing unless its attempt is still the current one.
#[derive(Default)]
pub struct WaitRegistry {
    requests: Mutex<HashMap<(String, ResourceName), Request>>,
    next_id: AtomicU64,
    /// When a failed cancel was last logged.
    cancel_failure_logged: Mutex<Option<Instant>>,
}

/// One request's calls on this node.
#[derive(Default)]
struct Request {
    /// Each call's registration id, its arguments and where its wait's end goes.
    calls: Vec<(u64, CallArgs, oneshot::Sender<WaitEnd>)>,
    /// The attempts (lease ids) of calls that left without their answer, whose Acquire went into
    /// a batch, with their arguments: to cancel once no call with those arguments is left here.
    left: Vec<(LeaseId, CallArgs)>,
}

/// The arguments of a waiting Acquire besides its request id and resource, as the log compares
/// them to tell a retry from a reuse of the id: calls that differ in them are not one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallArgs {
    pub lease_ttl_ms: u64,
    pub wait_timeout_ms: u64,
    pub holder: String,
}

impl WaitRegistry {
    /// Registers a call before its Acquire is proposed, so a grant applied at once is not
    /// missed. Ends no other call's wait.
    pub fn register(
        &self,
        request_id: &str,
        resource: &ResourceName,
        args: CallArgs,
    ) -> (u64, oneshot::Receiver<WaitEnd>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.requests
            .lock()
            .expect("waiters lock")
            .entry((request_id.to_owned(), resource.clone()))
            .or_default()
            .calls
            .push((id, args, tx));
        (id, rx)
    }

    /// Registration `id` leaves: with its answer (`left` is `None`), or without it, leaving
    /// attempt `left`, whose Acquire went into a batch and may queue with no call to answer.
    /// Returns the attempts to cancel now: none while another call of the request with the same
    /// arguments is still registered here, all that calls with those arguments left once none
    /// is. Decided under the lock, so a call
    /// registering at the same moment either is counted or registers after the decision (its
    /// own attempt, proposed later, then takes the waiter back if one of these cancels passed
    /// it over).
    pub fn leave(
        &self,
        request_id: &str,
        resource: &ResourceName,
        id: u64,
        left: Option<LeaseId>,
    ) -> Vec<LeaseId> {
        let mut requests = self.requests.lock().expect("waiters lock");
        let key = (request_id.to_owned(), resource.clone());
        let Some(request) = requests.get_mut(&key) else {
            // Woken already: the log decided the request, so there is nothing to cancel.
            return Vec::new();
        };
        let Some(at) = request.calls.iter().position(|(other, ..)| *other == id) else {
            // Only a call still registered leaves its attempt: one that was woken (and left
            // before reading its end) belongs to a request the log decided; the calls
            // registered since are of a later Acquire.
            return Vec::new();
        };
        let (_, args, _) = request.calls.remove(at);
        if let Some(attempt) = left {
            // Bounded: a client that keeps one call waiting and sends retry after retry that
            // leaves would otherwise grow this list, and the cancels proposed at the end, without
            // limit. Only a client's own churn of one request gets past the bound, and the worst
            // it does then is leave its own request granted to nobody for one lease ttl, which
            // it could do by holding the lock.
            if request.left.len() == LEFT_ATTEMPTS_MAX {
                request.left.remove(0);
            }
            request.left.push((attempt, args.clone()));
        }
        if request.calls.iter().any(|(_, other, _)| *other == args) {
            return Vec::new();
        }
        let cancel = if request.calls.is_empty() {
            requests.remove(&key).map(|r| r.left).unwrap_or_default()
        } else {
            let (cancel, keep) = std::mem::take(&mut request.left)
                .into_iter()
                .partition(|(_, a)| *a == args);
            request.left = keep;
            cancel
        };
        cancel.into_iter().map(|(attempt, _)| attempt).collect()
    }

    /// Ends the wait of every call registered for the request on `end`'s resource. The log
    /// decided the request, so the end is each call's answer (a call whose Acquire is still in
    /// flight answers from its own outcome instead: the same decision, read from the dedup
    /// record, or a refusal), and the attempts of calls that left need no cancel.
    pub fn notify(&self, request_id: &str, end: WaitEnd) {
        let key = (request_id.to_owned(), end.resource().clone());
        let request = self.requests.lock().expect("waiters lock").remove(&key);
        for (_, _, tx) in request.into_iter().flat_map(|r| r.calls) {
            let _ = tx.send(end.clone());
        }
    }

    /// Logs a cancel that could not be proposed, at most once per [`CANCEL_FAILURE_LOG_EVERY`].
    pub fn log_cancel_failure(&self, error: &dyn std::fmt::Display) {
        let mut last = self.cancel_failure_logged.lock().expect("waiters log lock");
        if last.is_none_or(|t| t.elapsed() >= CANCEL_FAILURE_LOG_EVERY) {
            *last = Some(Instant::now());
            tracing::warn!(
                error = %error,
                "could not remove a cancelled waiter; the reaper removes it at its deadline \
                 (further failures in the next {} s are not logged)",
                CANCEL_FAILURE_LOG_EVERY.as_secs()
            );
        }
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.requests.lock().unwrap().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot::error::TryRecvError;

    fn args() -> CallArgs {
        CallArgs {
            lease_ttl_ms: 30_000,
            wait_timeout_ms: 10_000,
            holder: "h".into(),
        }
    }

    fn resource(name: &str) -> ResourceName {
        lockd_core::validate::resource(name).unwrap()
    }

    fn grant(on: &str) -> WaitEnd {
        WaitEnd::Granted(
            resource(on),
            Grant {
                lease_id: LeaseId(7),
                fencing_token: lockd_core::FencingToken(3),
                expires_at_ms: 1,
                lease_ttl_ms: 1,
            },
        )
    }

    /// Goal: a second call registered under a request id (a refused reuse of the id, or a retry
    /// not yet queued) ends no earlier call's wait, and the grant reaches the earlier call.
    /// Method: register twice, the second leaves with its answer, notify.
    #[test]
    fn registering_again_leaves_the_earlier_call_waiting() {
        let waits = WaitRegistry::default();
        let a = resource("a");
        let (_, mut owner) = waits.register("r", &a, args());
        let (refused, _) = waits.register("r", &a, args());
        assert!(matches!(owner.try_recv(), Err(TryRecvError::Empty)));
        assert!(waits.leave("r", &a, refused, None).is_empty());
        assert!(matches!(owner.try_recv(), Err(TryRecvError::Empty)));
        waits.notify("r", grant("a"));
        assert!(matches!(owner.try_recv(), Ok(WaitEnd::Granted(..))));
        assert!(waits.is_empty());
    }

    /// Goal (review of f67ece3, findings 1 and 3): every call of a request gets its end,
    /// whatever order they registered in; none is retired by another. Method: three
    /// registrations, one grant.
    #[test]
    fn every_call_of_the_request_gets_its_end() {
        let waits = WaitRegistry::default();
        let a = resource("a");
        let mut calls: Vec<_> = (0..3).map(|_| waits.register("r", &a, args()).1).collect();
        waits.notify("r", WaitEnd::TimedOut(a.clone()));
        for call in &mut calls {
            assert!(matches!(call.try_recv(), Ok(WaitEnd::TimedOut(r)) if r == a));
        }
        assert!(waits.is_empty());
    }

    /// Goal (review of f67ece3, finding 2): a call waiting for one resource is never woken by
    /// an event of another resource under the same request id (a request that reused the id
    /// once the first one's record was forgotten). On f67ece3 `notify` woke every call of the
    /// id, and the call answered with the other resource's lease and a sequencer for its own
    /// resource signed with that lease's token. Method: register for `a`, notify a grant of
    /// `b` under the same id, then one of `a`.
    #[test]
    fn a_grant_of_another_resource_wakes_no_call_of_this_one() {
        let waits = WaitRegistry::default();
        let (a, b) = (resource("a"), resource("b"));
        let (_, mut on_a) = waits.register("r", &a, args());
        let (_, mut on_b) = waits.register("r", &b, args());
        waits.notify("r", grant("b"));
        assert!(matches!(on_a.try_recv(), Err(TryRecvError::Empty)));
        assert!(matches!(on_b.try_recv(), Ok(WaitEnd::Granted(r, _)) if r == b));
        waits.notify("r", grant("a"));
        assert!(matches!(on_a.try_recv(), Ok(WaitEnd::Granted(r, _)) if r == a));
    }

    /// Goal (review of f67ece3, finding 1): a call that leaves without its answer cancels
    /// nothing while another call of its request waits here (the cancel of the current attempt
    /// would pass over the request the other call waits for), and the request's last call to
    /// leave, answered or not, takes every attempt left to cancel. Method: two calls; the
    /// first leaves without its answer, then the second with it; then the same with a third
    /// call registering before the last leaves.
    #[test]
    fn a_call_that_leaves_cancels_only_once_no_call_of_its_request_is_left() {
        let waits = WaitRegistry::default();
        let a = resource("a");
        let (first, _) = waits.register("r", &a, args());
        let (second, _) = waits.register("r", &a, args());
        assert!(waits.leave("r", &a, first, Some(LeaseId(1))).is_empty());
        assert_eq!(waits.leave("r", &a, second, None), vec![LeaseId(1)]);
        assert!(waits.is_empty());

        let (first, _) = waits.register("r", &a, args());
        assert_eq!(
            waits.leave("r", &a, first, Some(LeaseId(2))),
            vec![LeaseId(2)]
        );
        let (second, _) = waits.register("r", &a, args());
        let (third, _) = waits.register("r", &a, args());
        assert!(waits.leave("r", &a, second, Some(LeaseId(3))).is_empty());
        assert_eq!(
            waits.leave("r", &a, third, Some(LeaseId(4))),
            vec![LeaseId(3), LeaseId(4)]
        );
        assert!(waits.is_empty());
    }

    /// Goal: a call woken by the log's end of its request and gone before reading it leaves no
    /// attempt to cancel, neither now nor for a later call of the same id. Method: notify, then
    /// the woken call leaves without its answer while a later call is registered.
    #[test]
    fn a_woken_call_leaves_nothing_to_cancel() {
        let waits = WaitRegistry::default();
        let a = resource("a");
        let (woken, _rx) = waits.register("r", &a, args());
        waits.notify("r", grant("a"));
        let (later, _) = waits.register("r", &a, args());
        assert!(waits.leave("r", &a, woken, Some(LeaseId(1))).is_empty());
        assert!(waits.leave("r", &a, later, None).is_empty());
        assert!(waits.is_empty());
    }

    /// Goal: the attempts a request keeps to cancel are bounded, however many calls of it leave
    /// while one stays (a client's churn of retries must not grow the registry, or the cancels
    /// proposed at the end, without limit); the latest are kept. Method: one call stays while
    /// 100 others register and leave without their answer; then the last leaves.
    #[test]
    fn the_attempts_left_to_cancel_are_bounded() {
        let waits = WaitRegistry::default();
        let a = resource("a");
        let (stays, _rx) = waits.register("r", &a, args());
        for i in 0..100u128 {
            let (churn, _) = waits.register("r", &a, args());
            assert!(waits.leave("r", &a, churn, Some(LeaseId(i))).is_empty());
        }
        let left = waits.leave("r", &a, stays, None);
        let expected: Vec<LeaseId> = (100 - LEFT_ATTEMPTS_MAX as u128..100)
            .map(LeaseId)
            .collect();
        assert_eq!(left, expected);
        assert!(waits.is_empty());
    }

    /// Goal (review of 41ff66d, M1): a call with other arguments under the same request id
    /// (refused by the log: it never waits for the request) holds back no cancel of a call that
    /// left, so the caller who left is passed over at once. Method: the owner and a call with
    /// another ttl are registered; the owner leaves without its answer; then the other call
    /// leaves answered (its refusal).
    #[test]
    fn a_call_with_other_arguments_holds_back_no_cancel() {
        let waits = WaitRegistry::default();
        let a = resource("a");
        let (owner, _) = waits.register("r", &a, args());
        let other = CallArgs {
            lease_ttl_ms: 10_000,
            ..args()
        };
        let (refused, _) = waits.register("r", &a, other);
        assert_eq!(
            waits.leave("r", &a, owner, Some(LeaseId(1))),
            vec![LeaseId(1)]
        );
        assert!(waits.leave("r", &a, refused, None).is_empty());
        assert!(waits.is_empty());
    }
}

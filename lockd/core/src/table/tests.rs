//! Unit tests of the lock table, and a property test against a plain reference model.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::command::{Batch, Command, EndWaitReason, Stamp};
use crate::validate;

thread_local! {
    /// Test hook: while set, every keyed digest of this thread's tables is 0, so all request
    /// keys, argument digests and tenant tags collide (what a client who could construct
    /// collisions would get).
    static COLLIDE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub(super) fn collide(digest: u128) -> u128 {
    if COLLIDE.with(|c| c.get()) { 0 } else { digest }
}

/// Runs `f` with every keyed digest colliding.
fn with_collisions<T>(f: impl FnOnce() -> T) -> T {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            COLLIDE.with(|c| c.set(false));
        }
    }
    COLLIDE.with(|c| c.set(true));
    let _reset = Reset;
    f()
}

fn res(name: &str) -> ResourceName {
    validate::resource(name).unwrap()
}

fn policy() -> Policy {
    Policy::default()
}

/// Drives one table. By default one leader process (session 1) stamps every batch with
/// `mono_ms = now`, so the table's clock follows `now`; `legacy` sends unstamped batches as lockd
/// wrote them before stamps.
struct Harness {
    table: LockTable,
    now: i64,
    term: u64,
    session: u64,
    legacy: bool,
    pol: Policy,
    next_lease: u128,
    events: Vec<Event>,
}

impl Harness {
    fn new() -> Self {
        Harness {
            table: LockTable::new(),
            now: 1_000_000,
            term: 1,
            session: 1,
            legacy: false,
            pol: policy(),
            next_lease: 1,
            events: Vec::new(),
        }
    }

    fn legacy() -> Self {
        Harness {
            legacy: true,
            ..Harness::new()
        }
    }

    fn stamp(&self) -> Option<Stamp> {
        (!self.legacy).then_some(Stamp {
            term: self.term,
            session: self.session,
            mono_ms: self.now as u64,
            key_seed: 0x5eed,
        })
    }

    fn run(&mut self, cmd: Command) -> Outcome {
        let batch = Batch {
            now_ms: self.now,
            stamp: self.stamp(),
            policy: self.pol,
            commands: vec![cmd],
        };
        let out = self
            .table
            .apply(self.term, &batch, &mut self.events)
            .remove(0);
        self.table.check_consistency().unwrap();
        out
    }

    fn acquire(&mut self, r: &str, req: &str, ttl: u64, wait: u64) -> Outcome {
        self.next_lease += 1;
        self.run(Command::AcquireV2 {
            resource: res(r),
            request_id: req.into(),
            lease_ttl_ms: ttl,
            wait_timeout_ms: wait,
            holder: format!("holder-{req}"),
            lease_id: LeaseId(self.next_lease),
        })
    }

    fn granted(&mut self, r: &str, req: &str) -> Grant {
        match self.acquire(r, req, 10_000, 0) {
            Outcome::Granted(g) => g,
            other => panic!("expected a grant, got {other:?}"),
        }
    }
}

#[test]
fn acquire_renew_release_and_held() {
    let mut h = Harness::new();
    let g = h.granted("orders/1", "r1");
    assert_eq!(
        h.acquire("orders/1", "r2", 10_000, 0),
        Outcome::Held {
            holder: "holder-r1".into()
        }
    );
    h.now += 5_000;
    assert_eq!(
        h.run(Command::Renew {
            resource: res("orders/1"),
            lease_id: g.lease_id,
            lease_ttl_ms: 0
        }),
        Outcome::Renewed {
            expires_at_ms: h.now + 10_000,
            lease_ttl_ms: 10_000
        }
    );
    assert_eq!(
        h.run(Command::Release {
            resource: res("orders/1"),
            lease_id: LeaseId(999)
        }),
        Outcome::Released(false)
    );
    assert_eq!(
        h.run(Command::Release {
            resource: res("orders/1"),
            lease_id: g.lease_id
        }),
        Outcome::Released(true)
    );
    assert_eq!(h.table.stats().resources, 0, "idle record deleted");
    let g2 = h.granted("orders/1", "r3");
    assert!(g2.fencing_token > g.fencing_token);
}

#[test]
fn superseded_lease_never_touches_the_new_holder() {
    let mut h = Harness::new();
    let old = h.granted("r", "a");
    h.now += 10_000; // old lease due
    let new = h.granted("r", "b");
    assert!(new.fencing_token > old.fencing_token);
    assert_eq!(
        h.run(Command::Release {
            resource: res("r"),
            lease_id: old.lease_id
        }),
        Outcome::Released(false)
    );
    assert_eq!(
        h.run(Command::Renew {
            resource: res("r"),
            lease_id: old.lease_id,
            lease_ttl_ms: 0
        }),
        Outcome::NotFound
    );
    assert!(h.table.describe(&res("r")).held);
    assert_eq!(h.table.describe(&res("r")).fencing_token, new.fencing_token);
}

#[test]
fn retry_returns_original_grant_and_rejects_other_arguments() {
    let mut h = Harness::new();
    let g = h.granted("r", "req");
    assert_eq!(h.acquire("r", "req", 10_000, 0), Outcome::Granted(g));
    match h.acquire("other", "req", 10_000, 0) {
        Outcome::InvalidArgument(msg) => assert!(msg.contains("\"req\""), "{msg}"),
        other => panic!("{other:?}"),
    }
    // Even after the lease is released, the retry gets the original lease (whose Renew will
    // answer NOT_FOUND), never a second lease.
    h.run(Command::Release {
        resource: res("r"),
        lease_id: g.lease_id,
    });
    assert_eq!(h.acquire("r", "req", 10_000, 0), Outcome::Granted(g));
    assert!(!h.table.describe(&res("r")).held);
}

/// Goal (review "clients2" finding 3): a request id is a credential (repeating the Acquire with it
/// returns the lease id), so the table's messages, which reach clients and their logs, show its
/// first 8 characters only, also when the server scoped it to an identity. Method: reuse a long id
/// with other arguments, and collide a queued one (the two InvalidArgument messages).
#[test]
fn review_clients2_finding3_messages_show_request_ids_shortened() {
    let long = "0123456789abcdef0123456789abcdef";
    let scoped = format!("\u{1}cert:alice\u{1}{long}");
    for id in [long, scoped.as_str()] {
        let mut h = Harness::new();
        h.granted("r", id);
        match h.acquire("other", id, 10_000, 0) {
            Outcome::InvalidArgument(msg) => assert!(
                msg.contains("\"01234567…\"")
                    && !msg.contains("89abcdef")
                    && !msg.contains("alice"),
                "{msg}"
            ),
            other => panic!("{other:?}"),
        }
        let mut h = Harness::new();
        h.granted("a/x", "holder");
        with_collisions(|| {
            assert_eq!(
                h.acquire("a/x", id, 10_000, 60_000),
                Outcome::Queued { position: 1 }
            );
            match h.acquire("b/y", id, 10_000, 60_000) {
                Outcome::InvalidArgument(msg) => assert!(
                    msg.contains("queued on another")
                        && msg.contains("\"01234567…\"")
                        && !msg.contains("89abcdef"),
                    "{msg}"
                ),
                other => panic!("{other:?}"),
            }
        });
    }
    assert_eq!(crate::types::shown_request_id("x"), "\"x\"");
    assert_eq!(crate::types::shown_request_id("01234567"), "\"01234567\"");
}

/// Digest collisions: before keyed digests, `Acquire(B, "x")` whose argument hash collides with the
/// queued `Acquire(A, "x")` found A's Waiting record, did not find itself in B's queue and hit the
/// INV-QUEUE-ONCE panic on every replica (and again at every restart: the entry is committed). With
/// every digest forced to collide, the same commands are answered with an error.
#[test]
fn issue14_finding1_colliding_digests_are_an_error_not_a_panic() {
    let mut h = Harness::new();
    h.granted("a/x", "holder");
    with_collisions(|| {
        assert_eq!(
            h.acquire("a/x", "x", 10_000, 60_000),
            Outcome::Queued { position: 1 }
        );
        match h.acquire("b/y", "x", 10_000, 60_000) {
            Outcome::InvalidArgument(msg) => assert!(msg.contains("\"x\""), "{msg}"),
            other => panic!("{other:?}"),
        }
        // Another request_id with the same (colliding) key is answered too, and cancelling it
        // never removes the queued request it collides with (waiters are matched by id).
        h.acquire("b/y", "z", 10_000, 60_000);
        h.run(Command::EndWait {
            resource: res("a/x"),
            request_id: "z".into(),
            reason: EndWaitReason::Cancelled,
        });
        assert_eq!(h.table.describe(&res("a/x")).waiters, 1);
        assert_eq!(
            h.acquire("a/x", "x", 10_000, 60_000),
            Outcome::Queued { position: 1 }
        );
    });
}

/// Digest collisions: request keys and argument digests are keyed with the table's replicated
/// secret, so the same request_id has unrelated keys in two clusters and a client cannot precompute
/// collisions.
#[test]
fn issue14_finding1_request_keys_are_keyed_with_the_table_secret() {
    let key_with = |seed: u128| {
        let mut t = LockTable::new();
        let batch = Batch {
            now_ms: 1,
            stamp: Some(Stamp {
                term: 1,
                session: 1,
                mono_ms: 1,
                key_seed: seed,
            }),
            policy: policy(),
            commands: vec![],
        };
        t.apply(1, &batch, &mut Vec::new());
        let r = res("r");
        (t.ident_key("id-1"), t.ident("id-1", &r, 1_000, 0, "h").args)
    };
    let (a, b) = (key_with(1), key_with(2));
    assert_ne!(a.0, b.0);
    assert_ne!(a.1, b.1);
    assert_ne!(a.0, RequestKey::of("id-1"));
}

fn cancel_attempt(r: &str, req: &str, attempt: LeaseId) -> Command {
    Command::EndWaitAttempt {
        resource: res(r),
        request_id: req.into(),
        reason: EndWaitReason::Cancelled,
        attempt,
    }
}

/// The lease id of the grant that woke a waiter, if a grant did.
fn woken(events: &[Event], request_id: &str) -> Option<LeaseId> {
    events.iter().find_map(|e| match e.kind {
        EventKind::Granted {
            to_waiter: Some(_),
            grant,
        } if e.request_id == request_id => Some(grant.lease_id),
        _ => None,
    })
}

/// A retried waiter, first order: the retry of a waiting acquire commits, then the cancel its
/// dropped first call proposed lands. Before attempts were named, the cancel removed the waiter and
/// its record, and the parked retry slept until its timeout although the lock was freed. The cancel
/// names the attempt it ends, and a retry has replaced that attempt: nothing happens.
#[test]
fn issue14_finding4_a_late_cancel_never_removes_the_retry() {
    let mut h = Harness::new();
    let g = h.granted("r", "holder");
    assert_eq!(
        h.acquire("r", "w1", 10_000, 60_000),
        Outcome::Queued { position: 1 }
    );
    let first_attempt = LeaseId(h.next_lease);
    assert_eq!(
        h.acquire("r", "w2", 10_000, 60_000),
        Outcome::Queued { position: 2 }
    );
    // The retry of w1 (a new call, a new attempt).
    assert_eq!(
        h.acquire("r", "w1", 10_000, 60_000),
        Outcome::Queued { position: 1 }
    );
    let retry_attempt = LeaseId(h.next_lease);
    assert_eq!(
        h.run(cancel_attempt("r", "w1", first_attempt)),
        Outcome::WaitCancelled
    );
    assert_eq!(h.table.describe(&res("r")).waiters, 2);
    h.events.clear();
    h.run(Command::Release {
        resource: res("r"),
        lease_id: g.lease_id,
    });
    assert_eq!(
        woken(&h.events, "w1"),
        Some(retry_attempt),
        "{:?}",
        h.events
    );
}

/// A retried waiter, second order: the cancel lands first, then the retry. Before, the retry went
/// to the back of the queue; it takes back its place.
#[test]
fn issue14_finding4_a_retry_after_its_cancel_takes_back_its_place() {
    let mut h = Harness::new();
    let g = h.granted("r", "holder");
    assert_eq!(
        h.acquire("r", "w1", 10_000, 60_000),
        Outcome::Queued { position: 1 }
    );
    let first_attempt = LeaseId(h.next_lease);
    assert_eq!(
        h.acquire("r", "w2", 10_000, 60_000),
        Outcome::Queued { position: 2 }
    );
    assert_eq!(
        h.run(cancel_attempt("r", "w1", first_attempt)),
        Outcome::WaitCancelled
    );
    // While cancelled it is not counted.
    assert_eq!(h.table.describe(&res("r")).waiters, 1);
    assert_eq!(
        h.acquire("r", "w2", 10_000, 60_000),
        Outcome::Queued { position: 1 }
    );
    assert_eq!(
        h.acquire("r", "w1", 10_000, 60_000),
        Outcome::Queued { position: 1 }
    );
    let retry_attempt = LeaseId(h.next_lease);
    assert_eq!(
        h.acquire("r", "w2", 10_000, 60_000),
        Outcome::Queued { position: 2 }
    );
    h.events.clear();
    h.run(Command::Release {
        resource: res("r"),
        lease_id: g.lease_id,
    });
    assert_eq!(
        woken(&h.events, "w1"),
        Some(retry_attempt),
        "{:?}",
        h.events
    );
}

/// A cancelled waiter that is not retried is never granted: the hand-off passes it by, and its
/// request_id then starts afresh.
#[test]
fn a_cancelled_waiter_is_passed_over() {
    let mut h = Harness::new();
    let g = h.granted("r", "holder");
    h.acquire("r", "w1", 10_000, 60_000);
    let attempt = LeaseId(h.next_lease);
    h.acquire("r", "w2", 10_000, 60_000);
    h.run(cancel_attempt("r", "w1", attempt));
    h.events.clear();
    h.run(Command::Release {
        resource: res("r"),
        lease_id: g.lease_id,
    });
    assert!(woken(&h.events, "w1").is_none());
    assert!(woken(&h.events, "w2").is_some());
    assert_eq!(h.table.describe(&res("r")).waiters, 0);
    assert_eq!(
        h.acquire("r", "w1", 10_000, 60_000),
        Outcome::Queued { position: 1 }
    );
}

/// Dedup retention of a granted waiter: a waiter granted after a long wait must find its grant on
/// retry for the full retention after the grant. Before, the record kept its enqueue time: granted
/// after 288 s, it was forgotten 312 s later and a retry 360 s after the grant was a new request.
#[test]
fn issue14_finding8d_a_waiters_grant_is_remembered_for_the_retention_after_the_grant() {
    let mut h = Harness::new();
    let g = h.granted("r", "holder");
    h.acquire("r", "w", 10_000, 300_000);
    for _ in 0..32 {
        h.now += 9_000;
        h.run(Command::Renew {
            resource: res("r"),
            lease_id: g.lease_id,
            lease_ttl_ms: 0,
        });
    }
    h.events.clear();
    h.run(Command::Release {
        resource: res("r"),
        lease_id: g.lease_id,
    });
    let granted = woken(&h.events, "w").expect("w granted");
    h.now += 360_000;
    match h.acquire("r", "w", 10_000, 300_000) {
        Outcome::Granted(again) => assert_eq!(again.lease_id, granted),
        other => panic!("{other:?}"),
    }
    // And forgotten once the retention after the grant has passed.
    h.now += 240_001;
    h.run(Command::Reap { resource: res("r") });
    assert!(!matches!(
        h.acquire("r", "w", 10_000, 300_000),
        Outcome::Granted(again) if again.lease_id == granted
    ));
}

/// Tenant quotas: one tenant's acquire/release loop with fresh request_ids, or its many held
/// resources, exhausts its own quota and not the others': tenant B is still served.
#[test]
fn issue14_finding5_a_tenant_flood_leaves_other_tenants_served() {
    let mut h = Harness::new();
    h.pol = Policy {
        dedup_records_per_tenant_max: 50,
        active_resources_per_tenant_max: 10,
        ..policy()
    };
    let mut refused = None;
    for i in 0..100 {
        match h.acquire("a/loop", &format!("a-{i}"), 10_000, 0) {
            Outcome::Granted(g) => {
                h.run(Command::Release {
                    resource: res("a/loop"),
                    lease_id: g.lease_id,
                });
            }
            Outcome::Exhausted(_, msg) => {
                refused = Some((i, msg));
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    let (i, msg) = refused.expect("the flood is refused");
    assert_eq!(i, 50);
    assert!(
        msg.contains("dedup_records_per_tenant_max") && msg.contains("\"a\""),
        "{msg}"
    );
    assert!(matches!(
        h.acquire("b/x", "b-1", 10_000, 0),
        Outcome::Granted(_)
    ));
    // A retry of a recorded request is still answered (it makes no new record).
    assert!(matches!(
        h.acquire("a/loop", "a-3", 10_000, 0),
        Outcome::Granted(_)
    ));

    for i in 0..10 {
        assert!(matches!(
            h.acquire(&format!("c/{i}"), &format!("c-{i}"), 10_000, 0),
            Outcome::Granted(_)
        ));
    }
    match h.acquire("c/10", "c-10", 10_000, 0) {
        Outcome::Exhausted(_, msg) => {
            assert!(msg.contains("active_resources_per_tenant_max"), "{msg}")
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        h.acquire("d/0", "d-0", 10_000, 0),
        Outcome::Granted(_)
    ));
    // Records are forgotten after the retention; then the tenant acquires again.
    h.now += 600_001;
    h.run(Command::Reap {
        resource: res("c/0"),
    });
    assert!(matches!(
        h.acquire("a/loop", "a-new", 10_000, 0),
        Outcome::Granted(_)
    ));
}

#[test]
fn fifo_handoff_wakes_only_the_head() {
    let mut h = Harness::new();
    let first = h.granted("r", "holder");
    for (i, w) in ["w1", "w2", "w3"].iter().enumerate() {
        assert_eq!(
            h.acquire("r", w, 10_000, 60_000),
            Outcome::Queued {
                position: i as u32 + 1
            }
        );
    }
    assert_eq!(h.table.describe(&res("r")).waiters, 3);
    h.events.clear();
    h.run(Command::Release {
        resource: res("r"),
        lease_id: first.lease_id,
    });
    let woken: Vec<_> = h
        .events
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::Granted {
                to_waiter: Some(k),
                grant,
            } => Some((k, grant)),
            _ => None,
        })
        .collect();
    assert_eq!(woken.len(), 1);
    assert_eq!(woken[0].0, h.table.ident_key("w1"));
    assert!(woken[0].1.fencing_token > first.fencing_token);
    // A retry of w2 keeps its place (now first in line).
    assert_eq!(
        h.acquire("r", "w2", 10_000, 60_000),
        Outcome::Queued { position: 1 }
    );
    // Cancel w2: w3 moves up.
    assert_eq!(
        h.run(Command::EndWait {
            resource: res("r"),
            request_id: "w2".into(),
            reason: EndWaitReason::Cancelled
        }),
        Outcome::WaitCancelled
    );
    assert_eq!(
        h.acquire("r", "w3", 10_000, 60_000),
        Outcome::Queued { position: 1 }
    );
}

#[test]
fn waiter_deadline_and_limits() {
    let mut h = Harness::new();
    h.granted("t/r", "holder");
    assert_eq!(
        h.acquire("t/r", "w", 10_000, 2_000),
        Outcome::Queued { position: 1 }
    );
    h.now += 2_000;
    h.run(Command::Reap {
        resource: res("t/r"),
    });
    assert_eq!(h.table.describe(&res("t/r")).waiters, 0);
    assert_eq!(
        h.acquire("t/r", "w", 10_000, 2_000),
        Outcome::WaitTimedOut,
        "original outcome"
    );

    let tight = Policy {
        waiters_per_resource_max: 1,
        waiters_per_tenant_max: 2,
        ..Policy::default()
    };
    let acquire = |h: &mut Harness, r: &str, req: &str| {
        let batch = Batch {
            now_ms: h.now,
            stamp: h.stamp(),
            policy: tight,
            commands: vec![Command::Acquire {
                resource: res(r),
                request_id: req.into(),
                lease_ttl_ms: 10_000,
                wait_timeout_ms: 60_000,
                holder: String::new(),
                lease_id: LeaseId(7_000 + req.len() as u128),
            }],
        };
        h.table.apply(h.term, &batch, &mut h.events).remove(0)
    };
    assert_eq!(
        acquire(&mut h, "t/r", "q1"),
        Outcome::Queued { position: 1 }
    );
    match acquire(&mut h, "t/r", "q2") {
        Outcome::Exhausted(_, msg) => assert!(msg.contains("waiters_per_resource_max"), "{msg}"),
        other => panic!("{other:?}"),
    }
    h.granted("t/s", "holder-s");
    assert_eq!(
        acquire(&mut h, "t/s", "q3"),
        Outcome::Queued { position: 1 }
    );
    h.granted("t/u", "holder-u");
    match acquire(&mut h, "t/u", "q4") {
        Outcome::Exhausted(_, msg) => assert!(msg.contains("waiters_per_tenant_max"), "{msg}"),
        other => panic!("{other:?}"),
    }
    h.table.check_consistency().unwrap();
    assert_eq!(
        h.table.describe(&res("t/r")).waiters,
        1,
        "queue intact after a refusal"
    );
}

#[test]
fn legacy_new_term_never_expires_a_lease_before_stamp_plus_ttl() {
    let mut h = Harness::legacy();
    let g = h.granted("r", "a");
    assert_eq!(g.expires_at_ms, h.now + 10_000);
    // The next leader's clock is 8 s ahead: without the rule it would expire the lease at once
    // on its clock, 8 s early in real time.
    h.term = 2;
    h.now += 9_000;
    h.run(Command::Reap { resource: res("r") });
    let view = h.table.describe(&res("r"));
    assert!(view.held);
    assert_eq!(view.expires_at_ms, h.now + 10_000);
    h.now += 9_999;
    h.run(Command::Reap { resource: res("r") });
    assert!(h.table.describe(&res("r")).held);
    h.now += 1;
    h.run(Command::Reap { resource: res("r") });
    assert!(!h.table.describe(&res("r")).held);
}

/// Applies one stamped batch of `cmds` from leader `session` in entry term `term`.
fn stamped(
    table: &mut LockTable,
    term: u64,
    session: u64,
    wall_ms: i64,
    mono_ms: u64,
    cmds: Vec<Command>,
) -> Vec<Outcome> {
    let batch = Batch {
        now_ms: wall_ms,
        stamp: Some(Stamp {
            term,
            session,
            mono_ms,
            key_seed: 0x5eed,
        }),
        policy: policy(),
        commands: cmds,
    };
    let out = table.apply(term, &batch, &mut Vec::new());
    table.check_consistency().unwrap();
    out
}

fn acquire_cmd(r: &str, req: &str, ttl: u64, wait: u64, id: u128) -> Command {
    Command::Acquire {
        resource: res(r),
        request_id: req.into(),
        lease_ttl_ms: ttl,
        wait_timeout_ms: wait,
        holder: format!("holder-{req}"),
        lease_id: LeaseId(id),
    }
}

fn reap_cmd(r: &str) -> Command {
    Command::Reap { resource: res(r) }
}

/// An early expiry found by the chaos suite (seed 20261130, log indexes 1542..1550): a lease of ttl
/// 2 s is granted by leader 3; node 3 restarts as leader of the SAME term (openraft 0.9 does this)
/// with its clock 2.4 s ahead, and its first batch arrives 100 ms later. The old rule took the max
/// of the stamps and, the term being unchanged, skipped the new-term floor: the table jumped 2.5 s
/// and expired the lease 1.9 s before its holder's deadline. Now the restarted process is a new
/// session: the clock re-anchors (pauses) and then advances by that process's monotonic time.
#[test]
fn issue14_finding0_leader_restarted_in_the_same_term_with_a_fast_clock_keeps_the_lease() {
    let wall = 1_764_540_000_000i64;
    let mut t = LockTable::new();
    // Node 3, session 30, has run for 50 s; real time r = 0 at the grant.
    stamped(
        &mut t,
        7,
        30,
        wall,
        50_000,
        vec![acquire_cmd("r1", "a", 2_000, 0, 1)],
    );
    let granted_at = t.stats().now_ms;
    // The restart: session 31, same term 7, monotonic clock from 0, wall clock +2,400 ms.
    let restarted = |r: i64| (wall + r + 2_400, (r - 60) as u64);
    for r in (100..2_000).step_by(50) {
        let (w, m) = restarted(r);
        stamped(&mut t, 7, 31, w, m, vec![reap_cmd("r1")]);
        assert!(
            t.describe(&res("r1")).held,
            "lease of ttl 2000 ms expired {r} ms after its grant"
        );
        assert!(t.stats().now_ms - granted_at <= r);
    }
    // Not frozen either: expired once ttl plus the 100 ms failover pause have passed.
    let (w, m) = restarted(2_100);
    stamped(&mut t, 7, 31, w, m, vec![reap_cmd("r1")]);
    assert!(!t.describe(&res("r1")).held);
}

/// Wrong wall clocks: leaders whose wall clocks are off by an hour either way change nothing: a
/// lease lasts its ttl plus the failover pause in real time, waits and dedup retention likewise.
#[test]
fn issue14_finding2_leaders_an_hour_apart_neither_expire_early_nor_freeze() {
    const HOUR: i64 = 3_600_000;
    let real0 = 1_764_540_000_000i64;
    // (entry term, session, wall offset, mono at real 0) of three leaders in turn.
    let leaders = [
        (1, 100, HOUR, 7_000u64),
        (2, 200, -HOUR, 90),
        (3, 300, 0, 12_345),
    ];
    for order in [[0, 1, 2], [1, 0, 2], [2, 1, 0]] {
        let mut t = LockTable::new();
        let stamp_at = |t: &mut LockTable, leader: usize, r: i64, cmds: Vec<Command>| {
            let (_, session, offset, mono0) = leaders[order[leader]];
            // Terms follow the order of leadership.
            let term = leader as u64 + 1;
            stamped(t, term, session, real0 + r + offset, mono0 + r as u64, cmds)
        };
        stamp_at(&mut t, 0, 0, vec![acquire_cmd("x", "a", 10_000, 0, 1)]);
        stamp_at(&mut t, 0, 0, vec![acquire_cmd("x", "w", 5_000, 8_000, 2)]);
        for r in (100..=3_000).step_by(100) {
            stamp_at(&mut t, 0, r, vec![reap_cmd("x")]);
        }
        // Failover to leader 1, which first commits at r = 3.5 s: a 500 ms pause.
        for r in (3_500..10_500).step_by(100) {
            stamp_at(&mut t, 1, r, vec![reap_cmd("x")]);
            assert!(t.describe(&res("x")).held, "expired at {r}");
            // The waiter's 8 s end 500 ms late, at 8.5 s.
            let waiters = if r < 8_500 { 1 } else { 0 };
            assert_eq!(t.describe(&res("x")).waiters, waiters, "at {r}");
        }
        // The lease's 10 s end at 10.5 s.
        stamp_at(&mut t, 1, 10_500, vec![reap_cmd("x")]);
        assert!(!t.describe(&res("x")).held);
        // Another failover, to leader 2, with a 1 s pause. The dedup record of "a" (10 minutes
        // of table time) is still there 600 s after it was made in real time.
        stamp_at(&mut t, 2, 11_500, vec![acquire_cmd("y", "b", 2_000, 0, 3)]);
        let retained = stamp_at(
            &mut t,
            2,
            600_000,
            vec![acquire_cmd("x", "a", 10_000, 0, 9)],
        );
        assert!(
            matches!(retained[0], Outcome::Granted(g) if g.lease_id == LeaseId(1)),
            "dedup record of \"a\" pruned early: {retained:?}"
        );
        let stats = t.stats();
        // The table clock lagged real time by the two pauses, whatever the wall clocks said.
        let first = leaders[order[0]].2;
        assert_eq!(stats.now_ms, real0 + first + 600_000 - 1_500);
    }
}

/// Stale stamps: a batch stamped by the leader of an older term, committed after a newer leader
/// anchored the clock, never moves the clock; a stamp claiming a term above its entry's cannot
/// freeze the clock for later leaders.
#[test]
fn issue14_finding8b_stale_stamps_never_move_the_clock() {
    let mut t = LockTable::new();
    stamped(
        &mut t,
        1,
        10,
        1_000_000,
        0,
        vec![acquire_cmd("x", "a", 5_000, 0, 1)],
    );
    stamped(&mut t, 2, 20, 1_000_000, 0, vec![reap_cmd("x")]);
    stamped(&mut t, 2, 20, 1_000_000, 1_000, vec![reap_cmd("x")]);
    assert_eq!(t.stats().now_ms, 1_001_000);
    // Session 10's stamp of term 1, an hour later on its clock, in an entry of term 3.
    let stale = Batch {
        now_ms: 1_000_000,
        stamp: Some(Stamp {
            term: 1,
            session: 10,
            mono_ms: 3_600_000,
            key_seed: 0x5eed,
        }),
        policy: policy(),
        commands: vec![reap_cmd("x")],
    };
    t.apply(3, &stale, &mut Vec::new());
    assert_eq!(t.stats().now_ms, 1_001_000);
    assert!(t.describe(&res("x")).held);
    // A stamp of term 99 in an entry of term 3 counts as term 3: leader 4 still moves the clock.
    let inflated = Batch {
        stamp: Some(Stamp {
            term: 99,
            session: 30,
            mono_ms: 0,
            key_seed: 0x5eed,
        }),
        ..stale.clone()
    };
    t.apply(3, &inflated, &mut Vec::new());
    stamped(&mut t, 4, 40, 0, 0, vec![reap_cmd("x")]);
    stamped(&mut t, 4, 40, 0, 4_000, vec![reap_cmd("x")]);
    assert_eq!(t.stats().now_ms, 1_005_000);
    assert!(!t.describe(&res("x")).held);
}

/// The reaper's view: a leader knows the table time only once the clock is anchored to it.
#[test]
fn clock_now_is_known_only_to_the_anchored_session() {
    let mut t = LockTable::new();
    assert_eq!(t.clock_now(1, 0), None);
    stamped(&mut t, 1, 1, 5_000, 100, vec![]);
    assert_eq!(t.clock_now(1, 100), Some(5_000));
    assert_eq!(t.clock_now(1, 2_600), Some(7_500));
    // Before the anchor (a reading older than the stamp) it is the table's clock.
    assert_eq!(t.clock_now(1, 50), Some(5_000));
    assert_eq!(t.clock_now(2, 2_600), None);
    stamped(&mut t, 2, 2, 99_999_999, 10, vec![]);
    assert_eq!(t.clock_now(1, 2_600), None);
    assert_eq!(t.clock_now(2, 1_010), Some(6_000));
}

/// Entries in existing logs were encoded before the stamp existed; they still decode, followed
/// by whatever comes after them in the entry, and a stamped batch round-trips.
#[test]
fn legacy_batches_still_decode() {
    #[derive(serde::Serialize)]
    struct LegacyBatch {
        now_ms: i64,
        policy: OldPolicy,
        commands: Vec<Command>,
    }
    /// The policy before per-tenant quotas.
    #[derive(serde::Serialize)]
    struct OldPolicy {
        waiters_per_resource_max: u32,
        waiters_per_tenant_max: u32,
        dedup_retention_ms: u64,
    }
    let p = policy();
    let cmds = vec![acquire_cmd("x", "a", 5_000, 0, 1), reap_cmd("y")];
    let old = postcard::to_allocvec(&(
        LegacyBatch {
            now_ms: 1_764_540_000_000,
            policy: OldPolicy {
                waiters_per_resource_max: p.waiters_per_resource_max,
                waiters_per_tenant_max: p.waiters_per_tenant_max,
                dedup_retention_ms: p.dedup_retention_ms,
            },
            commands: cmds.clone(),
        },
        42u64,
    ))
    .unwrap();
    let (batch, after): (Batch, u64) = postcard::from_bytes(&old).unwrap();
    assert_eq!(
        batch,
        Batch {
            now_ms: 1_764_540_000_000,
            stamp: None,
            // Entries of then applied without per-tenant quotas.
            policy: Policy {
                dedup_records_per_tenant_max: u32::MAX,
                active_resources_per_tenant_max: u32::MAX,
                ..p
            },
            commands: cmds.clone(),
        }
    );
    assert_eq!(after, 42);
    // Re-encoding an unstamped batch gives the old bytes.
    assert_eq!(postcard::to_allocvec(&(batch, 42u64)).unwrap(), old);

    let new = Batch {
        now_ms: -5,
        stamp: Some(Stamp {
            term: 3,
            session: u64::MAX,
            mono_ms: 17,
            key_seed: 0x5eed,
        }),
        policy: policy(),
        commands: cmds,
    };
    let bytes = postcard::to_allocvec(&(new.clone(), 7u8)).unwrap();
    assert_eq!(
        postcard::from_bytes::<(Batch, u8)>(&bytes).unwrap(),
        (new, 7)
    );
}

/// Goal: logs written before signed sequencers still decode, and the key command is replicated
/// like any other. Method: the new variant encodes with the next index (postcard encodes a
/// variant by its index, so appending keeps every older entry's meaning); applied in a batch
/// next to an Acquire, it installs the key on every replica identically and leaves the locks
/// alone.
#[test]
fn install_signing_key_is_appended_and_applies_deterministically() {
    let end_wait_attempt = Command::EndWaitAttempt {
        resource: ResourceName::new_unchecked("r".into()),
        request_id: "a".into(),
        reason: EndWaitReason::Cancelled,
        attempt: LeaseId(1),
    };
    assert_eq!(postcard::to_allocvec(&end_wait_attempt).unwrap()[0], 5);
    let pkcs8 = lockd_fence::sequencer::SigningKey::generate()
        .pkcs8_der()
        .to_vec();
    let install = Command::InstallSigningKey {
        pkcs8: pkcs8.clone(),
        replaces: None,
    };
    let bytes = postcard::to_allocvec(&install).unwrap();
    assert_eq!(bytes[0], 6);
    assert_eq!(postcard::from_bytes::<Command>(&bytes).unwrap(), install);

    let batch = Batch {
        now_ms: 1_000,
        stamp: Some(Stamp {
            term: 1,
            session: 1,
            mono_ms: 0,
            key_seed: 9,
        }),
        policy: policy(),
        commands: vec![acquire_cmd("x", "a", 5_000, 0, 1), install.clone(), install],
    };
    let mut replicas = [LockTable::new(), LockTable::new()];
    for t in &mut replicas {
        let outcomes = t.apply(1, &batch, &mut Vec::new());
        assert!(matches!(outcomes[0], Outcome::Granted(_)));
        assert!(matches!(outcomes[1], Outcome::SigningKeyInstalled { .. }));
        // The same key again: the compare-and-set on "no active key" refuses it.
        assert!(matches!(outcomes[2], Outcome::SigningKeyRefused(_)));
        t.check_consistency().unwrap();
    }
    assert_eq!(replicas[0].signing_keys(), replicas[1].signing_keys());
    assert_eq!(replicas[0].signing_keys().active().unwrap().pkcs8, pkcs8);
    assert_eq!(replicas[0].stats().active_locks, 1);
}

#[test]
fn clock_never_goes_back() {
    for mut h in [Harness::new(), Harness::legacy()] {
        h.granted("r", "a");
        let before = h.table.stats().now_ms;
        h.now -= 50_000;
        h.run(Command::Reap { resource: res("r") });
        assert_eq!(h.table.stats().now_ms, before);
    }
}

#[test]
fn dedup_records_are_forgotten_after_retention_but_not_while_queued() {
    let mut h = Harness::new();
    let g = h.granted("r", "a");
    assert_eq!(
        h.acquire("r", "w", 10_000, 300_000),
        Outcome::Queued { position: 1 }
    );
    h.run(Command::Release {
        resource: res("r"),
        lease_id: g.lease_id,
    });
    h.now += 600_001;
    h.run(Command::Reap { resource: res("r") });
    // "a" is forgotten (w's lease expired meanwhile too): the same id is now a fresh request
    // and gets a new lease instead of the original one.
    match h.acquire("r", "a", 10_000, 0) {
        Outcome::Granted(fresh) => {
            assert!(fresh.lease_id != g.lease_id && fresh.fencing_token > g.fencing_token)
        }
        other => panic!("{other:?}"),
    }
}

/// Chaos seed 9601 (network namespaces): an attempt stuck in a client-to-node cut was given up,
/// its retry with the same request_id was refused `Held`, the holder released, and TCP then
/// delivered the first attempt, which was granted: a lease its client had been told it did not
/// get. A refusal is the request's answer like a grant is: every later copy gets it again, also
/// from a snapshot.
#[test]
fn seed_9601_a_held_refusal_stands_for_its_request_id() {
    let mut h = Harness::new();
    let a = h.granted("orders/1", "a");
    assert_eq!(
        h.acquire("orders/1", "b", 10_000, 0),
        Outcome::Held {
            holder: "holder-a".into()
        }
    );
    assert_eq!(
        h.run(Command::Release {
            resource: res("orders/1"),
            lease_id: a.lease_id
        }),
        Outcome::Released(true)
    );
    let bytes = h.table.encode_snapshot();
    let mut copy = LockTable::decode_snapshot(&bytes).unwrap();
    copy.check_consistency().unwrap();
    // The late first attempt, on the table and on its snapshot: refused again, nothing granted.
    assert_eq!(
        h.acquire("orders/1", "b", 10_000, 0),
        Outcome::Held { holder: "".into() }
    );
    assert_eq!(h.table.describe(&res("orders/1")), ResourceView::default());
    std::mem::swap(&mut h.table, &mut copy);
    assert_eq!(
        h.acquire("orders/1", "b", 10_000, 0),
        Outcome::Held { holder: "".into() }
    );
    // A new attempt, with a new request_id, is granted; its refusal record stays until the
    // retention window passes, then the id is free.
    let c = h.granted("orders/1", "c");
    assert!(c.fencing_token > a.fencing_token);
    assert_eq!(
        h.acquire("orders/1", "b", 10_000, 0),
        Outcome::Held {
            holder: "holder-c".into()
        }
    );
    // Refusals count toward the dedup window like grants.
    assert_eq!(h.table.stats().dedup_records, 3);
}

/// Review of the seed-9601 fix: the refusal rule must travel with the entry, not the binary.
/// Entries written as `Acquire` (before the rule) replay without records, so two replicas that
/// restart from snapshots cut at different entries of such a log end with identical tables.
#[test]
fn acquire_entries_of_older_logs_replay_without_refusal_records() {
    let old = |r: &str, req: &str, lease: u128| Command::Acquire {
        resource: res(r),
        request_id: req.into(),
        lease_ttl_ms: 10_000,
        wait_timeout_ms: 0,
        holder: format!("holder-{req}"),
        lease_id: LeaseId(lease),
    };
    let log = [
        vec![old("orders/1", "a", 1)],
        vec![old("orders/1", "b", 2)],
        vec![Command::Release {
            resource: res("orders/1"),
            lease_id: LeaseId(1),
        }],
        vec![old("orders/1", "b", 3)],
    ];
    let batch = |commands: &Vec<Command>| Batch {
        now_ms: 1_000,
        stamp: None,
        policy: Policy::default(),
        commands: commands.clone(),
    };
    let mut events = Vec::new();
    let mut outcomes = Vec::new();
    // Replica A applies the whole log; replica B restarts from a snapshot taken after entry 2
    // and replays the rest.
    let mut a = LockTable::new();
    for entry in &log {
        outcomes.push(a.apply(1, &batch(entry), &mut events));
    }
    let mut b = LockTable::new();
    for entry in &log[..2] {
        b.apply(1, &batch(entry), &mut events);
    }
    let mut b = LockTable::decode_snapshot(&b.encode_snapshot()).unwrap();
    for entry in &log[2..] {
        b.apply(1, &batch(entry), &mut events);
    }
    assert_eq!(a.encode_snapshot(), b.encode_snapshot());
    // As first applied: the refused "b" was not recorded, so its later copy was granted.
    assert!(
        matches!(outcomes[3][0], Outcome::Granted(_)),
        "{outcomes:?}"
    );
    assert_eq!(a.stats().dedup_records, 2);
}

#[test]
fn snapshot_round_trip_keeps_everything() {
    let mut h = Harness::new();
    h.granted("a", "1");
    h.granted("b/x", "2");
    h.acquire("b/x", "3", 5_000, 60_000);
    let bytes = h.table.encode_snapshot();
    let copy = LockTable::decode_snapshot(&bytes).unwrap();
    copy.check_consistency().unwrap();
    assert_eq!(copy.stats(), h.table.stats());
    for r in ["a", "b/x", "c"] {
        assert_eq!(copy.describe(&res(r)), h.table.describe(&res(r)));
    }
}

// ---- property test against a reference model ----

/// The simplest model of the contract: linear scans, no indexes, no deletion of idle records.
#[derive(Default)]
struct Model {
    now: i64,
    term: u64,
    last_token: u64,
    res: BTreeMap<String, ModelRes>,
    /// request_id -> (args, created, state)
    dedup: BTreeMap<String, (String, i64, ModelDedup)>,
}

#[derive(Default, Clone)]
struct ModelRes {
    lease: Option<(LeaseId, u64, i64, u64, String, String)>, // id, token, expires, ttl, holder, req
    queue: Vec<(String, LeaseId, u64, i64, String, bool)>, // req, id, ttl, deadline, holder, cancelled
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum ModelDedup {
    Waiting,
    Granted(Grant),
    TimedOut,
    Held,
}

impl Model {
    fn settle(&mut self, r: &str) {
        let now = self.now;
        let mut state = self.res.remove(r).unwrap_or_default();
        if state.lease.as_ref().is_some_and(|l| l.2 <= now) {
            state.lease = None;
        }
        let (gone, kept): (Vec<_>, Vec<_>) = state.queue.into_iter().partition(|w| w.3 <= now);
        state.queue = kept;
        for w in gone {
            if w.5 {
                self.dedup.remove(&w.0);
            } else {
                self.dedup.get_mut(&w.0).unwrap().2 = ModelDedup::TimedOut;
            }
        }
        while state.lease.is_none() && !state.queue.is_empty() {
            let w = state.queue.remove(0);
            if w.5 {
                self.dedup.remove(&w.0);
                continue;
            }
            let g = self.grant(&mut state, w.1, w.2, &w.4, &w.0);
            let now = self.now;
            let record = self.dedup.get_mut(&w.0).unwrap();
            record.1 = now;
            record.2 = ModelDedup::Granted(g);
        }
        self.res.insert(r.to_owned(), state);
    }

    fn grant(&mut self, s: &mut ModelRes, id: LeaseId, ttl: u64, holder: &str, req: &str) -> Grant {
        self.last_token += 1;
        s.lease = Some((
            id,
            self.last_token,
            self.now + ttl as i64,
            ttl,
            holder.into(),
            req.into(),
        ));
        Grant {
            lease_id: id,
            fencing_token: FencingToken(self.last_token),
            expires_at_ms: self.now + ttl as i64,
            lease_ttl_ms: ttl,
        }
    }

    fn current(&self, r: &str, g: Grant) -> Grant {
        match self
            .res
            .get(r)
            .and_then(|s| s.lease.as_ref())
            .filter(|l| l.0 == g.lease_id)
        {
            Some(l) => Grant {
                expires_at_ms: l.2,
                lease_ttl_ms: l.3,
                ..g
            },
            None => g,
        }
    }

    fn apply(&mut self, term: u64, now: i64, retention: i64, cmd: &Command) -> Outcome {
        self.now = self.now.max(now);
        if term > self.term {
            self.term = term;
            for s in self.res.values_mut() {
                if let Some(l) = &mut s.lease {
                    l.2 = l.2.max(self.now + l.3 as i64);
                }
            }
        }
        let horizon = self.now - retention;
        let now = self.now;
        self.dedup.retain(|_, (_, created, st)| {
            if *created > horizon {
                true
            } else if *st == ModelDedup::Waiting {
                *created = now;
                true
            } else {
                false
            }
        });
        match cmd {
            Command::Acquire {
                resource,
                request_id,
                lease_ttl_ms,
                wait_timeout_ms,
                holder,
                lease_id,
            }
            | Command::AcquireV2 {
                resource,
                request_id,
                lease_ttl_ms,
                wait_timeout_ms,
                holder,
                lease_id,
            } => {
                let record_held = matches!(cmd, Command::AcquireV2 { .. });
                let r = resource.as_str();
                let args = format!("{r}|{lease_ttl_ms}|{wait_timeout_ms}|{holder}");
                self.settle(r);
                if let Some((a, _, st)) = self.dedup.get(request_id).cloned() {
                    if a != args {
                        return Outcome::InvalidArgument(String::new());
                    }
                    return match st {
                        ModelDedup::Granted(g) => Outcome::Granted(self.current(r, g)),
                        ModelDedup::TimedOut => Outcome::WaitTimedOut,
                        ModelDedup::Held => Outcome::Held {
                            holder: self
                                .res
                                .get(r)
                                .and_then(|s| s.lease.as_ref())
                                .map(|l| l.4.clone())
                                .unwrap_or_default(),
                        },
                        ModelDedup::Waiting => {
                            let q = &mut self.res.get_mut(r).unwrap().queue;
                            let i = q.iter().position(|w| &w.0 == request_id).unwrap();
                            q[i].1 = *lease_id;
                            q[i].5 = false;
                            Outcome::Queued {
                                position: q[..i].iter().filter(|w| !w.5).count() as u32 + 1,
                            }
                        }
                    };
                }
                let mut s = self.res.remove(r).unwrap_or_default();
                let out = if let Some(lease) = s.lease.as_ref().filter(|_| *wait_timeout_ms == 0) {
                    if record_held {
                        self.dedup
                            .insert(request_id.clone(), (args, self.now, ModelDedup::Held));
                    }
                    Outcome::Held {
                        holder: lease.4.clone(),
                    }
                } else if s.lease.is_none() {
                    let g = self.grant(&mut s, *lease_id, *lease_ttl_ms, holder, request_id);
                    self.dedup
                        .insert(request_id.clone(), (args, self.now, ModelDedup::Granted(g)));
                    Outcome::Granted(g)
                } else {
                    s.queue.push((
                        request_id.clone(),
                        *lease_id,
                        *lease_ttl_ms,
                        self.now + *wait_timeout_ms as i64,
                        holder.clone(),
                        false,
                    ));
                    self.dedup
                        .insert(request_id.clone(), (args, self.now, ModelDedup::Waiting));
                    Outcome::Queued {
                        position: s.queue.iter().filter(|w| !w.5).count() as u32,
                    }
                };
                self.res.insert(r.to_owned(), s);
                out
            }
            Command::Renew {
                resource,
                lease_id,
                lease_ttl_ms,
            } => {
                let r = resource.as_str();
                self.settle(r);
                let now = self.now;
                match self
                    .res
                    .get_mut(r)
                    .and_then(|s| s.lease.as_mut())
                    .filter(|l| l.0 == *lease_id)
                {
                    Some(l) => {
                        if *lease_ttl_ms != 0 {
                            l.3 = *lease_ttl_ms;
                        }
                        l.2 = now + l.3 as i64;
                        Outcome::Renewed {
                            expires_at_ms: l.2,
                            lease_ttl_ms: l.3,
                        }
                    }
                    None => Outcome::NotFound,
                }
            }
            Command::Release { resource, lease_id } => {
                let r = resource.as_str();
                self.settle(r);
                let s = self.res.get_mut(r).unwrap();
                if s.lease.as_ref().is_some_and(|l| l.0 == *lease_id) {
                    s.lease = None;
                    self.settle(r);
                    Outcome::Released(true)
                } else {
                    Outcome::Released(false)
                }
            }
            Command::Reap { resource } => {
                self.settle(resource.as_str());
                Outcome::Reaped
            }
            Command::EndWaitAttempt { .. } => {
                unreachable!("the reference model is driven with EndWait, which ends any attempt")
            }
            Command::InstallSigningKey { .. } => {
                unreachable!("the reference model holds no signing keys")
            }
            Command::EndWait {
                resource,
                request_id,
                reason,
            } => {
                let r = resource.as_str();
                self.settle(r);
                let s = self.res.get_mut(r).unwrap();
                if let Some(i) = s.queue.iter().position(|w| &w.0 == request_id) {
                    return match reason {
                        EndWaitReason::TimedOut => {
                            s.queue.remove(i);
                            self.dedup.get_mut(request_id).unwrap().2 = ModelDedup::TimedOut;
                            Outcome::WaitTimedOut
                        }
                        EndWaitReason::Cancelled => {
                            // Keeps its place for a retry; never granted meanwhile.
                            s.queue[i].5 = true;
                            Outcome::WaitCancelled
                        }
                    };
                }
                match self.dedup.get(request_id).map(|d| d.2) {
                    Some(ModelDedup::Granted(g)) => Outcome::Granted(self.current(r, g)),
                    _ => match reason {
                        EndWaitReason::TimedOut => Outcome::WaitTimedOut,
                        EndWaitReason::Cancelled => Outcome::WaitCancelled,
                    },
                }
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Acquire {
        r: usize,
        req: usize,
        ttl: u64,
        wait: u64,
        holder: usize,
        /// `AcquireV2` (records a `Held` answer) or the older `Acquire`.
        v2: bool,
    },
    Renew {
        r: usize,
        lease: usize,
        ttl: u64,
    },
    Release {
        r: usize,
        lease: usize,
    },
    Reap {
        r: usize,
    },
    EndWait {
        r: usize,
        req: usize,
        cancel: bool,
    },
    Step {
        ms: i64,
    },
    BackStep {
        ms: i64,
    },
    NewTerm,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, 0..8usize, prop_oneof![Just(1_000u64), Just(2_500)], prop_oneof![Just(0u64), Just(1_500), Just(4_000)], 0..2usize, any::<bool>())
            .prop_map(|(r, req, ttl, wait, holder, v2)| Op::Acquire { r, req, ttl, wait, holder, v2 }),
        2 => (0..3usize, 0..12usize, prop_oneof![Just(0u64), Just(1_000)]).prop_map(|(r, lease, ttl)| Op::Renew { r, lease, ttl }),
        2 => (0..3usize, 0..12usize).prop_map(|(r, lease)| Op::Release { r, lease }),
        1 => (0..3usize).prop_map(|r| Op::Reap { r }),
        1 => (0..3usize, 0..8usize, any::<bool>()).prop_map(|(r, req, cancel)| Op::EndWait { r, req, cancel }),
        3 => (0..1_500i64).prop_map(|ms| Op::Step { ms }),
        1 => (0..1_000i64).prop_map(|ms| Op::BackStep { ms }),
        1 => Just(Op::NewTerm),
    ]
}

const NAMES: [&str; 3] = ["a", "t/b", "t/c"];

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Goal: the table behaves like the reference model and keeps every invariant under random
    /// sequences. Method: apply each op to both (in small batches), compare outcomes one by one,
    /// check consistency, single holder, token monotonicity and the snapshot round trip.
    #[test]
    fn table_matches_reference_model(ops in proptest::collection::vec(op(), 1..120), batch_size in 1..4usize) {
        let retention = 6_000i64;
        let pol = Policy { dedup_retention_ms: retention as u64, ..Policy::default() };
        let mut table = LockTable::new();
        let mut model = Model::default();
        let (mut now, mut term) = (1_000_000i64, 1u64);
        let mut leases: Vec<LeaseId> = Vec::new();
        let mut last_token = 0u64;
        let mut next_id = 1u128;
        let mut pending: Vec<Command> = Vec::new();
        let mut events = Vec::new();

        let mut flush = |pending: &mut Vec<Command>, now: i64, term: u64, table: &mut LockTable, model: &mut Model, leases: &mut Vec<LeaseId>, last_token: &mut u64| -> Result<(), TestCaseError> {
            if pending.is_empty() { return Ok(()); }
            // Legacy (unstamped) batches: the model keeps the wall-clock rule of those entries.
            let batch = Batch { now_ms: now, stamp: None, policy: pol, commands: std::mem::take(pending) };
            events.clear();
            let outs = table.apply(term, &batch, &mut events);
            for (cmd, out) in batch.commands.iter().zip(&outs) {
                let expected = model.apply(term, now, retention, cmd);
                match (&expected, out) {
                    (Outcome::InvalidArgument(_), Outcome::InvalidArgument(_)) => {}
                    _ => prop_assert_eq!(&expected, out, "command {:?}", cmd),
                }
            }
            for e in &events {
                if let EventKind::Granted { grant, .. } = e.kind {
                    // INV-TOKEN-MONOTONIC, in grant order.
                    prop_assert!(grant.fencing_token.0 > *last_token);
                    *last_token = grant.fencing_token.0;
                    leases.push(grant.lease_id);
                }
            }
            prop_assert!(table.check_consistency().is_ok(), "{:?}", table.check_consistency());
            for r in NAMES {
                let view = table.describe(&res(r));
                let m = model.res.get(r).cloned().unwrap_or_default();
                prop_assert_eq!(view.held, m.lease.is_some());
                prop_assert_eq!(view.waiters as usize, m.queue.iter().filter(|w| !w.5).count());
            }
            Ok(())
        };

        for op in ops {
            match op {
                Op::Step { ms } => { flush(&mut pending, now, term, &mut table, &mut model, &mut leases, &mut last_token)?; now += ms; }
                Op::BackStep { ms } => { flush(&mut pending, now, term, &mut table, &mut model, &mut leases, &mut last_token)?; now -= ms; }
                Op::NewTerm => { flush(&mut pending, now, term, &mut table, &mut model, &mut leases, &mut last_token)?; term += 1; }
                Op::Acquire { r, req, ttl, wait, holder, v2 } => {
                    next_id += 1;
                    let (resource, request_id, holder, lease_id) = (res(NAMES[r]), format!("req{req}"), format!("h{holder}"), LeaseId(next_id << 64));
                    pending.push(if v2 {
                        Command::AcquireV2 { resource, request_id, lease_ttl_ms: ttl, wait_timeout_ms: wait, holder, lease_id }
                    } else {
                        Command::Acquire { resource, request_id, lease_ttl_ms: ttl, wait_timeout_ms: wait, holder, lease_id }
                    });
                }
                Op::Renew { r, lease, ttl } => pending.push(Command::Renew { resource: res(NAMES[r]), lease_id: leases.get(lease).copied().unwrap_or(LeaseId(1)), lease_ttl_ms: ttl }),
                Op::Release { r, lease } => pending.push(Command::Release { resource: res(NAMES[r]), lease_id: leases.get(lease).copied().unwrap_or(LeaseId(1)) }),
                Op::Reap { r } => pending.push(Command::Reap { resource: res(NAMES[r]) }),
                Op::EndWait { r, req, cancel } => pending.push(Command::EndWait { resource: res(NAMES[r]), request_id: format!("req{req}"), reason: if cancel { EndWaitReason::Cancelled } else { EndWaitReason::TimedOut } }),
            }
            if pending.len() >= batch_size {
                flush(&mut pending, now, term, &mut table, &mut model, &mut leases, &mut last_token)?;
            }
        }
        flush(&mut pending, now, term, &mut table, &mut model, &mut leases, &mut last_token)?;

        let bytes = table.encode_snapshot();
        let copy = LockTable::decode_snapshot(&bytes).unwrap();
        prop_assert_eq!(copy.stats(), table.stats());
        prop_assert!(copy.encode_snapshot() == bytes, "a decoded snapshot encodes differently");
        prop_assert!(copy.check_consistency().is_ok());
    }
}

// ---- property test: stamped batches from several leaders, adversarial commands ----

/// One step of the adversarial schedule.
#[derive(Debug, Clone)]
enum Adv {
    Acquire {
        r: usize,
        req: usize,
        ttl: u64,
        wait: u64,
        holder: usize,
    },
    Renew {
        r: usize,
        lease: usize,
    },
    Release {
        r: usize,
        lease: usize,
    },
    Reap {
        r: usize,
    },
    /// `attempt`: an index into the lease ids drawn so far (or a junk id).
    EndWait {
        r: usize,
        req: usize,
        cancel: bool,
        attempt: Option<usize>,
    },
    /// Real time passes.
    Step {
        ms: u64,
    },
    /// A new leader (new term, new process) whose wall clock is off by `offset_ms`.
    Failover {
        offset_ms: i64,
        mono_base: u64,
    },
    /// The leader process restarts in the same term (openraft 0.9 does this).
    Restart {
        offset_ms: i64,
    },
    /// The same leader process wins a later term (its batches stamped in the older term may
    /// still be appended in the new one).
    Reelect,
    /// The next batch carries an old stamp (stamped before a leadership change, or reordered
    /// in flight within one process).
    Stale {
        back: usize,
    },
    /// Flush the pending commands as one batch.
    Flush,
    /// Toggle the digest-collision hook for the following batches.
    Collide,
}

fn adv() -> impl Strategy<Value = Adv> {
    const HOUR: i64 = 3_600_000;
    prop_oneof![
        6 => (0..4usize, 0..10usize, prop_oneof![Just(1_000u64), Just(2_500), Just(60_000)],
              prop_oneof![Just(0u64), Just(1_500), Just(4_000)], 0..2usize)
            .prop_map(|(r, req, ttl, wait, holder)| Adv::Acquire { r, req, ttl, wait, holder }),
        2 => (0..4usize, 0..16usize).prop_map(|(r, lease)| Adv::Renew { r, lease }),
        2 => (0..4usize, 0..16usize).prop_map(|(r, lease)| Adv::Release { r, lease }),
        1 => (0..4usize).prop_map(|r| Adv::Reap { r }),
        2 => (0..4usize, 0..10usize, any::<bool>(), proptest::option::of(0..16usize))
            .prop_map(|(r, req, cancel, attempt)| Adv::EndWait { r, req, cancel, attempt }),
        4 => (0..2_000u64).prop_map(|ms| Adv::Step { ms }),
        1 => (-2 * HOUR..2 * HOUR, 0..10_000_000u64)
            .prop_map(|(offset_ms, mono_base)| Adv::Failover { offset_ms, mono_base }),
        1 => (-2 * HOUR..2 * HOUR).prop_map(|offset_ms| Adv::Restart { offset_ms }),
        1 => Just(Adv::Reelect),
        1 => (0..8usize).prop_map(|back| Adv::Stale { back }),
        3 => Just(Adv::Flush),
        1 => Just(Adv::Collide),
    ]
}

/// The leader process stamping batches.
struct Leader {
    term: u64,
    session: u64,
    offset_ms: i64,
    /// Its monotonic clock read `mono_base` at real time `real_base`.
    mono_base: u64,
    real_base: i64,
}

/// A lease's holder deadline: the real time of the stamp of the batch that granted or last
/// renewed it, plus its ttl. No lease may expire earlier in real time.
#[derive(Clone, Copy, Debug)]
struct Deadline {
    token: u64,
    ttl_ms: i64,
    real_ms: i64,
}

/// Checks the invariant catalogue on one replica's applied batch.
struct Checker {
    last_token: u64,
    /// Per resource: the current lease's token and holder deadline.
    deadlines: BTreeMap<String, Deadline>,
}

impl Checker {
    fn check(
        &mut self,
        table: &LockTable,
        before: &LockTable,
        stamp_real: i64,
        apply_real: i64,
        events: &[Event],
        single_command: bool,
    ) -> Result<(), TestCaseError> {
        prop_assert!(
            table.check_consistency().is_ok(),
            "{:?}",
            table.check_consistency()
        );
        prop_assert!(
            table.stats().now_ms >= before.stats().now_ms,
            "INV-TIME-MONOTONIC"
        );
        for e in events {
            let r = e.resource.as_str().to_owned();
            match e.kind {
                EventKind::Granted { grant, to_waiter } => {
                    // INV-TOKEN-MONOTONIC and INV-SINGLE-HOLDER (a grant only to a free resource).
                    prop_assert!(grant.fencing_token.0 > self.last_token);
                    self.last_token = grant.fencing_token.0;
                    prop_assert!(!self.deadlines.contains_key(&r), "{r} granted while held");
                    self.deadlines.insert(
                        r.clone(),
                        Deadline {
                            token: grant.fencing_token.0,
                            ttl_ms: grant.lease_ttl_ms as i64,
                            real_ms: stamp_real + grant.lease_ttl_ms as i64,
                        },
                    );
                    if let (Some(_), true) = (to_waiter, single_command) {
                        // FIFO: nobody still queued and not cancelled was ahead of it.
                        let queue = &before.resources[&e.resource].waiters;
                        let at = queue.iter().position(|w| w.request_id == e.request_id);
                        prop_assert!(at.is_some(), "granted a waiter that was not queued");
                        let after = table.resources.get(&e.resource);
                        for w in queue.iter().take(at.unwrap_or(0)) {
                            let still = after.is_some_and(|s| {
                                s.waiters.iter().any(|x| x.request_id == w.request_id)
                            });
                            prop_assert!(
                                !still || table.abandoned.contains(&w.key),
                                "{:?} granted before {:?} on {r}",
                                e.request_id,
                                w.request_id
                            );
                        }
                    }
                }
                EventKind::Renewed => {
                    // Renewals here keep the lease's ttl.
                    let d = self.deadlines.get_mut(&r);
                    prop_assert!(d.is_some(), "renewed a lease the checker does not know");
                    let d = d.unwrap();
                    d.real_ms = d.real_ms.max(stamp_real + d.ttl_ms);
                }
                EventKind::Released => {
                    self.deadlines.remove(&r);
                }
                EventKind::Expired => {
                    let d = self.deadlines.remove(&r);
                    prop_assert!(d.is_some_and(|d| d.token == e.fencing_token.0));
                    let d = d.unwrap();
                    prop_assert!(
                        apply_real >= d.real_ms,
                        "lease {} on {r} expired at real {apply_real}, before its holder's \
                         deadline {}",
                        d.token,
                        d.real_ms
                    );
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Cases per run: a few seconds in the normal suite; `LOCKD_PROPTEST_CASES` for longer runs
/// (with a random seed unless `LOCKD_PROPTEST_SEED` is set too).
fn adversarial_config() -> ProptestConfig {
    let cases = std::env::var("LOCKD_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok());
    let seed = std::env::var("LOCKD_PROPTEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok());
    ProptestConfig {
        cases: cases.unwrap_or(200),
        rng_seed: match (seed, cases) {
            (Some(seed), _) => proptest::test_runner::RngSeed::Fixed(seed),
            (None, Some(_)) => proptest::test_runner::RngSeed::Random,
            (None, None) => proptest::test_runner::RngSeed::Fixed(20_261_201),
        },
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(adversarial_config())]

    /// Goal: whatever the commands (including request_ids reused across resources, stale and
    /// foreign attempts, digests forced to collide) and whatever the stamps (leaders hours
    /// apart, restarts in the same term, stale and reordered stamps), apply never panics, the
    /// invariant catalogue holds, and every replica computes the same outcomes and table.
    /// Method: three replicas apply the same batches; replica 2 goes through a snapshot
    /// round-trip at a random point; a checker follows replica 0's events against the real
    /// time of each stamp.
    #[test]
    fn adversarial_schedules_keep_the_invariants_on_every_replica(
        ops in proptest::collection::vec(adv(), 1..160),
        snapshot_at in 0..160usize,
    ) {
        let names = ["a/x", "a/y", "b/x", "c"];
        let mut replicas = [LockTable::new(), LockTable::new(), LockTable::new()];
        let mut checker = Checker { last_token: 0, deadlines: BTreeMap::new() };
        let mut real: i64 = 1_764_540_000_000;
        let mut leader = Leader { term: 1, session: 1, offset_ms: 0, mono_base: 0, real_base: real };
        let mut sessions = 1u64;
        // Stamps used so far, with the real time they were read at.
        let mut stamps: Vec<(Stamp, i64, i64)> = Vec::new();
        let mut stale: Option<usize> = None;
        let mut leases: Vec<LeaseId> = Vec::new();
        let mut next_id = 1u128;
        let mut pending: Vec<Command> = Vec::new();
        let mut collide_on = false;

        let stamp_now = |leader: &Leader, real: i64| -> (Stamp, i64) {
            let mono = leader.mono_base + (real - leader.real_base) as u64;
            (Stamp { term: leader.term, session: leader.session, mono_ms: mono, key_seed: 0x5eed }, real + leader.offset_ms)
        };

        for (i, op) in ops.into_iter().enumerate() {
            let flush = matches!(op, Adv::Flush | Adv::Step { .. } | Adv::Failover { .. } | Adv::Restart { .. } | Adv::Reelect | Adv::Collide) || pending.len() >= 3;
            match op {
                Adv::Acquire { r, req, ttl, wait, holder } => {
                    next_id += 1;
                    leases.push(LeaseId(next_id));
                    pending.push(Command::Acquire {
                        resource: res(names[r]),
                        request_id: format!("req{req}"),
                        lease_ttl_ms: ttl,
                        wait_timeout_ms: wait,
                        holder: format!("h{holder}"),
                        lease_id: LeaseId(next_id),
                    });
                }
                Adv::Renew { r, lease } => pending.push(Command::Renew {
                    resource: res(names[r]),
                    lease_id: leases.get(lease).copied().unwrap_or(LeaseId(1)),
                    lease_ttl_ms: 0,
                }),
                Adv::Release { r, lease } => pending.push(Command::Release {
                    resource: res(names[r]),
                    lease_id: leases.get(lease).copied().unwrap_or(LeaseId(1)),
                }),
                Adv::Reap { r } => pending.push(Command::Reap { resource: res(names[r]) }),
                Adv::EndWait { r, req, cancel, attempt } => {
                    let reason = if cancel { EndWaitReason::Cancelled } else { EndWaitReason::TimedOut };
                    let (resource, request_id) = (res(names[r]), format!("req{req}"));
                    pending.push(match attempt {
                        None => Command::EndWait { resource, request_id, reason },
                        Some(a) => Command::EndWaitAttempt {
                            resource,
                            request_id,
                            reason,
                            attempt: leases.get(a).copied().unwrap_or(LeaseId(3)),
                        },
                    });
                }
                Adv::Stale { back } => stale = Some(back),
                Adv::Step { .. } | Adv::Failover { .. } | Adv::Restart { .. } | Adv::Reelect | Adv::Collide | Adv::Flush => {}
            }
            if flush && !pending.is_empty() {
                // A stale stamp is one the log can really hold: an entry is appended by the
                // process that stamped it, so only this leader process's own older stamps
                // (reordered in flight, or stamped in a term it led before). Other processes'
                // entries, committed or not, all precede this leader's in the log.
                let possible: Vec<_> = stamps
                    .iter()
                    .filter(|(s, _, _)| s.session == leader.session)
                    .copied()
                    .collect();
                let (stamp, wall, stamp_real) = match stale.take().filter(|_| !possible.is_empty()) {
                    Some(back) => possible[possible.len() - 1 - back.min(possible.len() - 1)],
                    None => {
                        let (s, w) = stamp_now(&leader, real);
                        (s, w, real)
                    }
                };
                stamps.push((stamp, wall, stamp_real));
                let batch = Batch { now_ms: wall, stamp: Some(stamp), policy: policy(), commands: std::mem::take(&mut pending) };
                let single = batch.commands.len() == 1;
                let before = replicas[0].clone();
                let mut outcomes = Vec::new();
                let mut events0 = Vec::new();
                for (n, table) in replicas.iter_mut().enumerate() {
                    let mut events = Vec::new();
                    let out = if collide_on {
                        with_collisions(|| table.apply(leader.term, &batch, &mut events))
                    } else {
                        table.apply(leader.term, &batch, &mut events)
                    };
                    outcomes.push(out);
                    if n == 0 {
                        events0 = events;
                    }
                }
                prop_assert_eq!(&outcomes[0], &outcomes[1]);
                prop_assert_eq!(&outcomes[0], &outcomes[2]);
                // Expiry in a stale batch happens now, in real time.
                checker.check(&replicas[0], &before, stamp_real, real, &events0, single)?;
            }
            match op {
                Adv::Step { ms } => real += ms as i64,
                Adv::Failover { offset_ms, mono_base } => {
                    sessions += 1;
                    leader = Leader { term: leader.term + 1, session: sessions, offset_ms, mono_base, real_base: real };
                }
                Adv::Restart { offset_ms } => {
                    sessions += 1;
                    leader = Leader { term: leader.term, session: sessions, offset_ms, mono_base: 0, real_base: real };
                }
                Adv::Reelect => leader.term += 1,
                Adv::Collide => collide_on = !collide_on,
                _ => {}
            }
            if i == snapshot_at {
                let bytes = replicas[2].encode_snapshot();
                replicas[2] = LockTable::decode_snapshot(&bytes).unwrap();
                prop_assert!(replicas[2].check_consistency().is_ok());
            }
        }
        let bytes = replicas[0].encode_snapshot();
        prop_assert!(replicas[1].encode_snapshot() == bytes, "replica 1 differs");
        prop_assert!(replicas[2].encode_snapshot() == bytes, "replica 2 (snapshot round-trip) differs");
    }
}

/// The first fix for retried waiters, reviewed: a cancelled waiter keeps its place for a retry
/// of its own call, and it used to count against waiters_per_resource_max until its deadline
/// (up to 5 minutes), so callers that queue and disconnect filled a queue with nobody and a live
/// caller was refused. Now a full queue drops its oldest cancelled waiter for a live caller.
/// (Per tenant, cancelled waiters still count until their deadline: open.)
#[test]
fn review14_a_queue_full_of_cancelled_waiters_admits_a_live_caller() {
    let mut h = Harness::new();
    h.pol = Policy {
        waiters_per_resource_max: 3,
        ..policy()
    };
    assert!(matches!(
        h.acquire("t/r", "holder", 300_000, 0),
        Outcome::Granted(_)
    ));
    for w in ["gone-1", "gone-2", "gone-3"] {
        assert!(matches!(
            h.acquire("t/r", w, 10_000, 300_000),
            Outcome::Queued { .. }
        ));
        let attempt = LeaseId(h.next_lease);
        h.run(cancel_attempt("t/r", w, attempt));
    }
    // Nobody is waiting any more (Describe agrees)...
    assert_eq!(h.table.describe(&res("t/r")).waiters, 0);
    // ...yet a live caller, 200 s later (the lease still held), is refused.
    h.now += 200_000;
    let out = h.acquire("t/r", "live", 10_000, 60_000);
    assert!(
        matches!(out, Outcome::Queued { position: 1 }),
        "a live waiter was refused by a queue of cancelled ones: {out:?}"
    );
}

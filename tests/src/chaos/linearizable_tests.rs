//! The linearizability checker must reject known-bad histories (two overlapping grants, a token
//! going backwards, a stale or impossible `Describe`, a lease lost before its deadline) and accept
//! good ones (overlapping operations in either order, unknown outcomes that did or did not take
//! effect), so that neither an always-pass nor an always-fail checker survives these tests.

use super::history::{Op, OpKind, Outcome};
use super::linearizable::{STEP_BUDGET, Verdict, check};

const R: &str = "r0";

/// Builds a history one operation at a time.
#[derive(Default)]
struct H {
    ops: Vec<Op>,
}

impl H {
    fn push(&mut self, kind: OpKind, invoke_ms: u64, complete_ms: u64, outcome: Outcome) -> &mut H {
        let index = self.ops.len();
        self.ops.push(Op {
            index,
            process: "w0".into(),
            kind,
            invoke_ms,
            complete_ms: Some(complete_ms),
            outcome: Some(outcome),
        });
        self
    }

    fn acquire(&mut self, rid: &str, ttl_ms: u64, at: (u64, u64), outcome: Outcome) -> &mut H {
        self.acquire_on(R, rid, ttl_ms, at, outcome)
    }

    fn acquire_on(
        &mut self,
        res: &str,
        rid: &str,
        ttl_ms: u64,
        at: (u64, u64),
        outcome: Outcome,
    ) -> &mut H {
        let attempt = self
            .ops
            .iter()
            .filter(|o| matches!(&o.kind, OpKind::Acquire { request_id, .. } if request_id == rid))
            .count() as u32
            + 1;
        self.push(
            OpKind::Acquire {
                resource: res.into(),
                request_id: rid.into(),
                ttl_ms,
                wait_ms: 0,
                attempt,
                via: "node-1".into(),
            },
            at.0,
            at.1,
            outcome,
        )
    }

    fn granted(&mut self, rid: &str, token: u64, ttl_ms: u64, at: (u64, u64)) -> &mut H {
        self.acquire(rid, ttl_ms, at, granted(&lease(token), token))
    }

    fn renew(&mut self, token: u64, at: (u64, u64), outcome: Outcome) -> &mut H {
        self.push(
            OpKind::Renew {
                resource: R.into(),
                lease_id: lease(token),
                token,
            },
            at.0,
            at.1,
            outcome,
        )
    }

    fn release(&mut self, token: u64, at: (u64, u64), outcome: Outcome) -> &mut H {
        self.release_on(R, token, at, outcome)
    }

    fn release_on(&mut self, res: &str, token: u64, at: (u64, u64), outcome: Outcome) -> &mut H {
        self.push(
            OpKind::Release {
                resource: res.into(),
                lease_id: lease(token),
                token,
            },
            at.0,
            at.1,
            outcome,
        )
    }

    fn describe(&mut self, held: Option<u64>, at: (u64, u64)) -> &mut H {
        self.describe_on(R, held, at)
    }

    fn describe_on(&mut self, res: &str, held: Option<u64>, at: (u64, u64)) -> &mut H {
        self.push(
            OpKind::Describe {
                resource: res.into(),
                via: "node-1".into(),
            },
            at.0,
            at.1,
            Outcome::Described {
                held: held.is_some(),
                token: held.unwrap_or(0),
                holder: String::new(),
            },
        )
    }

    fn verdicts(&self) -> Vec<Verdict> {
        check(&self.ops, STEP_BUDGET)
            .results
            .into_iter()
            .map(|r| r.verdict)
            .collect()
    }

    #[track_caller]
    fn assert_linearizable(&self) {
        let report = check(&self.ops, STEP_BUDGET);
        assert!(
            report
                .results
                .iter()
                .all(|r| r.verdict == Verdict::Linearizable),
            "expected linearizable: {:?}\n{}",
            report.results,
            report.summary()
        );
    }

    #[track_caller]
    fn assert_rejected(&self) {
        let v = self.verdicts();
        assert!(
            v.iter()
                .any(|v| matches!(v, Verdict::NotLinearizable { .. })),
            "expected a violation, got {v:?}"
        );
    }
}

fn lease(token: u64) -> String {
    format!("lease-{token}")
}

fn granted(lease_id: &str, token: u64) -> Outcome {
    Outcome::Granted {
        lease_id: lease_id.into(),
        token,
    }
}

fn held() -> Outcome {
    Outcome::Fail {
        reason: "Aborted: lockd: resource \"r0\" is held by \"w1\"".into(),
    }
}

fn not_found() -> Outcome {
    Outcome::Fail {
        reason: "NotFound: lockd: that lease is not the current lease".into(),
    }
}

fn unknown() -> Outcome {
    Outcome::Unknown {
        reason: "no answer".into(),
    }
}

fn done() -> Outcome {
    Outcome::Done { released: None }
}

fn released(r: bool) -> Outcome {
    Outcome::Done { released: Some(r) }
}

// ---- known-bad histories ----

#[test]
fn two_overlapping_grants_are_rejected() {
    let mut h = H::default();
    h.granted("a", 1, 5_000, (0, 10))
        .granted("b", 2, 5_000, (100, 110));
    h.assert_rejected();
    let Verdict::NotLinearizable { detail } = &h.verdicts()[0] else {
        unreachable!()
    };
    assert!(
        detail.contains("token 2") && detail.contains("held by token 1"),
        "the detail names the grant that cannot come next and the holder: {detail}"
    );
}

#[test]
fn a_token_that_goes_backwards_is_rejected() {
    let mut h = H::default();
    h.granted("a", 5, 5_000, (0, 10))
        .release(5, (20, 30), released(true))
        .granted("b", 3, 5_000, (40, 50));
    h.assert_rejected();
    // The same with a higher token is fine.
    let mut h = H::default();
    h.granted("a", 5, 5_000, (0, 10))
        .release(5, (20, 30), released(true))
        .granted("b", 6, 5_000, (40, 50));
    h.assert_linearizable();
}

#[test]
fn a_describe_showing_a_lease_released_before_it_began_is_rejected() {
    let mut h = H::default();
    h.granted("a", 1, 5_000, (0, 10))
        .release(1, (20, 30), released(true))
        .describe(Some(1), (40, 50));
    h.assert_rejected();
}

#[test]
fn stale_reads_are_rejected() {
    // The previous holder's token after a newer grant completed.
    let mut h = H::default();
    h.granted("a", 1, 5_000, (0, 10))
        .release(1, (20, 30), released(true))
        .granted("b", 2, 5_000, (40, 50))
        .describe(Some(1), (60, 70));
    h.assert_rejected();
    // "Free" while the newer lease is within its deadline and was not released.
    let mut h = H::default();
    h.granted("a", 1, 5_000, (0, 10))
        .release(1, (20, 30), released(true))
        .granted("b", 2, 5_000, (40, 50))
        .describe(None, (60, 70));
    h.assert_rejected();
}

#[test]
fn a_grant_inside_the_previous_lease_deadline_is_rejected_and_after_it_accepted() {
    let mut h = H::default();
    h.granted("a", 1, 1_000, (0, 10))
        .granted("b", 2, 1_000, (500, 510));
    h.assert_rejected();
    // The deadline counts from the first send (0 ms) plus the ttl: a grant completing at 1,000 ms
    // may have been linearized at the deadline.
    let mut h = H::default();
    h.granted("a", 1, 1_000, (0, 10))
        .granted("b", 2, 1_000, (990, 1_000));
    h.assert_linearizable();
}

#[test]
fn an_acknowledged_renew_moves_the_deadline() {
    let mut h = H::default();
    h.granted("a", 1, 1_000, (0, 10))
        .renew(1, (800, 810), done())
        .granted("b", 2, 1_000, (1_200, 1_210));
    h.assert_rejected();
    let mut h = H::default();
    h.granted("a", 1, 1_000, (0, 10))
        .renew(1, (800, 810), done())
        .granted("b", 2, 1_000, (1_850, 1_860));
    h.assert_linearizable();
}

#[test]
fn a_lease_reported_lost_before_its_deadline_is_rejected() {
    let mut h = H::default();
    h.granted("a", 1, 1_000, (0, 10))
        .renew(1, (300, 310), not_found());
    h.assert_rejected();
    // After the deadline the lease may have expired.
    let mut h = H::default();
    h.granted("a", 1, 1_000, (0, 10))
        .renew(1, (1_100, 1_110), not_found())
        .release(1, (1_120, 1_130), released(false));
    h.assert_linearizable();
    // A renew that succeeds after the holder's own release is impossible.
    let mut h = H::default();
    h.granted("a", 1, 5_000, (0, 10))
        .release(1, (20, 30), released(true))
        .renew(1, (40, 50), done());
    h.assert_rejected();
}

#[test]
fn a_refusal_while_the_resource_is_free_is_rejected_unless_an_unknown_acquire_explains_it() {
    let mut h = H::default();
    h.granted("a", 1, 5_000, (0, 10))
        .release(1, (20, 30), released(true))
        .acquire("c", 1_000, (40, 50), held());
    h.assert_rejected();
    // An acquire whose outcome is unknown may have taken the lock meanwhile.
    let mut h = H::default();
    h.granted("a", 1, 5_000, (0, 10))
        .release(1, (20, 30), released(true))
        .acquire("u", 1_000, (35, 5_000), unknown())
        .acquire("c", 1_000, (40, 50), held());
    h.assert_linearizable();
    // Not one sent only after the refusal came back.
    let mut h = H::default();
    h.granted("a", 1, 5_000, (0, 10))
        .release(1, (20, 30), released(true))
        .acquire("c", 1_000, (40, 50), held())
        .acquire("u", 1_000, (60, 5_000), unknown());
    h.assert_rejected();
}

// ---- good histories: overlaps and unknown outcomes ----

#[test]
fn overlapping_operations_are_accepted_in_either_order() {
    // A describe overlapping the grant may see it or not.
    for seen in [None, Some(1)] {
        let mut h = H::default();
        h.granted("a", 1, 5_000, (0, 100)).describe(seen, (10, 90));
        h.assert_linearizable();
    }
    // A grant that overlaps the previous holder's release comes after it, even if it completes
    // first.
    let mut h = H::default();
    h.granted("a", 1, 5_000, (0, 10))
        .release(1, (100, 200), released(true))
        .granted("b", 2, 5_000, (150, 180))
        .describe(Some(2), (190, 195));
    h.assert_linearizable();
    // ...but not if it completed before the release was sent.
    let mut h = H::default();
    h.granted("a", 1, 5_000, (0, 10))
        .granted("b", 2, 5_000, (150, 180))
        .release(1, (190, 200), released(true));
    h.assert_rejected();
}

#[test]
fn unknown_acquires_that_did_or_did_not_take_effect_are_accepted() {
    // Did: a describe shows a token no client saw; the lease then expires.
    let mut h = H::default();
    h.acquire("u", 1_000, (0, 5_500), unknown())
        .describe(Some(7), (100, 110))
        .granted("b", 8, 1_000, (1_500, 1_510));
    h.assert_linearizable();
    // Did not: another client is granted at once.
    let mut h = H::default();
    h.acquire("u", 1_000, (0, 5_500), unknown())
        .granted("b", 2, 1_000, (100, 110))
        .describe(Some(2), (120, 130));
    h.assert_linearizable();
    // Once a describe showed its token, later grants must be above it and wait for its expiry.
    let mut h = H::default();
    h.acquire("u", 1_000, (0, 5_500), unknown())
        .describe(Some(7), (100, 110))
        .granted("b", 6, 1_000, (1_500, 1_510));
    h.assert_rejected();
    let mut h = H::default();
    h.acquire("u", 1_000, (0, 5_500), unknown())
        .describe(Some(7), (100, 110))
        .granted("b", 8, 1_000, (500, 510));
    h.assert_rejected();
}

#[test]
fn unknown_releases_that_did_or_did_not_take_effect_are_accepted() {
    let mut h = H::default();
    h.granted("a", 1, 5_000, (0, 10))
        .release(1, (100, 5_600), unknown())
        .granted("b", 2, 5_000, (200, 210));
    h.assert_linearizable();
    let mut h = H::default();
    h.granted("a", 1, 5_000, (0, 10))
        .release(1, (100, 5_600), unknown())
        .describe(Some(1), (300, 310));
    h.assert_linearizable();
    // Not both: once another client holds it, the old lease cannot be seen again.
    let mut h = H::default();
    h.granted("a", 1, 5_000, (0, 10))
        .release(1, (100, 5_600), unknown())
        .granted("b", 2, 5_000, (200, 210))
        .describe(Some(1), (300, 310));
    h.assert_rejected();
}

#[test]
fn retries_of_one_request_are_one_operation_timed_from_the_first_send() {
    // Attempt 1 lost its reply, attempt 2 returned the grant: the deadline is 0 + 1,000 ms.
    let mut h = H::default();
    h.acquire("a", 1_000, (0, 50), unknown())
        .acquire("a", 1_000, (60, 70), granted(&lease(1), 1))
        .granted("b", 2, 1_000, (1_000, 1_005));
    h.assert_linearizable();
    // A refusal after an unknown attempt: the request never took the lock (it was held).
    let mut h = H::default();
    h.granted("a", 1, 5_000, (0, 10))
        .acquire("c", 1_000, (20, 40), unknown())
        .acquire("c", 1_000, (50, 60), held())
        .describe(Some(1), (70, 80));
    h.assert_linearizable();
}

#[test]
fn resources_are_checked_apart() {
    let mut h = H::default();
    h.acquire_on("x", "a", 5_000, (0, 10), granted("la", 1))
        .acquire_on("y", "b", 5_000, (5, 15), granted("lb", 2))
        .describe_on("x", Some(1), (20, 30))
        .describe_on("y", Some(2), (20, 30));
    h.assert_linearizable();
    h.describe_on("y", None, (40, 50));
    let report = check(&h.ops, STEP_BUDGET);
    assert_eq!(report.results.len(), 2);
    assert_eq!(report.results[0].verdict, Verdict::Linearizable);
    assert!(matches!(
        report.results[1].verdict,
        Verdict::NotLinearizable { .. }
    ));
    let v = report.violations();
    assert_eq!(v.len(), 1);
    assert!(v[0].detail.contains("\"y\""), "{}", v[0].detail);
}

/// Sixteen concurrent grants (any subset may go first, in token order) and an impossible read at
/// the end: the search must visit every subset before it can say no. With a small budget it says
/// "inconclusive" instead of hanging; with the full one it finds the violation.
#[test]
fn the_step_budget_makes_a_hard_history_inconclusive_not_a_hang() {
    let mut h = H::default();
    for t in 1..=16u64 {
        h.granted(&format!("g{t}"), t, 1, (0, 1_000));
    }
    h.describe(Some(99), (2_000, 2_010));
    let small = check(&h.ops, 1_000);
    assert_eq!(small.results[0].verdict, Verdict::Inconclusive);
    assert_eq!(small.inconclusive(), 1);
    let full = check(&h.ops, STEP_BUDGET);
    assert!(matches!(
        full.results[0].verdict,
        Verdict::NotLinearizable { .. }
    ));
    assert!(full.results[0].steps > 1_000);
    // Without the impossible read, the same grants linearize at once (in token order).
    h.ops.pop();
    h.describe(Some(16), (2_000, 2_010));
    h.assert_linearizable();
}

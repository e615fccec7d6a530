//! The checker must fail on bad histories: one known-bad input per check, and a good one that
//! passes (so a check that always fails is caught too).

use super::checker::*;
use super::history::{Op, OpKind, Outcome, Target};

fn audit(
    index: u64,
    node: u64,
    ms: i64,
    outcome: &str,
    res: &str,
    token: u64,
    rid: &str,
) -> AuditLine {
    AuditLine {
        unix_ms: ms,
        log_index: index,
        node,
        op: "x".into(),
        outcome: outcome.into(),
        resource: res.into(),
        fencing_token: token,
        holder: String::new(),
        request_id: rid.into(),
        request_digest: String::new(),
    }
}

fn op(index: usize, kind: OpKind, invoke_ms: u64, complete_ms: u64, outcome: Outcome) -> Op {
    Op {
        index,
        process: "w0".into(),
        kind,
        invoke_ms,
        complete_ms: Some(complete_ms),
        outcome: Some(outcome),
    }
}

fn acquire(rid: &str, res: &str, ttl_ms: u64, attempt: u32) -> OpKind {
    OpKind::Acquire {
        resource: res.into(),
        request_id: rid.into(),
        ttl_ms,
        wait_ms: 0,
        attempt,
        via: "node-1".into(),
    }
}

fn granted(lease: &str, token: u64) -> Outcome {
    Outcome::Granted {
        lease_id: lease.into(),
        token,
    }
}

fn write(res: &str, token: u64, value: &str) -> OpKind {
    OpKind::Write {
        target: Target::Http,
        resource: res.into(),
        token,
        value: value.into(),
        bypass: false,
    }
}

fn applied(res: &str, token: u64, value: &str) -> Applied {
    Applied {
        resource: res.into(),
        token,
        value: value.into(),
    }
}

fn ok() -> Outcome {
    Outcome::Done { released: None }
}

/// A small history that keeps every invariant: two leases one after the other, writes applied in
/// token order, a retried acquire with one outcome, liveness within the bound.
fn good() -> CheckInput {
    CheckInput {
        ops: vec![
            op(
                0,
                acquire("a", "r", 1000, 1),
                0,
                10,
                Outcome::Unknown {
                    reason: "timeout".into(),
                },
            ),
            op(1, acquire("a", "r", 1000, 2), 20, 30, granted("L1", 5)),
            op(2, write("r", 5, "v1"), 40, 50, ok()),
            op(
                3,
                OpKind::Release {
                    resource: "r".into(),
                    lease_id: "L1".into(),
                    token: 5,
                },
                60,
                70,
                ok(),
            ),
            op(4, acquire("b", "r", 1000, 1), 65, 80, granted("L2", 6)),
            op(5, write("r", 6, "v2"), 90, 100, ok()),
            op(
                6,
                write("r", 5, "stale"),
                110,
                120,
                Outcome::Fail {
                    reason: "412".into(),
                },
            ),
        ],
        audit: vec![
            audit(3, 1, 1_000, "granted", "r", 5, "a"),
            audit(3, 2, 1_000, "granted", "r", 5, "a"),
            audit(4, 1, 1_060, "released", "r", 5, ""),
            audit(5, 2, 1_070, "granted", "r", 6, "b"),
            audit(7, 2, 2_100, "expired", "r", 6, ""),
        ],
        http_applied: vec![applied("r", 5, "v1"), applied("r", 6, "v2")],
        pg_applied: Some(vec![]),
        liveness: vec![Liveness {
            resource: "r".into(),
            acquired_after_ms: Some(500),
            bound_ms: 1000,
        }],
        availability: None,
        rate_error_pct: 0,
    }
}

fn checks_failing(input: &CheckInput) -> Vec<&'static str> {
    let mut c: Vec<_> = check(input).into_iter().map(|v| v.check).collect();
    c.dedup();
    c
}

#[test]
fn a_good_history_passes() {
    assert_eq!(check(&good()), vec![]);
}

#[test]
fn overlapping_grants_in_the_audit_fail_single_holder() {
    let mut i = good();
    i.audit.retain(|l| l.outcome != "released");
    assert_eq!(checks_failing(&i), vec!["single-holder"]);
}

#[test]
fn early_expiry_fails_single_holder() {
    let mut i = good();
    // Lease 6 (ttl 1000 from table time 1070) expiring at 1500.
    i.audit.last_mut().unwrap().unix_ms = 1_500;
    assert_eq!(checks_failing(&i), vec!["single-holder"]);
}

#[test]
fn a_grant_acknowledged_before_the_previous_holders_deadline_fails_single_holder() {
    let mut i = good();
    // The first holder never released: its own deadline is 0 + 1000; "b" was granted at 80.
    i.ops.retain(|o| !matches!(o.kind, OpKind::Release { .. }));
    i.audit.retain(|l| l.outcome != "released");
    i.audit.insert(2, audit(4, 1, 1_060, "expired", "r", 5, ""));
    let v = check(&i);
    assert!(
        v.iter()
            .any(|v| v.check == "single-holder" && v.detail.contains("own deadline")),
        "{v:?}"
    );
}

#[test]
fn a_lower_token_granted_later_fails_token_monotonic() {
    let mut i = good();
    i.audit[3].fencing_token = 4;
    i.audit[4].fencing_token = 4;
    i.ops[4].outcome = Some(granted("L2", 4));
    i.ops[5].kind = write("r", 4, "v2");
    i.http_applied[1].token = 4;
    assert!(
        checks_failing(&i).contains(&"token-monotonic"),
        "{:?}",
        check(&i)
    );
}

#[test]
fn one_token_for_two_requests_fails_token_monotonic() {
    let mut i = good();
    i.ops.push(op(
        7,
        acquire("c", "q", 1000, 1),
        200,
        210,
        granted("L3", 6),
    ));
    assert!(checks_failing(&i).contains(&"token-monotonic"));
}

#[test]
fn a_stale_write_applied_after_a_newer_one_fails_fence_accept() {
    let mut i = good();
    i.http_applied.push(applied("r", 5, "stale"));
    assert_eq!(checks_failing(&i), vec!["fence-accept"]);
    let mut i = good();
    i.pg_applied = Some(vec![applied("r", 6, "x"), applied("r", 5, "y")]);
    assert_eq!(checks_failing(&i), vec!["fence-accept"]);
}

#[test]
fn an_acknowledged_write_missing_from_the_target_fails_no_lost_write() {
    let mut i = good();
    i.http_applied.remove(1);
    assert_eq!(checks_failing(&i), vec!["no-lost-write"]);
}

#[test]
fn an_unknown_write_missing_from_the_target_is_fine() {
    let mut i = good();
    i.ops.push(op(
        7,
        write("r", 6, "maybe"),
        130,
        140,
        Outcome::Unknown {
            reason: "timeout".into(),
        },
    ));
    assert_eq!(check(&i), vec![]);
}

#[test]
fn two_outcomes_for_one_request_id_fail_request_id_once() {
    let mut i = good();
    i.ops.push(op(
        7,
        acquire("a", "r", 1000, 3),
        130,
        140,
        granted("L9", 9),
    ));
    assert!(checks_failing(&i).contains(&"request-id-once"));
    let mut i = good();
    i.ops.push(op(
        7,
        acquire("a", "r", 1000, 3),
        130,
        140,
        Outcome::Fail {
            reason: "ABORTED".into(),
        },
    ));
    assert!(checks_failing(&i).contains(&"request-id-once"));
    let mut i = good();
    // Granted twice in the log.
    i.audit.push(audit(9, 1, 3_000, "granted", "r", 9, "a"));
    assert!(checks_failing(&i).contains(&"request-id-once"));
}

#[test]
fn a_resource_not_acquired_within_the_bound_fails_liveness() {
    let mut i = good();
    i.liveness[0].acquired_after_ms = None;
    assert_eq!(checks_failing(&i), vec!["liveness"]);
    i.liveness[0].acquired_after_ms = Some(1_001);
    assert_eq!(checks_failing(&i), vec!["liveness"]);
}

#[test]
fn replicas_that_disagree_fail_replica_agreement() {
    let mut i = good();
    i.audit.push(audit(5, 3, 1_070, "granted", "r", 7, "b"));
    assert!(checks_failing(&i).contains(&"replica-agreement"));
}

fn describe_op(index: usize, at_ms: u64, outcome: Outcome) -> Op {
    op(
        index,
        OpKind::Describe {
            resource: "r".into(),
            via: "node-1".into(),
        },
        at_ms.saturating_sub(5),
        at_ms,
        outcome,
    )
}

/// Definite answers every second from 0 to 40 s, except none in 12-30 s; one unknown in the gap.
fn history_with_a_gap() -> Vec<Op> {
    let free = || Outcome::Described {
        held: false,
        token: 0,
        holder: String::new(),
    };
    let mut ops: Vec<Op> = (0..=40)
        .filter(|s| !(13..30).contains(s))
        .enumerate()
        .map(|(i, s)| describe_op(i, s * 1_000, free()))
        .collect();
    ops.push(describe_op(
        ops.len(),
        20_000,
        Outcome::Unknown {
            reason: "Unavailable".into(),
        },
    ));
    ops
}

fn availability(no_quorum: Vec<(u64, u64)>) -> CheckInput {
    CheckInput {
        ops: history_with_a_gap(),
        availability: Some(AvailabilityInput {
            from_ms: 0,
            to_ms: 40_000,
            no_quorum,
        }),
        ..CheckInput::default()
    }
}

#[test]
fn a_long_silence_while_a_quorum_could_exist_fails_availability() {
    let i = availability(vec![]);
    let (v, gap) = check_availability(&i.ops, i.availability.as_ref().unwrap());
    assert_eq!(
        gap,
        Gap {
            from_ms: 12_000,
            len_ms: 18_000
        }
    );
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(checks_failing(&availability(vec![])), vec!["availability"]);
}

#[test]
fn the_same_silence_inside_a_no_quorum_window_is_excused() {
    // No quorum from 12 to 25 s; recovery allowance up to 31 s covers the rest.
    assert_eq!(check(&availability(vec![(12_000, 25_000)])), vec![]);
}

#[test]
fn a_silence_that_outlasts_the_window_and_its_recovery_fails_availability() {
    // The window ends at 13 s: excused until 19 s, then 11 s with no answer.
    let i = availability(vec![(12_000, 13_000)]);
    assert_eq!(checks_failing(&i), vec!["availability"]);
    let (_, gap) = check_availability(&i.ops, i.availability.as_ref().unwrap());
    assert_eq!(gap.from_ms, 13_000 + RECOVERY_MS);
}

#[test]
fn silence_at_the_end_of_the_span_counts_too() {
    // Excused until 31 s, answers until 31 s, then 14 s of silence to the end of the span.
    let mut i = availability(vec![(12_000, 25_000)]);
    i.ops.retain(|o| o.complete_ms.unwrap() <= 31_000);
    i.availability.as_mut().unwrap().to_ms = 45_000;
    assert_eq!(checks_failing(&i), vec!["availability"]);
}

/// A holder took a 3,000 ms lease (sent at 0) and never renewed or released it; another request
/// was granted, acknowledged at `at_ms`.
fn early_takeover(at_ms: u64, rate_error_pct: u64) -> CheckInput {
    CheckInput {
        ops: vec![
            op(0, acquire("a", "r", 3_000, 1), 0, 10, granted("L1", 1)),
            op(
                1,
                acquire("b", "r", 1_000, 1),
                at_ms - 100,
                at_ms,
                granted("L2", 2),
            ),
        ],
        rate_error_pct,
        ..CheckInput::default()
    }
}

#[test]
fn with_rate_faults_a_client_counts_its_ttl_less_the_rate_bound() {
    // 2,900 ms: inside the holder's full ttl, outside ttl less 5 %.
    assert_eq!(
        checks_failing(&early_takeover(2_900, 0)),
        vec!["single-holder"]
    );
    assert_eq!(check(&early_takeover(2_900, 5)), vec![]);
    // 2,800 ms is inside even the reduced lease.
    assert_eq!(
        checks_failing(&early_takeover(2_800, 5)),
        vec!["single-holder"]
    );
}

//! Checks a recorded run against the invariants (ARCHITECTURE.md's catalogue):
//!
//! 1. `single-holder`: no two leases of one resource overlap in the state machine's own view (the
//!    merged audit logs, in log order: granted opens a lease, released/expired/the next grant
//!    closes it; a lease must not expire before its table-clock deadline) nor in real time as the
//!    clients saw it (a grant acknowledged before an earlier holder's own deadline: the holder's
//!    deadline is the time it *sent* the request plus the ttl, as docs/api.md tells clients).
//! 2. `token-monotonic`: fencing tokens strictly increase in grant (log) order, for all resources.
//! 3. `fence-accept`: each protected target never applied a write with a token lower than one it
//!    applied before for that resource.
//! 4. `no-lost-write`: every write a client saw acknowledged is in the target.
//! 5. `request-id-once`: all attempts of one `request_id` got one outcome (same lease and token;
//!    never granted in one attempt and definitely refused in another; granted at most once in the
//!    audit, with the token the client saw).
//! 6. `liveness`: once faults stopped, every resource was acquired within the stated bound.
//!    `availability`: while faults went on, lockd never went [`AVAILABILITY_GAP_MS`] without a
//!    definite answer to some client, except in windows where the nemesis had left no quorum
//!    possible (two of three nodes down, paused, isolated or wiped), each extended by
//!    [`RECOVERY_MS`] for restart and election.
//!
//! With clock *rate* faults, the client-side checks count a lease's ttl less the rate bound
//! ([`with_rate_margin`]): the contract assumes sane rates, and a client keeps that margin.
//!
//! Unknown operations are never assumed to have failed: they constrain nothing here.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::history::{Op, OpKind, Outcome, Target};

/// One line of a node's audit log (`lockd --audit-log`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditLine {
    pub unix_ms: i64,
    pub log_index: u64,
    pub node: u64,
    pub op: String,
    pub outcome: String,
    #[serde(default)]
    pub resource: String,
    #[serde(default)]
    pub fencing_token: u64,
    #[serde(default)]
    pub holder: String,
    /// The request id, recovered by the run from `request_digest` (lockd never writes the id).
    #[serde(default)]
    pub request_id: String,
    /// What lockd writes: a keyed digest of the request id (see `crate::audit`).
    #[serde(default)]
    pub request_digest: String,
}

/// A write the protected target applied, in the target's own order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    pub resource: String,
    pub token: u64,
    pub value: String,
}

/// How long a resource took to become acquirable after the faults stopped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Liveness {
    pub resource: String,
    /// `None`: not acquired within the bound.
    pub acquired_after_ms: Option<u64>,
    pub bound_ms: u64,
}

#[derive(Clone, Debug, Default)]
pub struct CheckInput {
    pub ops: Vec<Op>,
    /// Audit lines of every node (any order; merged by log index).
    pub audit: Vec<AuditLine>,
    pub http_applied: Vec<Applied>,
    /// `None` when the run had no Postgres target.
    pub pg_applied: Option<Vec<Applied>>,
    pub liveness: Vec<Liveness>,
    /// The in-run availability check's input; `None` skips it.
    pub availability: Option<AvailabilityInput>,
    /// The bound on clock rates of the run, percent (0: clocks run at real rate).
    pub rate_error_pct: u64,
}

/// Longest time (ms) lockd may go without a definite answer to any client while a quorum could
/// exist: a leader's failure detected (election timeout 0.6-1.2 s) and an election won, while
/// clients whose attempt went to a node cut off get `UNAVAILABLE` within 5 s and retry elsewhere,
/// with room for a loaded 2-core machine running a debug build.
pub const AVAILABILITY_GAP_MS: u64 = 10_000;
/// Added to the end of every no-quorum window: the node that makes a quorum again starts (or
/// resumes, or is reconnected), an election completes and clients' attempts that were waiting
/// on the outage (up to 5.5 s each) run out and are retried.
pub const RECOVERY_MS: u64 = 6_000;

/// What the availability check needs besides the history.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AvailabilityInput {
    /// The checked span (history ms): from the first fault to when the faults stopped.
    pub from_ms: u64,
    pub to_ms: u64,
    /// Windows (history ms) in which no quorum could exist.
    pub no_quorum: Vec<(u64, u64)>,
}

/// The longest stretch without a definite answer outside the excused windows, ms, and where
/// it began.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gap {
    pub from_ms: u64,
    pub len_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The check's short name (`single-holder`, `token-monotonic`, ...).
    pub check: &'static str,
    pub detail: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}] {}", self.check, self.detail)
    }
}

/// Runs every check; an empty result means the run kept every invariant.
pub fn check(input: &CheckInput) -> Vec<Violation> {
    let mut v = Vec::new();
    let (merged, divergence) = merge_audit(&input.audit);
    v.extend(divergence);
    v.extend(check_audit_single_holder(&merged, &input.ops));
    if input.rate_error_pct > 0 {
        v.extend(check_client_single_holder(&with_rate_margin(
            &input.ops,
            input.rate_error_pct,
        )));
    } else {
        v.extend(check_client_single_holder(&input.ops));
    }
    v.extend(check_token_monotonic(&merged, &input.ops));
    v.extend(check_fence_accept("http", &input.http_applied));
    v.extend(check_no_lost_write(
        Target::Http,
        &input.ops,
        &input.http_applied,
    ));
    if let Some(pg) = &input.pg_applied {
        v.extend(check_fence_accept("postgres", pg));
        v.extend(check_no_lost_write(Target::Postgres, &input.ops, pg));
    }
    v.extend(check_request_id_once(&merged, &input.ops));
    v.extend(check_liveness(&input.liveness));
    if let Some(a) = &input.availability {
        v.extend(check_availability(&input.ops, a).0);
    }
    v
}

/// The history as the client-side checks read it when clocks may run up to `rate_error_pct` %
/// fast: every acquire's ttl is what a client with that safety margin counts on
/// ([`super::clock::rate_margin_ttl_ms`]). The table-clock (audit) check keeps the real ttls: a
/// fast clock moves the table clock itself.
pub fn with_rate_margin(ops: &[Op], rate_error_pct: u64) -> Vec<Op> {
    ops.iter()
        .cloned()
        .map(|mut op| {
            if let OpKind::Acquire { ttl_ms, .. } = &mut op.kind {
                *ttl_ms = super::clock::rate_margin_ttl_ms(*ttl_ms, rate_error_pct);
            }
            op
        })
        .collect()
}

/// Whether `op` is an answer from lockd that settles something: a grant, a renew, a release, a
/// read, or a definite refusal (not `UNAVAILABLE`, not a timeout).
fn definite_lockd_answer(op: &Op) -> bool {
    matches!(
        op.kind,
        OpKind::Acquire { .. }
            | OpKind::Renew { .. }
            | OpKind::Release { .. }
            | OpKind::Describe { .. }
    ) && matches!(
        op.outcome,
        Some(
            Outcome::Granted { .. }
                | Outcome::Done { .. }
                | Outcome::Described { .. }
                | Outcome::Fail { .. }
        )
    )
}

/// `availability`: every stretch of `a`'s span longer than [`AVAILABILITY_GAP_MS`] in which
/// no client got a definite answer and which no no-quorum window (plus [`RECOVERY_MS`]) covers.
/// Also returns the longest such stretch, violation or not.
pub fn check_availability(ops: &[Op], a: &AvailabilityInput) -> (Vec<Violation>, Gap) {
    // Covered spans: each answer an instant, each excused window an interval.
    let mut covered: Vec<(u64, u64)> = ops
        .iter()
        .filter(|o| definite_lockd_answer(o))
        .filter_map(|o| o.complete_ms)
        .map(|t| (t, t))
        .collect();
    covered.extend(
        a.no_quorum
            .iter()
            .map(|(s, e)| (*s, e.saturating_add(RECOVERY_MS))),
    );
    covered.sort_unstable();
    let mut gaps = Vec::new();
    let mut cur = a.from_ms;
    for (s, e) in covered {
        if e < cur {
            continue;
        }
        if s > cur {
            gaps.push((cur, s.min(a.to_ms)));
        }
        cur = cur.max(e);
        if cur >= a.to_ms {
            break;
        }
    }
    if cur < a.to_ms {
        gaps.push((cur, a.to_ms));
    }
    let longest = gaps
        .iter()
        .map(|(s, e)| Gap {
            from_ms: *s,
            len_ms: e.saturating_sub(*s),
        })
        .max_by_key(|g| g.len_ms)
        .unwrap_or_default();
    let violations = gaps
        .iter()
        .filter(|(s, e)| e.saturating_sub(*s) > AVAILABILITY_GAP_MS)
        .map(|(s, e)| Violation {
            check: "availability",
            detail: format!(
                "no client got a definite answer from {s} to {e} ms ({} ms, bound {AVAILABILITY_GAP_MS} ms) while a quorum could exist (no-quorum windows: {:?})",
                e - s,
                a.no_quorum
            ),
        })
        .collect();
    (violations, longest)
}

/// The lock-table events of the audit logs, one list per log index, taken from whichever node
/// wrote that index most completely. Nodes that disagree on an index are reported: replicas must
/// apply the same entries with the same effects.
pub fn merge_audit(lines: &[AuditLine]) -> (BTreeMap<u64, Vec<AuditLine>>, Vec<Violation>) {
    let mut per_node: BTreeMap<(u64, u64), Vec<AuditLine>> = BTreeMap::new();
    for l in lines.iter().filter(|l| l.outcome != "gap") {
        per_node
            .entry((l.log_index, l.node))
            .or_default()
            .push(l.clone());
    }
    let mut merged: BTreeMap<u64, Vec<AuditLine>> = BTreeMap::new();
    let mut violations = Vec::new();
    for ((index, node), events) in per_node {
        match merged.get_mut(&index) {
            None => {
                merged.insert(index, events);
            }
            Some(existing) => {
                let same = |a: &AuditLine, b: &AuditLine| {
                    (
                        &a.op,
                        &a.outcome,
                        &a.resource,
                        a.fencing_token,
                        &a.request_id,
                    ) == (
                        &b.op,
                        &b.outcome,
                        &b.resource,
                        b.fencing_token,
                        &b.request_id,
                    )
                };
                let n = existing.len().min(events.len());
                if (0..n).any(|i| !same(&existing[i], &events[i])) {
                    violations.push(Violation {
                        check: "replica-agreement",
                        detail: format!(
                            "log index {index}: node {node} applied {events:?}, node {} applied {existing:?}",
                            existing[0].node
                        ),
                    });
                } else if events.len() > existing.len() {
                    *existing = events;
                }
            }
        }
    }
    (merged, violations)
}

fn acquire_ttls(ops: &[Op]) -> HashMap<String, u64> {
    ops.iter()
        .filter_map(|op| match &op.kind {
            OpKind::Acquire {
                request_id, ttl_ms, ..
            } => Some((request_id.clone(), *ttl_ms)),
            _ => None,
        })
        .collect()
}

/// Check 1, the state machine's view: per resource, in log order, a grant while another lease is
/// open, a renew/release/expiry of a lease that is not the open one, or an expiry before the
/// lease's deadline on the table's clock (the running maximum of entry stamps).
pub fn check_audit_single_holder(
    merged: &BTreeMap<u64, Vec<AuditLine>>,
    ops: &[Op],
) -> Vec<Violation> {
    struct Open {
        token: u64,
        request_id: String,
        ttl_ms: Option<u64>,
        deadline_ms: Option<i64>,
    }
    let ttls = acquire_ttls(ops);
    let mut open: HashMap<String, Open> = HashMap::new();
    let mut clock = i64::MIN;
    let mut v = Vec::new();
    for (index, events) in merged {
        for e in events {
            clock = clock.max(e.unix_ms);
            let current = open.get(&e.resource);
            match e.outcome.as_str() {
                "granted" => {
                    if let Some(o) = current {
                        v.push(Violation {
                            check: "single-holder",
                            detail: format!(
                                "log index {index}: {:?} granted to request {} (token {}) while token {} (request {}) still held it",
                                e.resource, e.request_id, e.fencing_token, o.token, o.request_id
                            ),
                        });
                    }
                    let ttl_ms = ttls.get(&e.request_id).copied();
                    open.insert(
                        e.resource.clone(),
                        Open {
                            token: e.fencing_token,
                            request_id: e.request_id.clone(),
                            ttl_ms,
                            deadline_ms: ttl_ms.map(|t| clock + t as i64),
                        },
                    );
                }
                "renewed" | "released" | "expired" => {
                    let Some(o) = current.filter(|o| o.token == e.fencing_token) else {
                        v.push(Violation {
                            check: "single-holder",
                            detail: format!(
                                "log index {index}: {} of token {} on {:?}, which is not the current lease (current: {:?})",
                                e.outcome,
                                e.fencing_token,
                                e.resource,
                                current.map(|o| o.token)
                            ),
                        });
                        continue;
                    };
                    if e.outcome == "expired"
                        && let Some(d) = o.deadline_ms.filter(|d| clock < *d)
                    {
                        v.push(Violation {
                                check: "single-holder",
                                detail: format!(
                                    "log index {index}: token {} on {:?} expired at table time {clock}, before its deadline {d} ({} ms early)",
                                    o.token,
                                    e.resource,
                                    d - clock
                                ),
                            });
                    }
                    if e.outcome == "renewed" {
                        let o = open.get_mut(&e.resource).unwrap();
                        if let Some(t) = o.ttl_ms {
                            o.deadline_ms =
                                Some(o.deadline_ms.unwrap_or(i64::MIN).max(clock + t as i64));
                        }
                    } else {
                        open.remove(&e.resource);
                    }
                }
                _ => {}
            }
        }
    }
    v
}

/// A lease as its holder knew it: granted (some attempt of its request returned ok), with the
/// holder's own end: the earliest send time of the request plus the ttl, pushed on by acknowledged
/// renews (send time + ttl), cut short by the first release the holder sent.
#[derive(Debug)]
struct KnownLease {
    resource: String,
    token: u64,
    lease_id: String,
    request_id: String,
    first_sent_ms: u64,
    granted_seen_ms: u64,
    end_ms: u64,
}

fn known_leases(ops: &[Op]) -> Vec<KnownLease> {
    let mut first_sent: HashMap<&str, u64> = HashMap::new();
    let mut ttl: HashMap<&str, u64> = HashMap::new();
    for op in ops {
        if let OpKind::Acquire {
            request_id, ttl_ms, ..
        } = &op.kind
        {
            let e = first_sent
                .entry(request_id.as_str())
                .or_insert(op.invoke_ms);
            *e = (*e).min(op.invoke_ms);
            ttl.insert(request_id.as_str(), *ttl_ms);
        }
    }
    let mut leases: BTreeMap<String, KnownLease> = BTreeMap::new();
    for op in ops {
        if let (
            OpKind::Acquire {
                resource,
                request_id,
                ..
            },
            Some(Outcome::Granted { lease_id, token }),
        ) = (&op.kind, &op.outcome)
        {
            let seen = op.complete_ms.unwrap_or(op.invoke_ms);
            let sent = first_sent[request_id.as_str()];
            let l = leases.entry(lease_id.clone()).or_insert(KnownLease {
                resource: resource.clone(),
                token: *token,
                lease_id: lease_id.clone(),
                request_id: request_id.clone(),
                first_sent_ms: sent,
                granted_seen_ms: seen,
                end_ms: sent + ttl[request_id.as_str()],
            });
            l.granted_seen_ms = l.granted_seen_ms.min(seen);
        }
    }
    let ttl_of_lease: HashMap<String, u64> = leases
        .values()
        .map(|l| (l.lease_id.clone(), ttl[l.request_id.as_str()]))
        .collect();
    let mut release_sent: HashMap<String, u64> = HashMap::new();
    for op in ops {
        match (&op.kind, &op.outcome) {
            (OpKind::Renew { lease_id, .. }, Some(Outcome::Done { .. })) => {
                if let (Some(l), Some(t)) = (leases.get_mut(lease_id), ttl_of_lease.get(lease_id)) {
                    l.end_ms = l.end_ms.max(op.invoke_ms + t);
                }
            }
            (OpKind::Release { lease_id, .. }, _) => {
                let e = release_sent.entry(lease_id.clone()).or_insert(op.invoke_ms);
                *e = (*e).min(op.invoke_ms);
            }
            _ => {}
        }
    }
    for l in leases.values_mut() {
        if let Some(r) = release_sent.get(&l.lease_id) {
            l.end_ms = l.end_ms.min(*r);
        }
    }
    leases.into_values().collect()
}

/// Check 1, the clients' real-time view: a lease acknowledged to its holder before an earlier
/// lease of the same resource (lower token) reached its holder's own end.
pub fn check_client_single_holder(ops: &[Op]) -> Vec<Violation> {
    let mut by_resource: BTreeMap<&str, Vec<&KnownLease>> = BTreeMap::new();
    let leases = known_leases(ops);
    for l in &leases {
        by_resource.entry(&l.resource).or_default().push(l);
    }
    let mut v = Vec::new();
    for (resource, mut ls) in by_resource {
        ls.sort_by_key(|l| l.token);
        let mut latest_end: Option<&KnownLease> = None;
        for l in ls {
            if let Some(prev) = latest_end
                && l.granted_seen_ms < prev.end_ms
            {
                v.push(Violation {
                        check: "single-holder",
                        detail: format!(
                            "{resource:?}: token {} (request {}) was acknowledged at {} ms, while token {} (request {}, sent at {} ms) was still held by its holder's own deadline until {} ms",
                            l.token,
                            l.request_id,
                            l.granted_seen_ms,
                            prev.token,
                            prev.request_id,
                            prev.first_sent_ms,
                            prev.end_ms
                        ),
                    });
            }
            if latest_end.is_none_or(|p| l.end_ms > p.end_ms) {
                latest_end = Some(l);
            }
        }
    }
    v
}

/// Check 2: grant tokens strictly increase in log order (all resources), and two different
/// requests never got the same token.
pub fn check_token_monotonic(merged: &BTreeMap<u64, Vec<AuditLine>>, ops: &[Op]) -> Vec<Violation> {
    let mut v = Vec::new();
    let mut last: Option<(u64, u64, &str)> = None;
    for (index, events) in merged {
        for e in events.iter().filter(|e| e.outcome == "granted") {
            if let Some((li, lt, lr)) = last
                && e.fencing_token <= lt
            {
                v.push(Violation {
                        check: "token-monotonic",
                        detail: format!(
                            "log index {index}: token {} granted to request {} on {:?} after token {lt} (log index {li}, {lr:?})",
                            e.fencing_token, e.request_id, e.resource
                        ),
                    });
            }
            last = Some((*index, e.fencing_token, &e.resource));
        }
    }
    let mut owner: HashMap<u64, &str> = HashMap::new();
    for op in ops {
        if let (OpKind::Acquire { request_id, .. }, Some(Outcome::Granted { token, .. })) =
            (&op.kind, &op.outcome)
        {
            let o = owner.entry(*token).or_insert(request_id.as_str());
            if *o != request_id.as_str() {
                v.push(Violation {
                    check: "token-monotonic",
                    detail: format!(
                        "token {token} was returned to two requests: {o} and {request_id}"
                    ),
                });
            }
        }
    }
    v
}

/// Check 3: per resource, the target's applied tokens never go below one applied before.
pub fn check_fence_accept(target: &str, applied: &[Applied]) -> Vec<Violation> {
    let mut highest: HashMap<&str, (u64, &str)> = HashMap::new();
    let mut v = Vec::new();
    for (i, a) in applied.iter().enumerate() {
        match highest.get(a.resource.as_str()) {
            Some((h, hv)) if a.token < *h => v.push(Violation {
                check: "fence-accept",
                detail: format!(
                    "{target} target, write #{i}: {:?} applied value {:?} with token {} after value {hv:?} with token {h}",
                    a.resource, a.value, a.token
                ),
            }),
            _ => {
                highest.insert(&a.resource, (a.token, &a.value));
            }
        }
    }
    v
}

/// Check 4: every write acknowledged to a client is in the target.
pub fn check_no_lost_write(target: Target, ops: &[Op], applied: &[Applied]) -> Vec<Violation> {
    let present: std::collections::HashSet<(&str, u64, &str)> = applied
        .iter()
        .map(|a| (a.resource.as_str(), a.token, a.value.as_str()))
        .collect();
    let mut v = Vec::new();
    for op in ops {
        if let (
            OpKind::Write {
                target: t,
                resource,
                token,
                value,
                ..
            },
            Some(Outcome::Done { .. }),
        ) = (&op.kind, &op.outcome)
            && *t == target
            && !present.contains(&(resource.as_str(), *token, value.as_str()))
        {
            v.push(Violation {
                    check: "no-lost-write",
                    detail: format!(
                        "{target:?} write {value:?} to {resource:?} with token {token} was acknowledged at {} ms but is not in the target",
                        op.complete_ms.unwrap_or(0)
                    ),
                });
        }
    }
    v
}

/// Check 5: one request id, one outcome.
pub fn check_request_id_once(merged: &BTreeMap<u64, Vec<AuditLine>>, ops: &[Op]) -> Vec<Violation> {
    let mut v = Vec::new();
    let mut granted: BTreeMap<&str, (String, u64)> = BTreeMap::new();
    let mut refused: BTreeMap<&str, String> = BTreeMap::new();
    for op in ops {
        let OpKind::Acquire { request_id, .. } = &op.kind else {
            continue;
        };
        match &op.outcome {
            Some(Outcome::Granted { lease_id, token }) => {
                let g = granted
                    .entry(request_id.as_str())
                    .or_insert((lease_id.clone(), *token));
                if (&g.0, g.1) != (lease_id, *token) {
                    v.push(Violation {
                        check: "request-id-once",
                        detail: format!(
                            "request {request_id} was granted token {} and, on a retry, token {token}",
                            g.1
                        ),
                    });
                }
            }
            Some(Outcome::Fail { reason }) => {
                refused.insert(request_id.as_str(), reason.clone());
            }
            _ => {}
        }
    }
    for (rid, reason) in &refused {
        if let Some((_, token)) = granted.get(rid) {
            v.push(Violation {
                check: "request-id-once",
                detail: format!(
                    "request {rid} was granted token {token} in one attempt and refused ({reason}) in another"
                ),
            });
        }
    }
    let mut audit_grants: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
    for (index, events) in merged {
        for e in events.iter().filter(|e| e.outcome == "granted") {
            audit_grants
                .entry(e.request_id.as_str())
                .or_default()
                .push((*index, e.fencing_token));
        }
    }
    for (rid, grants) in &audit_grants {
        if grants.len() > 1 {
            v.push(Violation {
                check: "request-id-once",
                detail: format!(
                    "request {rid} was granted more than once in the log: (index, token) {grants:?}"
                ),
            });
        }
        if let Some((_, token)) = granted.get(rid)
            && grants.iter().all(|(_, t)| t != token)
        {
            v.push(Violation {
                check: "request-id-once",
                detail: format!(
                    "request {rid}: the client was told token {token}, the log granted {grants:?}"
                ),
            });
        }
        if let Some(reason) = refused.get(rid) {
            v.push(Violation {
                check: "request-id-once",
                detail: format!(
                    "request {rid} was granted in the log ({grants:?}) but the client was told it was refused ({reason})"
                ),
            });
        }
    }
    v
}

/// Check 6.
pub fn check_liveness(results: &[Liveness]) -> Vec<Violation> {
    results
        .iter()
        .filter_map(|l| match l.acquired_after_ms {
            Some(ms) if ms <= l.bound_ms => None,
            other => Some(Violation {
                check: "liveness",
                detail: format!(
                    "{:?} was not acquirable within {} ms after the faults stopped (acquired after: {other:?} ms)",
                    l.resource, l.bound_ms
                ),
            }),
        })
        .collect()
}

//! Linearizability of the lock operations and of `Describe`: is there one order of the recorded
//! operations, consistent with real time (an operation that completed before another was invoked
//! comes first), in which a sequential lock would have answered what the clients saw?
//!
//! The search is Wing & Gong's, with Lowe's memoization as in Knossos and Porcupine (WGL): a
//! depth-first search over "which operations are linearized so far" (a bitset) and the model's
//! state, never visiting one (bitset, state) twice. Resources are independent, so each is checked
//! alone (P-compositionality). The search has a step budget: past it the answer is
//! "inconclusive", never a hang. It does not fix what it finds.
//!
//! # The model, per resource
//!
//! - **State**: free, or held by a lease (known: granted to a client that saw the grant; or
//!   unknown: granted to a request whose every attempt had an unknown outcome), and the highest
//!   token granted so far. A held lease has an *earliest expiry*: the first send time of its
//!   request plus its ttl, pushed on by each acknowledged renew to the renew's send time plus the
//!   ttl. That is the contract's deadline (clients count from their own send time), so a lease
//!   that ends earlier (other than by release) is a violation.
//! - **Expiry** is a step of the model's own, never forced: a lease may expire at any point at or
//!   after its earliest expiry, or stay held (lockd extends leases on failover, and an expired
//!   lease stays visible to `Describe` until a command settles the resource). An expiry placed
//!   before operation X needs every operation after it, X included, to have completed at or after
//!   the earliest expiry: the search allows it when the earliest expiry is at most the smallest
//!   completion time among the operations not yet linearized.
//! - **Acquire** granted (lease L, token t): the resource must be free (after an expiry or
//!   release if needed) and t above every earlier token; L becomes the holder. All attempts of one
//!   `request_id` are one operation: from the first attempt's send to the first attempt that saw
//!   the grant.
//! - **Acquire refused** (`ABORTED` held, `DEADLINE_EXCEEDED` wait timed out): the resource was
//!   held at some point between the request's first send and the refusal (a waiter is queued only
//!   behind a holder). Other refusals (limits, bad arguments) constrain nothing.
//! - **Renew** acknowledged: L is the holder; its earliest expiry moves on. `NOT_FOUND`: L is not
//!   the holder (it may expire or be released first).
//! - **Release** `released: true`: L is the holder, and the resource becomes free.
//!   `released: false`: L is not the holder.
//! - **Describe** held with token t: the holder has token t; free: nobody holds it.
//! - **Unknown outcomes** may or may not have taken effect. An acquire whose attempts all had an
//!   unknown outcome may grant (an unknown lease, token unknown but above every earlier one) at
//!   any point after its first send, with no upper bound in time (a waiter may be granted long
//!   after its caller gave up); a release with an unknown outcome may free its lease at any point
//!   after it was sent; a renew or Describe with an unknown outcome is left out (taking effect
//!   would only constrain more).
//!
//! # Where the search is lazy, and why that loses no linearization
//!
//! Each operation has at most one successor state, so the search branches only over which
//! operation comes next, as in WGL for a deterministic model:
//! - A lease is ended (expiry, or a pending unknown release) only right before an operation that
//!   needs it gone: an ended lease never comes back, and "still held" can always become "ended"
//!   later, since the condition for ending it only gets easier as operations are linearized.
//! - An unknown acquire takes effect only right before an operation that needs the resource held
//!   by someone it cannot otherwise be (a refusal while free, a `Describe` naming a token the
//!   holder does not have). Anywhere else a grant only constrains: it blocks others, raises the
//!   token floor and must expire. Among the candidates it takes the one whose lease may expire
//!   earliest; any linearization using another can swap the two.
//!
//! # Limits
//!
//! - Times are the harness's (invoke before the request is sent, completion after the reply is
//!   read), in whole milliseconds: completions get 1 ms added, invokes are truncated down.
//! - The memo stores a 128-bit fingerprint of (bitset, state), not the pair: a collision (about
//!   n²/2¹²⁹ for n states) could prune a branch and report a false violation.
//! - Unknown acquires constrain nothing until they are needed, and then may be placed anywhere
//!   after their send: refusals are weak evidence in runs with many lost replies.
//! - Fenced writes are not in the model (the fence checks cover them); tokens across resources
//!   are checked by `token-monotonic`, not here.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::{Duration, Instant};

use super::checker::Violation;
use super::history::{Op, OpKind, Outcome};

/// Model steps one resource's search may try before it reports "inconclusive". A correct history
/// needs about one step per operation plus a few per overlap; 2 million is seconds of CPU and,
/// at 16 bytes per memo entry, at most 32 MB.
pub const STEP_BUDGET: u64 = 2_000_000;
/// Added to every recorded completion: times are whole milliseconds, truncated, so the reply may
/// have arrived up to 1 ms after the recorded time.
const COMPLETE_ROUNDING_MS: u64 = 1;
/// The completion time of an operation that may never have taken effect.
const NEVER: u64 = u64::MAX;
/// Pending operations listed in a violation's detail.
const DETAIL_OPS_MAX: usize = 6;

/// What one operation (or all attempts of one acquire request) tells the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Granted to a client that saw it: lease number `lease` in [`Partition::leases`].
    Grant {
        lease: usize,
    },
    /// Refused because the resource was held (or the wait for it ran out).
    Refused,
    RenewOk {
        lease: usize,
    },
    /// A renew answered `NOT_FOUND` or a release answered `released: false`.
    NotCurrent {
        lease: usize,
    },
    ReleaseOk {
        lease: usize,
    },
    DescribeFree,
    DescribeHeld {
        token: u64,
    },
    /// An acquire whose every attempt had an unknown outcome (optional).
    MaybeGrant {
        min_expiry_ms: u64,
    },
    /// A release with an unknown outcome (optional).
    MaybeRelease {
        lease: usize,
    },
}

impl Step {
    fn optional(&self) -> bool {
        matches!(self, Step::MaybeGrant { .. } | Step::MaybeRelease { .. })
    }
}

/// One operation of the model, with its real-time interval.
#[derive(Clone, Debug)]
pub struct Entry {
    pub step: Step,
    pub invoke_ms: u64,
    /// `NEVER` for optional operations (unknown outcome).
    pub complete_ms: u64,
    /// The history operations it stands for (all attempts of one acquire request).
    pub ops: Vec<usize>,
}

/// A lease a client saw granted.
#[derive(Clone, Debug)]
pub struct Lease {
    pub lease_id: String,
    pub token: u64,
    pub ttl_ms: u64,
    /// The first send time of the request that got it.
    pub first_sent_ms: u64,
}

/// The operations on one resource.
#[derive(Clone, Debug, Default)]
pub struct Partition {
    pub resource: String,
    /// Required operations first, sorted by invoke time; then the optional ones.
    pub entries: Vec<Entry>,
    pub leases: Vec<Lease>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Linearizable,
    NotLinearizable {
        detail: String,
    },
    /// The step budget ran out first.
    Inconclusive,
}

#[derive(Clone, Debug)]
pub struct PartitionResult {
    pub resource: String,
    /// Operations that must be linearized (known outcomes).
    pub required: usize,
    /// Operations with unknown outcomes that may be.
    pub optional: usize,
    pub verdict: Verdict,
    pub steps: u64,
    pub elapsed: Duration,
}

/// The linearizability check of one history.
#[derive(Clone, Debug, Default)]
pub struct LinReport {
    pub results: Vec<PartitionResult>,
    pub elapsed: Duration,
    /// History operations left out: renews/releases of a lease no client saw granted, and
    /// unknown renews and Describes (they constrain nothing).
    pub skipped: usize,
}

impl LinReport {
    pub fn violations(&self) -> Vec<Violation> {
        self.results
            .iter()
            .filter_map(|r| match &r.verdict {
                Verdict::NotLinearizable { detail } => Some(Violation {
                    check: "linearizable",
                    detail: detail.clone(),
                }),
                _ => None,
            })
            .collect()
    }

    pub fn count(&self, f: impl Fn(&Verdict) -> bool) -> usize {
        self.results.iter().filter(|r| f(&r.verdict)).count()
    }

    pub fn inconclusive(&self) -> usize {
        self.count(|v| *v == Verdict::Inconclusive)
    }

    pub fn not_linearizable(&self) -> usize {
        self.count(|v| matches!(v, Verdict::NotLinearizable { .. }))
    }

    pub fn operations(&self) -> usize {
        self.results.iter().map(|r| r.required + r.optional).sum()
    }

    pub fn steps(&self) -> u64 {
        self.results.iter().map(|r| r.steps).sum()
    }

    pub fn summary(&self) -> String {
        format!(
            "linearizability: {} resources, {} lock operations ({} skipped), {} steps in {} ms: {} linearizable, {} not, {} inconclusive",
            self.results.len(),
            self.operations(),
            self.skipped,
            self.steps(),
            self.elapsed.as_millis(),
            self.count(|v| *v == Verdict::Linearizable),
            self.not_linearizable(),
            self.inconclusive()
        )
    }
}

/// Checks every resource of `ops` with at most `budget` steps each.
pub fn check(ops: &[Op], budget: u64) -> LinReport {
    let started = Instant::now();
    let (partitions, skipped) = partitions(ops);
    let results = partitions
        .iter()
        .map(|p| check_partition(p, budget))
        .collect();
    LinReport {
        results,
        elapsed: started.elapsed(),
        skipped,
    }
}

fn refusal_means_held(reason: &str) -> bool {
    reason.starts_with("Aborted") || reason.starts_with("DeadlineExceeded")
}

/// Splits a history into one partition per resource; returns how many operations were left out.
pub fn partitions(ops: &[Op]) -> (Vec<Partition>, usize) {
    let mut parts: BTreeMap<String, Partition> = BTreeMap::new();
    let mut skipped = 0;
    // All attempts of one request are one operation.
    let mut requests: BTreeMap<(&str, &str), Vec<&Op>> = BTreeMap::new();
    for op in ops {
        if let OpKind::Acquire {
            resource,
            request_id,
            ..
        } = &op.kind
        {
            requests
                .entry((resource.as_str(), request_id.as_str()))
                .or_default()
                .push(op);
        }
    }
    let mut lease_index: HashMap<(String, String), usize> = HashMap::new();
    for ((resource, _), attempts) in &requests {
        let p = parts
            .entry(resource.to_string())
            .or_insert_with(|| Partition {
                resource: resource.to_string(),
                ..Partition::default()
            });
        let OpKind::Acquire { ttl_ms, .. } = &attempts[0].kind else {
            unreachable!("grouped acquires")
        };
        let first_sent_ms = attempts.iter().map(|o| o.invoke_ms).min().unwrap_or(0);
        let indices: Vec<usize> = attempts.iter().map(|o| o.index).collect();
        let outcome = |o: &&Op| {
            o.outcome.clone().unwrap_or(Outcome::Unknown {
                reason: "never completed".into(),
            })
        };
        let complete = |o: &&Op| o.complete_ms.unwrap_or(o.invoke_ms) + COMPLETE_ROUNDING_MS;
        let granted = attempts
            .iter()
            .filter_map(|o| match outcome(o) {
                Outcome::Granted { lease_id, token } => Some((complete(o), lease_id, token)),
                _ => None,
            })
            .min_by_key(|(c, _, _)| *c);
        if let Some((complete_ms, lease_id, token)) = granted {
            let lease = p.leases.len();
            p.leases.push(Lease {
                lease_id: lease_id.clone(),
                token,
                ttl_ms: *ttl_ms,
                first_sent_ms,
            });
            lease_index.insert((resource.to_string(), lease_id), lease);
            p.entries.push(Entry {
                step: Step::Grant { lease },
                invoke_ms: first_sent_ms,
                complete_ms,
                ops: indices,
            });
            continue;
        }
        let refused = attempts
            .iter()
            .filter(
                |o| matches!(outcome(o), Outcome::Fail { reason } if refusal_means_held(&reason)),
            )
            .map(complete)
            .min();
        if let Some(complete_ms) = refused {
            p.entries.push(Entry {
                step: Step::Refused,
                invoke_ms: first_sent_ms,
                complete_ms,
                ops: indices,
            });
        } else if attempts
            .iter()
            .all(|o| matches!(outcome(o), Outcome::Unknown { .. }))
        {
            p.entries.push(Entry {
                step: Step::MaybeGrant {
                    min_expiry_ms: first_sent_ms + ttl_ms,
                },
                invoke_ms: first_sent_ms,
                complete_ms: NEVER,
                ops: indices,
            });
        } else {
            // Refused for another reason (a limit, a bad argument): not granted, nothing learnt.
            skipped += attempts.len();
        }
    }

    for op in ops {
        let (resource, step) = match (&op.kind, &op.outcome) {
            (
                OpKind::Renew {
                    resource, lease_id, ..
                },
                Some(o),
            )
            | (
                OpKind::Release {
                    resource, lease_id, ..
                },
                Some(o),
            ) => {
                let Some(&lease) = lease_index.get(&(resource.clone(), lease_id.clone())) else {
                    skipped += 1;
                    continue;
                };
                let renew = matches!(op.kind, OpKind::Renew { .. });
                let step = match o {
                    Outcome::Done { .. } if renew => Step::RenewOk { lease },
                    Outcome::Fail { reason } if renew && reason.starts_with("NotFound") => {
                        Step::NotCurrent { lease }
                    }
                    Outcome::Done {
                        released: Some(true),
                    } => Step::ReleaseOk { lease },
                    Outcome::Done {
                        released: Some(false),
                    } => Step::NotCurrent { lease },
                    Outcome::Unknown { .. } if !renew => Step::MaybeRelease { lease },
                    _ => {
                        skipped += 1;
                        continue;
                    }
                };
                (resource, step)
            }
            (OpKind::Describe { resource, .. }, Some(Outcome::Described { held, token, .. })) => {
                let step = if *held {
                    Step::DescribeHeld { token: *token }
                } else {
                    Step::DescribeFree
                };
                (resource, step)
            }
            (OpKind::Describe { .. }, _) => {
                skipped += 1;
                continue;
            }
            _ => continue,
        };
        let optional = step.optional();
        let p = parts.entry(resource.clone()).or_insert_with(|| Partition {
            resource: resource.clone(),
            ..Partition::default()
        });
        p.entries.push(Entry {
            step,
            invoke_ms: op.invoke_ms,
            complete_ms: if optional {
                NEVER
            } else {
                op.complete_ms.unwrap_or(op.invoke_ms) + COMPLETE_ROUNDING_MS
            },
            ops: vec![op.index],
        });
    }
    for p in parts.values_mut() {
        p.entries
            .sort_by_key(|e| (e.step.optional(), e.invoke_ms, e.complete_ms));
    }
    (parts.into_values().collect(), skipped)
}

/// Who holds the resource in the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Holder {
    Free,
    Known {
        lease: u32,
        min_expiry_ms: u64,
    },
    /// Granted to an acquire with an unknown outcome; its token is learnt from a `Describe`.
    Unknown {
        token: Option<u64>,
        min_expiry_ms: u64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Model {
    holder: Holder,
    /// The highest token granted so far (for an unknown grant: the least it can be).
    last_token: u64,
}

#[derive(Clone, Debug)]
struct Node {
    /// Bit i: entry i is linearized (or, for an optional one, used or moot).
    done: Vec<u64>,
    model: Model,
    required_done: usize,
}

impl Node {
    fn has(&self, i: usize) -> bool {
        self.done[i / 64] & (1 << (i % 64)) != 0
    }

    fn set(&mut self, i: usize) {
        self.done[i / 64] |= 1 << (i % 64);
    }

    fn fingerprint(&self) -> u128 {
        let h = |salt: u8| {
            let mut s = DefaultHasher::new();
            salt.hash(&mut s);
            self.done.hash(&mut s);
            self.model.hash(&mut s);
            s.finish()
        };
        (u128::from(h(0)) << 64) | u128::from(h(1))
    }
}

/// A partition prepared for the search.
struct Search<'a> {
    p: &'a Partition,
    /// Entries `0..required` must be linearized; they are sorted by invoke time.
    required: usize,
    /// Optional acquires, earliest possible expiry first.
    maybe_grants: Vec<usize>,
    /// Optional releases of each lease.
    maybe_releases: Vec<Vec<usize>>,
}

impl<'a> Search<'a> {
    fn new(p: &'a Partition) -> Search<'a> {
        let required = p.entries.iter().take_while(|e| !e.step.optional()).count();
        let mut maybe_grants: Vec<usize> = (required..p.entries.len())
            .filter(|&i| matches!(p.entries[i].step, Step::MaybeGrant { .. }))
            .collect();
        maybe_grants.sort_by_key(|&i| match p.entries[i].step {
            Step::MaybeGrant { min_expiry_ms } => min_expiry_ms,
            _ => unreachable!(),
        });
        let mut maybe_releases = vec![Vec::new(); p.leases.len()];
        for i in required..p.entries.len() {
            if let Step::MaybeRelease { lease } = p.entries[i].step {
                maybe_releases[lease].push(i);
            }
        }
        Search {
            p,
            required,
            maybe_grants,
            maybe_releases,
        }
    }

    fn root(&self) -> Node {
        Node {
            done: vec![0; self.p.entries.len().div_ceil(64).max(1)],
            model: Model {
                holder: Holder::Free,
                last_token: 0,
            },
            required_done: 0,
        }
    }

    /// The smallest completion time among required operations not yet linearized, and those
    /// that may come next (invoked by then), earliest completion first.
    fn frontier(&self, n: &Node) -> (u64, Vec<usize>) {
        let e = &self.p.entries;
        let first = (0..self.required).find(|&i| !n.has(i));
        let Some(first) = first else {
            return (NEVER, Vec::new());
        };
        let mut m = NEVER;
        for (i, entry) in e.iter().enumerate().take(self.required).skip(first) {
            if entry.invoke_ms > m {
                break;
            }
            if !n.has(i) {
                m = m.min(entry.complete_ms);
            }
        }
        let mut next: Vec<usize> = (first..self.required)
            .take_while(|&i| e[i].invoke_ms <= m)
            .filter(|&i| !n.has(i))
            .collect();
        next.sort_by_key(|&i| (e[i].complete_ms, i));
        (m, next)
    }

    /// Ends the holder's lease before an operation that needs it gone, if the model allows it
    /// now (`m`: the smallest completion among pending operations).
    fn free(&self, n: &mut Node, m: u64) -> Option<()> {
        match n.model.holder {
            Holder::Free => {}
            Holder::Known {
                lease,
                min_expiry_ms,
            } => {
                let releases = &self.maybe_releases[lease as usize];
                let released = releases
                    .iter()
                    .any(|&i| !n.has(i) && self.p.entries[i].invoke_ms <= m);
                if !released && min_expiry_ms > m {
                    return None;
                }
                // The lease never comes back: its other unknown releases are moot.
                for &i in releases {
                    n.set(i);
                }
            }
            Holder::Unknown { min_expiry_ms, .. } => {
                if min_expiry_ms > m {
                    return None;
                }
            }
        }
        n.model.holder = Holder::Free;
        Some(())
    }

    /// Lets an unknown acquire take effect now (the resource is free): the candidate whose lease
    /// may expire earliest.
    fn unknown_grant(&self, n: &mut Node, m: u64, token: Option<u64>) -> Option<()> {
        let &i = self
            .maybe_grants
            .iter()
            .find(|&&i| !n.has(i) && self.p.entries[i].invoke_ms <= m)?;
        let Step::MaybeGrant { min_expiry_ms } = self.p.entries[i].step else {
            unreachable!()
        };
        n.set(i);
        n.model.last_token = token.unwrap_or(n.model.last_token + 1);
        n.model.holder = Holder::Unknown {
            token,
            min_expiry_ms,
        };
        Some(())
    }

    /// The state after linearizing entry `x` next, if the model allows it.
    fn apply(&self, node: &Node, x: usize, m: u64) -> Option<Node> {
        let mut n = node.clone();
        n.set(x);
        n.required_done += 1;
        let entry = &self.p.entries[x];
        let leases = &self.p.leases;
        let is =
            |h: Holder, l: usize| matches!(h, Holder::Known { lease, .. } if lease as usize == l);
        match entry.step {
            Step::Grant { lease } => {
                self.free(&mut n, m)?;
                let l = &leases[lease];
                if l.token <= n.model.last_token {
                    return None;
                }
                n.model.last_token = l.token;
                n.model.holder = Holder::Known {
                    lease: lease as u32,
                    min_expiry_ms: l.first_sent_ms + l.ttl_ms,
                };
            }
            Step::Refused => {
                if n.model.holder == Holder::Free {
                    self.unknown_grant(&mut n, m, None)?;
                }
            }
            Step::RenewOk { lease } => match &mut n.model.holder {
                Holder::Known {
                    lease: l,
                    min_expiry_ms,
                } if *l as usize == lease => {
                    *min_expiry_ms = (*min_expiry_ms).max(entry.invoke_ms + leases[lease].ttl_ms);
                }
                _ => return None,
            },
            Step::NotCurrent { lease } => {
                if is(n.model.holder, lease) {
                    self.free(&mut n, m)?;
                }
            }
            Step::ReleaseOk { lease } => {
                if !is(n.model.holder, lease) {
                    return None;
                }
                for &i in &self.maybe_releases[lease] {
                    n.set(i);
                }
                n.model.holder = Holder::Free;
            }
            Step::DescribeFree => self.free(&mut n, m)?,
            Step::DescribeHeld { token } => match n.model.holder {
                Holder::Known { lease, .. } if leases[lease as usize].token == token => {}
                Holder::Unknown { token: Some(t), .. } if t == token => {}
                Holder::Unknown {
                    token: None,
                    min_expiry_ms,
                } if token >= n.model.last_token => {
                    n.model.holder = Holder::Unknown {
                        token: Some(token),
                        min_expiry_ms,
                    };
                    n.model.last_token = token;
                }
                _ => {
                    self.free(&mut n, m)?;
                    if token <= n.model.last_token {
                        return None;
                    }
                    self.unknown_grant(&mut n, m, Some(token))?;
                }
            },
            Step::MaybeGrant { .. } | Step::MaybeRelease { .. } => {
                unreachable!("optional operations are used by the steps above")
            }
        }
        Some(n)
    }

    fn describe(&self, i: usize) -> String {
        let e = &self.p.entries[i];
        let what = match &e.step {
            Step::Grant { lease } => {
                let l = &self.p.leases[*lease];
                format!(
                    "acquire granted token {} (lease {}, ttl {} ms)",
                    l.token,
                    short(&l.lease_id),
                    l.ttl_ms
                )
            }
            Step::Refused => "acquire refused (held)".to_owned(),
            Step::RenewOk { lease } => format!("renew ok of token {}", self.p.leases[*lease].token),
            Step::NotCurrent { lease } => format!(
                "renew/release said token {} is not current",
                self.p.leases[*lease].token
            ),
            Step::ReleaseOk { lease } => {
                format!("release ok of token {}", self.p.leases[*lease].token)
            }
            Step::DescribeFree => "describe: free".to_owned(),
            Step::DescribeHeld { token } => format!("describe: held with token {token}"),
            Step::MaybeGrant { .. } => "acquire, outcome unknown".to_owned(),
            Step::MaybeRelease { lease } => format!(
                "release of token {}, outcome unknown",
                self.p.leases[*lease].token
            ),
        };
        let end = if e.complete_ms == NEVER {
            "?".to_owned()
        } else {
            (e.complete_ms - COMPLETE_ROUNDING_MS).to_string()
        };
        format!(
            "{what} [{}..{end} ms, history ops {:?}]",
            e.invoke_ms, e.ops
        )
    }

    fn describe_model(&self, m: &Model) -> String {
        let holder = match m.holder {
            Holder::Free => "free".to_owned(),
            Holder::Known {
                lease,
                min_expiry_ms,
            } => format!(
                "held by token {} (may expire from {min_expiry_ms} ms)",
                self.p.leases[lease as usize].token
            ),
            Holder::Unknown {
                token,
                min_expiry_ms,
            } => format!(
                "held by an acquire with unknown outcome, token {token:?} (may expire from {min_expiry_ms} ms)"
            ),
        };
        format!("{holder}, last token {}", m.last_token)
    }
}

fn short(lease_id: &str) -> &str {
    &lease_id[..lease_id.len().min(8)]
}

/// Searches one partition for a linearization.
pub fn check_partition(p: &Partition, budget: u64) -> PartitionResult {
    let started = Instant::now();
    let s = Search::new(p);
    let mut steps = 0u64;
    let mut seen: HashSet<u128> = HashSet::new();
    let root = s.root();
    // The deepest node reached, for the report of a violation.
    let mut deepest = root.clone();
    // Each frame: the successors of one node still to try.
    let mut stack: Vec<(Vec<Node>, usize)> = Vec::new();
    let expand = |n: &Node| -> Vec<Node> {
        let (m, next) = s.frontier(n);
        next.into_iter().filter_map(|x| s.apply(n, x, m)).collect()
    };
    let verdict = if s.required == 0 {
        Verdict::Linearizable
    } else {
        seen.insert(root.fingerprint());
        stack.push((expand(&root), 0));
        loop {
            let Some((succs, next)) = stack.last_mut() else {
                break Verdict::NotLinearizable {
                    detail: stuck_detail(&s, &deepest),
                };
            };
            let Some(n) = succs.get(*next).cloned() else {
                stack.pop();
                continue;
            };
            *next += 1;
            steps += 1;
            if steps > budget {
                break Verdict::Inconclusive;
            }
            if !seen.insert(n.fingerprint()) {
                continue;
            }
            if n.required_done > deepest.required_done {
                deepest = n.clone();
            }
            if n.required_done == s.required {
                break Verdict::Linearizable;
            }
            let succs = expand(&n);
            stack.push((succs, 0));
        }
    };
    PartitionResult {
        resource: p.resource.clone(),
        required: s.required,
        optional: p.entries.len() - s.required,
        verdict,
        steps,
        elapsed: started.elapsed(),
    }
}

fn stuck_detail(s: &Search, deepest: &Node) -> String {
    let (_, next) = s.frontier(deepest);
    let listed: Vec<String> = next
        .iter()
        .take(DETAIL_OPS_MAX)
        .map(|&i| s.describe(i))
        .collect();
    format!(
        "{:?} is not linearizable: the longest order found explains {} of its {} operations, then the model is {} and none of these can come next: {}{}",
        s.p.resource,
        deepest.required_done,
        s.required,
        s.describe_model(&deepest.model),
        listed.join("; "),
        if next.len() > DETAIL_OPS_MAX {
            format!(" (and {} more)", next.len() - DETAIL_OPS_MAX)
        } else {
            String::new()
        }
    )
}

//! The recorded history of a chaos run: every operation a client or the nemesis started, with the
//! time it was invoked, the time it completed and its outcome: ok, fail (definitely not done) or
//! unknown (timed out or lost: it may or may not have happened, and the checker treats it so).
//! The invoke/complete pairs of Acquire, Renew, Release and Describe are what the
//! linearizability check (`linearizable.rs`) orders.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// Which protected target a fenced write went to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Target {
    /// The in-process HTTP register behind `fence-proxy http`.
    Http,
    /// The Postgres table behind `fence-proxy postgres`.
    Postgres,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OpKind {
    /// One attempt of an `Acquire`; retries of one request carry the same `request_id`.
    Acquire {
        resource: String,
        request_id: String,
        ttl_ms: u64,
        wait_ms: u64,
        attempt: u32,
        /// The endpoint this attempt went to (a node, or the reply-dropping relay of a node).
        via: String,
    },
    Renew {
        resource: String,
        lease_id: String,
        token: u64,
    },
    Release {
        resource: String,
        lease_id: String,
        token: u64,
    },
    /// A `Describe` of the resource (a linearizable read on the leader).
    Describe { resource: String, via: String },
    /// A fenced write of `value` with `token`; `bypass` means it skipped the fence on purpose
    /// (the deliberately broken mode).
    Write {
        target: Target,
        resource: String,
        token: u64,
        value: String,
        bypass: bool,
    },
    /// A fault the nemesis injected or lifted (for reading a history, not for checking).
    Nemesis { action: String },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Acquire granted.
    Granted { lease_id: String, token: u64 },
    /// Renew, release (with its `released` flag) or write done.
    Done { released: Option<bool> },
    /// What a `Describe` answered (`token` is 0 when not held).
    Described {
        held: bool,
        token: u64,
        holder: String,
    },
    /// Definitely not done; the reason names the status (`ABORTED`, `412`, `55P03`, ...).
    Fail { reason: String },
    /// May or may not have happened.
    Unknown { reason: String },
}

impl Outcome {
    pub fn is_ok(&self) -> bool {
        matches!(
            self,
            Outcome::Granted { .. } | Outcome::Done { .. } | Outcome::Described { .. }
        )
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Op {
    pub index: usize,
    /// Worker number, or a name for the nemesis and the liveness probe.
    pub process: String,
    pub kind: OpKind,
    /// Milliseconds since the run started, on the harness's monotonic clock.
    pub invoke_ms: u64,
    pub complete_ms: Option<u64>,
    /// `None` until completed; an op still open at the end of the run is unknown.
    pub outcome: Option<Outcome>,
}

/// A history shared by all workers of a run.
#[derive(Clone)]
pub struct History {
    start: Instant,
    ops: Arc<Mutex<Vec<Op>>>,
}

impl History {
    pub fn new(start: Instant) -> History {
        History {
            start,
            ops: Arc::new(Mutex::new(Vec::new())),
        }
    }

    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Records an invocation; returns its index for [`History::complete`].
    pub fn invoke(&self, process: impl Into<String>, kind: OpKind) -> usize {
        let now = self.now_ms();
        let mut ops = self.ops.lock().unwrap();
        let index = ops.len();
        ops.push(Op {
            index,
            process: process.into(),
            kind,
            invoke_ms: now,
            complete_ms: None,
            outcome: None,
        });
        index
    }

    pub fn complete(&self, index: usize, outcome: Outcome) {
        let now = self.now_ms();
        let mut ops = self.ops.lock().unwrap();
        ops[index].complete_ms = Some(now);
        ops[index].outcome = Some(outcome);
    }

    pub fn note(&self, process: &str, action: impl Into<String>) {
        let i = self.invoke(
            process,
            OpKind::Nemesis {
                action: action.into(),
            },
        );
        self.complete(i, Outcome::Done { released: None });
    }

    /// A copy of the operations; ops never completed become unknown.
    pub fn snapshot(&self) -> Vec<Op> {
        let mut ops = self.ops.lock().unwrap().clone();
        for op in &mut ops {
            if op.outcome.is_none() {
                op.outcome = Some(Outcome::Unknown {
                    reason: "never completed".into(),
                });
            }
        }
        ops
    }
}

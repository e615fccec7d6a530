//! Fault-injection verification: real `lockd` processes, `fence-proxy` and protected targets
//! under a seeded nemesis (crashes, pauses, partitions, lost replies, clock jumps, stalled
//! clients, and with `--composed` several of them at once), optionally with wrong clocks made by
//! libfaketime or (`--netns`) with each node in a network namespace of its own and partitions,
//! one-way cuts, loss, delay and reordering made in the kernel's packet path, with a recorded
//! history checked against the invariants. See
//! docs/verification.md.
//!
//! It does not fix what it finds: a violation is reported with its seed and a rerun command.
//!
//! # Layout
//! - [`relay`]: fault-injecting TCP relay (blackhole by source IP, drop replies).
//! - [`cluster`]: three nodes wired through relays; `fence-proxy http` start-up; the windows in
//!   which no quorum could exist.
//! - [`netns`]: network namespaces for the nodes, and the faults made in them.
//! - [`netem`]: loss, delay and reordering of frames in user space (this kernel has no netem).
//! - [`clock`]: wall-clock offsets and clock rates with libfaketime.
//! - [`register`]: the protected HTTP register and a minimal HTTP client.
//! - [`history`]: the recorded history (invoke, ok, fail, unknown).
//! - [`workload`]: the seeded client workers.
//! - [`nemesis`]: the seeded fault schedule.
//! - [`checker`]: the invariant checks.
//! - [`linearizable`]: the lock operations and `Describe` against a sequential lock (WGL search).
//! - [`run`]: one run from start to verdict.
//! - [`soak`]: many seeded runs, some at once, with a summary file that accumulates.

pub mod checker;
pub mod clock;
pub mod cluster;
pub mod history;
pub mod linearizable;
pub mod nemesis;
pub mod netem;
pub mod netns;
pub mod register;
pub mod relay;
pub mod run;
pub mod soak;
pub mod workload;

#[cfg(test)]
mod checker_tests;
#[cfg(test)]
mod linearizable_tests;

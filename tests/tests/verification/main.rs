//! Verification by fault injection and generated adversaries: seeded runs of lockd and
//! fence-proxy under faults, each checked against the invariants, and broken modes that prove the
//! checks are not blind. docs/verification.md has the long forms and their results.
//!
//! # Layout
//! - `chaos`: lockd, both front ends of fence-proxy and concurrent clients under a seeded nemesis
//!   (kills, pauses, partitions, wiped nodes, wrong clocks); histories checked for the invariants
//!   and linearizability.
//! - `fence_gen`: the adversarial session generator against the Postgres front end.
//! - `fence_faults`: fence-proxy under killed proxies, shared stores, Postgres restarts and
//!   misbehaving HTTP upstreams.
//! - `disk_faults`: lockd on a FUSE layer that loses unsynced writes, fails fsyncs and fills up.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test, with its message"
)]

mod chaos;
mod disk_faults;
mod fence_faults;
mod fence_gen;

/// The long seeded runs start several processes each (lockd nodes, proxies, a FUSE layer) on a
/// two-core machine, and some of their checks measure availability: they take turns, so that a
/// check measures lockd and not a neighbouring run. An async mutex: a failed test releases it.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

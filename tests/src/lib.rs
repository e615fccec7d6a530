//! Test harness for the integration suites under `tests/tests/`: it starts the real binaries
//! (`lockd`, `lockctl`, `fence-proxy`) on loopback and stops them by PID, also when a test fails.
//!
//! It deliberately contains no assertions about lockd's behaviour; the suites do.
//!
//! # Layout
//! - [`audit`]: the audit key test clusters use and the request digests it yields.
//! - [`chaos`]: fault-injection runs (relays, network namespaces, nemesis, workload, history
//!   checker).
//! - [`cluster`]: a real multi-process lockd cluster that tests can kill, pause and wipe.
//! - [`diskfault`]: a FUSE layer under a node's data dir that drops unsynced writes on a simulated
//!   power loss, fails fsyncs and fills the disk; and the runs that check lockd under it.
//! - [`fleet`]: a cluster of named members (test-only DNS names) that grows, shrinks and moves.
//! - [`process`]: locating built binaries and owning child processes.
//! - [`http_upstream`]: an in-process HTTP upstream that logs every request it applied, in order.
//! - [`fencegen`]: the adversarial session generator for the Postgres front end (`fence-gen`).
//! - [`fencefaults`]: fence-proxy under faults (killed proxies, shared stores, Postgres
//!   restarts, misbehaving HTTP upstreams), checked for stale or lost writes (`fence-faults`).
//! - [`fence_proxy`]: `fence-proxy http` as a child process, and an HTTP client for it.
//! - [`poll`]: waiting for a condition, instead of a fixed sleep, before an assert.
//! - [`previous`]: the `lockd` of an earlier commit, built from git history, for the rolling
//!   upgrade test.
//! - [`skip`]: how a test that cannot run on this machine says why (and [`skip_without_postgres`]).
//! - [`pg`]: the local Postgres, an in-process fence-proxy Postgres front end, psql, a private
//!   password-protected cluster.

#![allow(
    clippy::unwrap_used,
    reason = "test support: a failed unwrap fails the test that called it, with its location"
)]
#![allow(
    missing_docs,
    reason = "test support for the suites in this crate, not an API: its items are read where they are used"
)]

pub mod audit;
pub mod chaos;
pub mod cluster;
pub mod diskfault;
pub mod fence_proxy;
pub mod fencefaults;
pub mod fencegen;
pub mod fleet;
pub mod http_upstream;
pub mod pg;
pub mod poll;
pub mod previous;
pub mod process;
pub mod skip;
pub mod tls;

/// Returns from the calling test when the shared Postgres is unreachable, after reporting the
/// test as skipped with how to start Postgres; under CI (env `CI` set) it fails the test
/// instead. The first line of every test that needs Postgres (see [`pg::available`]).
#[macro_export]
macro_rules! skip_without_postgres {
    () => {
        if !$crate::pg::available() {
            return;
        }
    };
}

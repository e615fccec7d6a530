//! Tests that cannot run on this machine say why where a reader of `cargo test` sees it, then
//! return. Only what a developer's machine may lack is skipped this way (the local Postgres, FUSE,
//! network namespaces); under CI (env `CI` set) a missing Postgres fails instead of skipping
//! ([`crate::pg::available`]), so CI never passes by skipping the fence-proxy suites.

use std::io::Write;

/// Prints `SKIPPED <test>: <why>` on the process's stderr, past the test harness's output
/// capture (which only takes `print!` and `eprint!`), so that the line shows in a plain
/// `cargo test` run and not only with `--nocapture`.
pub fn report(why: &str) {
    // The test harness names each test's thread after the test.
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test");
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

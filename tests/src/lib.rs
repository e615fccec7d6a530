//! Test harness for the integration suites under `tests/tests/`: it starts the real binaries
//! (`lockd`, `lockctl`, `fence-proxy`) on loopback and stops them by PID, also when a test fails.
//!
//! It deliberately contains no assertions about lockd's behaviour; the suites do.
//!
//! # Layout
//! - [`cluster`]: a real multi-process lockd cluster that tests can kill, pause and wipe.
//! - [`process`]: locating built binaries and owning child processes.
//! - [`pg`]: the local Postgres, an in-process fence-proxy Postgres front end, psql, a private
//!   password-protected cluster.

pub mod cluster;
pub mod pg;
pub mod process;

//! Test harness for the integration suites under `tests/tests/`: it starts the real binaries
//! (`lockd`, `lockctl`, `fence-proxy`) on loopback and stops them by PID, also when a test fails.
//!
//! It deliberately contains no assertions about lockd's behaviour; the suites do.
//!
//! # Layout
//! - [`process`]: locating built binaries and owning child processes.

pub mod process;

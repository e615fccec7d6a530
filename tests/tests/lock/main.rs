//! The lock API against a real three-node cluster, as a client sees it.
//!
//! # Layout
//! - `basic`: grants, renewals, releases, expiry, validation and the order of fencing tokens.
//! - `wait`: waiting for a lock: FIFO order, one wake-up per release, cancellation, timeouts,
//!   limits and retries across a leader change.
//! - `wait_bounds`: what parked waiting calls may hold: places per source and per node, and
//!   the follower's connections to the leader.
//! - `error_reasons`: the machine-readable reason every error status carries.
//! - `reflection`: gRPC server reflection lists the public services.
//! - `config_file`: nodes configured by `--config` TOML files; flags and env win over them.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test, with its message"
)]

mod basic;
mod config_file;
mod error_reasons;
mod reflection;
mod wait;
mod wait_bounds;
